"""Plot bench_qkv.py's JSON: µs per layer against the tokens per call M, one panel per (weight format, heads),
with the fused op (two-kernel design), cuBLAS's GEMM alone, the best Triton GEMM and the bandwidth limit
(weight bytes / copy bandwidth) as lines. Needs matplotlib (pip install -e '.[plot]').

    python benchmarks/plot_qkv.py qkv.json benchmarks/qkv.png
"""

from __future__ import annotations

import argparse
import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

OP = "flint fused op, two-kernel design (norm, qkv, q/k norm, RoPE, KV write)"
# (row key, legend label, colour, line style, marker, line width)
LINES = [
    ("two_kernel", OP, "#c0392b", "-", "o", 2.6),
    ("cublas", "cuBLAS GEMM alone (torch.matmul)", "#2e86c1", "-", "s", 1.8),
    ("triton", "Triton GEMM alone (best of its sweep)", "#27ae60", "-", "^", 1.8),
    ("limit", "bandwidth limit: weight bytes / copy bandwidth", "#555555", "--", "", 1.4),
]
FORMAT_NAMES = {"bf16": "BF16 weights", "nvfp4": "NVFP4 weights"}


def _value(row: dict, key: str) -> float:
    v = row.get(key)
    return math.nan if v is None else float(v)


def make_figure(data: dict):
    """The figure for bench_qkv.py's JSON object (its 'rows', 'copy_bw', 'commit', 'device')."""
    rows = data.get("rows") or []
    if not rows:
        raise ValueError("the JSON has no rows: write it with benchmarks/bench_qkv.py --json FILE")
    fmts = [f for f in FORMAT_NAMES if any(r["fmt"] == f for r in rows)]
    fmts += sorted({r["fmt"] for r in rows} - set(fmts))
    heads = list(dict.fromkeys(tuple(r["heads"]) for r in rows))  # in the run's order
    ms = sorted({r["M"] for r in rows})
    top = max(_value(r, k) for r in rows for k, *_ in LINES if not math.isnan(_value(r, k)))
    with plt.rc_context({"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11}):
        size = (4.6 * len(heads) + 0.6, 3.6 * len(fmts) + 1.4)
        fig, axes = plt.subplots(len(fmts), len(heads), figsize=size, sharex=True, sharey=True, squeeze=False,
                                 layout="constrained")  # fmt: skip
        for fi, fmt in enumerate(fmts):
            for hi, hd in enumerate(heads):
                ax = axes[fi][hi]
                sel = [r for r in rows if r["fmt"] == fmt and tuple(r["heads"]) == hd]
                sel.sort(key=lambda r: r["M"])
                if not sel:
                    ax.set_axis_off()
                    continue
                x = [r["M"] for r in sel]
                for key, label, colour, ls, marker, lw in LINES:
                    ys = [_value(r, key) for r in sel]
                    if all(math.isnan(y) for y in ys):
                        continue
                    ax.plot(x, ys, ls, color=colour, marker=marker, lw=lw, ms=5, label=label, zorder=3)
                lim = _value(sel[-1], "limit")
                if not math.isnan(lim):
                    ax.annotate(f"{lim:.2f} µs", (x[-1], lim), xytext=(0, 4), textcoords="offset points",
                                ha="right", va="bottom", color="#555555", fontsize=9)  # fmt: skip
                ax.set_title(f"{FORMAT_NAMES.get(fmt, fmt)}, {hd[0]} q / {hd[1]} kv heads")
                if fmt != "bf16":  # torch has no NVFP4 GEMM on sm_90a
                    ax.text(0.03, 0.96, "cuBLAS and Triton: BF16 weights", transform=ax.transAxes, fontsize=9,
                            color="#555555", style="italic", va="top")  # fmt: skip
                ax.grid(True, which="major", alpha=0.3)
                if hi == 0:
                    ax.set_ylabel("µs per layer (lower is better)")
                if fi == len(fmts) - 1:
                    ax.set_xlabel("tokens per call (M)")
        ax0 = axes[0][0]
        ax0.set_xscale("log", base=2)
        ax0.xaxis.set_major_locator(FixedLocator(ms))
        ax0.xaxis.set_minor_locator(NullLocator())
        ax0.set_xticklabels([str(m) for m in ms])
        ax0.set_xlim(ms[0] / 1.25, ms[-1] * 1.25)
        ax0.set_ylim(0, top * 1.12)
        handles = {}
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
        order = [lab for _, lab, *_ in LINES if lab in handles]
        fig.legend([handles[lab] for lab in order], order, loc="outside lower center", ncol=2, frameon=False)
        device = data.get("device") or "GPU"
        fig.suptitle(f"Fused qkv op against a plain GEMM, {device}: copy bandwidth "
                     f"{data['copy_bw'] / 1e12:.2f} TB/s, commit {data.get('commit', 'unknown')}\n"
                     "(CUDA graph of many layers with distinct weights, L2 defeated; median per layer)",
                     fontsize=13)  # fmt: skip
    return fig


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="bench_qkv.py --json output")
    ap.add_argument("png", help="the image to write")
    a = ap.parse_args(argv)
    with open(a.json) as f:
        fig = make_figure(json.load(f))
    fig.savefig(a.png, dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    main()

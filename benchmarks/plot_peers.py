"""Plot bench_peers.py's JSON: time per layer vs M, one panel per (heads, weights), one line per
implementation, the bandwidth limit drawn. Needs matplotlib (pip install -e '.[plot]').

    python benchmarks/plot_peers.py peers.json benchmarks/peers.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LINES = [
    ("fused", "flint fused (PDL)", "-", "o"),
    ("fused_no_pdl", "flint fused, no PDL", "--", "o"),
    ("unfused_ours", "flint unfused (3 kernels)", "-", "s"),
    ("torch_eager", "torch eager (dense bf16)", "-", "^"),
    ("torch_compile", "torch.compile (dense bf16)", "-", "v"),
    ("cublas_gemv", "cuBLAS BF16 GEMV alone", ":", "x"),
    ("limit", "weight bytes / copy bandwidth", "-.", ""),
]


def main(src, dst):
    data = json.load(open(src))
    rows = data["rows"]
    panels = sorted({(tuple(r["heads"]), r["fmt"]) for r in rows}, key=lambda p: (p[1], -p[0][0], -p[0][1]))
    fmts = sorted({p[1] for p in panels})
    ncol = max(sum(1 for p in panels if p[1] == f) for f in fmts)
    fig, axes = plt.subplots(len(fmts), ncol, figsize=(5 * ncol, 4 * len(fmts)), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for fi, fmt in enumerate(fmts):
        for ci, (hd, _) in enumerate(p for p in panels if p[1] == fmt):
            ax = axes[fi][ci]
            ax.set_visible(True)
            sel = [r for r in rows if tuple(r["heads"]) == hd and r["fmt"] == fmt]
            sel.sort(key=lambda r: r["M"])
            ms = [r["M"] for r in sel]
            for key, label, ls, mk in LINES:
                ys = [r.get(key) for r in sel]
                if all(y is not None for y in ys):
                    ax.plot(ms, ys, ls, marker=mk, label=label)
            ax.set_title(f"heads {hd}, {fmt} weights")
            ax.set_xlabel("M (tokens)")
            ax.set_ylabel("µs per layer (log scale)")
            ax.set_xticks(ms)
            ax.set_yscale("log")
            ax.set_yticks([1, 2, 4, 8, 16, 32, 64, 128])
            ax.get_yaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"H200, per layer under CUDA-graph replay (copy BW {data['copy_bw'] / 1e12:.2f} TB/s)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""benchmarks/bench_qkv.py's derived numbers and Markdown table, and benchmarks/plot_qkv.py's figure drawn
from a JSON of bench_qkv's schema (synthetic rows, on the CPU; the plot tests skip without matplotlib)."""

import json
import math

import pytest

from benchmarks import bench_qkv as bq

BW = 4.0e12
HEADS = ((32, 4), (16, 2))
MS = (1, 8, 16, 32, 64)
OP_MAX = 16  # the synthetic op has no rows above this M (the loader refused them)


def _op(hd, fmt, m):  # distinct per panel and M, so that a panel or point drawn from the wrong row shows
    return 3 + hd[0] / 10 + hd[1] / 100 + (fmt == "bf16") + m / 64


def _rows():
    rows = []
    for hd in HEADS:
        n = (hd[0] + 2 * hd[1]) * bq.D
        for fmt in ("bf16", "nvfp4"):
            for m in MS:
                wb = bq.weight_bytes(fmt, n)
                r = {"heads": list(hd), "fmt": fmt, "M": m, "layers": bq.layer_count(wb), "weight_bytes": wb,
                     "cublas": 8 + hd[1] / 10 + m / 1000, "triton": 7 + hd[1] / 10 + m / 50,
                     "triton_config": "n64-k128-s4-split2"}  # fmt: skip
                if m <= OP_MAX:
                    r["two_kernel"] = _op(hd, fmt, m)
                rows.append(bq.finish_row(r, BW, "abc1234"))
    return rows


def test_finish_row_derives_limit_share_and_ratios():
    rows = _rows()
    for r in rows:
        assert r["limit"] == pytest.approx(r["weight_bytes"] / BW * 1e6)
        assert r["copy_bw"] == BW and r["commit"] == "abc1234"
        if r["M"] <= OP_MAX:
            op = _op(tuple(r["heads"]), r["fmt"], r["M"])
            assert r["pct_copy_bw"] == pytest.approx(100 * r["limit"] / op)
            assert r["op_over_cublas"] == pytest.approx(op / r["cublas"])
            assert r["op_over_triton"] == pytest.approx(op / r["triton"])
        else:
            assert r["pct_copy_bw"] is r["op_over_cublas"] is r["op_over_triton"] is None
    assert rows[0]["weight_bytes"] == 5120 * 2048 * 2 and rows[5]["weight_bytes"] == 5120 * (1024 + 128)


def test_markdown_has_a_line_per_row_and_only_measured_columns():
    rows = _rows()
    text = bq.markdown(rows, BW, "abc1234", [], "build/flint")
    lines = [ln for ln in text.splitlines() if ln.startswith("| (")]
    assert len(lines) == len(rows)
    header = next(ln for ln in text.splitlines() if ln.startswith("| heads"))
    assert "cuBLAS GEMM" in header and "Triton GEMM" in header and "op / Triton" in header
    assert "prologue" not in header and "FP8" not in header and "GEMV" not in header  # not measured here
    assert "torch has no NVFP4 GEMM on sm_90a" in text and "commit abc1234" in text and "4.00 TB/s" in text
    ncol = header.count("|")
    assert all(ln.count("|") == ncol for ln in lines)
    m32 = next(ln for ln, r in zip(lines, rows, strict=True) if r["M"] == 32)
    m1 = lines[0].split(" | ")
    assert m32.split(" | ")[header.split(" | ").index("two-kernel µs/layer (the op)")] == "–"
    assert m1[header.split(" | ").index("two-kernel µs/layer (the op)")] == f"{_op((32, 4), 'bf16', 1):.2f}"


@pytest.fixture
def plot_qkv():
    pytest.importorskip("matplotlib")
    from benchmarks import plot_qkv

    return plot_qkv


def test_plot_renders_a_panel_per_heads_and_format(plot_qkv, tmp_path):
    import matplotlib.pyplot as plt

    data = {"commit": "abc1234", "copy_bw": BW, "device": "NVIDIA H200", "rows": _rows()}
    src, png = tmp_path / "qkv.json", tmp_path / "qkv.png"
    src.write_text(json.dumps(data))
    plot_qkv.main([str(src), str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000

    fig = plot_qkv.make_figure(data)
    try:
        assert "abc1234" in fig._suptitle.get_text() and "4.00 TB/s" in fig._suptitle.get_text()
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert len(legend) == 4 and "two-kernel" in legend[0] and "cuBLAS" in legend[1]
        assert "Triton" in legend[2] and "limit" in legend[3]
        axes = [ax for ax in fig.axes if ax.get_visible() and ax.lines]
        assert len(axes) == 4
        names = {"two_kernel": "two-kernel", "cublas": "cuBLAS", "triton": "Triton", "limit": "limit"}
        seen = set()
        for ax in axes:
            title = ax.get_title()
            fmt = "bf16" if title.startswith("BF16") else "nvfp4"
            hd = next(h for h in HEADS if f"{h[0]} q / {h[1]} kv" in title)
            seen.add((hd, fmt))
            sel = [r for r in data["rows"] if tuple(r["heads"]) == hd and r["fmt"] == fmt]
            assert [int(t) for t in ax.get_xticks()] == list(MS) and ax.get_xscale() == "log"
            assert ax.get_ylim()[0] == 0
            for key in ("two_kernel", "cublas", "triton", "limit"):
                (line,) = [ln for ln in ax.lines if names[key] in ln.get_label()]  # (its label names it)
                want = [math.nan if r.get(key) is None else r[key] for r in sel]
                got = list(line.get_ydata())
                assert list(line.get_xdata()) == list(MS)
                assert len(got) == len(want)
                for w, g in zip(want, got, strict=True):
                    assert (math.isnan(w) and math.isnan(g)) or w == pytest.approx(g), (hd, fmt, key)
        assert len(seen) == 4
    finally:
        plt.close(fig)


def test_plot_refuses_a_json_without_rows(plot_qkv):
    with pytest.raises(ValueError, match="bench_qkv.py --json"):
        plot_qkv.make_figure({"copy_bw": BW, "rows": []})

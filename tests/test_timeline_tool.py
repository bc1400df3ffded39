"""tools/timeline.py reads the kernels' named trace points (flint_aot/kernels/trace.py), compiled in by a
diagnostic build only: no text of the kernels is patched, so a refactor cannot break the tool. With the DSL,
the instrumented kernels compile and read the global timer once per point where the tool expects it, and
the same kernels without the diagnostics read it nowhere; the tool's analysis of the stamps runs here on
stamps whose answer is known."""

import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, needs_dsl

sys.path.insert(0, str(ROOT / "tools"))
import timeline  # noqa: E402

from flint_aot.kernels import trace_layout as P  # noqa: E402


def test_the_tool_patches_no_kernel_text():
    src = (ROOT / "tools" / "timeline.py").read_text()
    assert "PATCHES" not in src and "read_text" not in src and "flint_aot/kernels/qkv" not in src
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "timeline.py")], capture_output=True, text=True)
    assert r.returncode != 0 and "flint-aot build configs/timeline.yaml" in r.stderr  # its usage


def _stamps(m, layers=10, ctas=16, gap=3000, span=5000):
    """Synthetic stamps of `layers` layers of `ctas` CTAs (two clusters), layer i's first wait-return at
    i * (span + gap) and its last store span ns later; the norm kernel between them."""
    tq = np.zeros((layers, ctas, P.QKV_WORDS), dtype=np.int64)
    tn = np.zeros((layers, 64, P.NORM_WORDS), dtype=np.int64)
    groups = -(-m // 8)
    for i in range(layers):
        t0 = 1000 + i * (span + gap)
        for c in range(ctas):
            w = t0 + 10 * (c % 8)  # the cluster's wait-returns 0..70 ns apart
            tq[i, c, [P.START, P.WEIGHTS_IN, P.WAIT_RETURNED, P.X_IN]] = [w - 2000, w - 500, w, w + 400]
            tq[i, c, P.GEMV_DONE] = w + 1400
            tq[i, c, P.EXCHANGED] = w + 2000
            tq[i, c, P.STORED] = t0 + span - (c % 3)  # the last store at t0 + span
            for g in range(groups):
                tq[i, c, P.GROUP_X_IN + g] = w + 400 + 500 * g
                tq[i, c, P.GROUP_DONE + g] = w + 600 + 500 * g
        tn[i, :m, P.NORM_WAITED] = t0 - gap + 700
        tn[i, :m, P.NORM_REDUCED] = t0 - gap + 1000
        tn[i, :m, P.NORM_STORED] = t0 - 900
    return (tq % (1 << 32)).astype(np.int32), tn.astype(np.int32)


@pytest.mark.parametrize("m", [1, 24])
def test_the_analysis_reads_the_stamps(m):
    tq, tn = _stamps(m)
    r = timeline.summarize(tq, tn, m, "separate", 1, 0, tq.shape[0])
    assert r["span (first wait-return to last store)"] == 5000
    assert r["gap (last store to next first wait-return)"] == 3000
    assert r["cluster wait-return skew (max - min within a cluster)"] == 70
    assert r["CTA start to weights in"] == 1500
    assert r["norm: wait-return after the last qkv store"] == 700
    assert r["norm: reduced to stores issued"] == 3000 - 1000 - 900
    if m > 8:  # 3 groups 500 ns apart, each's MMAs 200 ns after its x
        assert r["per further group (median over CTAs)"] == 500
        assert r["per further group: its x in to its MMAs done"] == 200
        assert r["per further group: previous MMAs done to its x in"] == 300
        assert r["GEMV (GEMV_DONE - X_IN)"] == 200 + 500 * 2
    else:
        assert r["GEMV (GEMV_DONE - X_IN)"] == 1000 and r["q/k exchange (EXCHANGED - GEMV_DONE)"] == 600


def test_the_timeline_stamps_survive_the_wrap_of_the_timer():
    tq, tn = _stamps(1)
    shift = (1 << 32) - 7000  # %globaltimer_lo wraps inside the graph
    r0 = timeline.summarize(tq, tn, 1, "separate", 1, 0, tq.shape[0])
    w = lambda a: ((a.astype(np.int64) + shift) % (1 << 32)).astype(np.uint32).view(np.int32)  # noqa: E731
    assert timeline.summarize(w(tq), w(tn), 1, "separate", 1, 0, tq.shape[0]) == r0


@needs_dsl
@pytest.mark.parametrize("tile", [8, 64])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_instrumented_kernels_compile_and_read_the_timer(tmp_path, fmt, tile):
    from flint_aot.kernels import kernel_class
    from flint_aot.kernels.diagnostics import Diagnostics
    from loader import abi
    from tests.test_sass import _sass

    on = Diagnostics(timeline=True)
    spec = abi.qkv_spec(fmt, True, 16, 2, "bf16", "separate", tile)
    q = kernel_class("qkv")(spec, "sm_90a", on).compile("sm_90a", "flint_t")
    n = kernel_class("norm")(abi.norm_spec(True), "sm_90a", on).compile("sm_90a", "flint_n")
    assert [p[0] for p in n.params][-1] == "trace" and [p[0] for p in q.params][-1] == "qk_eps"
    qs, ns = _sass(q.cubin, tmp_path), _sass(n.cubin, tmp_path)
    # START..STORED; the token stream (no GEMV_DONE: its groups' ends instead) reads, in its group loop, each
    # group's x-in moment and MMAs' end, and in its epilogue loop EXCHANGED and STORED
    timers = 7
    if tile == 64:  # the wgmma fours (straight-line): START .. WAIT_RETURNED, EXCHANGED, STORED; X_IN and 8
        # reads in each four (group 4 h's x in and MMAs' end, the pass's three x-in and three ends); 2 in each
        # of its mma.sync loops (the groups after one pass, and the fewer-group path)
        timers = 5 + (1 + 8 + 8) + 2 + 2
    assert sum("SR_GLOBALTIMERLO" in ln for ln in qs) == timers
    assert sum("SR_GLOBALTIMERLO" in ln for ln in ns) == 4
    assert not any("STL" in ln or "LDL" in ln for ln in qs + ns)
    off = kernel_class("qkv")(spec, "sm_90a").compile("sm_90a", "flint_t")  # a serving build: no points
    assert not any("SR_GLOBALTIMERLO" in ln for ln in _sass(off.cubin, tmp_path)) and off.cubin != q.cubin

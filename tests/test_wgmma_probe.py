"""The wgmma research probe (benchmarks/wgmma_probe, BENCHMARKS.md §2 step 9) compiles to the schedules its
measurements describe: with 255 registers (2 CTAs per SM) the wgmma of a pass are issued back to back and
waited for once; with 168 (3 CTAs per SM, the token stream's budget) ptxas serializes them from N = 16 on
(a wait after every wgmma), and N = 8 still fits, as do N = 16 and 32 when a quarter or half of the A
fragments are read from shared memory (the hybrid modes). If a new DSL or ptxas changes any of it, the probe's
numbers in BENCHMARKS.md are stale: rerun it."""

import sys

import pytest

from tests.conftest import ROOT, needs_dsl
from tests.test_sass import _sass

pytestmark = needs_dsl


def _probe(mode, ctas, tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks" / "wgmma_probe"))
    try:
        from probe_kernel import WgmmaProbe
    finally:
        sys.path.pop(0)
    k = WgmmaProbe({"mode": mode, "ctas": ctas})
    c = k.compile("sm_90a", "flint_probe", grid=("GRID_X", "GRID_Y", "GRID_Z"))
    return _sass(c.cubin, tmp_path)


def _waits_between_wgmma(sass):
    """Waits (WARPGROUP.DEPBAR) that follow a wgmma before the next one: 0 when a pass is issued at once."""
    n, seen = 0, False
    for line in sass:
        if "HGMMA" in line:
            seen = True
        elif "WARPGROUP.DEPBAR" in line and seen:
            n, seen = n + 1, False
    return n


@pytest.mark.parametrize(("mode", "ctas", "hgmma", "serialized"), [
    ("wg8", 3, "HGMMA.64x8x16.F32.BF16", False),
    ("wg16", 2, "HGMMA.64x16x16.F32.BF16", False),
    ("wg16", 3, "HGMMA.64x16x16.F32.BF16", True),
    ("h16q", 3, "HGMMA.64x16x16.F32.BF16", False),
    ("h32h", 3, "HGMMA.64x32x16.F32.BF16", False),
])  # fmt: skip
def test_probe_schedule(mode, ctas, hgmma, serialized, tmp_path):
    s = _probe(mode, ctas, tmp_path)
    n = sum(hgmma in line for line in s)
    assert n and n % 32 == 0, f"{mode}: {n} x {hgmma}"  # 16 blocks x 2 chains a pass
    waits = _waits_between_wgmma(s)
    passes = n // 32
    assert (waits >= n - passes) if serialized else (waits == passes), (mode, ctas, n, waits)


def test_probe_mma_mode_is_the_stream_sequence(tmp_path):
    s = _probe("mma", 3, tmp_path)
    assert sum("HMMA.16816.F32.BF16" in line for line in s) % 32 == 0
    assert not any("HGMMA" in line for line in s)

"""tools/timeline.py instruments a copy of the kernels by text anchors: a kernel edit that moves an anchor
must fail here, not on the GPU machine. With the DSL, the instrumented kernels must also compile and read
the global timer where the tool says."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import needs_dsl

ROOT = Path(__file__).resolve().parents[1]


def _instrument(tmp_path) -> Path:
    dst = tmp_path / "tl"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "timeline.py"), "instrument", str(dst)],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return dst


def test_every_anchor_is_found_once(tmp_path):
    dst = _instrument(tmp_path)
    qkv = (dst / "flint_aot/kernels/qkv.py").read_text()
    norm = (dst / "flint_aot/kernels/norm.py").read_text()
    assert all(f"v_scale + (cta * 32 + {i})" in qkv for i in (0, 1, 7))  # T0, T1 and the SM id
    assert all(f"v_scale + (t.cta * 32 + {i})" in qkv for i in range(2, 7))  # T2..T6
    assert "v_scale + (t.cta * 32 + 8 + i)" in qkv  # the token stream's groups' MMA ends
    assert "v_scale + (t.cta * 32 + 16 + i)" in qkv  # and the moments their x was in
    assert all(f"trace + (row * 8 + {i}) * 2" in norm for i in (1, 2, 3, 7))
    assert "TRACE_CB(st" in (dst / "flint_aot/kernels/gemv_core.py").read_text()
    assert "debug" not in (dst / "configs/timeline.yaml").read_text()  # no serving keys changed
    # the repository's own kernels are untouched
    assert "_tl_store" not in (ROOT / "flint_aot/kernels/qkv.py").read_text()


@needs_dsl
@pytest.mark.parametrize("tile", [8, 64])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_instrumented_kernels_compile_and_read_the_timer(tmp_path, fmt, tile):
    from tests.test_sass import _sass

    dst = _instrument(tmp_path)
    code = (
        "import sys; from loader import abi; from flint_aot.kernels import qkv, norm\n"
        f"spec = abi.qkv_spec('{fmt}', True, 16, 2, 'bf16', 'separate', {tile})\n"
        "c = qkv.KERNEL(spec).compile('sm_90a', 'flint_t')\n"
        "n = norm.KERNEL(abi.norm_spec(True)).compile('sm_90a', 'flint_n')\n"
        "open('q.cubin', 'wb').write(c.cubin); open('n.cubin', 'wb').write(n.cubin)\n"
        "print([p[0] for p in n.params])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=dst, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "'trace'" in r.stdout  # the norm kernel's extra parameter
    q = _sass((dst / "q.cubin").read_bytes(), tmp_path)
    n = _sass((dst / "n.cubin").read_bytes(), tmp_path)
    # T0..T6; the token stream (no T4: its groups' ends instead) reads, in its group loop, each group's x-in
    # moment and MMAs' end, and in its epilogue loop T5 and T6 (the last group's sums in, its stores issued)
    timers = 7 if tile == 8 else 8
    if tile == 64:  # the wgmma stream (straight-line fours): T0-T2, T5, T6; T3 and 8
        # reads in each four (group 4 h's x in and MMAs' end, the pass's three x-in and three ends); 2 in each
        # of its mma.sync loops (the groups after one pass, and the fewer-group path)
        timers = 5 + (1 + 8 + 8) + 2 + 2
    assert sum("SR_GLOBALTIMERLO" in ln for ln in q) == timers
    assert sum("SR_GLOBALTIMERLO" in ln for ln in n) == 4
    assert not any("STL" in ln or "LDL" in ln for ln in q + n)

"""benchmarks/triton_gemm.py (bench_qkv.py's Triton peer) computes y = x @ W^T for every sweep config and
token count, run on the CPU by Triton's interpreter: against a float64 reference, every element bounded,
y's padding poisoned and left untouched. float16, not bfloat16: the interpreter's tl.dot multiplies
bfloat16's raw bits (triton 3.9); bench_qkv.py checks the bfloat16 runs on the GPU before timing them.

TRITON_INTERPRET must be set before triton is first imported (its standard library is decorated then), so
the cases run in one fresh interpreter: `python tests/test_triton_gemm_cpu.py CASE ...`. Skipped without
triton.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
MS = (1, 5, 16, 33, 64)
N, K = 104, 512  # N: a partial last row block for both block sizes; K: a multiple of every block_k * split_k


def _bound(x, w):
    """The float64 reference and a bound per element: the float16 rounding of the result (2^-11 relative,
    doubled) and the fp32 accumulation over K (relative to sum |x| |w|)."""
    ref = x.double() @ w.double().t()
    return ref, ref.abs() * 2.0**-10 + (x.double().abs() @ w.double().abs().t()) * 1e-5


def case_m(tg, m: int):
    g = torch.Generator().manual_seed(m)
    # x and y are views into wider buffers (strides != widths); the buffers' extra rows and columns are
    # poisoned padding that must stay untouched
    x = torch.randn(m, K + 64, generator=g).half()[:, :K]
    w = (torch.randn(N, K, generator=g) * 0.05).half()
    ref, bound = _bound(x, w)
    assert ref.abs().max() > 0.5  # a real signal, not rounding noise
    for cfg in tg.CONFIGS:
        yb = torch.full((m + 1, N + 8), float("nan"), dtype=torch.float16)
        y = yb[:m, :N]
        assert tg.gemm(x, w, y, cfg).data_ptr() == y.data_ptr()
        bad = ~((y.double() - ref).abs() <= bound)  # (NaN: unwritten, fails)
        assert not bad.any(), f"{cfg}, M={m}: {int(bad.sum())} off, first {bad.nonzero()[0].tolist()}"
        assert yb[m].isnan().all() and yb[:, N:].isnan().all(), f"{cfg}, M={m}: wrote outside y"


def case_workspace(tg):
    """A split-K workspace holding garbage (a previous call's sums) gives the same result as a fresh one."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, K, generator=g).half(), (torch.randn(N, K, generator=g) * 0.05).half()
    ref, bound = _bound(x, w)
    for cfg in (c for c in tg.CONFIGS if c.split_k > 1):
        y = torch.full((3, N), float("nan"), dtype=torch.float16)
        tg.gemm(x, w, y, cfg, workspace=torch.full((3, N), 1e3))
        assert ((y.double() - ref).abs() <= bound).all(), str(cfg)


def case_bad_arguments(tg):
    import pytest

    cfg = tg.CONFIGS[0]
    x, w, y = torch.zeros(2, K).half(), torch.zeros(N, K).half(), torch.zeros(2, N).half()
    with pytest.raises(TypeError, match="x and w"):
        tg.gemm(x, w.bfloat16(), y, cfg)
    with pytest.raises(ValueError, match=r"y \[M, N\]"):
        tg.gemm(x, w, y[:1], cfg)
    with pytest.raises(ValueError, match="multiple of block_k"):
        tg.gemm(x[:, :384], w[:, :384], y, tg.Config(64, 256, 3, 1))
    with pytest.raises(ValueError, match="workspace"):
        tg.gemm(x, w, y, tg.Config(64, 128, 4, 2), workspace=torch.zeros(2, N).half())
    assert [tg.token_block(m) for m in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]


CASES = [f"m={m}" for m in MS] + ["workspace", "bad_arguments"]


@pytest.fixture(scope="module")
def results():
    """Every case run once in one fresh interpreter (TRITON_INTERPRET=1): case -> 'ok' or the failure.
    Triton before 3.9 (the H200 machine's 3.6) has an interpreter that cannot run the kernel ("only
    0-dimensional arrays can be converted to Python scalars"): skipped there; bench_qkv.py checks every
    config on the GPU."""
    triton = pytest.importorskip("triton")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"triton {triton.__version__}: its interpreter cannot run the kernel (3.9 can)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, __file__, *CASES], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    out = dict(ln[5:].split(": ", 1) for ln in r.stdout.splitlines() if ln.startswith("CASE "))
    assert r.returncode == 0 and len(out) == len(CASES), r.stdout[-2000:] + r.stderr[-4000:]
    return out


@pytest.mark.parametrize("m", MS)
def test_every_config_matches_float64_and_writes_only_y(results, m):
    assert results[f"m={m}"] == "ok"


def test_split_k_workspace_is_zeroed_first(results):
    assert results["workspace"] == "ok"


def test_bad_arguments_are_named(results):
    assert results["bad_arguments"] == "ok"


if __name__ == "__main__":
    import traceback

    assert os.environ.get("TRITON_INTERPRET") == "1"
    from benchmarks import triton_gemm

    for arg in sys.argv[1:]:
        try:
            if arg.startswith("m="):
                case_m(triton_gemm, int(arg[2:]))
            else:
                globals()[f"case_{arg}"](triton_gemm)
            print(f"CASE {arg}: ok", flush=True)
        except Exception as e:  # reported per case; the others still run
            traceback.print_exc()
            print(f"CASE {arg}: {type(e).__name__}: {e}".replace("\n", " "), flush=True)

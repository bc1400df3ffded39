"""The example plugin kernel (examples/custom_kernel: SiLU-and-mul) on the GPU, from the bundle built with
examples/custom_kernel/flint_plus.yaml ($FLINT_PLUS_BUNDLE, else build/flint_plus): every element within one
bf16 rounding of the float64 value at M = 1, 16 and 64, eagerly and replayed from a CUDA graph, nothing
written past M; under torch.compile; from 8 threads with a stream each; on a second device. And
loader.launch_kernel running a built-in kernel gives the op's bits."""

import os
import sys
import threading

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.gpu

BOUND = 2.0**-8 + 1e-5  # one bf16 rounding (unit roundoff 2^-8) of a value the fp32 math has within 1e-5
FLOOR = 1e-37  # what fp32 may flush to zero


@pytest.fixture(scope="module")
def plus(gpu_bundle):
    """The flint_plus bundle made current for this module (the suite's bundle again afterwards), and the
    example's serve module (which imports neither the DSL nor the kernel module)."""
    import loader

    path = os.environ.get("FLINT_PLUS_BUNDLE") or str(ROOT / "build" / "flint_plus")
    if not os.path.isdir(path):
        pytest.fail(f"no bundle at {path}: build it on the build machine (flint-aot build "
                    "examples/custom_kernel/flint_plus.yaml -o build/flint_plus) and bring it")  # fmt: skip
    sys.path.insert(0, str(ROOT / "examples" / "custom_kernel"))
    import silu_mul_op

    b = loader.load_bundle(path)
    try:
        yield b, silu_mul_op
    finally:
        loader.load_bundle(gpu_bundle.path)


def _sizes(b) -> list[int]:
    return sorted({e.spec["intermediate"] for e in b.manifest.kernels if e.kind == "silu_mul"})


def _x(m, i, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(m, 2 * i, generator=g, device=device) * 3).bfloat16()  # the curve and both tails


def _check(x, buf):
    """buf[:M] within the bound of the float64 value, every element; buf[M:] still NaN."""
    m = x.shape[0]
    g, u = x.double().chunk(2, dim=1)
    ref = g / (1 + torch.exp(-g)) * u
    out = buf[:m].double()
    assert torch.isfinite(out).all()
    excess = (out - ref).abs() - (ref.abs() * BOUND + FLOOR)
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} elements beyond one bf16 rounding"
    assert buf[m:].isnan().all(), "written past M"


def _poisoned(m, i, device="cuda"):
    return torch.full((m + 2, i), float("nan"), dtype=torch.bfloat16, device=device)


@pytest.mark.parametrize("m", [1, 16, 64])
def test_silu_mul_eager_and_in_a_cuda_graph(plus, m):
    b, op = plus
    assert 6144 in _sizes(b), _sizes(b)
    for i in _sizes(b):
        x, buf = _x(m, i, seed=m), _poisoned(m, i)
        assert op.silu_mul(x, out=buf[:m]) is not None
        torch.cuda.synchronize()
        _check(x, buf)
        out = op.silu_mul(x)  # a new output tensor: the same bits
        torch.cuda.synchronize()
        assert torch.equal(out, buf[:m])

        x, buf = _x(m, i, seed=100 + m), _poisoned(m, i)
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(st), torch.cuda.graph(graph, stream=st):
            op.silu_mul(x, out=buf[:m])
        for seed in (200 + m, 300 + m):  # replayed with new inputs
            x.copy_(_x(m, i, seed))
            buf.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            _check(x, buf)


@pytest.mark.parametrize("m", [1, 16, 64])
def test_the_kernel_checks_its_own_extents_on_a_larger_grid(plus, m):
    """The kernel's own bounds (its author's, docs/plugins.md §4): launched directly on a grid one CTA wider
    and two rows taller than the data, it computes rows < m and columns < I only: rows past m stay NaN, and
    a write past a row's end (into the next row, or the poisoned rows for the last one) would show."""
    from silu_mul.abi import grid

    import loader

    b, _ = plus
    for i in _sizes(b):
        x, buf = _x(m, i, seed=500 + m), _poisoned(m, i)
        gx, gy, _ = grid(m, i)
        loader.launch_kernel("silu_mul", {"intermediate": i}, (gx + 1, gy + 2, 1), x=x, out=buf, m=m)
        torch.cuda.synchronize()
        _check(x, buf)


def test_silu_mul_custom_op_under_torch_compile(plus):
    b, op = plus  # (importing the op's module registered torch.ops.flint_example.silu_mul)
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.ops.flint_example.silu_mul(x), fullgraph=True)  # a graph break raises
    for m in (1, 16, 64):
        x = _x(m, 6144, seed=400 + m)
        out = f(x)
        torch.cuda.synchronize()
        _check(x, out)
        assert torch.equal(out, op.silu_mul(x))


def test_silu_mul_from_8_threads_with_a_stream_each(plus):
    """8 threads start together (each its first call: plan and launcher built per thread), each launching on
    a stream of its own at changing M; every result checked after its stream finished."""
    _, op = plus
    start, errors, results = threading.Barrier(8), [], {}

    def worker(t):
        try:
            st = torch.cuda.Stream()
            start.wait()
            with torch.cuda.stream(st):
                for k, m in enumerate((1, 16, 64, 3, 64, 1)):
                    x, buf = _x(m, 6144, seed=1000 * t + k), _poisoned(m, 6144)
                    op.silu_mul(x, out=buf[:m])
                    results[(t, k)] = (x, buf)
            st.synchronize()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append((t, repr(e)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 8 * 6
    for x, buf in results.values():
        _check(x, buf)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_silu_mul_on_a_second_device(plus):
    _, op = plus
    x, buf = _x(16, 6144, seed=7, device="cuda:1"), _poisoned(16, 6144, device="cuda:1")
    op.silu_mul(x, out=buf[:16])
    torch.cuda.synchronize("cuda:1")
    _check(x, buf)
    assert torch.cuda.current_device() == 0


def test_launch_kernel_runs_a_built_in_kernel_as_its_op_does(plus):
    """The norm kernel of the same bundle through loader.launch_kernel (every pointer a tensor by name; the
    residual-free kernel reads no residual), PDL on and off, gives loader.rms_norm's bits."""
    import loader

    m = 5
    x = _x(m, 1024, seed=9)  # [5, 2048] bf16
    w = (1 + 0.1 * torch.randn(2048, device="cuda")).bfloat16()
    want = loader.rms_norm(x, w, 1e-6)
    for pdl in (True, False):
        xn = torch.full_like(x, float("nan"))
        loader.launch_kernel("norm", {"residual": False}, (m,), pdl=pdl, x=x, residual=x, residual_out=x,
                             xn=xn, weight=w, eps=1e-6, xn_group=8 * 2048, xn_row=2048,
                             xn_quarter=512, xn_pairs=0)  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(xn, want)


def test_the_doctor_loads_a_plugin_kernel_and_runs_the_rest(plus):
    """`python -m loader.doctor` on a bundle with plugin kernels: each is verified and loaded (it knows no
    reference for it), reported as such, and every Flint variant still runs and passes."""
    from loader import doctor

    b, _ = plus
    results = doctor.run(b.path, ms=(1,))
    plugin = [r for r in results if r.variant.startswith("silu_mul_")]
    assert plugin and all(r.ok and r.note == "plugin kernel: loaded, not run" for r in plugin), plugin
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    assert len(results) > len(plugin)

"""torch.library registration: opcheck of every flint:: op, torch.compile(fullgraph=True) of
code calling the loader's functions, and CUDA-graph capture of the compiled code."""

import pytest
import torch

from tests.helpers import D, check, check_q_and_caches, make_case, op_args

pytestmark = pytest.mark.gpu


def _fused_args(c):
    a = op_args(c)
    names = ["x", "residual", "norm_weight", "eps", "weight", "weight_scale", "global_scale", "q_norm_weight",
             "k_norm_weight", "qk_eps", "cos_sin_cache", "positions", "k_cache", "v_cache", "slot_mapping",
             "num_q_heads", "num_kv_heads"]  # fmt: skip
    return tuple(a[n] for n in names)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_opcheck(gpu_bundle, fmt):
    import loader  # noqa: F401  (registers the ops)

    # NVFP4 scales as their uint8 view (accepted by the loader): opcheck's schema test does arithmetic on
    # every input, which torch does not implement for float8_e4m3fn
    for residual in (True, False):
        c = make_case(3, 16, 2, True, seed=31, residual=residual, fmt=fmt, scale_u8=True)
        torch.library.opcheck(torch.ops.flint.qkv_fused.default, _fused_args(c))
    c = make_case(3, 16, 2, False, seed=32, fmt=fmt, scale_u8=True)
    gemv_args = (c["x"], c["weight"], c["weight_scale"], c["global_scale"])
    torch.library.opcheck(torch.ops.flint.gemv.default, gemv_args)
    qkv = torch.randn(3, 20 * D, device="cuda").bfloat16()
    qk_args = (qkv, c["q_norm_weight"], c["k_norm_weight"], 1e-6, None, c["positions"], c["k_cache"],
               c["v_cache"], c["slot_mapping"], 16, 2)  # fmt: skip
    torch.library.opcheck(torch.ops.flint.qk_norm_rope_cache.default, qk_args)
    torch.library.opcheck(torch.ops.flint.rms_norm.default, (c["x"], c["norm_weight"], 1e-6))
    torch.library.opcheck(torch.ops.flint.fused_add_rms_norm.default,
                          (c["x"], c["residual"], c["norm_weight"], 1e-6))  # fmt: skip


def test_compile_fullgraph_and_graph_capture(gpu_bundle):
    import loader

    def layer(x, residual, c):
        q, r = loader.flint_qkv_fused(
            x, residual, c["norm_weight"], 1e-6, c["weight"], None, None, c["q_norm_weight"],
            c["k_norm_weight"], 1e-6, c["cos_sin_cache"], c["positions"], c["k_cache"], c["v_cache"],
            c["slot_mapping"], 32, 4,
        )  # fmt: skip
        return q.float().sum(-1), q, r

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)  # a graph break would raise
    c = make_case(4, 32, 4, True, seed=41)
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    s, q, r = compiled(c["x"], c["residual"], c)
    torch.cuda.synchronize()
    check(c, q, r, kb, vb)
    k1, v1 = c["k_cache"].clone(), c["v_cache"].clone()
    c["k_cache"].copy_(kb)
    c["v_cache"].copy_(vb)
    s2, q2, r2 = layer(c["x"], c["residual"], c)  # eager: the same kernels, bit-identical
    assert torch.equal(q, q2) and torch.equal(r, r2)
    torch.testing.assert_close(s, s2)  # inductor's sum may add in another order
    assert torch.equal(k1.nan_to_num(7), c["k_cache"].nan_to_num(7))
    assert torch.equal(v1.nan_to_num(7), c["v_cache"].nan_to_num(7))

    # the compiled code captured in a CUDA graph, replayed with new inputs
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        compiled(c["x"], c["residual"], c)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(st), torch.cuda.graph(g, stream=st):
        out = compiled(c["x"], c["residual"], c)
    n = make_case(4, 32, 4, True, seed=42)
    for key in ("x", "residual", "positions"):
        c[key].copy_(n[key])
    c["k_cache"].fill_(float("nan"))
    c["v_cache"].fill_(float("nan"))
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    g.replay()
    torch.cuda.synchronize()
    check(c, out[1], out[2], kb, vb)


def test_compile_without_residual_returns_x(gpu_bundle):
    import loader

    c = make_case(2, 16, 2, False, seed=43, residual=False)
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    f = torch.compile(lambda c: loader.flint_qkv_fused(**op_args(c)), fullgraph=True)
    q, r = f(c)
    torch.cuda.synchronize()
    assert torch.equal(r, c["x"])
    check_q_and_caches(c, q, kb, vb)  # (r == x alone holds for a call that computed nothing)


def test_compile_dynamic_m(gpu_bundle):
    """torch.compile(dynamic=True) of code calling the op: one compiled graph serves M = 2 .. 64 (every token
    tile; the fake implementations give the outputs' shapes from M), each result checked against the
    reference."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import loader

    def layer(x, residual, c):
        return loader.flint_qkv_fused(
            x, residual, c["norm_weight"], 1e-6, c["weight"], None, None, c["q_norm_weight"],
            c["k_norm_weight"], 1e-6, c["cos_sin_cache"], c["positions"], c["k_cache"], c["v_cache"],
            c["slot_mapping"], 16, 8,
        )  # fmt: skip

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, dynamic=True, fullgraph=True)
    for m in (2, 9, 17, 33, 64):
        c = make_case(m, 16, 8, True, seed=700 + m)
        kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
        q, r = compiled(c["x"], c["residual"], c)
        torch.cuda.synchronize()
        assert q.shape == (m, 16 * D)
        check(c, q, r, kb, vb)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for M = 2 .. 64"

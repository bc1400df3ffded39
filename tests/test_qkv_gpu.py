"""The fused qkv op (BF16 weights) on the GPU against the float64 reference of SPEC §3."""

import pytest
import torch

from loader import nvfp4
from loader.reference import expected_cache, make_cos_sin_cache, qkv_fused_ref, rms_norm_ref
from tests.conftest import needs_gpu

pytestmark = needs_gpu
K, D = 2048, 128


def _variants(bundle, fmt="bf16"):
    return sorted(
        {
            (e.spec["rope"], tuple(e.spec["heads"]))
            for e in bundle.manifest.kernels
            if e.kind == "qkv" and e.spec["weight_format"] == fmt and e.arch == "sm_90a"
        }
    )


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def make_case(
    m, nq, nkv, rope, seed, residual=True, num_blocks=16, block_size=16, split_kv=False, slots=None,
    fmt="bf16", scale_u8=False,
):  # fmt: skip
    """Fresh random inputs for one call; keys starting with '_' are for the checks, not the op.
    fmt="nvfp4" quantizes the random weight (reference: the float64 dequantization); scale_u8 passes the
    block scales as a uint8 view."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    n = (nq + 2 * nkv) * D
    c = dict(
        x=r(m, K).mul_(2).bfloat16(),
        residual=r(m, K).bfloat16() if residual else None,
        norm_weight=(1 + 0.3 * r(K)).bfloat16(),
        eps=1e-6,
        weight=(r(n, K) * 0.03).bfloat16(),
        weight_scale=None,
        global_scale=None,
        q_norm_weight=(1 + 0.3 * r(D)).bfloat16(),
        k_norm_weight=(1 + 0.3 * r(D)).bfloat16(),
        qk_eps=1e-6,
        cos_sin_cache=make_cos_sin_cache(4096, device="cuda") if rope else None,
        positions=torch.randint(0, 4096, (m,), device="cuda", generator=g),
    )
    if split_kv:  # vLLM layout: k and v are the two halves of one allocation
        kv = torch.full(
            (num_blocks, 2, block_size, nkv, D), float("nan"), dtype=torch.bfloat16, device="cuda"
        )
        c["k_cache"], c["v_cache"] = kv[:, 0], kv[:, 1]
    else:
        c["k_cache"] = torch.full(
            (num_blocks, block_size, nkv, D), float("nan"), dtype=torch.bfloat16, device="cuda"
        )
        c["v_cache"] = torch.full_like(c["k_cache"], float("nan"))
    if slots is None:
        slots = torch.randperm(num_blocks * block_size, device="cuda", generator=g)[:m]
    c["slot_mapping"] = slots
    c["num_q_heads"], c["num_kv_heads"] = nq, nkv
    c["_w_dense"] = c["weight"]
    if fmt == "nvfp4":
        packed, scales, gs = nvfp4.quantize(c["weight"])
        gs = gs.to("cuda")
        c["_w_dense"] = nvfp4.dequantize(packed, scales, gs)
        c["weight"], c["global_scale"] = packed, gs
        c["weight_scale"] = scales.view(torch.uint8) if scale_u8 else scales
    return c


def op_args(c):
    return {k: v for k, v in c.items() if not k.startswith("_")}


def run(c):
    import loader

    return loader.flint_qkv_fused(**op_args(c))


def check(c, q, res_out, k_before, v_before):
    m, nq, nkv = c["x"].shape[0], c["num_q_heads"], c["num_kv_heads"]
    ref = qkv_fused_ref(
        c["x"],
        c["residual"],
        c["norm_weight"],
        c["eps"],
        c["_w_dense"],
        c["q_norm_weight"],
        c["k_norm_weight"],
        c["qk_eps"],
        c["cos_sin_cache"],
        c["positions"],
        nq,
        nkv,
    )
    if c["residual"] is None:
        assert res_out.data_ptr() == c["x"].data_ptr()
    else:
        assert torch.equal(res_out, rms_norm_ref(c["x"], c["residual"], c["norm_weight"], c["eps"])[1])
    assert q.shape == (m, nq * D) and not q.isnan().any(), "q must be written everywhere"
    assert _rel(q.view(m, nq, D), ref["q"]) < 1e-2
    ek, ev = expected_cache(k_before, v_before, ref["k"], ref["v"], c["slot_mapping"])
    for name, got, exp in (("k", c["k_cache"], ek), ("v", c["v_cache"], ev)):
        assert torch.equal(got.isnan(), exp.isnan()), f"{name}_cache: wrong set of elements written"
        w = ~exp.isnan()
        if w.any():
            assert _rel(got[w], exp[w]) < 1e-2, name


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", range(1, 9))
def test_every_variant(gpu_bundle, m, fmt):
    variants = _variants(gpu_bundle, fmt)
    assert variants, f"the bundle has no {fmt} qkv kernels"
    for i, (rope, (nq, nkv)) in enumerate(variants):
        c = make_case(
            m, nq, nkv, rope, seed=1000 * m + i, residual=(i % 2 == 0), fmt=fmt, scale_u8=(i % 3 == 1)
        )
        kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
        q, res_out = run(c)
        torch.cuda.synchronize()
        check(c, q, res_out, kb, vb)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("split_kv", [False, True])
def test_cache_layouts_and_slot_mapping(gpu_bundle, block_size, split_kv, fmt):
    nb = 64 // block_size + 2
    slots = torch.tensor([5, -1, nb * block_size - 1, 0, -7, 17], device="cuda")  # shorter than M, negatives
    c = make_case(
        8, 16, 2, True, seed=block_size, num_blocks=nb, block_size=block_size, split_kv=split_kv, slots=slots,
        fmt=fmt,
    )  # fmt: skip
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    q, res_out = run(c)
    torch.cuda.synchronize()
    check(c, q, res_out, kb, vb)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_two_runs_bit_identical(gpu_bundle, fmt):
    c = make_case(5, 32, 4, True, seed=3, fmt=fmt)
    q1, r1 = run(c)
    k1, v1 = c["k_cache"].clone(), c["v_cache"].clone()
    q2, r2 = run(c)
    torch.cuda.synchronize()
    assert torch.equal(q1, q2) and torch.equal(r1, r2)
    assert torch.equal(k1.nan_to_num(7), c["k_cache"].nan_to_num(7))
    assert torch.equal(v1.nan_to_num(7), c["v_cache"].nan_to_num(7))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_graph_capture_replay(gpu_bundle, fmt):
    c = make_case(4, 32, 4, True, seed=4, fmt=fmt)
    run(c)  # load modules before capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        q, res_out = run(c)
    for seed in (5, 6):
        n = make_case(4, 32, 4, True, seed=seed, fmt=fmt)
        for key in ("x", "residual", "positions"):
            c[key].copy_(n[key])
        c["k_cache"].fill_(float("nan"))
        c["v_cache"].fill_(float("nan"))
        kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
        graph.replay()
        torch.cuda.synchronize()
        check(c, q, res_out, kb, vb)


def test_out_of_range_positions_and_slots_are_safe(gpu_bundle):
    import loader

    c = make_case(3, 16, 2, True, seed=8, num_blocks=4, block_size=16)
    c["positions"] = torch.tensor([1, 4096, -3], device="cuda")
    c["slot_mapping"] = torch.tensor([0, 64, 1], device="cuda")  # 64 = one past the cache
    q, _ = run(c)
    torch.cuda.synchronize()
    q = q.view(3, 16, D)
    assert not q[0].isnan().any() and q[1].isnan().all() and q[2].isnan().all()
    # token 1's slot is past the cache: not written; token 2's k is NaN (bad position) but v is written
    assert (~c["k_cache"].isnan()).sum().item() == 2 * D
    assert (~c["v_cache"].isnan()).sum().item() == 2 * 2 * D
    loader.set_bounds_check(True)
    try:
        with pytest.raises(ValueError, match="positions outside"):
            run(c)
        c["positions"] = torch.tensor([1, 2, 3], device="cuda")
        with pytest.raises(ValueError, match="slots outside"):
            run(c)
    finally:
        loader.set_bounds_check(False)


def test_bad_inputs_raise_and_write_nothing(gpu_bundle):
    import loader

    base = make_case(2, 32, 4, True, seed=9)
    bad = {
        "x": (base["x"].float(), TypeError, "x must be torch.bfloat16"),
        "weight": (base["weight"][:-16], ValueError, r"weight must have shape \[5120, 2048\]"),
        "weight_scale": (base["weight"], ValueError, "must be None for a BF16 weight"),
        "positions": (base["positions"].int(), TypeError, "positions must be torch.int64"),
        "slot_mapping": (torch.zeros(3, dtype=torch.int64, device="cuda"), ValueError, "more than the M = 2"),
        "v_cache": (base["v_cache"][:, :8], ValueError, "same shape and strides"),
        "k_cache": (base["k_cache"].float(), TypeError, "k_cache must be torch.bfloat16"),
        "cos_sin_cache": (base["cos_sin_cache"][:, :64], ValueError, r"cos_sin_cache must have shape"),
        "q_norm_weight": (base["q_norm_weight"][:64], ValueError, "q_norm_weight must have shape"),
        "num_q_heads": (31, ValueError, "multiple of num_kv_heads"),
        "num_kv_heads": (8, ValueError, r"weight must have shape"),
        "qk_eps": (None, TypeError, "qk_eps must be a Python float"),
    }
    base = op_args(base)
    for key, (val, exc, msg) in bad.items():
        c = dict(base, **{key: val})
        with pytest.raises(exc, match=msg):
            loader.flint_qkv_fused(**c)
    c = dict(
        base,
        num_q_heads=24,
        num_kv_heads=4,
        weight=torch.zeros(32 * D, K, dtype=torch.bfloat16, device="cuda"),
    )
    with pytest.raises(LookupError, match="no qkv kernel"):
        loader.flint_qkv_fused(**c)
    torch.cuda.synchronize()
    assert base["k_cache"].isnan().all() and base["v_cache"].isnan().all()
    q, r = loader.flint_qkv_fused(**base)  # the context is still healthy


def test_bad_nvfp4_inputs_raise_and_write_nothing(gpu_bundle):
    import loader

    base = make_case(2, 32, 4, True, seed=10, fmt="nvfp4")
    ws, gs = base["weight_scale"], base["global_scale"]
    bad = {
        "weight_scale": [
            (None, ValueError, "needs weight_scale and global_scale"),
            (ws.view(torch.uint8).bfloat16(), TypeError, "weight_scale must be torch.float8_e4m3fn"),
            (ws[:-128], ValueError, r"weight_scale must have shape \[5120, 128\]"),
            (ws.cpu(), ValueError, "weight_scale must be on a CUDA device"),
            (ws.view(torch.uint8).t(), ValueError, "weight_scale must have shape"),
        ],
        "global_scale": [
            (None, ValueError, "needs weight_scale and global_scale"),
            (gs.half(), TypeError, "global_scale must be torch.float32"),
            (torch.ones(2, device="cuda"), ValueError, "one fp32 element"),
            (1.0, TypeError, "global_scale must be a torch.Tensor"),
        ],
        "weight": [
            (base["weight"][:, :512], ValueError, r"weight must have shape \[5120, 1024\]"),
            (base["weight"].view(torch.int8), TypeError, "weight must be bf16"),
        ],
    }
    base = op_args(base)
    for key, cases in bad.items():
        for val, exc, msg in cases:
            with pytest.raises(exc, match=msg):
                loader.flint_qkv_fused(**dict(base, **{key: val}))
    torch.cuda.synchronize()
    assert base["k_cache"].isnan().all() and base["v_cache"].isnan().all()
    q, r = loader.flint_qkv_fused(**base)
    torch.cuda.synchronize()
    assert not q.isnan().any()
    torch.cuda.synchronize()
    assert not q.isnan().any()


def test_slow_producer(gpu_bundle):
    """A debug bundle whose norm kernel busy-waits ~1 ms before writing xn (configs/debug_slow_producer.yaml,
    built into build/debug or $FLINT_AOT_DEBUG_BUNDLE): the qkv kernel, which starts streaming its weights
    as soon as the norm kernel starts, must still read the new xn. Inputs change between calls, so a kernel
    that did not wait would read the previous call's activations (or garbage) and fail the comparison."""
    import os

    import loader
    from tests.conftest import ROOT

    path = os.environ.get("FLINT_AOT_DEBUG_BUNDLE") or str(ROOT / "build" / "debug")
    if not os.path.exists(os.path.join(path, "manifest.json")):
        how = f"no debug bundle at {path}: flint-aot build configs/debug_slow_producer.yaml -o {path}"
        if os.environ.get("FLINT_REQUIRE_DEBUG_BUNDLE"):
            pytest.fail(how)
        pytest.skip(how)
    b = loader.load_bundle(path)
    try:
        norms = [e for e in b.manifest.kernels if e.kind == "norm" and e.arch == "sm_90a"]
        assert norms and all(e.spec.get("debug_spin_cycles", 0) >= 1_000_000 for e in norms)
        for i, (rope, (nq, nkv)) in enumerate(_variants(b)):
            for m in (1, 5, 8):
                c = make_case(m, nq, nkv, rope, seed=7000 + 10 * m + i, residual=(m % 2 == 1))
                kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                q, res_out = run(c)
                e1.record()
                torch.cuda.synchronize()
                assert e0.elapsed_time(e1) > 0.3, "the debug norm kernel did not spin: wrong bundle?"
                check(c, q, res_out, kb, vb)
    finally:
        loader.load_bundle(gpu_bundle.path)

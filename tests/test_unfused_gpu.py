"""The unfused path: loader.gemv and loader.qk_norm_rope_cache on their own (BF16 and FP8 KV caches), and
the fused op against norm -> gemv -> qk_norm_rope_cache on identical inputs."""

import pytest
import torch

from loader import nvfp4
from loader.reference import expected_cache, fp8_cache_value, gemv_ref, qk_norm_rope_ref
from tests.helpers import (
    FP8_CACHE_POISON,
    D,
    K,
    assert_elements_close,
    assert_gemv_close,
    check,
    check_qk,
    make_case,
    op_args,
    qk_args,
    rel,
    run_unfused,
    variants,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("n", [16, 48, 2560, 5120 + 16])
def test_gemv_against_reference(gpu_bundle, fmt, n):
    import loader

    g = torch.Generator(device="cuda").manual_seed(n)
    for m in (1, 3, 8, 9, 16, 17, 40, 64):
        x = torch.randn(m, K, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, K, device="cuda", generator=g) * 0.03).bfloat16()
        if fmt == "bf16":
            args, dense = (w, None, None), w
        else:
            packed, scales, gs = nvfp4.quantize(w)
            args, dense = (packed, scales, gs), nvfp4.dequantize(packed, scales, gs)
        y = loader.gemv(x, *args)
        torch.cuda.synchronize()
        assert y.shape == (m, n) and y.dtype == torch.bfloat16 and not y.isnan().any()
        ref = gemv_ref(x, dense)
        assert rel(y, ref) < 1e-2
        # element-wise: one bf16 rounding plus the fp32 accumulation bound (K * 2^-24 of sum |x w|)
        assert_gemv_close(y, x, dense, ref, f"{fmt} N={n} M={m}")


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_gemv_tiles_agree(gpu_bundle, fmt):
    """A token's sum does not depend on the token tile (docs/numerics.md §2): the rows of a call of M = 9..64
    (the 16-, 32- and 64-token kernels: the token stream) equal, bit for bit, the same rows computed in calls
    of M <= 8 (the 8-token kernel); also for N not a multiple of 64 (the stream's last quad part-empty)."""
    import loader

    g = torch.Generator(device="cuda").manual_seed(77)
    for n in (5120, 5120 + 16, 48):
        w = (torch.randn(n, K, device="cuda", generator=g) * 0.03).bfloat16()
        args = (w,) if fmt == "bf16" else nvfp4.quantize(w)
        for m in (9, 12, 16, 17, 32, 33, 64):
            x = torch.randn(m, K, device="cuda", generator=g).bfloat16()
            big = loader.gemv(x, *args)
            small = torch.cat([loader.gemv(x[i : i + 8], *args) for i in range(0, m, 8)])
            torch.cuda.synchronize()
            assert torch.equal(big.view(torch.int16), small.view(torch.int16)), f"N={n} M={m}"


def test_gemv_bad_inputs(gpu_bundle):
    import loader

    x = torch.randn(2, K, device="cuda").bfloat16()
    w = torch.randn(40, K, device="cuda").bfloat16()
    with pytest.raises(ValueError, match=r"weight"):
        loader.gemv(x, w)  # 40 rows: not a multiple of 16
    with pytest.raises(ValueError, match=r"weight"):
        loader.gemv(x, torch.zeros(32, 1024, dtype=torch.bfloat16, device="cuda"))
    packed, scales, gs = nvfp4.quantize(torch.randn(48, K, device="cuda").bfloat16())
    with pytest.raises(ValueError, match=r"weight_scale"):
        loader.gemv(x, packed, scales[:48], gs)  # rows must be padded to 128
    with pytest.raises(ValueError, match=r"weight_scale|global_scale"):
        loader.gemv(x, packed)
    with pytest.raises(ValueError, match=r"\bM\b.*64"):
        loader.gemv(torch.randn(65, K, device="cuda").bfloat16(), w[:32])
    y = loader.gemv(x, packed, scales, gs)  # the context is still healthy
    torch.cuda.synchronize()
    assert rel(y, gemv_ref(x, nvfp4.dequantize(packed, scales, gs))) < 1e-2


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_qk_norm_rope_cache_against_reference(gpu_bundle, kv):
    import loader

    for rope in (True, False):
        cases = ((1, (32, 4)), (8, (16, 2)), (5, (8, 1)), (17, (16, 8)), (64, (32, 4)), (47, (8, 1)))
        for m, (nq, nkv) in cases:
            c = make_case(m, nq, nkv, rope, seed=50 + m, kv_dtype=kv, cache_u8=(m == 5), num_blocks=8)
            qkv = (torch.randn(m, (nq + 2 * nkv) * D, device="cuda") * 3).bfloat16()
            kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
            q = loader.qk_norm_rope_cache(**qk_args(c, qkv))
            torch.cuda.synchronize()
            check_qk(c, qkv, q, kb, vb)
            if kv == "bf16":  # v is copied unchanged
                vh = qkv.view(m, -1, D)[:, nq + nkv :].double()
                ev = expected_cache(kb, vb, vh, vh, c["slot_mapping"])[1]
                assert torch.equal(c["v_cache"].nan_to_num(7), ev.nan_to_num(7))


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("m", [65, 1000, 16384])
def test_qk_norm_rope_cache_at_prefill_sizes(gpu_bundle, kv, m):
    """M past the decode sizes (a prefill chunk: the grid's 16-token blocks, the last one part-full): every
    element against the float64 reference, the caches NaN-poisoned and written exactly at the mapped slots;
    a slot mapping shorter than M (its last tokens not written) and negative slots among it."""
    import loader

    assert m <= gpu_bundle.max_tokens("qk_norm_rope_cache")
    for rope, (nq, nkv) in ((True, (32, 4)), (False, (16, 8))):
        nb = -(-m // 16) + 8
        g = torch.Generator(device="cuda").manual_seed(m)
        slots = torch.randperm(nb * 16, device="cuda", generator=g)[: m - 3]
        slots[::97] = -1  # not written
        c = make_case(m, nq, nkv, rope, seed=60 + m, kv_dtype=kv, num_blocks=nb, slots=slots)
        qkv = (torch.randn(m, (nq + 2 * nkv) * D, device="cuda", generator=g) * 3).bfloat16()
        kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
        q = loader.qk_norm_rope_cache(**qk_args(c, qkv))
        torch.cuda.synchronize()
        check_qk(c, qkv, q, kb, vb)


def test_qk_norm_rope_cache_offsets_past_2_31(gpu_bundle):
    """M = 16,384 into caches of more than 2**31 elements each (4.3 GB): slots spread over the whole cache,
    the last blocks' element offsets past 2**31 (computed in 64 bits), negative slots among them; every
    mapped slot holds its token's k and v (k against the float64 reference, v the GEMV's values exactly) and
    no other element is written."""
    import loader

    m, nq, nkv, bs = 16384, 32, 8, 16
    assert m <= gpu_bundle.max_tokens("qk_norm_rope_cache")
    nb = (1 << 31) // (bs * nkv * D) + 64
    assert nb * bs * nkv * D > 1 << 31
    g = torch.Generator(device="cuda").manual_seed(31)
    c = make_case(1, nq, nkv, True, seed=31)  # (the norm weights and the table)
    k = torch.full((nb, bs, nkv, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    v = torch.full_like(k, float("nan"))
    slots = torch.randperm(nb * bs, device="cuda", generator=g)[:m]
    slots[:64] = torch.arange(nb * bs - 64, nb * bs, device="cuda")  # the very last slots
    slots[100::1000] = -5
    pos = torch.randint(0, 4096, (m,), device="cuda", generator=g)
    qkv = (torch.randn(m, (nq + 2 * nkv) * D, device="cuda", generator=g) * 3).bfloat16()
    q = loader.qk_norm_rope_cache(qkv, c["q_norm_weight"], c["k_norm_weight"], c["qk_eps"],
                                  c["cos_sin_cache"], pos, k, v, slots, nq, nkv)  # fmt: skip
    torch.cuda.synchronize()
    rq, rk, _ = qk_norm_rope_ref(qkv, c["q_norm_weight"], c["k_norm_weight"], c["qk_eps"],
                                 c["cos_sin_cache"], pos, nq, nkv)  # fmt: skip
    assert_elements_close(q.view(m, nq, D), rq, "q")
    ok = slots >= 0
    for name, cache, want in (("k", k, None), ("v", v, qkv.view(m, -1, D)[:, nq + nkv :])):
        assert int((~cache.isnan()).sum()) == int(ok.sum()) * nkv * D, f"{name}: elements written elsewhere"
        got = cache.view(-1, nkv, D)[slots[ok]]
        if want is None:
            assert_elements_close(got, rk[ok], "k_cache")
        else:
            assert torch.equal(got, want[ok]), "v_cache: not the GEMV's values"


def test_qk_norm_rope_cache_refuses_more_tokens_than_the_bundle_serves(gpu_bundle):
    import loader

    limit = gpu_bundle.max_tokens("qk_norm_rope_cache")
    c = make_case(1, 16, 2, True, seed=3)
    qkv = torch.randn(limit + 1, 20 * D, device="cuda").bfloat16()
    kb = c["k_cache"].clone()
    what = rf"1 <= M <= {limit} \(the bundle's qk_norm_rope_cache.max_tokens\)"
    with pytest.raises(ValueError, match=what):
        loader.qk_norm_rope_cache(**qk_args(c, qkv))
    torch.cuda.synchronize()
    assert torch.equal(c["k_cache"].isnan(), kb.isnan())


def test_qk_norm_rope_cache_fp8_bytes_from_the_bf16_values(gpu_bundle):
    """The FP8 cache holds e4m3(bf16 value / scale), bit for bit, of what the same call writes into a BF16
    cache; q is bit-identical."""
    import loader

    for rope in (True, False):
        for m, (nq, nkv) in ((1, (32, 4)), (8, (16, 2))):
            c8 = make_case(m, nq, nkv, rope, seed=80 + m, kv_dtype="fp8_e4m3")
            c16 = make_case(m, nq, nkv, rope, seed=80 + m)
            qkv = (torch.randn(m, (nq + 2 * nkv) * D, device="cuda") * 3).bfloat16()
            q8 = loader.qk_norm_rope_cache(**qk_args(c8, qkv))
            q16 = loader.qk_norm_rope_cache(**qk_args(c16, qkv))
            torch.cuda.synchronize()
            assert torch.equal(q8, q16)
            for name, scale in (("k_cache", c8["k_scale"]), ("v_cache", c8["v_scale"])):
                b16 = c16[name]
                written = ~b16.isnan()
                want = torch.full(b16.shape, FP8_CACHE_POISON, dtype=torch.uint8, device="cuda")
                want[written] = fp8_cache_value(b16[written], scale).view(torch.uint8)
                diff = c8[name].view(torch.uint8) != want
                assert not diff.any(), f"rope={rope} M={m} {name}: {int(diff.sum())} bytes differ"


def test_qk_norm_rope_cache_bad_inputs(gpu_bundle):
    import loader

    c = make_case(2, 16, 2, True, seed=77)
    qkv = torch.randn(2, 20 * D, device="cuda").bfloat16()
    args = [c["q_norm_weight"], c["k_norm_weight"], 1e-6, c["cos_sin_cache"], c["positions"], c["k_cache"],
            c["v_cache"], c["slot_mapping"]]  # fmt: skip
    with pytest.raises(ValueError, match=r"qkv"):
        loader.qk_norm_rope_cache(qkv[:, :2048], *args, 16, 2)
    with pytest.raises(TypeError, match=r"qkv"):
        loader.qk_norm_rope_cache(qkv.float(), *args, 16, 2)
    bad = list(args)
    bad[4] = c["positions"][:1]
    with pytest.raises(ValueError, match=r"positions"):
        loader.qk_norm_rope_cache(qkv, *bad, 16, 2)
    torch.cuda.synchronize()
    assert c["k_cache"].isnan().all() and c["v_cache"].isnan().all()
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    q = loader.qk_norm_rope_cache(qkv, *args, 16, 2)  # the context is still healthy
    torch.cuda.synchronize()
    check_qk(c, qkv, q, kb, vb)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_fused_equals_unfused(gpu_bundle, fmt):
    """The unfused path gives the fused op's bits: residual_out, xn, q and both caches bit-identical (the
    per-head stage sums the squares in the fused epilogue's order, docs/numerics.md §5)."""
    import loader

    vs = variants(gpu_bundle, fmt)
    assert vs
    for i, (rope, (nq, nkv)) in enumerate(vs):
        for m in (1, 4, 8, 9, 12, 16):
            c = make_case(m, nq, nkv, rope, seed=900 + 10 * i + m, residual=(m != 4), fmt=fmt)
            u = {k: (v.clone() if k in ("k_cache", "v_cache") else v) for k, v in c.items()}
            kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
            q, res_out = loader.flint_qkv_fused(**op_args(c))
            q2, r2, _ = run_unfused(c, u)
            torch.cuda.synchronize()
            check(c, q, res_out, kb, vb)  # the fused op against the float64 reference
            assert torch.equal(res_out, r2)
            assert torch.equal(c["v_cache"].nan_to_num(7), u["v_cache"].nan_to_num(7)), "v not bit-identical"
            assert torch.equal(c["k_cache"].nan_to_num(7), u["k_cache"].nan_to_num(7)), "k not bit-identical"
            assert torch.equal(q.view(torch.int16), q2.view(torch.int16)), f"q not bit-identical, M = {m}"


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_fused_equals_unfused_fp8_cache(gpu_bundle, fmt):
    """FP8 caches: the same bytes from both paths, k and v (both paths' bf16 values are the same bits)."""
    import loader

    vs = variants(gpu_bundle, fmt, "fp8_e4m3")
    assert vs, f"the bundle has no {fmt} qkv kernels with an FP8 cache"
    for i, (rope, (nq, nkv)) in enumerate(vs):
        for m in (1, 4, 8, 9, 12, 16):
            c = make_case(
                m, nq, nkv, rope, seed=950 + 10 * i + m, residual=(m != 4), fmt=fmt, kv_dtype="fp8_e4m3"
            )
            u = {k: (v.clone() if k in ("k_cache", "v_cache") else v) for k, v in c.items()}
            loader.flint_qkv_fused(**op_args(c))
            run_unfused(c, u)
            torch.cuda.synchronize()
            assert torch.equal(c["v_cache"].view(torch.uint8), u["v_cache"].view(torch.uint8)), (
                "v bytes differ"
            )
            kf, ku = c["k_cache"].view(torch.uint8), u["k_cache"].view(torch.uint8)
            assert torch.equal(kf, ku), f"k bytes differ, M = {m}"

"""The unfused path (SPEC §3): loader.gemv and loader.qk_norm_rope_cache on their own, and the fused op
against norm -> gemv -> qk_norm_rope_cache on identical inputs (issue 5)."""

import pytest
import torch

from loader import nvfp4
from loader.reference import expected_cache, gemv_ref, qk_norm_rope_ref
from tests.conftest import needs_gpu
from tests.test_qkv_gpu import _rel, _variants, check, make_case, op_args

pytestmark = needs_gpu
K, D = 2048, 128


def _ulps(a, b):
    """Distance in bf16 ulps between two bf16 tensors of finite values (sign-magnitude order)."""

    def order(t):
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (order(a) - order(b)).abs()


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("n", [16, 48, 2560, 5120 + 16])
def test_gemv_against_reference(gpu_bundle, fmt, n):
    import loader

    g = torch.Generator(device="cuda").manual_seed(n)
    for m in (1, 3, 8):
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
        assert _rel(y, ref) < 1e-2
        # element-wise: one bf16 rounding plus the fp32 accumulation bound (K * 2^-24 of sum |x w|)
        _, e = torch.frexp(ref)
        ulp = torch.ldexp(torch.ones_like(ref), e - 8)
        mag = x.double().abs() @ dense.double().abs().t()
        assert ((y.double() - ref).abs() <= ulp + 2.0**-13 * mag).all()


def test_gemv_bad_inputs(gpu_bundle):
    import loader

    x = torch.randn(2, K, device="cuda").bfloat16()
    w = torch.randn(40, K, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="multiple of 16"):
        loader.gemv(x, w)
    with pytest.raises(ValueError, match="multiple of 16"):
        loader.gemv(x, torch.zeros(32, 1024, dtype=torch.bfloat16, device="cuda"))
    packed, scales, gs = nvfp4.quantize(torch.randn(48, K, device="cuda").bfloat16())
    with pytest.raises(ValueError, match=r"weight_scale must have shape \[128, 128\]"):
        loader.gemv(x, packed, scales[:48], gs)
    with pytest.raises(ValueError, match="needs weight_scale"):
        loader.gemv(x, packed)
    with pytest.raises(ValueError, match="M = 9"):
        loader.gemv(torch.randn(9, K, device="cuda").bfloat16(), w[:32])


def test_qk_norm_rope_cache_against_reference(gpu_bundle):
    import loader

    for rope in (True, False):
        for m, (nq, nkv) in ((1, (32, 4)), (8, (16, 2)), (5, (8, 1))):
            c = make_case(m, nq, nkv, rope, seed=50 + m)
            qkv = (torch.randn(m, (nq + 2 * nkv) * D, device="cuda") * 3).bfloat16()
            kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
            q = loader.qk_norm_rope_cache(qkv, c["q_norm_weight"], c["k_norm_weight"], c["qk_eps"],
                                          c["cos_sin_cache"], c["positions"], c["k_cache"], c["v_cache"],
                                          c["slot_mapping"], nq, nkv)  # fmt: skip
            torch.cuda.synchronize()
            rq, rk, rv = qk_norm_rope_ref(qkv, c["q_norm_weight"], c["k_norm_weight"], c["qk_eps"],
                                          c["cos_sin_cache"], c["positions"], nq, nkv)  # fmt: skip
            assert not q.isnan().any() and _rel(q.view(m, nq, D), rq) < 1e-2
            ek, ev = expected_cache(kb, vb, rk, rv, c["slot_mapping"])
            for got, exp in ((c["k_cache"], ek), (c["v_cache"], ev)):
                assert torch.equal(got.isnan(), exp.isnan())
                w = ~exp.isnan()
                assert _rel(got[w], exp[w]) < 1e-2
            assert torch.equal(c["v_cache"].nan_to_num(7), ev.nan_to_num(7))  # v copied unchanged


def test_qk_norm_rope_cache_bad_inputs(gpu_bundle):
    import loader

    c = make_case(2, 16, 2, True, seed=77)
    qkv = torch.randn(2, 20 * D, device="cuda").bfloat16()
    args = [c["q_norm_weight"], c["k_norm_weight"], 1e-6, c["cos_sin_cache"], c["positions"], c["k_cache"],
            c["v_cache"], c["slot_mapping"]]  # fmt: skip
    with pytest.raises(ValueError, match=r"qkv must have shape \[M, 2560\]"):
        loader.qk_norm_rope_cache(qkv[:, :2048], *args, 16, 2)
    with pytest.raises(TypeError, match="qkv must be torch.bfloat16"):
        loader.qk_norm_rope_cache(qkv.float(), *args, 16, 2)
    bad = list(args)
    bad[4] = c["positions"][:1]
    with pytest.raises(ValueError, match="positions must have shape"):
        loader.qk_norm_rope_cache(qkv, *bad, 16, 2)
    torch.cuda.synchronize()
    assert c["k_cache"].isnan().all() and c["v_cache"].isnan().all()


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_fused_equals_unfused(gpu_bundle, fmt, capsys):
    """residual_out, xn and v bit-identical; q and k within one bf16 ulp (the fused kernel sums the per-head
    squares in another order)."""
    import loader

    variants = _variants(gpu_bundle, fmt)
    assert variants
    differ = total = 0
    for i, (rope, (nq, nkv)) in enumerate(variants):
        for m in (1, 4, 8):
            c = make_case(m, nq, nkv, rope, seed=900 + 10 * i + m, residual=(m != 4), fmt=fmt)
            u = {k: (v.clone() if k in ("k_cache", "v_cache") else v) for k, v in c.items()}
            kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
            q, res_out = loader.flint_qkv_fused(**op_args(c))
            if c["residual"] is None:
                xn, r2 = loader.rms_norm(c["x"], c["norm_weight"], c["eps"]), c["x"]
            else:
                xn, r2 = loader.fused_add_rms_norm(c["x"], c["residual"], c["norm_weight"], c["eps"])
            qkv = loader.gemv(xn, c["weight"], c["weight_scale"], c["global_scale"])
            q2 = loader.qk_norm_rope_cache(qkv, u["q_norm_weight"], u["k_norm_weight"], u["qk_eps"],
                                           u["cos_sin_cache"], u["positions"], u["k_cache"], u["v_cache"],
                                           u["slot_mapping"], nq, nkv)  # fmt: skip
            torch.cuda.synchronize()
            check(c, q, res_out, kb, vb)  # the fused op against the float64 reference
            assert torch.equal(res_out, r2)
            assert torch.equal(c["v_cache"].nan_to_num(7), u["v_cache"].nan_to_num(7)), "v not bit-identical"
            assert torch.equal(c["k_cache"].isnan(), u["k_cache"].isnan())
            w = ~c["k_cache"].isnan()
            for a, b in ((q, q2), (c["k_cache"][w], u["k_cache"][w])):
                d = _ulps(a, b)
                assert d.max().item() <= 1, "q/k must agree within one bf16 ulp"
                differ += (d > 0).sum().item()
                total += d.numel()
    with capsys.disabled():
        print(f"\n[fused vs unfused, {fmt}] q/k elements that differ (by 1 ulp): {differ}/{total} "
              f"= {100 * differ / total:.3f} %")  # fmt: skip

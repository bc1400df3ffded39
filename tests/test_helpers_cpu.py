"""tests/helpers.py's number checks on the CPU: what a correct kernel returns passes them (the kernels'
arithmetic emulated by loader.reference in fp32, as the measurement of helpers.ELEMENT_TOL does), and
planted wrong values fail them: a NaN, one wrong element, an error just over the norm-wise bound, a wrong
cache value or slot, residual_out off by one ulp or not aliasing x.

    PYTHONPATH=. python -m tests.test_helpers_cpu [CASES]   # the measurement: worst element per output
"""

from __future__ import annotations

import sys

import pytest
import torch

from loader import nvfp4
from loader.reference import expected_cache, qkv_fused_ref
from tests import helpers as h

HEADS = ((8, 1), (16, 2), (16, 8), (32, 4))


def emulate(c: dict):
    """What a kernel returns for case c, by loader.reference in fp32 (docs/numerics.md: fp32 accumulation and
    norms, one bf16 rounding per stored value): (q, residual_out); c's caches are written as the kernel
    writes them (bf16, or e4m3 through fp8_cache_value with the case's scales)."""
    m, nq = c["x"].shape[0], c["num_q_heads"]
    out = qkv_fused_ref(
        c["x"], c["residual"], c["norm_weight"], c["eps"], c["_w_dense"], c["q_norm_weight"],
        c["k_norm_weight"], c["qk_eps"], c["cos_sin_cache"], c["positions"], nq, c["num_kv_heads"],
        dtype=torch.float32,
    )  # fmt: skip
    kc, vc = expected_cache(c["k_cache"], c["v_cache"], out["k"], out["v"], c["slot_mapping"],
                            c.get("k_scale"), c.get("v_scale"))  # fmt: skip
    c["k_cache"].copy_(kc)
    c["v_cache"].copy_(vc)
    return out["q"].bfloat16().reshape(m, nq * h.D), out["residual_out"]


def case(i: int, **kw) -> dict:
    """The i-th case of the measurement (CPU): heads, M, weights, RoPE and residual varied with i."""
    nq, nkv = HEADS[i % len(HEADS)]
    args = dict(m=1 + (i * 7) % 16, nq=nq, nkv=nkv, rope=i % 3 != 2, seed=90_000 + i, residual=i % 2 == 0,
                fmt="nvfp4" if i % 4 >= 2 else "bf16", device="cpu")  # fmt: skip
    return h.make_case(**{**args, **kw})


_NVFP4: dict = {}


def measured_case(i: int) -> dict:
    """case(i), except that NVFP4 weights come from 8 per head count, quantized once (quantizing is most of
    a case's time on the CPU); the activations and everything else stay fresh per case."""
    c = case(i, fmt="bf16")
    if i % 4 < 2:
        return c
    key = (c["num_q_heads"], c["num_kv_heads"], i % 8)
    if key not in _NVFP4:
        w = h.make_case(1, *key[:2], False, seed=95_000 + i % 8, device="cpu")["weight"]
        packed, scales, gs = nvfp4.quantize(w)
        _NVFP4[key] = packed, scales, gs, nvfp4.dequantize(packed, scales, gs)
    c["weight"], c["weight_scale"], c["global_scale"], c["_w_dense"] = _NVFP4[key]
    return c


def worst_errors(c: dict) -> dict:
    """The emulated kernel's worst element of q, k and v over its head's RMS, as the checks compare them:
    q against the float64 reference, the BF16 caches' written values against expected_cache's."""
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    q, _ = emulate(c)
    ref = h.reference(c)
    m, nq = c["x"].shape[0], c["num_q_heads"]
    out = {"q": h.head_error(q.view(m, nq, h.D), ref["q"]).max().item()}
    ek, ev = expected_cache(kb, vb, ref["k"], ref["v"], c["slot_mapping"])
    for name, got, exp in (("k", c["k_cache"], ek), ("v", c["v_cache"], ev)):
        g, e = got.float().reshape(-1, h.D), exp.float().reshape(-1, h.D)
        rows = ~e.isnan().any(-1)
        out[name] = h.head_error(g[rows], e[rows]).max().item() if rows.any() else 0.0
    return out


@pytest.mark.parametrize("i", range(16))
def test_emulated_kernel_passes_check(i):
    """check() accepts what a correct kernel returns (emulated), for each head count, BF16 and NVFP4 weights,
    BF16 and FP8 caches, RoPE and residual on and off: the bound is not tighter than the arithmetic."""
    c = case(i, kv_dtype="fp8_e4m3" if i % 5 == 4 else "bf16")
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    q, r = emulate(c)
    h.check(c, q, r, kb, vb)
    if c["residual"] is None:
        assert r is c["x"]


def measure(n: int) -> dict:
    worst = {"q": 0.0, "k": 0.0, "v": 0.0}
    for i in range(n):
        for k, v in worst_errors(measured_case(i)).items():
            worst[k] = max(worst[k], v)
    return worst


# ----------------------------------------------------------------------------- planted values must fail
def emulated(i: int, **kw):
    """(case, q, residual_out, k_before, v_before) of a correct (emulated) call: check() passes on it."""
    c = case(i, **kw)
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    q, r = emulate(c)
    return c, q, r, kb, vb


def _spread(ref: torch.Tensor, target: float, seed: int) -> torch.Tensor:
    """bf16 q off ref (float64 [M, nq, 128]) by a relative Frobenius error of about `target`, spread evenly:
    every element off by about target x the tensor's RMS (random signs), far inside ELEMENT_TOL. The bf16
    rounding's own error e0 adds in quadrature: the planted part is sqrt(target^2 - e0^2)."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, ref.shape, generator=g).double() * 2 - 1
    e0 = h.rel(ref.bfloat16(), ref)
    return (ref + (target**2 - e0**2) ** 0.5 * ref.pow(2).mean().sqrt() * sign).bfloat16()


def test_check_passes_the_emulated_kernel_and_fails_planted_q():
    """q: a NaN, one element off by 1/5 of its head's RMS (inside the norm-wise bound), an error spread over
    every element just over the norm-wise bound (just under it passes); residual_out one ulp off."""
    c, q, r, kb, vb = emulated(4)
    m, nq = c["x"].shape[0], c["num_q_heads"]
    ref = h.reference(c)["q"]
    h.check(c, q, r, kb, vb)

    def fails(bad_q, match, bad_r=None):
        with pytest.raises(AssertionError, match=match):
            h.check(c, bad_q.reshape(m, nq * h.D), r if bad_r is None else bad_r, kb, vb)

    bad = q.clone().view(m, nq, h.D)
    bad[m - 1, nq - 1, 7] = float("nan")
    fails(bad, "written everywhere")
    # one wrong element: the norm-wise bound alone lets it through
    bad = q.clone().view(m, nq, h.D)
    t, hh, j = m // 2, nq // 2, 77
    bad[t, hh, j] += 0.2 * ref[t, hh].pow(2).mean().sqrt().item()
    assert h.rel(bad, ref) < 1e-2
    fails(bad, "ELEMENT_TOL")
    # an error spread over every element: just over the norm-wise bound fails, just under it passes
    over, under = _spread(ref, 1.02e-2, 1), _spread(ref, 0.98e-2, 2)
    assert 1e-2 < h.rel(over, ref) < 1.04e-2 and 0.96e-2 < h.rel(under, ref) < 1e-2
    assert h.head_error(over, ref).max() < h.ELEMENT_TOL
    fails(over, "q: relative error")
    h.check(c, under.reshape(m, nq * h.D), r, kb, vb)
    # residual_out: one element one ulp off
    assert c["residual"] is not None
    bad_r = r.clone()
    bad_r.view(torch.int16).view(-1)[5] += 1
    fails(q, None, bad_r=bad_r)


def test_check_fails_planted_cache_values():
    """BF16 caches: one element of a written slot off by 1/5 of its head's RMS, a NaN where a slot was
    written, a value written where no slot maps; FP8: one stored value a quarter too small."""
    c, q, r, kb, vb = emulated(4)
    h.check(c, q, r, kb, vb)
    bs, nkv = c["k_cache"].shape[1], c["num_kv_heads"]
    slot = int(c["slot_mapping"][0])
    good_k, good_v = c["k_cache"].clone(), c["v_cache"].clone()

    def fails(match):
        with pytest.raises(AssertionError, match=match):
            h.check(c, q, r, kb, vb)
        c["k_cache"].copy_(good_k)
        c["v_cache"].copy_(good_v)

    head = c["k_cache"][slot // bs, slot % bs, nkv - 1]
    head[3] += 0.2 * head.float().pow(2).mean().sqrt().item()
    fails("k_cache: .*ELEMENT_TOL")
    c["v_cache"][slot // bs, slot % bs, 0, 9] = float("nan")
    fails("v_cache: wrong set of elements written")
    free = next(s for s in range(c["k_cache"].shape[0] * bs) if s not in c["slot_mapping"].tolist())
    c["k_cache"][free // bs, free % bs] = 0.5
    fails("k_cache: wrong set of elements written")

    c, q, r, kb, vb = emulated(4, kv_dtype="fp8_e4m3", cache_u8=True)
    h.check(c, q, r, kb, vb)
    slot = int(c["slot_mapping"][0])
    head = c["v_cache"][slot // bs, slot % bs, 0]
    i = h.as_float(head).abs().argmax()  # the head's largest value, made a quarter smaller
    head[i] = (h.as_float(head[i]) * 0.75).to(torch.float8_e4m3fn).view(torch.uint8)
    with pytest.raises(AssertionError, match="v_cache slot .* e4m3 values off"):
        h.check(c, q, r, kb, vb)


def test_check_fails_without_the_residual_aliasing():
    """Without a residual, residual_out must be x itself: an equal copy fails."""
    c, q, r, kb, vb = emulated(4, residual=False)
    h.check(c, q, r, kb, vb)
    with pytest.raises(AssertionError, match="x itself"):
        h.check(c, q, r.clone(), kb, vb)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    w = measure(n)
    print(f"{n} cases: worst element over its head's RMS: " + ", ".join(f"{k} {v:.4g}" for k, v in w.items()))
    print(f"ELEMENT_TOL = {h.ELEMENT_TOL}: {h.ELEMENT_TOL / max(w.values()):.2f}x the worst")


def test_the_xn_bound_takes_a_one_ulp_shift_before_the_weight_and_nothing_more():
    """assert_xn_close: the reference itself passes, and so does xn computed from t moved by one bf16 ulp
    (what a differently ordered fp32 sum of squares can do), also where that makes xn 2 ulps off; an element
    moved 4 ulps is caught, as is a row of elements moved by one ulp each (the exact share)."""
    import pytest
    import torch

    from loader.reference import rms_norm_ref
    from tests.helpers import assert_xn_close, bf16_ulps

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 2048, generator=g) * 3).bfloat16()
    w = (1 + 0.5 * torch.randn(2048, generator=g)).bfloat16()
    ref, _ = rms_norm_ref(x, None, w, 1e-6)
    assert_xn_close(ref, x, None, w, 1e-6)
    xf = x.float()
    t = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    shifted = t.clone()
    shifted.view(torch.int16)[:, :2] += 1  # t one ulp up in two columns
    xn = (shifted.float() * w.float()).bfloat16()
    assert bf16_ulps(xn, ref).max().item() >= 1
    assert_xn_close(xn, x, None, w, 1e-6)
    bad = ref.clone()
    bad.view(torch.int16)[7, 100] += 4
    with pytest.raises(AssertionError, match="1 of"):
        assert_xn_close(bad, x, None, w, 1e-6)
    many = ref.clone()
    many.view(torch.int16)[:, : 2048 // 10] += 1
    with pytest.raises(AssertionError):
        assert_xn_close(many, x, None, w, 1e-6)

"""tests/helpers.py's number checks on the CPU: what a correct kernel returns passes them (the kernels'
arithmetic emulated by loader.reference in fp32, as the measurement of helpers.ELEMENT_TOL does).

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


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    w = measure(n)
    print(f"{n} cases: worst element over its head's RMS: " + ", ".join(f"{k} {v:.4g}" for k, v in w.items()))
    print(f"ELEMENT_TOL = {h.ELEMENT_TOL}: {h.ELEMENT_TOL / max(w.values()):.2f}x the worst")

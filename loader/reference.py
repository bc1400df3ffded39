"""The float64 torch reference of the op (docs/numerics.md): what every kernel's result is compared against,
by the tests, the benchmarks and `python -m loader.doctor`. Torch only; CPU or CUDA tensors.
"""

from __future__ import annotations

import torch

from loader.abi import E4M3_MAX, HALF_DIM, HEAD_DIM


def rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """The input RMSNorm (docs/numerics.md §1) with its bf16 roundings. Returns (xn, residual_out), both bf16.

    residual_out is bf16(x + residual), or ``x`` itself when residual is None.
    """
    if residual is not None:
        r = (x.float() + residual.float()).bfloat16()
    else:
        r = x
    rf = r.float()
    var = rf.pow(2).mean(dim=-1, keepdim=True)
    s = torch.rsqrt(var + eps)
    xn = ((rf * s).bfloat16().float() * weight.float()).bfloat16()
    return xn, r


def gemv_ref(xn: torch.Tensor, w: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """qkv[M, N] = xn @ w.T computed in ``dtype``, no rounding."""
    return xn.to(dtype) @ w.to(dtype).T


def qk_norm_rope_ref(
    qkv: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    qk_eps: float,
    cos_sin_cache: torch.Tensor | None,
    positions: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    round_qkv: bool = True,
    dtype: torch.dtype = torch.float64,
):
    """Per-head q/k RMSNorm (docs/numerics.md §3; norm weights None: none) + NeoX RoPE. Returns (q, k, v) in
    ``dtype``.

    q is [M, nq, 128], k and v are [M, nkv, 128]. When ``round_qkv`` the input is first rounded
    to bf16. ``cos_sin_cache`` None skips the rotation. v is the raw qkv v heads. No final rounding.
    """
    m = qkv.shape[0]
    nh = num_q_heads + 2 * num_kv_heads
    if qkv.numel() != m * nh * HEAD_DIM:
        raise ValueError(f"qkv has {qkv.numel()} elements, expected {m} x {nh} x {HEAD_DIM}")
    if round_qkv:
        qkv = qkv.bfloat16()
    heads = qkv.to(dtype).reshape(m, nh, HEAD_DIM)
    q = heads[:, :num_q_heads]
    k = heads[:, num_q_heads : num_q_heads + num_kv_heads]
    v = heads[:, num_q_heads + num_kv_heads :].clone()

    def _norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ms = h.pow(2).mean(dim=-1, keepdim=True)
        return h * torch.rsqrt(ms + qk_eps) * w.to(dtype)

    if q_norm_weight is not None:  # (None: no q/k norm, Llama's numerics)
        q = _norm(q, q_norm_weight)
        k = _norm(k, k_norm_weight)
    if cos_sin_cache is not None:
        table = cos_sin_cache[positions.long()].to(dtype)  # [M, 128]
        cos = table[:, None, :HALF_DIM]
        sin = table[:, None, HALF_DIM:]

        def _rope(y: torch.Tensor) -> torch.Tensor:
            y1, y2 = y[..., :HALF_DIM], y[..., HALF_DIM:]
            return torch.cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin), dim=-1)

        q = _rope(q)
        k = _rope(k)
    return q, k, v


def qkv_fused_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w_dense: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    qk_eps: float,
    cos_sin_cache: torch.Tensor | None,
    positions: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype = torch.float64,
) -> dict:
    """Whole chain: norm (bf16, exact) -> GEMV in ``dtype`` -> bf16 qkv -> q/k norm + RoPE.

    ``w_dense`` is the (dequantized) [N, K] weight. Returns dict(q, k, v, xn, residual_out);
    q, k, v are in ``dtype`` and not rounded.
    """
    xn, residual_out = rms_norm_ref(x, residual, norm_weight, eps)
    qkv = gemv_ref(xn, w_dense, dtype)
    q, k, v = qk_norm_rope_ref(
        qkv,
        q_norm_weight,
        k_norm_weight,
        qk_eps,
        cos_sin_cache,
        positions,
        num_q_heads,
        num_kv_heads,
        round_qkv=True,
        dtype=dtype,
    )
    return {"q": q, "k": k, "v": v, "xn": xn, "residual_out": residual_out}


def make_cos_sin_cache(max_pos: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """fp32 [max_pos, 128]; row p = cat(cos(p*theta), sin(p*theta)), theta_i = base^(-2i/128)."""
    i = torch.arange(HALF_DIM, dtype=torch.float64)
    theta = base ** (-2.0 * i / HEAD_DIM)
    p = torch.arange(max_pos, dtype=torch.float64)
    ang = p[:, None] * theta[None, :]
    table = torch.cat((torch.cos(ang), torch.sin(ang)), dim=-1).float()
    return table.to(device) if device is not None else table


def fp8_cache_value(v: torch.Tensor, scale) -> torch.Tensor:
    """What an FP8 (e4m3) cache holds for the value v (docs/numerics.md §4): v rounded to bf16 (the BF16
    cache's value), divided by the fp32 scale, rounded to nearest even e4m3, saturated to +-448; NaN stays
    NaN."""
    s = scale.float().reshape(()) if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    return (v.to(torch.bfloat16).float() / s.to(v.device)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def expected_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale=None,
    v_scale=None,
):
    """Clones of the caches with token t < len(slot_mapping), slot >= 0 written at
    [slot // block_size, slot % block_size]: k, v rounded to bf16, or for an FP8 cache (float8_e4m3fn, or
    uint8 meaning e4m3) to e4m3 with k_scale / v_scale (fp8_cache_value)."""
    kc = k_cache.clone()
    vc = v_cache.clone()
    block_size, nkv = k_cache.shape[1], k_cache.shape[2]
    m = k.shape[0]
    k3 = k.reshape(m, nkv, HEAD_DIM)
    v3 = v.reshape(m, nkv, HEAD_DIM)

    def cast(val, cache, scale):
        if cache.dtype not in (torch.float8_e4m3fn, torch.uint8):
            return val.to(cache.dtype)  # bf16 (a BF16 cache), or float (no rounding)
        e = fp8_cache_value(val, scale)
        return e.view(torch.uint8) if cache.dtype == torch.uint8 else e

    for t, slot in enumerate(slot_mapping.tolist()):
        if t >= m:
            break
        if slot < 0:
            continue
        b, o = divmod(int(slot), block_size)
        kc[b, o] = cast(k3[t], kc, k_scale)
        vc[b, o] = cast(v3[t], vc, v_scale)
    return kc, vc

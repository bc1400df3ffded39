"""Torch reference path for Flint's fused qkv op (SPEC §3) and the NVFP4 weight format (SPEC §4).

Torch only, device-agnostic: every function works on CPU and CUDA tensors. Used by tests and
benchmarks; never imports cutlass or any other project module.
"""

from __future__ import annotations

import torch

K = 2048
HEAD_DIM = 128

_HALF = HEAD_DIM // 2
_BLOCK = 16  # k values per NVFP4 block scale
_E4M3_MAX = 448.0
_E2M1_MAX = 6.0

E2M1_VALUES = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)

# Midpoints between consecutive e2m1 magnitudes, and whether a tie there goes to the upper code
# (the upper code is even exactly when the boundary index is odd).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ---------------------------------------------------------------------------------------------
# SPEC §3: input norm, GEMV, per-head q/k norm + RoPE, KV cache
# ---------------------------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """SPEC §3.1 with bf16 roundings. Returns (xn, residual_out), both bf16.

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
    """SPEC §3.3 per-head RMS norm + NeoX RoPE. Returns (q, k, v) in ``dtype``.

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
    k = heads[:, num_q_heads:num_q_heads + num_kv_heads]
    v = heads[:, num_q_heads + num_kv_heads:].clone()

    def _norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ms = h.pow(2).mean(dim=-1, keepdim=True)
        return h * torch.rsqrt(ms + qk_eps) * w.to(dtype)

    q = _norm(q, q_norm_weight)
    k = _norm(k, k_norm_weight)
    if cos_sin_cache is not None:
        table = cos_sin_cache[positions.long()].to(dtype)  # [M, 128]
        cos = table[:, None, :_HALF]
        sin = table[:, None, _HALF:]

        def _rope(y: torch.Tensor) -> torch.Tensor:
            y1, y2 = y[..., :_HALF], y[..., _HALF:]
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

    ``w_dense`` is the (dequantized) [N, 2048] weight. Returns dict(q, k, v, xn, residual_out);
    q, k, v are in ``dtype`` and not rounded.
    """
    xn, residual_out = rms_norm_ref(x, residual, norm_weight, eps)
    qkv = gemv_ref(xn, w_dense, dtype)
    q, k, v = qk_norm_rope_ref(
        qkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions,
        num_q_heads, num_kv_heads, round_qkv=True, dtype=dtype,
    )
    return {"q": q, "k": k, "v": v, "xn": xn, "residual_out": residual_out}


def make_cos_sin_cache(max_pos: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """fp32 [max_pos, 128]; row p = cat(cos(p*theta), sin(p*theta)), theta_i = base^(-2i/128)."""
    i = torch.arange(_HALF, dtype=torch.float64)
    theta = base ** (-2.0 * i / HEAD_DIM)
    p = torch.arange(max_pos, dtype=torch.float64)
    ang = p[:, None] * theta[None, :]
    table = torch.cat((torch.cos(ang), torch.sin(ang)), dim=-1).float()
    return table.to(device) if device is not None else table


def expected_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
):
    """Clones of the caches with token t < len(slot_mapping), slot >= 0 written at
    [slot // block_size, slot % block_size]; k, v rounded to the cache dtype."""
    kc = k_cache.clone()
    vc = v_cache.clone()
    block_size, nkv = k_cache.shape[1], k_cache.shape[2]
    m = k.shape[0]
    k3 = k.reshape(m, nkv, HEAD_DIM)
    v3 = v.reshape(m, nkv, HEAD_DIM)
    for t, slot in enumerate(slot_mapping.tolist()):
        if t >= m:
            break
        if slot < 0:
            continue
        b, o = divmod(int(slot), block_size)
        kc[b, o] = k3[t].to(kc.dtype)
        vc[b, o] = v3[t].to(vc.dtype)
    return kc, vc


# ---------------------------------------------------------------------------------------------
# SPEC §4: NVFP4
# ---------------------------------------------------------------------------------------------


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    raise TypeError(f"expected float8_e4m3fn or uint8 scales, got {t.dtype}")


def swizzle_offset(r: int, c: int, num_cols: int) -> int:
    """Byte offset of logical scale (r, c) in the 128x4-swizzled layout (SPEC §4)."""
    return ((r // 128) * (num_cols // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def swizzle_scales(scales_logical: torch.Tensor) -> torch.Tensor:
    """[R, C] scales (e4m3 or uint8) -> uint8 [R_pad, C] in the swizzled layout, zero padding."""
    s = _as_u8(scales_logical)
    if s.dim() != 2:
        raise ValueError(f"scales must be 2-D, got shape {tuple(s.shape)}")
    rows, cols = s.shape
    if cols % 4 != 0:
        raise ValueError(f"number of scale columns ({cols}) must be a multiple of 4")
    rows_pad = -(-rows // 128) * 128
    padded = torch.zeros((rows_pad, cols), dtype=torch.uint8, device=s.device)
    padded[:rows] = s
    # r = rb*128 + r4*32 + r32, c = cb*4 + c4  ->  storage order (rb, cb, r32, r4, c4)
    t = padded.view(rows_pad // 128, 4, 32, cols // 4, 4).permute(0, 3, 2, 1, 4)
    return t.contiguous().view(rows_pad, cols)


def unswizzle_scales(swizzled: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse of swizzle_scales: swizzled [R_pad, C] (e4m3 or uint8) -> uint8 [num_rows, C]."""
    s = _as_u8(swizzled)
    cols = s.shape[-1]
    if cols % 4 != 0:
        raise ValueError(f"number of scale columns ({cols}) must be a multiple of 4")
    rows_pad = -(-num_rows // 128) * 128
    if s.numel() < rows_pad * cols:
        raise ValueError(
            f"swizzled scales hold {s.numel()} bytes, need {rows_pad * cols} "
            f"({num_rows} rows padded to {rows_pad}, {cols} columns)"
        )
    flat = s.reshape(-1)[: rows_pad * cols]
    t = flat.view(rows_pad // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return t.reshape(rows_pad, cols)[:num_rows].contiguous()


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) -> uint8 [N, K//2]; low nibble = even k."""
    if codes.shape[-1] % 2 != 0:
        raise ValueError("last dimension must be even")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K//2] -> uint8 codes [N, K]."""
    p = packed.to(torch.uint8)
    lo = p & 0xF
    hi = p >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def _e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (ties to even code) of float values q, saturating at +-6."""
    a = q.abs()
    mag = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        up = (a >= mid) if i % 2 == 1 else (a > mid)
        mag += up.to(torch.uint8)
    sign = ((q < 0) & (mag != 0)).to(torch.uint8) << 3
    return mag | sign


def _scalar_tensor(v, device) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.reshape(-1)[:1].to(device)
    return torch.tensor([float(v)], dtype=torch.float32, device=device)


def quantize_nvfp4(w: torch.Tensor):
    """bf16 [N, K] -> (packed uint8 [N, K//2], swizzled e4m3 scales [N_pad, K//16], fp32 gs [1]).

    global_scale = amax / (6 * 448) (1.0 if amax == 0); block scale = e4m3(block_amax / 6 / gs);
    codes = nearest e2m1 (ties to even) of w / (scale * gs); zero-scale blocks give code 0.
    """
    n, k = w.shape
    if k % (_BLOCK * 4) != 0:
        raise ValueError(f"K ({k}) must be a multiple of {_BLOCK * 4}")
    wf = w.float()
    amax = wf.abs().amax().reshape(1)
    gs = torch.where(amax > 0, amax / (_E2M1_MAX * _E4M3_MAX), torch.ones_like(amax))
    blocks = wf.reshape(n, k // _BLOCK, _BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    scale_f = (block_amax / _E2M1_MAX / gs).clamp(max=_E4M3_MAX)
    scale_e4m3 = scale_f.to(torch.float8_e4m3fn)
    denom = scale_e4m3.float() * gs  # [N, K//16]
    nonzero = denom > 0
    q = blocks / torch.where(nonzero, denom, torch.ones_like(denom))[..., None]
    codes = _e2m1_encode(q)
    codes = torch.where(nonzero[..., None], codes, torch.zeros_like(codes)).reshape(n, k)
    packed = pack_e2m1(codes)
    scales = swizzle_scales(scale_e4m3).view(torch.float8_e4m3fn)
    return packed, scales, gs


def dequantize_nvfp4(
    packed: torch.Tensor,
    scales_swizzled: torch.Tensor,
    global_scale,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """[N, K] = e2m1(code) * e4m3(scale) * global_scale in ``dtype``."""
    n = packed.shape[0]
    codes = unpack_e2m1(packed)
    k = codes.shape[-1]
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=packed.device)
    vals = table[codes.long()]
    sc = unswizzle_scales(scales_swizzled, n).view(torch.float8_e4m3fn).to(dtype)
    if sc.shape[-1] * _BLOCK != k:
        raise ValueError(f"scales have {sc.shape[-1]} columns, expected K/16 = {k // _BLOCK}")
    gs = _scalar_tensor(global_scale, packed.device).to(dtype)
    return (vals.view(n, k // _BLOCK, _BLOCK) * sc[..., None]).reshape(n, k) * gs

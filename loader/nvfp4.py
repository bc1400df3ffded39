"""NVFP4 weights for the op (docs/nvfp4.md), in torch alone: quantize a BF16 weight, dequantize it, and
move block scales between the linear [N, K/16] layout that checkpoints store (ModelOpt NVFP4) and the
128x4-swizzled layout the kernels read in place.

    packed, scales, global_scale = loader.nvfp4.quantize(w_bf16)        # what loader.flint_qkv_fused takes
    scales = loader.nvfp4.swizzle_scales(checkpoint_scales)              # a checkpoint's linear e4m3 scales
    w = loader.nvfp4.dequantize(packed, scales, global_scale)            # float64 [N, K] (the reference)

Works on CPU and CUDA tensors.
"""

from __future__ import annotations

import torch

from loader.abi import E4M3_MAX, NVFP4_BLOCK

E2M1_MAX = 6.0
E2M1_VALUES = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
# Midpoints between consecutive e2m1 magnitudes; a tie goes to the even code (the upper one when the
# boundary index is odd).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    raise TypeError(f"expected float8_e4m3fn or uint8 scales, got {t.dtype}")


def swizzle_offset(r: int, c: int, num_cols: int) -> int:
    """Byte offset of logical scale (r, c) in the 128x4-swizzled layout (docs/nvfp4.md)."""
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


def quantize(w: torch.Tensor):
    """bf16 [N, K] -> (packed uint8 [N, K//2], swizzled e4m3 scales [N_pad, K//16], fp32 gs [1]).

    global_scale = amax / (6 * 448) (1.0 if amax == 0); block scale = e4m3(block_amax / 6 / gs);
    codes = nearest e2m1 (ties to even) of w / (scale * gs); zero-scale blocks give code 0.
    """
    n, k = w.shape
    if k % (NVFP4_BLOCK * 4) != 0:
        raise ValueError(f"K ({k}) must be a multiple of {NVFP4_BLOCK * 4}")
    wf = w.float()
    amax = wf.abs().amax().reshape(1)
    gs = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
    blocks = wf.reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    scale_f = (block_amax / E2M1_MAX / gs).clamp(max=E4M3_MAX)
    scale_e4m3 = scale_f.to(torch.float8_e4m3fn)
    denom = scale_e4m3.float() * gs  # [N, K//16]
    nonzero = denom > 0
    q = blocks / torch.where(nonzero, denom, torch.ones_like(denom))[..., None]
    codes = _e2m1_encode(q)
    codes = torch.where(nonzero[..., None], codes, torch.zeros_like(codes)).reshape(n, k)
    packed = pack_e2m1(codes)
    scales = swizzle_scales(scale_e4m3).view(torch.float8_e4m3fn)
    return packed, scales, gs


def dequantize(
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
    if sc.shape[-1] * NVFP4_BLOCK != k:
        raise ValueError(f"scales have {sc.shape[-1]} columns, expected K/16 = {k // NVFP4_BLOCK}")
    gs = _scalar_tensor(global_scale, packed.device).to(dtype)
    return (vals.view(n, k // NVFP4_BLOCK, NVFP4_BLOCK) * sc[..., None]).reshape(n, k) * gs

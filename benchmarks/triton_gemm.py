"""A plain Triton GEMM for decode shapes: y[M, N] = x[M, K] @ W[N, K]^T, the peer that bench_qkv.py puts
beside the fused op (no PDL, no fusion: what a user who writes one Triton kernel for the projection gets).

One program per BLOCK_N weight rows; the M tokens padded (masked loads, zero fill) to a power of two >= 16 as
the dot's N (tl.dot needs >= 16); K in tiles of BLOCK_K; the weights loaded `.cg` with evict_first (read
once, do not keep them in L1/L2), x with the default policy (every program reads it); `stages` pipeline
stages. With split_k > 1, split_k programs per row block each reduce a contiguous K / split_k and add their
fp32 partial sums atomically into a zeroed fp32 workspace, which is then cast to y's dtype.

    from benchmarks.triton_gemm import CONFIGS, gemm
    gemm(x, w, y, CONFIGS[0])           # y = x @ w.T (x, w, y on one CUDA device; y's dtype: any float)

The kernel is dtype-generic (x and W of one 16-bit float type). Triton's CPU interpreter (TRITON_INTERPRET=1,
set before this module is imported) runs it for float16 but not bfloat16: its tl.dot multiplies bfloat16's
raw bits (triton 3.9), so the CPU test (tests/test_triton_gemm_cpu.py) uses float16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Config:
    block_n: int  # weight rows per program (the dot's M)
    block_k: int  # K per tile
    stages: int  # software-pipeline stages
    split_k: int  # programs per row block over K (> 1: fp32 atomics into a workspace, then a cast)
    warps: int = 4

    def __str__(self):
        return f"n{self.block_n}-k{self.block_k}-s{self.stages}-split{self.split_k}"


# The sweep bench_qkv.py times per row (BLOCK_N x BLOCK_K x stages x split). Shared memory per stage is
# (block_n + tokens) * block_k * 2 bytes: at 64 tokens the largest, n64-k256, fits 3 stages (192 KiB).
CONFIGS = (
    Config(32, 128, 4, 1),
    Config(32, 256, 3, 1),
    Config(64, 128, 4, 1),
    Config(64, 256, 3, 1),
    Config(32, 256, 3, 2),
    Config(64, 128, 4, 2),
    Config(64, 256, 3, 2),
    Config(32, 128, 4, 4),
    Config(64, 128, 4, 4),
)


def token_block(m: int) -> int:
    """The dot's N for m tokens: the next power of two, at least 16."""
    return max(16, triton.next_power_of_2(m))


@triton.jit(do_not_specialize=["M"])  # one compile per token block, not per M
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K_PER_SPLIT, stride_x, stride_w, stride_y,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 ATOMIC: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    tok_ok = toks < M
    k_lo = tl.program_id(1) * K_PER_SPLIT
    w_ptrs = w_ptr + rows[:, None] * stride_w + (k_lo + ks)[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + toks[None, :] * stride_x + (k_lo + ks)[:, None]  # [BLOCK_K, BLOCK_M]: x transposed
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, K_PER_SPLIT, BLOCK_K):  # (K_PER_SPLIT is a multiple of BLOCK_K: no K mask)
        w = tl.load(w_ptrs, mask=row_ok[:, None], other=0.0, cache_modifier=".cg",
                    eviction_policy="evict_first")  # fmt: skip
        xt = tl.load(x_ptrs, mask=tok_ok[None, :], other=0.0)  # the padded tokens read as zeros
        acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = y_ptr + toks[None, :] * stride_y + rows[:, None]  # acc[n, m] is y[m, n]
    mask = row_ok[:, None] & tok_ok[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def check_args(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: Config, workspace=None) -> None:
    """ValueError/TypeError naming the argument when gemm(x, w, y, cfg, workspace) cannot run as asked."""
    if x.dim() != 2 or w.dim() != 2 or y.dim() != 2:
        raise ValueError(f"x, w and y must be 2-D, got {x.dim()}-D, {w.dim()}-D and {y.dim()}-D")
    (m, k), n = x.shape, w.shape[0]
    if m < 1 or w.shape[1] != k or tuple(y.shape) != (m, n):
        raise ValueError(f"need x [M, K], w [N, K], y [M, N] with M >= 1; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}, y {tuple(y.shape)}")  # fmt: skip
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise TypeError(f"x and w must both be bfloat16 or both float16, got {x.dtype} and {w.dtype}")
    if not y.dtype.is_floating_point:
        raise TypeError(f"y must be a floating-point tensor, got {y.dtype}")
    if x.stride(1) != 1 or w.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("x, w and y must be contiguous along their last dimension (call .contiguous())")
    if k % (cfg.block_k * cfg.split_k):
        raise ValueError(f"K = {k} must be a multiple of block_k * split_k = {cfg.block_k * cfg.split_k} "
                         f"for config {cfg}; pick another config")  # fmt: skip
    if len({x.device, w.device, y.device}) != 1:
        raise ValueError(f"x, w and y must be on one device, got {x.device}, {w.device}, {y.device}")
    if cfg.split_k > 1 and workspace is not None:
        if workspace.dtype != torch.float32 or workspace.shape != (m, n) or not workspace.is_contiguous():
            raise ValueError(f"workspace must be a contiguous float32 [{m}, {n}] tensor (or None)")


def gemm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: Config, workspace=None) -> torch.Tensor:
    """y = x @ w.T with config cfg, written into y and returned. A split-K config zeroes and fills workspace
    (float32 [M, N], allocated here when None; pass one to keep a captured CUDA graph allocation-free)."""
    check_args(x, w, y, cfg, workspace)
    (m, k), n = x.shape, w.shape[0]
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    meta = dict(BLOCK_N=cfg.block_n, BLOCK_M=token_block(m), BLOCK_K=cfg.block_k, num_warps=cfg.warps,
                num_stages=cfg.stages)  # fmt: skip
    if cfg.split_k == 1:
        _gemm_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), ATOMIC=False, **meta)
        return y
    acc = torch.empty(m, n, dtype=torch.float32, device=x.device) if workspace is None else workspace
    acc.zero_()
    _gemm_kernel[grid](x, w, acc, m, n, k // cfg.split_k, x.stride(0), w.stride(0), acc.stride(0),
                       ATOMIC=True, **meta)  # fmt: skip
    y.copy_(acc)
    return y

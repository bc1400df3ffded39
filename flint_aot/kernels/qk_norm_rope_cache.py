"""Standalone per-head q/k RMSNorm + NeoX RoPE + paged KV-cache write (the unfused path,
docs/numerics.md §3-§4)
on a bf16 qkv [M, N] (the standalone GEMV's output).

One CTA of 128 threads (thread = dim) per head, q heads then k heads then v heads; all M tokens at once
(loads of every token first, one reduction round, one RoPE exchange). Same numerics as the fused kernel's
epilogue (device.rotate, device.store_cache) except the order of the per-head sum of squares (here: warp
butterflies, then warps 0..3), so q/k may differ from the fused op by one bf16 ulp; v is copied unchanged
(bit-identical), and an FP8 cache gets the same bytes from the same bf16 values. Memory safety as the fused
kernel. PDL: releases its dependents at entry, reads the norm weights, then waits for the GEMV."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot.kernels import device
from flint_aot.kernels.compile import compile_kernel
from loader.abi import HEAD_DIM, MAX_M

THREADS = HEAD_DIM
WARPS = THREADS // 32


def make_kernel(rope: bool, fp8: bool):
    @cute.kernel
    def qk_norm_rope_cache(
        qkv: cute.Pointer, q_norm_weight: cute.Pointer, k_norm_weight: cute.Pointer,
        cos_sin_cache: cute.Pointer, positions: cute.Pointer, slot_mapping: cute.Pointer, q: cute.Pointer,
        k_cache: cute.Pointer, v_cache: cute.Pointer, k_scale: cute.Pointer, v_scale: cute.Pointer,
        m: Int32, num_q_heads: Int32, num_kv_heads: Int32, num_slot_mapping: Int32, max_pos: Int32,
        block_size: Int32, num_cache_slots: Int64, stride_block: Int64, stride_slot: Int64,
        stride_head: Int64, qk_eps: Float32,
    ):  # fmt: skip
        dim, _, _ = cute.arch.thread_idx()
        head, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        nq, nkv = num_q_heads, num_kv_heads
        warp = dim // 32
        n = (nq + 2 * nkv) * HEAD_DIM
        qw = cute.make_tensor(q_norm_weight, cute.make_layout(HEAD_DIM))
        kw = cute.make_tensor(k_norm_weight, cute.make_layout(HEAD_DIM))
        wn = Float32(cutlass.select_(head < nq, qw[dim].to(Float32), kw[dim].to(Float32)))
        red = cute.make_tensor(cute.arch.alloc_smem(Float32, WARPS * MAX_M, alignment=16),
                               cute.make_layout(WARPS * MAX_M))  # fmt: skip
        yb = cute.make_tensor(cute.arch.alloc_smem(Float32, MAX_M * HEAD_DIM, alignment=16),
                              cute.make_layout(MAX_M * HEAD_DIM))  # fmt: skip
        st = cute.make_tensor(slot_mapping, cute.make_layout(MAX_M))
        pt = cute.make_tensor(positions, cute.make_layout(MAX_M))
        cute.arch.griddepcontrol_wait()
        # every load of every token first (tokens >= m read token m - 1 and are never stored), so the
        # latencies overlap; then one reduction round and one exchange for all tokens
        xh = qkv + head * HEAD_DIM
        hs = [cute.make_tensor(xh + cutlass.min(t, m - 1) * n, cute.make_layout(HEAD_DIM))[dim]
              for t in range(MAX_M)]  # fmt: skip
        sl = []
        for t in cutlass.range_constexpr(MAX_M):
            slot = Int64(-1)
            if t < num_slot_mapping:
                slot = st[t]
            sl.append(slot)
        ks = Float32(1.0)
        vs = Float32(1.0)
        if cutlass.const_expr(fp8):
            ks = device.at(k_scale, 0)[0]
            vs = device.at(v_scale, 0)[0]
        geom = (num_cache_slots, block_size, stride_block, stride_slot, stride_head)
        if head >= nq + nkv:
            for t in cutlass.range_constexpr(MAX_M):
                if t < m:
                    device.store_cache(v_cache, sl[t], *geom, head - (nq + nkv), dim, hs[t], fp8, vs)
        else:
            oks, cos, sins = [], [], []
            if cutlass.const_expr(rope):
                for t in cutlass.range_constexpr(MAX_M):
                    ok, c, sn = device.rope_coeffs(cos_sin_cache, pt[cutlass.min(t, m - 1)], max_pos, dim)
                    oks.append(ok)
                    cos.append(c)
                    sins.append(sn)
            hv = [h.to(Float32) for h in hs]
            # the work of tokens >= m is skipped (uniform branches): at M = 1 this kernel's tail is one token
            for t in cutlass.range_constexpr(MAX_M):
                if t < m:
                    ss = cute.arch.warp_reduction_sum(hv[t] * hv[t])
                    if dim % 32 == 0:
                        red[warp * MAX_M + t] = ss
            cute.arch.sync_threads()
            ys = []
            for t in cutlass.range_constexpr(MAX_M):
                y = Float32(0.0)
                if t < m:
                    tot = red[t]
                    for j in cutlass.range_constexpr(1, WARPS):
                        tot = tot + red[j * MAX_M + t]
                    inv = cute.math.rsqrt(tot * Float32(1.0 / HEAD_DIM) + qk_eps)
                    y = hv[t] * inv * wn
                    if cutlass.const_expr(rope):
                        yb[t * HEAD_DIM + dim] = y
                ys.append(y)
            if cutlass.const_expr(rope):
                cute.arch.sync_threads()
                for t in cutlass.range_constexpr(MAX_M):
                    y = ys[t]
                    if t < m:
                        y = device.rotate(ys[t], yb[t * HEAD_DIM + (dim ^ (HEAD_DIM // 2))], oks[t], cos[t],
                                          sins[t], dim)  # fmt: skip
                    ys[t] = y
            for t in cutlass.range_constexpr(MAX_M):
                if t < m:
                    yt = ys[t].to(BFloat16)
                    if head < nq:
                        device.at(q, t * (nq * HEAD_DIM) + head * HEAD_DIM + dim)[0] = yt
                    else:
                        device.store_cache(k_cache, sl[t], *geom, head - nq, dim, yt, fp8, ks)

    return qk_norm_rope_cache


def kernel(spec: dict):
    return make_kernel(bool(spec["rope"]), spec.get("kv_cache_dtype", "bf16") == "fp8_e4m3")


def ptr_types(spec: dict) -> dict:
    """Element type and assumed alignment (bytes) of the pointers that are not bf16 16-byte aligned."""
    cache = (cutlass.Uint8, 1) if spec.get("kv_cache_dtype", "bf16") == "fp8_e4m3" else (BFloat16, 2)
    return {"cos_sin_cache": (Float32, 16), "positions": (Int64, 8), "slot_mapping": (Int64, 8),
            "k_cache": cache, "v_cache": cache, "k_scale": (Float32, 4), "v_scale": (Float32, 4)}  # fmt: skip


def compile(spec: dict, arch: str, entry_prefix: str):
    return compile_kernel(kernel(spec), kind="qk_norm_rope_cache", arch=arch, entry_prefix=entry_prefix,
                          block=(THREADS, 1, 1), ptr_types=ptr_types(spec))  # fmt: skip

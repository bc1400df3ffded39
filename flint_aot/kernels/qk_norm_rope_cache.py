"""Standalone per-head q/k RMSNorm + NeoX RoPE + paged KV-cache write (the unfused path,
docs/numerics.md §3-§4)
on a bf16 qkv [M, N] (the standalone GEMV's output).

One CTA of 128 threads (thread = dim) per head, q heads then k heads then v heads; the M <= 64 tokens in
chunks of 16, each chunk at once (loads of its tokens first, one reduction round, one RoPE exchange; the work
of tokens >= M is skipped by uniform branches). Same numerics as the fused kernel's
epilogue (device.rotate, device.store_cache) except the order of the per-head sum of squares (here: warp
butterflies, then warps 0..3), so q/k may differ from the fused op by one bf16 ulp; v is copied unchanged
(bit-identical), and an FP8 cache gets the same bytes from the same bf16 values. Memory safety as the fused
kernel. PDL: releases its dependents at entry, reads the norm weights, then waits for the GEMV."""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot.kernels import device
from flint_aot.kernels.compile import Kernel
from flint_aot.kernels.diagnostics import SERVING, Diagnostics
from loader.abi import HEAD_DIM

THREADS = HEAD_DIM
WARPS = THREADS // 32
CHUNK = 16  # tokens per round


class QkNormRopeCacheKernel(Kernel):
    """The standalone per-head stage of one specialization: RoPE on/off and the cache dtype, set once."""

    kind, block = "qk_norm_rope_cache", (THREADS, 1, 1)

    def __init__(self, spec: dict, arch: str, diag: Diagnostics = SERVING):
        self.arch, self.diag = arch, diag
        self.rope = bool(spec["rope"])
        self.fp8 = spec.get("kv_cache_dtype", "bf16") == "fp8_e4m3"

    @cute.kernel
    def kernel(
        self, qkv: cute.Pointer, q_norm_weight: cute.Pointer, k_norm_weight: cute.Pointer,
        cos_sin_cache: cute.Pointer, positions: cute.Pointer, slot_mapping: cute.Pointer, q: cute.Pointer,
        k_cache: cute.Pointer, v_cache: cute.Pointer, k_scale: cute.Pointer, v_scale: cute.Pointer,
        m: Int32, num_q_heads: Int32, num_kv_heads: Int32, num_slot_mapping: Int32, max_pos: Int32,
        block_size: Int32, num_cache_slots: Int64, stride_block: Int64, stride_slot: Int64,
        stride_head: Int64, qk_eps: Float32,
    ):  # fmt: skip
        a = SimpleNamespace(**{k: v for k, v in locals().items() if k != "self"})  # the parameters, by name
        dim, _, _ = cute.arch.thread_idx()
        head, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        qw = cute.make_tensor(q_norm_weight, cute.make_layout(HEAD_DIM))
        kw = cute.make_tensor(k_norm_weight, cute.make_layout(HEAD_DIM))
        wn = Float32(cutlass.select_(head < num_q_heads, qw[dim].to(Float32), kw[dim].to(Float32)))
        red = cute.make_tensor(cute.arch.alloc_smem(Float32, WARPS * CHUNK, alignment=16),
                               cute.make_layout(WARPS * CHUNK))  # fmt: skip
        yb = cute.make_tensor(cute.arch.alloc_smem(Float32, CHUNK * HEAD_DIM, alignment=16),
                              cute.make_layout(CHUNK * HEAD_DIM))  # fmt: skip
        cute.arch.griddepcontrol_wait()
        t = SimpleNamespace(dim=dim, head=head, warp=dim // 32)
        ks = Float32(1.0)
        vs = Float32(1.0)
        if cutlass.const_expr(self.fp8):
            ks = device.at(a.k_scale, 0)[0]
            vs = device.at(a.v_scale, 0)[0]
        for c0 in range(0, m, CHUNK):  # tokens c0 .. c0 + 15
            cute.arch.sync_threads()  # (the previous chunk's readers of red and yb are done)
            x = self.loads(a, t, c0, ks, vs)
            if head >= num_q_heads + num_kv_heads:
                self.v_head(a, t, x, c0)
            else:
                self.qk_head(a, t, x, c0, wn, red, yb)

    @cute.jit
    def loads(self, a, t, c0, ks, vs):
        """Every token's value of this dim and slot in the chunk first (tokens >= m read token m - 1 and are
        never stored), so the latencies overlap."""
        n = (a.num_q_heads + 2 * a.num_kv_heads) * HEAD_DIM
        xh = a.qkv + t.head * HEAD_DIM
        hs = [cute.make_tensor(xh + cutlass.min(c0 + tok, a.m - 1) * n, cute.make_layout(HEAD_DIM))[t.dim]
              for tok in range(CHUNK)]  # fmt: skip
        sl = []
        for tok in cutlass.range_constexpr(CHUNK):
            slot = Int64(-1)
            if c0 + tok < a.num_slot_mapping:
                slot = device.at(a.slot_mapping, c0 + tok)[0]
            sl.append(slot)
        return SimpleNamespace(h=hs, slot=sl, k_scale=ks, v_scale=vs)

    def geometry(self, a):
        return a.num_cache_slots, a.block_size, a.stride_block, a.stride_slot, a.stride_head

    @cute.jit
    def v_head(self, a, t, x, c0):
        """v: the bf16 values copied to the cache unchanged."""
        for tok in cutlass.range_constexpr(CHUNK):
            if c0 + tok < a.m:
                device.store_cache(a.v_cache, x.slot[tok], *self.geometry(a), t.head - (a.num_q_heads +
                                   a.num_kv_heads), t.dim, x.h[tok], self.fp8, x.v_scale)  # fmt: skip

    @cute.jit
    def qk_head(self, a, t, x, c0, wn, red, yb):
        """q/k: per token the head's sum of squares (warp butterflies, then warps 0..3 in order), the RMSNorm,
        NeoX RoPE with the partner dim through shared memory, one bf16 rounding; q stored or k cached."""
        oks, cos, sins = [], [], []
        if cutlass.const_expr(self.rope):
            for tok in cutlass.range_constexpr(CHUNK):
                p = device.at(a.positions, cutlass.min(c0 + tok, a.m - 1))[0]
                ok, c, sn = device.rope_coeffs(a.cos_sin_cache, p, a.max_pos, t.dim)
                oks.append(ok)
                cos.append(c)
                sins.append(sn)
        hv = [h.to(Float32) for h in x.h]
        for tok in cutlass.range_constexpr(CHUNK):
            if c0 + tok < a.m:
                ss = cute.arch.warp_reduction_sum(hv[tok] * hv[tok])
                if t.dim % 32 == 0:
                    red[t.warp * CHUNK + tok] = ss
        cute.arch.sync_threads()
        ys = []
        for tok in cutlass.range_constexpr(CHUNK):
            y = Float32(0.0)
            if c0 + tok < a.m:
                tot = red[tok]
                for j in cutlass.range_constexpr(1, WARPS):
                    tot = tot + red[j * CHUNK + tok]
                inv = cute.math.rsqrt(tot * Float32(1.0 / HEAD_DIM) + a.qk_eps)
                y = hv[tok] * inv * wn
                if cutlass.const_expr(self.rope):
                    yb[tok * HEAD_DIM + t.dim] = y
            ys.append(y)
        if cutlass.const_expr(self.rope):
            cute.arch.sync_threads()
            for tok in cutlass.range_constexpr(CHUNK):
                y = ys[tok]
                if c0 + tok < a.m:
                    y = device.rotate(ys[tok], yb[tok * HEAD_DIM + (t.dim ^ (HEAD_DIM // 2))], oks[tok],
                                      cos[tok], sins[tok], t.dim)  # fmt: skip
                ys[tok] = y
        nq = a.num_q_heads
        for tok in cutlass.range_constexpr(CHUNK):
            if c0 + tok < a.m:
                yt = ys[tok].to(BFloat16)
                if t.head < nq:
                    device.put(a.q, (c0 + tok) * (nq * HEAD_DIM) + t.head * HEAD_DIM + t.dim, yt)
                else:
                    device.store_cache(a.k_cache, x.slot[tok], *self.geometry(a), t.head - nq, t.dim, yt,
                                       self.fp8, x.k_scale)  # fmt: skip

    def ptr_types(self) -> dict:
        """Element type and assumed alignment (bytes) of the pointers that are not bf16 16-byte aligned."""
        cache = (cutlass.Uint8, 1) if self.fp8 else (BFloat16, 2)
        return {"cos_sin_cache": (Float32, 16), "positions": (Int64, 8), "slot_mapping": (Int64, 8),
                "k_cache": cache, "v_cache": cache, "k_scale": (Float32, 4),
                "v_scale": (Float32, 4)}  # fmt: skip


KERNEL = QkNormRopeCacheKernel

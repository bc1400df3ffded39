"""Standalone per-head q/k RMSNorm + NeoX RoPE + paged KV-cache write (the unfused path, SPEC §3.3) on a
bf16 qkv [M, N] (the standalone GEMV's output).

One CTA of 128 threads (thread = dim) per head, q heads then k heads then v heads; all M tokens at once
(loads of every token first, one reduction round, one RoPE exchange). Same numerics as the
fused kernel's epilogue (y = h * rsqrt(mean(h²) + eps) * w in fp32, the same RoPE expression, one bf16
rounding) except the order of the per-head sum of squares (here: warp butterflies, then warps 0..3), so q/k
may differ from the fused op by one bf16 ulp; v is copied unchanged (bit-identical). Memory safety as the
fused kernel: a position outside the table gives NaN for that token's q/k, a slot outside the cache is
not written. PDL: releases its dependents at entry, reads the norm weights, then waits for the GEMV."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot.kernels import common, qkv

HEAD_DIM = qkv.HEAD_DIM
HALF = HEAD_DIM // 2
THREADS = HEAD_DIM
WARPS = THREADS // 32
M8 = 8

PARAMS = (
    ("qkv", "ptr"),
    ("q_norm_weight", "ptr"),
    ("k_norm_weight", "ptr"),
    ("cos_sin_cache", "ptr"),
    ("positions", "ptr"),
    ("slot_mapping", "ptr"),
    ("q", "ptr"),
    ("k_cache", "ptr"),
    ("v_cache", "ptr"),
    ("m", "i32"),
    ("num_q_heads", "i32"),
    ("num_kv_heads", "i32"),
    ("num_slot_mapping", "i32"),
    ("max_pos", "i32"),
    ("block_size", "i32"),
    ("num_cache_slots", "i64"),
    ("stride_block", "i64"),
    ("stride_slot", "i64"),
    ("stride_head", "i64"),
    ("qk_eps", "f32"),
)
PTR_DTYPES = {"cos_sin_cache": Float32, "positions": Int64, "slot_mapping": Int64}


def make_kernel(rope: bool, entry_prefix: str):
    @cute.kernel
    def qkn(
        x: cute.Pointer, qnw: cute.Pointer, knw: cute.Pointer, cs: cute.Pointer, pos: cute.Pointer,
        slots: cute.Pointer, q: cute.Pointer, kc: cute.Pointer, vc: cute.Pointer,
        m: Int32, nq: Int32, nkv: Int32, nsm: Int32, max_pos: Int32, bs: Int32, nslots: Int64,
        s0: Int64, s1: Int64, s2: Int64, eps: Float32,
    ):  # fmt: skip
        dim, _, _ = cute.arch.thread_idx()
        head, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        warp = dim // 32
        n = (nq + 2 * nkv) * HEAD_DIM
        qw = cute.make_tensor(qnw, cute.make_layout(HEAD_DIM))
        kw = cute.make_tensor(knw, cute.make_layout(HEAD_DIM))
        wn = Float32(cutlass.select_(head < nq, qw[dim].to(Float32), kw[dim].to(Float32)))
        red = cute.make_tensor(cute.arch.alloc_smem(Float32, WARPS * M8, alignment=16),
                               cute.make_layout(WARPS * M8))  # fmt: skip
        yb = cute.make_tensor(cute.arch.alloc_smem(Float32, M8 * HEAD_DIM, alignment=16),
                              cute.make_layout(M8 * HEAD_DIM))  # fmt: skip
        st = cute.make_tensor(slots, cute.make_layout(M8))
        pt = cute.make_tensor(pos, cute.make_layout(M8))
        cute.arch.griddepcontrol_wait()
        # every load of every token first (tokens >= m read token m - 1 and are never stored), so the
        # latencies overlap; then one reduction round and one exchange for all tokens
        xh = x + head * HEAD_DIM
        hs = [cute.make_tensor(xh + cutlass.min(t, m - 1) * n, cute.make_layout(HEAD_DIM))[dim]
              for t in range(M8)]  # fmt: skip
        sl = []
        for t in cutlass.range_constexpr(M8):
            slot = Int64(-1)
            if t < nsm:
                slot = st[t]
            sl.append(slot)
        if head >= nq + nkv:
            for t in cutlass.range_constexpr(M8):
                if t < m:
                    qkv._store_cache(vc, sl[t], nslots, bs, s0, s1, s2, head - (nq + nkv), dim, hs[t])
        else:
            oks, cos, sins = [], [], []
            if cutlass.const_expr(rope):
                for t in cutlass.range_constexpr(M8):
                    p = pt[cutlass.min(t, m - 1)]
                    ok = p >= 0 and p < max_pos
                    row = Int64(cutlass.select_(ok, p, Int64(0))) * HEAD_DIM + dim % HALF
                    oks.append(ok)
                    cos.append(qkv._at(cs, row)[0])
                    sins.append(qkv._at(cs, row + HALF)[0])
            hv = [h.to(Float32) for h in hs]
            # the work of tokens >= m is skipped (uniform branches): at M = 1 this kernel's tail is one token
            for t in cutlass.range_constexpr(M8):
                if t < m:
                    ss = cute.arch.warp_reduction_sum(hv[t] * hv[t])
                    if dim % 32 == 0:
                        red[warp * M8 + t] = ss
            cute.arch.sync_threads()
            ys = []
            for t in cutlass.range_constexpr(M8):
                y = Float32(0.0)
                if t < m:
                    tot = red[t]
                    for j in cutlass.range_constexpr(1, WARPS):
                        tot = tot + red[j * M8 + t]
                    inv = cute.math.rsqrt(tot * Float32(1.0 / HEAD_DIM) + eps)
                    y = hv[t] * inv * wn
                    if cutlass.const_expr(rope):
                        yb[t * HEAD_DIM + dim] = y
                ys.append(y)
            if cutlass.const_expr(rope):
                cute.arch.sync_threads()
                sign = Float32(cutlass.select_(dim < HALF, Float32(-1.0), Float32(1.0)))
                for t in cutlass.range_constexpr(M8):
                    y = ys[t]
                    if t < m:
                        yp = yb[t * HEAD_DIM + (dim ^ HALF)]
                        r = ys[t] * cos[t] + sign * yp * sins[t]
                        y = Float32(cutlass.select_(oks[t], r, Float32(float("nan"))))
                    ys[t] = y
            for t in cutlass.range_constexpr(M8):
                if t < m:
                    if head < nq:
                        qkv._at(q, t * (nq * HEAD_DIM) + head * HEAD_DIM + dim)[0] = ys[t].to(BFloat16)
                    else:
                        yt = ys[t].to(BFloat16)
                        qkv._store_cache(kc, sl[t], nslots, bs, s0, s1, s2, head - nq, dim, yt)

    qkn.set_name_prefix(entry_prefix, remove_cutlass_symbol=True, keep_mangled_name=False)

    @cute.jit
    def host(
        x: cute.Pointer, qnw: cute.Pointer, knw: cute.Pointer, cs: cute.Pointer, pos: cute.Pointer,
        slots: cute.Pointer, q: cute.Pointer, kc: cute.Pointer, vc: cute.Pointer,
        m: Int32, nq: Int32, nkv: Int32, nsm: Int32, max_pos: Int32, bs: Int32, nslots: Int64,
        s0: Int64, s1: Int64, s2: Int64, eps: Float32, stream,
    ):  # fmt: skip
        k = qkn(x, qnw, knw, cs, pos, slots, q, kc, vc, m, nq, nkv, nsm, max_pos, bs, nslots, s0, s1, s2, eps)
        k.launch(grid=[nq + 2 * nkv, 1, 1], block=[THREADS, 1, 1], use_pdl=True, stream=stream)

    return host


def compile(spec: dict, arch: str, entry_prefix: str) -> common.Compiled:
    host = make_kernel(bool(spec["rope"]), entry_prefix)
    args = common.fake_args(PARAMS, BFloat16, PTR_DTYPES)
    return common.compile_host(
        host, args, arch=arch, params=PARAMS, block=(THREADS, 1, 1), cluster=(1, 1, 1),
        grid=("HEADS", 1, 1), dyn_smem=0,
    )  # fmt: skip

"""Standalone per-head q/k RMSNorm + NeoX RoPE + paged KV-cache write (the unfused path, docs/numerics.md
§3-§4) on a bf16 qkv [M, N] (the standalone GEMV's output, or any GEMM's), for any M the loader allows (a
decode step or a prefill chunk; docs/kernels.md §4).

Grid (ceil(HEADS / 4), ceil(M / 8)): a CTA of 128 threads takes 4 heads (q heads, then k heads, then v heads)
of 8 tokens; each half-warp one token, for the 4 heads one after another, lane l the dims 8 l .. 8 l + 7
(one 16-byte load of qkv a head): the token's slot (and its place in the caches), position and cos|sin row
are read once for its 4 heads, and the 4 heads' loads are issued before any is used. A q/k head's sum of
squares is the fused kernel's, bit for bit (epilogue.HeadEpilogue: each 16-dim block's butterfly, here three
adds in the lane and lane ^ 1, then the 8 blocks in order), and so are its RMSNorm, RoPE (the partner dim
^ 64 in lane ^ 8) and rounding: the unfused path gives the fused op's bits. v is copied; an FP8 cache gets
e4m3(value / scale) of the same bf16 values. Tokens past M compute token M - 1's values (so no lane leaves
a shuffle) and store nothing; heads past the last are loaded as the last one and left alone; a slot outside
the cache is not written; a position outside the table gives that token's q/k NaN. PDL: releases its
dependents at entry, reads the norm weights, then waits for the producer of qkv. Without q/k norm
(`qk_norm: false`, Llama's numerics) q and k go to RoPE as they are, and no norm weight is read."""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot.kernels import device
from flint_aot.kernels.compile import Kernel
from flint_aot.kernels.diagnostics import SERVING, Diagnostics
from loader.abi import CLUSTER, HALF_DIM, HEAD_DIM, QKNRC_HEADS, QKNRC_TOKENS

THREADS = 128
HALF = 16  # lanes of a half-warp: one token
VEC = HEAD_DIM // HALF  # dims per lane (8: one 16-byte load)
assert QKNRC_TOKENS == THREADS // HALF


class QkNormRopeCacheKernel(Kernel):
    """The standalone per-head stage of one specialization: RoPE on/off, q/k norm on/off and the cache dtype,
    set once."""

    kind, block = "qk_norm_rope_cache", (THREADS, 1, 1)

    def __init__(self, spec: dict, arch: str, diag: Diagnostics = SERVING):
        self.arch, self.diag = arch, diag
        self.rope = bool(spec["rope"])
        self.qk_norm = bool(spec.get("qk_norm", True))
        self.fp8 = spec.get("kv_cache_dtype", "bf16") == "fp8_e4m3"
        self.vec_bytes = VEC * (1 if self.fp8 else 2)  # a lane's 8 cache elements

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
        tid, _, _ = cute.arch.thread_idx()
        hb, tb, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        lane = tid % 32
        ln = tid % HALF  # this lane of its half-warp: dims 8 ln .. 8 ln + 7
        t = SimpleNamespace(dim0=ln * VEC, col=ln * VEC % HALF_DIM, base=lane - ln,
                            heads=num_q_heads + 2 * num_kv_heads)  # fmt: skip
        if cutlass.const_expr(self.qk_norm):  # (constants: before the wait)
            w = [self.weights(a.q_norm_weight, t), self.weights(a.k_norm_weight, t)]
        else:  # (not read, not used)
            w = [[[Float32(1.0)] * VEC] * 2] * 2
        cute.arch.griddepcontrol_wait()
        tok = tb * QKNRC_TOKENS + tid // HALF
        x = self.inputs(a, t, tok, hb)  # the token's heads, slot, position: every load first
        cs = self.rope_coeffs(a, t, x) if cutlass.const_expr(self.rope) else None
        for g in cutlass.range_constexpr(QKNRC_HEADS):
            head = hb * QKNRC_HEADS + g
            if head < t.heads:  # (uniform in the CTA, as every branch on the head)
                if head >= a.num_q_heads + a.num_kv_heads:
                    kvh = head - (a.num_q_heads + a.num_kv_heads)
                    self.store_cache(a, t, a.v_cache, x, x.h[g], kvh, a.v_scale)
                else:
                    is_q = head < a.num_q_heads
                    wn = [Float32(cutlass.select_(is_q, w[0][0][j], w[1][0][j])) for j in range(VEC)]
                    wp = [Float32(cutlass.select_(is_q, w[0][1][j], w[1][1][j])) for j in range(VEC)]
                    ys = self.finish(a, t, x.h[g], cs, wn, wp)
                    if is_q:
                        self.store_q(a, t, tok, head, ys)
                    else:
                        self.store_cache(a, t, a.k_cache, x, ys, head - a.num_q_heads, a.k_scale)

    def weights(self, wptr, t):
        """A norm weight (q's or k's) of this lane's dims and of their RoPE partners' (dim ^ 64), as fp32."""
        out = []
        for d0 in (t.dim0, t.dim0 ^ HALF_DIM):
            r = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
            r.store(device.load_vec(wptr + cute.assume(d0, divby=VEC), VEC))
            out.append([r[j].to(Float32) for j in range(VEC)])
        return out

    @cute.jit
    def inputs(self, a, t, tok, hb):
        """Token tok's 8 values of each of the CTA's heads (tokens past m: token m - 1's; heads past the
        last: the last's), its position, and where its slot is in the caches."""
        tc = cutlass.min(tok, a.m - 1)
        row = Int64(tc) * (t.heads * HEAD_DIM) + t.dim0
        hs = []
        for g in cutlass.range_constexpr(QKNRC_HEADS):
            head = cutlass.min(hb * QKNRC_HEADS + g, t.heads - 1)
            h = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
            h.store(device.load_vec(a.qkv + cute.assume(row + head * HEAD_DIM, divby=VEC), VEC))
            hs.append([h[j] for j in range(VEC)])
        slot = Int64(-1)
        if tok < a.num_slot_mapping:
            slot = device.at(a.slot_mapping, tok)[0]
        pos = Int64(0)
        if cutlass.const_expr(self.rope):
            pos = device.at(a.positions, tc)[0]
        # where the token's heads go in the caches (once for its heads): written only for tokens < m and
        # slots inside the cache
        stored = tok < a.m and slot >= 0 and slot < a.num_cache_slots
        where = (slot // a.block_size) * a.stride_block + (slot % a.block_size) * a.stride_slot + t.dim0
        return SimpleNamespace(h=hs, pos=pos, stored=stored, where=where)

    @cute.jit
    def rope_coeffs(self, a, t, x):
        """(ok, cos[8], sin[8]) of this lane's dims at the token's position: the table's row, or row 0 and
        ok = False for a position outside it (device.rope_coeffs' rule)."""
        ok = x.pos >= 0 and x.pos < a.max_pos
        row = Int64(cutlass.select_(ok, x.pos, Int64(0))) * HEAD_DIM
        return ok, self.table(a, row + t.col), self.table(a, row + (t.col + HALF_DIM))

    def table(self, a, off):
        """8 fp32 of the cos|sin table from element off (two 16-byte loads)."""
        r = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        r.store(device.load_vec(a.cos_sin_cache + cute.assume(off, divby=VEC), VEC))
        return [r[j] for j in range(VEC)]

    def finish(self, a, t, h, cs, wn, wp):
        """The head's RMSNorm (fp32; the fused kernel's sum of squares: the lane's 8 dims as a balanced tree,
        lane ^ 1 completes the 16-dim block, the 8 blocks added in order), RoPE and one bf16 rounding; without
        q/k norm, RoPE of the values as they are."""
        hv = [v.to(Float32) for v in h]
        inv = None
        if cutlass.const_expr(self.qk_norm):
            sq = [v * v for v in hv]
            part = ((sq[0] + sq[1]) + (sq[2] + sq[3])) + ((sq[4] + sq[5]) + (sq[6] + sq[7]))
            part = part + cute.arch.shuffle_sync_bfly(part, 1)
            tot = cute.arch.shuffle_sync(part, t.base)
            for r in range(1, CLUSTER):  # the 16-dim blocks in order (block r: lanes 2 r, 2 r + 1)
                tot = tot + cute.arch.shuffle_sync(part, t.base + 2 * r)
            inv = cute.math.rsqrt(tot * Float32(1.0 / HEAD_DIM) + a.qk_eps)
        ys = []
        for j in range(VEC):
            y = hv[j] * inv * wn[j] if cutlass.const_expr(self.qk_norm) else hv[j]
            if cutlass.const_expr(self.rope):
                ok, c, sn = cs
                yp = cute.arch.shuffle_sync_bfly(hv[j], HALF // 2)  # dim ^ 64: lane ^ 8
                if cutlass.const_expr(self.qk_norm):
                    yp = yp * inv * wp[j]
                y = device.rotate(y, yp, ok, c[j], sn[j], t.dim0 + j)
            ys.append(y.to(BFloat16))
        return ys

    @cute.jit
    def store_q(self, a, t, tok, head, ys):
        """q[tok, head, dims 8 l ..]: one 16-byte store (tokens < m)."""
        if tok < a.m:
            off = Int64(tok) * (a.num_q_heads * HEAD_DIM) + head * HEAD_DIM + t.dim0
            r = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
            for j in cutlass.range_constexpr(VEC):
                r[j] = ys[j]
            cute.autovec_copy(r, cute.make_tensor(a.q + cute.assume(off, divby=VEC), cute.make_layout(VEC)))

    @cute.jit
    def store_cache(self, a, t, cache, x, vals, kvh, scale_ptr):
        """The paged cache at the token's slot (x.stored: tokens < m, 0 <= slot < num_cache_slots), kv head
        kvh: the 8 bf16 values, or e4m3 of value / scale (an FP8 cache), as one vector store where the
        cache's base and strides keep it aligned, else element by element (device.store_cache: the same
        bytes)."""
        if x.stored:
            off = x.where + kvh * a.stride_head
            scale = Float32(1.0)
            if cutlass.const_expr(self.fp8):
                scale = device.at(scale_ptr, 0)[0]
            strides = a.stride_block | a.stride_slot | a.stride_head
            if strides % VEC == 0 and Int64(cache.toint()) % self.vec_bytes == 0:
                self.store_vec(cache + off, vals, scale)
            else:
                for j in cutlass.range_constexpr(VEC):
                    if cutlass.const_expr(self.fp8):
                        device.store_e4m3(cache + (off + j), vals[j].to(Float32), scale)
                    else:
                        device.put(cache, off + j, vals[j])

    def store_vec(self, ptr, vals, scale):
        """8 values at ptr (aligned to their size): one 16-byte store of bf16, or 8 e4m3 bytes of value /
        scale (IEEE division, round to nearest even, saturated: device.store_e4m3's numerics) in one
        8-byte store."""
        r = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
        for j in range(VEC):
            r[j] = vals[j]
        if cutlass.const_expr(self.fp8):
            f = [r[j].to(Float32) for j in range(VEC)]
            cute.arch.inline_ptx(
                "{ .reg .f32 q<8>; .reg .b16 h<4>; .reg .b64 d;"
                + "".join(f" div.rn.f32 q{j}, {{$r{j + 1}}}, {{$r9}};" for j in range(VEC))
                + "".join(f" cvt.rn.satfinite.e4m3x2.f32 h{j}, q{2 * j + 1}, q{2 * j};" for j in range(4))
                + " mov.b64 d, {h0, h1, h2, h3}; st.global.b64 [{$r0}], d; }",
                read_only_args=[ptr, *f, scale],
            )
        else:
            w = cute.recast_tensor(r, Int32)
            cute.arch.inline_ptx("st.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                                 read_only_args=[ptr, w[0], w[1], w[2], w[3]])  # fmt: skip

    def ptr_types(self) -> dict:
        """Element type and assumed alignment (bytes) of the pointers that are not bf16 16-byte aligned."""
        cache = (cutlass.Uint8, 1) if self.fp8 else (BFloat16, 2)
        return {"cos_sin_cache": (Float32, 16), "positions": (Int64, 8), "slot_mapping": (Int64, 8),
                "k_cache": cache, "v_cache": cache, "k_scale": (Float32, 4),
                "v_scale": (Float32, 4)}  # fmt: skip


KERNEL = QkNormRopeCacheKernel

"""The fused qkv kernel's per-head epilogue (docs/kernels.md §2.3, §2.5; docs/numerics.md §3-§4): the q/k
RMSNorm, NeoX RoPE, the q store and the paged KV-cache writes (BF16 or FP8), for both kernel shapes:
* the 8-token kernel's CTA holds 16 dims of a head for 8 tokens (thread: row r, token tk) and meets the other
  7 CTAs of its head over DSMEM: `send` (the per-token partial sums of squares to every CTA, the value to
  the RoPE partner rank ^ 4), then `finish` once its mbarrier has every byte;
* the token stream's warp holds a token's whole head (lane l: dims 4 l .. 4 l + 3) and exchanges nothing:
  `finish_token`, whose sum of squares is the 8-token kernel's, bit for bit.
Without q/k norm (Llama's numerics) q and k go to RoPE as they are: the 8-token kernel then exchanges only
the RoPE partner's values, or nothing. Memory safety (docs/api.md §6): a position outside [0, max_pos)
reads row 0 of the table and turns that token's q/k head into NaN; a slot outside the cache is not written
(like a negative slot).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64

from flint_aot.kernels import device, trace
from flint_aot.kernels.mma import ROWS
from loader.abi import CLUSTER, HALF_DIM, HEAD_DIM, TOKEN_GROUP

R = ROWS
GROUP = TOKEN_GROUP


class HeadEpilogue:
    """The epilogue of one specialization: q/k/v head counts, RoPE on/off, the cache's dtype, the token
    tile (the layout of the 8-token kernel's per-call inputs; tiles > 8 compute cache offsets with a 32-bit
    division: `narrow`, device.store_cache) and q/k norm on/off."""

    def __init__(self, nq: int, nkv: int, rope: bool, fp8: bool, tile: int, qk_norm: bool = True):
        self.nq, self.nkv, self.rope, self.fp8, self.tile = nq, nkv, rope, fp8, tile
        self.narrow = tile > GROUP
        self.qk_norm = qk_norm
        self.exchange = qk_norm or rope  # (the 8-token kernel: what a q/k head's CTAs send each other)

    def norm_weights(self, a, t, dims):
        """The q/k norm weights of the given dims and of their rotation partners (model constants): lists
        (without q/k norm: ones, nothing read)."""
        if not self.qk_norm:
            return [Float32(1.0)] * len(dims), [Float32(1.0)] * len(dims)
        qw = cute.make_tensor(a.q_norm_weight, cute.make_layout(HEAD_DIM))
        kw = cute.make_tensor(a.k_norm_weight, cute.make_layout(HEAD_DIM))
        is_q = t.head < self.nq
        wn = [Float32(cutlass.select_(is_q, qw[d].to(Float32), kw[d].to(Float32))) for d in dims]
        wp = [Float32(cutlass.select_(is_q, qw[d ^ HALF_DIM].to(Float32), kw[d ^ HALF_DIM].to(Float32)))
              for d in dims]  # fmt: skip
        return wn, wp

    def cache_scale(self, a, t):
        """The FP8 cache's scale of this head (k or v); 1 for a BF16 cache."""
        if cutlass.const_expr(self.fp8):
            return Float32(cutlass.select_(t.is_v, device.at(a.v_scale, 0)[0], device.at(a.k_scale, 0)[0]))
        return Float32(1.0)

    def geometry(self, a):
        return a.num_cache_slots, a.block_size, a.stride_block, a.stride_slot, a.stride_head

    @cute.jit
    def store_v(self, a, t, tok, slot, hv, scale, dim):
        """v head: token tok's value of dim into the paged cache at slot (tokens < m)."""
        if tok < a.m:
            device.store_cache(a.v_cache, slot, *self.geometry(a), t.head - (self.nq + self.nkv), dim,
                               hv.to(BFloat16), self.fp8, scale, self.narrow)  # fmt: skip

    @cute.jit
    def store_qk(self, a, t, tok, slot, yb, scale, dim):
        """q, or the k cache (an FP8 cache: e4m3(value / scale) of the same bf16 value), for tokens < m."""
        if tok < a.m:
            if t.head < self.nq:
                device.put(a.q, tok * (self.nq * HEAD_DIM) + t.head * HEAD_DIM + dim, yb)
            else:
                device.store_cache(a.k_cache, slot, *self.geometry(a), t.head - self.nq, dim, yb,
                                   self.fp8, scale, self.narrow)  # fmt: skip

    # ------------------------------------------------------------------ the 8-token kernel: 8 CTAs a head
    @cute.jit
    def inputs(self, a, t, i: cutlass.Constexpr):
        """Per-token inputs of the epilogue of group i (this thread's token 8 i + tk): slot, RoPE coeffs,
        issued after the wait so their latency hides under the MMAs."""
        tok = GROUP * i + t.tk
        slot = Int64(-1)
        if tok < a.num_slot_mapping:
            slot = cute.make_tensor(a.slot_mapping, cute.make_layout(self.tile))[tok]
        c = Float32(1.0)
        sn = Float32(0.0)
        ok = True
        if cutlass.const_expr(self.rope):
            p = cute.make_tensor(a.positions, cute.make_layout(self.tile))[cutlass.min(tok, a.m - 1)]
            ok, c, sn = device.rope_coeffs(a.cos_sin_cache, p, a.max_pos, t.dim)
        return slot, ok, c, sn

    @cute.jit
    def send(self, a, t, buf, hv, i, scale, slot):
        """v head: this thread's value (row r, token 8 i + tk) to the paged cache at slot. q/k head: the
        token's partial sum of squares over this CTA's 16 dims (a 16-lane butterfly) to every CTA of the head
        (lane r to rank r) and, with RoPE, the value to the rotation partner (rank ^ 4: pv [row][token], word
        partner_word), by st.async on their mbarrier of the group (buf: ssq, pv, mbar)."""
        if t.is_v:
            self.store_v(a, t, GROUP * i + t.tk, slot, hv, scale, t.dim)
        else:
            ssq, pv, mbar = buf
            if cutlass.const_expr(self.qk_norm):
                part = hv * hv
                for o in (1, 2, 4, 8):
                    part = part + cute.arch.shuffle_sync_bfly(part, o)
                if t.r < CLUSTER:  # lane r sends the partial to rank r
                    cute.arch.store_async_dsmem(ssq + (t.rank * GROUP + t.tk), device.f32_bits(part), mbar,
                                                t.r)  # fmt: skip
            if cutlass.const_expr(self.rope):
                self.send_partner(t, pv, mbar, hv)

    @cute.jit
    def send_partner(self, t, pv, mbar, hv):
        partner = t.rank ^ (CLUSTER // 2)
        cute.arch.store_async_dsmem(pv + self.partner_word(t), device.f32_bits(hv), mbar, partner)

    def partner_word(self, t):
        """The word of pv that holds this thread's partner value."""
        return t.r * GROUP + t.tk

    @cute.jit
    def finish(self, a, t, buf, hv, i, scale, e, wn, wp):
        """q/k head, once the group's mbarrier has every byte: finish_value, stored as q or into the k
        cache."""
        if not t.is_v:
            if cutlass.const_expr(self.exchange):
                cute.arch.mbarrier_wait(buf[2], 0)
            t.tr.mark(trace.EXCHANGED)
            yb = self.finish_value(a, t, buf, hv, e[1:], wn, wp)
            self.store_qk(a, t, GROUP * i + t.tk, e[0], yb, scale, t.dim)

    def finish_value(self, a, t, buf, hv, rope, wn, wp):
        """q/k head, the group's exchange received: the RMSNorm (fp32, the 8 ranks' sums in rank order: the
        same in all 8 CTAs), NeoX RoPE (rope: ok, cos, sin) and one bf16 rounding of its own dim."""
        ssq, pv, _ = buf
        ok, c, sn = rope
        y, inv = hv, None
        if cutlass.const_expr(self.qk_norm):
            st = cute.make_tensor(ssq, cute.make_layout(CLUSTER * GROUP))
            tot = st[t.tk]
            for j in range(1, CLUSTER):  # rank order
                tot = tot + st[j * GROUP + t.tk]
            inv = cute.math.rsqrt(tot * Float32(1.0 / HEAD_DIM) + a.qk_eps)
            y = hv * inv * wn
        if cutlass.const_expr(self.rope):
            yp = cute.make_tensor(pv, cute.make_layout(R * GROUP))[self.partner_word(t)]
            if cutlass.const_expr(self.qk_norm):
                yp = yp * inv * wp
            y = device.rotate(y, yp, ok, c, sn, t.dim)
        return y.to(BFloat16)

    # ------------------------------------------------------------------ the token stream: a head in a warp
    def finish_token(self, a, hv, rope, wn, wp, dims):
        """A token's 128 dims in one warp (hv: dims 4 lane ..): finish_value's RMSNorm and RoPE, bit for bit:
        its 16-lane butterfly over each 16-dim block (here two adds in the lane, then lanes ^ 1 and ^ 2) and
        the 8 blocks' sums in rank order; the RoPE partner (dim ^ 64) is in lane ^ 16."""
        inv = None
        if cutlass.const_expr(self.qk_norm):
            sq = [h * h for h in hv]
            part = (sq[0] + sq[1]) + (sq[2] + sq[3])  # the butterfly's first two steps, inside the lane
            for o in (1, 2):
                part = part + cute.arch.shuffle_sync_bfly(part, o)
            tot = cute.arch.shuffle_sync(part, 0)
            for j in range(1, CLUSTER):  # rank order
                tot = tot + cute.arch.shuffle_sync(part, 4 * j)
            inv = cute.math.rsqrt(tot * Float32(1.0 / HEAD_DIM) + a.qk_eps)
        ok, c, sn = rope
        ys = []
        for j in range(4):
            y = hv[j] * inv * wn[j] if cutlass.const_expr(self.qk_norm) else hv[j]
            if cutlass.const_expr(self.rope):
                yp = cute.arch.shuffle_sync_bfly(hv[j], 16)
                if cutlass.const_expr(self.qk_norm):
                    yp = yp * inv * wp[j]
                y = device.rotate(y, yp, ok, c[j], sn[j], dims[j])
            ys.append(y.to(BFloat16))
        return ys

    @cute.jit
    def token(self, a, t, tok, slot, hv, rope, wn, wp, scale, dims, lane):
        """The token stream: this lane's 4 dims of token tok (tokens < m): v into the cache; q/k through
        finish_token, q in one 8-byte store, k into the cache."""
        if t.is_v:
            if tok < a.m:
                for j in cutlass.range_constexpr(4):
                    device.store_cache(a.v_cache, slot, *self.geometry(a), t.head - (self.nq + self.nkv),
                                       dims[j], hv[j].to(BFloat16), self.fp8, scale, True)  # fmt: skip
        else:
            ys = self.finish_token(a, hv, rope, wn, wp, dims)
            if tok < a.m:
                if t.head < self.nq:  # q: 4 dims in one 8-byte store
                    off = cute.assume(tok * (self.nq * HEAD_DIM) + t.head * HEAD_DIM + 4 * lane, divby=4)
                    r = cute.make_rmem_tensor(cute.make_layout(4), BFloat16)
                    for j in cutlass.range_constexpr(4):
                        r[j] = ys[j]
                    cute.autovec_copy(r, cute.make_tensor(a.q + off, cute.make_layout(4)))
                else:
                    for j in cutlass.range_constexpr(4):
                        self.store_qk(a, t, tok, slot, ys[j], scale, dims[j])

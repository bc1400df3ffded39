"""The fused qkv kernel (docs/kernels.md §2-§3): qkv GEMV + per-head q/k RMSNorm + NeoX RoPE + paged KV-cache
write, and in the prologue design the input RMSNorm too.

Grid: one CTA of 128 threads per 16 weight rows; the 8 CTAs of one head (128 rows) form a cluster (8,1,1).
A kernel serves M up to its token tile (8: x in static shared memory; 16: two groups of 8 tokens, x in
m x 4 KB of dynamic shared memory, each thread's epilogue runs for tokens t and t + 8). Each CTA
1. releases its own PDL dependents, initialises its mbarriers, arrives on the cluster barrier, issues its
   whole weight slice (BF16: 64 KiB into registers; NVFP4: codes + scales, and 3/4 of the decode), and only
   then waits (griddepcontrol.wait) for the kernel before it: the weight stream overlaps that kernel;
2. gets the activations of every token into its shared memory, 1/8 of them (k in [256 r, 256 r + 256),
   rank r) from each CTA of the cluster, so that they are read from L2 once per cluster, not once per CTA.
   The threads that fetch them wait for the predecessor themselves; with BF16 weights they start as soon
   as the weight loads are issued (before step 1's wait, while the weights still arrive), with NVFP4
   after it;
   - separate design: the activations are xn, written by the norm kernel before it: one multicast bulk
     copy per token into all 8 CTAs;
   - prologue design: the input RMSNorm split over the cluster. Rank r reads slice r of x and the
     residual of every token (one warp per token: exactly the norm kernel's warp r), sends r = bf16(x +
     residual) and the slice's sum of squares to its 7 peers (st.async), and once every slice is in,
     each CTA adds the 8 sums in warp order and turns r into xn (device.norm_*: the norm kernel's
     arithmetic and order, so xn is bit-identical); the 8 CTAs of the first head write residual_out;
3. computes its 16 rows for all tokens (gemv_core: fragment math, K split, summation order) and rounds them
   to bf16;
4. v head: writes its rows to the paged cache. q/k head: sends its per-token partial sums of squares to
   every CTA of the head and its rows to its RoPE partner (rank ^ 4) with st.async on their mbarriers,
   then applies the RMSNorm (fp32, sums in rank order: the same in all 8 CTAs), NeoX RoPE from the fp32
   cos|sin table (or none) and one bf16 rounding to its own 16 dims, and stores q or writes k. An FP8 cache
   gets e4m3(value / scale) of the same bf16 values (device.store_cache).

`QkvKernel` holds a specialization's compile-time configuration (format, RoPE, heads, cache dtype, design,
token tile); its `kernel` is the flat parameter list the manifest records, and the steps above are its
methods, each given the kernel's parameters by name (`a`) and the thread's coordinates (`t`). One parameter
list serves both designs: a separate build reads its activations from `x` (the loader passes xn there) and
ignores residual, residual_out, norm_weight, has_residual and eps.

Memory safety (docs/api.md §6): a position outside [0, max_pos) reads row 0 of the table and turns that
token's q/k head into NaN; a slot >= num_cache_slots is not written (like a negative slot).
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot.kernels import device
from flint_aot.kernels import gemv_core as core
from flint_aot.kernels.compile import Kernel
from flint_aot.kernels.device import NORM_VEC
from loader.abi import CLUSTER, HALF_DIM, HEAD_DIM

R = core.ROWS
K_PART = core.K // CLUSTER  # activations each CTA of a cluster copies for all 8


class QkvKernel(Kernel):
    """The fused qkv kernel of one specialization; its compile-time configuration is set here, once."""

    kind, block, cluster = "qkv", (core.THREADS, 1, 1), (CLUSTER, 1, 1)

    def __init__(self, spec: dict):
        assert spec["weight_format"] in ("bf16", "nvfp4"), spec
        self.fp4 = spec["weight_format"] == "nvfp4"
        self.rope = bool(spec["rope"])
        self.nq, self.nkv = spec["heads"]
        self.fp8 = spec.get("kv_cache_dtype", "bf16") == "fp8_e4m3"
        self.prologue = spec.get("norm") == "prologue"
        self.tile = spec.get("max_m", 8)  # tokens per call this build serves
        self.groups = self.tile // 8  # of 8 tokens: one mma.sync N each
        self.xrow = core.smem_row(self.fp4)
        self.gemv = core.CtaGemv(self.fp4, self.tile, core.FP4_PRE_QKV)
        # bytes each CTA of a q/k head receives over DSMEM: the 8 ranks' per-token sums of squares, and
        # (RoPE) the 16 x tile values of its rotation partner (rank ^ 4), as fp32
        self.rx_bytes = CLUSTER * self.tile * 4 + (R * self.tile * 4 if self.rope else 0)
        # tile 16: x of m tokens in dynamic shared memory (m x row bytes, set by the loader per call), and
        # registers within 3 CTAs per SM (one wave)
        self.dyn_smem_per_m = self.xrow * 2 if self.tile > 8 else 0
        self.min_ctas_per_sm = 3 if self.tile > 8 else 0

    @cute.kernel
    def kernel(
        self, x: cute.Pointer, residual: cute.Pointer, residual_out: cute.Pointer, norm_weight: cute.Pointer,
        weight: cute.Pointer, weight_scale: cute.Pointer, global_scale: cute.Pointer,
        q_norm_weight: cute.Pointer, k_norm_weight: cute.Pointer, cos_sin_cache: cute.Pointer,
        positions: cute.Pointer, slot_mapping: cute.Pointer, q: cute.Pointer, k_cache: cute.Pointer,
        v_cache: cute.Pointer, k_scale: cute.Pointer, v_scale: cute.Pointer,
        m: Int32, has_residual: Int32, num_slot_mapping: Int32, max_pos: Int32, block_size: Int32,
        num_cache_slots: Int64, stride_block: Int64, stride_slot: Int64, stride_head: Int64,
        eps: Float32, qk_eps: Float32,
    ):  # fmt: skip
        a = SimpleNamespace(**{k: v for k, v in locals().items() if k != "self"})  # the parameters, by name
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        head = cta // CLUSTER  # uniform over the cluster
        rank = cute.arch.block_idx_in_cluster()
        is_v = head >= self.nq + self.nkv
        r = tid % R  # after reduce_rows: this thread's row (within the CTA) and token
        tk = tid // R
        t = SimpleNamespace(tid=tid, cta=cta, head=head, rank=rank, is_v=is_v, r=r, tk=tk, dim=rank * R + r)
        s = self.shared(a, t)
        e = SimpleNamespace(slot=[], ok=[], c=[], sn=[])  # the epilogue's inputs
        if cutlass.const_expr(self.groups == 1):
            e.wn, e.wp = self.norm_weights(a, t)
        # the weight stream, issued before griddepcontrol.wait (which follows it). BF16: the activations are
        # fetched as soon as the weight loads are issued (by threads that wait for the predecessor
        # themselves), NVFP4 after the guarded wait: a waiting thread's warp cannot decode (measured,
        # two-kernel design: BF16 up to 0.17 us per layer faster, NVFP4 0.1-0.35 slower that way)
        wst = self.gemv.start(weight, weight_scale, global_scale, cta * R, tid, m,
                              issued=None if self.fp4 else lambda: self.activations(a, t, s))  # fmt: skip
        if cutlass.const_expr(self.fp4):
            self.activations(a, t, s)
        if cutlass.const_expr(self.groups == 1):
            self.epilogue_inputs(a, t, e, [0])
        if cutlass.const_expr(self.prologue):
            self.input_norm(a, t, s)
        acc = self.gemv.sums(wst, core.SharedX(s.xs, self.xrow, s.mbx), m, tid,
                             between=lambda: self.late_inputs(a, t, e))  # fmt: skip
        h = [v.to(BFloat16) for v in acc]  # qkv[token, head * 128 + dim], rounded once
        self.epilogue(a, t, s, e, h)

    def late_inputs(self, a, t, e):
        """Tile 16: the epilogue inputs and the norm weights once the MMAs end and free the weights' registers
        (live across the MMAs, they would not fit beside the weights of 16 tokens: ptxas spills)."""
        if cutlass.const_expr(self.groups > 1):
            self.epilogue_inputs(a, t, e, range(self.groups))
            e.wn, e.wp = self.norm_weights(a, t)

    def tokens(self, t):
        """This thread's tokens after reduce_rows: tk, and tk + 8 with a tile of 16."""
        return [t.tk + 8 * i if i else t.tk for i in range(self.groups)]

    @cute.jit
    def shared(self, a, t):
        """Shared memory, and the mbarriers initialised before this CTA arrives on the cluster barrier (the
        wait comes before anyone targets a peer). The activations arrive on mbx: the cluster's multicast
        copies (separate design) or the peers' slices of r and sums of squares (prologue design; ssn:
        [src rank][token], apart from ssq, which a peer ahead of this CTA may already be writing). q/k heads
        also receive their peers' st.async on mbar."""
        tile = self.tile
        ssq = cute.arch.alloc_smem(Float32, CLUSTER * tile, alignment=16)  # [src rank][token]
        pv = cute.arch.alloc_smem(Float32, R * tile, alignment=16)  # partner rows [row][token]
        mbar = cute.arch.alloc_smem(Int64, 1, alignment=8)
        if cutlass.const_expr(tile > 8):
            xs = cute.arch.get_dyn_smem(BFloat16, alignment=128)
        else:
            xs = cute.arch.alloc_smem(BFloat16, tile * self.xrow, alignment=128)
        ssn = ssq
        if cutlass.const_expr(self.prologue):
            ssn = cute.arch.alloc_smem(Float32, CLUSTER * tile, alignment=16)
        mbx = cute.arch.alloc_smem(Int64, 1, alignment=8)
        if t.tid == 0:
            cute.arch.mbarrier_init(mbx, 1)
            if not t.is_v:
                cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_warp()  # orders the inits before the arrives for racecheck (same thread anyway)
        if t.tid == 0:
            act_bytes = a.m * (core.K * 2)  # the multicast copies of x
            if cutlass.const_expr(self.prologue):  # the 7 peers' slices of r, the 8 slices' sums of squares
                act_bytes = a.m * ((CLUSTER - 1) * K_PART * 2 + CLUSTER * 4)
            cute.arch.mbarrier_arrive_and_expect_tx(mbx, act_bytes)
            if not t.is_v:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, self.rx_bytes)
        cute.arch.cluster_arrive_relaxed()
        return SimpleNamespace(ssq=ssq, pv=pv, mbar=mbar, xs=xs, ssn=ssn, mbx=mbx)

    def norm_weights(self, a, t):
        """The q/k norm weights of this thread's dim and of its rotation partner (model constants)."""
        qw = cute.make_tensor(a.q_norm_weight, cute.make_layout(HEAD_DIM))
        kw = cute.make_tensor(a.k_norm_weight, cute.make_layout(HEAD_DIM))
        is_q, dim = t.head < self.nq, t.dim
        wn = Float32(cutlass.select_(is_q, qw[dim].to(Float32), kw[dim].to(Float32)))
        wp = Float32(cutlass.select_(is_q, qw[dim ^ HALF_DIM].to(Float32), kw[dim ^ HALF_DIM].to(Float32)))
        return wn, wp

    def activations(self, a, t, s):
        """The activations into shared memory: xn by multicast copies, or the input norm's first half."""
        if cutlass.const_expr(self.prologue):
            self.norm_slices(a, t, s)
        else:
            self.copy_activations(a, t, s)

    @cute.jit
    def epilogue_inputs(self, a, t, e, groups):
        """Per-token inputs of the epilogue (slot, RoPE coefficients) of the given token groups, and the FP8
        scale, issued after the wait so their latency hides under the GEMV."""
        for i in groups:
            tok = self.tokens(t)[i]
            slot = Int64(-1)
            if tok < a.num_slot_mapping:
                slot = cute.make_tensor(a.slot_mapping, cute.make_layout(self.tile))[tok]
            c = Float32(1.0)
            sn = Float32(0.0)
            ok = True
            if cutlass.const_expr(self.rope):
                p = cute.make_tensor(a.positions, cute.make_layout(self.tile))[cutlass.min(tok, a.m - 1)]
                ok, c, sn = device.rope_coeffs(a.cos_sin_cache, p, a.max_pos, t.dim)
            e.slot.append(slot)
            e.ok.append(ok)
            e.c.append(c)
            e.sn.append(sn)
        if cutlass.const_expr(0 in groups):
            e.scale = Float32(1.0)
            if cutlass.const_expr(self.fp8):
                e.scale = Float32(cutlass.select_(t.is_v, device.at(a.v_scale, 0)[0],
                                                  device.at(a.k_scale, 0)[0]))  # fmt: skip

    @cute.jit
    def epilogue(self, a, t, s, e, h):
        """v head: its rows to the paged cache. q/k head: per token, the 16 dims' sum of squares to every CTA
        of the head and the rows to the RoPE partner (rank ^ 4) by st.async, then the RMSNorm (fp32, sums in
        rank order: the same in all 8 CTAs), NeoX RoPE and one bf16 rounding of its own 16 dims, stored as q
        or into the k cache (an FP8 cache: e4m3(value / scale) of the same bf16 values)."""
        if t.is_v:
            self.v_head(a, t, e, h)
        else:
            self.qk_head(a, t, s, e, h)

    def geometry(self, a):
        return a.num_cache_slots, a.block_size, a.stride_block, a.stride_slot, a.stride_head

    @cute.jit
    def v_head(self, a, t, e, h):
        for i in cutlass.range_constexpr(self.groups):
            tok = self.tokens(t)[i]
            if tok < a.m:
                device.store_cache(a.v_cache, e.slot[i], *self.geometry(a), t.head - (self.nq + self.nkv),
                                   t.dim, h[i], self.fp8, e.scale)  # fmt: skip

    @cute.jit
    def qk_head(self, a, t, s, e, h):
        tile, tokens = self.tile, self.tokens(t)
        hv = [v.to(Float32) for v in h]
        for i in cutlass.range_constexpr(self.groups):
            part = hv[i] * hv[i]  # this CTA's 16 dims of the token: a 16-lane butterfly (every lane's sum)
            for o in (1, 2, 4, 8):
                part = part + cute.arch.shuffle_sync_bfly(part, o)
            if t.r < CLUSTER:  # lane r sends the partial to rank r
                cute.arch.store_async_dsmem(s.ssq + (t.rank * tile + tokens[i]), device.f32_bits(part),
                                            s.mbar, t.r)  # fmt: skip
            if cutlass.const_expr(self.rope):
                cute.arch.store_async_dsmem(s.pv + (t.r * tile + tokens[i]), device.f32_bits(hv[i]), s.mbar,
                                            t.rank ^ (CLUSTER // 2))  # fmt: skip
        cute.arch.mbarrier_wait(s.mbar, 0)
        st = cute.make_tensor(s.ssq, cute.make_layout(CLUSTER * tile))
        for i in cutlass.range_constexpr(self.groups):
            self.qk_store(a, t, s, e, i, st, hv[i], tokens[i])

    @cute.jit
    def qk_store(self, a, t, s, e, i, st, hv, tok):
        tile, nq = self.tile, self.nq
        tot = st[tok]
        for j in range(1, CLUSTER):  # rank order: the same sum in every CTA of the head
            tot = tot + st[j * tile + tok]
        inv = cute.math.rsqrt(tot * Float32(1.0 / HEAD_DIM) + a.qk_eps)
        y = hv * inv * e.wn
        if cutlass.const_expr(self.rope):
            yp = cute.make_tensor(s.pv, cute.make_layout(R * tile))[t.r * tile + tok] * inv * e.wp
            y = device.rotate(y, yp, e.ok[i], e.c[i], e.sn[i], t.dim)
        yb = y.to(BFloat16)
        if tok < a.m:
            if t.head < nq:
                device.put(a.q, tok * (nq * HEAD_DIM) + t.head * HEAD_DIM + t.dim, yb)
            else:
                device.store_cache(a.k_cache, e.slot[i], *self.geometry(a), t.head - nq, t.dim, yb, self.fp8,
                                   e.scale)  # fmt: skip

    @cute.jit
    def copy_activations(self, a, t, s):
        """Wait on the cluster barrier (every peer's mbarriers are initialised), then threads tid < m wait for
        the predecessor themselves (griddepcontrol.wait: the copies need no weights, which may still be in
        flight) and copy this CTA's 1/8 of token tid's activations into all 8 CTAs."""
        cute.arch.cluster_wait()
        if t.tid < a.m:
            cute.arch.griddepcontrol_wait()
            part = t.rank * K_PART
            device.bulk_multicast(s.xs + (t.tid * self.xrow + part), a.x + (t.tid * core.K + part), s.mbx,
                                  K_PART * 2)  # fmt: skip

    @cute.jit
    def norm_slices(self, a, t, s):
        """The prologue design's input RMSNorm, first half, split over the cluster: once every peer's mbarrier
        is initialised (cluster barrier) and the predecessor is done (each thread waits for it itself), CTA
        rank r computes slice r of every token (k in [256 r, 256 r + 256): exactly the norm kernel's warp r;
        one warp per token here, 8 elements per lane, the same butterfly), keeps r = bf16(x + residual) in its
        shared memory and sends it (st.async) and its warp sum to the 7 peers. The CTAs of the first head
        write residual_out, slice r each."""
        cute.arch.cluster_wait()
        cute.arch.griddepcontrol_wait()
        warp, lane, _, _ = device.lanes(t.tid)
        col = t.rank * K_PART + lane * NORM_VEC  # this lane's chunk of the CTA's slice
        for j in range(self.tile // core.WARPS):  # token warp + 4 j
            tok = warp + j * core.WARPS
            if tok < a.m:
                if a.has_residual != 0:
                    self.norm_slice(a, t, s, tok, col, lane, True)
                else:
                    self.norm_slice(a, t, s, tok, col, lane, False)

    @cute.jit
    def norm_slice(self, a, t, s, tok, col, lane, res: cutlass.Constexpr):
        """norm_slices' part of one token in one warp: this lane's chunk of r, the warp's sum of squares; r
        kept in xs and sent to the 7 peers, the sum to all 8 (lane d to rank d)."""
        off = cute.assume(tok * core.K + col, divby=NORM_VEC)
        if cutlass.const_expr(res):
            rv = device.load_vec(a.residual + off, NORM_VEC)
        else:  # r = x + (-0.0) = x exactly: the same arithmetic as with a residual
            rv = cute.full((NORM_VEC,), -0.0, BFloat16)
        r, ss = device.norm_residual(device.load_vec(a.x + off, NORM_VEC), rv)
        ss = cute.arch.warp_reduction_sum(ss)
        rb = r.to(BFloat16)
        if cutlass.const_expr(res):
            if t.head == 0:
                device.store_vec(a.residual_out + off, rb, NORM_VEC)
        xo = cute.assume(tok * self.xrow + col, divby=NORM_VEC)
        device.store_vec(s.xs + xo, rb, NORM_VEC)
        words = device.load_vec(cute.recast_ptr(s.xs + xo, dtype=Int32), 4)  # (this thread's own store)
        for d in range(1, CLUSTER):
            cute.arch.store_async_dsmem(s.xs + xo, (words[0], words[1], words[2], words[3]), s.mbx,
                                        (t.rank + d) % CLUSTER)  # fmt: skip
        if lane < CLUSTER:  # lane d sends the slice's sum to rank d
            cute.arch.store_async_dsmem(s.ssn + (t.rank * self.tile + tok), device.f32_bits(ss), s.mbx, lane)

    @cute.jit
    def input_norm(self, a, t, s):
        """The second half, after norm_slices: once the mbarrier has every peer's slice and sum, every CTA
        holds r and the 8 sums of every token, adds the sums in warp order (device.norm_scale) and turns xs
        into xn. The norm kernel's arithmetic and order: xn is bit-identical."""
        chunks = (t.tid, t.tid + core.THREADS)
        w = [device.load_vec(a.norm_weight + v * NORM_VEC, NORM_VEC) for v in chunks]
        cute.arch.mbarrier_wait(s.mbx, 0)
        cute.arch.sync_threads()  # (this CTA's own slice was written by its threads, not by the mbarrier)
        sn = cute.make_tensor(s.ssn, cute.make_layout(CLUSTER * self.tile))
        for i in range(a.m):
            sc = device.norm_scale([sn[j * self.tile + i] for j in range(CLUSTER)], a.eps)
            for j, v in enumerate(chunks):
                off = cute.assume(i * self.xrow + v * NORM_VEC, divby=NORM_VEC)
                r = device.load_vec(s.xs + off, NORM_VEC).to(Float32)
                device.store_vec(s.xs + off, device.norm_apply(r, sc, w[j]), NORM_VEC)
        cute.arch.sync_threads()

    def ptr_types(self) -> dict:
        """Element type and assumed alignment (bytes) of the pointers that are not bf16 16-byte aligned."""
        cache = (cutlass.Uint8, 1) if self.fp8 else (BFloat16, 2)
        return {
            "weight": (cutlass.Uint8 if self.fp4 else BFloat16, 16), "weight_scale": (cutlass.Uint8, 4),
            "global_scale": (Float32, 4), "cos_sin_cache": (Float32, 16), "positions": (Int64, 8),
            "slot_mapping": (Int64, 8), "k_cache": cache, "v_cache": cache, "k_scale": (Float32, 4),
            "v_scale": (Float32, 4),
        }  # fmt: skip


KERNEL = QkvKernel

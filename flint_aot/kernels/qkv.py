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
   gets e4m3(value / scale) of the same bf16 values (device.store_cache). The token stream (tiles 16..64)
   exchanges nothing here: its CTAs own tokens, not dims, and one warp holds a token's whole head.

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
from loader.abi import CLUSTER, HALF_DIM, HEAD_DIM, wgmma_stream, xn_pairs

R = core.ROWS
ROPE_ROW_BYTES = HEAD_DIM * 4  # one position's cos|sin row of the fp32 table
K_PART = core.K // CLUSTER  # the prologue design (tile 8): the slice of every token each CTA normalises
GROUP = core.GROUP
QUARTERS = core.WARPS  # the token stream: K quarters per row block, CTAs per quad (a quad: 64 rows)


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
        # NVFP4, two-kernel design: the norm kernel writes xn in the MMA pair order (loader.abi.xn_pairs), so
        # no warp permutes its x fragments (4 byte permutes a 16-byte load: 0.14-1.1 us a layer at M = 12-64)
        self.paired = bool(xn_pairs(spec))
        self.streamed = self.tile > GROUP  # the token stream (docs/kernels.md §2.5)
        self.wgmma = False
        if self.streamed:
            # (the prologue design fills its ring itself, one group ahead: 2 stages.) The 32-token kernel's
            # ring holds all 4 of its groups: its 3 CTAs still fit the 164 KB carveout, and every group's x is
            # in flight from the start (0.1-0.5 us faster at M = 32; a 4th or 5th stage at tile 64 needs the
            # 196 KB carveout and was slower: BENCHMARKS.md §2 step 12)
            stages = 2 if self.prologue else (core.STAGES if self.tile > 32 else self.tile // GROUP)
            # (the separate design's norm kernel writes x in the ring layout: one bulk copy per group)
            sep = not self.prologue
            self.wgmma = wgmma_stream(spec)  # the 32- and 64-token kernels (docs/kernels.md §2.6)
            if self.wgmma:
                stages = 4  # (groups 4 h .. 4 h + 3 in stages 0..3)
            self.core = core.StreamGemv(self.fp4, self.tile, core.FP4_PRE_QKV, stages, read_barriers=sep,
                                        ring_x=sep, token_owners=True, paired=self.paired,
                                        wgmma=self.wgmma)  # fmt: skip
            self.dyn_smem = self.core.dyn_smem
            self.min_ctas_per_sm = 3  # registers within 3 CTAs per SM: every grid one wave
            # the hardware may place a cluster's CTAs as it balances the SMs: 0.1-0.7 us faster on nearly
            # every row from M = 12 to 64 (the 8-token kernels lose 0.7-2 us with it: default there;
            # BENCHMARKS.md §2 step 12)
            self.cluster_policy = "load_balancing"
        else:
            self.gemv = core.CtaGemv(self.fp4, core.FP4_PRE_QKV, self.paired)
        self.groups = self.tile // GROUP
        self.meta_threads = min(self.tile, 32)  # the token stream: warp 0 stages slots and positions
        self.xrow = core.smem_row(self.fp4)  # tile 8: x of all K per token in shared memory
        # bytes each CTA of a q/k head receives over DSMEM per group of 8 tokens: the 8 ranks' per-token sums
        # of squares, and (RoPE) the 16 x 8 values of its rotation partner (rank ^ 4), as fp32
        self.rx_bytes = CLUSTER * GROUP * 4 + (R * GROUP * 4 if self.rope else 0)

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
        r = tid % R  # after the quarters' sum: this thread's row (within the row block) and token
        tk = tid // R
        t = SimpleNamespace(tid=tid, cta=cta, head=head, rank=rank, is_v=is_v, r=r, tk=tk, dim=rank * R + r)
        if cutlass.const_expr(self.streamed):
            self.stream_kernel(a, t)
        else:
            self.tile8_kernel(a, t)

    # ------------------------------------------------------------------------- tile 8 (docs/kernels.md §2.2)
    def tile8_kernel(self, a, t):
        """M <= 8: the CTA owns 16 rows (rank r: the head's dims 16 r ..) over all K, x of all 8 tokens in its
        shared memory (xn multicast once per cluster, or the split input norm), warps = K quarters."""
        s = self.shared(a, t)
        wn, wp = (w[0] for w in self.norm_weights(a, t, [t.dim]))
        # the weight stream, issued before griddepcontrol.wait (which follows it). BF16: the activations are
        # fetched as soon as the weight loads are issued (by threads that wait for the predecessor
        # themselves), NVFP4 after the guarded wait: a waiting thread's warp cannot decode (measured,
        # two-kernel design: BF16 up to 0.17 us per layer faster, NVFP4 0.1-0.35 slower that way)
        wst = self.gemv.start(a.weight, a.weight_scale, a.global_scale, t.cta * R, t.tid, a.m,
                              issued=None if self.fp4 else lambda: self.activations(a, t, s))  # fmt: skip
        if cutlass.const_expr(self.fp4):
            self.activations(a, t, s)
        e = self.epilogue_inputs(a, t, 0)
        scale = self.cache_scale(a, t)
        if cutlass.const_expr(self.prologue):
            self.input_norm(a, t, s)
        acc = self.gemv.sums(wst, core.SharedX(s.xs, self.xrow, s.mbx), a.m, t.tid)
        hv = acc.to(BFloat16).to(Float32)  # qkv[token, head * 128 + dim], rounded once
        buf = (s.ssq, s.pv, s.mbar)
        self.epilogue_send(a, t, buf, hv, 0, scale, e[0])
        self.epilogue_finish(a, t, buf, hv, 0, scale, e, wn, wp)

    @cute.jit
    def shared(self, a, t):
        """Shared memory, and the mbarriers initialised before this CTA arrives on the cluster barrier (the
        wait comes before anyone targets a peer). The activations arrive on mbx: the cluster's multicast
        copies (separate design) or the peers' slices of r and sums of squares (prologue design; ssn:
        [src rank][token], apart from ssq, which a peer ahead of this CTA may already be writing). q/k heads
        also receive their peers' st.async on mbar."""
        ssq = cute.arch.alloc_smem(Float32, CLUSTER * GROUP, alignment=16)  # [src rank][token]
        pv = cute.arch.alloc_smem(Float32, R * GROUP, alignment=16)  # partner rows [row][token]
        mbar = cute.arch.alloc_smem(Int64, 1, alignment=8)
        xs = cute.arch.alloc_smem(BFloat16, GROUP * self.xrow, alignment=128)
        ssn = ssq
        if cutlass.const_expr(self.prologue):
            ssn = cute.arch.alloc_smem(Float32, CLUSTER * GROUP, alignment=16)
        mbx = cute.arch.alloc_smem(Int64, 1, alignment=8)
        if t.tid == 0:
            cute.arch.mbarrier_init(mbx, 1)
            if not t.is_v:
                cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_warp()  # orders the inits before the arrives for racecheck (same thread anyway)
        if t.tid == 0:
            act_bytes = a.m * (self.xrow * 2)  # the multicast copy of x (its rows padded as here)
            if cutlass.const_expr(self.prologue):  # the 7 peers' slices of r, the 8 slices' sums of squares
                act_bytes = a.m * ((CLUSTER - 1) * K_PART * 2 + CLUSTER * 4)
            cute.arch.mbarrier_arrive_and_expect_tx(mbx, act_bytes)
            if not t.is_v:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, self.rx_bytes)
        cute.arch.cluster_arrive_relaxed()
        return SimpleNamespace(ssq=ssq, pv=pv, mbar=mbar, xs=xs, ssn=ssn, mbx=mbx)

    def activations(self, a, t, s):
        """The activations into shared memory: xn by multicast copies, or the input norm's first half."""
        if cutlass.const_expr(self.prologue):
            self.norm_slices(a, t, s)
        else:
            self.copy_activations(a, t, s)

    @cute.jit
    def copy_activations(self, a, t, s):
        """Wait on the cluster barrier (every peer's mbarriers are initialised); then thread 0 of rank 0
        waits for the predecessor itself (griddepcontrol.wait: the copy needs no weights, which may still be
        in flight) and copies the activations of all m tokens into all 8 CTAs with one multicast copy: the
        norm kernel wrote xn with this shared memory's padded rows (loader.abi.xn_strides). One copy per
        token, issued by rank r for token r, was 0.07-0.26 us per layer slower for NVFP4 at M = 4-8, and a
        CTA's 1/8 of every token, 8 copies a token, slower still (BENCHMARKS.md §2 steps 15-16)."""
        cute.arch.cluster_wait()
        if t.tid == 0 and t.rank == 0:
            cute.arch.griddepcontrol_wait()
            device.bulk_multicast(s.xs, a.x, s.mbx, a.m * (self.xrow * 2))

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
        for j in range(GROUP // core.WARPS):  # token warp + 4 j
            tok = warp + j * core.WARPS
            if tok < a.m:
                self.with_residual(a, self.norm_slice, a, t, s, tok, col, lane)

    @cute.jit
    def with_residual(self, a, body, *args):
        """body(*args, res), res a compile-time bool: whether this call has a residual (the body is compiled
        for both cases, and the call picks one at run time)."""
        if a.has_residual != 0:
            body(*args, True)
        else:
            body(*args, False)

    @cute.jit
    def norm_slice(self, a, t, s, tok, col, lane, res: cutlass.Constexpr):
        """norm_slices' part of one token in one warp: this lane's chunk of r, the warp's sum of squares; r
        kept in xs and sent to the 7 peers, the sum to all 8 (lane d to rank d)."""
        off = cute.assume(tok * core.K + col, divby=NORM_VEC)
        r, ss = self.residual_chunk(a, t, off, res, t.head == 0)
        ss = cute.arch.warp_reduction_sum(ss)
        rb = r.to(BFloat16)
        xo = cute.assume(tok * self.xrow + col, divby=NORM_VEC)
        device.store_vec(s.xs + xo, rb, NORM_VEC)
        words = device.load_vec(cute.recast_ptr(s.xs + xo, dtype=Int32), 4)  # (this thread's own store)
        for d in range(1, CLUSTER):
            cute.arch.store_async_dsmem(s.xs + xo, (words[0], words[1], words[2], words[3]), s.mbx,
                                        (t.rank + d) % CLUSTER)  # fmt: skip
        if lane < CLUSTER:  # lane d sends the slice's sum to rank d
            cute.arch.store_async_dsmem(s.ssn + (t.rank * GROUP + tok), device.f32_bits(ss), s.mbx, lane)

    @cute.jit
    def residual_chunk(self, a, t, off, res: cutlass.Constexpr, writes):
        """r = bf16(x + residual) of the 8 elements at off (as fp32) and their sum of squares; without a
        residual r = x + (-0.0) = x exactly (the same arithmetic). writes: this thread stores r into
        residual_out."""
        if cutlass.const_expr(res):
            rv = device.load_vec(a.residual + off, NORM_VEC)
        else:
            rv = cute.full((NORM_VEC,), -0.0, BFloat16)
        r, ss = device.norm_residual(device.load_vec(a.x + off, NORM_VEC), rv)
        if cutlass.const_expr(res):
            if writes:
                device.store_vec(a.residual_out + off, r.to(BFloat16), NORM_VEC)
        return r, ss

    @cute.jit
    def input_norm(self, a, t, s):
        """The second half, after norm_slices: once the mbarrier has every peer's slice and sum, every CTA
        holds r and the 8 sums of every token, adds the sums in warp order (device.norm_scale) and turns xs
        into xn. The norm kernel's arithmetic and order: xn is bit-identical."""
        chunks = (t.tid, t.tid + core.THREADS)
        w = [device.load_vec(a.norm_weight + v * NORM_VEC, NORM_VEC) for v in chunks]
        cute.arch.mbarrier_wait(s.mbx, 0)
        cute.arch.sync_threads()  # (this CTA's own slice was written by its threads, not by the mbarrier)
        sn = cute.make_tensor(s.ssn, cute.make_layout(CLUSTER * GROUP))
        for i in range(a.m):
            sc = device.norm_scale([sn[j * GROUP + i] for j in range(CLUSTER)], a.eps)
            for j, v in enumerate(chunks):
                off = cute.assume(i * self.xrow + v * NORM_VEC, divby=NORM_VEC)
                r = device.load_vec(s.xs + off, NORM_VEC).to(Float32)
                device.store_vec(s.xs + off, device.norm_apply(r, sc, w[j]), NORM_VEC)
        cute.arch.sync_threads()

    # ---------------------------------------------------------------- the token stream (docs/kernels.md §2.5)
    def stream_kernel(self, a, t):
        """Tiles 16, 32, 64: the CTA of rank 4 h + q computes K quarter q of the head's rows 64 h .. 64 h + 63
        (gemv_core.StreamGemv) for one group of 8 tokens after another, sending each group's partial sums to
        the owners of its tokens (rank j: token 8 i + j, all 128 rows) without waiting; then, as owner, the
        epilogue of its token of every group, one warp a group, with no further exchange (stream_epilogue).
        Both phases are loops over the groups at run time (one copy of their code, not one per group:
        unrolled, the 64-token kernel's groups each cost up to twice the 16-token kernel's, BENCHMARKS.md).
        Every token's slot and position are read once, into shared memory, by the threads of warp 0 (one or
        two tokens each), which also copy the cos|sin rows of the CTA's own tokens."""
        s = self.stream_shared(a, t)
        q = t.rank % QUARTERS
        row0 = ((t.cta // QUARTERS) * QUARTERS + t.tid // 32) * R  # this warp's row block
        first = lambda: self.stream_first(a, t, s, q)  # noqa: E731
        st = self.core.start(a.weight, a.weight_scale, a.global_scale, row0, q, t.tid, a.m,
                             issued=None if self.fp4 else first)  # fmt: skip
        if cutlass.const_expr(self.fp4):
            first()
        if cutlass.const_expr(self.wgmma and self.fp4):  # (BF16 parks in wg_four)
            self.stream_park(a, t, s, st)
        scale = self.cache_scale(a, t)
        if cutlass.const_expr(self.prologue):
            cute.arch.mbarrier_wait(s.mbn, 0)  # every quarter's sums of squares
            self.stream_norm_fill(a, t, s, q, 0)
            cute.arch.sync_threads()
        else:
            cute.arch.cluster_wait()  # the peers' mbarriers are initialised (before the first send)
        self.stream_mmas(a, t, s, st, q)
        cute.arch.mbarrier_wait(s.mbm, 0)  # the slots and positions are in shared memory
        self.stream_epilogue(a, t, s, st, scale)

    @cute.jit
    def stream_shared(self, a, t):
        """The stream's shared memory (gemv_core.StreamGemv.alloc), every token's slot (int32, -1: not
        written) and position (-1: outside the table), on mbm (one arrival per staging thread); with RoPE, the
        cos|sin row of this CTA's token of each group (rs, 512 B a group: read by the epilogue, which
        otherwise waited for the table after the group's sums), on mbc (q/k heads); prologue design: ssn
        [token][virtual warp], the 8 slice sums of squares of each token, on mbn. Initialised before the
        cluster arrive. (Every KB counts: the shared memory of 3 CTAs sets the SM's carveout, and what is
        left of the 256 KB is the L1 that the weight loads in flight pass through, BENCHMARKS.md.)"""
        xs, red, mbx, mbr = self.core.alloc()
        mslot = cute.arch.alloc_smem(Int32, self.tile, alignment=16)
        mpos = cute.arch.alloc_smem(Int32, self.tile, alignment=16)
        mbm = cute.arch.alloc_smem(Int64, 1, alignment=8)
        rs, mbc = mslot, mbm  # RoPE: this CTA's tokens' cos|sin rows (bulk copies by stream_meta), on mbc
        if cutlass.const_expr(self.rope):
            rs = cute.arch.alloc_smem(Float32, self.groups * HEAD_DIM, alignment=16)
            mbc = cute.arch.alloc_smem(Int64, 1, alignment=8)
        ssn = mslot  # (prologue design only)
        mbn = mbm
        if cutlass.const_expr(self.prologue):
            ssn = cute.arch.alloc_smem(Float32, self.tile * CLUSTER, alignment=16)
            mbn = cute.arch.alloc_smem(Int64, 1, alignment=8)
        if t.tid == 0:
            self.core.arm(xs, red, mbx, mbr)
            cute.arch.mbarrier_init(mbm, self.meta_threads)
            if cutlass.const_expr(self.rope):
                cute.arch.mbarrier_init(mbc, 1)
            if cutlass.const_expr(self.prologue):
                cute.arch.mbarrier_init(mbn, 1)
            cute.arch.mbarrier_init_fence()
            if cutlass.const_expr(self.rope):
                if not t.is_v:  # one row of cos|sin per group
                    groups = (a.m + (GROUP - 1)) // GROUP
                    cute.arch.mbarrier_arrive_and_expect_tx(mbc, groups * ROPE_ROW_BYTES)
            if cutlass.const_expr(self.prologue):  # 2 sums from each of the 4 quarters' CTAs, per token
                cute.arch.mbarrier_arrive_and_expect_tx(mbn, a.m * (CLUSTER * 4))
        cute.arch.sync_warp()  # warp 0's other threads use the mbarriers before the cluster wait (mbx, mbm)
        cute.arch.cluster_arrive_relaxed()
        return SimpleNamespace(xs=xs, red=red, mbx=mbx, mbr=mbr, ssn=ssn, mbn=mbn, mslot=mslot, mpos=mpos,
                               mbm=mbm, rs=rs, mbc=mbc)  # fmt: skip

    def stream_first(self, a, t, s, q):
        """Once the weights are issued (BF16) or after the guarded wait (NVFP4): the separate design's first
        ring stages (threads tid < 8, waiting for the predecessor themselves), or the prologue design's sums
        of squares (every thread); then warp 0 stages every token's slot and position."""
        if cutlass.const_expr(self.prologue):
            self.stream_norm_sums(a, t, s, q)
        else:
            self.stream_copy_first(a, t, s, q)

    @cute.jit
    def stream_copy_first(self, a, t, s, q):
        if t.tid < self.meta_threads:  # (warp 0)
            cute.arch.griddepcontrol_wait()
            if t.tid < GROUP:
                for i in cutlass.range_constexpr(self.core.stages):
                    if GROUP * i < a.m:
                        self.core.fill(s.xs, s.mbx, a.x, q, i, a.m, t.tid)
            if cutlass.const_expr(not (self.wgmma and self.fp4)):  # (NVFP4's wgmma: after the park)
                self.stream_meta(a, t, s)

    def wg_pass(self) -> bool:
        """This build runs groups 1-3 as a wgmma pass: the 32-token NVFP4 kernel compiled for sm_90a (sm_100a
        has no wgmma: there every group runs by mma.sync from the same tiles). Read while tracing."""
        return self.wgmma and self.arch == "sm_90a"

    @cute.jit
    def stream_park(self, a, t, s, st):
        """NVFP4's wgmma stream, once the weights are decoded: with 4 groups or more, A's parked words
        (gemv_core.StreamGemv.park) fenced for the wgmma's async proxy, and a CTA barrier; then warp 0 stages
        the slots and positions (after the barrier: its loads would hold the other warps there, 0.1 us a
        layer, BENCHMARKS.md §2 step 20)."""
        if cutlass.const_expr(self.wg_pass()):
            if (a.m + (GROUP - 1)) // GROUP >= 4:  # (a pass runs: stream_mmas)
                self.core.park(st, s.xs, t.tid)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()
        if t.tid < self.meta_threads:
            self.stream_meta(a, t, s)

    @cute.jit
    def stream_meta(self, a, t, s):
        """Threads tid < meta_threads (warp 0, the warp of the thread that initialised mbm), after the wait:
        tokens tid and tid + 32: the slot as int32 (-1 unless inside the cache, which the loader keeps below
        2**31 slots) and the position (-1 outside the cos/sin table; tokens past m take token m - 1's) into
        shared memory; then an arrival on mbm. With RoPE, in a q/k head, the thread of each of this CTA's
        tokens copies the token's cos|sin row into rs (one 512-byte bulk copy, on mbc). Every load is issued
        before any is used, so no token waits behind another (8 threads taking 8 tokens each, one after
        another, with the RoPE coefficients' copies depending on each position, made the gap between layers
        8.4 instead of 3.7 us at M = 64, BENCHMARKS.md)."""
        toks = [t.tid + 32 * j for j in range((self.tile + 31) // 32)]
        slots, poss = [], []
        for tok in toks:
            slot = Int64(-1)
            if tok < a.num_slot_mapping:
                slot = device.at(a.slot_mapping, tok)[0]
            slots.append(slot)
            if cutlass.const_expr(self.rope):
                poss.append(device.at(a.positions, cutlass.min(tok, a.m - 1))[0])
        for j, tok in enumerate(toks):
            ok = slots[j] >= 0 and slots[j] < a.num_cache_slots
            device.put(s.mslot, tok, Int32(cutlass.select_(ok, slots[j], Int64(-1))))
            if cutlass.const_expr(self.rope):
                p = poss[j]
                inside = p >= 0 and p < a.max_pos
                device.put(s.mpos, tok, Int32(cutlass.select_(inside, p, Int64(-1))))
                # this CTA's tokens (8 i + rank, i < the groups of m): their table row (row 0 outside it)
                if not t.is_v and tok % GROUP == t.rank and tok < (a.m + (GROUP - 1)) // GROUP * GROUP:
                    row = Int64(cutlass.select_(inside, p, Int64(0))) * HEAD_DIM
                    src = a.cos_sin_cache + cute.assume(row, divby=HEAD_DIM)
                    device.bulk_copy(s.rs + cute.assume(tok // GROUP * HEAD_DIM, divby=HEAD_DIM), src, s.mbc,
                                     ROPE_ROW_BYTES)  # fmt: skip
        cute.arch.mbarrier_arrive(s.mbm)  # (after this thread's stores)

    def stream_rope(self, a, s, tok, lane):
        """(ok, cos, sin) of dims 4 lane .. 4 lane + 3 at token tok's position: the row stream_meta copied
        into rs (row 0 of the table for a position outside it, which gives ok = False, as device.rope_coeffs
        does). Two 16-byte shared-memory loads (lanes l and l + 16 read the same words)."""
        if cutlass.const_expr(self.rope):
            ok = cute.make_tensor(s.mpos, cute.make_layout(self.tile))[tok] >= 0
            row = s.rs + cute.assume(tok // GROUP * HEAD_DIM + (4 * lane) % HALF_DIM, divby=4)
            return ok, core.ld_shared_f32x4(row), core.ld_shared_f32x4(row + HALF_DIM)
        return True, [Float32(1.0)] * 4, [Float32(0.0)] * 4

    @cute.jit
    def stream_mmas(self, a, t, s, st, q):
        """Every group's MMAs (a loop at run time) and partial sums to the tokens' owners; its ring stage
        refilled (separate design: bulk copies of group i + stages once every warp has read it; prologue
        design: group i + 1 normalised into the other stage after the MMAs, then a CTA barrier)."""
        groups = (a.m + (GROUP - 1)) // GROUP
        if cutlass.const_expr(self.wg_pass()):  # (docs/kernels.md §2.6)
            if groups >= 4:  # groups 0-3 (group 0, then a pass), at 64 tokens 4-7 so too if all 8 are there
                self.wg_four(a, t, s, st, q, 0, groups)
                if cutlass.const_expr(self.groups > 4):
                    if groups == self.groups:
                        self.wg_four(a, t, s, st, q, 1, groups)
                    else:
                        self.ring_groups(a, t, s, st, q, groups, 4)
            else:  # (N = 8 or 16 reuses A too little for the pass to pay: BENCHMARKS.md §2 step 20)
                self.ring_groups(a, t, s, st, q, groups, 0)
        elif cutlass.const_expr(self.wgmma):  # sm_100a has no wgmma: the same tiles, every group by mma.sync
            self.ring_groups(a, t, s, st, q, groups, 0)
        elif cutlass.const_expr(self.prologue):
            for i in range(groups):
                d = self.core.partials(st, self.core.stage(s.xs, s.mbx, i, wait=False), i, a.m, t.tid)
                if i + 1 < groups:  # (the other stage: read by group i - 1's MMAs, which every warp ended
                    self.stream_norm_fill(a, t, s, q, i + 1)  # before the last barrier)
                cute.arch.sync_threads()
                self.core.send_tokens(s.red, s.mbr, d, i, t.rank, t.tid)
        else:
            for i in cutlass.range(groups, unroll=1):  # (one copy of the loop: ptxas unrolled tile 16's 3x)
                d = self.core.partials(st, self.core.stage(s.xs, s.mbx, i), i, a.m, t.tid)
                if i + self.core.stages < groups:  # (never at tiles 16 and 32: their rings hold every group)
                    self.core.refill(s.xs, s.mbx, a.x, q, i, a.m, t.tid)
                self.core.send_tokens(s.red, s.mbr, d, i, t.rank, t.tid)

    @cute.jit
    def wg_four(self, a, t, s, st, q, h: cutlass.Constexpr, groups):
        """The wgmma stream's groups 4 h .. 4 h + 3, in ring stages 0..3 (their fill h): group 4 h by
        mma.sync as soon as its x lands, then the other three in one wgmma pass (N = 24). In the 64-token
        kernel's first four each stage, once read, is refilled with the group 4 ahead, if there is one (stage
        0 after group 0's MMAs, so that group 4's x arrives during the pass; stages 1-3 after the pass),
        each after a CTA barrier: refilled on the stages' "read" mbarriers instead, ptxas could no longer
        prove the warps converged and gave every shuffle after them a collective path (168 registers, 500
        more instructions; 0.2-0.5 us a layer slower, BENCHMARKS.md §2 step 22). BF16's park barrier is
        group 0's. Two passes of 32 `wgmma` in the code (h is a constant: a loop over h at run time spilled
        25 registers)."""
        cute.arch.mbarrier_wait(s.mbx, h)
        d = self.core.ring_partials(st, s.xs, 0, t.tid)
        if cutlass.const_expr(h == 0 and not self.fp4):  # BF16 parks A's words here: its weights arrive after
            # the wait, and group 0's MMAs meet them as they come (parked first, group 0 would wait for all)
            self.core.park(st, s.xs, t.tid)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
        if cutlass.const_expr(h == 0 and self.groups > 4):
            if cutlass.const_expr(self.fp4):  # (BF16: the park's barrier above)
                cute.arch.sync_threads()
            if 4 < groups and t.tid < GROUP:
                self.core.fill(s.xs, s.mbx, a.x, q, 4, a.m, t.tid)
        self.core.send_tokens(s.red, s.mbr, d, 4 * h, t.rank, t.tid)
        for j in cutlass.range_constexpr(1, 4):
            cute.arch.mbarrier_wait(s.mbx + j, h)
        ds = self.core.wg_pass(st, s.xs, GROUP * 3, 1)
        if cutlass.const_expr(h == 0 and self.groups > 4):
            cute.arch.sync_threads()
            for j in cutlass.range_constexpr(1, 4):
                if j + 4 < groups and t.tid < GROUP:
                    self.core.fill(s.xs, s.mbx, a.x, q, j + 4, a.m, t.tid)
        for j in cutlass.range_constexpr(1, 4):
            self.core.send_tokens(s.red, s.mbr, ds[j - 1], 4 * h + j, t.rank, t.tid)

    @cute.jit
    def ring_groups(self, a, t, s, st, q, groups, start: cutlass.Constexpr):
        """The wgmma stream's groups start .. groups - 1 one after another by mma.sync, x by ldmatrix from
        their ring stages' tiles (sm_100a's 64-token kernel: its stages refilled with the group 4 ahead once
        read; on sm_90a groups 4.. come after wg_four's refills, and none is refilled again)."""
        for i in cutlass.range(start, groups, unroll=1):
            if cutlass.const_expr(self.core.refills):
                stage = i % self.core.stages
                cute.arch.mbarrier_wait(s.mbx + stage, (i // self.core.stages) % 2)
                d = self.core.ring_partials(st, s.xs, stage, t.tid)
                if cutlass.const_expr(not self.wg_pass()):  # (compiled in, the branch alone brings the
                    if i + self.core.stages < groups:  # collective paths of wg_four's docstring back)
                        self.core.refill(s.xs, s.mbx, a.x, q, i, a.m, t.tid)
            else:  # (a ring of every group)
                cute.arch.mbarrier_wait(s.mbx + i, 0)
                d = self.core.ring_partials(st, s.xs, i, t.tid)
            self.core.send_tokens(s.red, s.mbr, d, i, t.rank, t.tid)

    @cute.jit
    def stream_epilogue(self, a, t, s, st, scale):
        """As the owner of token 8 i + rank of every group i (gemv_core.StreamGemv.send_tokens): warp w
        takes groups w, w + 4, .. (a loop at run time), lane l the head's dims 4 l .. 4 l + 3. As soon as the
        group's partial sums are in (every CTA's, for all 128 rows), the quarters' sums rounded to bf16; v
        head: the cache stores; q/k head: the RMSNorm, RoPE and stores with no exchange at all, since the
        whole head of the token is in this warp (the row owners before it sent the sums of squares and the
        RoPE partners across the cluster after each group, up to 2.3 us a layer slower: BENCHMARKS.md §2
        step 18). The sum of squares is the 8-token kernel's, bit for bit: its 16-lane butterfly over each
        16-dim block (here two adds in the lane, then lanes ^ 1 and ^ 2) and the 8 blocks' sums in rank
        order; the RoPE partner (dim ^ 64) is in lane ^ 16."""
        groups = (a.m + (GROUP - 1)) // GROUP
        warp, lane, _, _ = device.lanes(t.tid)
        dims = [4 * lane + j for j in range(4)]
        if cutlass.const_expr(self.fp4 and self.wgmma and self.groups > 4):  # NVFP4's global scale read again
            st["gs"] = core.global_scale(a.global_scale)  # here: held from the start, ptxas spilled it
        wn, wp = self.norm_weights(a, t, dims)
        if cutlass.const_expr(self.rope):
            if not t.is_v:
                cute.arch.mbarrier_wait(s.mbc, 0)  # this CTA's cos|sin rows (copied while the MMAs ran)
        for i in cutlass.range(warp, groups, core.WARPS, unroll=1):
            tok = GROUP * i + t.rank
            slot = self.stream_slot(s, tok)
            cute.arch.mbarrier_wait(s.mbr + i, 0)
            rope = self.stream_rope(a, s, tok, lane)
            hv = [v.to(BFloat16).to(Float32) for v in self.core.token_rows(st, s.red, i, lane)]
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

    def stream_slot(self, s, tok):
        return cute.make_tensor(s.mslot, cute.make_layout(self.tile))[tok]

    def finish_token(self, a, hv, rope, wn, wp, dims):
        """A token's 128 dims in one warp (hv: dims 4 lane ..): finish_value's RMSNorm and RoPE, bit for
        bit."""
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
            y = hv[j] * inv * wn[j]
            if cutlass.const_expr(self.rope):
                yp = cute.arch.shuffle_sync_bfly(hv[j], 16) * inv * wp[j]
                y = device.rotate(y, yp, ok, c[j], sn[j], dims[j])
            ys.append(y.to(BFloat16))
        return ys

    @cute.jit
    def stream_norm_sums(self, a, t, s, q):
        """The prologue design's input RMSNorm, first pass: CTA 4 h + q computes, for every token (warp w:
        tokens w, w + 4, ..), the sums of squares of r = bf16(x + residual) over the norm kernel's virtual
        warps 2 q and 2 q + 1 (k in [512 q, 512 q + 512): the same chunks, lanes and butterfly) and sends both
        to the 4 CTAs of its half (which hold the other quarters), on mbn. The first head's CTAs of half 0
        write residual_out."""
        cute.arch.cluster_wait()
        cute.arch.griddepcontrol_wait()
        warp, lane, _, _ = device.lanes(t.tid)
        for j in range(self.tile // core.WARPS):  # token warp + 4 j
            tok = warp + j * core.WARPS
            if tok < a.m:
                self.with_residual(a, self.stream_norm_sum, a, t, s, q, tok, lane)
        if t.tid < self.meta_threads:
            self.stream_meta(a, t, s)

    @cute.jit
    def stream_norm_sum(self, a, t, s, q, tok, lane, res: cutlass.Constexpr):
        sums = []
        for v in cutlass.range_constexpr(2):  # virtual warps 2 q + v
            off = cute.assume(tok * core.K + q * core.QUARTER + v * (32 * NORM_VEC) + lane * NORM_VEC,
                              divby=NORM_VEC)  # fmt: skip
            _, ss = self.residual_chunk(a, t, off, res, t.cta < QUARTERS)
            sums.append(device.f32_bits(cute.arch.warp_reduction_sum(ss)))
        if lane < QUARTERS:  # lane d sends both sums to rank 4 h + d
            dst = cute.assume(tok * CLUSTER + 2 * q, divby=2)
            cute.arch.store_async_dsmem(s.ssn + dst, (sums[0], sums[1]), s.mbn, t.rank - q + lane)

    @cute.jit
    def stream_norm_fill(self, a, t, s, q, i):
        """The prologue design's second pass for group i (after mbn: every quarter's sums): xn of the group's
        tokens, this CTA's quarter, into ring stage i % stages (rows 2 j + tid // 64, 8 elements at column
        8 (tid % 64) each): r recomputed from x and the residual (the same bits), scaled with the 8 virtual
        warps' sums added in order (device.norm_scale) and the norm weight: bit-identical to the norm
        kernel's xn."""
        col = (t.tid % 64) * NORM_VEC
        stage = s.xs + (i % self.core.stages) * GROUP * self.core.xrow
        for j in range(GROUP // 2):
            row = 2 * j + t.tid // 64
            tok = GROUP * i + row
            if tok < a.m:
                self.with_residual(a, self.stream_norm_row, a, t, s, q, stage, row, tok, col)

    @cute.jit
    def stream_norm_row(self, a, t, s, q, stage, row, tok, col, res: cutlass.Constexpr):
        nw = device.load_vec(a.norm_weight + (q * core.QUARTER + col), NORM_VEC)  # (L1 hits after the first)
        sn = cute.make_tensor(s.ssn, cute.make_layout(self.tile * CLUSTER))
        sc = device.norm_scale([sn[tok * CLUSTER + v] for v in range(CLUSTER)], a.eps)
        off = cute.assume(tok * core.K + q * core.QUARTER + col, divby=NORM_VEC)
        r, _ = self.residual_chunk(a, t, off, res, False)
        device.store_vec(stage + cute.assume(row * self.core.xrow + col, divby=NORM_VEC),
                         device.norm_apply(r, sc, nw), NORM_VEC)  # fmt: skip

    # ------------------------------------------------------------------------- the per-head epilogue (§2.3)
    def norm_weights(self, a, t, dims):
        """The q/k norm weights of the given dims and of their rotation partners (model constants): lists."""
        qw = cute.make_tensor(a.q_norm_weight, cute.make_layout(HEAD_DIM))
        kw = cute.make_tensor(a.k_norm_weight, cute.make_layout(HEAD_DIM))
        is_q = t.head < self.nq
        wn = [Float32(cutlass.select_(is_q, qw[d].to(Float32), kw[d].to(Float32))) for d in dims]
        wp = [Float32(cutlass.select_(is_q, qw[d ^ HALF_DIM].to(Float32), kw[d ^ HALF_DIM].to(Float32)))
              for d in dims]  # fmt: skip
        return wn, wp

    @cute.jit
    def epilogue_inputs(self, a, t, i: cutlass.Constexpr):
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

    def cache_scale(self, a, t):
        """The FP8 cache's scale of this head (k or v); 1 for a BF16 cache."""
        if cutlass.const_expr(self.fp8):
            return Float32(cutlass.select_(t.is_v, device.at(a.v_scale, 0)[0], device.at(a.k_scale, 0)[0]))
        return Float32(1.0)

    def geometry(self, a):
        return a.num_cache_slots, a.block_size, a.stride_block, a.stride_slot, a.stride_head

    @cute.jit
    def epilogue_send(self, a, t, buf, hv, i, scale, slot):
        """v head: this thread's value (row r, token 8 i + tk) to the paged cache at slot. q/k head: the
        token's partial sum of squares over this CTA's 16 dims (a 16-lane butterfly) to every CTA of the head
        (lane r to rank r) and, with RoPE, the value to the rotation partner (rank ^ 4, send_partner), by
        st.async on their mbarrier of the group (buf: ssq, pv, mbar)."""
        if t.is_v:
            self.store_v(a, t, GROUP * i + t.tk, slot, hv, scale)
        else:
            ssq, pv, mbar = buf
            part = hv * hv
            for o in (1, 2, 4, 8):
                part = part + cute.arch.shuffle_sync_bfly(part, o)
            if t.r < CLUSTER:  # lane r sends the partial to rank r
                cute.arch.store_async_dsmem(ssq + (t.rank * GROUP + t.tk), device.f32_bits(part), mbar, t.r)
            if cutlass.const_expr(self.rope):
                self.send_partner(t, pv, mbar, hv)

    @cute.jit
    def send_partner(self, t, pv, mbar, hv):
        """The 8-token kernel: this thread's value into the rotation partner's (rank ^ 4) pv, [row][token],
        word partner_word(t). (The token stream exchanges nothing: stream_epilogue.)"""
        partner = t.rank ^ (CLUSTER // 2)
        cute.arch.store_async_dsmem(pv + self.partner_word(t), device.f32_bits(hv), mbar, partner)

    def partner_word(self, t):
        """The word of pv that holds this thread's partner value (send_partner's layout)."""
        return t.r * GROUP + t.tk

    @cute.jit
    def store_v(self, a, t, tok, slot, hv, scale):
        if tok < a.m:
            device.store_cache(a.v_cache, slot, *self.geometry(a), t.head - (self.nq + self.nkv), t.dim,
                               hv.to(BFloat16), self.fp8, scale, self.streamed)  # fmt: skip

    @cute.jit
    def epilogue_finish(self, a, t, buf, hv, i, scale, e, wn, wp):
        """q/k head, once the group's mbarrier has every byte: finish_value, stored as q or into the k
        cache."""
        if not t.is_v:
            cute.arch.mbarrier_wait(buf[2], 0)
            yb = self.finish_value(a, t, buf, hv, e[1:], wn, wp)
            self.store_qk(a, t, GROUP * i + t.tk, e[0], yb, scale)

    def finish_value(self, a, t, buf, hv, rope, wn, wp):
        """q/k head, the group's exchange received: the RMSNorm (fp32, the 8 ranks' sums in rank order: the
        same in all 8 CTAs), NeoX RoPE (rope: ok, cos, sin) and one bf16 rounding of its own dim."""
        ssq, pv, _ = buf
        ok, c, sn = rope
        st = cute.make_tensor(ssq, cute.make_layout(CLUSTER * GROUP))
        tot = st[t.tk]
        for j in range(1, CLUSTER):  # rank order
            tot = tot + st[j * GROUP + t.tk]
        inv = cute.math.rsqrt(tot * Float32(1.0 / HEAD_DIM) + a.qk_eps)
        y = hv * inv * wn
        if cutlass.const_expr(self.rope):
            yp = cute.make_tensor(pv, cute.make_layout(R * GROUP))[self.partner_word(t)] * inv * wp
            y = device.rotate(y, yp, ok, c, sn, t.dim)
        return y.to(BFloat16)

    @cute.jit
    def store_qk(self, a, t, tok, slot, yb, scale, dim=None):
        """q, or the k cache (an FP8 cache: e4m3(value / scale) of the same bf16 value), for tokens < m, at
        this thread's dim (or the given one)."""
        dim = t.dim if dim is None else dim
        if tok < a.m:
            if t.head < self.nq:
                device.put(a.q, tok * (self.nq * HEAD_DIM) + t.head * HEAD_DIM + dim, yb)
            else:
                device.store_cache(a.k_cache, slot, *self.geometry(a), t.head - self.nq, dim, yb,
                                   self.fp8, scale, self.streamed)  # fmt: skip

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

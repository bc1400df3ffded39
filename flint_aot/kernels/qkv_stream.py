"""The fused qkv kernel for tiles of 16, 32 and 64 tokens: the token stream (docs/kernels.md §2.5, §2.6).

The CTA of rank 4 h + q computes K quarter q of the head's rows 64 h .. 64 h + 63 (stream_gemv.StreamGemv)
for one group of 8 tokens after another, sending each group's partial sums to the owners of its tokens
(rank j: token 8 i + j, all 128 rows) without waiting; then, as owner, the epilogue of its token of every
group, one warp a group, with no further exchange (epilogue.HeadEpilogue.token). How the groups run is the
group schedule (schedules.py), picked here once from the design, the tile and the architecture; how x gets
into the ring is the design's part (activations.py). Every token's slot and position are read once, into
shared memory, by the threads of warp 0, which also copy the cos|sin rows of the CTA's own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot.kernels import device, trace
from flint_aot.kernels.activations import QUARTERS, StreamCopy, StreamNorm
from flint_aot.kernels.diagnostics import SERVING, Diagnostics
from flint_aot.kernels.fp4 import FP4_PRE_QKV
from flint_aot.kernels.mma import ROWS, WARPS, ld_shared_f32x4
from flint_aot.kernels.qkv_base import QkvKernel, Thread
from flint_aot.kernels.schedules import GroupRun, MmaRing, PrologueRing, TiledMmaRing, WgmmaFours
from flint_aot.kernels.stream_gemv import (
    GROUP,
    STAGES,
    X_OWN,
    X_RING,
    X_TILES,
    StreamConfig,
    StreamGemv,
    StreamSmem,
)
from flint_aot.kernels.weights import global_scale
from loader.abi import HALF_DIM, HEAD_DIM, wgmma_stream

R = ROWS
ROPE_ROW_BYTES = HEAD_DIM * 4  # one position's cos|sin row of the fp32 table


@dataclass(frozen=True)
class StreamQkvSmem:
    core: StreamSmem  # the stream GEMV's: x ring, partial sums, their mbarriers
    xs: object
    mbx: object
    red: object
    mbr: object
    mslot: object  # every token's slot (int32; -1: not written)
    mpos: object  # every token's position (-1: outside the table)
    mbm: object  # slots and positions staged (one arrival per staging thread)
    rs: object  # RoPE: the cos|sin row of this CTA's token of each group (on mbc, q/k heads)
    mbc: object
    ssn: object  # prologue design: the sums of squares of each token's K quarters (on mbn)
    mbn: object


class StreamQkv(QkvKernel):
    def __init__(self, spec: dict, arch: str, diag: Diagnostics = SERVING):
        super().__init__(spec, arch, diag)
        # the two-kernel design's 32- and 64-token kernels read xn as wgmma tiles (loader.abi.WG_STRIDES)
        self.tiles = wgmma_stream(spec)
        if self.prologue:  # (it normalises its ring itself, one group ahead: 2 stages)
            self.schedule, stages, x = PrologueRing(), 2, X_OWN
        elif self.tiles:  # (groups 4 h .. 4 h + 3 in stages 0..3)
            self.schedule = WgmmaFours(self.fp4) if arch == "sm_90a" else TiledMmaRing(refill=True)
            stages, x = 4, X_TILES
        else:  # (the ring holds both groups of the 16-token tile; one copy of the loop's code)
            self.schedule, x = MmaRing(unroll=1), X_RING
            stages = STAGES if self.tile > 32 else self.tile // GROUP
        self.core = StreamGemv(StreamConfig(self.fp4, self.tile, FP4_PRE_QKV, self.k, stages, x,
                                            owners="tokens",
                                            read_barriers=self.schedule.read_barriers))  # fmt: skip
        self.dyn_smem = self.core.dyn_smem
        self.min_ctas_per_sm = 3  # registers within 3 CTAs per SM: every grid one wave
        # the hardware may place a cluster's CTAs as it balances the SMs (faster on nearly every row from
        # M = 12 to 64; the 8-token kernels are faster with the driver's default)
        self.cluster_policy = diag.cluster_policy or "load_balancing"
        self.groups = self.tile // GROUP
        self.meta_threads = min(self.tile, 32)  # warp 0 stages slots and positions
        # NVFP4 with x as tiles: warp 0 stages them once the weights are decoded (on sm_90a after the park:
        # its loads would hold the other warps at the park's barrier)
        self.meta_late = self.fp4 and self.tiles
        self.x = StreamNorm(self.core, self.meta_threads, self.tile) if self.prologue else \
            StreamCopy(self.core, self.meta_threads)  # fmt: skip

    def body(self, a, t: Thread):
        s = self.shared(a, t)
        q = t.rank % QUARTERS
        row0 = ((t.cta // QUARTERS) * QUARTERS + t.tid // 32) * R  # this warp's row block
        meta = None if self.meta_late else (lambda: self.stage_meta(a, t, s))
        first = lambda: self.x.first(a, t, s, q, meta)  # noqa: E731
        st = self.core.start(a.weight, a.weight_scale, a.global_scale, row0, q, t.tid, a.m,
                             issued=None if self.fp4 else first, tr=t.tr)  # fmt: skip
        if cutlass.const_expr(self.fp4):
            first()
        g = GroupRun(self.core, s.core, st, a.x, q, t.rank, a.m, t.tid, t.tr,
                     normalise=lambda i: self.x.normalise(a, t, s, q, i))  # fmt: skip
        if cutlass.const_expr(self.meta_late):
            self.prepare_then_meta(a, t, s, g)
        scale = self.epi.cache_scale(a, t)
        t.tr.mark(trace.WAIT_RETURNED, zero=st.zero)
        self.x.ready(a, t, s, q)
        groups = (a.m + (GROUP - 1)) // GROUP
        self.schedule.run(g, groups)
        cute.arch.mbarrier_wait(s.mbm, 0)  # the slots and positions are in shared memory
        self.epilogue(a, t, s, st, scale)

    @cute.jit
    def shared(self, a, t: Thread) -> StreamQkvSmem:
        """The stream's shared memory, initialised before the cluster arrive. (Every KB counts: the shared
        memory of 3 CTAs sets the SM's carveout, and what is left of the 256 KB is the L1 that the weight
        loads in flight pass through.)"""
        sm = self.core.alloc()
        mslot = cute.arch.alloc_smem(Int32, self.tile, alignment=16)
        mpos = cute.arch.alloc_smem(Int32, self.tile, alignment=16)
        mbm = cute.arch.alloc_smem(Int64, 1, alignment=8)
        rs, mbc = None, None
        if cutlass.const_expr(self.rope):
            rs = cute.arch.alloc_smem(Float32, self.groups * HEAD_DIM, alignment=16)
            mbc = cute.arch.alloc_smem(Int64, 1, alignment=8)
        ssn, mbn = self.x.alloc()
        if t.tid == 0:
            self.core.arm(sm)
            cute.arch.mbarrier_init(mbm, self.meta_threads)
            if cutlass.const_expr(self.rope):
                cute.arch.mbarrier_init(mbc, 1)
            self.x.init(mbn)
            cute.arch.mbarrier_init_fence()
            if cutlass.const_expr(self.rope):
                if not t.is_v:  # one row of cos|sin per group
                    groups = (a.m + (GROUP - 1)) // GROUP
                    cute.arch.mbarrier_arrive_and_expect_tx(mbc, groups * ROPE_ROW_BYTES)
            self.x.expect(a, mbn)
        cute.arch.sync_warp()  # warp 0's other threads use the mbarriers before the cluster wait (mbx, mbm)
        cute.arch.cluster_arrive_relaxed()
        return StreamQkvSmem(sm, sm.xs, sm.mbx, sm.red, sm.mbr, mslot, mpos, mbm, rs, mbc, ssn, mbn)

    @cute.jit
    def prepare_then_meta(self, a, t, s, g):
        """NVFP4 with x as tiles, once the weights are decoded: the schedule's preparation (sm_90a: A's words
        parked), then warp 0 stages the slots and positions."""
        self.schedule.prepare(g)
        if t.tid < self.meta_threads:
            self.stage_meta(a, t, s)

    @cute.jit
    def stage_meta(self, a, t, s):
        """Threads tid < meta_threads (warp 0, the warp of the thread that initialised mbm), after the wait:
        tokens tid and tid + 32: the slot as int32 (-1 unless inside the cache, which the loader keeps below
        2**31 slots) and the position (-1 outside the cos/sin table; tokens past m take token m - 1's) into
        shared memory; then an arrival on mbm. With RoPE, in a q/k head, the thread of each of this CTA's
        tokens copies the token's cos|sin row into rs (one 512-byte bulk copy, on mbc). Every load is issued
        before any is used, so no token waits behind another."""
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

    def rope_coeffs(self, a, s, tok, lane):
        """(ok, cos, sin) of dims 4 lane .. 4 lane + 3 at token tok's position: the row stage_meta copied
        into rs (row 0 of the table for a position outside it, which gives ok = False, as
        device.rope_coeffs does). Two 16-byte shared-memory loads (lanes l and l + 16 read the same words)."""
        if cutlass.const_expr(self.rope):
            ok = cute.make_tensor(s.mpos, cute.make_layout(self.tile))[tok] >= 0
            row = s.rs + cute.assume(tok // GROUP * HEAD_DIM + (4 * lane) % HALF_DIM, divby=4)
            return ok, ld_shared_f32x4(row), ld_shared_f32x4(row + HALF_DIM)
        return True, [Float32(1.0)] * 4, [Float32(0.0)] * 4

    @cute.jit
    def epilogue(self, a, t, s, st, scale):
        """As the owner of token 8 i + rank of every group i: warp w takes groups w, w + 4, .. (a loop at run
        time), lane l the head's dims 4 l .. 4 l + 3. As soon as the group's partial sums are in (every
        CTA's, for all 128 rows), the quarters' sums rounded to bf16, then the token's q/k norm, RoPE and
        stores, or the v cache's (HeadEpilogue.token)."""
        groups = (a.m + (GROUP - 1)) // GROUP
        warp, lane, _, _ = device.lanes(t.tid)
        dims = [4 * lane + j for j in range(4)]
        if cutlass.const_expr(self.fp4 and self.tiles and self.groups > 4):  # NVFP4's global scale read again
            st = st.with_global_scale(global_scale(a.global_scale))  # here: held from the start, it spilled
        wn, wp = self.epi.norm_weights(a, t, dims)
        if cutlass.const_expr(self.rope):
            if not t.is_v:
                cute.arch.mbarrier_wait(s.mbc, 0)  # this CTA's cos|sin rows (copied while the MMAs ran)
        for i in cutlass.range(warp, groups, WARPS, unroll=1):
            tok = GROUP * i + t.rank
            slot = cute.make_tensor(s.mslot, cute.make_layout(self.tile))[tok]
            cute.arch.mbarrier_wait(s.mbr + i, 0)
            t.tr.at_group(i, groups, trace.EXCHANGED, minus_one=True, per_warp=True)
            rope = self.rope_coeffs(a, s, tok, lane)
            hv = [v.to(BFloat16).to(Float32) for v in self.core.token_rows(st, s.red, i, lane)]
            self.epi.token(a, t, tok, slot, hv, rope, wn, wp, scale, dims, lane)
            t.tr.at_group(i, groups, trace.STORED, minus_one=True, per_warp=True)

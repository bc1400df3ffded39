"""How the activations reach a fused qkv kernel's shared memory, one part per design and kernel shape
(docs/kernels.md §2-§3):

* the two-kernel design (`norm: separate`) copies the xn that the norm kernel wrote in the layout of that
  shared memory: `Tile8Copy` (one multicast bulk copy of all M tokens into the 8 CTAs of a cluster) and
  `StreamCopy` (one bulk copy per group of 8 tokens and K quarter into the ring);
* the prologue design (`norm: prologue`) runs the input RMSNorm in the kernel itself, split over the
  cluster: `Tile8Norm` and `StreamNorm`. They use the norm kernel's arithmetic and order (device.norm_*),
  so xn is bit-identical to the norm kernel's.

The threads that fetch or read the activations wait for the predecessor (griddepcontrol.wait) themselves.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot.kernels import device
from flint_aot.kernels.device import NORM_VEC
from flint_aot.kernels.mma import THREADS, WARPS
from flint_aot.kernels.stream_gemv import GROUP
from loader.abi import CLUSTER, PROLOGUE_HIDDEN

# The prologue design splits each row into the norm kernel's virtual warps of 256 elements: at hidden 2048,
# one per CTA of the 8-token kernel's cluster and two per K quarter of the token stream's
K = PROLOGUE_HIDDEN[0]
K_PART = K // CLUSTER  # the 8-token prologue design: the slice of every token each CTA normalises
QUARTER = K // WARPS
QUARTERS = WARPS  # the token stream: K quarters per row block, CTAs per quad (a quad: 64 rows)
assert PROLOGUE_HIDDEN == (K,) and K_PART == 32 * NORM_VEC, "one virtual warp of the norm per CTA"


@cute.jit
def with_residual(a, body, *args):
    """body(*args, res), res a compile-time bool: whether this call has a residual (the body is compiled
    for both cases, and the call picks one at run time)."""
    if a.has_residual != 0:
        body(*args, True)
    else:
        body(*args, False)


@cute.jit
def residual_chunk(a, off, res: cutlass.Constexpr, writes):
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


# ------------------------------------------------------------------------------ the 8-token kernel
class Tile8Copy:
    """Two-kernel design: xn, written by the norm kernel with this shared memory's padded rows
    (loader.abi.xn_strides), into all 8 CTAs by one multicast copy, on the mbarrier mbx."""

    def __init__(self, xrow: int):
        self.xrow = xrow

    def sums_buffer(self, ssq):
        return ssq  # (no input-norm sums to receive)

    def expect_bytes(self, a):
        return a.m * (self.xrow * 2)  # the multicast copy of x (its rows padded as here)

    @cute.jit
    def fetch(self, a, t, s):
        """Wait on the cluster barrier (every peer's mbarriers are initialised); then thread 0 of rank 0
        waits for the predecessor itself (the copy needs no weights, which may still be in flight) and
        copies the activations of all m tokens into all 8 CTAs with one multicast copy (one copy per token,
        or each rank its slice of every token, was slower: the count of copies costs, not their bytes)."""
        cute.arch.cluster_wait()
        if t.tid == 0 and t.rank == 0:
            cute.arch.griddepcontrol_wait()
            device.bulk_multicast(s.xs, a.x, s.mbx, a.m * (self.xrow * 2))

    def finish(self, a, t, s):
        pass


class Tile8Norm:
    """Prologue design: rank r normalises slice r (k in [256 r, 256 r + 256)) of every token and the 8 CTAs
    exchange r = bf16(x + residual) and the slices' sums of squares (on mbx; ssn: [src rank][token])."""

    def __init__(self, xrow: int):
        self.xrow = xrow

    def sums_buffer(self, ssq):
        # (apart from ssq, which a peer ahead of this CTA may already be writing)
        return cute.arch.alloc_smem(Float32, CLUSTER * GROUP, alignment=16)

    def expect_bytes(self, a):
        return a.m * ((CLUSTER - 1) * K_PART * 2 + CLUSTER * 4)  # the 7 peers' slices of r, the 8 sums

    @cute.jit
    def fetch(self, a, t, s):
        """The first half: once every peer's mbarrier is initialised (cluster barrier) and the predecessor
        is done (each thread waits for it itself), CTA rank r computes slice r of every token (exactly the
        norm kernel's warp r; one warp per token here, 8 elements per lane, the same butterfly), keeps r in
        its shared memory and sends it (st.async) and its warp sum to the 7 peers. The CTAs of the first
        head write residual_out, slice r each."""
        cute.arch.cluster_wait()
        cute.arch.griddepcontrol_wait()
        warp, lane, _, _ = device.lanes(t.tid)
        col = t.rank * K_PART + lane * NORM_VEC  # this lane's chunk of the CTA's slice
        for j in range(GROUP // WARPS):  # token warp + 4 j
            tok = warp + j * WARPS
            if tok < a.m:
                with_residual(a, self.slice, a, t, s, tok, col, lane)

    @cute.jit
    def slice(self, a, t, s, tok, col, lane, res: cutlass.Constexpr):
        """fetch's part of one token in one warp: this lane's chunk of r, the warp's sum of squares; r kept
        in xs and sent to the 7 peers, the sum to all 8 (lane d to rank d)."""
        off = cute.assume(tok * K + col, divby=NORM_VEC)
        r, ss = residual_chunk(a, off, res, t.head == 0)
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
    def finish(self, a, t, s):
        """The second half: once the mbarrier has every peer's slice and sum, every CTA holds r and the 8
        sums of every token, adds the sums in warp order (device.norm_scale) and turns xs into xn."""
        chunks = (t.tid, t.tid + THREADS)
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


# ------------------------------------------------------------------------------ the token stream
class StreamCopy:
    """Two-kernel design: each group's K quarter of xn (the ring's layout or wgmma tiles, as the norm kernel
    wrote it) by bulk copies into the ring (StreamGemv.fill); the first stages by the threads tid < 8 as
    soon as the predecessor is done."""

    normalise = None

    def __init__(self, core, meta_threads: int):
        self.core, self.meta_threads = core, meta_threads

    def alloc(self):
        return None, None  # (no sums of squares to receive)

    def init(self, mbn):
        pass

    def expect(self, a, mbn):
        pass

    @cute.jit
    def first(self, a, t, s, q, meta):
        """Warp 0 waits for the predecessor; its threads tid < 8 copy the first stages; then meta() (warp 0
        stages the slots and positions), unless it is None."""
        if t.tid < self.meta_threads:  # (warp 0)
            cute.arch.griddepcontrol_wait()
            if t.tid < GROUP:
                for i in cutlass.range_constexpr(self.core.stages):
                    if GROUP * i < a.m:
                        self.core.fill(s.xs, s.mbx, a.x, q, i, a.m, t.tid)
            if cutlass.const_expr(meta is not None):
                meta()

    def ready(self, a, t, s, q):
        cute.arch.cluster_wait()  # the peers' mbarriers are initialised (before the first send)


class StreamNorm:
    """Prologue design: CTA 4 h + q computes the sums of squares of its K quarter for every token and sends
    them to the 4 CTAs of its half (on mbn; ssn: [token][virtual warp]); then each group is normalised into
    the ring (2 stages) by the CTA itself, x and the residual read twice."""

    def __init__(self, core, meta_threads: int, tile: int):
        self.core, self.meta_threads, self.tile = core, meta_threads, tile

    def alloc(self):
        ssn = cute.arch.alloc_smem(Float32, self.tile * CLUSTER, alignment=16)
        mbn = cute.arch.alloc_smem(Int64, 1, alignment=8)
        return ssn, mbn

    def init(self, mbn):
        cute.arch.mbarrier_init(mbn, 1)

    def expect(self, a, mbn):
        cute.arch.mbarrier_arrive_and_expect_tx(mbn, a.m * (CLUSTER * 4))  # 2 sums from each of 4 CTAs

    @cute.jit
    def first(self, a, t, s, q, meta):
        """The first pass: CTA 4 h + q computes, for every token (warp w: tokens w, w + 4, ..), the sums of
        squares of r = bf16(x + residual) over the norm kernel's virtual warps 2 q and 2 q + 1 (k in
        [512 q, 512 q + 512): the same chunks, lanes and butterfly) and sends both to the 4 CTAs of its
        half. The first head's CTAs of half 0 write residual_out. Then meta() (warp 0)."""
        cute.arch.cluster_wait()
        cute.arch.griddepcontrol_wait()
        warp, lane, _, _ = device.lanes(t.tid)
        for j in range(self.tile // WARPS):  # token warp + 4 j
            tok = warp + j * WARPS
            if tok < a.m:
                with_residual(a, self.sums, a, t, s, q, tok, lane)
        if t.tid < self.meta_threads:
            meta()

    @cute.jit
    def sums(self, a, t, s, q, tok, lane, res: cutlass.Constexpr):
        sums = []
        for v in cutlass.range_constexpr(2):  # virtual warps 2 q + v
            off = cute.assume(tok * K + q * QUARTER + v * (32 * NORM_VEC) + lane * NORM_VEC,
                              divby=NORM_VEC)  # fmt: skip
            _, ss = residual_chunk(a, off, res, t.cta < QUARTERS)
            sums.append(device.f32_bits(cute.arch.warp_reduction_sum(ss)))
        if lane < QUARTERS:  # lane d sends both sums to rank 4 h + d
            dst = cute.assume(tok * CLUSTER + 2 * q, divby=2)
            cute.arch.store_async_dsmem(s.ssn + dst, (sums[0], sums[1]), s.mbn, t.rank - q + lane)

    @cute.jit
    def ready(self, a, t, s, q):
        cute.arch.mbarrier_wait(s.mbn, 0)  # every quarter's sums of squares
        self.normalise(a, t, s, q, 0)
        cute.arch.sync_threads()

    @cute.jit
    def normalise(self, a, t, s, q, i):
        """The second pass for group i (after mbn: every quarter's sums): xn of the group's tokens, this CTA's
        quarter, into ring stage i % stages (rows 2 j + tid // 64, 8 elements at column 8 (tid % 64) each):
        r recomputed from x and the residual (the same bits), scaled with the 8 virtual warps' sums added in
        order (device.norm_scale) and the norm weight."""
        col = (t.tid % 64) * NORM_VEC
        stage = s.xs + (i % self.core.stages) * GROUP * self.core.xrow
        for j in range(GROUP // 2):
            row = 2 * j + t.tid // 64
            tok = GROUP * i + row
            if tok < a.m:
                with_residual(a, self.row, a, t, s, q, stage, row, tok, col)

    @cute.jit
    def row(self, a, t, s, q, stage, row, tok, col, res: cutlass.Constexpr):
        nw = device.load_vec(a.norm_weight + (q * QUARTER + col), NORM_VEC)  # (L1 hits after the first)
        sn = cute.make_tensor(s.ssn, cute.make_layout(self.tile * CLUSTER))
        sc = device.norm_scale([sn[tok * CLUSTER + v] for v in range(CLUSTER)], a.eps)
        off = cute.assume(tok * K + q * QUARTER + col, divby=NORM_VEC)
        r, _ = residual_chunk(a, off, res, False)
        device.store_vec(stage + cute.assume(row * self.core.xrow + col, divby=NORM_VEC),
                         device.norm_apply(r, sc, nw), NORM_VEC)  # fmt: skip

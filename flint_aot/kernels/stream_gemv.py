"""The token stream's GEMV of one CTA (tiles 16, 32, 64; docs/kernels.md §2.5), shared by the fused qkv
kernel and the standalone GEMV. The unit of work of the 8-token design, one warp's K quarter of 16 rows with
its two MMA chains, is kept, and so is the order in which the quarters are added; what changes is where the
units sit and how the tokens arrive:
* a CTA of 4 warps takes 64 rows (4 row blocks, warp w the block 4 quad + w) of ONE K quarter q; the 4 CTAs
  of one quad (its quarters 0..3) are 4 consecutive ranks of a cluster, 4 h + q;
* x arrives per group of 8 tokens, and only the CTA's quarter of it, into a ring of stages in dynamic shared
  memory (`StreamConfig.x` says how); each weight fragment, held in registers for the whole call, meets
  every group;
* after each group's MMAs every warp sends its 16 x 8 partial sums to their owners by st.async and goes on
  to the next group without waiting for anyone. The standalone GEMV's owners are row blocks (`send`: rank
  4 h + w; `total`), the fused kernel's are tokens (`send_tokens`: rank j, token 8 i + j of every group, all
  128 rows of the head, so that one warp holds a token's whole head for its q/k norm and RoPE;
  `token_rows`). Either way the owner adds the four quarters in order 0..3, once its own MMAs are done.
Which group runs when, and how the ring is refilled, is the kernel's group schedule (schedules.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot.kernels import trace
from flint_aot.kernels.device import bulk_copy, lanes
from flint_aot.kernels.mma import (
    ROWS,
    THREADS,
    WARPS,
    SharedX,
    TiledX,
    as_i32,
    ld_shared_f32x4,
    steps,
    sum_quarters,
    sw128_chunk,
)
from flint_aot.kernels.weights import weights_then_wait
from flint_aot.kernels.wgmma import WG_CORE, wg_desc, wg_desc_sw128, wg_fence, wg_wait, wgmma_rs, wgmma_ss
from loader.abi import TOKEN_GROUP, ring_strides, stream_row, wg_strides

GROUP = TOKEN_GROUP  # tokens per group: one mma.sync N
STAGES = 3  # x ring depth by default: a group's bulk copies are issued 2 groups before its MMAs
PART_BYTES = WARPS * ROWS * GROUP * 4  # partial sums one owner receives per group (4 quarters, fp32)
# their rows in shared memory: 8 tokens and 2 words of pad, so that the owner's reads (a warp: 16 rows x 2
# tokens) hit 32 different banks (without the pad, 8 banks: 4-way conflicts), and a sender's 8-byte pair of
# tokens stays aligned
PART_ROW = GROUP + 2
PART_WORDS = WARPS * ROWS * PART_ROW  # one group's buffer (words)
# token owners (send_tokens): rank j receives token 8 i + j of group i, all 128 rows of the head from the 8
# CTAs (2 halves x 4 quarters), [group][quarter][row] fp32: the same bytes, so PART_BYTES holds for both
HEAD_ROWS = 2 * WARPS * ROWS
TOKEN_WORDS = WARPS * HEAD_ROWS  # one group's buffer (words)
# the wgmma tiles' kernels: A's words (NVFP4: decoded code words; BF16: k blocks; 16 either way at hidden
# 2048, 8 registers each) that stay in registers, per tile (all of them where a quarter has fewer); the others
# are parked in shared memory. At 3 CTAs per SM (168 registers) 15 or 16 words beside N = 24's accumulators
# make ptxas serialize the wgmma and spill. Tile 64 keeps 14 so that its three CTAs fit the 196 KB carveout
# (docs/kernels.md §2.6)
WG_REG = {32: 12, 64: 14}

# How x reaches the ring (StreamConfig.x)
X_ROWS = "rows"  # plain [M, K] rows, one bulk copy per token of K / 4 (1 KB at 2048) (the standalone GEMV)
X_RING = "ring"  # the ring's layout (loader.abi.ring_strides), one copy per group and stage
X_TILES = "tiles"  # wgmma tiles (loader.abi.wg_strides), one copy per group and stage (8 KB at 2048)
X_OWN = "own"  # normalised into the ring by the kernel itself (the prologue design): never copied


@dataclass(frozen=True)
class StreamConfig:
    """What a token-stream CTA is built for: set once, by its kernel."""

    fp4: bool
    tile: int  # tokens a call may have (16, 32, 64)
    pre: int  # NVFP4 code words decoded before the wait
    k: int  # the hidden size
    stages: int = STAGES  # x ring stages (at most the tile's groups)
    x: str = X_ROWS
    owners: str = "rows"  # who adds a group's quarters: "rows" (row blocks) or "tokens"
    # stages refilled on "read" mbarriers (every thread arrives; only the copying threads wait) instead of
    # after a CTA barrier
    read_barriers: bool = False

    @property
    def paired(self) -> bool:
        """x holds NVFP4's MMA pair order (written so by the norm kernel: loader.abi.xn_pairs)."""
        return self.fp4 and self.x in (X_RING, X_TILES)


@dataclass(frozen=True)
class StreamSmem:
    """The stream's shared memory: x ring (dynamic), the owners' partial sums, the stages' mbarriers ("in",
    then with read barriers "read"), one mbarrier per group (its partial sums)."""

    xs: object
    red: object
    mbx: object
    mbr: object


class StreamGemv:
    """`alloc` / `arm` set up the shared memory and mbarriers, `start` issues the weights of this thread (K
    quarter q) and waits for the predecessor, `fill` / `refill` bring a group's x quarter into the ring,
    `partials` / `ring_partials` / `wg_pass` run a group's MMAs, `send_partials` hands them to their
    owners, `total` / `token_rows` are an owner's sums."""

    def __init__(self, cfg: StreamConfig):
        self.cfg = cfg
        self.fp4, self.tile = cfg.fp4, cfg.tile
        self.paired = cfg.paired
        self.part_words = TOKEN_WORDS if cfg.owners == "tokens" else PART_WORDS
        self.groups = cfg.tile // GROUP
        self.k, self.quarter, self.words = cfg.k, cfg.k // WARPS, steps(cfg.k)
        self.stages = min(cfg.stages, self.groups)
        self.refills = cfg.read_barriers and self.groups > self.stages  # (the ring has stages to refill)
        fmt = "nvfp4" if cfg.fp4 else "bf16"
        self.xrow = stream_row(fmt, cfg.k)
        group, _, self.ring_quarter = ring_strides(fmt, cfg.k)  # X_RING: xn's strides
        self.ring_quarters = group // self.ring_quarter  # (a group's quarter blocks, one after another)
        self.dyn_smem = self.stages * GROUP * self.xrow * 2  # the x ring (bytes)
        if cfg.x == X_TILES:
            # x as the wgmma's swizzled K-major tiles, a ring of 4 stages (8 KB each at 2048); A's words
            # wg_reg .. words - 1 parked after it (`park`)
            assert (self.paired or not cfg.fp4) and self.stages == 4, "wgmma tiles: a ring of 4 stages"
            self.wg_reg = min(WG_REG[cfg.tile], self.words)
            group, _, self.ring_quarter = wg_strides(cfg.k)
            self.ring_quarters = group // self.ring_quarter
            self.stage_bytes = GROUP * self.quarter * 2
            self.a_off = self.stages * self.stage_bytes  # A's parked words, after the ring
            self.a_sbo = (self.words - self.wg_reg) * 4 * WG_CORE  # the next 8 rows of A
            self.dyn_smem = self.a_off + WARPS * ROWS // 8 * self.a_sbo

    def alloc(self) -> StreamSmem:
        """x ring [stage][token][xrow] bf16, the owners' partial sums (row owners: [group][quarter][row]
        [token], token owners: [group][quarter][row]) fp32, the mbarriers."""
        xs = cute.arch.get_dyn_smem(BFloat16, alignment=1024 if self.cfg.x == X_TILES else 128)
        red = cute.arch.alloc_smem(Float32, self.groups * self.part_words, alignment=16)
        mbx = cute.arch.alloc_smem(Int64, (2 if self.refills else 1) * self.stages, alignment=8)
        mbr = cute.arch.alloc_smem(Int64, self.groups, alignment=8)
        return StreamSmem(xs, red, mbx, mbr)

    def arm(self, sm: StreamSmem):
        """Thread 0, before the cluster arrive: initialise the mbarriers (a stage's "read" one takes an
        arrival from every thread); each group's expects its 4 quarters' partial sums."""
        for i in range(self.stages):
            cute.arch.mbarrier_init(sm.mbx + i, 1)
            if self.refills:
                cute.arch.mbarrier_init(sm.mbx + self.stages + i, THREADS)
        for i in range(self.groups):
            cute.arch.mbarrier_init(sm.mbr + i, 1)
        cute.arch.mbarrier_init_fence()
        for i in range(self.groups):
            cute.arch.mbarrier_arrive_and_expect_tx(sm.mbr + i, PART_BYTES)

    def start(self, w, wsc, gsc, row0, q, tid, m, issued=None, tr=trace.OFF):
        """The weights of this thread (rows row0 + g, + 8 of K quarter q), then the wait; every word ready
        for the MMAs, since every group uses every word."""
        st = weights_then_wait(self.fp4, w, wsc, gsc, row0, tid, m, self.k, self.cfg.pre, issued, q, tr)
        return st.complete(tid)

    @cute.jit
    def fill(self, xs, mbx, x, q, i, m, tid):
        """Group i's tokens, quarter q of their rows of x (bf16, written by the predecessor: the calling
        threads, tid < 8, have waited for it), into ring stage i % stages, thread 0 arming the stage's
        mbarrier for them: one bulk copy by thread 0 in the ring's layouts, one per token (thread tid < n:
        token 8 i + tid) from plain rows."""
        stg = i % self.stages
        n = cutlass.min(m - GROUP * i, GROUP)
        if cutlass.const_expr(self.cfg.x == X_TILES):  # the whole tile (every token's rows span its 8 atoms)
            if tid == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(mbx + stg, self.stage_bytes)
                src = x + (i * self.ring_quarters + q) * self.ring_quarter
                bulk_copy(xs + stg * (self.stage_bytes // 2), src, mbx + stg, self.stage_bytes)
        elif cutlass.const_expr(self.cfg.x == X_RING):
            if tid == 0:
                nbytes = n * (self.xrow * 2)
                cute.arch.mbarrier_arrive_and_expect_tx(mbx + stg, nbytes)
                src = x + (i * self.ring_quarters + q) * self.ring_quarter
                bulk_copy(xs + stg * GROUP * self.xrow, src, mbx + stg, nbytes)
        else:
            if tid == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(mbx + stg, n * (self.quarter * 2))
            if tid < n:
                bulk_copy(xs + (stg * GROUP + tid) * self.xrow,
                          x + ((GROUP * i + tid) * self.k + q * self.quarter), mbx + stg,
                          self.quarter * 2)  # fmt: skip

    @cute.jit
    def refill(self, xs, mbx, x, q, i, m, tid):
        """After group i's MMAs: group i + stages into stage i % stages once every warp is done with it. With
        read barriers every thread arrives on the stage's "read" mbarrier (release: its fragment reads come
        before the copies), only the copying threads (tid < 8) wait for all 128 and copy, and the other warps
        go on without a CTA barrier; the warp barrier after it makes warp 0 whole again before its next
        shuffles and MMAs (without it ptxas loses the proof that warp 0 is converged and gives every shuffle
        a collective path). Otherwise a CTA barrier first."""
        if cutlass.const_expr(self.refills):
            rd = mbx + self.stages + i % self.stages
            cute.arch.mbarrier_arrive(rd)
            if tid < GROUP:
                cute.arch.mbarrier_wait(rd, (i // self.stages) % 2)
                self.fill(xs, mbx, x, q, i + self.stages, m, tid)
            cute.arch.sync_warp()
        else:
            cute.arch.sync_threads()
            if tid < GROUP:
                self.fill(xs, mbx, x, q, i + self.stages, m, tid)

    def stage(self, xs, mbx, i, wait: bool = True):
        """Ring stage of group i as a SharedX (after waiting for its copies, if wait)."""
        stg = i % self.stages
        if wait:
            cute.arch.mbarrier_wait(mbx + stg, (i // self.stages) % 2)
        return SharedX(xs + stg * GROUP * self.xrow, self.xrow, None)

    def partials(self, st, x, i, m, tid):
        """This warp's partial sums of group i (tokens 8 i ..): the 8-token design's MMA sequence on its
        quarter; x: the group's stage."""
        _, _, g, _ = lanes(tid)
        return st.partials(x, cutlass.min(g, m - GROUP * i - 1), tid, m, 0, self.paired)

    def park(self, st, xs, tid):
        """x as wgmma tiles, after start: this thread's A fragments of words wg_reg .. (both rows) into A's
        tile in shared memory, K-major without swizzle: row r = 16 w + g (+ 8), word t of core matrix
        4 (i - wg_reg) + j holds register j of word i (the k order of x's tiles). The caller fences them for
        the async proxy and syncs the CTA before the pass."""
        warp, _, g, t = lanes(tid)
        xb = xs.toint()
        D = st.words()
        for i in range(self.wg_reg, self.words):
            for h in range(2):
                regs = D[h][i]
                for j in range(4):
                    row = self.a_off + (2 * warp + h) * self.a_sbo + g * 16 + t * 4
                    off = row + (4 * (i - self.wg_reg) + j) * WG_CORE
                    cute.arch.inline_ptx("st.shared.b32 [{$r0}], {$r1};", read_only_args=[xb + off, regs[j]])

    def ring_partials(self, st, xs, stage, tid):
        """x as wgmma tiles: the partial sums of the group in ring stage `stage` (landed) by the 8-token
        design's mma.sync sequence, x from the stage's tiles by ldmatrix (TiledX); A: all 16 words from
        registers."""
        x = TiledX(xs.toint() + stage * self.stage_bytes, lanes(tid)[1])
        return st.tile_partials(x, tid)

    def wg_pass(self, st, xs, n: int, first: int = 0):
        """The partial sums of the n tokens of ring stages first .. first + n / 8 - 1 (landed; A's parked
        words fenced) in one wgmma pass, as partials' per group: [[d0, d1, d2, d3] per group]. The same two
        chains over the same 16 steps in the same order as the mma.sync sequence (bit-identical sums)."""
        z, one = Float32(0.0), Int32(1)
        xb = xs.toint()
        bdesc = wg_desc_sw128(xb + first * self.stage_bytes, self.stage_bytes)
        adesc = wg_desc(xb + self.a_off, self.a_sbo)
        acc = wg_fence([z] * n)
        acc = [acc[: n // 2], acc[n // 2 :]]
        D = st.words()
        for i in range(self.words):
            for h in range(2):
                db = bdesc + Int64(sw128_chunk(4 * i + 2 * h, 0) >> 4)  # (chunks 4 i + 2 h and + 1: 32 bytes)
                if i >= self.wg_reg:
                    da = adesc + Int64(((4 * (i - self.wg_reg) + 2 * h) * WG_CORE) >> 4)
                    acc[h] = wgmma_ss(n, acc[h], da, db, one)
                else:
                    a, b = D[0][i], D[1][i]
                    acc[h] = wgmma_rs(n, acc[h], (a[2 * h], b[2 * h], a[2 * h + 1], b[2 * h + 1]), db, one)
        flat = wg_wait(acc[0] + acc[1])
        return [[flat[4 * g + e] + flat[n // 2 + 4 * g + e] for e in range(4)] for g in range(n // GROUP)]

    def send_partials(self, sm: StreamSmem, d, i, rank, tid):
        """Group i's partial sums of this warp's row block to their owners (cfg.owners)."""
        if self.cfg.owners == "tokens":
            self.send_tokens(sm.red, sm.mbr, d, i, rank, tid)
        else:
            self.send(sm.red, sm.mbr, d, i, rank, tid)

    def send(self, red, mbr, d, i, rank, tid):
        """Row owners: group i's partial sums of this warp's row block to its owner, rank 4 h + w, [i][q]."""
        warp, _, g, t = lanes(tid)
        q = rank % WARPS
        base = cute.assume(((i * WARPS + q) * ROWS + g) * PART_ROW + 2 * t, divby=2)
        owner = rank - q + warp
        for half in range(2):
            cute.arch.store_async_dsmem(red + (base + half * 8 * PART_ROW),
                                        (as_i32(d[2 * half]), as_i32(d[2 * half + 1])), mbr + i,
                                        owner)  # fmt: skip

    @cute.jit
    def send_tokens(self, red, mbr, d, i, rank, tid):
        """Token owners: group i's partial sums of this warp's row block to the owners of its 8 tokens: rank j
        owns token 8 i + j, words [i][q][64 h + 16 w + row]. Lane (g, t) holds rows g and g + 8 of tokens 2 t
        and 2 t + 1; lanes g and g ^ 1 swap one token's pair (2 shuffles), so that each lane holds two rows
        of one token (token 2 t + g % 2, rows g & ~1 and its neighbour, and 8 further) and sends them as two
        8-byte st.async, as many as send."""
        warp, _, g, t = lanes(tid)
        q = rank % WARPS
        odd = (g & 1) != 0
        give = [as_i32(Float32(cutlass.select_(odd, d[j], d[j + 1]))) for j in (0, 2)]
        keep = [as_i32(Float32(cutlass.select_(odd, d[j + 1], d[j]))) for j in (0, 2)]
        got = [cute.arch.shuffle_sync_bfly(v, 4) for v in give]  # lane g ^ 1 (lane ^ 4)
        row = (rank // WARPS) * (WARPS * ROWS) + warp * ROWS + (g & 6)
        base = cute.assume((i * WARPS + q) * HEAD_ROWS + row, divby=2)
        for j in cutlass.range_constexpr(2):  # rows (g & ~1, +1), then 8 further
            lo = cutlass.select_(odd, got[j], keep[j])
            hi = cutlass.select_(odd, keep[j], got[j])
            cute.arch.store_async_dsmem(red + (base + 8 * j), (lo, hi), mbr + i, 2 * t + (g & 1))

    def token_rows(self, st, red, i, lane):
        """Token owner, after group i's mbarrier: the fp32 sums (quarters in order, times the global scale for
        NVFP4) of the head's rows 4 lane .. 4 lane + 3 for this CTA's token of group i."""
        part = red + i * TOKEN_WORDS
        qs = []
        for q in range(WARPS):
            ptr = part + cute.assume(q * HEAD_ROWS + 4 * lane, divby=4)
            qs.append(ld_shared_f32x4(ptr))
        out = []
        for j in range(4):
            s = qs[0][j]
            for q in range(1, WARPS):
                s = s + qs[q][j]
            out.append(st.scaled(s))
        return out

    def total(self, st, red, mbr, i, tid, wait: bool = True):
        """Row owner: the fp32 sum of row tid % 16 of its row block, token 8 i + tid // 16 (quarters in
        order), times the global scale for NVFP4; wait=False: the caller has waited for group i's sums."""
        if wait:
            cute.arch.mbarrier_wait(mbr + i, 0)
        part = cute.make_tensor(red + i * PART_WORDS, cute.make_layout(PART_WORDS))
        return st.scaled(sum_quarters(part, tid, PART_ROW))

"""The GEMV of one CTA (`CtaGemv`), shared by the fused qkv kernel and the standalone GEMV kernel: 16 output
rows per CTA of 128 threads, all M tokens of a compile-time token tile (8 or 16: one or two groups of 8
tokens, each an mma.sync N of 8), fp32 accumulation on tensor cores (mma.sync m16n8k16, bf16 in, fp32 out).

K split and summation order (fixed, so every kernel built on it rounds the same sums):
* warp w owns k in [512 w, 512 w + 512) as 16 blocks of 32; in block b, lane (g, t) = (lane / 4, lane % 4)
  holds the 8 consecutive k in [512 w + 32 b + 8 t, +8) of rows g and g + 8 (one 16-byte load each) and
  of token g (x). Those 8 k feed two mma.sync (pairs 0,1 then pairs 2,3: a K permutation, the same for A
  and B, so the dot product is unchanged).
* each warp accumulates its 32 mma in one chain per 16-wide half (acc[b % 2]) in block order, adds the two
  chains, and the four warps' partial sums are added in warp order 0, 1, 2, 3 through shared memory.
* tokens 8..15 (tile 16) are a second group: the same weight fragments, the MMAs of the two groups
  interleaved, each group's chains exactly those of the first. A token's sum is the same whatever the
  tile, so a tile-8 and a tile-16 kernel give the same bits.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm

from flint_aot.kernels.device import lanes
from loader.abi import HIDDEN, NVFP4_ROW_BYTES, ROWS_PER_CTA, SCALE_COLS

K = HIDDEN
ROWS = ROWS_PER_CTA
THREADS = 128
WARPS = THREADS // 32
NB = K // 32 // WARPS  # 32-wide k blocks per warp


def ld_weight(ptr):
    """16 bytes of weights: read once, never written by a predecessor -> non-coherent path, no L1 allocation,
    128-byte L2 fetch (0.1-0.25 us per layer faster for BF16 than the 256-byte hint, the same for NVFP4;
    BENCHMARKS.md §1)."""
    return cute.arch.inline_ptx(
        "ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Int32] * 4,
        read_only_args=[ptr],
    )


def ld_act(ptr):
    """16 bytes of activations written by the previous kernel: plain coherent load (never .nc, which ptxas
    may hoist above griddepcontrol.wait)."""
    return cute.arch.inline_ptx(
        "ld.global.v4.u32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Int32] * 4,
        read_only_args=[ptr],
    )


def mma_bf16(a, b, c):
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$w0},{$w1},{$w2},{$w3}}, "
        "{{$r0},{$r1},{$r2},{$r3}}, {{$r4},{$r5}}, {{$r6},{$r7},{$r8},{$r9}};",
        write_only_types=[Float32] * 4,
        read_only_args=[*a, *b, *c],
    )


def as_f32(i):
    return Float32(llvm.bitcast(Float32.mlir_type, i.ir_value()))


def issue_weight_loads(w, row0, tid):
    """Issue all of this thread's weight loads (32 x 16 B); returns [(lo, hi)] per k block."""
    warp, _, g, t = lanes(tid)
    wa = w + ((row0 + g) * K + warp * (NB * 32) + t * 8)
    return [(ld_weight(wa + b * 32), ld_weight(wa + (8 * K + b * 32))) for b in range(NB)]


def ld_shared(ptr):
    return cute.arch.inline_ptx(
        "ld.shared.v4.u32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Int32] * 4,
        read_only_args=[ptr],
    )


def smem_row(fp4: bool) -> int:
    """Row stride (elements) of x staged in shared memory (SharedX), padded against bank conflicts."""
    return K + (8 if fp4 else 32)


class SharedX:
    """x [tile, K] staged in this CTA's shared memory (row stride `row` elements, smem_row) by bulk copies
    (qkv.py: the cluster's multicast copies; gemv.py, tile 16); `ready()` waits on their mbarrier. Passed
    instead of the global x pointer, it changes where the fragments come from, not the MMA sequence: results
    stay bit-identical."""

    def __init__(self, base, row, mbar):
        self.base, self.row, self.mbar = base, row, mbar

    def ready(self):
        cute.arch.mbarrier_wait(self.mbar, 0)

    def load(self, tok, k):
        return ld_shared(self.base + (tok * self.row + k))


def _x_loads(x, tok, ks):
    """16-byte x fragments at token tok and element offsets ks: global loads, or shared once staged."""
    if isinstance(x, SharedX):
        x.ready()
        return [x.load(tok, k) for k in ks]
    xa = x + tok * K
    return [ld_act(xa + k) for k in ks]


def _x_load(x, tok, k):
    """One 16-byte x fragment (shared memory: after SharedX.ready())."""
    return x.load(tok, k) if isinstance(x, SharedX) else ld_act(x + (tok * K + k))


def runtime_zero(regs, m):
    """An Int32 that is 0 at run time (m >= 1) but depends on every register in regs, so ptxas must issue
    every load before anything that uses it (it otherwise sinks loads next to their use, and may move
    griddepcontrol.wait above .nc loads)."""
    f = regs[0]
    for r in regs[1:]:
        f = f ^ r
    return f & (m >> 31)


def mma_partials(A, x, m, tid, zero, groups: int = 1):
    """This warp's partial sums for its K quarter, per group of 8 tokens: [d0, d1, d2, d3] with d0/d1 = (row
    g, tokens 8 i + 2t, +1), d2/d3 = (row g + 8, the same tokens). A from issue_weight_loads; x bf16 [m, K]
    (tokens >= m read token m - 1; their columns are never stored)."""
    warp, _, g, t = lanes(tid)
    toks = [cutlass.min(g + 8 * i if i else g, m - 1) for i in range(groups)]
    ks = [warp * (NB * 32) + t * 8 + b * 32 for b in range(NB)]
    if groups == 1:
        X = [_x_loads(x, toks[0], ks)]
    else:  # each block's fragments loaded where they are used: ptxas would hoist them all, and spill
        X = None
        if isinstance(x, SharedX):
            x.ready()
    z = as_f32(zero)
    acc = [[[z, z, z, z], [z, z, z, z]] for _ in range(groups)]
    for b in range(NB):
        lo, hi = A[b]
        xb = [Xi[b] for Xi in X] if X else [_x_load(x, tok, ks[b]) for tok in toks]
        for j in range(2):
            for i in range(groups):
                acc[i][j] = list(mma_bf16((lo[2 * j], hi[2 * j], lo[2 * j + 1], hi[2 * j + 1]),
                                          (xb[i][2 * j], xb[i][2 * j + 1]), acc[i][j]))  # fmt: skip
    return [[a[0][i] + a[1][i] for i in range(4)] for a in acc]


def reduce_rows(d, tid, red, tile: int = 8):
    """Cross-warp sum in warp order. d: mma_partials' groups; red: smem fp32 tensor of WARPS*ROWS*tile. After
    the call (it syncs the CTA) thread i gets the full sums for row i % 16 and tokens i // 16 + 8 j, one per
    group j."""
    warp, _, g, t = lanes(tid)
    base0 = warp * (ROWS * tile) + g * tile + 2 * t
    for i, di in enumerate(d):
        base = base0 + 8 * i if i else base0
        red[base] = di[0]
        red[base + 1] = di[1]
        red[base + 8 * tile] = di[2]
        red[base + 8 * tile + 1] = di[3]
    cute.arch.sync_threads()
    r = tid % ROWS
    out = []
    for i in range(len(d)):
        tk = tid // ROWS + 8 * i if i else tid // ROWS
        s = red[r * tile + tk]
        for q in range(1, WARPS):
            s = s + red[q * (ROWS * tile) + r * tile + tk]
        out.append(s)
    return out


# ----------------------------------------------------------------------------- NVFP4 weights
# Weight rows are 1024 bytes of e2m1 codes (low nibble = even k) plus 128 e4m3 block scales (one per 16 k) in
# the 128x4-swizzled layout, read in place. Same CTA shape and MMA as BF16, with another K split:
# * warp w owns k in [512 w, 512 w + 512) as 16 chunks of 32 k (16 code bytes); lane (g, t) owns chunks
#   4 c + t, c = 0..3, of rows g and g + 8 (one 16-byte load each: a warp instruction reads 8 rows x 64
#   contiguous bytes), their 2 block scales (half of a 4-byte swizzle group) and x of token g at those k;
# * code word i = 4 c + u (k0 = 512 w + 128 c + 32 t + 8 u, .. k0 + 7) decodes to 4 bf16x2 registers
#   P_j = (k0 + j, k0 + j + 4), j = 0..3, and x is permuted to the same pairs; word i feeds MMA 2 i (P_0, P_1)
#   and 2 i + 1 (P_2, P_3): a K permutation shared by A and B, so the dot product is unchanged;
# * decoded weights are e2m1 * e4m3 * 2^-7 (exact in bf16: at most 5 significant bits, always normal); the
#   fp32 row sums are multiplied by global_scale * 2^7 after the cross-warp reduction (reduce_rows order).
KB = NVFP4_ROW_BYTES  # code bytes per row
FP4_CHUNKS = KB // 16 // WARPS // 4  # 16-byte code chunks per thread per row (4)
FP4_WORDS = FP4_CHUNKS * 4  # 32-bit code words per thread per row (16)
# code words per row decoded before griddepcontrol.wait, per kernel (weights_then_wait's `pre`): the fused qkv
# kernel decodes 12 of 16 (measured fastest on the H200: 8 is 0.1-0.2 us per layer slower for (32,4), all 16
# fit in 167 registers but gain less; BENCHMARKS.md §1); the standalone GEMV 8 (12 takes it to 186 registers)
FP4_PRE_QKV = 12
FP4_PRE_GEMV = 8


def ld_weight_b32(ptr):
    return cute.arch.inline_ptx(
        "ld.global.nc.b32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[ptr]
    )


def issue_fp4_loads(wq, sf, row0, tid):
    """This thread's code and scale loads, rows g and g + 8: (codes[2][16 words], scales[2][4 words]);
    scales[row][c] is the swizzle group holding chunk c's two block scales (in half t % 2)."""
    warp, _, g, t = lanes(tid)
    codes, scales = [], []
    for r in (row0 + g, row0 + g + 8):
        a = wq + (r * KB + warp * (KB // WARPS) + t * 16)
        words = []
        for c in range(FP4_CHUNKS):
            words.extend(ld_weight(a + 64 * c))
        codes.append(words)
        # logical scale column of chunk c: 32 w + 8 c + 2 t (+1) -> group 8 w + 2 c + t // 2
        # (the offsets of docs/nvfp4.md §3)
        grp = (r // 128) * (SCALE_COLS // 4) + warp * 8 + t // 2
        s = sf + (grp * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4)
        scales.append([ld_weight_b32(s + 1024 * c) for c in range(FP4_CHUNKS)])
    return codes, scales


def fp4_scale_pair(word, tid):
    """The two e4m3 block scales of this thread's chunk (half t % 2 of a swizzle group word) -> 2 bf16x2,
    each a broadcast of e4m3 * 2^119 (exact)."""
    half = word >> ((tid % 2) * 16)
    return cute.arch.inline_ptx(
        "{ .reg .b16 lo, a, b; .reg .b32 p; .reg .f32 fa, fb;"
        " cvt.u16.u32 lo, {$r0}; cvt.rn.f16x2.e4m3x2 p, lo; mov.b32 {a, b}, p;"
        " cvt.f32.f16 fa, a; cvt.f32.f16 fb, b;"
        " mul.f32 fa, fa, 0f7B000000; mul.f32 fb, fb, 0f7B000000;"
        " cvt.rn.bf16x2.f32 {$w0}, fa, fa; cvt.rn.bf16x2.f32 {$w1}, fb, fb; }",
        write_only_types=[Int32] * 2,
        read_only_args=[half],
    )


def fp4_decode(word, scale):
    """8 e2m1 codes (nibble n = k0 + n) times a bf16x2 block scale -> 4 bf16x2 P_j = (k0 + j, k0 + j + 4).

    A nibble s|e1 e0|m moved to bf16 bits 15 | 8:7 | 6 is the e2m1 value times 2^-126 (e = 0 lands on the
    bf16 subnormals 0.5 * m * 2^-126). The multiply by 0x1040 (0x104 for the odd nibbles, already 4 bits up)
    copies bits 2:0 to 8:6 and bit 3 to 15 at once; the mask keeps those. Times e4m3 * 2^119: e2m1 * e4m3
    * 2^-7, exact."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 hi8, e0, e1, e2, e3;"
        " shr.u32 hi8, {$r0}, 8;"
        " and.b32 e0, {$r0}, 0x000F000F; and.b32 e1, {$r0}, 0x00F000F0;"
        " and.b32 e2, hi8, 0x000F000F; and.b32 e3, hi8, 0x00F000F0;"
        " mul.lo.u32 e0, e0, 0x1040; mul.lo.u32 e1, e1, 0x104;"
        " mul.lo.u32 e2, e2, 0x1040; mul.lo.u32 e3, e3, 0x104;"
        " and.b32 e0, e0, 0x81C081C0; and.b32 e1, e1, 0x81C081C0;"
        " and.b32 e2, e2, 0x81C081C0; and.b32 e3, e3, 0x81C081C0;"
        " mul.rn.bf16x2 {$w0}, e0, {$r1}; mul.rn.bf16x2 {$w1}, e1, {$r1};"
        " mul.rn.bf16x2 {$w2}, e2, {$r1}; mul.rn.bf16x2 {$w3}, e3, {$r1}; }",
        write_only_types=[Int32] * 4,
        read_only_args=[word, scale],
    )


def fp4_x_pairs(v):
    """16 bytes of x (k0..k0+7 as 4 bf16x2 words) -> the pairs (k0 + j, k0 + j + 4), j = 0..3."""
    return cute.arch.inline_ptx(
        "prmt.b32 {$w0}, {$r0}, {$r2}, 0x5410; prmt.b32 {$w1}, {$r0}, {$r2}, 0x7632;"
        " prmt.b32 {$w2}, {$r1}, {$r3}, 0x5410; prmt.b32 {$w3}, {$r1}, {$r3}, 0x7632;",
        write_only_types=[Int32] * 4,
        read_only_args=list(v),
    )


def fp4_decode_rows(codes, scales, words, tid):
    """Decoded bf16x2 for the given word indices of both rows: D[row][i] = 4 registers."""
    out = []
    for row in range(2):
        sc = {}
        d = {}
        for i in words:
            c = i // 4
            if c not in sc:
                sc[c] = fp4_scale_pair(scales[row][c], tid)
            d[i] = fp4_decode(codes[row][i], sc[c][(i % 4) // 2])  # 2 words (16 k) per block scale
        out.append(d)
    return out


def fp4_mma_partials(D, x, m, tid, groups: int = 1):
    """This warp's partial sums (layout as mma_partials) from decoded weights D[row][word] (all 16 words).
    The x loads are fenced: every one is issued right after the wait, before the first MMA."""
    warp, _, g, t = lanes(tid)
    ks = [warp * (K // WARPS) + t * 32 + 128 * (i // 4) + 8 * (i % 4) for i in range(FP4_WORDS)]
    toks = [cutlass.min(g + 8 * j if j else g, m - 1) for j in range(groups)]
    if groups == 1 or not isinstance(x, SharedX):
        X = [_x_loads(x, tok, ks) for tok in toks]
    else:  # each word's fragments loaded where they are used (as mma_partials)
        X = None
        x.ready()
    if isinstance(x, SharedX):
        z = Float32(0.0)  # shared-memory loads: short latency, no fence (it would hold all 64 registers)
    else:
        flat = []
        for v in [v for Xj in X for v in Xj]:
            flat.extend(v)
        z = as_f32(runtime_zero(flat, m))  # all global x loads issued at once, before the first MMA
    acc = [[[z, z, z, z], [z, z, z, z]] for _ in range(groups)]
    for i in range(FP4_WORDS):
        xw = [Xj[i] for Xj in X] if X else [x.load(tok, ks[i]) for tok in toks]
        xp = [fp4_x_pairs(v) for v in xw]
        a, b = D[0][i], D[1][i]
        for h in range(2):
            for j in range(groups):
                acc[j][h] = list(mma_bf16((a[2 * h], b[2 * h], a[2 * h + 1], b[2 * h + 1]),
                                          (xp[j][2 * h], xp[j][2 * h + 1]), acc[j][h]))  # fmt: skip
    return [[c[0][i] + c[1][i] for i in range(4)] for c in acc]


# ----------------------------------------------------------------------------- the GEMV of one CTA
# The fused qkv kernel and the standalone GEMV both call these two, so their bf16 results are bit-identical.
def weights_then_wait(fp4: bool, w, wsc, gsc, row0, tid, m, pre: int = FP4_PRE_GEMV, issued=None):
    """Issue this CTA's whole weight slice (NVFP4: codes, scales and the decode of `pre` of 16 words), then
    griddepcontrol.wait, guarded by a run-time zero that depends on every loaded register (ptxas can
    neither sink the loads below the wait nor hoist the wait above them). BF16: issued(), if given, runs
    once the loads are issued, before any of them is waited for (the guard's chain starts from a clock read
    after it, so ptxas cannot hoist the waits above it). Returns the state for CtaGemv.sums."""
    st = {}
    if fp4:
        assert issued is None, "NVFP4: a warp waiting in issued() could not decode before the wait"
        codes, scw = issue_fp4_loads(w, wsc, row0, tid)
        st["gs"] = cute.make_tensor(gsc, cute.make_layout(1))[0] * Float32(128.0)  # global scale * 2^7
        st["D"] = fp4_decode_rows(codes, scw, range(pre), tid)
        st["codes"], st["scw"], st["pre"] = codes, scw, pre
        flat = scw[0][pre // 4 :] + scw[1][pre // 4 :] + codes[0][pre:] + codes[1][pre:]
        for row in st["D"]:
            for regs in row.values():
                flat.extend(regs)
    else:
        st["A"] = issue_weight_loads(w, row0, tid)
        flat = []
        if issued is not None:
            issued()
            flat.append(Int32(cute.arch.clock64()))  # the guard's chain starts after issued()
        for lo, hi in st["A"]:
            flat.extend(lo)
            flat.extend(hi)
    st["zero"] = runtime_zero(flat, m)
    guarded_wait(st["zero"])
    return st


@cute.jit
def guarded_wait(zero: Int32):
    if zero == 0:  # always true at run time
        cute.arch.griddepcontrol_wait()


def partial_sums(fp4: bool, st, x, m, tid, groups: int):
    """This warp's MMAs (mma_partials / fp4_mma_partials, the rest of the NVFP4 decode first)."""
    if fp4 and groups > 1:  # the rest of the decode word by word in the MMA loop: fewer registers live
        D = [_LazyWords(st["D"][r], st["codes"], st["scw"], r, tid) for r in range(2)]
        return fp4_mma_partials(D, x, m, tid, groups)
    if fp4:
        rest = fp4_decode_rows(st["codes"], st["scw"], range(st["pre"], FP4_WORDS), tid)
        return fp4_mma_partials([{**st["D"][i], **rest[i]} for i in range(2)], x, m, tid, groups)
    return mma_partials(st["A"], x, m, tid, st["zero"], groups)


class _LazyWords:
    """Decoded code words of one row: those decoded before the wait, the others decoded when first read."""

    def __init__(self, done, codes, scw, row, tid):
        self.done, self.codes, self.scw, self.row, self.tid = dict(done), codes, scw, row, tid

    def __getitem__(self, i):
        if i not in self.done:
            scale = fp4_scale_pair(self.scw[self.row][i // 4], self.tid)[(i % 4) // 2]
            self.done[i] = fp4_decode(self.codes[self.row][i], scale)
        return self.done[i]


def reduce_sums(fp4: bool, st, d, tid, tile: int):
    """The four warps' partial sums added (reduce_rows), times the global scale for NVFP4."""
    red = cute.make_tensor(cute.arch.alloc_smem(Float32, WARPS * ROWS * tile, alignment=16),
                           cute.make_layout(WARPS * ROWS * tile))  # fmt: skip
    s = reduce_rows(d, tid, red, tile)
    if fp4:
        s = [v * st["gs"] for v in s]
    return s


class CtaGemv:
    """The GEMV of one CTA for one weight format and token tile: `start` issues the weight slice and waits for
    the predecessor (weights_then_wait), `sums` computes this CTA's 16 rows for all tokens of the tile."""

    def __init__(self, fp4: bool, tile: int, pre: int):
        self.fp4, self.tile, self.pre = fp4, tile, pre

    def start(self, w, wsc, gsc, row0, tid, m, issued=None):
        return weights_then_wait(self.fp4, w, wsc, gsc, row0, tid, m, self.pre, issued)

    def sums(self, st, x, m, tid, between=None):
        """After start: thread tid gets the fp32 sums (times the global scale for NVFP4) of row tid % 16,
        tokens tid // 16 + 8 j, one per group j of 8 tokens (syncs the CTA). between(), if given, runs after
        this thread's MMAs, before the warps' sums are added (when the weight registers are free)."""
        d = partial_sums(self.fp4, st, x, m, tid, self.tile // 8)
        if between is not None:
            between()
        return reduce_sums(self.fp4, st, d, tid, self.tile)

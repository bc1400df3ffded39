"""The GEMV of one CTA, shared by the fused qkv kernel and the standalone GEMV kernel: tensor-core MMAs
(mma.sync m16n8k16, bf16 in, fp32 accumulate) of weight rows (MMA-M, 16 per warp) and tokens (MMA-N, groups
of 8). Two CTA shapes use it (docs/kernels.md §2):
* `CtaGemv`, the 8-token kernels: a CTA of 128 threads owns 16 rows; warp w takes K quarter w;
* `StreamGemv`, the token stream (tiles 16, 32, 64): a CTA owns one K quarter of 64 rows (warp w: row block
  w of them), x arrives a group of 8 tokens at a time, and the quarters meet over DSMEM.

K split and summation order (fixed, so every kernel built on it rounds the same sums, whatever M and tile):
* one warp's unit is 16 rows x one K quarter [512 q, 512 q + 512), 16 blocks of 32 k; in block b, lane
  (g, t) = (lane / 4, lane % 4) holds the 8 consecutive k in [512 q + 32 b + 8 t, +8) of rows g and g + 8
  (one 16-byte load each) and of token g (x). Those 8 k feed two mma.sync (pairs 0,1 then pairs 2,3: a K
  permutation, the same for A and B, so the dot product is unchanged);
* the unit accumulates its 32 mma in one chain per MMA of the block (acc[0], acc[1]) in block order and adds
  the two chains; the four quarters' partial sums are added in quarter order 0, 1, 2, 3 (sum_quarters).
Each token is an MMA column of its own, so its sum is the same in any tile and either CTA shape.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm

from flint_aot.kernels.device import bulk_copy, lanes
from loader.abi import (
    HIDDEN,
    K_QUARTER,
    NVFP4_ROW_BYTES,
    ROWS_PER_CTA,
    SCALE_COLS,
    TOKEN_GROUP,
    WG_STRIDES,
    ring_strides,
    stream_row,
    tile8_row,
)

K = HIDDEN
ROWS = ROWS_PER_CTA
THREADS = 128
WARPS = THREADS // 32
NB = K // 32 // WARPS  # 32-wide k blocks per warp


def ld_weight(ptr):
    """16 bytes of weights: read once, never written by a predecessor -> non-coherent path, no L1 allocation,
    128-byte L2 fetch (0.1-0.25 us per layer faster for BF16 than the 256-byte hint, the same for NVFP4;
    docs/benchmarks-history.md §1)."""
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


def as_i32(f):
    return Int32(llvm.bitcast(Int32.mlir_type, f.ir_value()))


def issue_weight_loads(w, row0, tid, kq=None):
    """Issue all of this thread's weight loads (32 x 16 B) of rows row0 + g and + 8 in K quarter kq (default:
    the warp's); returns [(lo, hi)] per k block."""
    warp, _, g, t = lanes(tid)
    kq = warp if kq is None else kq
    wa = w + ((row0 + g) * K + kq * (NB * 32) + t * 8)
    return [(ld_weight(wa + b * 32), ld_weight(wa + (8 * K + b * 32))) for b in range(NB)]


def ld_shared(ptr):
    return cute.arch.inline_ptx(
        "ld.shared.v4.u32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Int32] * 4,
        read_only_args=[ptr],
    )


def ld_shared_f32x4(ptr):
    """4 fp32 of shared memory at a 16-byte aligned pointer."""
    return [as_f32(v) for v in ld_shared(ptr)]


def smem_row(fp4: bool) -> int:
    """Row stride (elements) of x of all K staged in shared memory (SharedX: the 8-token qkv kernel), padded
    against bank conflicts (loader.abi.tile8_row)."""
    return tile8_row("nvfp4" if fp4 else "bf16")


class SharedX:
    """x rows staged in this CTA's shared memory (row stride `row` elements) by bulk copies: all of K for the
    8-token kernels (qkv.py: the cluster's multicast copies), a group's K quarter in the token stream's ring;
    `ready()` waits on their mbarrier (None: the caller has waited). Passed instead of the global x pointer,
    it changes where the fragments come from, not the MMA sequence: results stay bit-identical."""

    def __init__(self, base, row, mbar):
        self.base, self.row, self.mbar = base, row, mbar

    def ready(self):
        if self.mbar is not None:
            cute.arch.mbarrier_wait(self.mbar, 0)

    def load(self, tok, k):
        return ld_shared(self.base + (tok * self.row + k))


class TiledX(SharedX):
    """The x of one token-stream ring stage as wgmma tiles (loader.abi.WG_STRIDES; the caller has waited for
    it), read by ldmatrix: matrix j of MMA step s is the 16-byte chunk 4 s + j of the 8 tokens' rows, whose
    row g, word t is lane (g, t)'s MMA pair j of the k that fp4_x_k (NVFP4) or bf16_x_k (BF16, step s = k
    block s) gives, i.e. fp4_mma_partials' paired fragment of step s, or mma_partials' fragment of block s.
    `base`: the stage's shared address (an integer)."""

    def __init__(self, base, lane):
        super().__init__(base, 0, None)
        self.lane = lane

    def __getitem__(self, s):
        """Step s's fragment, loaded where it is used (so the loads stay beside their MMAs)."""
        return cute.arch.inline_ptx(
            "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
            write_only_types=[Int32] * 4,
            read_only_args=[self.base + sw128_chunk(4 * s + self.lane // 8, self.lane % 8)])  # fmt: skip


def sw128_chunk(c, row):
    """Byte offset of logical 16-byte chunk c of row `row` (0..7) in the 128-byte swizzled layout of a group's
    K quarter (loader.abi.WG_STRIDES): atom c // 8, row `row`, chunk (c % 8) ^ row."""
    return (c // 8) * 1024 + row * 128 + ((c % 8) ^ row) * 16


def _x_loads(x, tok, ks):
    """16-byte x fragments at token tok and element offsets ks: global loads, or shared once staged (wgmma
    tiles: indexed by MMA step, the tiles holding each step's k in fp4_x_k's order)."""
    if isinstance(x, TiledX):
        return x
    if isinstance(x, SharedX):
        x.ready()
        return [x.load(tok, k) for k in ks]
    xa = x + tok * K
    return [ld_act(xa + k) for k in ks]


def runtime_zero(regs, m):
    """An Int32 that is 0 at run time (m >= 1) but depends on every register in regs, so ptxas must issue
    every load before anything that uses it (it otherwise sinks loads next to their use, and may move
    griddepcontrol.wait above .nc loads)."""
    f = regs[0]
    for r in regs[1:]:
        f = f ^ r
    return f & (m >> 31)


def bf16_x_k(t, b, kx=0):
    """BF16: the first of the 8 consecutive k that lane t of a quad reads for block b of the quarter at kx;
    plain arithmetic on Python or DSL integers (tests/test_gemv_layout.py checks the banks it implies)."""
    return kx + t * 8 + b * 32


def mma_partials(A, x, tok, tid, zero, kx=None):
    """This warp's partial sums over its K quarter for 8 tokens: [d0, d1, d2, d3] with d0/d1 = (row g, token
    columns 2t, 2t + 1), d2/d3 = (row g + 8, the same columns). A from issue_weight_loads; x bf16 rows of K
    (global) or a SharedX; tok: the row of x this lane's column g reads (columns past the last token repeat
    it and are never stored); kx: x's element offset of the quarter (default: the warp's, warp * 512)."""
    warp, _, g, t = lanes(tid)
    kx = warp * (NB * 32) if kx is None else kx
    X = _x_loads(x, tok, [bf16_x_k(t, b, kx) for b in range(NB)])
    z = as_f32(zero)
    acc = [[z, z, z, z], [z, z, z, z]]
    for b in range(NB):
        lo, hi = A[b]
        for j in range(2):
            acc[j] = list(mma_bf16((lo[2 * j], hi[2 * j], lo[2 * j + 1], hi[2 * j + 1]),
                                   (X[b][2 * j], X[b][2 * j + 1]), acc[j]))  # fmt: skip
    return [acc[0][i] + acc[1][i] for i in range(4)]


def reduce_rows(d, tid, red):
    """Cross-warp sum in warp order. d: mma_partials' sums; red: smem fp32 tensor of WARPS*ROWS*8. After the
    call (it syncs the CTA) thread i holds the full sum of row i % 16, token i // 16."""
    warp, _, g, t = lanes(tid)
    base = warp * (ROWS * 8) + g * 8 + 2 * t
    red[base] = d[0]
    red[base + 1] = d[1]
    red[base + 8 * 8] = d[2]
    red[base + 8 * 8 + 1] = d[3]
    cute.arch.sync_threads()
    return sum_quarters(red, tid)


def sum_quarters(red, tid, row: int = 8):
    """Row tid % 16, token tid // 16 of the four K quarters' partial sums in red ([quarter][row][token],
    fp32, `row` words a row: 8 tokens and a pad), added in quarter order 0, 1, 2, 3: the one summation order
    of every GEMV kernel."""
    r, tk = tid % ROWS, tid // ROWS
    s = red[r * row + tk]
    for q in range(1, WARPS):
        s = s + red[q * (ROWS * row) + r * row + tk]
    return s


# ----------------------------------------------------------------------------- NVFP4 weights
# Weight rows are 1024 bytes of e2m1 codes (low nibble = even k) plus 128 e4m3 block scales (one per 16 k) in
# the 128x4-swizzled layout, read in place. Same CTA shape and MMA as BF16, with another K split:
# * warp w owns k in [512 w, 512 w + 512) as 16 chunks of 32 k (16 code bytes); lane (g, t) owns chunks
#   4 c + t, c = 0..3, of rows g and g + 8 (one 16-byte load each: a warp instruction reads 8 rows x 64
#   contiguous bytes), their 2 block scales (half of a 4-byte swizzle group) and x of token g at those k;
# * code word i = 4 c + u (k0 = 512 w + 128 c + 32 t + 8 u, .. k0 + 7) decodes to 4 bf16x2 registers
#   P_j = (k0 + j, k0 + j + 4), j = 0..3, and x is permuted to the same pairs (fp4_x_pairs, or, in the fused
#   kernel's two-kernel design, by the norm kernel where it writes xn: loader.abi.xn_pairs); word i feeds
#   MMA 2 i (P_0, P_1) and 2 i + 1 (P_2, P_3): a K permutation shared by A and B, so the dot product is
#   unchanged;
# * lanes t = 2, 3 take the words of each chunk in the order u ^ 2 (2, 3, 0, 1): MMA step i = 4 c + u reads
#   word 4 c + (u ^ (t & 2)) for both A and B (a lane's k-slots meet only that lane's, so the lanes of one
#   step may hold different words). Why: at one step the lanes t read x 64 B (32 k) apart, so t and t + 2
#   would hit the same banks, a 2-way conflict on every x read from shared memory; with the swap the 8 lanes
#   of a phase read 8 different 16-byte bank groups for x rows whose stride is 16 mod 128 bytes (smem_row,
#   stream_row). It costs a select per code word and block scale, once per call (issue_fp4_loads,
#   fp4_decode_rows);
# * decoded weights are e2m1 * e4m3 * 2^-7 (exact in bf16: at most 5 significant bits, always normal); the
#   fp32 row sums are multiplied by global_scale * 2^7 after the cross-warp reduction (reduce_rows order).
KB = NVFP4_ROW_BYTES  # code bytes per row
FP4_CHUNKS = KB // 16 // WARPS // 4  # 16-byte code chunks per thread per row (4)
FP4_WORDS = FP4_CHUNKS * 4  # 32-bit code words per thread per row (16)
# code words per row decoded before griddepcontrol.wait, per kernel (weights_then_wait's `pre`): the fused qkv
# kernel decodes 12 of 16 (measured fastest on the H200: 8 is 0.1-0.2 us per layer slower for (32,4), all 16
# fit in 167 registers but gain less; docs/benchmarks-history.md §1); the standalone GEMV 8 (12 takes it to
# 186 registers)
FP4_PRE_QKV = 12
FP4_PRE_GEMV = 8


def ld_weight_b32(ptr):
    return cute.arch.inline_ptx(
        "ld.global.nc.b32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[ptr]
    )


def issue_fp4_loads(wq, sf, row0, tid, kq=None):
    """This thread's code and scale loads, rows row0 + g and + 8, K quarter kq (default: the warp's):
    (codes[2][16 words], scales[2][4 words]); codes[row][4 c + u] is word u ^ (t & 2) of chunk c (the step
    order); scales[row][c] is the swizzle group holding chunk c's two block scales (in half t % 2)."""
    warp, _, g, t = lanes(tid)
    kq = warp if kq is None else kq
    codes, scales = [], []
    swap = (t & 2) != 0
    for r in (row0 + g, row0 + g + 8):
        a = wq + (r * KB + kq * (KB // WARPS) + t * 16)
        words = []
        for c in range(FP4_CHUNKS):
            v = ld_weight(a + 64 * c)
            words.extend(cutlass.select_(swap, v[u ^ 2], v[u]) for u in range(4))  # step order u ^ (t & 2)
        codes.append(words)
        # logical scale column of chunk c: 32 w + 8 c + 2 t (+1) -> group 8 w + 2 c + t // 2
        # (the offsets of docs/nvfp4.md §3)
        grp = (r // 128) * (SCALE_COLS // 4) + kq * 8 + t // 2
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
    """Decoded bf16x2 for the given step indices of both rows (codes in step order, issue_fp4_loads):
    D[row][i] = 4 registers."""
    swap = (lanes(tid)[3] & 2) != 0
    out = []
    for row in range(2):
        sc = {}
        d = {}
        for i in words:
            c = i // 4
            if c not in sc:
                s0, s1 = fp4_scale_pair(scales[row][c], tid)
                sc[c] = (cutlass.select_(swap, s1, s0), cutlass.select_(swap, s0, s1))  # step order
            d[i] = fp4_decode(codes[row][i], sc[c][(i % 4) // 2])  # 2 words (16 k) per block scale
        out.append(d)
    return out


def fp4_x_k(t, i, kx=0):
    """NVFP4: the first of the 8 consecutive k that lane t of a quad reads at MMA step i = 4 c + u of the
    quarter starting at kx: word u ^ (t & 2) of its chunk 4 c + t (the step order of issue_fp4_loads)."""
    return kx + t * 32 + 128 * (i // 4) + 8 * ((i % 4) ^ (t & 2))


def fp4_mma_partials(D, x, tok, tid, m, kx=None, paired=False):
    """This warp's partial sums (layout as mma_partials) from decoded weights D[row][word] (all 16 words), x
    and tok as mma_partials. Global x loads are fenced: every one is issued right after the wait, before the
    first MMA. paired: x holds each 8 k already in the MMA's pair order (fp4_x_pairs' output; the norm kernel
    writes it so for the two-kernel design, loader.abi.xn_pairs), so its loads feed the MMAs as they are."""
    warp, _, g, t = lanes(tid)
    kx = warp * (K // WARPS) if kx is None else kx
    X = _x_loads(x, tok, [fp4_x_k(t, i, kx) for i in range(FP4_WORDS)])
    if isinstance(x, SharedX):
        z = Float32(0.0)  # shared-memory loads: short latency, no fence (it would hold all 64 registers)
    else:
        flat = []
        for v in X:
            flat.extend(v)
        z = as_f32(runtime_zero(flat, m))  # all global x loads issued at once, before the first MMA
    acc = [[z, z, z, z], [z, z, z, z]]
    for i in range(FP4_WORDS):
        xp = X[i] if paired else fp4_x_pairs(X[i])
        a, b = D[0][i], D[1][i]
        for h in range(2):
            acc[h] = list(mma_bf16((a[2 * h], b[2 * h], a[2 * h + 1], b[2 * h + 1]),
                                   (xp[2 * h], xp[2 * h + 1]), acc[h]))  # fmt: skip
    return [acc[0][i] + acc[1][i] for i in range(4)]


# ----------------------------------------------------------------------------- the GEMV of one CTA
# The fused qkv kernel and the standalone GEMV both call these, so their bf16 results are bit-identical.
def weights_then_wait(fp4: bool, w, wsc, gsc, row0, tid, m, pre: int = FP4_PRE_GEMV, issued=None, kq=None):
    """Issue this thread's whole weight slice (rows row0 + g, + 8 of K quarter kq, default the warp's; NVFP4:
    codes, scales and the decode of `pre` of 16 words), then griddepcontrol.wait, guarded by a run-time zero
    that depends on every loaded register (ptxas can neither sink the loads below the wait nor hoist the wait
    above them). BF16: issued(), if given, runs once the loads are issued, before any of them is waited for
    (the guard's chain starts from a clock read after it, so ptxas cannot hoist the waits above it). Returns
    the state the MMAs take (partial_sums)."""
    st = {}
    if fp4:
        assert issued is None, "NVFP4: a warp waiting in issued() could not decode before the wait"
        codes, scw = issue_fp4_loads(w, wsc, row0, tid, kq)
        st["gs"] = global_scale(gsc)
        st["D"] = fp4_decode_rows(codes, scw, range(pre), tid)
        st["codes"], st["scw"], st["pre"] = codes, scw, pre
        flat = scw[0][pre // 4 :] + scw[1][pre // 4 :] + codes[0][pre:] + codes[1][pre:]
        for row in st["D"]:
            for regs in row.values():
                flat.extend(regs)
    else:
        st["A"] = issue_weight_loads(w, row0, tid, kq)
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


def global_scale(gsc):
    """NVFP4: the weights' global scale times 2^7 (the decoded weights are e2m1 * e4m3 * 2^-7)."""
    return cute.make_tensor(gsc, cute.make_layout(1))[0] * Float32(128.0)


@cute.jit
def guarded_wait(zero: Int32):
    if zero == 0:  # always true at run time
        cute.arch.griddepcontrol_wait()


def decode_rest(st, tid):
    """NVFP4: the code words not decoded before the wait, decoded now (st["D"] then holds all 16)."""
    rest = fp4_decode_rows(st["codes"], st["scw"], range(st["pre"], FP4_WORDS), tid)
    st["D"] = [{**st["D"][i], **rest[i]} for i in range(2)]


def partial_sums(fp4: bool, st, x, tok, tid, m, kx=None, paired=False):
    """This warp's MMAs for 8 tokens (mma_partials / fp4_mma_partials; NVFP4: after decode_rest; paired: x in
    the MMA pair order)."""
    if fp4:
        return fp4_mma_partials(st["D"], x, tok, tid, m, kx, paired)
    return mma_partials(st["A"], x, tok, tid, st["zero"], kx)


def scaled(fp4: bool, st, v):
    """A row sum times the global scale (x 2^7) for NVFP4."""
    return v * st["gs"] if fp4 else v


class CtaGemv:
    """The 8-token GEMV of one CTA for one weight format: `start` issues the weight slice and waits for the
    predecessor (weights_then_wait), `sums` computes this CTA's 16 rows for up to 8 tokens."""

    def __init__(self, fp4: bool, pre: int, paired: bool = False):
        self.fp4, self.pre, self.paired = fp4, pre, paired  # paired: x in the NVFP4 MMA pair order

    def start(self, w, wsc, gsc, row0, tid, m, issued=None):
        return weights_then_wait(self.fp4, w, wsc, gsc, row0, tid, m, self.pre, issued)

    def sums(self, st, x, m, tid, between=None):
        """After start: thread tid gets the fp32 sum (times the global scale for NVFP4) of row tid % 16, token
        tid // 16 (syncs the CTA). between(), if given, runs after this thread's MMAs, before the warps' sums
        are added."""
        if self.fp4:
            decode_rest(st, tid)
        _, _, g, _ = lanes(tid)
        d = partial_sums(self.fp4, st, x, cutlass.min(g, m - 1), tid, m, paired=self.paired)
        if between is not None:
            between()
        red = cute.make_tensor(cute.arch.alloc_smem(Float32, WARPS * ROWS * 8, alignment=16),
                               cute.make_layout(WARPS * ROWS * 8))  # fmt: skip
        return scaled(self.fp4, st, reduce_rows(d, tid, red))


# ------------------------------------------------------------------------ wgmma (the 32- and 64-token stream)
# wgmma.m64nNk16 of a warpgroup (the CTA's 4 warps, warp w the rows 16 w .. 16 w + 15) adds exactly what
# mma.sync adds given the same A fragments, k permutation and order (benchmarks/wgmma_probe: every sum of six
# inputs bit-identical; the stream's sums, tests/test_qkv_gpu.py), and reuses each A fragment for N tokens.
# A: this thread's mma.sync A registers, or a K-major tile in shared memory (no swizzle: core matrices of 8
# rows x 16 B); B (x): the ring's K-major tiles with the 128-byte swizzle (loader.abi.WG_STRIDES).
WG_CORE = 128  # bytes of one core matrix


def _f32_struct(n):
    return llvm.StructType.get_literal([Float32.mlir_type] * n)


def _wg_tied(asm, vals, extra=(), extra_cons=()):
    """asm with vals as tied in/out fp32 registers $0.. and extra inputs after them (side effects: never
    reordered against the other wgmma statements); returns the new values."""
    n = len(vals)
    cons = ",".join(["=f"] * n + list(extra_cons) + [str(i) for i in range(n)])
    ops = [e.ir_value() if hasattr(e, "ir_value") else e for e in extra] + [v.ir_value() for v in vals]
    res = llvm.inline_asm(_f32_struct(n), ops, asm, cons, has_side_effects=True)
    return [Float32(llvm.extractvalue(Float32.mlir_type, res, [i])) for i in range(n)]


def wg_fence(vals):
    """wgmma.fence: the accumulators and A registers written before are visible to the wgmma after."""
    return _wg_tied("wgmma.fence.sync.aligned;", vals)


def wg_wait(vals):
    """Commit the wgmma issued so far and wait for them: vals hold their sums after."""
    return _wg_tied("wgmma.commit_group.sync.aligned;\n\twgmma.wait_group.sync.aligned 0;", vals)


def wgmma_ss(n, acc, desc_a, desc_b, one):
    """acc += A (64 rows x k16 at desc_a) x B (k16 x n tokens at desc_b), both from shared memory."""
    r = n // 2
    d = ",".join(f"${i}" for i in range(r))
    asm = ("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $" + str(r + 2) + ", 0;\n\t"
           f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, ${r}, ${r + 1}, p, 1, 1, 0, 0;"
           "\n\t}")  # fmt: skip
    return _wg_tied(asm, acc, extra=(desc_a, desc_b, one), extra_cons=("l", "l", "r"))


def wgmma_rs(n, acc, a, desc, one):
    """acc += A (4 registers: mma.sync's A fragment of this warp's 16 rows) x B (k16 x n tokens at desc)."""
    r = n // 2
    d = ",".join(f"${i}" for i in range(r))
    asm = ("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $" + str(r + 5) + ", 0;\n\t"
           f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, "
           f"{{${r},${r + 1},${r + 2},${r + 3}}}, ${r + 4}, p, 1, 1, 0;\n\t}}")  # fmt: skip
    return _wg_tied(asm, acc, extra=(*a, desc, one), extra_cons=("r", "r", "r", "r", "l", "r"))


def wg_desc_sw128(addr, sbo: int):
    """A K-major matrix descriptor with the 128-byte swizzle: rows of 128 bytes, 8 rows (1 KB, 1 KB-aligned)
    an atom, the next 8 rows (tokens) sbo bytes further; addr + 32 j points at the atom's k16 slice j."""
    return Int64((addr >> 4) & 0x3FFF) | Int64(1 << 16) | (Int64(sbo >> 4) << 32) | (Int64(1) << 62)


def wg_desc(addr, sbo: int):
    """A K-major matrix descriptor without swizzle: start address addr (shared, bytes), the next core matrix
    in k WG_CORE bytes further (LBO), the next 8 rows (tokens) sbo bytes further (SBO)."""
    return Int64((addr >> 4) & 0x3FFF) | Int64((WG_CORE >> 4) << 16) | (Int64(sbo >> 4) << 32)


# ----------------------------------------------------------------------------- the token stream (tiles > 8)
# docs/kernels.md §2.5. The unit of work of the 8-token design, one warp's K quarter of 16 rows with its two
# MMA chains, is kept, and so is the order in which the quarters are added; what changes is where the units
# sit and how the tokens arrive:
# * a CTA of 4 warps takes 64 rows (4 row blocks, warp w the block 4 quad + w) of ONE K quarter q; the 4 CTAs
#   of one quad (its quarters 0..3) are 4 consecutive ranks of a cluster, 4 h + q;
# * x arrives per group of 8 tokens, and only the CTA's quarter of it (8 x 1 KB: one bulk copy where the
#   norm kernel wrote it in the ring's layout, the fused kernel; one per token from plain rows, the
#   standalone GEMV) into a ring of STAGES stages in dynamic shared memory, each refilled as soon as every
#   warp has read it; each weight fragment, held in registers for the whole call, meets every group;
# * after each group's MMAs every warp sends its 16 x 8 partial sums to their owners by st.async, and goes
#   on to the next group without waiting for anyone. The standalone GEMV's owners are row blocks (`send`:
#   rank 4 h + w), each thread then holding, like the 8-token kernel after reduce_rows, the sum of row
#   tid % 16, token 8 i + tid // 16 (`total`); the fused kernel's are tokens (`send_tokens`: rank j, token
#   8 i + j of every group, all 128 rows of the head), so that one warp holds a token's whole head for its
#   q/k norm and RoPE (`token_rows`: lane l the rows 4 l .. 4 l + 3). Either way the owner adds the four
#   quarters in order 0..3, once its own MMAs are done. (Waiting for a peer's
#   group after each group, as a first version did, paid a DSMEM round trip per group: 1.2-1.5 us,
#   BENCHMARKS.md.)
QUARTER = K_QUARTER  # k per quarter (512)
GROUP = TOKEN_GROUP  # tokens per group: one mma.sync N
STAGES = 3  # x ring depth: a group's bulk copies are issued 2 groups before its MMAs
PART_BYTES = WARPS * ROWS * GROUP * 4  # partial sums one owner receives per group (4 quarters, fp32)
# their rows in shared memory: 8 tokens and 2 words of pad, so that the owner's reads (a warp: 16 rows x 2
# tokens) hit 32 different banks (without the pad, 8 banks: 4-way conflicts), and a sender's 8-byte pair of
# tokens stays aligned
PART_ROW = GROUP + 2
PART_WORDS = WARPS * ROWS * PART_ROW  # one group's buffer (words)
# the fused kernel's owners are tokens, not row blocks (send_tokens): rank j receives token 8 i + j of
# group i, all 128 rows of the head from the 8 CTAs (2 halves x 4 quarters), [group][quarter][row] fp32: the
# same bytes, so PART_BYTES holds for both
HEAD_ROWS = 2 * WARPS * ROWS
# the wgmma stream: A's words (NVFP4: decoded code words; BF16: k blocks; 16 either way, 8 registers each)
# that stay in registers, per tile; the others are parked in shared memory, since at 3 CTAs per SM (168
# registers) 15 or 16 words beside N = 24's accumulators make ptxas serialize the wgmma and spill (14: 162
# registers at tile 32, 12: 160, both unserialized). Tile 32 keeps 12 (chosen when its pass was N = 32, where
# 14 serialized too; 14 measured since: -0.15..+0.12 us, mixed); tile 64 takes 14: with 8 KB less of parked A
# its three CTAs fit the 196 KB carveout (with 12 they need 228 KB, and gave back 0.3-0.45 us a layer of the
# passes' gain; BENCHMARKS.md §2 step 21)
WG_REG = {32: 12, 64: 14}
TOKEN_WORDS = WARPS * HEAD_ROWS  # one group's buffer (words)


class StreamGemv:
    """The token stream's GEMV of one CTA (tiles 16, 32, 64): `alloc` / `arm` set up its shared memory and
    mbarriers, `start` issues the weights of this thread (K quarter q) and waits for the predecessor, `fill`
    brings a group's x quarter into the ring, `partials` runs a group's MMAs, `send` / `send_tokens` hand them
    to the owners of the row blocks / of the tokens, `total` / `token_rows` are an owner's sums. The caller
    decides the order (docs/kernels.md §2.5)."""

    def __init__(self, fp4: bool, tile: int, pre: int, stages: int = STAGES, read_barriers: bool = False,
                 ring_x: bool = False, token_owners: bool = False, paired: bool = False, wgmma: bool = False):
        self.fp4, self.tile, self.pre = fp4, tile, pre
        self.paired = paired  # x in the NVFP4 MMA pair order (fp4_mma_partials)
        # partial sums to the owner of each token (send_tokens, the fused kernel) or of each row block (send)
        self.part_words = TOKEN_WORDS if token_owners else PART_WORDS
        # x in the ring layout (loader.abi.xn_strides: the fused kernel's two-kernel design, whose norm
        # kernel writes it so): one bulk copy per group and stage; else plain rows, one copy per token
        self.ring_x = ring_x
        self.groups = tile // GROUP
        self.stages = min(stages, self.groups)
        # the stages are refilled by `refill`, on "read" mbarriers instead of a CTA barrier (the fused
        # kernel's two-kernel design; the standalone GEMV keeps the CTA barrier, 0.07-0.15 us faster for it
        # at M = 48-64, and the prologue design fills its ring itself: BENCHMARKS.md §2 step 13)
        self.refills = read_barriers and self.groups > self.stages
        self.xrow = stream_row("nvfp4" if fp4 else "bf16")
        group, _, self.ring_quarter = ring_strides("nvfp4" if fp4 else "bf16")  # ring_x: xn's strides
        self.ring_quarters = group // self.ring_quarter  # (a group's quarter blocks, one after another)
        self.dyn_smem = self.stages * GROUP * self.xrow * 2  # the x ring (bytes)
        # the wgmma stream (both formats, the separate design's 32- and 64-token kernels, §2.6): x in
        # the wgmma's swizzled K-major tiles (xn in loader.abi.WG_STRIDES), one 8 KB bulk copy a group and
        # quarter into a ring of 4 stages; groups 4 h .. 4 h + 3: group 4 h by mma.sync (x by ldmatrix) as
        # soon as its x lands, then the other 3 in one wgmma pass (N = 24), A's words 0 .. wg_reg - 1 from
        # registers, the rest from a tile in shared memory (`park`); groups outside such a four by mma.sync
        self.wgmma = wgmma
        if wgmma:
            assert ring_x and (paired or not fp4) and self.stages == 4, "wgmma: a ring of 4 stages"
            self.wg_reg = WG_REG[tile]
            group, _, self.ring_quarter = WG_STRIDES
            self.ring_quarters = group // self.ring_quarter
            self.stage_bytes = GROUP * QUARTER * 2
            self.a_off = self.stages * self.stage_bytes  # A's parked words, after the ring
            self.a_sbo = (FP4_WORDS - self.wg_reg) * 4 * WG_CORE  # the next 8 rows of A
            self.dyn_smem = self.a_off + WARPS * ROWS // 8 * self.a_sbo

    def alloc(self):
        """x ring [stage][token][xrow] bf16 (dynamic shared memory), the owners' partial sums (row owners:
        [group][quarter][row][token], token owners: [group][quarter][row]) fp32, one mbarrier per stage (its
        x copies landed; where stages are refilled, a second: every warp is done with it) and one per group
        (partial sums)."""
        xs = cute.arch.get_dyn_smem(BFloat16, alignment=1024 if self.wgmma else 128)
        red = cute.arch.alloc_smem(Float32, self.groups * self.part_words, alignment=16)
        mbx = cute.arch.alloc_smem(Int64, (2 if self.refills else 1) * self.stages, alignment=8)
        mbr = cute.arch.alloc_smem(Int64, self.groups, alignment=8)
        return xs, red, mbx, mbr

    def arm(self, xs, red, mbx, mbr):
        """Thread 0, before the cluster arrive: initialise the mbarriers (a stage's "read" one takes an
        arrival from every thread); each group's expects its 4 quarters' partial sums."""
        for i in range(self.stages):
            cute.arch.mbarrier_init(mbx + i, 1)
            if self.refills:
                cute.arch.mbarrier_init(mbx + self.stages + i, THREADS)
        for i in range(self.groups):
            cute.arch.mbarrier_init(mbr + i, 1)
        cute.arch.mbarrier_init_fence()
        for i in range(self.groups):
            cute.arch.mbarrier_arrive_and_expect_tx(mbr + i, PART_BYTES)

    def start(self, w, wsc, gsc, row0, q, tid, m, issued=None):
        st = weights_then_wait(self.fp4, w, wsc, gsc, row0, tid, m, self.pre, issued, q)
        if self.fp4:
            decode_rest(st, tid)  # every group uses every word
        return st

    @cute.jit
    def fill(self, xs, mbx, x, q, i, m, tid):
        """Group i's tokens, quarter q of their rows of x (bf16, written by the predecessor: the calling
        threads, tid < 8, have waited for it), into ring stage i % stages, thread 0 arming the stage's
        mbarrier for them. x in the ring layout (ring_x): the group's quarter is one block of n rows of xrow,
        one bulk copy by thread 0; plain rows [m, K]: one 1 KB bulk copy per token (thread tid < n: token
        8 i + tid)."""
        stg = i % self.stages
        n = cutlass.min(m - GROUP * i, GROUP)
        if cutlass.const_expr(self.wgmma):  # the whole tile (every token's rows are spread over its 8 atoms)
            if tid == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(mbx + stg, self.stage_bytes)
                src = x + (i * self.ring_quarters + q) * self.ring_quarter
                bulk_copy(xs + stg * (self.stage_bytes // 2), src, mbx + stg, self.stage_bytes)
        elif cutlass.const_expr(self.ring_x):
            if tid == 0:
                nbytes = n * (self.xrow * 2)
                cute.arch.mbarrier_arrive_and_expect_tx(mbx + stg, nbytes)
                src = x + (i * self.ring_quarters + q) * self.ring_quarter
                bulk_copy(xs + stg * GROUP * self.xrow, src, mbx + stg, nbytes)
        else:
            if tid == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(mbx + stg, n * (QUARTER * 2))
            if tid < n:
                bulk_copy(xs + (stg * GROUP + tid) * self.xrow, x + ((GROUP * i + tid) * K + q * QUARTER),
                          mbx + stg, QUARTER * 2)  # fmt: skip

    @cute.jit
    def refill(self, xs, mbx, x, q, i, m, tid):
        """After group i's MMAs: group i + stages into stage i % stages once every warp is done with it.
        With read barriers (`refills`: the fused 64-token ring of the mma.sync stream, and sm_100a's, whose
        wgmma-tile kernels run every group by mma.sync; sm_90a's wgmma fours refill after CTA barriers,
        docs/kernels.md §2.6) every thread arrives on the stage's "read" mbarrier (release: its fragment
        reads come before the copies); only the copying threads (tid < 8) wait for all 128 and copy; the
        other warps go on without a CTA barrier. The warp barrier after it
        makes warp 0 whole again before its next shuffles and MMAs: without it ptxas could no longer prove
        warp 0 converged (168 registers instead of 159, every shuffle given a collective fallback; NVFP4 up to
        1.2 us slower at M = 64, BENCHMARKS.md). Otherwise a CTA barrier first (the standalone GEMV; in the
        16- and 32-token kernels, whose rings hold every group, the caller's branch is never taken, but
        without it ptxas unrolls their group loop 3 times)."""
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
        return partial_sums(self.fp4, st, x, cutlass.min(g, m - GROUP * i - 1), tid, m, 0, self.paired)

    def a_words(self, st):
        """A's registers by word i and row half h: D[h][i], 4 registers (NVFP4: decoded words; BF16: the
        16-byte loads of k block i, rows g and g + 8)."""
        if self.fp4:
            return st["D"]
        return [{i: st["A"][i][h] for i in range(NB)} for h in range(2)]

    def park(self, st, xs, tid):
        """wgmma stream, after start: this thread's A fragments of words wg_reg .. 15 (both rows) into A's
        tile in shared memory, K-major without swizzle: row r = 16 w + g (+ 8), word t of core matrix
        4 (i - wg_reg) + j holds register j of word i (the k order of x's tiles). The caller fences them for
        the async proxy and syncs the CTA before the pass."""
        warp, _, g, t = lanes(tid)
        xb = xs.toint()
        D = self.a_words(st)
        for i in range(self.wg_reg, FP4_WORDS):
            for h in range(2):
                regs = D[h][i]
                for j in range(4):
                    row = self.a_off + (2 * warp + h) * self.a_sbo + g * 16 + t * 4
                    off = row + (4 * (i - self.wg_reg) + j) * WG_CORE
                    cute.arch.inline_ptx("st.shared.b32 [{$r0}], {$r1};", read_only_args=[xb + off, regs[j]])

    def ring_partials(self, st, xs, stage, tid):
        """wgmma stream: the partial sums of the group in ring stage `stage` (landed) by the 8-token design's
        mma.sync sequence (fp4_mma_partials itself), x from the stage's tiles (TiledX); A: all 16 words from
        registers. (tok and m are unused for x in shared memory.)"""
        x = TiledX(xs.toint() + stage * self.stage_bytes, lanes(tid)[1])
        if not self.fp4:  # (x in shared memory: the accumulators start from a plain 0)
            return mma_partials(st["A"], x, 0, tid, Int32(0))
        return fp4_mma_partials(st["D"], x, 0, tid, None, paired=True)

    def wg_pass(self, st, xs, n: int, first: int = 0):
        """wgmma stream: the partial sums of the n tokens of ring stages first .. first + n / 8 - 1 (landed;
        A's parked words fenced), as partials' per group: [[d0, d1, d2, d3] per group]. The same two chains
        over the same 16 steps in the same order as fp4_mma_partials (bit-identical sums)."""
        z, one = Float32(0.0), Int32(1)
        xb = xs.toint()
        bdesc = wg_desc_sw128(xb + first * self.stage_bytes, self.stage_bytes)
        adesc = wg_desc(xb + self.a_off, self.a_sbo)
        acc = wg_fence([z] * n)
        acc = [acc[: n // 2], acc[n // 2 :]]
        D = self.a_words(st)
        for i in range(FP4_WORDS):
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

    def send(self, red, mbr, d, i, rank, tid):
        """Group i's partial sums of this warp's row block to its owner, rank 4 h + w, slot [i][q]."""
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
        """Group i's partial sums of this warp's row block to the owners of its 8 tokens: rank j owns token
        8 i + j, words [i][q][64 h + 16 w + row]. Lane (g, t) holds rows g and g + 8 of tokens 2 t and
        2 t + 1; lanes g and g ^ 1 swap one token's pair (2 shuffles), so that each lane holds two rows of one
        token (token 2 t + g % 2, rows g & ~1 and its neighbour, and 8 further) and sends them as two 8-byte
        st.async, as many as send."""
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
        """Token owner (send_tokens), after group i's mbarrier: the fp32 sums (quarters in order, times the
        global scale for NVFP4) of the head's rows 4 lane .. 4 lane + 3 for this CTA's token of group i."""
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
            out.append(scaled(self.fp4, st, s))
        return out

    def total(self, st, red, mbr, i, tid, wait: bool = True):
        """Owner: the fp32 sum of row tid % 16 of its row block, token 8 i + tid // 16 (quarters in order),
        times the global scale for NVFP4; wait=False: the caller has waited for group i's partial sums."""
        if wait:
            cute.arch.mbarrier_wait(mbr + i, 0)
        part = cute.make_tensor(red + i * PART_WORDS, cute.make_layout(PART_WORDS))
        return scaled(self.fp4, st, sum_quarters(part, tid, PART_ROW))

"""NVFP4 weights in the GEMV kernels: e2m1 codes and e4m3 block scales read in place, decoded in software to
bf16 (sm_90a has no FP4 conversion; docs/nvfp4.md §7), fed to the same MMAs as BF16 weights (mma.py).

Weight rows are K / 2 bytes of e2m1 codes (low nibble = even k) plus K / 16 e4m3 block scales (one per 16 k)
in the 128x4-swizzled layout (1024 and 128 at K = 2048). Same CTA shape, MMA and summation order as BF16,
with another k order inside a warp's K quarter (Q = K / 4 k):
* warp w owns k in [Q w, Q w + Q) as Q / 32 chunks of 32 k (16 code bytes); lane (g, t) owns chunks
  4 c + t, c = 0 .. Q / 128 - 1, of rows g and g + 8 (one 16-byte load each: a warp instruction reads 8 rows
  x 64 contiguous bytes), their 2 block scales (half of a 4-byte swizzle group) and x of token g at those k;
* code word i = 4 c + u (k0 = Q w + 128 c + 32 t + 8 u, .. k0 + 7) decodes to 4 bf16x2 registers
  P_j = (k0 + j, k0 + j + 4), j = 0..3, and x is permuted to the same pairs (fp4_x_pairs, or, in the fused
  kernel's two-kernel design, by the norm kernel where it writes xn: loader.abi.xn_pairs); word i feeds
  MMA 2 i (P_0, P_1) and 2 i + 1 (P_2, P_3): a K permutation shared by A and B, so the dot product is
  unchanged;
* lanes t = 2, 3 take the words of each chunk in the order u ^ 2 (2, 3, 0, 1): MMA step i = 4 c + u reads
  word 4 c + (u ^ (t & 2)) for both A and B (a lane's k-slots meet only that lane's, so the lanes of one
  step may hold different words). Why: at one step the lanes t read x 64 B (32 k) apart, so t and t + 2
  would hit the same banks, a 2-way conflict on every x read from shared memory; with the swap the 8 lanes
  of a phase read 8 different 16-byte bank groups for x rows whose stride is 16 mod 128 bytes (smem_row,
  stream_row). It costs a select per code word and block scale, once per call (issue_fp4_loads,
  fp4_decode_rows);
* decoded weights are e2m1 * e4m3 * 2^-7 (exact in bf16: at most 5 significant bits, always normal); the
  fp32 row sums are multiplied by global_scale * 2^7 after the cross-warp reduction (reduce_rows order).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flint_aot.kernels.device import lanes
from flint_aot.kernels.mma import WARPS, SharedX, as_f32, ld_weight, mma_bf16, runtime_zero, x_loads
from loader.abi import nvfp4_row_bytes, scale_cols


def fp4_chunks(k: int) -> int:
    """16-byte code chunks per thread per row at hidden size k (4 at 2048); 4 code words each."""
    return nvfp4_row_bytes(k) // 16 // WARPS // 4


# code words per row decoded before griddepcontrol.wait (Fp4Weights.issue's `pre`; all of them where a row has
# fewer): the fused qkv kernel 12 of 16 (fewer leave more decode after the wait; all 16 gain less), the
# standalone GEMV 8 (12 takes it past the register budget of 3 CTAs per SM)
FP4_PRE_QKV = 12
FP4_PRE_GEMV = 8


def ld_weight_b32(ptr):
    return cute.arch.inline_ptx(
        "ld.global.nc.b32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[ptr]
    )


def issue_fp4_loads(wq, sf, row0, tid, k, kq=None):
    """This thread's code and scale loads, rows row0 + g and + 8 of hidden size k, K quarter kq (default: the
    warp's): (codes[2][steps(k) words], scales[2][fp4_chunks(k) words]); codes[row][4 c + u] is word
    u ^ (t & 2) of chunk c (the step order); scales[row][c] is the swizzle group holding chunk c's two block
    scales (in half t % 2)."""
    warp, _, g, t = lanes(tid)
    kq = warp if kq is None else kq
    kb, chunks = nvfp4_row_bytes(k), fp4_chunks(k)
    codes, scales = [], []
    swap = (t & 2) != 0
    for r in (row0 + g, row0 + g + 8):
        a = wq + (r * kb + kq * (kb // WARPS) + t * 16)
        words = []
        for c in range(chunks):
            v = ld_weight(a + 64 * c)
            words.extend(cutlass.select_(swap, v[u ^ 2], v[u]) for u in range(4))  # step order u ^ (t & 2)
        codes.append(words)
        # logical scale column of chunk c: (Q / 16) w + 8 c + 2 t (+1) -> group (Q / 64) w + 2 c + t // 2
        # (the offsets of docs/nvfp4.md §3)
        grp = (r // 128) * (scale_cols(k) // 4) + kq * (scale_cols(k) // 4 // WARPS) + t // 2
        s = sf + (grp * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4)
        scales.append([ld_weight_b32(s + 1024 * c) for c in range(chunks)])
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
    """This warp's partial sums (layout as mma_partials) from decoded weights D[row][word] (all the quarter's
    words: their count gives the hidden size), x and tok as mma_partials. Global x loads are fenced: every
    one is issued right after the wait, before the first MMA. paired: x holds each 8 k already in the MMA's
    pair order (fp4_x_pairs' output; the norm kernel writes it so for the two-kernel design,
    loader.abi.xn_pairs), so its loads feed the MMAs as they are."""
    warp, _, g, t = lanes(tid)
    words = len(D[0])
    k = words * 32 * WARPS
    kx = warp * (k // WARPS) if kx is None else kx
    X = x_loads(x, tok, [fp4_x_k(t, i, kx) for i in range(words)], k)
    if isinstance(x, SharedX):
        z = Float32(0.0)  # shared-memory loads: short latency, no fence (it would hold all 64 registers)
    else:
        flat = []
        for v in X:
            flat.extend(v)
        z = as_f32(runtime_zero(flat, m))  # all global x loads issued at once, before the first MMA
    acc = [[z, z, z, z], [z, z, z, z]]
    for i in range(words):
        xp = X[i] if paired else fp4_x_pairs(X[i])
        a, b = D[0][i], D[1][i]
        for h in range(2):
            acc[h] = list(mma_bf16((a[2 * h], b[2 * h], a[2 * h + 1], b[2 * h + 1]),
                                   (xp[2 * h], xp[2 * h + 1]), acc[h]))  # fmt: skip
    return [acc[0][i] + acc[1][i] for i in range(4)]


"""Device helpers shared by several kernels: vector loads and stores, lane coordinates, the paged KV-cache
store (BF16 or FP8), NeoX RoPE with the NaN rule for positions outside the table, the input-norm arithmetic,
and the cluster's multicast bulk copy. Every kernel that must round like another calls the same helper, so
their results are bit-identical (docs/numerics.md §5)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm

from loader.abi import HALF_DIM, HEAD_DIM


def lanes(tid):
    """(warp, lane, g, t) of a thread: g = lane // 4 and t = lane % 4 are the mma.sync fragment coordinates.
    Plain arithmetic: cute.arch.warp_idx() is a full-warp shfl.sync, which deadlocks in a divergent branch."""
    lane = tid % 32
    return tid // 32, lane, lane // 4, lane % 4


def at(ptr, idx):
    """A one-element view at ptr + idx (idx may be Int64)."""
    return cute.make_tensor(ptr + idx, cute.make_layout(1))


def put(ptr, idx, val):
    """ptr[idx] = val."""
    at(ptr, idx)[0] = val


def load_vec(ptr, n):
    """n contiguous elements at a 16-byte aligned pointer, as a TensorSSA (plain ld.global, never .nc:
    ptxas may move .nc loads across griddepcontrol.wait)."""
    t = cute.make_tensor(ptr, cute.make_layout(n))
    r = cute.make_rmem_tensor(cute.make_layout(n), ptr.dtype)
    cute.autovec_copy(t, r)
    return r.load()


def store_vec(ptr, val, n):
    r = cute.make_rmem_tensor(cute.make_layout(n), ptr.dtype)
    r.store(val)
    cute.autovec_copy(r, cute.make_tensor(ptr, cute.make_layout(n)))


def f32_bits(v):
    return Int32(llvm.bitcast(Int32.mlir_type, v.ir_value()))


@cute.jit
def spin_cycles(n: cutlass.Constexpr):
    """Busy-wait n clock cycles (debug builds only: a slow producer)."""
    t0 = cute.arch.clock64()
    t = t0
    while t - t0 < Int64(n):
        t = cute.arch.clock64()


# ------------------------------------------------------------------ input RMSNorm (docs/numerics.md §1)
# The norm kernel and the qkv kernel's prologue both use these three, on chunks of 8 consecutive elements
# of a row: chunk i of the row is owned by "virtual thread" i of a CTA of K / 8 threads (warp i // 32: 256
# elements a virtual warp), the partial sums are reduced per virtual warp with a butterfly and the K / 256
# warp sums (8 at hidden 2048) added in warp order. Same order, same bits.
NORM_VEC = 8
NORM_WARP_K = 32 * NORM_VEC  # elements of a row per virtual warp


def norm_residual(x, res):
    """r = bf16(x + residual) (res None: r = x), as fp32, and the chunk's sum of squares."""
    r = x.to(Float32)
    if res is not None:
        r = (r + res.to(Float32)).to(BFloat16).to(Float32)
    return r, (r * r).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)


def norm_scale(warp_sums, eps):
    """rsqrt(mean(r²) + eps) from the virtual warps' sums of a row (a sequence, added in warp order; its
    length gives the row's length)."""
    total = warp_sums[0]
    for i in range(1, len(warp_sums)):
        total = total + warp_sums[i]
    return cute.math.rsqrt(total * Float32(1.0 / (len(warp_sums) * NORM_WARP_K)) + eps)


# the NVFP4 MMA's bf16x2 pairs (k0 + j, k0 + j + 4), j = 0..3: element e of the reordered 8 is k0 + PAIRS[e]
MMA_PAIRS = tuple(j + h * (NORM_VEC // 2) for j in range(NORM_VEC // 2) for h in range(2))


def mma_pairs(v):
    """8 values k0 .. k0 + 7 (a TensorSSA) in the order of the NVFP4 MMA's pairs (MMA_PAIRS: fp4.fp4_x_pairs'
    permutation, done once where xn is written: loader.abi.xn_pairs)."""
    t = cute.make_rmem_tensor(cute.make_layout(NORM_VEC), v.dtype)
    t.store(v)
    r = cute.make_rmem_tensor(cute.make_layout(NORM_VEC), v.dtype)
    for e, k in enumerate(MMA_PAIRS):
        r[e] = t[k]
    return r.load()


def norm_apply(r, s, w):
    """xn = bf16(bf16(r * s) * w)."""
    return ((r * s).to(BFloat16).to(Float32) * w.to(Float32)).to(BFloat16)


# ----------------------------------------------------------------------------- per-head epilogue (§3, §4, §7)
@cute.jit
def rope_coeffs(cs, p, max_pos, dim):
    """cos and sin of this dim's angle at position p from the fp32 cos|sin table, and whether p is inside the
    table (a position outside [0, max_pos) reads row 0 and makes the token's q/k NaN: see rotate)."""
    ok = p >= 0 and p < max_pos
    row = Int64(cutlass.select_(ok, p, Int64(0))) * HEAD_DIM + dim % HALF_DIM
    return ok, at(cs, row)[0], at(cs, row + HALF_DIM)[0]


def rotate(y, y_partner, ok, c, sn, dim):
    """NeoX RoPE of one dim: y1' = y1 c - y2 s (dims < 64), y2' = y2 c + y1 s; NaN when the position
    was bad."""
    sign = Float32(cutlass.select_(dim < HALF_DIM, Float32(-1.0), Float32(1.0)))
    return Float32(cutlass.select_(ok, y * c + sign * y_partner * sn, Float32(float("nan"))))


def store_e4m3(ptr, v, scale):
    """*ptr = e4m3(v / scale): IEEE division, round to nearest even, saturated to +-448 (NaN stays NaN): the
    FP8 cache's numerics (docs/numerics.md §4), bit-identical to torch's divide, clamp and cast."""
    cute.arch.inline_ptx(
        "{ .reg .f32 q; .reg .b16 h; div.rn.f32 q, {$r1}, {$r2};"
        " cvt.rn.satfinite.e4m3x2.f32 h, 0f00000000, q; st.global.b8 [{$r0}], h; }",
        read_only_args=[ptr, v, scale],
    )


@cute.jit
def store_cache(cache, slot, nslots, bs, s0, s1, s2, kvh, dim, val, fp8: cutlass.Constexpr, scale,
                narrow: cutlass.Constexpr = False):  # fmt: skip
    """cache[slot // bs, slot % bs, kvh, dim] = val (bf16), or e4m3(float(val) / scale) for an FP8 cache;
    only for 0 <= slot < nslots (negative and out-of-range slots are not written). narrow: the block and the
    offset by a 32-bit division (the loader keeps nslots < 2**31; ptxas's 64-bit division routine needs
    registers that the token stream's kernels hold)."""
    if slot >= 0 and slot < nslots:
        if cutlass.const_expr(narrow):
            s32 = Int32(slot)
            off = Int64(s32 // bs) * s0 + Int64(s32 % bs) * s1 + kvh * s2 + dim
        else:
            off = (slot // bs) * s0 + (slot % bs) * s1 + kvh * s2 + dim
        if cutlass.const_expr(fp8):
            store_e4m3(cache + off, val.to(Float32), scale)
        else:
            at(cache, off)[0] = val


# ----------------------------------------------------------------------------- bulk copies
def _bulk_size(dst, src, mbar, nbytes):
    """A bulk copy's size operand and inline_ptx arguments: an immediate, or a register ($r3)."""
    if isinstance(nbytes, int):
        return str(nbytes), [dst, src, mbar]
    return "{$r3}", [dst, src, mbar, nbytes]


def bulk_copy(dst, src, mbar, nbytes):
    """nbytes global -> this CTA's shared memory at dst (one bulk copy), completing on the mbarrier mbar;
    nbytes a Python int (an immediate) or an Int32 (a multiple of 16)."""
    size, args = _bulk_size(dst, src, mbar, nbytes)
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
        f" [{{$r0}}], [{{$r1}}], {size}, [{{$r2}}];",
        read_only_args=args,
    )


def bulk_multicast(dst, src, mbar, nbytes):
    """nbytes global -> the same shared-memory offset in all 8 CTAs of the cluster (one L2 read),
    completing on each CTA's mbarrier at mbar's offset; nbytes as bulk_copy's."""
    size, args = _bulk_size(dst, src, mbar, nbytes)
    cute.arch.inline_ptx(
        "{ .reg .b16 msk; mov.b16 msk, 0xFF;"
        " cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        f" [{{$r0}}], [{{$r1}}], {size}, [{{$r2}}], msk; }}",
        read_only_args=args,
    )

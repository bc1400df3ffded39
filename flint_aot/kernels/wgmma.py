"""wgmma.m64nNk16, the warpgroup MMA of sm_90a, as the 32- and 64-token qkv kernels use it (docs/kernels.md
§2.6).

A warpgroup (the CTA's 4 warps, warp w the rows 16 w .. 16 w + 15) adds exactly what mma.sync adds given the
same A fragments, k permutation and order (benchmarks/wgmma_probe: every sum of six inputs bit-identical),
and reuses each A fragment for N tokens. A: this thread's mma.sync A registers (wgmma_rs), or a K-major tile
in shared memory without swizzle (core matrices of 8 rows x 16 B, wgmma_ss); B (x): the ring's K-major tiles
with the 128-byte swizzle (loader.abi.WG_STRIDES). Each statement is inline PTX with side effects, so none
is reordered against the others.
"""

from __future__ import annotations

from cutlass import Float32, Int64
from cutlass._mlir.dialects import llvm

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

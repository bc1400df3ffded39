"""The MMA fragments of the GEMV kernels (the fused qkv kernel and the standalone GEMV): tensor-core MMAs
(mma.sync m16n8k16, bf16 in, fp32 accumulate) of weight rows (MMA-M, 16 per warp) and tokens (MMA-N, groups
of 8), the loads that feed them, where x comes from, and the one summation order (docs/numerics.md §2).

K split and summation order (fixed, so every kernel built on it rounds the same sums, whatever M and tile):
* one warp's unit is 16 rows x one K quarter [Q q, Q q + Q), Q = K / 4 (512 at hidden 2048), Q / 32 blocks
  of 32 k; in block b, lane (g, t) = (lane / 4, lane % 4) holds the 8 consecutive k in [Q q + 32 b + 8 t,
  +8) of rows g and g + 8 (one 16-byte load each) and of token g (x). Those 8 k feed two mma.sync (pairs
  0,1 then pairs 2,3: a K permutation, the same for A and B, so the dot product is unchanged);
* the unit accumulates its Q / 16 mma in two chains, one per MMA of the block (acc[0], acc[1]), in block
  order and adds the two chains; the four quarters' partial sums are added in quarter order 0, 1, 2, 3
  (sum_quarters).
Each token is an MMA column of its own, so its sum is the same in any tile and either CTA shape. NVFP4 weights
(fp4.py) keep the unit and the order with another k order inside it.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm

from flint_aot.kernels.device import lanes
from loader.abi import ROWS_PER_CTA, tile8_row

ROWS = ROWS_PER_CTA
THREADS = 128
WARPS = THREADS // 32


def steps(k: int) -> int:
    """32-wide k blocks of one warp's K quarter at hidden size k (16 at 2048): BF16's loads of a row, NVFP4's
    code words of a row, the MMA steps of either."""
    return k // 32 // WARPS


def ld_weight(ptr):
    """16 bytes of weights: read once, never written by a predecessor -> non-coherent path, no L1 allocation,
    128-byte L2 fetch (faster for BF16 than the 256-byte hint, the same for NVFP4: docs/kernels.md §2.2)."""
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


def issue_weight_loads(w, row0, tid, k, kq=None):
    """Issue all of this thread's weight loads (2 x steps(k) x 16 B) of rows row0 + g and + 8 of hidden size k
    in K quarter kq (default: the warp's); returns [(lo, hi)] per k block."""
    warp, _, g, t = lanes(tid)
    kq = warp if kq is None else kq
    nb = steps(k)
    wa = w + ((row0 + g) * k + kq * (nb * 32) + t * 8)
    return [(ld_weight(wa + b * 32), ld_weight(wa + (8 * k + b * 32))) for b in range(nb)]


def ld_shared(ptr):
    return cute.arch.inline_ptx(
        "ld.shared.v4.u32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Int32] * 4,
        read_only_args=[ptr],
    )


def ld_shared_f32x4(ptr):
    """4 fp32 of shared memory at a 16-byte aligned pointer."""
    return [as_f32(v) for v in ld_shared(ptr)]


def smem_row(fp4: bool, k: int) -> int:
    """Row stride (elements) of x of all K staged in shared memory (SharedX: the 8-token qkv kernel), padded
    against bank conflicts (loader.abi.tile8_row)."""
    return tile8_row("nvfp4" if fp4 else "bf16", k)


class SharedX:
    """x rows staged in this CTA's shared memory (row stride `row` elements) by bulk copies: all of K for the
    8-token kernels (the cluster's multicast copy), a group's K quarter in the token stream's ring; `ready()`
    waits on their mbarrier (None: the caller has waited). Passed instead of the global x pointer, it changes
    where the fragments come from, not the MMA sequence: results stay bit-identical."""

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


def x_loads(x, tok, ks, k):
    """16-byte x fragments at token tok and element offsets ks: global loads (rows of k elements), or shared
    once staged (wgmma tiles: indexed by MMA step, the tiles holding each step's k in fp4_x_k's order)."""
    if isinstance(x, TiledX):
        return x
    if isinstance(x, SharedX):
        x.ready()
        return [x.load(tok, c) for c in ks]
    xa = x + tok * k
    return [ld_act(xa + c) for c in ks]


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
    columns 2t, 2t + 1), d2/d3 = (row g + 8, the same columns). A from issue_weight_loads (its length, the
    quarter's blocks, gives the hidden size k); x bf16 rows of k (global) or a SharedX; tok: the row of x this
    lane's column g reads (columns past the last token repeat it and are never stored); kx: x's element
    offset of the quarter (default: the warp's, warp * k / 4)."""
    warp, _, g, t = lanes(tid)
    nb = len(A)
    kx = warp * (nb * 32) if kx is None else kx
    X = x_loads(x, tok, [bf16_x_k(t, b, kx) for b in range(nb)], nb * 32 * WARPS)
    z = as_f32(zero)
    acc = [[z, z, z, z], [z, z, z, z]]
    for b in range(nb):
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

"""The GEMV core shared by the fused qkv kernel and the standalone GEMV: 16 output rows per CTA of 128
threads, all M <= 8 tokens, fp32 accumulation on tensor cores (mma.sync m16n8k16, bf16 in, fp32 out).

K split and summation order (fixed, so every kernel built on it rounds the same sums):
* warp w owns k in [512 w, 512 w + 512) as 16 blocks of 32; in block b, lane (g, t) = (lane / 4, lane % 4)
  holds the 8 consecutive k in [512 w + 32 b + 8 t, +8) of rows g and g + 8 (one 16-byte load each) and
  of token g (x). Those 8 k feed two mma.sync (pairs 0,1 then pairs 2,3: a K permutation, the same for A
  and B, so the dot product is unchanged).
* each warp accumulates its 32 mma in one chain per 16-wide half (acc[b % 2]) in block order, adds the two
  chains, and the four warps' partial sums are added in warp order 0, 1, 2, 3 through shared memory.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm

K = 2048
ROWS = 16
THREADS = 128
WARPS = THREADS // 32
NB = K // 32 // WARPS  # 32-wide k blocks per warp
MAX_M = 8


def ld_weight(ptr):
    """16 bytes of weights: read once, never written by a predecessor -> non-coherent path, no L1 allocation,
    256-byte L2 fetch."""
    return cute.arch.inline_ptx(
        "ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
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
    warp = tid // 32
    lane = tid % 32
    g = lane // 4
    t = lane % 4
    wa = w + ((row0 + g) * K + warp * (NB * 32) + t * 8)
    return [(ld_weight(wa + b * 32), ld_weight(wa + (8 * K + b * 32))) for b in range(NB)]


def runtime_zero(regs, m):
    """An Int32 that is 0 at run time (m >= 1) but depends on every register in regs, so ptxas must issue
    every load before anything that uses it (it otherwise sinks loads next to their use, and may move
    griddepcontrol.wait above .nc loads)."""
    f = regs[0]
    for r in regs[1:]:
        f = f ^ r
    return f & (m >> 31)


def mma_partials(A, x, m, tid, zero):
    """This warp's partial sums for its K quarter: [d0, d1, d2, d3] with d0/d1 = (row g, tokens 2t, 2t+1),
    d2/d3 = (row g + 8, tokens 2t, 2t+1). A from issue_weight_loads; x bf16 [m, K] (tokens >= m read token
    m - 1; their columns are never stored)."""
    warp = tid // 32
    lane = tid % 32
    g = lane // 4
    t = lane % 4
    tok = cutlass.min(g, m - 1)
    xa = x + (tok * K + warp * (NB * 32) + t * 8)
    X = [ld_act(xa + b * 32) for b in range(NB)]
    z = as_f32(zero)
    acc = [[z, z, z, z], [z, z, z, z]]
    for b in range(NB):
        lo, hi = A[b]
        for j in range(2):
            c = acc[j]
            acc[j] = list(mma_bf16((lo[2 * j], hi[2 * j], lo[2 * j + 1], hi[2 * j + 1]),
                                   (X[b][2 * j], X[b][2 * j + 1]), c))  # fmt: skip
    return [acc[0][i] + acc[1][i] for i in range(4)]


def reduce_rows(d, tid, red):
    """Cross-warp sum in warp order. red: smem fp32 tensor of WARPS*ROWS*8. After the call (it syncs the CTA)
    thread i < ROWS*8 gets the full sum for row i % 16, token i // 16."""
    warp = tid // 32
    lane = tid % 32
    g = lane // 4
    t = lane % 4
    base = warp * (ROWS * 8) + g * 8 + 2 * t
    red[base] = d[0]
    red[base + 1] = d[1]
    red[base + 64] = d[2]
    red[base + 65] = d[3]
    cute.arch.sync_threads()
    r = tid % ROWS
    tk = tid // ROWS
    s = red[r * 8 + tk]
    for q in range(1, WARPS):
        s = s + red[q * (ROWS * 8) + r * 8 + tk]
    return s

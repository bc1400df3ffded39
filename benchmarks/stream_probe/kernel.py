"""The stream probe: y[8, N] = x[8, K] . W^T in BF16 for K quarters longer than a lane's registers hold (the
8-token GEMV's layout and summation order, flint_aot/kernels/mma.py), with a register ring: a lane keeps
`depth` k blocks of its two rows in flight and issues block b + depth as soon as block b's MMAs have read
it. mode "load" issues exactly the same loads and only folds them (xor) into one word per lane: the bare
stream of the same bytes, the bound of the ring. x (8 rows) is staged in shared memory once per CTA. No PDL
wait before the first weights (the probe has no producer to wait for; it releases its dependents).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot import Kernel
from flint_aot.kernels.device import bulk_copy, lanes
from flint_aot.kernels.mma import (
    SharedX,
    as_f32,
    bf16_x_k,
    ld_weight,
    mma_bf16,
    reduce_rows,
    runtime_zero,
    steps,
)
from stream_probe.abi import PAD, ROWS, smem_bytes

THREADS = 128
WARPS = THREADS // 32


class StreamProbe(Kernel):
    block = (THREADS, 1, 1)

    def __init__(self, spec: dict):
        self.k, self.depth, self.mode = spec["k"], spec["depth"], spec["mode"]
        self.stride = self.k + spec.get("pad", 0)  # the weight rows' stride (elements): pad > 0 tests strides
        assert self.k % 512 == 0 and self.mode in ("load", "ring"), spec
        self.nb = steps(self.k)
        self.depth = min(self.depth, self.nb)
        # smem_kb > the x rows' bytes: more dynamic shared memory than the kernel uses, to hold the CTAs an SM
        # down (the rest of the 256 KB is L1)
        self.dyn_smem = max(smem_bytes(self.k), spec.get("smem_kb", 0) * 1024)
        self.min_ctas_per_sm = spec.get("ctas", 3)
        self.xrow = self.k + PAD

    @cute.kernel
    def kernel(self, x: cute.Pointer, w: cute.Pointer, y: cute.Pointer, m: Int32, n: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        wa, A = self.first_loads(w, cta, tid)
        xs = cute.arch.get_dyn_smem(BFloat16, alignment=128)
        self.stage_x(x, xs, m, tid)
        if cutlass.const_expr(self.mode == "load"):
            acc = self.fold(wa, A)
            yt = cute.make_tensor(cute.recast_ptr(y, dtype=Int32), cute.make_layout(1 << 30))
            if acc == 0x7FFFFFFF:  # (never at run time for random weights: keeps the loads)
                yt[cta * THREADS + tid] = acc
        else:
            s = self.ring(wa, A, xs, m, tid)
            tk = tid // ROWS
            if tk < m:
                yt = cute.make_tensor(y + (tk * n + cta * ROWS), cute.make_layout(ROWS))
                yt[tid % ROWS] = s.to(BFloat16)

    def first_loads(self, w, cta, tid):
        """This lane's rows g, g + 8 of the CTA's block, its warp's K quarter: the first `depth` blocks."""
        warp, _, g, t = lanes(tid)
        nb = self.nb
        wa = w + ((cta * ROWS + g) * self.stride + warp * (nb * 32) + t * 8)
        return wa, [self.block_loads(wa, b) for b in range(self.depth)]

    def block_loads(self, wa, b):
        return ld_weight(wa + b * 32), ld_weight(wa + (8 * self.stride + b * 32))

    def fold(self, wa, A):
        """mode load: every block's words xor-ed into one, block b + depth issued after block b is read."""
        acc = Int32(0)
        for b in range(self.nb):
            lo, hi = A[b % self.depth]
            for v in (*lo, *hi):
                acc = acc ^ v
            if b + self.depth < self.nb:
                A[b % self.depth] = self.block_loads(wa, b + self.depth)
        return acc

    def ring(self, wa, A, xs, m, tid):
        """mode ring: the 8-token GEMV's MMAs in block order (two chains), block b + depth issued after block
        b's MMAs; then the quarters' sum (thread tid: row tid % 16, token tid // 16)."""
        warp, _, g, t = lanes(tid)
        sx = SharedX(xs, self.xrow, None)
        tok = cutlass.min(g, m - 1)
        z = as_f32(runtime_zero([A[0][0][0]], m))
        accs = [[z, z, z, z], [z, z, z, z]]
        kx = warp * (self.nb * 32)
        for b in range(self.nb):
            lo, hi = A[b % self.depth]
            xv = sx.load(tok, bf16_x_k(t, b, kx))
            for j in range(2):
                accs[j] = list(mma_bf16((lo[2 * j], hi[2 * j], lo[2 * j + 1], hi[2 * j + 1]),
                                        (xv[2 * j], xv[2 * j + 1]), accs[j]))  # fmt: skip
            if b + self.depth < self.nb:
                A[b % self.depth] = self.block_loads(wa, b + self.depth)
        d = [accs[0][i] + accs[1][i] for i in range(4)]
        red = cute.make_tensor(cute.arch.alloc_smem(Float32, WARPS * ROWS * 8, alignment=16),
                               cute.make_layout(WARPS * ROWS * 8))  # fmt: skip
        return reduce_rows(d, tid, red)

    @cute.jit
    def stage_x(self, x, xs, m, tid):
        """x's m rows (m <= 8) into shared memory, padded rows: one bulk copy a row by thread 0 (as the GEMV
        kernels stage x), every thread waiting on their mbarrier."""
        mbx = cute.arch.alloc_smem(Int64, 1, alignment=8)
        if tid == 0:
            cute.arch.mbarrier_init(mbx, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.mbarrier_arrive_and_expect_tx(mbx, m * (self.k * 2))
            for r in cutlass.range(m, unroll=1):
                bulk_copy(xs + r * self.xrow, x + r * self.k, mbx, self.k * 2)
        cute.arch.sync_threads()
        cute.arch.mbarrier_wait(mbx, 0)


KERNEL = StreamProbe

"""Standalone GEMV (the unfused path, docs/numerics.md §2): y[M, N] = bf16(x[M, 2048] · Wᵀ), BF16 or NVFP4 W.

One CTA of 128 threads per 16 rows, no cluster, M up to the token tile (8 or 16); the CTA's GEMV is
gemv_core.CtaGemv, the very code of the fused qkv kernel, so y is bit-identical to the fused kernel's qkv
values. PDL: releases its dependents at entry, streams its weights, then waits for the producer of x. Row
offsets are 32-bit: N <= loader.abi.MAX_GEMV_ROWS (the loader checks it)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot.kernels import device
from flint_aot.kernels import gemv_core as core
from flint_aot.kernels.compile import Kernel


class GemvKernel(Kernel):
    """The standalone GEMV of one specialization: weight format and token tile, set once. Tile 16 stages x
    (m rows) in dynamic shared memory by bulk copies, as the fused kernel does: read from global memory, the
    fragments of 16 tokens would not fit beside the weights in the registers of 3 CTAs per SM."""

    kind, block = "gemv", (core.THREADS, 1, 1)

    def __init__(self, spec: dict):
        self.fp4 = spec["weight_format"] == "nvfp4"
        self.tile = spec.get("max_m", 8)
        self.gemv = core.CtaGemv(self.fp4, self.tile, core.FP4_PRE_GEMV)
        self.xrow = core.smem_row(self.fp4)
        self.dyn_smem_per_m = self.xrow * 2 if self.tile > 8 else 0
        self.min_ctas_per_sm = 3 if self.tile > 8 else 0

    @cute.kernel
    def kernel(self, x: cute.Pointer, weight: cute.Pointer, weight_scale: cute.Pointer,
               global_scale: cute.Pointer, y: cute.Pointer, m: Int32, n: Int32):  # fmt: skip
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.tile > 8):
            xs = cute.arch.get_dyn_smem(BFloat16, alignment=128)
            mbx = cute.arch.alloc_smem(Int64, 1, alignment=8)
            self.expect_rows(tid, m, mbx)
            copy = lambda: self.copy_rows(tid, m, x, xs, mbx)  # noqa: E731
            st = self.gemv.start(weight, weight_scale, global_scale, cta * core.ROWS, tid, m,
                                 issued=None if self.fp4 else copy)  # fmt: skip
            if cutlass.const_expr(self.fp4):
                copy()
            sums = self.gemv.sums(st, core.SharedX(xs, self.xrow, mbx), m, tid)
        else:
            st = self.gemv.start(weight, weight_scale, global_scale, cta * core.ROWS, tid, m)
            sums = self.gemv.sums(st, x, m, tid)
        for i in cutlass.range_constexpr(len(sums)):
            self.store(y, sums[i], tid // core.ROWS + 8 * i if i else tid // core.ROWS, tid, cta, m, n)

    @cute.jit
    def expect_rows(self, tid, m, mbx):
        """The mbarrier the x rows arrive on, expecting m rows."""
        if tid == 0:
            cute.arch.mbarrier_init(mbx, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.mbarrier_arrive_and_expect_tx(mbx, m * (core.K * 2))
        cute.arch.sync_threads()

    @cute.jit
    def copy_rows(self, tid, m, x, xs, mbx):
        """Threads tid < m wait for the producer of x themselves and bulk-copy row tid into shared memory."""
        if tid < m:
            cute.arch.griddepcontrol_wait()
            device.bulk_copy(xs + tid * self.xrow, x + tid * core.K, mbx, core.K * 2)

    @cute.jit
    def store(self, y, s, tk, tid, cta, m, n):
        """y[tk, 16 cta + tid % 16] = bf16(s), for tokens tk < m."""
        if tk < m:
            yt = cute.make_tensor(y + (tk * n + cta * core.ROWS), cute.make_layout(core.ROWS))
            yt[tid % core.ROWS] = s.to(BFloat16)

    def ptr_types(self) -> dict:
        """Element type and assumed alignment (bytes) of the pointers that are not bf16 16-byte aligned."""
        t = {"weight_scale": (cutlass.Uint8, 4), "global_scale": (Float32, 4)}
        if self.fp4:
            t["weight"] = (cutlass.Uint8, 16)
        return t


KERNEL = GemvKernel

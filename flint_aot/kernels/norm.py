"""Input RMSNorm for K = 2048 (docs/numerics.md §1, docs/kernels.md §1): `rms_norm` and `fused_add_rms_norm`.

One CTA of 256 threads per token row; each thread owns 8 consecutive elements (one 16-byte load per operand).
The kernel releases its PDL dependents at its very start, so the qkv GEMV behind it can start streaming its
weights at once, and waits (griddepcontrol.wait) before it reads x or the residual, so it may itself be
launched as a PDL dependent of whatever wrote them. The arithmetic is device.norm_*: the qkv kernel's
prologue variant rounds exactly the same way.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from flint_aot.kernels import device
from flint_aot.kernels.compile import Kernel
from flint_aot.kernels.device import NORM_CHUNKS, NORM_VEC, NORM_WARPS
from loader.abi import HIDDEN

THREADS = NORM_CHUNKS  # one thread per 8-element chunk
import os
TPC = int(os.environ.get("FLINT_NORM_TPC", "0"))  # DIAG: 0 = a CTA per token; T > 0: a warp per token, T a CTA


class NormKernel(Kernel):
    """The input norm of one specialization: residual on/off (and a debug build's spin), set once."""

    kind, block = "norm", ((THREADS if TPC == 0 else 32 * TPC), 1, 1)
    grid = None if TPC in (0, 1) else ("M8", 1, 1)

    def __init__(self, spec: dict):
        self.residual = bool(spec["residual"])
        # > 0: a debug kernel that busy-waits this many clock cycles before writing its outputs (a slow
        # producer, used to prove that a dependent kernel waits for it)
        self.spin = int(spec.get("debug_spin_cycles", 0))

    @cute.kernel
    def kernel(
        self,
        x: cute.Pointer,
        residual: cute.Pointer,
        residual_out: cute.Pointer,
        xn: cute.Pointer,
        weight: cute.Pointer,
        eps: Float32,
        m: cutlass.Int32,
    ):
        if cutlass.const_expr(TPC > 0):
            self.warp_rows(x, residual, residual_out, xn, weight, eps, m)
        else:
            self.cta_row(x, residual, residual_out, xn, weight, eps)

    @cute.jit
    def warp_rows(self, x, residual, residual_out, xn, weight, eps, m):
        """A warp per token: lane l holds the chunks 32 j + l (j = 0..7) of virtual warp j; the 8 virtual warps'
        butterflies and their sum in warp order are the CTA kernel's, so the bits are the same."""
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp, lane, _, _ = device.lanes(tid)
        cute.arch.griddepcontrol_launch_dependents()
        row = cta * TPC + warp
        offs = [cute.assume((32 * j + lane) * NORM_VEC, divby=NORM_VEC) for j in range(NORM_WARPS)]
        w = [device.load_vec(weight + o, NORM_VEC) for o in offs]
        cute.arch.griddepcontrol_wait()
        if row < m:
            base = cute.assume(row * HIDDEN, divby=HIDDEN)
            xs = [device.load_vec(x + (base + o), NORM_VEC) for o in offs]
            rs = [device.load_vec(residual + (base + o), NORM_VEC) for o in offs] if cutlass.const_expr(
                self.residual) else [None] * NORM_WARPS
            rr, sums = [], []
            for j in cutlass.range_constexpr(NORM_WARPS):
                r, ss = device.norm_residual(xs[j], rs[j])
                rr.append(r)
                sums.append(ss)
            sums = [cute.arch.warp_reduction_sum(v) for v in sums]
            s = device.norm_scale(sums, eps)
            for j in cutlass.range_constexpr(NORM_WARPS):
                device.store_vec(xn + (base + offs[j]), device.norm_apply(rr[j], s, w[j]), NORM_VEC)
                if cutlass.const_expr(self.residual):
                    device.store_vec(residual_out + (base + offs[j]), rr[j].to(cutlass.BFloat16), NORM_VEC)

    @cute.jit
    def cta_row(self, x, residual, residual_out, xn, weight, eps):
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp, lane, _, _ = device.lanes(tid)
        cute.arch.griddepcontrol_launch_dependents()
        off = cute.assume(row * HIDDEN + tid * NORM_VEC, divby=NORM_VEC)
        w = device.load_vec(weight + tid * NORM_VEC, NORM_VEC)  # a model constant: read before the wait
        cute.arch.griddepcontrol_wait()
        res = device.load_vec(residual + off, NORM_VEC) if cutlass.const_expr(self.residual) else None
        r, ss = device.norm_residual(device.load_vec(x + off, NORM_VEC), res)
        ss = cute.arch.warp_reduction_sum(ss)
        red = cute.make_tensor(cute.arch.alloc_smem(Float32, NORM_WARPS, alignment=16),
                               cute.make_layout(NORM_WARPS))  # fmt: skip
        if lane == 0:
            red[warp] = ss
        cute.arch.sync_threads()
        y = device.norm_apply(r, device.norm_scale([red[i] for i in range(NORM_WARPS)], eps), w)
        if cutlass.const_expr(self.spin > 0):
            device.spin_cycles(self.spin)
        device.store_vec(xn + off, y, NORM_VEC)
        if cutlass.const_expr(self.residual):
            device.store_vec(residual_out + off, r.to(cutlass.BFloat16), NORM_VEC)


KERNEL = NormKernel

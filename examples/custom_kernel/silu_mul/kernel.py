"""SiLU-and-mul, the gated MLP's activation: out[M, I] = silu(gate) * up for x = [M, 2*I] bf16, gate =
x[:, :I], up = x[:, I:], written as a flint-aot plugin kernel (flint_aot.Kernel).

Each thread owns VEC = 8 consecutive columns of one row: one 16-byte load of gate, one of up, fp32 math
(silu(g) = g / (1 + exp(-g))), one bf16 rounding of silu(g) * u, one 16-byte store. A CTA of THREADS threads
covers COLS_PER_CTA columns of row blockIdx.y. PDL: the kernel releases its dependents at entry and waits for
its predecessor before it reads x (everything it reads is per-call input).

Extents are the kernel's to check (docs/plugins.md §3): the grid may be larger than the data, so a CTA whose
row is >= m and a thread whose columns start at or beyond I do nothing. I is a compile-time axis (a multiple
of VEC, so every 16-byte access stays inside its row); m is a run-time parameter.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot import Kernel
from silu_mul.abi import COLS_PER_CTA, THREADS, VEC


def _vec(ptr):
    """The VEC elements at a 16-byte aligned pointer, as fp32 (one 16-byte load)."""
    src = cute.make_tensor(ptr, cute.make_layout(VEC))
    r = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
    cute.autovec_copy(src, r)
    return r.load().to(Float32)


class SiluMulKernel(Kernel):
    """One specialization: the intermediate size I (the spec's `intermediate`)."""

    block = (THREADS, 1, 1)

    def __init__(self, spec: dict):
        unknown = sorted(set(spec) - {"intermediate"})
        if unknown:
            raise ValueError(f"unknown spec key(s) {unknown}; SiluMulKernel takes: intermediate")
        i = spec["intermediate"]
        if isinstance(i, bool) or not isinstance(i, int) or i <= 0 or i % VEC or 2 * i >= 1 << 31:
            raise ValueError(f"intermediate must be a positive multiple of {VEC} below 2**30, got {i!r}")
        self.intermediate = i

    @cute.kernel
    def kernel(self, x: cute.Pointer, out: cute.Pointer, m: Int32):
        tid, _, _ = cute.arch.thread_idx()
        bx, row, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()  # x may be the previous kernel's output
        i = self.intermediate
        col = bx * COLS_PER_CTA + tid * VEC
        if row < m and col < i:
            src = cute.assume(Int64(row) * (2 * i) + Int64(col), divby=VEC)
            g = _vec(x + src)
            u = _vec(x + cute.assume(src + i, divby=VEC))
            y = g / (Float32(1.0) + cute.math.exp(Float32(0.0) - g, fastmath=True)) * u
            r = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
            r.store(y.to(BFloat16))
            dst = cute.assume(Int64(row) * i + Int64(col), divby=VEC)
            cute.autovec_copy(r, cute.make_tensor(out + dst, cute.make_layout(VEC)))


KERNEL = SiluMulKernel

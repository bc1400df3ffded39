"""Standalone GEMV (the unfused path, docs/numerics.md §2): y[M, N] = bf16(x[M, 2048] · Wᵀ), BF16 or NVFP4 W.

One CTA of 128 threads per 16 rows, no cluster; the CTA's GEMV is gemv_core.weights_then_wait +
gemv_core.row_sums, the very functions of the fused qkv kernel, so y is bit-identical to the fused kernel's
qkv values. PDL: releases its dependents at entry, streams its weights, then waits for the producer of x.
Row offsets are 32-bit: N <= loader.abi.MAX_GEMV_ROWS (the loader checks it)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from flint_aot.kernels import gemv_core as core
from flint_aot.kernels.compile import compile_kernel


def make_kernel(weight_format: str):
    fp4 = weight_format == "nvfp4"

    @cute.kernel
    def gemv(x: cute.Pointer, weight: cute.Pointer, weight_scale: cute.Pointer, global_scale: cute.Pointer,
             y: cute.Pointer, m: Int32, n: Int32):  # fmt: skip
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        st = core.weights_then_wait(fp4, weight, weight_scale, global_scale, cta * core.ROWS, tid, m)
        s = core.row_sums(fp4, st, x, m, tid)
        tk = tid // core.ROWS
        if tk < m:
            yt = cute.make_tensor(y + (tk * n + cta * core.ROWS), cute.make_layout(core.ROWS))
            yt[tid % core.ROWS] = s.to(BFloat16)

    return gemv


def kernel(spec: dict):
    return make_kernel(spec["weight_format"])


def ptr_types(spec: dict) -> dict:
    """Element type and assumed alignment (bytes) of the pointers that are not bf16 16-byte aligned."""
    t = {"weight_scale": (cutlass.Uint8, 4), "global_scale": (Float32, 4)}
    if spec["weight_format"] == "nvfp4":
        t["weight"] = (cutlass.Uint8, 16)
    return t


def compile(spec: dict, arch: str, entry_prefix: str):
    return compile_kernel(kernel(spec), kind="gemv", arch=arch, entry_prefix=entry_prefix,
                          block=(core.THREADS, 1, 1), ptr_types=ptr_types(spec))  # fmt: skip

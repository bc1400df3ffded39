"""Standalone GEMV (the unfused path, SPEC §3.2): y[M, N] = bf16(x[M, 2048] · Wᵀ), BF16 or NVFP4 W.

One CTA of 128 threads per 16 rows, no cluster; the CTA's GEMV is gemv.weights_then_wait + gemv.row_sums,
the very functions of the fused qkv kernel, so y is bit-identical to the fused kernel's qkv values. PDL:
releases its dependents at entry, streams its weights, then waits for the producer of x."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from flint_aot.kernels import common, gemv

PARAMS = (
    ("x", "ptr"),
    ("weight", "ptr"),
    ("weight_scale", "ptr"),
    ("global_scale", "ptr"),
    ("y", "ptr"),
    ("m", "i32"),
    ("n", "i32"),
)


def make_kernel(weight_format: str, entry_prefix: str):
    fp4 = weight_format == "nvfp4"

    @cute.kernel
    def gemv_k(x: cute.Pointer, w: cute.Pointer, wsc: cute.Pointer, gsc: cute.Pointer, y: cute.Pointer,
               m: Int32, n: Int32):  # fmt: skip
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        st = gemv.weights_then_wait(fp4, w, wsc, gsc, cta * gemv.ROWS, tid, m)
        s = gemv.row_sums(fp4, st, x, m, tid)
        tk = tid // gemv.ROWS
        if tk < m:
            yt = cute.make_tensor(y + (tk * n + cta * gemv.ROWS), cute.make_layout(gemv.ROWS))
            yt[tid % gemv.ROWS] = s.to(BFloat16)

    gemv_k.set_name_prefix(entry_prefix, remove_cutlass_symbol=True, keep_mangled_name=False)

    @cute.jit
    def host(x: cute.Pointer, w: cute.Pointer, wsc: cute.Pointer, gsc: cute.Pointer, y: cute.Pointer,
             m: Int32, n: Int32, stream):  # fmt: skip
        gemv_k(x, w, wsc, gsc, y, m, n).launch(
            grid=[n // gemv.ROWS, 1, 1], block=[gemv.THREADS, 1, 1], use_pdl=True, stream=stream
        )

    return host


def compile(spec: dict, arch: str, entry_prefix: str) -> common.Compiled:
    fmt = spec["weight_format"]
    host = make_kernel(fmt, entry_prefix)
    dtypes = {"weight_scale": cutlass.Uint8, "global_scale": Float32}
    if fmt == "nvfp4":
        dtypes["weight"] = cutlass.Uint8
    args = common.fake_args(PARAMS, BFloat16, dtypes)
    return common.compile_host(
        host, args, arch=arch, params=PARAMS, block=(gemv.THREADS, 1, 1), cluster=(1, 1, 1),
        grid=("ROW_BLOCKS", 1, 1), dyn_smem=0,
    )  # fmt: skip

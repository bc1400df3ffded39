"""Device helpers shared by the kernels, and the offline compile step (imports the DSL)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.runtime import make_fake_stream, make_ptr


@dataclass
class Compiled:
    cubin: bytes
    ptx: str
    entry: str
    params: tuple  # ((name, type), ...)
    block: tuple
    cluster: tuple
    grid: tuple
    dyn_smem: int


def fake_args(params, ptr_dtype, ptr_dtypes=None):
    """Placeholder host arguments matching a (name, type) parameter list; values are irrelevant.
    Pointers are 16-byte aligned, of ptr_dtypes.get(name, ptr_dtype)."""
    out = []
    for i, (name, typ) in enumerate(params):
        if typ == "ptr":
            dt = (ptr_dtypes or {}).get(name, ptr_dtype)
            out.append(make_ptr(dt, 0x10000 * (i + 1), cute.AddressSpace.gmem, assumed_align=16))
        elif typ == "i32":
            out.append(Int32(1))
        elif typ == "i64":
            out.append(Int64(1))
        elif typ == "f32":
            out.append(Float32(1e-6))
        else:
            raise ValueError(typ)
    out.append(make_fake_stream())
    return out


def compile_host(host, args, *, arch, params, block, cluster, grid, dyn_smem) -> Compiled:
    with tempfile.TemporaryDirectory(prefix="flint-aot-dsl-") as d:
        c = cute.compile(host, *args, options=f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {d}")
        cubin, ptx = c.artifacts.CUBIN, c.artifacts.PTX
    names = list(c.kernel_info)
    if len(names) != 1:
        raise RuntimeError(f"expected one kernel in the compile, got {names}")
    return Compiled(cubin, ptx, names[0], tuple(params), block, cluster, grid, dyn_smem)


# ----------------------------------------------------------------------------- device helpers
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


@cute.jit
def spin_cycles(n: cutlass.Constexpr):
    t0 = cute.arch.clock64()
    t = t0
    while t - t0 < Int64(n):
        t = cute.arch.clock64()


__all__ = ["BFloat16", "Float32", "Int32", "Int64", "cutlass"]

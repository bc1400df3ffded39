"""Offline compile of one kernel to a cubin (imports the DSL; runs in the compile subprocess).

A kernel's parameter list is its @cute.kernel function's signature, written once: compile_kernel reads the
names and types from it (kernel_params), records them in the manifest with the alignment each pointer is
compiled to assume (the ABI the loader fills by name, and checks tensors against), and builds the DSL host
function and placeholder arguments from it. Only flat parameters are used: global
pointers and Int32 / Int64 / Float32 scalars, each one .param with natural alignment, in signature order.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.runtime import make_fake_stream, make_ptr

from flint_aot.kernels.diagnostics import SERVING
from loader.abi import GRID
from loader.elf import CubinError, read_cubin
from loader.manifest import cluster_policy_problem

_C_TYPE = {cute.Pointer: "ptr", Int32: "i32", Int64: "i64", Float32: "f32"}
_PTR = (BFloat16, 16)  # a pointer's element type and assumed alignment unless the kernel's ptr_types say else


@dataclass
class Compiled:
    cubin: bytes
    ptx: str
    entry: str
    params: tuple  # ((name, C type, alignment the kernel assumes of a pointer, 0 for a scalar), ...)
    block: tuple
    cluster: tuple
    grid: tuple
    dyn_smem: int
    cluster_policy: str = ""


class Kernel:
    """The public base class of every kernel kind, built-in or a plugin (`flint_aot.Kernel`, docs/plugins.md):
    one specialization, its compile-time configuration set once, in __init__, from the spec's values (a
    plugin's `__init__(spec)`; a built-in kind's `__init__(spec, arch, diag)`, which also knows the
    architecture and the build's diagnostics); `kernel` (a @cute.kernel method) is the flat parameter list
    the manifest records by name."""

    kind = ""  # a built-in kind's name (its grid rule, loader.abi.GRID); plugins leave it empty
    block: tuple = (128, 1, 1)  # baked into the cubin (.reqntid): every launch uses exactly this block
    cluster: tuple = (1, 1, 1)  # a launch attribute, recorded in the manifest
    grid: tuple | None = None  # a built-in specialization's grid rule (abi.GRID_SYMBOLS); None: the kind's
    dyn_smem = 0  # dynamic shared memory the kernel may use (bytes): the loader allows launches up to it
    min_ctas_per_sm = 0  # > 0: ptxas keeps the registers within what this many CTAs per SM leave
    # the clusters' scheduling policy, a launch attribute recorded in the manifest: "" (the driver's default),
    # "spread" or "load_balancing" (loader.manifest.CLUSTER_POLICIES)
    cluster_policy = ""
    arch = ""  # the architecture compiled for (a built-in kind's __init__ sets it; else compile does)
    diag = SERVING  # a built-in kind's diagnostics (kernels/diagnostics.py)

    def ptr_types(self) -> dict:
        """Element type and assumed alignment (bytes) of the pointers that are not bf16 16-byte aligned."""
        return {}

    def entry_point(self):
        """The @cute.kernel to compile (default: `kernel`)."""
        return self.kernel

    def compile(self, arch: str, entry_prefix: str, grid: tuple | None = None) -> Compiled:
        """The cubin for arch; grid: the manifest's grid rule (default: the built-in kind's)."""
        if self.arch and self.arch != arch:
            raise ValueError(f"this {type(self).__name__} was made for {self.arch}, not {arch}")
        self.arch = arch
        policy = self.cluster_policy
        if self.diag.cluster_policy and tuple(self.cluster) != (1, 1, 1):  # (a diagnostic A/B build)
            policy = "" if self.diag.cluster_policy == "default" else self.diag.cluster_policy
        return compile_kernel(self.entry_point(), kind=self.kind, arch=arch, entry_prefix=entry_prefix,
                              block=self.block, cluster=self.cluster, ptr_types=self.ptr_types(),
                              dyn_smem=self.dyn_smem, min_ctas_per_sm=self.min_ctas_per_sm,
                              grid=grid or self.grid, cluster_policy=policy)  # fmt: skip


def kernel_params(kernel, ptr_types: dict | None = None) -> tuple[tuple[str, str, int], ...]:
    """(name, C type, alignment) of each parameter of a @cute.kernel function, in order: the kernel's ABI.
    A pointer's alignment is the one it is compiled to assume (ptr_types: name -> (dtype, alignment), default
    (BFloat16, 16)); a scalar's is 0."""
    out = []
    for name, p in inspect.signature(kernel, eval_str=True).parameters.items():
        typ = _C_TYPE.get(p.annotation)
        if typ is None:
            raise TypeError(
                f"{kernel.__name__}({name}): {p.annotation!r} is not a flat parameter type the loader packs "
                "(cute.Pointer, Int32, Int64, Float32)"
            )
        out.append((name, typ, (ptr_types or {}).get(name, _PTR)[1] if typ == "ptr" else 0))
    return tuple(out)


def _placeholders(params, ptr_types: dict):
    """Host arguments matching the parameter list; values are irrelevant, pointer element types and assumed
    alignments are not: ptr_types maps a pointer's name to (dtype, alignment), default (BFloat16, 16)."""
    out = []
    for i, (name, typ, _) in enumerate(params):
        if typ == "ptr":
            dtype, align = ptr_types.get(name, _PTR)
            out.append(make_ptr(dtype, 0x10000 * (i + 1), cute.AddressSpace.gmem, assumed_align=align))
        else:
            out.append({"i32": Int32(1), "i64": Int64(1), "f32": Float32(1e-6)}[typ])
    out.append(make_fake_stream())
    return out


def compile_kernel(kernel, *, kind: str, arch: str, entry_prefix: str, block: tuple, cluster=(1, 1, 1),
                   dyn_smem: int = 0, ptr_types: dict | None = None, min_ctas_per_sm: int = 0,
                   grid: tuple | None = None, cluster_policy: str = "") -> Compiled:  # fmt: skip
    """Compile one @cute.kernel for arch. The launch geometry recorded in the manifest: block (baked into the
    cubin as .reqntid), cluster, its scheduling policy and dynamic shared memory (launch attributes) and the
    grid rule (default: the kind's, loader.abi.GRID)."""
    bad = cluster_policy_problem(cluster_policy, cluster)
    if bad:
        raise ValueError(bad)
    kernel.set_name_prefix(entry_prefix, remove_cutlass_symbol=True, keep_mangled_name=False)
    params = kernel_params(kernel, ptr_types)
    launch = dict(grid=[cluster[0], 1, 1], block=list(block), use_pdl=True)
    if cluster != (1, 1, 1):
        launch["cluster"] = list(cluster)
    if dyn_smem:
        launch["smem"] = dyn_smem
    if min_ctas_per_sm:  # .minnctapersm: ptxas keeps the registers within what this many CTAs per SM leave
        launch.update(min_blocks_per_mp=min_ctas_per_sm, preferred_smem_carveout=-1)

    @cute.jit
    def host(*args):
        *kargs, stream = args
        kernel(*kargs).launch(stream=stream, **launch)

    with tempfile.TemporaryDirectory(prefix="flint-aot-dsl-") as d:
        c = cute.compile(
            host, *_placeholders(params, ptr_types or {}),
            options=f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {d}",
        )  # fmt: skip
        cubin, ptx = c.artifacts.CUBIN, c.artifacts.PTX
        _check_written(Path(d), cubin)
    names = list(c.kernel_info)
    if len(names) != 1:
        raise RuntimeError(f"expected one kernel in the compile, got {names}")
    return Compiled(cubin, ptx, names[0], params, tuple(block), tuple(cluster),
                    tuple(grid) if grid else GRID[kind], dyn_smem, cluster_policy)  # fmt: skip


def _check_written(d: Path, cubin: bytes) -> None:
    """The DSL writes the cubin into d and reads it back, and a write the file system refuses (a full disk, a
    file size limit) leaves it cut short without an error: an unreadable cubin is written again, longer, to
    raise the OSError that cut it, naming the file."""
    try:
        read_cubin(cubin)
        return
    except CubinError:
        pass
    path = next(iter(sorted(d.glob("*.cubin"))), d / "kernel.cubin")
    probe = path.with_suffix(".probe")
    try:
        with open(probe, "wb") as f:
            f.write(cubin + bytes(1 << 16))  # more than was written: fails where the DSL's write stopped
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        what = f"{e.strerror}: the DSL's cubin was cut off at {len(cubin)} bytes"
        raise OSError(e.errno, what, str(path)) from None
    finally:
        probe.unlink(missing_ok=True)

"""CUDA driver side of the loader: bundle discovery, per-device module loading, cuLaunchKernelEx.

torch and cuda-bindings only. Modules are loaded lazily, once per (device, cubin), under a lock, into
the device's primary context (the one torch uses). Launches go to torch's current stream with the
cluster-dimension and programmatic-stream-serialization (PDL) attributes, so they can be captured in
a CUDA graph.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch
from cuda.bindings import driver as cu

from loader.bundle import Bundle
from loader.manifest import ARCH_CC, KernelEntry

_PACKAGED_BUNDLE = Path(__file__).resolve().parent / "_bundle"  # installed by `flint-aot pack`
_DEFAULT_BUNDLE = Path(__file__).resolve().parent.parent / "build" / "flint"  # a source checkout
_lock = threading.RLock()
_bundle: Bundle | None = None
_modules: dict[tuple[int, str, str], _Loaded] = {}  # (device, arch, name) -> loaded kernel
_tls = threading.local()
_pdl_enabled = True

_CTYPES = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}


class CudaError(RuntimeError):
    pass


def _check(result, what: str):
    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, desc = cu.cuGetErrorString(err)
        raise CudaError(f"{what} failed: {name.decode() if name else err} ({desc.decode() if desc else ''})")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


# ----------------------------------------------------------------------------- bundle
def load_bundle(path: str | os.PathLike | None = None) -> Bundle:
    """Use the bundle at `path` (else $FLINT_AOT_BUNDLE, else the one packed with the loader, else build/flint
    of the checkout) from now on.
    Reads and validates its manifest at once; cubins are loaded lazily, per device, on first use."""
    global _bundle
    if path is None:
        path = os.environ.get("FLINT_AOT_BUNDLE") or packaged_bundle() or _DEFAULT_BUNDLE
    b = Bundle.open(path)
    with _lock:
        _bundle = b
        _modules.clear()
    return b


def packaged_bundle() -> Path | None:
    """The bundle installed with the loader by `flint-aot pack` (a wheel), if any."""
    return _PACKAGED_BUNDLE if (_PACKAGED_BUNDLE / "manifest.json").is_file() else None


def current_bundle() -> Bundle:
    with _lock:
        if _bundle is None:
            load_bundle()
        return _bundle


def set_pdl(enabled: bool) -> None:
    """Launch with the programmatic-stream-serialization attribute (default on). For A/B measurements."""
    global _pdl_enabled
    _pdl_enabled = bool(enabled)


def arch_for(cc: tuple[int, int]) -> str | None:
    for arch, c in ARCH_CC.items():
        if tuple(c) == tuple(cc):
            return arch
    return None


def select_entry(bundle: Bundle, cc: tuple[int, int], kind: str, spec: dict) -> KernelEntry:
    """The manifest entry for (kind, spec) built for compute capability `cc`; LookupError otherwise."""
    arch = arch_for(cc)
    archs = bundle.manifest.archs()
    if arch is None or arch not in archs:
        raise LookupError(
            f"bundle {bundle.path} has no cubins for this GPU (compute capability {cc[0]}.{cc[1]}"
            f"{', ' + arch if arch else ', an architecture flint-aot does not target'}); it holds "
            f"{', '.join(archs) or 'nothing'}. Add the architecture to `archs` in the config and rebuild "
            "with `flint-aot build CONFIG -o BUNDLE`"
        )
    for e in bundle.manifest.kernels:
        if e.arch == arch and e.kind == kind and _serving_spec(e.spec) == spec:
            return e
    have = sorted({_spec_str(e.spec) for e in bundle.manifest.kernels if e.kind == kind and e.arch == arch})
    raise LookupError(
        f"bundle {bundle.path} has no {kind} kernel for {_spec_str(spec)} on {arch}; it has: "
        f"{'; '.join(have) or 'none'}. Add it to the config and rebuild"
    )


def _serving_spec(spec: dict) -> dict:
    """The spec without its debug_* keys: a debug bundle (e.g. a norm kernel built with
    debug_spin_cycles) serves the same calls as a normal one."""
    return {k: v for k, v in spec.items() if not k.startswith("debug_")}


def _spec_str(spec: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(spec.items()))


# ----------------------------------------------------------------------------- modules
class _Loaded:
    def __init__(self, key: tuple, entry: KernelEntry, module, function, ctx):
        self.key = key
        self.entry = entry
        self.module = module
        self.function = function
        self.ctx = ctx  # the device's primary context (torch's), in which the module was loaded
        self.ctx_id = int(ctx)
        self.ctypes = [_CTYPES[p.type] for p in entry.params]


_module_loads = 0


def _device_cc(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def get_kernel(device: torch.device, kind: str, spec: dict) -> _Loaded:
    bundle = current_bundle()
    idx = device.index if device.index is not None else torch.cuda.current_device()
    cc = _device_cc(torch.device("cuda", idx))
    entry = select_entry(bundle, cc, kind, spec)
    key = (idx, entry.arch, entry.name)
    k = _modules.get(key)
    if k is not None:
        return k
    with _lock:
        k = _modules.get(key)
        if k is None:
            image = bundle.read(entry)  # sha256 and ELF checked against the manifest
            with torch.cuda.device(idx):
                dev = _check(cu.cuDeviceGet(idx), "cuDeviceGet")
                ctx = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")  # torch's context
                _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
                module = _check(cu.cuModuleLoadData(image), f"cuModuleLoadData({entry.file})")
                try:
                    fn = _check(cu.cuModuleGetFunction(module, entry.entry.encode()), f"get {entry.entry}")
                    if entry.cluster != (1, 1, 1):
                        a = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
                        _check(cu.cuFuncSetAttribute(fn, a, 1), "cuFuncSetAttribute(non-portable cluster)")
                    if entry.dyn_smem > 0:
                        a = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                        _check(cu.cuFuncSetAttribute(fn, a, entry.dyn_smem), "cuFuncSetAttribute(dyn smem)")
                except Exception:
                    cu.cuModuleUnload(module)
                    raise
            k = _modules[key] = _Loaded(key, entry, module, fn, ctx)
            global _module_loads
            _module_loads += 1
    return k


def module_loads() -> int:
    """How many cubins this process has loaded (cuModuleLoadData calls); for tests and diagnostics."""
    return _module_loads


# ----------------------------------------------------------------------------- launch
def _config(k: _Loaded, pdl: bool):
    cache = getattr(_tls, "configs", None)
    if cache is None:
        cache = _tls.configs = {}
    ck = (k.key, pdl)
    cfg = cache.get(ck)
    if cfg is None:
        e = k.entry
        cfg = cu.CUlaunchConfig()
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = e.block
        cfg.sharedMemBytes = e.dyn_smem
        attrs = []
        a = cu.CUlaunchAttribute()
        a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        a.value.programmaticStreamSerializationAllowed = int(pdl)
        attrs.append(a)
        if e.cluster != (1, 1, 1):
            c = cu.CUlaunchAttribute()
            c.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            c.value.clusterDim.x, c.value.clusterDim.y, c.value.clusterDim.z = e.cluster
            attrs.append(c)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        cache[ck] = cfg
    return cfg


def launch(k: _Loaded, grid_symbols: dict[str, int], args: list, stream: torch.cuda.Stream) -> None:
    e = k.entry
    grid = [g if isinstance(g, int) else grid_symbols[g] for g in e.grid]
    cfg = _config(k, _pdl_enabled)
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.hStream = cu.CUstream(stream.cuda_stream)
    vals = [t(v) for t, v in zip(k.ctypes, args, strict=True)]
    argv = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
    # The driver API launches in the calling thread's current context, which a thread that never touched
    # the driver (or last used another device) does not have: make the module's context current.
    cur = _check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if cur is None or int(cur) != k.ctx_id:
        _check(cu.cuCtxSetCurrent(k.ctx), "cuCtxSetCurrent")
    _check(cu.cuLaunchKernelEx(cfg, k.function, ctypes.addressof(argv), 0), f"launch {e.entry}")

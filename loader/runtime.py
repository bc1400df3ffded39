"""CUDA driver side of the loader (docs/bundle.md §5, docs/api.md §10), torch and cuda-bindings only: where
the bundle is, cubins loaded once per device and content (lazily, under a lock, into torch's primary context;
never unloaded), and a `Launcher` per (thread, device, kind, spec): function, launch configs with their
cluster and PDL attributes, a parameter buffer laid out from the manifest. `Launcher.bind` matches a plan's
values to the parameters by name once; a call fills the buffer with one struct.pack_into and calls
cuLaunchKernelEx on torch's current stream (capturable in CUDA graphs). Launch settings are scoped
(`launch_options`), never process-wide."""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import operator
import os
import struct
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from cuda.bindings import driver as cu

from loader.abi import ARCH_CC, NORM_MODES
from loader.bundle import REBUILD, Bundle, BundleError
from loader.manifest import KernelEntry

_PACKAGED_BUNDLE = Path(__file__).resolve().parent / "_bundle"  # installed by `flint-aot pack`
_DEFAULT_BUNDLE = Path(__file__).resolve().parent.parent / "build" / "flint"  # a source checkout
_POLICY = {
    "spread": cu.CUclusterSchedulingPolicy.CU_CLUSTER_SCHEDULING_POLICY_SPREAD,
    "load_balancing": cu.CUclusterSchedulingPolicy.CU_CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING,
}
_FORMAT = {"ptr": "Q", "i32": "i", "i64": "q", "f32": "f"}
_SUCCESS = cu.CUresult.CUDA_SUCCESS


def _direct_launch():
    """The driver's cuLaunchKernelEx called through ctypes with the CUlaunchConfig that cuda-bindings built
    (the address of its C struct): the same call without cuda-bindings' per-call conversion of Python
    objects, about 2 µs less per launch. None where the driver library cannot be opened this way."""
    try:
        f = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    f.restype = ctypes.c_int  # arguments: prepared ctypes.c_void_p objects (no per-call conversion)
    return f


_cu_launch = _direct_launch()


class CudaError(RuntimeError):
    pass


def _check(result, what: str):
    err = result[0]
    if err != _SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise CudaError(f"{what} failed: {name.decode() if name else err}")
    return result[1] if len(result) == 2 else result[1:]


# ----------------------------------------------------------------------------- launch options
@dataclass(frozen=True)
class LaunchOptions:
    pdl: bool = True  # programmatic stream serialization: a kernel's weight stream overlaps its predecessor
    bounds_check: bool = False  # checked mode: raise on positions / slots the kernels would skip
    design: str | None = None  # flint_qkv_fused: "separate" / "prologue"; None: the loader's choice


_options = contextvars.ContextVar("flint_launch", default=LaunchOptions())  # noqa: B039 (frozen)


@contextlib.contextmanager
def launch_options(*, pdl: bool | None = None, bounds_check: bool | None = None, design: str | None = None):
    """Scope launch settings to the `with` block, in this thread (or asyncio task) only (docs/api.md §9):
    `pdl=False` launches without the PDL attribute; `bounds_check=True` is checked mode (bad positions and
    slots raise ValueError; one device-to-host copy per call; not in CUDA-graph capture); `design=` makes
    flint_qkv_fused run that design (LookupError if the bundle lacks it)."""
    if design not in (None, *NORM_MODES):
        raise ValueError(f"design must be one of {NORM_MODES} or None, got {design!r}")
    cur = _options.get()
    pdl = cur.pdl if pdl is None else bool(pdl)
    checked = cur.bounds_check if bounds_check is None else bool(bounds_check)
    token = _options.set(LaunchOptions(pdl, checked, design or cur.design))
    try:
        yield
    finally:
        _options.reset(token)


# ----------------------------------------------------------------------------- bundle
_lock = threading.RLock()
_bundle: Bundle | None = None
_generation = 0  # bumped by load_bundle: every thread's launchers and plans of older generations are dropped
_modules: dict[tuple, tuple] = {}  # _load_module's key -> (module, function, context); never unloaded
_module_loads = 0
_tls = threading.local()


def load_bundle(path: str | os.PathLike | None = None) -> Bundle:
    """Serve from the bundle at `path` (else $FLINT_AOT_BUNDLE, else the bundle packed with the loader, else
    build/flint of the checkout) from now on. Reads and checks its manifest at once; cubins are loaded lazily,
    per device. Calls that start after it returns, in any thread, run the new bundle's kernels; a call in
    flight and CUDA graphs captured before keep the kernels they launch: no module is ever unloaded, and a
    cubin already loaded (same content, from any bundle or path) is not read again (docs/api.md §10)."""
    global _bundle, _generation
    if path is None:
        path = os.environ.get("FLINT_AOT_BUNDLE") or packaged_bundle() or _DEFAULT_BUNDLE
    b = Bundle.open(path)
    diagnostics = b.manifest.config.get("diagnostics")
    if diagnostics:
        warnings.warn(f"bundle {b.path} is a diagnostic build ({', '.join(sorted(diagnostics))}): never "
                      "serve with it", stacklevel=2)  # fmt: skip
    with _lock:
        _bundle = b
        _generation += 1
    return b


def packaged_bundle() -> Path | None:
    """The bundle installed with the loader by `flint-aot pack` (a wheel), if any."""
    return _PACKAGED_BUNDLE if (_PACKAGED_BUNDLE / "manifest.json").is_file() else None


def current_bundle() -> Bundle:
    with _lock:
        if _bundle is None:
            load_bundle()
        return _bundle


def arch_for(cc: tuple[int, int]) -> str | None:
    return next((a for a, c in ARCH_CC.items() if tuple(c) == tuple(cc)), None)


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
        if e.arch == arch and e.kind == kind and spec == e.spec:
            return e
    have = sorted({_spec_str(e.spec) for e in bundle.manifest.kernels if e.kind == kind and e.arch == arch})
    raise LookupError(
        f"bundle {bundle.path} has no {kind} kernel for {_spec_str(spec)} on {arch}; it has: "
        f"{'; '.join(have) or 'none'}. Add it to the config and rebuild"
    )


def _spec_str(spec: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(spec.items()))


def check_params(entry: KernelEntry, supplied) -> None:
    """Refuse a manifest entry whose parameter names differ from the names the loader fills."""
    have = [p.name for p in entry.params]
    if sorted(have) != sorted(supplied):
        raise BundleError(
            f"{entry.file}: kernel {entry.name} takes parameters ({', '.join(have)}) but this loader fills "
            f"({', '.join(supplied)}): bundle and loader come from different flint-aot versions; rebuild the "
            "bundle with this version (`flint-aot build CONFIG -o BUNDLE`)"
        )


def _load_module(dev: int, entry: KernelEntry, bundle: Bundle):
    """(module, function, context) of entry on device dev (caller holds _lock), loaded once per process for
    each cubin content (sha256) with the manifest fields verified against it or applied to its function,
    whatever bundle or path names it, and never unloaded: another thread's launcher or plan, or a captured
    CUDA graph, may launch it after any load_bundle."""
    global _module_loads
    key = (dev, entry.sha256, entry.size, entry.arch, entry.entry, entry.params, entry.block, entry.cluster,
           entry.dyn_smem)  # fmt: skip
    if key in _modules:
        return _modules[key]
    image = bundle.read(entry)  # sha256 and ELF checked against the manifest
    device = _check(cu.cuDeviceGet(dev), "cuDeviceGet")
    ctx = _check(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")  # torch's context
    _check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        module = _check(cu.cuModuleLoadData(image), f"cuModuleLoadData({entry.file})")
        try:
            fn = _check(cu.cuModuleGetFunction(module, entry.entry.encode()), f"get {entry.entry}")
            attr = cu.CUfunction_attribute
            if entry.cluster != (1, 1, 1):
                a = attr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
                _check(cu.cuFuncSetAttribute(fn, a, 1), "cuFuncSetAttribute(non-portable cluster)")
            if entry.dyn_smem > 0:  # (the carveout is the driver's choice, per launch)
                a = attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _check(cu.cuFuncSetAttribute(fn, a, entry.dyn_smem), "cuFuncSetAttribute(dynamic smem)")
        except Exception:
            cu.cuModuleUnload(module)
            raise
    finally:
        cu.cuCtxPopCurrent()
    _modules[key] = (module, fn, ctx)
    _module_loads += 1
    return _modules[key]


def module_loads() -> int:
    """How many cubins this process has loaded (cuModuleLoadData calls); for tests and diagnostics."""
    return _module_loads


# ----------------------------------------------------------------------------- launchers
class Launcher:
    """One kernel, ready to launch on one device from one thread."""

    def __init__(self, dev: int, entry: KernelEntry, function, ctx):
        self.entry, self.function, self.ctx, self.dev = entry, function, ctx, dev
        self.names = tuple(p.name for p in entry.params)
        fmt, offsets = "<", []
        for p in entry.params:
            size = struct.calcsize(_FORMAT[p.type])
            pad = -struct.calcsize(fmt) % size  # natural C alignment, as the kernel's .param space
            fmt += "x" * pad + _FORMAT[p.type]
            offsets.append(struct.calcsize(fmt) - size)
        self._struct = struct.Struct(fmt)
        self._layouts: dict = {}  # bind's parameter layouts, by (value names, const names, renames)
        self._buf = ctypes.create_string_buffer(max(self._struct.size, 1))
        base = ctypes.addressof(self._buf)
        self._argv = (ctypes.c_void_p * len(offsets))(*(base + o for o in offsets))
        self._argv_addr = ctypes.addressof(self._argv)
        self._cfgs = {pdl: self._config(entry, pdl) for pdl in (True, False)}
        fn_argv = ctypes.c_void_p(int(function)), ctypes.c_void_p(self._argv_addr)
        # per PDL setting: [config, its grid and shared memory, its stream, the driver call's arguments]
        self._state = {pdl: [cfg, None, None, (ctypes.c_void_p(cfg.getPtr()), *fn_argv, None)]
                       for pdl, cfg in self._cfgs.items()}  # fmt: skip

    @staticmethod
    def _config(e: KernelEntry, pdl: bool):
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = 1, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = e.block
        cfg.sharedMemBytes = 0
        a = cu.CUlaunchAttribute()
        a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        a.value.programmaticStreamSerializationAllowed = int(pdl)
        attrs = [a]
        if e.cluster != (1, 1, 1):
            c = cu.CUlaunchAttribute()
            c.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            c.value.clusterDim.x, c.value.clusterDim.y, c.value.clusterDim.z = e.cluster
            attrs.append(c)
            if e.cluster_policy:  # (the manifest's; "" is the driver's default)
                s = cu.CUlaunchAttribute()
                s.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE
                s.value.clusterSchedulingPolicyPreference = _POLICY[e.cluster_policy]
                attrs.append(s)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        return cfg

    def bind(self, names: tuple, symbols: dict, consts: dict, renames: dict) -> tuple:
        """(run, masks) for one plan. run(values, stream, pdl) packs the parameters by name and launches:
        parameter p takes consts[p] if given, else values[names.index(renames.get(p, p))]; the grid is the
        manifest's rule with `symbols`. masks: the alignment this kernel needs of each of `names`, minus 1.
        BundleError if the names do not cover the parameters; ValueError for a value outside its C type."""
        key = (names, *consts, "", *symbols, "", *renames.items())  # ("": the three parts' boundaries)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = self._layout(names, consts, renames, symbols)
        get, const_values, masks, grid, const_struct = layout
        fixed = const_values(consts)
        pack_into, buf, launch = self._struct.pack_into, self._buf, self.launch
        dims = grid(symbols)  # the launch's grid and dynamic shared memory
        try:
            const_struct.pack(*fixed)
        except struct.error:
            self._refuse(get((0,) * len(names) + fixed))  # a const outside its C type: refused now

        def run(values: tuple, stream: int, pdl: bool) -> None:
            try:
                pack_into(buf, 0, *get(values + fixed))
            except struct.error:  # a value outside its C type: the ops' checks should have caught it first
                self._refuse(get(values + fixed))
                raise
            launch(dims, stream, pdl)

        return run, masks

    def _layout(self, names: tuple, consts: dict, renames: dict, symbols: dict) -> tuple:
        """(getter of the parameters in order from values + consts, getter of the consts in that order,
        alignment masks, grid, the consts' Struct)."""
        idx, const_names, align = [], [], [1] * len(names)
        for p in self.entry.params:
            if p.name in consts:
                idx.append(len(names) + len(const_names))
                const_names.append(p.name)
                continue
            src = renames.get(p.name, p.name)
            if src not in names:
                check_params(self.entry, (*names, *consts))  # raises: names the missing parameter
                raise BundleError(f"{self.entry.name}: parameter {p.name} has no value")
            i = names.index(src)
            idx.append(i)
            align[i] = max(align[i], p.align)
        rule_ok = all(not isinstance(g, str) or g in symbols for g in self.entry.grid)
        if not rule_ok or "M" not in symbols and "SMEM" not in symbols:  # (SMEM: the launch's shared memory)
            raise BundleError(f"{self.entry.file}: grid rule {self.entry.grid} names a symbol this loader "
                              f"does not supply for {self.entry.kind} ({', '.join(symbols)}); "
                              f"{REBUILD}")  # fmt: skip
        consts_in_order = operator.itemgetter(*const_names) if len(const_names) > 1 else (
            lambda d: tuple(map(d.__getitem__, const_names)))  # fmt: skip
        g, seen, dyn = self.entry.grid, {}, self.entry.dyn_smem
        smem = (lambda sym: sym["SMEM"]) if "SMEM" in symbols else (lambda sym: dyn)

        def grid(sym: dict) -> tuple:  # (grid x, y, z, dynamic shared memory bytes) from the manifest's rule
            key = tuple(sym.values())  # (one tuple per distinct grid: a dictionary hit after the first)
            return seen.get(key) or seen.setdefault(key, (*(sym[d] if isinstance(d, str) else d for d in g),
                                                          smem(sym)))  # fmt: skip

        types = {p.name: _FORMAT[p.type] for p in self.entry.params}
        const_struct = struct.Struct("<" + "".join(types[n] for n in const_names))  # the consts' C types
        return operator.itemgetter(*idx), consts_in_order, tuple(a - 1 for a in align), grid, const_struct

    def _refuse(self, values: tuple) -> None:
        """ValueError naming the first value that does not fit its parameter's C type."""
        for p, v in zip(self.entry.params, values, strict=True):
            try:
                struct.pack("<" + _FORMAT[p.type], v)
            except struct.error as e:
                raise ValueError(f"{self.entry.name}: {p.name} = {v!r} does not fit the kernel's {p.type} "
                                 f"parameter ({e})") from None

    def launch(self, dims: tuple, stream: int, pdl: bool) -> None:
        """Launch with the packed parameters on the raw stream handle `stream`; dims: (grid x, y, z, dynamic
        shared memory bytes)."""
        st = self._state[pdl]
        cfg = st[0]
        if st[1] is not dims:
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.sharedMemBytes = st[1] = dims
        if st[2] != stream:
            cfg.hStream = cu.CUstream(stream)
            st[2] = stream
        if _cu_launch and not _cu_launch(*st[3]):
            return  # CUDA_SUCCESS
        err = cu.cuLaunchKernelEx(cfg, self.function, self._argv_addr, 0)[0]
        if err != _SUCCESS:
            cur = cu.cuCtxGetCurrent()[1]
            if cur is None or int(cur) != int(self.ctx):
                err = self._launch_in_context(cfg, cur)
            _check((err,), f"launch {self.entry.entry}")

    def _launch_in_context(self, cfg, cur):
        """The launch from a thread whose current context is another device's, or none: the kernel's context
        is pushed and popped (the thread's current device stays), unless the thread has none and its current
        device is this one (then it is made current and stays, as torch's first use of the device does)."""
        if cur is None and torch.cuda.current_device() == self.dev:
            _check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            return cu.cuLaunchKernelEx(cfg, self.function, self._argv_addr, 0)[0]
        _check(cu.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        try:
            return cu.cuLaunchKernelEx(cfg, self.function, self._argv_addr, 0)[0]
        finally:
            cu.cuCtxPopCurrent()


def thread_cache() -> dict:
    """The calling thread's launchers and argument plans (loader.ops) for the current bundle: emptied when
    load_bundle is called, from any thread."""
    cache = getattr(_tls, "cache", None)
    if cache is None or _tls.generation != _generation:
        cache = _tls.cache = {}
        _tls.generation = _generation
    return cache


def launcher(dev: int, kind: str, key: tuple, spec_of) -> Launcher:
    """The calling thread's launcher for (dev, kind, key): one dictionary hit once built. spec_of() gives
    the spec dict (or a list of them, in order of preference) to look up in the manifest on the first call."""
    cache = thread_cache()
    lk = (dev, kind, key)
    got = cache.get(lk)
    if got is None:
        got = cache[lk] = _build(dev, kind, spec_of())
    return got


def first_entry(bundle: Bundle, cc: tuple[int, int], kind: str, specs) -> KernelEntry:
    """select_entry for the first of specs (a dict, or a list in order of preference) the bundle has."""
    specs = specs if isinstance(specs, list) else [specs]
    for spec in specs[:-1]:
        with contextlib.suppress(LookupError):
            return select_entry(bundle, cc, kind, spec)
    return select_entry(bundle, cc, kind, specs[-1])


def entry(dev: int, kind: str, key: tuple, spec_of) -> KernelEntry:
    """The manifest entry launcher(dev, kind, key, spec_of) would load, without loading it (per thread, one
    dictionary hit once looked up)."""
    cache = thread_cache()
    lk = ("entry", dev, kind, key)
    got = cache.get(lk)
    if got is None:
        cc = torch.cuda.get_device_capability(dev)
        got = cache[lk] = first_entry(current_bundle(), cc, kind, spec_of())
    return got


def _build(dev: int, kind: str, specs) -> Launcher:
    bundle = current_bundle()
    entry = first_entry(bundle, torch.cuda.get_device_capability(dev), kind, specs)
    with _lock:
        module, fn, ctx = _load_module(dev, entry, bundle)
    return Launcher(dev, entry, fn, ctx)

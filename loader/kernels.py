"""Any kernel of the bundle launched by kind and spec, its parameters by name (docs/plugins.md §4): the serve
side of plugin kernels. What the manifest knows is checked before anything launches (each parameter given,
none unknown, a pointer's device and alignment, a scalar's C range); the launch is runtime.Launcher's (PDL,
cluster, CUDA graphs, threads, devices). The names are checked once per thread and (kind, spec, names)."""

from __future__ import annotations

import torch
from torch import Tensor

from loader import runtime
from loader.abi import F32_MAX
from loader.ops import _options, _raw_stream

_RANGE = {"i32": (-(1 << 31), (1 << 31) - 1), "i64": (-(1 << 63), (1 << 63) - 1), "f32": (-F32_MAX, F32_MAX)}
_GRID_MAX, _INT = ((1 << 31) - 1, 65535, 65535), {int, type(None)}


class _Plan:
    __slots__ = ("kind", "spec", "key", "params", "first", "launchers", "runs")

    def __init__(self, kind: str, spec: dict, key, names: tuple, dev: int):
        e = runtime.entry(dev, kind, key, lambda: spec)
        have = [p.name for p in e.params]
        missing, unknown = [n for n in have if n not in names], [n for n in names if n not in have]
        if missing or unknown:
            what = f"missing parameter {missing[0]!r}" if missing else f"unknown parameter {unknown[0]!r}"
            raise TypeError(f"{kind} {spec}: {what}: the kernel takes {', '.join(have)}, each once, by name")
        self.kind, self.spec, self.key, self.launchers, self.runs = kind, spec, key, {}, {}
        self.params = tuple((p.name, p.type, p.align - 1) for p in e.params)
        self.first = next((p.name for p in e.params if p.type == "ptr"), None)  # gives the launch device

    def run(self, dev: int, grid, smem):
        """Launcher.bind's run for this device, grid and shared memory (kept per plan), the grid checked."""
        k = self.launchers.get(dev) or self.launchers.setdefault(
            dev, runtime.launcher(dev, self.kind, self.key, lambda: self.spec))  # fmt: skip
        e, g = k.entry, tuple(grid) + (1,) * (3 - len(grid)) if isinstance(grid, (tuple, list)) else ()
        if len(g) != 3 or not all(type(d) is int and 0 < d <= top for d, top in zip(g, _GRID_MAX)):  # noqa: B905
            raise ValueError(f"grid must be 1 to 3 ints within {_GRID_MAX}, got {grid!r}")
        sym, top = {"SMEM": e.dyn_smem if smem is None else smem}, e.dyn_smem
        for d, rule, c in zip(g, e.grid, e.cluster, strict=True):
            if d % c or not isinstance(rule, str) and d != rule:
                raise ValueError(f"grid {g} does not fit {self.kind}'s rule {e.grid} and cluster {e.cluster}")
            sym.update({rule: d} if isinstance(rule, str) else {})
        if type(sym["SMEM"]) is not int or not 0 <= sym["SMEM"] <= top:
            raise ValueError(f"smem must be an int in 0..{top} (what the kernel declares), got {smem!r}")
        if len(self.runs) > 256:
            self.runs.clear()
        run = k.bind(tuple(n for n, _, _ in self.params), sym, {}, {})[0]
        self.runs[(dev, grid if isinstance(grid, tuple) else g, smem)] = run
        return run


def launch_kernel(kind: str, spec: dict, grid, /, *, stream=None, smem=None, pdl=None, **params) -> None:
    """Launch the bundle's `kind` kernel of this spec on `grid` (1 to 3 ints), on `stream` (a
    torch.cuda.Stream; default: torch's current one of the launch device) with `smem` bytes of dynamic shared
    memory (default: what the kernel declares) and PDL (default: launch_options'), every kernel parameter by
    name: a tensor for a pointer (its data pointer; the first one's CUDA device is the launch device), a
    Python int (an f32: or float) for a scalar. TypeError / ValueError name the parameter before anything
    launches; LookupError if the bundle lacks the kernel. Extents are the kernel author's to check."""
    try:
        fs = frozenset(spec.items())
    except (AttributeError, TypeError):
        fs = repr(sorted(spec.items())) if isinstance(spec, dict) else None
    if type(kind) is not str or fs is None:
        raise TypeError(f"kind must be a str, spec a dict; got {type(kind).__name__}, {type(spec).__name__}")
    cache, key = runtime.thread_cache(), (launch_kernel, kind, fs, tuple(params))
    p = cache.get(key)
    if p is None:
        ts = [(n, v) for n, v in params.items() if isinstance(v, Tensor)]
        dev = next((v.get_device() for _, v in ts if v.get_device() >= 0), -1 if ts else None)
        if dev == -1:
            raise ValueError(f"{ts[0][0]} is on {ts[0][1].device}: a kernel's tensors must be CUDA tensors")
        dev = torch.cuda.current_device() if dev is None else dev
        p = cache[key] = _Plan(kind, dict(spec), fs, key[3], dev)
    f = params.get(p.first)
    dev = f.get_device() if isinstance(f, Tensor) else -1 if p.first else torch.cuda.current_device()
    values = []
    for name, typ, mask in p.params:
        v = params[name]
        if typ == "ptr":
            if not isinstance(v, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor (a pointer), got {type(v).__name__}")
            if v.get_device() != dev or dev < 0:
                where = f"cuda:{dev}, the launch device ({p.first}'s)" if dev >= 0 else "a CUDA device"
                raise ValueError(f"{name} is on {v.device}, expected {where}")
            if (v := v.data_ptr()) & mask:
                a = mask + 1
                raise ValueError(f"{name} must be {a}-byte aligned (data_ptr % {a} = {v & mask})")
        elif type(v) is not int and (typ != "f32" or type(v) is not float):
            what = "float" if typ == "f32" else "int"
            raise TypeError(f"{name} must be a Python {what} (an {typ} parameter), got {type(v).__name__}")
        elif not _RANGE[typ][0] <= v <= _RANGE[typ][1] and v == v and abs(v) != float("inf"):
            lo, hi, f = *_RANGE[typ], ".9g" if typ == "f32" else ""
            raise ValueError(f"{name} = {v!r} does not fit the kernel's {typ} parameter ({lo:{f}}..{hi:{f}})")
        values.append(v)
    if stream is None:
        stream = _raw_stream(dev)
    elif isinstance(stream, torch.cuda.Stream) and stream.device_index == dev:
        stream = stream.cuda_stream
    else:
        raise ValueError(f"stream must be a torch.cuda.Stream of the launch device cuda:{dev}, got {stream}")
    hit = type(grid) is tuple and {*map(type, grid), type(smem)} <= _INT  # (1.0 == 1: a float is refused)
    run = p.runs.get((dev, grid, smem)) if hit else None
    (run or p.run(dev, grid, smem))(tuple(values), stream, _options().pdl if pdl is None else bool(pdl))

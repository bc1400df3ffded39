"""Argument plans (docs/api.md §15), per thread: the first call with new tensor metadata runs every check
(loader.checks) and leaves a plan (the kernels bound to the call's values by name, the arguments that follow
from the metadata, and a guard: torch's C++ TensorGuards, which verifies in one call that later tensors have
the plan's dtypes, devices, shapes and strides). Later calls re-check only what depends on pointers and
values. The guard refuses a tensor given twice, so a call passing one tensor in two roles gets a plan that
guards its distinct tensors and checks the repeated roles are the same objects again: the same fast path.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from loader import checks, runtime

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover
    _TensorGuards = None

PER_KEY = 16  # plans kept per key (the key holds M, so a key's plans differ in other shapes or strides)
builds = 0  # plans built by this process (tests count them)


@dataclass(slots=True, eq=False)
class Stage:
    """The per-head stage's part of a plan (flint_qkv_fused, qk_norm_rope_cache): what its pointer- and
    value-dependent checks need."""

    dev: int
    geometry: tuple  # (num_blocks, block_size, nkv, strides): checks.disjoint's arguments
    deltas: set  # v_cache - k_cache addresses found not to overlap
    fp8: bool
    rope: bool
    max_pos: int
    num_slots: int
    placeholder: bool  # calls must check for the no-RoPE placeholder table (RoPE, max_pos 1: its shape)

    def recheck(self, k_cache, v_cache, cos_sin_cache, k_scale, v_scale, positions, slot_mapping, checked):
        """The checks that depend on pointers and values."""
        delta = v_cache.data_ptr() - k_cache.data_ptr()
        if delta not in self.deltas:
            checks.disjoint(k_cache, v_cache, *self.geometry)
            if len(self.deltas) < 256:
                self.deltas.add(delta)
        if self.placeholder:
            checks.placeholder(cos_sin_cache, self.dev)
        if self.fp8:
            checks.kv_scale("k_scale", k_scale, self.dev, checked)  # (reads a value only when needed)
            checks.kv_scale("v_scale", v_scale, self.dev, checked)
        if checked:
            checks.bounds(positions, slot_mapping, self.max_pos if self.rope else None, self.num_slots)


@dataclass(slots=True, eq=False)
class Plan:
    dev: int
    launches: tuple[Callable, ...]  # Launcher.bind's run functions, launched in this order
    out: Tensor | None = None  # an expanded view with the main output's shape, dtype and device
    stage: Stage | None = None
    xn: int = 0  # the two-kernel design: elements of the xn the norm kernel writes for the qkv kernel
    graph: bool = False  # flint_qkv_fused with no design asked for: CUDA-graph capture takes another design
    names: tuple[str, ...] = ()  # the call's distinct tensors, in the op's order: the values' first names
    take: Callable = tuple  # the call's argument tuple -> its distinct tensors
    same: tuple[tuple[int, int], ...] = ()  # (i, j): argument i must be argument j
    masks: tuple[int, ...] = ()  # per distinct tensor: its required alignment - 1 (from the manifest)
    guard: object = field(default=None)


def distinct(names: tuple, args: tuple) -> tuple[tuple, tuple, dict]:
    """(indices of the distinct tensors among args, (i, j) pairs where argument i is argument j, {name of a
    repeated role: the name of its first role}). Absent (None) arguments are left out."""
    keep = [i for i, a in enumerate(args) if a is not None]
    if len({id(args[i]) for i in keep}) == len(keep):  # (the usual call: every tensor distinct)
        return tuple(keep), (), {}
    first, keep, same, renames = {}, [], [], {}
    for i, a in enumerate(args):
        if a is None:
            continue
        j = first.setdefault(id(a), i)
        if j == i:
            keep.append(i)
        else:
            same.append((i, j))
            renames[names[i]] = names[j]
    return tuple(keep), tuple(same), renames


def get(key: tuple, names: tuple, args: tuple, build, *extra):
    """(plan, its distinct tensors) for a call: the first of this key's plans (most recently used first) whose
    guard the call's tensors pass, with its repeated roles the same objects again; else `new`'s."""
    plans = runtime.thread_cache().get(key)
    if plans:
        for i, p in enumerate(plans):
            ts = p.take(args)
            if p.guard.check(*ts) and (not p.same or all(args[a] is args[b] for a, b in p.same)):
                if i:
                    plans.insert(0, plans.pop(i))
                return p, ts
    return new(key, names, args, build, *extra)


def new(key: tuple, names: tuple, args: tuple, build, *extra):
    """(plan, its distinct tensors) from build(names of the distinct tensors, renames of repeated roles,
    *extra), which runs every check but the alignment (and raises on bad arguments; the ops check the data
    pointers' alignment against the plan's masks on every call). The plan is kept under key for later
    calls."""
    global builds
    keep, same, renames = distinct(names, args)
    take = operator.itemgetter(*keep) if len(keep) > 1 else (lambda a, i=keep[0]: (a[i],))
    cache = runtime.thread_cache()  # (before build: a plan built across a load_bundle is not kept for later)
    p, ts = build(take(names), renames, *extra), take(args)
    builds += 1
    p.take, p.same = take, same
    if GUARDS:
        p.guard = _guard(ts)
        plans = cache.setdefault(key, [])
        plans.insert(0, p)
        del plans[PER_KEY:]
    return p, ts


def bind(p: Plan, values: tuple, launches: list) -> None:
    """Bind each (launcher, symbols, consts, renames) of launches to the value names `values` (the plan's
    tensors first) and record on the plan the alignment masks of its tensors: what those kernels assume
    (the manifest's parameter alignments), which the ops check on every call."""
    runs, masks = [], ()
    for k, symbols, consts, renames in launches:
        run, m = k.bind(values, symbols, consts, renames)
        runs.append(run)
        masks = tuple(map(operator.or_, masks, m)) if masks else m  # (masks 2^k - 1: | is max)
    p.launches, p.masks = tuple(runs), masks[: len(p.names)]


def _guard(tensors):  # (None: every size and stride static, the tensors' own; 1 µs instead of 6 for lists)
    return _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)


def _guards_work() -> bool:
    """TensorGuards is private to torch: use it only if it accepts and refuses what the plans rely on."""
    try:
        a, b = torch.empty(4, 6), torch.empty(2, 4, 6)[1]
        g = _guard((a, a[0]))
        refused = (a.double(), a[:, :5], torch.empty(6, 4).t(), torch.empty(4, 7)[:, :6], a.view(2, 12), 1)
        return g.check(b, b[1]) and not any(g.check(a, t) or g.check(t, a[0]) for t in refused)
    except Exception:  # noqa: BLE001 (any failure means: do not use it)
        return False


GUARDS = _TensorGuards is not None and _guards_work()

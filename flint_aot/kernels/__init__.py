"""Kernel registry: one module per kernel kind, named after it (norm, qkv, gemv, qk_norm_rope_cache), each
exposing its kernel class as `KERNEL` (a compile.Kernel: `KERNEL(spec).compile(arch, entry_prefix) ->
compile.Compiled`); device helpers several kernels share live in `device` (generic) and `gemv_core` (the CTA
GEMV), the compile plumbing in `compile`. Importing this package does not import the DSL: kernel modules are
imported only inside the compile subprocess (`flint_aot.compile_one`) and by `kernel_class`."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from pathlib import Path

from loader.abi import KINDS

MODULES = {kind: f"flint_aot.kernels.{kind}" for kind in KINDS}

_DIR = Path(__file__).resolve().parent


# Specializations the config may ask for but this version cannot compile yet.
_NOT_YET: set[tuple[str, str, object]] = set()


def kernel_class(kind: str):
    """The kernel class of a kind (imports the DSL)."""
    return importlib.import_module(MODULES[kind]).KERNEL


def implemented(kind: str, spec: dict) -> bool:
    """A built-in kind's spec this version compiles; a plugin kind (any other) always is (its module is
    checked by flint_aot.plugins before the build)."""
    mod = MODULES.get(kind)
    if mod is None:
        return kind not in KINDS
    if importlib.util.find_spec(mod) is None:
        return False
    return not any(k == kind and spec.get(key) == v for k, key, v in _NOT_YET)


def source_hash() -> str:
    """sha256 over every kernel source file and loader/abi.py (the sizes they compile in): any change to
    device code invalidates the build cache."""
    h = hashlib.sha256()
    for p in [*sorted(_DIR.glob("*.py")), _DIR.parent.parent / "loader" / "abi.py"]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def entry_prefix(name: str) -> str:
    return f"flint_{name}"

"""Kernel registry: one module per kernel kind, named after it (norm, qkv, gemv, qk_norm_rope_cache), each
exposing `KERNEL(spec, arch, diag)` -> a compile.Kernel of that specialization (`.compile(arch,
entry_prefix) -> compile.Compiled`); the parts several kernels share live in modules of their own (qkv.py's
docstring maps them), the compile plumbing in `compile`. Importing this package does not import the DSL:
kernel modules are imported only inside the compile subprocess (`flint_aot.compile_one`) and by
`kernel_class`."""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

from loader.abi import KINDS

MODULES = {kind: f"flint_aot.kernels.{kind}" for kind in KINDS}

_DIR = Path(__file__).resolve().parent


def kernel_class(kind: str):
    """The kernel class (or maker) of a built-in kind: KERNEL(spec, arch, diag) (imports the DSL)."""
    return importlib.import_module(MODULES[kind]).KERNEL


def source_hash() -> str:
    """sha256 over every kernel source file and loader/abi.py (the sizes they compile in): any change to
    device code invalidates the build cache."""
    h = hashlib.sha256()
    for p in [*sorted(_DIR.glob("*.py")), _DIR.parent.parent / "loader" / "abi.py"]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def entry_prefix(name: str) -> str:
    return f"flint_{name}"

"""The bundle manifest: its schema, defined once (stdlib only).

The builder (`flint_aot`) writes manifests through `Manifest.dumps`; the loader reads them through
`Manifest.load`. Nothing here imports torch, the CUDA bindings or the DSL.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"

# Kernel parameter types the loader knows how to pack: name -> (ctypes-ish size, alignment).
PARAM_TYPES = {"ptr": (8, 8), "i32": (4, 4), "i64": (8, 8), "f32": (4, 4)}
# Symbols a grid rule may use; the loader supplies their values at launch.
GRID_SYMBOLS = ("M", "ROW_BLOCKS", "HEADS")
ARCH_CC = {"sm_90a": (9, 0), "sm_100a": (10, 0)}


class ManifestError(ValueError):
    """A manifest that cannot be trusted; the message says how to fix it."""


@dataclass(frozen=True)
class Param:
    name: str
    type: str


@dataclass(frozen=True)
class KernelEntry:
    kind: str  # "norm", "qkv", ...
    name: str  # specialization name, unique per arch, e.g. "norm_res1"
    spec: dict  # specialization values, e.g. {"residual": True}
    arch: str  # "sm_90a"
    file: str  # relative file name inside the bundle
    size: int
    sha256: str
    entry: str  # entry symbol in the cubin
    block: tuple[int, int, int]
    cluster: tuple[int, int, int]
    dyn_smem: int
    grid: tuple  # each item an int or a name from GRID_SYMBOLS
    params: tuple[Param, ...]
    build_key: str  # hash of (kernel source, DSL version, specialization, arch): the build cache key
    registers: int = 0  # REGCOUNT read from the cubin (informational)

    def param_offsets(self) -> list[tuple[int, int]]:
        """(offset, size) of each parameter in the kernel's parameter buffer (natural C alignment)."""
        out, off = [], 0
        for p in self.params:
            size, align = PARAM_TYPES[p.type]
            off = (off + align - 1) // align * align
            out.append((off, size))
            off += size
        return out


@dataclass
class Manifest:
    generator: str  # "flint-aot <version>"
    dsl_version: str  # nvidia-cutlass-dsl version used to compile
    config: dict  # the resolved config
    kernels: list[KernelEntry] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    # ---------------------------------------------------------------- writing
    def to_dict(self) -> dict:
        d = asdict(self)
        d["kernels"] = [asdict(k) for k in sorted(self.kernels, key=lambda k: (k.kind, k.name, k.arch))]
        return d

    def dumps(self) -> str:
        """Deterministic JSON: same manifest, same bytes."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    # ---------------------------------------------------------------- reading
    @classmethod
    def from_dict(cls, d: dict, where: str = "manifest") -> Manifest:
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: not a JSON object")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ManifestError(
                f"{where}: schema version {version!r}, this loader reads version {SCHEMA_VERSION}; "
                "rebuild the bundle with the matching flint-aot (`flint-aot build CONFIG -o BUNDLE`)"
            )
        try:
            kernels = [_entry_from_dict(k, f"{where}: kernels[{i}]") for i, k in enumerate(d["kernels"])]
            m = cls(
                generator=str(d["generator"]),
                dsl_version=str(d["dsl_version"]),
                config=dict(d["config"]),
                kernels=kernels,
            )
        except (KeyError, TypeError) as e:
            raise ManifestError(f"{where}: malformed ({type(e).__name__}: {e}); rebuild the bundle") from None
        seen = set()
        for k in m.kernels:
            key = (k.kind, k.name, k.arch)
            if key in seen:
                raise ManifestError(f"{where}: duplicate kernel {k.name} for {k.arch}; rebuild the bundle")
            seen.add(key)
        return m

    @classmethod
    def load(cls, bundle_dir: str | os.PathLike) -> Manifest:
        path = os.path.join(bundle_dir, MANIFEST_NAME)
        try:
            with open(path, encoding="utf-8") as f:
                raw = f.read()
        except FileNotFoundError:
            raise ManifestError(
                f"{path} does not exist: not a flint-aot bundle; build one with "
                "`flint-aot build configs/flint.yaml -o DIR`"
            ) from None
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path}: not valid JSON ({e}); rebuild the bundle") from None
        return cls.from_dict(d, where=path)

    def archs(self) -> list[str]:
        return sorted({k.arch for k in self.kernels})


def _entry_from_dict(d: dict, where: str) -> KernelEntry:
    params = tuple(Param(str(p["name"]), str(p["type"])) for p in d["params"])
    for p in params:
        if p.type not in PARAM_TYPES:
            raise ManifestError(
                f"{where}: parameter {p.name} has unknown type {p.type!r}; rebuild the bundle"
            )
    grid = tuple(d["grid"])
    if len(grid) != 3 or any(not (isinstance(g, int) and g > 0) and g not in GRID_SYMBOLS for g in grid):
        raise ManifestError(f"{where}: bad grid rule {grid!r}; rebuild the bundle")
    e = KernelEntry(
        kind=str(d["kind"]),
        name=str(d["name"]),
        spec=dict(d["spec"]),
        arch=str(d["arch"]),
        file=str(d["file"]),
        size=int(d["size"]),
        sha256=str(d["sha256"]),
        entry=str(d["entry"]),
        block=_dim3(d["block"], where, "block"),
        cluster=_dim3(d["cluster"], where, "cluster"),
        dyn_smem=int(d["dyn_smem"]),
        grid=grid,
        params=params,
        build_key=str(d["build_key"]),
        registers=int(d.get("registers", 0)),
    )
    check_relative_path(e.file, where)
    return e


def _dim3(v, where: str, what: str) -> tuple[int, int, int]:
    t = tuple(int(x) for x in v)
    if len(t) != 3 or min(t) < 1:
        raise ManifestError(f"{where}: bad {what} dims {v!r}; rebuild the bundle")
    return t


def check_relative_path(name: str, where: str = "manifest") -> None:
    """A manifest file entry must name a file inside the bundle: relative, no '..', no absolute path."""
    p = PurePosixPath(name)
    if (
        not name
        or p.is_absolute()
        or "\\" in name
        or any(part in ("..", "") for part in p.parts)
        or (name != str(p))
    ):
        raise ManifestError(
            f"{where}: file {name!r} leaves the bundle directory; the manifest is corrupt or tampered "
            "with: rebuild the bundle"
        )


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()

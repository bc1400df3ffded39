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

# the parameter C types the loader packs, the symbols of grid rules and the archs: defined in loader.abi
from loader.abi import ARCH_CC, GRID_SYMBOLS, PARAM_TYPES  # noqa: F401  (ARCH_CC re-exported)

MANIFEST_NAME = "manifest.json"
# 2: Param.align (the alignment a kernel assumes of a pointer), dyn_smem_per_m; 3: the norm kernel writes xn
# in the layout its qkv kernel reads (loader.abi.xn_strides), so a loader and a bundle of different layouts
# must never meet: a bundle of 2 would run with wrong results, and is refused with the fix instead; 4: for
# an NVFP4 qkv kernel the norm kernel writes each 8 elements of xn in the MMA pair order (loader.abi.xn_pairs,
# a norm kernel parameter), which that qkv kernel no longer makes itself; 5: the 32-token NVFP4 qkv kernel of
# the two-kernel design reads xn as wgmma tiles (loader.abi.WG_STRIDES, xn_pairs 2); 6: so does the 64-token
# one; 7: and so do the BF16 kernels of 32 and 64 tokens (xn_pairs 3); 8: entries without dyn_smem_per_m
# (always 0), and a diagnostic build says so in its config's `diagnostics` section, not in kernel specs; 9:
# every norm, qkv and gemv spec names its hidden size, every qkv and qk_norm_rope_cache spec its q/k norm
SCHEMA_VERSION = 9
# a cluster kernel's scheduling policy (an optional entry field; bundles without it get the driver's default)
CLUSTER_POLICIES = ("", "spread", "load_balancing")


def cluster_policy_problem(policy, cluster) -> str:
    """What is wrong with a kernel's cluster scheduling policy ("" if nothing): one of CLUSTER_POLICIES, and
    set only with a cluster."""
    if policy not in CLUSTER_POLICIES:
        return f"cluster_policy {policy!r} is not one of {CLUSTER_POLICIES}"
    if policy and tuple(cluster) == (1, 1, 1):
        return f"cluster_policy {policy!r} needs a cluster (cluster is (1, 1, 1))"
    return ""


class ManifestError(ValueError):
    """A manifest that cannot be trusted; the message says how to fix it."""


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # a C type of PARAM_TYPES
    align: int = 0  # pointers: the byte alignment the kernel assumes of the address (the loader checks it)


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
    cluster_policy: str = ""  # the clusters' scheduling policy (CLUSTER_POLICIES; "": the driver's default)

    def param_offsets(self) -> list[tuple[int, int]]:
        """(offset, size) of each parameter in the kernel's parameter buffer (natural C alignment)."""
        out, off = [], 0
        for p in self.params:
            size, align = PARAM_TYPES[p.type]
            off = (off + align - 1) // align * align
            out.append((off, size))
            off += size
        return out


@dataclass(repr=False)
class Manifest:
    generator: str  # "flint-aot <version>"
    dsl_version: str  # nvidia-cutlass-dsl version used to compile
    config: dict  # the resolved config
    kernels: list[KernelEntry] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION
    # plugin kinds (docs/plugins.md): kind -> {module, class, source_sha256, files, version}; written only
    # when the bundle has some (a bundle of Flint's kernels alone keeps its bytes)
    plugins: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        n = len(self.kernels)
        return (f"{n} cubin{'s' * (n != 1)} for {', '.join(self.archs()) or 'no architecture'}, "
                f"{self.generator}, nvidia-cutlass-dsl {self.dsl_version}, schema {self.schema_version}")

    # ---------------------------------------------------------------- writing
    def to_dict(self) -> dict:
        d = asdict(self)
        d["kernels"] = [asdict(k) for k in sorted(self.kernels, key=lambda k: (k.kind, k.name, k.arch))]
        if not self.plugins:
            del d["plugins"]
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
            if not isinstance(d["kernels"], (list, tuple)):
                raise ManifestError(
                    f"{where}: kernels: expected a list, got {_short(d['kernels'])}; rebuild the bundle"
                )
            if not isinstance(d["config"], dict):
                raise ManifestError(
                    f"{where}: config: expected an object, got {_short(d['config'])}; rebuild the bundle"
                )
            plugins = d.get("plugins", {})
            if not isinstance(plugins, dict) or not all(isinstance(v, dict) for v in plugins.values()):
                raise ManifestError(f"{where}: plugins: expected an object of objects, got "
                                    f"{_short(plugins)}; rebuild the bundle")  # fmt: skip
            kernels = [_entry_from_dict(k, f"{where}: kernels[{i}]") for i, k in enumerate(d["kernels"])]
            m = cls(
                generator=str(d["generator"]),
                dsl_version=str(d["dsl_version"]),
                config=dict(d["config"]),
                kernels=kernels,
                plugins=dict(plugins),
            )
        except KeyError as e:
            raise ManifestError(f"{where}: malformed (missing field {e}); rebuild the bundle") from None
        except (TypeError, ValueError, OverflowError) as e:
            if isinstance(e, ManifestError):
                raise
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
        except OSError as e:
            raise ManifestError(
                f"{path}: cannot read ({e.strerror}); rebuild or redeploy the bundle"
            ) from None
        except UnicodeDecodeError as e:
            raise ManifestError(f"{path}: not UTF-8 (byte {e.start}); rebuild the bundle") from None
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path}: not valid JSON ({e}); rebuild the bundle") from None
        except RecursionError:
            raise ManifestError(f"{path}: not valid JSON (nested too deeply); rebuild the bundle") from None
        return cls.from_dict(d, where=path)

    def archs(self) -> list[str]:
        return sorted({k.arch for k in self.kernels})


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _int(d: dict, key: str, where: str, default=None) -> int:
    """A non-negative JSON integer field (not a bool, float or string)."""
    v = d.get(key, default) if default is not None else d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ManifestError(
            f"{where}: {key}: expected a non-negative integer, got {_short(v)}; rebuild the bundle"
        )
    return v


def _str(d: dict, key: str, where: str, default=None) -> str:
    """A JSON string field (default: the value when the field is absent; None: the field is required)."""
    v = d.get(key, default) if default is not None else d[key]
    if not isinstance(v, str):
        raise ManifestError(f"{where}: {key}: expected a string, got {_short(v)}; rebuild the bundle")
    return v


def _entry_from_dict(d: dict, where: str) -> KernelEntry:
    try:
        return _entry_fields(d, where)
    except KeyError as e:
        raise ManifestError(f"{where}: missing field {e}; rebuild the bundle") from None


def _entry_fields(d: dict, where: str) -> KernelEntry:
    if not isinstance(d, dict):
        raise ManifestError(f"{where}: expected an object, got {_short(d)}; rebuild the bundle")
    if not isinstance(d["params"], (list, tuple)) or not all(isinstance(p, dict) for p in d["params"]):
        raise ManifestError(
            f"{where}: params: expected a list of objects, got {_short(d['params'])}; rebuild the bundle"
        )
    if not isinstance(d["spec"], dict):
        raise ManifestError(f"{where}: spec: expected an object, got {_short(d['spec'])}; rebuild the bundle")
    if not isinstance(d["grid"], (list, tuple)):
        raise ManifestError(f"{where}: grid: expected a list, got {_short(d['grid'])}; rebuild the bundle")
    params = tuple(Param(str(p["name"]), str(p["type"]), _int(p, "align", where)) for p in d["params"])
    for p in params:
        if p.type not in PARAM_TYPES:
            raise ManifestError(
                f"{where}: parameter {p.name} has unknown type {p.type!r}; rebuild the bundle"
            )
        if p.align & (p.align - 1) or (p.type == "ptr") != (p.align > 0):
            raise ManifestError(f"{where}: parameter {p.name}: bad alignment {p.align} for a {p.type} "
                                "(pointers: a power of two, scalars: 0); rebuild the bundle")  # fmt: skip
    grid = tuple(d["grid"])
    ok = lambda g: (isinstance(g, int) and not isinstance(g, bool) and g > 0) or g in GRID_SYMBOLS  # noqa: E731
    if len(grid) != 3 or not all(ok(g) for g in grid):
        raise ManifestError(f"{where}: bad grid rule {grid!r}; rebuild the bundle")
    e = KernelEntry(
        kind=_str(d, "kind", where),
        name=_str(d, "name", where),
        spec=dict(d["spec"]),
        arch=_str(d, "arch", where),
        file=_str(d, "file", where),
        size=_int(d, "size", where),
        sha256=_str(d, "sha256", where),
        entry=_str(d, "entry", where),
        block=_dim3(d["block"], where, "block"),
        cluster=_dim3(d["cluster"], where, "cluster"),
        dyn_smem=_int(d, "dyn_smem", where),
        grid=grid,
        params=params,
        build_key=_str(d, "build_key", where),
        registers=_int(d, "registers", where, default=0),
        cluster_policy=_str(d, "cluster_policy", where, default=""),
    )
    bad = cluster_policy_problem(e.cluster_policy, e.cluster)
    if bad:
        raise ManifestError(f"{where}: {bad}; rebuild the bundle")
    check_relative_path(e.file, where)
    return e


def _dim3(v, where: str, what: str) -> tuple[int, int, int]:
    """Three positive JSON integers (not strings, floats or bools)."""
    if not (
        isinstance(v, (list, tuple))
        and len(v) == 3
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v)
    ):
        raise ManifestError(
            f"{where}: bad {what} dims {_short(v)} (three positive integers); rebuild the bundle"
        )
    return tuple(v)


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

"""A bundle on disk: its manifest plus checked access to its cubins (stdlib only)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from loader.elf import CubinError, read_cubin
from loader.manifest import ARCH_CC, MANIFEST_NAME, KernelEntry, Manifest, ManifestError, sha256_bytes


class BundleError(ValueError):
    """A bundle file that cannot be trusted; the message says how to fix it."""


REBUILD = "rebuild the bundle (`flint-aot build CONFIG -o BUNDLE`) or redeploy it"


def check_cubin(entry: KernelEntry, data: bytes) -> list[str]:
    """Problems found comparing a cubin's bytes with its manifest entry (empty list: consistent)."""
    problems = []
    if len(data) != entry.size:
        problems.append(f"size {len(data)} != manifest {entry.size}")
    digest = sha256_bytes(data)
    if digest != entry.sha256:
        problems.append(f"sha256 {digest[:16]}… != manifest {entry.sha256[:16]}…")
    try:
        info = read_cubin(data)
    except CubinError as e:
        return problems + [f"not a readable cubin ({e})"]
    cc = ARCH_CC.get(entry.arch)
    if cc is not None and info.sm != cc[0] * 10 + cc[1]:
        problems.append(f"ELF is for sm_{info.sm}, manifest says {entry.arch}")
    k = info.kernels.get(entry.entry)
    if k is None:
        problems.append(f"entry symbol {entry.entry} not in cubin (has {sorted(info.kernels)})")
        return problems
    if k.params != entry.param_offsets():
        problems.append(f"parameter layout {k.params} != manifest {entry.param_offsets()}")
    if k.reqntid is not None and tuple(k.reqntid) + (1,) * (3 - len(k.reqntid)) != tuple(entry.block):
        problems.append(f"required block {k.reqntid} != manifest {entry.block}")
    return problems


@dataclass(repr=False)
class Bundle:
    path: Path
    manifest: Manifest

    def __repr__(self) -> str:
        return f"Bundle({str(self.path)!r}, {self.manifest!r})"

    @classmethod
    def open(cls, path: str | os.PathLike) -> Bundle:
        p = Path(path)
        if p.exists() and not p.is_dir():
            raise BundleError(f"bundle {p} is a file, not a bundle directory; {REBUILD}")
        if not p.is_dir():
            raise BundleError(
                f"bundle directory {p} does not exist; build one with "
                "`flint-aot build configs/flint.yaml -o DIR`, or point FLINT_AOT_BUNDLE / "
                "loader.load_bundle() at an existing one"
            )
        return cls(p.resolve(), Manifest.load(p))

    def file_path(self, entry: KernelEntry) -> Path:
        f = (self.path / entry.file).resolve()
        if self.path not in f.parents:
            raise ManifestError(f"{self.path}: file {entry.file!r} leaves the bundle directory; {REBUILD}")
        return f

    def read(self, entry: KernelEntry) -> bytes:
        """The cubin's bytes, checked against the manifest (size, sha256, ELF entry/params/block)."""
        f = self.file_path(entry)
        try:
            data = f.read_bytes()
        except OSError as e:
            raise BundleError(f"{f}: cannot read ({e.strerror}); {REBUILD}") from None
        problems = check_cubin(entry, data)
        if problems:
            raise BundleError(
                f"{f} ({entry.name}, {entry.arch}) is corrupt: {'; '.join(problems)}; {REBUILD}"
            )
        return data

    def verify(self) -> dict[str, list[str]]:
        """Check the bundle both ways: every manifest entry against its file (size, sha256, ELF entry,
        parameters, block; never raises on a malformed cubin), and every file in the bundle directory
        against the manifest (a file no entry names is reported under its own name).
        Returns {label: problems}, all lists empty when the bundle is sound."""
        out: dict[str, list[str]] = {}
        owner: dict[str, str] = {}
        for e in self.manifest.kernels:
            label = f"{e.name}@{e.arch}"
            problems = out.setdefault(label, [])
            if e.file in owner:
                problems.append(f"file {e.file} is also {owner[e.file]}'s")
            owner.setdefault(e.file, label)
            try:
                problems += check_cubin(e, self.file_path(e).read_bytes())
            except ManifestError as err:
                problems.append(str(err))
            except OSError as err:
                problems.append(f"{e.file}: cannot read ({err.strerror or err})")
        try:
            present = sorted(p.name for p in self.path.iterdir())
        except OSError as err:
            return dict(out, **{str(self.path): [f"cannot list the bundle directory ({err.strerror})"]})
        for name in present:
            if name != MANIFEST_NAME and name not in owner:
                out[name] = ["not in the manifest (a stray or orphaned file: rebuild or remove it)"]
        return out

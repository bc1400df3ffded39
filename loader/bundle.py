"""A bundle on disk: its manifest plus checked access to its cubins (stdlib only)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from loader.abi import MAX_TOKENS
from loader.elf import check_cubin
from loader.manifest import Manifest, ManifestError


class BundleError(ValueError):
    """A bundle file that cannot be trusted; the message says how to fix it."""


REBUILD = "rebuild the bundle (`flint-aot build CONFIG -o BUNDLE`) or redeploy it"


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

    def max_tokens(self, kind: str) -> int:
        """The most tokens a call of the unfused norm or per-head op may have with this bundle: its config's
        `max_tokens` of that kind (docs/config.md)."""
        section = self.manifest.config.get(kind)
        return int(section.get("max_tokens", MAX_TOKENS)) if isinstance(section, dict) else MAX_TOKENS

    def file_path(self, entry) -> Path:
        f = (self.path / entry.file).resolve()
        if self.path not in f.parents:
            raise ManifestError(f"{self.path}: file {entry.file!r} leaves the bundle directory; {REBUILD}")
        return f

    def read(self, entry) -> bytes:
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

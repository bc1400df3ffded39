"""`flint-aot verify`: a bundle checked both ways (stdlib only, no GPU)."""

from __future__ import annotations

from loader.bundle import Bundle
from loader.elf import check_cubin
from loader.manifest import MANIFEST_NAME, ManifestError


def verify(bundle: Bundle) -> dict[str, list[str]]:
    """Check the bundle both ways: every manifest entry against its file (size, sha256, ELF entry,
    parameters, block; never raises on a malformed cubin), and every file in the bundle directory
    against the manifest (a file no entry names is reported under its own name).
    Returns {label: problems}, all lists empty when the bundle is sound."""
    out: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    for e in bundle.manifest.kernels:
        label = f"{e.name}@{e.arch}"
        problems = out.setdefault(label, [])
        if e.file in owner:
            problems.append(f"file {e.file} is also {owner[e.file]}'s")
        owner.setdefault(e.file, label)
        try:
            problems += check_cubin(e, bundle.file_path(e).read_bytes())
        except ManifestError as err:
            problems.append(str(err))
        except OSError as err:
            problems.append(f"{e.file}: cannot read ({err.strerror or err})")
    try:
        present = sorted(p.name for p in bundle.path.iterdir())
    except OSError as err:
        return dict(out, **{str(bundle.path): [f"cannot list the bundle directory ({err.strerror})"]})
    for name in present:
        if name != MANIFEST_NAME and name not in owner:
            out[name] = ["not in the manifest (a stray or orphaned file: rebuild or remove it)"]
    return out

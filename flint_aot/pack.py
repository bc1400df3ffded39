"""`flint-aot pack`: a bundle plus the loader as one installable wheel, for a serving image that has only
torch and cuda-bindings. The wheel is the loader's own distribution (flint-aot-loader, built from
loader/pyproject.toml) with the bundle added as package data (loader/_bundle), where the loader finds it
with no environment variable: installing it replaces a plain loader install, so one distribution owns
each file. Built with setuptools through pip (no network: --no-build-isolation).

The wheel is byte-reproducible: same bundle and loader sources, same bytes (fixed timestamps through
SOURCE_DATE_EPOCH and again when the archive is normalized, fixed file modes, the order setuptools writes).
Scratch files live in a folder beside the wheel (.flint-aot-pack-PID-*), removed afterwards, or by the next
pack if this one was killed; nothing goes to the system temp dir."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from flint_aot.builder import BuildError, _sweep, check_writable_dir
from flint_aot.verify import verify
from loader.bundle import Bundle
from loader.manifest import MANIFEST_NAME, sha256_bytes

PACKAGED = "_bundle"  # loader/_bundle: see loader.runtime.packaged_bundle
EPOCH = 315532800  # 1980-01-01T00:00:00Z, the earliest time a zip archive can record
_SCRATCH = ".flint-aot-pack-"
# what a checkout's loader/ may hold besides the project's own files (editable installs, local builds)
_NOT_SHIPPED = ("__pycache__", "*.pyc", "*.egg-info", "build", "dist", PACKAGED)


class PackError(RuntimeError):
    pass


def loader_project() -> Path:
    """The loader's source project: the directory of the `loader` package, holding its pyproject.toml (a
    checkout, or an editable install of it)."""
    spec = importlib.util.find_spec("loader")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        if (Path(d) / "pyproject.toml").is_file():
            return Path(d)
    raise PackError(
        f"flint-aot pack builds the flint-aot-loader wheel from the loader's source project "
        f"(loader/pyproject.toml), which the loader found here ({', '.join(dirs) or 'none'}) does not have; "
        "run it from a checkout: pip install -e ./loader -e ."
    )


def _set_version(pyproject: str, version: str) -> str:
    text, n = re.subn(r'(?m)^version = "[^"]*"', f'version = "{version}"', pyproject, count=1)
    if n != 1:
        raise PackError('loader/pyproject.toml has no `version = "..."` line to stamp the bundle into')
    return text


def pack(bundle_dir, out_dir) -> Path:
    """Write flint_aot_loader-VERSION-py3-none-any.whl into out_dir and return its path. VERSION is the
    loader project's version plus a local label from the manifest's sha256 (0.1.0+b<12 hex digits>), so two
    different bundles never share a version and `flint-aot-loader==0.1.0` still accepts it."""
    out_dir = Path(out_dir).absolute()
    try:
        check_writable_dir(out_dir, "wheel folder (-o)", "choose another -o")
    except BuildError as e:
        raise PackError(str(e)) from None
    src = loader_project()
    b = Bundle.open(bundle_dir)
    bad = {label: p for label, p in verify(b).items() if p}
    if bad:
        what = "; ".join(f"{k}: {v}" for k, v in bad.items())
        raise PackError(f"bundle {b.path} does not verify ({what}); rebuild it: "
                        "flint-aot build CONFIG -o BUNDLE")  # fmt: skip
    pyproject = (src / "pyproject.toml").read_text(encoding="utf-8")
    base = re.search(r'(?m)^version = "([^"+]*)', pyproject)
    tag = sha256_bytes((b.path / MANIFEST_NAME).read_bytes())[:12]
    version = f"{base.group(1) if base else '0'}+b{tag}"
    out_dir.mkdir(parents=True, exist_ok=True)
    _sweep(out_dir, _SCRATCH)
    scratch = Path(tempfile.mkdtemp(prefix=f"{_SCRATCH}{os.getpid()}-", dir=out_dir))
    try:
        proj = scratch / "loader"
        shutil.copytree(src, proj, ignore=shutil.ignore_patterns(*_NOT_SHIPPED))
        (proj / "pyproject.toml").write_text(_set_version(pyproject, version), encoding="utf-8")
        (proj / PACKAGED).mkdir()
        shutil.copyfile(b.path / MANIFEST_NAME, proj / PACKAGED / MANIFEST_NAME)
        for e in b.manifest.kernels:
            shutil.copyfile(b.file_path(e), proj / PACKAGED / e.file)
        built = scratch / "dist"
        env = dict(os.environ, SOURCE_DATE_EPOCH=str(EPOCH), TMPDIR=str(scratch), PYTHONHASHSEED="0")
        r = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
             "-w", str(built), str(proj)],
            capture_output=True, text=True, env=env, cwd=scratch,
        )  # fmt: skip
        if r.returncode != 0:
            raise PackError(f"pip wheel failed:\n{r.stdout}{r.stderr}")
        wheels = sorted(built.glob("*.whl"))
        if len(wheels) != 1:
            raise PackError(f"expected one wheel from pip, found {[w.name for w in wheels]}")
        _check_contents(wheels[0], b)
        dest = out_dir / wheels[0].name
        _normalize(wheels[0], scratch / "normalized.whl")
        os.replace(scratch / "normalized.whl", dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return dest


def _check_contents(whl: Path, b: Bundle) -> None:
    """The wheel holds the bundle and only the loader package (a stray file in the project would ship)."""
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
    want = {f"loader/{PACKAGED}/{MANIFEST_NAME}"} | {
        f"loader/{PACKAGED}/{e.file}" for e in b.manifest.kernels
    }
    if not want <= names:
        raise PackError(f"the wheel lacks {sorted(want - names)}; check loader/pyproject.toml's package-data")
    foreign = sorted(n for n in names if not n.startswith(("loader/", whl.name.split("-")[0] + "-")))
    if foreign:
        raise PackError(f"the wheel would ship files outside the loader package: {foreign}")


def _normalize(src: Path, dst: Path) -> None:
    """Rewrite the wheel with every entry's timestamp EPOCH and mode 0644 (directories 0755), in the order
    setuptools wrote them (dist-info last): the bytes then depend only on the files' contents."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            out = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
            out.create_system = 3  # Unix, so that external_attr holds the mode
            directory = info.filename.endswith("/")
            out.external_attr = ((0o40755 if directory else 0o100644) << 16) | (0x10 if directory else 0)
            out.compress_type = zipfile.ZIP_STORED if directory else zipfile.ZIP_DEFLATED
            zout.writestr(out, zin.read(info), compresslevel=6)

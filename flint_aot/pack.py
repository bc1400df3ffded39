"""`flint-aot pack`: a bundle plus the loader as one installable wheel, for a serving image that has only
torch and cuda-bindings. The bundle is installed inside the package (loader/_bundle), where the loader finds
it with no environment variable. Built with setuptools through pip (no network: --no-build-isolation).

The wheel is byte-reproducible: same bundle and loader sources, same bytes (fixed timestamps through
SOURCE_DATE_EPOCH and again when the archive is normalized, fixed file modes, the order setuptools writes).
Scratch files live in a folder beside the wheel (.flint-aot-pack-PID-*), removed afterwards, or by the next
pack if this one was killed; nothing goes to the system temp dir."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from flint_aot import __version__
from flint_aot.builder import BuildError, _sweep, check_writable_dir
from loader.bundle import Bundle
from loader.manifest import MANIFEST_NAME, sha256_bytes

LOADER_DIR = Path(__file__).resolve().parent.parent / "loader"
PACKAGED = "_bundle"  # loader/_bundle: see loader.runtime.packaged_bundle
EPOCH = 315532800  # 1980-01-01T00:00:00Z, the earliest time a zip archive can record
_SCRATCH = ".flint-aot-pack-"


class PackError(RuntimeError):
    pass


def pack(bundle_dir, out_dir, name: str = "flint-aot-loader") -> Path:
    """Write NAME-VERSION-py3-none-any.whl into out_dir and return its path. VERSION is flint-aot's version
    plus a local label from the manifest's sha256, so two different bundles never share a version."""
    out_dir = Path(out_dir).absolute()
    try:
        check_writable_dir(out_dir, "wheel folder (-o)", "choose another -o")
    except BuildError as e:
        raise PackError(str(e)) from None
    b = Bundle.open(bundle_dir)
    bad = {label: p for label, p in b.verify().items() if p}
    if bad:
        what = "; ".join(f"{k}: {v}" for k, v in bad.items())
        raise PackError(f"bundle {b.path} does not verify ({what}); rebuild it: "
                        "flint-aot build CONFIG -o BUNDLE")  # fmt: skip
    tag = sha256_bytes((b.path / MANIFEST_NAME).read_bytes())[:12]
    version = f"{__version__}+b{tag}"
    out_dir.mkdir(parents=True, exist_ok=True)
    _sweep(out_dir, _SCRATCH)
    scratch = Path(tempfile.mkdtemp(prefix=f"{_SCRATCH}{os.getpid()}-", dir=out_dir))
    try:
        proj = scratch / "proj"
        pkg = proj / "loader"
        shutil.copytree(LOADER_DIR, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", PACKAGED))
        (pkg / PACKAGED).mkdir()
        shutil.copyfile(b.path / MANIFEST_NAME, pkg / PACKAGED / MANIFEST_NAME)
        for e in b.manifest.kernels:
            shutil.copyfile(b.file_path(e), pkg / PACKAGED / e.file)
        (proj / "pyproject.toml").write_text(
            "[build-system]\n"
            'requires = ["setuptools>=70.1"]\n'
            'build-backend = "setuptools.build_meta"\n\n'
            "[project]\n"
            f'name = "{name}"\n'
            f'version = "{version}"\n'
            f'description = "flint-aot loader with its kernel bundle ({", ".join(b.manifest.archs())})"\n'
            'requires-python = ">=3.10"\n'
            'dependencies = ["torch>=2.6,<3", "cuda-bindings>=12.8"]\n\n'
            "[tool.setuptools]\n"
            'packages = ["loader"]\n\n'
            "[tool.setuptools.package-data]\n"
            f'loader = ["{PACKAGED}/*"]\n'
        )
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
        dest = out_dir / wheels[0].name
        _normalize(wheels[0], scratch / "normalized.whl")
        os.replace(scratch / "normalized.whl", dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return dest


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

"""`flint-aot pack`: a bundle plus the loader as one installable wheel, for a serving image that has only
torch and cuda-bindings. The bundle is installed inside the package (loader/_bundle), where the loader finds
it with no environment variable. Built with setuptools through pip (no network: --no-build-isolation)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from flint_aot import __version__
from flint_aot.builder import BuildError, check_writable_dir
from loader.bundle import Bundle
from loader.manifest import MANIFEST_NAME, sha256_bytes

LOADER_DIR = Path(__file__).resolve().parent.parent / "loader"
PACKAGED = "_bundle"  # loader/_bundle: see loader.runtime.packaged_bundle


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
    with tempfile.TemporaryDirectory(prefix="flint-aot-pack-") as d:
        proj = Path(d) / "proj"
        pkg = proj / "loader"
        shutil.copytree(LOADER_DIR, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", PACKAGED))
        (pkg / PACKAGED).mkdir()
        shutil.copy2(b.path / MANIFEST_NAME, pkg / PACKAGED / MANIFEST_NAME)
        for e in b.manifest.kernels:
            shutil.copy2(b.file_path(e), pkg / PACKAGED / e.file)
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
        r = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
             "-w", str(out_dir), str(proj)],
            capture_output=True, text=True,
        )  # fmt: skip
        if r.returncode != 0:
            raise PackError(f"pip wheel failed:\n{r.stdout}{r.stderr}")
    wheels = sorted(out_dir.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if len(wheels) != 1:
        raise PackError(f"expected one wheel in {out_dir}, found {[w.name for w in wheels]}")
    return wheels[0]

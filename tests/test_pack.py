"""`flint-aot pack`: the wheel installs into a fresh venv that has only torch and cuda-bindings;
there `import loader` finds the packed bundle by itself, and neither the DSL nor flint_aot is installed."""

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import pytest
from click.testing import CliRunner

from flint_aot.cli import main
from tests.conftest import needs_dsl

pytestmark = needs_dsl

PROBE = """
import importlib.util, json, loader
b = loader.current_bundle()
print(json.dumps({
    "bundle": str(b.path),
    "loader": loader.__file__,
    "variants": sorted(f"{e.name}@{e.arch}" for e in b.manifest.kernels),
    "verify": all(not p for p in b.verify().values()),
    "cutlass": importlib.util.find_spec("cutlass") is not None,
    "flint_aot": importlib.util.find_spec("flint_aot") is not None,
}))
"""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from flint_aot.builder import build

    d = tmp_path_factory.mktemp("pack")
    (d / "c.yaml").write_text("archs: [sm_90a, sm_100a]\nnorm:\n  residual: [true, false]\n")
    # a cache shared by the modules that only need a sound bundle (the same norm cubins)
    build(d / "c.yaml", d / "bundle", jobs=2, cache_dir=tmp_path_factory.getbasetemp() / "shared-cache")
    return d / "bundle"


def test_pack_installs_into_a_fresh_venv(bundle, tmp_path):
    from loader.bundle import Bundle

    r = CliRunner().invoke(main, ["pack", str(bundle), "-o", str(tmp_path / "dist")])
    assert r.exit_code == 0, r.output
    (whl,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "loader/_bundle/manifest.json" in names and "loader/ops.py" in names
    assert not any(n.startswith("flint_aot/") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # torch 2.13.0: the CPU build on the build machine (README); the wheel itself asks for torch>=2.6,<3
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0", "cuda-bindings>=12.8",
                          str(whl)], capture_output=True, text=True)  # fmt: skip
    assert pip.returncode == 0, pip.stderr
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no PYTHONPATH, no FLINT_AOT_BUNDLE
    out = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["loader"].startswith(str(venv)) and got["bundle"].startswith(str(venv))
    expect = sorted(f"{e.name}@{e.arch}" for e in Bundle.open(bundle).manifest.kernels)
    assert got["variants"] == expect and got["verify"]
    assert not got["cutlass"] and not got["flint_aot"]


def test_pack_is_reproducible_and_leaves_nothing_behind(bundle, tmp_path, monkeypatch):
    """Two packs of the same bundle (other folders, other times) are the same bytes; scratch files go
    neither to the system temp dir nor stay beside the wheel."""
    systmp = tmp_path / "systmp"
    systmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(systmp))
    monkeypatch.setattr(tempfile, "tempdir", str(systmp))
    digests = []
    for i in range(2):
        r = CliRunner().invoke(main, ["pack", str(bundle), "-o", str(tmp_path / f"dist{i}")])
        assert r.exit_code == 0, r.output
        (whl,) = (tmp_path / f"dist{i}").iterdir()  # the wheel only
        digests.append(hashlib.sha256(whl.read_bytes()).hexdigest())
        if i == 0:
            time.sleep(2.1)  # zip timestamps have 2 s resolution: a clock-based one would differ
    assert digests[0] == digests[1]
    assert not list(systmp.iterdir()), list(systmp.iterdir())
    with zipfile.ZipFile(whl) as z:
        assert {i.date_time for i in z.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        assert {i.external_attr >> 16 for i in z.infolist()} == {0o100644}


def test_pack_refuses_a_corrupt_bundle(bundle, tmp_path):
    bad = shutil.copytree(bundle, tmp_path / "bundle")
    cubin = next(bad.glob("*.cubin"))
    data = bytearray(cubin.read_bytes())
    data[-1] ^= 1
    cubin.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["pack", str(bad), "-o", str(tmp_path / "dist")])
    assert r.exit_code != 0 and "does not verify" in r.output and "flint-aot build" in r.output
    assert not (tmp_path / "dist").exists() or not list((tmp_path / "dist").glob("*.whl"))

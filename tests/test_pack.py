"""`flint-aot pack`: the serving wheel is the flint-aot-loader distribution with the bundle inside. In a fresh
venv holding only torch and cuda-bindings, `import loader` finds the packed bundle by itself, the
self-check and the NVFP4 helpers work, neither the DSL nor flint_aot is there; installing the build
package (flint-aot) beside it and uninstalling it again leaves the loader intact (one owner per file)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import pytest
from click.testing import CliRunner

from flint_aot.cli import main
from tests.conftest import ROOT, needs_dsl

pytestmark = needs_dsl

PROBE = """
import importlib.util, json, loader
from loader.elf import check_cubin
b = loader.current_bundle()
print(json.dumps({
    "bundle": str(b.path),
    "loader": loader.__file__,
    "variants": sorted(f"{e.name}@{e.arch}" for e in b.manifest.kernels),
    "verify": not any(check_cubin(e, b.file_path(e).read_bytes()) for e in b.manifest.kernels),
    "cutlass": importlib.util.find_spec("cutlass") is not None,
    "flint_aot": importlib.util.find_spec("flint_aot") is not None,
}))
"""

# NVFP4 helpers of the installed wheel against a float64 decoding written here from the format's definition
# (docs/nvfp4.md): e2m1 codes (sign, 2 exponent bits, 1 mantissa bit; low nibble first), e4m3 block scales
# of 16 elements in the 128x4-swizzled layout, one fp32 global scale.
NVFP4_PROBE = """
import torch
from loader import nvfp4

g = torch.Generator().manual_seed(7)
lin = torch.randint(0, 256, (300, 128), dtype=torch.uint8, generator=g)
sw = nvfp4.swizzle_scales(lin)
assert sw.dtype == torch.uint8 and sw.shape == (384, 128), sw.shape
assert torch.equal(nvfp4.unswizzle_scales(sw, 300), lin)
flat = sw.reshape(-1)
for r, c in [(0, 0), (1, 0), (31, 5), (32, 0), (127, 127), (128, 4), (299, 126)]:
    off = ((r // 128) * (128 // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    assert flat[off] == lin[r, c], (r, c)
assert not nvfp4.unswizzle_scales(sw, 384)[300:].any()  # rows 300..383: zero padding

n, k = 300, 2048
rows = torch.rand(n, 1, generator=g, dtype=torch.float64) * 3  # rows of different magnitudes
w = (torch.randn(n, k, generator=g, dtype=torch.float64) * rows).to(torch.bfloat16)
packed, scales, gs = nvfp4.quantize(w)
assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
assert scales.shape == (384, k // 16) and scales.dtype == torch.float8_e4m3fn and gs.shape == (1,)

def e2m1(code):
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))

table = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)
p = packed.long()
codes = torch.stack((p & 15, p >> 4), dim=-1).reshape(n, k)
sflat = scales.view(torch.uint8).reshape(-1)
r = torch.arange(n).view(n, 1)
c = torch.arange(k // 16).view(1, -1)
off = ((r // 128) * (k // 16 // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
block_scale = sflat[off].view(torch.float8_e4m3fn).to(torch.float64)        # [n, k/16]
ref = table[codes] * block_scale.repeat_interleave(16, dim=1) * float(gs)
got = nvfp4.dequantize(packed, scales, gs)
assert got.dtype == torch.float64 and torch.equal(got, ref), (got - ref).abs().max()
err = ((ref - w.double()).norm() / w.double().norm()).item()
assert err < 0.12, err  # 4-bit values with e4m3 block scales: ~8 % relative error on Gaussian weights
print("nvfp4 ok", err)
"""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from flint_aot.builder import build

    d = tmp_path_factory.mktemp("pack")
    (d / "c.yaml").write_text("archs: [sm_90a, sm_100a]\nnorm:\n  residual: [true, false]\n")
    # a cache shared by the modules that only need a sound bundle (the same norm cubins)
    build(d / "c.yaml", d / "bundle", jobs=2, cache_dir=tmp_path_factory.getbasetemp() / "shared-cache")
    return d / "bundle"


class Venv:
    """A plain venv (no system site-packages) with torch 2.13.0 (the CPU build on the build machine, as
    .ci/run installs it), cuda-bindings and the packed wheel; commands run with no PYTHONPATH, outside the
    checkout."""

    def __init__(self, root, wheel):
        self.root, self.wheel = root, wheel
        subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True)
        self.py = root / "venv" / "bin" / "python"
        self.env = {"PATH": f"{self.py.parent}:/usr/bin:/bin", "HOME": str(root)}
        self.env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})  # local wheels
        self.pip("install", "-q", "--no-compile", "torch==2.13.0", "cuda-bindings>=12.8", str(wheel))

    def run(self, *args, check=True):
        r = subprocess.run([str(self.py), *args], capture_output=True, text=True, cwd=self.root, env=self.env)
        assert r.returncode == 0 or not check, f"{args}: {r.stdout}{r.stderr}"
        return r

    def pip(self, *args):
        return self.run("-m", "pip", *args)

    def probe(self) -> dict:
        return json.loads(self.run("-c", PROBE).stdout)


@pytest.fixture(scope="module")
def served(bundle, tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    r = CliRunner().invoke(main, ["pack", str(bundle), "-o", str(d / "dist")])
    assert r.exit_code == 0, r.output
    (whl,) = (d / "dist").glob("*.whl")
    return Venv(d, whl)


def test_wheel_is_the_loader_distribution_with_the_bundle(served, bundle):
    from loader.bundle import Bundle

    whl = served.wheel
    assert whl.name.startswith("flint_aot_loader-0.1.0+b") and whl.name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(whl).namelist()
    for module in ("__init__", "ops", "runtime", "doctor", "nvfp4", "reference", "abi", "manifest", "elf"):
        assert f"loader/{module}.py" in names, module
    kernels = Bundle.open(bundle).manifest.kernels
    assert sorted(n for n in names if n.startswith("loader/_bundle/")) == sorted(
        ["loader/_bundle/manifest.json"] + [f"loader/_bundle/{e.file}" for e in kernels]
    )
    assert all(n.startswith(("loader/", "flint_aot_loader-")) for n in names), names
    assert not any(n.endswith(("pyproject.toml", ".pyc")) or ".egg-info" in n for n in names)


def test_pack_installs_into_a_fresh_venv(served, bundle):
    from loader.bundle import Bundle

    got = served.probe()
    venv = str(served.root / "venv")
    assert got["loader"].startswith(venv) and got["bundle"].startswith(venv)
    expect = sorted(f"{e.name}@{e.arch}" for e in Bundle.open(bundle).manifest.kernels)
    assert got["variants"] == expect and got["verify"]
    assert not got["cutlass"] and not got["flint_aot"]


def test_serving_wheel_has_the_doctor_and_the_nvfp4_helpers(served):
    r = served.run("-m", "loader.doctor", "--help")
    assert "usage: python -m loader.doctor" in r.stdout, r.stdout
    r = served.run("-c", NVFP4_PROBE)
    assert r.stdout.startswith("nvfp4 ok"), r.stdout + r.stderr


def test_build_package_owns_no_loader_file(served, tmp_path):
    """`pip install flint-aot` beside the serving wheel, then `pip uninstall flint-aot`: the loader and its
    bundle stay (before the split, flint-aot also held loader/ and its uninstall deleted the loader)."""
    src = tmp_path / "src"  # the checkout's build-package sources, so that building leaves the checkout as is
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    for d in ("flint_aot", "loader"):  # loader/ is there in a checkout too: flint-aot must not pick it up
        shutil.copytree(ROOT / d, src / d, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # the wheel `pip install --no-deps <checkout>` builds (here with this environment's setuptools)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "w"), str(src)], check=True, capture_output=True)  # fmt: skip
    (whl,) = (tmp_path / "w").glob("flint_aot-*.whl")
    served.pip("install", "-q", "--no-deps", str(whl))
    (site,) = (served.root / "venv" / "lib").glob("python3*/site-packages")
    (record,) = site.glob("flint_aot-*.dist-info/RECORD")
    owned = [ln.split(",")[0] for ln in record.read_text().splitlines()]
    assert any(f.startswith("flint_aot/") for f in owned)
    assert not [f for f in owned if f.startswith("loader/")], "flint-aot must not own loader files"
    assert served.probe()["flint_aot"]

    served.pip("uninstall", "-y", "-q", "flint-aot")
    got = served.probe()
    assert got["verify"] and got["bundle"].startswith(str(site)) and not got["flint_aot"]
    assert served.run("-m", "loader.doctor", "--help").returncode == 0


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

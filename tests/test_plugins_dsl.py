"""Plugin kernels through the real build (needs the DSL): the example (examples/custom_kernel) compiles beside
Flint's norm kernel into one verified bundle, with its parameters by name and its version in the manifest; a
second build finds it cached; a copy elsewhere with a fresh cache gives the same bytes; changing the plugin's
source recompiles it and nothing else. Each misuse of the config's plugins section is one line naming the
file, the key and the fix, before anything compiles."""

import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile

import pytest
from click.testing import CliRunner

from flint_aot.cli import main
from loader.abi import CALLER_GRID
from loader.bundle import Bundle
from loader.manifest import Param
from tests.conftest import ROOT, needs_dsl

pytestmark = needs_dsl

EXAMPLE = ROOT / "examples" / "custom_kernel"
CONFIG = """archs: [sm_90a]
norm: {residual: [true]}
plugins:
  silu_mul:
    module: silu_mul.kernel
    class: SiluMulKernel
    spec: {intermediate: [6144]}
"""


def _project(d):
    """The example's kernel package and a small config beside it, in d (the config's folder is where the
    build finds the module)."""
    d.mkdir(parents=True, exist_ok=True)
    shutil.copytree(EXAMPLE / "silu_mul", d / "silu_mul", ignore=shutil.ignore_patterns("__pycache__"))
    (d / "c.yaml").write_text(CONFIG)
    return d / "c.yaml"


def _files(p):
    return {f.name: f.read_bytes() for f in sorted(p.iterdir())}


def _sources_sha256(pkg):
    """The hash docs/plugins.md describes, computed here from its definition: every .py file of the package,
    by its path relative to the package's parent, sorted."""
    h = hashlib.sha256()
    for p in sorted(pkg.rglob("*.py"), key=lambda p: p.relative_to(pkg.parent).as_posix()):
        h.update(p.relative_to(pkg.parent).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from flint_aot.builder import build

    d = tmp_path_factory.mktemp("plugin")
    cfg = _project(d / "src")
    res = build(cfg, d / "bundle", jobs=2, cache_dir=d / "cache")
    return d, cfg, res


def test_the_example_compiles_into_the_bundle_with_its_abi_and_version(built):
    d, cfg, res = built
    assert sorted((r.spec.name, r.status) for r in res.rows) == [
        ("norm_res1", "compiled"), ("silu_mul_intermediate6144", "compiled")]  # fmt: skip
    m = Bundle.open(d / "bundle").manifest
    (e,) = [e for e in m.kernels if e.kind == "silu_mul"]
    assert (e.name, e.spec, e.arch, e.file) == ("silu_mul_intermediate6144", {"intermediate": 6144}, "sm_90a",
                                                "silu_mul_intermediate6144.sm_90a.cubin")  # fmt: skip
    assert e.params == (Param("x", "ptr", 16), Param("out", "ptr", 16), Param("m", "i32", 0))
    assert e.grid == CALLER_GRID and e.block == (128, 1, 1) and e.cluster == (1, 1, 1) and e.dyn_smem == 0
    assert e.entry == "flint_silu_mul_intermediate6144_0" and e.registers > 0
    assert m.plugins == {"silu_mul": {
        "module": "silu_mul.kernel", "class": "SiluMulKernel", "version": None,
        "files": ["silu_mul/__init__.py", "silu_mul/abi.py", "silu_mul/kernel.py"],
        "source_sha256": _sources_sha256(cfg.parent / "silu_mul")}}  # fmt: skip
    assert m.config["plugins"] == {"silu_mul": {"module": "silu_mul.kernel", "class": "SiluMulKernel",
                                                "spec": {"intermediate": [6144]}}}  # fmt: skip
    r = CliRunner().invoke(main, ["verify", str(d / "bundle")])
    assert r.exit_code == 0 and "ok   silu_mul_intermediate6144@sm_90a" in r.output and "2 cubins" in r.output
    r = CliRunner().invoke(main, ["list", str(d / "bundle")])
    sha = m.plugins["silu_mul"]["source_sha256"][:12]
    assert "flint_silu_mul_intermediate6144_0" in r.output, r.output
    assert f"plugin silu_mul: silu_mul.kernel.SiluMulKernel, sources sha256 {sha}" in r.output, r.output


def test_a_second_build_finds_the_plugin_cached(built, tmp_path):
    from flint_aot.builder import build

    d, cfg, _ = built
    res = build(cfg, tmp_path / "again", cache_dir=d / "cache")
    assert res.compiled == 0 and {r.status for r in res.rows} == {"cached"}
    assert _files(tmp_path / "again") == _files(d / "bundle")


def test_a_changed_plugin_source_recompiles_the_plugin_and_nothing_else(built, tmp_path):
    """A copy of the project elsewhere, built by the CLI with a fresh cache from another working directory,
    gives the same bytes (the key and the manifest hold no path); then an edit of the plugin's kernel module
    recompiles the plugin alone, an edit beside the package nothing."""
    d, _, _ = built
    cfg = _project(tmp_path / "elsewhere")
    cli = [sys.executable, "-m", "flint_aot.cli", "build", str(cfg), "-o", str(tmp_path / "b"), "--cache-dir",
           str(tmp_path / "cache")]  # fmt: skip

    def build():
        r = subprocess.run(cli, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr
        rows = [ln.split() for ln in r.stdout.splitlines()]
        return {row[0]: row[2] for row in rows if len(row) > 2 and row[2] in ("compiled", "cached")}

    assert build() == {"norm_res1": "compiled", "silu_mul_intermediate6144": "compiled"}
    assert _files(tmp_path / "b") == _files(d / "bundle")
    before = Bundle.open(tmp_path / "b").manifest
    kernel = cfg.parent / "silu_mul" / "kernel.py"
    kernel.write_text(kernel.read_text() + "\n# an edit of the plugin's source\n")
    assert build() == {"norm_res1": "cached", "silu_mul_intermediate6144": "compiled"}
    after = Bundle.open(tmp_path / "b").manifest
    assert after.plugins["silu_mul"]["source_sha256"] == _sources_sha256(cfg.parent / "silu_mul")
    assert after.plugins["silu_mul"]["source_sha256"] != before.plugins["silu_mul"]["source_sha256"]
    keys = lambda m: {e.name: e.build_key for e in m.kernels}  # noqa: E731
    assert keys(after)["norm_res1"] == keys(before)["norm_res1"]
    assert keys(after)["silu_mul_intermediate6144"] != keys(before)["silu_mul_intermediate6144"]
    (cfg.parent / "notes.py").write_text("# beside the package, not part of it\n")
    assert build() == {"norm_res1": "cached", "silu_mul_intermediate6144": "cached"}


def test_pack_ships_the_plugin_kernel(built, tmp_path):
    d, _, _ = built
    r = CliRunner().invoke(main, ["pack", str(d / "bundle"), "-o", str(tmp_path / "dist")])
    assert r.exit_code == 0, r.output
    (whl,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "loader/_bundle/silu_mul_intermediate6144.sm_90a.cubin" in names
    assert "loader/kernels.py" in names and not [n for n in names if "silu_mul/" in n]
    packed = json.loads(zipfile.ZipFile(whl).read("loader/_bundle/manifest.json"))
    assert packed["plugins"]["silu_mul"]["class"] == "SiluMulKernel"


# A plugin of two axes written out of alphabetical order (mode before intermediate): the example's kernel
# with a second axis, which it records and does not use.
_TWO_AXES = """from silu_mul.kernel import SiluMulKernel


class Modes(SiluMulKernel):
    def __init__(self, spec):
        spec = dict(spec)
        self.mode = spec.pop("mode")
        if self.mode not in ("fast", "exact"):
            raise ValueError(f"mode must be fast or exact, got {self.mode!r}")
        super().__init__(spec)


KERNEL = Modes
"""


def test_a_fresh_bundle_of_a_plugin_with_axes_out_of_alphabetical_order_verifies(tmp_path):
    """A plugin whose spec's axes are not in alphabetical order, built into a fresh bundle: each cubin is
    named with the axes in alphabetical order (docs/plugins.md §2), and `flint-aot verify` finds every
    variant its recorded config (stored with sorted keys) expands to, every entry sound."""
    shutil.copytree(EXAMPLE / "silu_mul", tmp_path / "silu_mul", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "modes.py").write_text(_TWO_AXES)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("archs: [sm_90a]\nplugins:\n  act:\n    module: modes\n"
                   "    spec: {mode: [fast, exact], intermediate: [1024, 2048]}\n")  # fmt: skip
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "b"), "-j", "2", "--cache-dir",
                                  str(tmp_path / "cache")])  # fmt: skip
    assert r.exit_code == 0, r.output
    names = [f"act_intermediate{i}_mode{m}" for i in (1024, 2048) for m in ("exact", "fast")]
    assert sorted(p.name for p in (tmp_path / "b").glob("*.cubin")) == [f"{n}.sm_90a.cubin" for n in names]
    m = Bundle.open(tmp_path / "b").manifest
    assert sorted((e.name, e.entry, e.spec["mode"], e.spec["intermediate"]) for e in m.kernels) == sorted(
        (f"act_intermediate{i}_mode{md}", f"flint_act_intermediate{i}_mode{md}_0", md, i)
        for i in (1024, 2048) for md in ("exact", "fast"))  # fmt: skip
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "b")])
    assert r.exit_code == 0 and "4 cubins verified" in r.output, r.output
    assert sorted(ln.split()[1] for ln in r.output.splitlines() if ln.startswith("ok ")) == [
        f"{n}@sm_90a" for n in names]  # fmt: skip


# ----------------------------------------------------------------------------- misuse: one line each
_NOT_A_KERNEL = "class Plain:\n    def __init__(self, spec):\n        pass\n"
_RESERVED = """import cutlass.cute as cute
from cutlass import Int32
from flint_aot import Kernel


class Reserved(Kernel):
    def __init__(self, spec):
        pass

    @cute.kernel
    def kernel(self, x: cute.Pointer, stream: Int32):
        pass


KERNEL = Reserved
"""

_POLICY = """
import cutlass.cute as cute

from flint_aot import Kernel


class Spreads(Kernel):
    cluster_policy = "spread"  # without a cluster

    def __init__(self, spec):
        pass

    @cute.kernel
    def kernel(self, x: cute.Pointer):
        pass


KERNEL = Spreads
"""


@pytest.mark.parametrize("plugin, files, where, says", [
    ({"module": "nowhere_to_be_found"}, {}, "plugins.act.module",
     "cannot import 'nowhere_to_be_found' (ModuleNotFoundError: No module named 'nowhere_to_be_found'); "
     "install it, or put it in the config file's folder"),
    ({"module": "needs_dep"}, {"needs_dep.py": "import a_dependency_not_installed\n"}, "plugins.act.module",
     "cannot import 'needs_dep' (ModuleNotFoundError: No module named 'a_dependency_not_installed')"),
    ({"module": "raises"}, {"raises.py": "raise RuntimeError('no GPU at import time, please')\n"},
     "plugins.act.module",
     "importing 'raises' raised RuntimeError: no GPU at import time, please; fix the module"),
    ({"module": "plain", "class": "Plain"}, {"plain.py": _NOT_A_KERNEL}, "plugins.act.class",
     "plain.Plain is <class 'plain.Plain'>, not a subclass of flint_aot.Kernel; derive the kernel class from "
     "flint_aot.Kernel"),
    ({"module": "plain"}, {"plain.py": _NOT_A_KERNEL}, "plugins.act",
     "module 'plain' has no KERNEL; name its kernel class with plugins.act.class"),
    ({"module": "plain", "class": "Missing"}, {"plain.py": _NOT_A_KERNEL}, "plugins.act.class",
     "module 'plain' has no Missing"),
    ({"module": "silu_mul.kernel", "spec": {"intermdiate": [6144]}}, "example", "plugins.act.spec",
     "SiluMulKernel rejects the spec {'intermdiate': 6144} (ValueError: unknown spec key(s) ['intermdiate']; "
     "SiluMulKernel takes: intermediate); give the axes and values SiluMulKernel.__init__ accepts"),
    ({"module": "silu_mul.kernel", "spec": {"intermediate": [6144, 100]}}, "example", "plugins.act.spec",
     "SiluMulKernel rejects the spec {'intermediate': 100} (ValueError: intermediate must be a positive "
     "multiple of 8"),
    ({"module": "reserved"}, {"reserved.py": _RESERVED}, "plugins.act.class",
     "Reserved's kernel has a parameter named 'stream', a keyword of loader.launch_kernel; rename the "
     "parameter"),
    ({"module": "spreads"}, {"spreads.py": _POLICY}, "plugins.act.class",
     "Spreads: cluster_policy 'spread' needs a cluster (cluster is (1, 1, 1)) (docs/plugins.md §2)"),
])  # fmt: skip
def test_a_plugin_misuse_is_one_line_before_anything_compiles(tmp_path, plugin, files, where, says):
    """The build stops in its checks: one line (file, key, the problem, the fix), exit status 1, no cache
    entry and no bundle, though the config also asks for a built-in kernel."""
    if files == "example":
        shutil.copytree(EXAMPLE / "silu_mul", tmp_path / "silu_mul")
        files = {}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cfg = tmp_path / "cfg.yaml"
    config = {"archs": ["sm_90a"], "norm": {"residual": [True]}, "plugins": {"act": plugin}}
    cfg.write_text(json.dumps(config))  # (JSON is YAML)
    r = CliRunner().invoke(main, ["build", str(cfg), "-o", str(tmp_path / "out"), "--cache-dir",
                                  str(tmp_path / "cache")])  # fmt: skip
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {cfg}: {where}: "), r.output
    assert says in lines[0], lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_an_interrupt_during_the_plugin_check_stops_the_build_at_once(tmp_path):
    """SIGINT while the plugins' modules are being imported (here one that takes a minute, its process then
    frozen by SIGSTOP so that it can never finish by itself) kills the check process and stops the build
    with status 130: one line, the import never completed, nothing compiled or written. A build that waited
    for the check instead would wait for ever (STOP_TIMEOUT_S is that failure, not a speed bound)."""
    import os
    import signal
    import time

    from tests.test_cli_interrupt import STOP_TIMEOUT_S, _stopped

    (tmp_path / "slow.py").write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path({str(tmp_path / 'pid')!r}).write_text(str(os.getpid()))\n"
        "time.sleep(60)\n"
        f"pathlib.Path({str(tmp_path / 'imported')!r}).write_text('the import finished')\n"
    )
    cfg = tmp_path / "cfg.yaml"
    plugins = {"act": {"module": "slow"}}
    cfg.write_text(json.dumps({"archs": ["sm_90a"], "norm": {"residual": [True]}, "plugins": plugins}))
    cmd = [sys.executable, "-m", "flint_aot.cli", "build", str(cfg), "-o", str(tmp_path / "out"),
           "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    p = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    child = None
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
            assert p.poll() is None and time.monotonic() < deadline, "the check did not start"
            time.sleep(0.05)
        child = int((tmp_path / "pid").read_text())
        os.kill(child, signal.SIGSTOP)  # the check process cannot end by itself now
        while not _stopped(child):
            assert time.monotonic() < deadline, "could not freeze the check process"
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        out = p.communicate(timeout=STOP_TIMEOUT_S)[0]
    finally:
        if p.poll() is None:  # (a failure above: this test's build is not left running)
            p.kill()
            p.communicate()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    assert p.returncode == 130, (p.returncode, out)
    assert out.strip().splitlines() == [f"interrupted (SIGINT) while checking the plugin modules: nothing "
                                        f"compiled; {tmp_path / 'out'} untouched"], out  # fmt: skip
    assert not (tmp_path / "imported").exists(), "the check's import ran to its end"
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()

"""load_bundle without a GPU (docs/api.md §10), the CUDA driver calls of loader.runtime stubbed: a module is
loaded once per cubin content, whatever bundle or path names it, and never unloaded, so that launchers, plans
and CUDA graphs made before a reload keep working while calls after it run the new bundle's kernels; and a
plan built across a reload is not kept for the calls after it. (tests/test_reload_gpu.py runs the same under
load on a GPU.)"""

import hashlib
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from loader import plans, runtime
from loader.manifest import KernelEntry, Manifest, Param
from tests.conftest import HAS_GPU, ROOT


class _Driver:
    """loader.runtime's `cu`, the calls that load and unload modules recorded and answered without a GPU;
    everything else (the launch config types) is cuda-bindings' own."""

    def __init__(self):
        self.loads, self.unloads, self.handles = [], [], iter(range(0x1000, 1 << 40, 0x1000))

    def __getattr__(self, name):
        return getattr(_real_cu, name)

    def cuModuleLoadData(self, image):
        self.loads.append(hashlib.sha256(image).hexdigest())
        return (runtime._SUCCESS, next(self.handles))

    def cuModuleUnload(self, module):
        self.unloads.append(module)
        return (runtime._SUCCESS,)

    def cuModuleGetFunction(self, module, name):
        return (runtime._SUCCESS, module + 1)  # a function handle that names its module

    def cuDeviceGet(self, dev):
        return (runtime._SUCCESS, dev)

    def cuDevicePrimaryCtxRetain(self, device):
        return (runtime._SUCCESS, "context")

    def cuCtxPushCurrent(self, ctx):
        return (runtime._SUCCESS,)

    def cuCtxPopCurrent(self):
        return (runtime._SUCCESS, "context")

    def cuFuncSetAttribute(self, fn, attr, value):
        return (runtime._SUCCESS,)


_real_cu = runtime.cu


def _entry(residual: bool, data: bytes) -> KernelEntry:
    name = f"norm_res{int(residual)}"
    return KernelEntry("norm", name, {"residual": residual}, "sm_90a", f"{name}.sm_90a.cubin", len(data),
                       hashlib.sha256(data).hexdigest(), f"flint_{name}_0", (256, 1, 1), (1, 1, 1), 0,
                       ("M", 1, 1), (Param("x", "ptr", 16), Param("m", "i32")), "k")  # fmt: skip


def _write_bundle(path: Path, cubins: dict) -> Path:
    """A bundle directory holding `cubins` ({residual: bytes}) and its manifest."""
    path.mkdir()
    entries = [_entry(res, data) for res, data in cubins.items()]
    for e, data in zip(entries, cubins.values(), strict=True):
        (path / e.file).write_bytes(data)
    (path / "manifest.json").write_text(Manifest("flint-aot test", "4.8.1", {}, entries).dumps())
    return path


@pytest.fixture
def driver(monkeypatch):
    """A fresh module table and thread state in loader.runtime, on the stubbed driver; cubins 'verified' by
    their sha256 only (they are not ELF files), each verification recorded."""
    import loader.bundle

    d = _Driver()
    d.verified = []

    def check(entry, data):
        d.verified.append(entry.file)
        return [] if hashlib.sha256(data).hexdigest() == entry.sha256 else ["sha256 differs"]

    monkeypatch.setattr(runtime, "cu", d)
    monkeypatch.setattr(loader.bundle, "check_cubin", check)
    monkeypatch.setattr(runtime, "_modules", {})
    monkeypatch.setattr(runtime, "_module_loads", 0)
    monkeypatch.setattr(runtime, "_bundle", None)
    monkeypatch.setattr(runtime, "_tls", threading.local())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: None)  # (what the old reload called)
    return d


def _serve() -> list:
    """The launchers a new call of this thread would use for both norm kernels."""
    return [runtime.launcher(0, "norm", res, lambda res=res: {"residual": res}) for res in (True, False)]


def test_modules_are_keyed_by_content_and_never_unloaded(driver, tmp_path):
    """Reloading the same bundle, or a byte-identical copy at another path, reads, verifies and loads no
    cubin again, and unloads nothing; the calls after each reload get new launchers, of the new bundle's
    entries, on the already loaded functions. A changed cubin gets a module of its own; the one it replaces
    stays loaded (a graph captured before may launch it), and going back to the first bundle loads nothing."""
    res1, res0 = b"\x7fELF cubin with a residual" * 40, b"\x7fELF cubin without one" * 40
    a = _write_bundle(tmp_path / "a", {True: res1, False: res0})
    copy = shutil.copytree(a, tmp_path / "copy")
    runtime.load_bundle(a)
    first = _serve()
    assert runtime.module_loads() == len(driver.loads) == len(driver.verified) == 2
    before = first
    for path in (a, copy, a, copy):
        b = runtime.load_bundle(path)
        assert driver.unloads == [], "load_bundle unloaded modules that launchers and graphs may still launch"
        now = _serve()
        assert all(n is not o for n, o in zip(now, before, strict=True)), "a launcher outlived its generation"
        assert all(any(n.entry is e for e in b.manifest.kernels) for n in now), "served from the old bundle"
        assert [int(n.function) for n in now] == [int(f.function) for f in first]
        before = now
    assert runtime.module_loads() == len(driver.loads) == len(driver.verified) == 2, driver.verified

    changed = _write_bundle(tmp_path / "changed", {True: res1[:-1] + b"!", False: res0})
    runtime.load_bundle(changed)
    now = _serve()
    assert driver.loads[2:] == [hashlib.sha256(res1[:-1] + b"!").hexdigest()] and runtime.module_loads() == 3
    assert int(now[0].function) != int(first[0].function) and int(now[1].function) == int(first[1].function)
    runtime.load_bundle(a)
    assert [int(n.function) for n in _serve()] == [int(f.function) for f in first]
    assert runtime.module_loads() == 3 and driver.unloads == []


def test_a_manifest_entry_naming_a_loaded_cubin_with_other_claims_is_verified(driver, tmp_path):
    """The module table's key holds what the manifest claims of the cubin besides its content (the entry
    symbol, the parameters, the block...): an entry that names an already loaded cubin but claims another
    entry symbol is read and verified again (the bundle check, not the table, answers for it)."""
    data = b"\x7fELF one cubin" * 40
    a = _write_bundle(tmp_path / "a", {True: data})
    runtime.load_bundle(a)
    _serve_one = lambda: runtime.launcher(0, "norm", True, lambda: {"residual": True})  # noqa: E731
    _serve_one()
    b = shutil.copytree(a, tmp_path / "b")
    m = json.loads((b / "manifest.json").read_text())
    m["kernels"][0]["entry"] = "another_symbol"
    (b / "manifest.json").write_text(json.dumps(m))
    runtime.load_bundle(b)
    _serve_one()
    assert driver.verified == ["norm_res1.sm_90a.cubin"] * 2 and runtime.module_loads() == 2


@pytest.mark.skipif(not plans.GUARDS, reason="this torch's TensorGuards do not work: plans are not kept")
def test_a_plan_built_across_a_reload_is_not_kept(driver, tmp_path):
    """A load_bundle (from another thread) while a call builds its plan: the plan serves that call only, the
    next call builds one from the new bundle; a plan built with no reload in between is kept."""
    a = _write_bundle(tmp_path / "a", {True: b"\x7fELF c" * 40})
    runtime.load_bundle(a)
    x = torch.ones(2, 4)

    def build(names, renames, reload):
        if reload:
            runtime.load_bundle(a)
        return plans.Plan(0, ())

    plans.new(("k", 0), ("x",), (x,), build, False)
    assert ("k", 0) in runtime.thread_cache()
    plans.new(("k", 1), ("x",), (x,), build, True)
    assert ("k", 1) not in runtime.thread_cache(), "a plan built before a reload serves the calls after it"


def test_a_child_that_crashes_fails_with_its_output():
    """tests.helpers.run_child, which the GPU reload tests run their work in: a child killed by a signal, or
    one that exits 0 without 'child ok', is an AssertionError naming the signal and showing the output."""
    from tests.helpers import run_child

    assert "child ok" in run_child("-c", "print('child ok')")
    with pytest.raises(AssertionError, match=r"(?s)killed by signal 11 .*serving\n"):
        run_child(
            "-c", "import os, signal; print('serving', flush=True); os.kill(os.getpid(), signal.SIGSEGV)"
        )
    with pytest.raises(AssertionError, match="exit 0"):
        run_child("-c", "print('done')")


@pytest.mark.skipif(HAS_GPU, reason="CPU check of test_reload_gpu.py's children: a GPU runs the real ones")
@pytest.mark.parametrize("child, fault, says", [
    ("reload", "none", None),
    ("midcall", "none", None),
    ("graph", "none", None),
    ("midcall", "lazy_launchers", "the call in flight launched the new bundle's kernels"),
    ("midcall", "no_generation_bump", "the call after the reload ran kernels of the earlier bundle"),
    ("graph", "no_generation_bump", "the eager call did not run the new bundle's kernels"),
])  # fmt: skip
def test_the_gpu_reload_tests_children_on_a_fake_op(child, fault, says):
    """tests/test_reload_gpu.py's children, unchanged, against a fake fused op through the real runtime
    (tests/reload_children_cpu.py): each passes on the real loader logic, and fails, saying what went wrong,
    on a planted fault (a call that fetches a launcher when it launches it; a reload that leaves every
    thread's launchers and plans in place)."""
    r = subprocess.run([sys.executable, "-m", "tests.reload_children_cpu", child, fault], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    if says is None:
        assert r.returncode == 0 and f"harness ok {child} none" in r.stdout, r.stdout + r.stderr[-3000:]
    else:
        assert r.returncode == 1 and "harness ok" not in r.stdout, r.stdout + r.stderr[-3000:]
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("AssertionError: ") and last.endswith(says), r.stderr[-3000:]

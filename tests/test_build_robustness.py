"""Build robustness: a build killed mid-way leaves the previous bundle intact and loadable and
its cache usable; -j N gives the same bytes as -j 1; another DSL version or kernel source is rebuilt, not
taken from the cache."""

import os
import re
import signal
import subprocess
import sys
import time

from flint_aot.verify import verify
from loader.bundle import Bundle
from tests.conftest import ROOT, needs_dsl

pytestmark = needs_dsl

SMALL = "archs: [sm_90a]\nnorm:\n  residual: [true, false]\n"
LARGER = (
    "archs: [sm_90a]\nnorm:\n  residual: [true, false]\n"
    "qkv:\n  weight_format: [bf16]\n  rope: [true, false]\n  heads: [[8, 1]]\n"
)


def _files(p):
    return {f.name: f.read_bytes() for f in sorted(p.iterdir())}


def _cli(*args, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "flint_aot.cli", *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)  # fmt: skip


def test_killed_build_keeps_previous_bundle(tmp_path, tmp_path_factory):
    (tmp_path / "small.yaml").write_text(SMALL)
    (tmp_path / "larger.yaml").write_text(LARGER)
    out = tmp_path / "bundle"
    shared = tmp_path_factory.getbasetemp() / "shared-cache"  # the previous bundle: from any cache
    p = _cli("build", str(tmp_path / "small.yaml"), "-o", str(out), "--cache-dir", str(shared))
    assert p.wait(300) == 0, p.stdout.read().decode()
    before = _files(out)

    # compiles one at a time: killed (SIGKILL to the builder's process group; the compiles, in sessions of
    # their own, die with the builder) once the first one is in the cache
    cache = tmp_path / "c2"
    p = _cli("build", str(tmp_path / "larger.yaml"), "-o", str(out), "-j", "1", "--cache-dir", str(cache),
             start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not [c for c in cache.glob("*") if len(c.name) == 64] and time.monotonic() < deadline:
        assert p.poll() is None, "the build finished before it could be killed: " + p.stdout.read().decode()
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(60)
    assert _files(out) == before, "a killed build must not touch the bundle in place"
    b = Bundle.open(out)
    assert all(not problems for problems in verify(b).values())
    assert sorted(e.name for e in b.manifest.kernels) == ["norm_res0", "norm_res1"]

    # the interrupted cache is still good: the build finishes with it, reusing what was compiled (the bytes
    # equal a build from scratch: test_build.test_reproducible_from_scratch, test_parallel_build_same_bytes)
    p = _cli("build", str(tmp_path / "larger.yaml"), "-o", str(out), "--cache-dir", str(cache))
    log = p.communicate(timeout=600)[0].decode()
    assert p.returncode == 0, log
    assert re.search(r"\((\d) compiled, ([1-9]) cached\)", log), (
        log
    )  # what finished before the kill was reused
    assert all(not problems for problems in verify(Bundle.open(out)).values())
    assert not list(tmp_path.glob(".bundle.tmp-*")) and not list(cache.glob(".work-*"))


def test_parallel_build_same_bytes(tmp_path):
    from flint_aot.builder import build

    (tmp_path / "c.yaml").write_text(SMALL)
    build(tmp_path / "c.yaml", tmp_path / "j1", jobs=1, cache_dir=tmp_path / "k1")
    build(tmp_path / "c.yaml", tmp_path / "j3", jobs=3, cache_dir=tmp_path / "k3")
    assert _files(tmp_path / "j1") == _files(tmp_path / "j3")


def test_other_dsl_or_kernel_source_is_rebuilt(tmp_path, monkeypatch):
    from flint_aot import builder, kernels

    (tmp_path / "c.yaml").write_text(SMALL.replace("true, false", "true"))
    cache = tmp_path / "cache"
    out = tmp_path / "b"
    assert builder.build(tmp_path / "c.yaml", out, cache_dir=cache).compiled == 1
    assert builder.build(tmp_path / "c.yaml", out, cache_dir=cache).compiled == 0  # cached
    monkeypatch.setattr(builder, "dsl_version", lambda: "4.8.1+other")
    res = builder.build(tmp_path / "c.yaml", out, cache_dir=cache)
    assert res.compiled == 1 and Bundle.open(out).manifest.dsl_version == "4.8.1+other"
    monkeypatch.undo()
    real = kernels.source_hash()
    monkeypatch.setattr(kernels, "source_hash", lambda: "0" * 64 if real != "0" * 64 else "1" * 64)
    assert builder.build(tmp_path / "c.yaml", out, cache_dir=cache).compiled == 1


def test_cli_compile_failure_names_the_specialization(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from flint_aot import builder
    from flint_aot.cli import main

    (tmp_path / "c.yaml").write_text(SMALL)
    real_command = builder._compile_command

    def failing(s, work):
        if s.spec == {"residual": True, "hidden": 2048}:  # this specialization's compile exits with an error
            return [sys.executable, "-c", "import sys; sys.exit('boom: unsupported')"]
        return real_command(s, work)

    monkeypatch.setattr(builder, "_compile_command", failing)
    r = CliRunner().invoke(main, ["build", str(tmp_path / "c.yaml"), "-o", str(tmp_path / "o"),
                                  "--cache-dir", str(tmp_path / "cache")])  # fmt: skip
    assert r.exit_code == 1
    assert "norm_res1@sm_90a" in r.output and "boom: unsupported" in r.output
    assert not (tmp_path / "o").exists()


def test_a_write_refused_by_the_file_system_names_the_os_error_and_the_file(tmp_path):
    """A build under a file size limit smaller than a cubin (`ulimit -f`; a full disk cuts writes short the
    same way) fails with the OS error and the file it could not write (the DSL's own write of the cubin, which
    it does not check), not with a complaint about the truncated cubin; nothing is cached or installed and
    the previous bundle stays."""
    import resource

    (tmp_path / "c.yaml").write_text(SMALL.replace("true, false", "true"))  # one norm cubin: 5 KB
    out, cache = tmp_path / "b", tmp_path / "cache"
    out.mkdir()
    (out / "manifest.json").write_text("{}")  # a previous bundle (contents irrelevant: never read)
    limit = 4096
    p = _cli("build", str(tmp_path / "c.yaml"), "-o", str(out), "--cache-dir", str(cache),
             preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))  # fmt: skip
    log = p.communicate(timeout=600)[0].decode()
    assert p.returncode == 1, log
    line = next(ln for ln in log.splitlines() if ln.startswith("cannot write "))
    assert ".cubin: File too large" in line and "(EFBIG)" in line and f"cut off at {limit} bytes" in line, log
    assert "ELF" not in log and "CubinError" not in log, log
    assert not [c for c in cache.glob("*") if len(c.name) == 64]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]
    assert (out / "manifest.json").read_text() == "{}"

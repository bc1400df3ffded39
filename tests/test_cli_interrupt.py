"""Stopping a real build (the CLI in a subprocess, a fresh cache so it really compiles): SIGINT as a
terminal's Ctrl-C sends it (to the whole foreground process group) and SIGTERM to the builder alone.
The running compiles are frozen (SIGSTOP) before the signal, so the build can end only by killing them: it
must exit (STOP_TIMEOUT_S is the failure mode, not a speed requirement) with status 130 / 143 and one line
saying what was kept; the frozen compiles are gone, no compile keeps running or starts afterwards; the
bundle in place is untouched; the cache holds exactly the finished compiles, each intact; nothing is left
in the temp dir."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.conftest import ROOT, needs_dsl

pytestmark = needs_dsl

STOP_TIMEOUT_S = 60  # a build that has not exited this long after the signal waits for its compiles: failed
# 8 specializations, ~1-3 s each on the CI machine
CONFIG = (
    "archs: [sm_90a, sm_100a]\nnorm:\n  residual: [true, false]\n"
    "qkv:\n  weight_format: [bf16]\n  rope: [true, false]\n  heads: [[8, 1]]\n  max_m: [64]\n"
)


class Build:
    """`flint-aot build` in a subprocess of its own session, stderr read line by line as it comes."""

    def __init__(self, tmp: Path, *args: str):
        self.tmp_dir = tmp / "systmp"  # the build's TMPDIR: must stay empty
        self.tmp_dir.mkdir(exist_ok=True)
        env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(self.tmp_dir))
        self.p = subprocess.Popen(
            [sys.executable, "-m", "flint_aot.cli", "build", *args],
            cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.stdout = ""
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        for line in self.p.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_until(self, condition, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            assert self.p.poll() is None, "build ended too early:\n" + "\n".join(self.lines)
            time.sleep(0.02)
        raise AssertionError(f"still waiting after {timeout} s:\n" + "\n".join(self.lines))

    def signal_and_wait(self, sig: int, group: bool) -> None:
        """Send sig (to the builder's process group, or to the builder alone) and wait for it to exit; a
        builder still running after STOP_TIMEOUT_S is killed and the test fails."""
        (os.killpg if group else os.kill)(self.p.pid, sig)
        try:
            self.p.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the build did not exit within {STOP_TIMEOUT_S} s of {signal.Signals(sig).name}:\n"
                + "\n".join(self.lines)
            ) from None
        finally:
            if self.p.poll() is None:
                os.killpg(self.p.pid, signal.SIGKILL)
        self.stdout = self.p.stdout.read()
        self._t.join(5)


def _compile_pids(marker: str) -> dict[int, str]:
    """{pid: command line} of the live compile processes mentioning marker (the test's own cache path)."""
    found = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "flint_aot.compile_one" in cmd and marker in cmd:
                found[int(d.name)] = cmd
    return found


def _compiles_running(marker: str) -> list[str]:
    """Command lines of live processes mentioning marker (the test's own cache path)."""
    return list(_compile_pids(marker).values())


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


@contextlib.contextmanager
def _frozen_compiles(marker: str, at_least: int):
    """SIGSTOP the process group of every compile of the build (each is its own session's leader) until at
    least `at_least` are frozen and none runs: a compile that ended while the set was being taken lets the
    builder start another, which is frozen in turn. Frozen compiles cannot finish, so a build that waited
    for its running compiles instead of killing them would never exit. Yields the frozen pids; whatever
    is left of them afterwards is killed."""
    frozen: set[int] = set()
    try:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while True:
            running = set(_compile_pids(marker))
            for pid in running - frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGSTOP)
                frozen.add(pid)
            live = [p for p in frozen if p in _compile_pids(marker)]
            if len(live) >= at_least and running <= frozen and all(map(_stopped, live)):
                break
            assert time.monotonic() < deadline, f"could not freeze {at_least} compiles: {running}, {frozen}"
            time.sleep(0.02)
        yield sorted(live)
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _assert_no_compiles_for(marker: str, seconds: float, grace: float = 0.0) -> None:
    """None running (after grace seconds at most), and none starting for a while (a dropped queue must stay
    dropped)."""
    deadline = time.monotonic() + grace
    while _compiles_running(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    deadline = time.monotonic() + seconds
    while True:
        running = _compiles_running(marker)
        assert not running, f"compile processes still running after the build exited: {running}"
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _cached(cache: Path) -> int:
    return sum(1 for p in cache.glob("*") if re.fullmatch(r"[0-9a-f]{64}", p.name)) if cache.is_dir() else 0


def _assert_cache_consistent(cache: Path) -> int:
    from flint_aot.builder import _cache_get

    names = sorted(p.name for p in cache.iterdir())
    assert all(re.fullmatch(r"[0-9a-f]{64}", n) for n in names), f"leftovers in the cache: {names}"
    for n in names:
        assert _cache_get(cache, n) is not None, f"cache entry {n} is damaged"
    return len(names)


def _files(p: Path) -> dict:
    return {f.name: f.read_bytes() for f in sorted(p.iterdir())}


def test_ctrl_c_stops_the_build_and_keeps_the_previous_bundle(tmp_path):
    (tmp_path / "c.yaml").write_text(CONFIG)
    out, cache = tmp_path / "bundle", tmp_path / "cache"
    out.mkdir()  # a previous bundle, as far as the builder is concerned (it never reads the old one)
    (out / "manifest.json").write_text('{"previous": true}\n')
    (out / "old.sm_90a.cubin").write_bytes(b"old bytes")
    before = _files(out)

    b = Build(tmp_path, "c.yaml", "-o", str(out), "-j", "1", "--cache-dir", str(cache))
    b.wait_until(lambda: _cached(cache) >= 1)  # the first compile is in the cache
    with _frozen_compiles(str(cache), 1) as frozen:  # the next one runs, frozen
        b.signal_and_wait(signal.SIGINT, group=True)  # what a terminal's Ctrl-C does
        gone = not set(frozen) & set(_compile_pids(str(cache)))
    log = "\n".join(b.lines)
    assert b.p.returncode == 130, log
    assert gone, f"the frozen compiles {frozen} outlived the build"
    assert "Traceback" not in log and "Aborted" not in log, log
    m = re.fullmatch(
        rf"interrupted \(SIGINT\): (\d) of 8 specializations compiled and cached \((\d) this run, in "
        rf"{re.escape(str(cache))}\); previous bundle at {re.escape(str(out))} untouched",
        b.lines[-1],
    )
    assert m and m.group(1) == m.group(2), b.lines[-1]
    assert b.stdout == ""  # no table: nothing was built
    _assert_no_compiles_for(str(cache), 1.0)

    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "c.yaml", "cache", "systmp"]
    assert _assert_cache_consistent(cache) == int(m.group(1))
    assert not list(b.tmp_dir.iterdir()), list(b.tmp_dir.iterdir())

    # what was compiled before the signal is used by the next build
    (tmp_path / "first.yaml").write_text("archs: [sm_90a]\nnorm:\n  residual: [true]\n")
    r = subprocess.run(
        [sys.executable, "-m", "flint_aot.cli", "build", "first.yaml", "-o", str(tmp_path / "next"),
         "--cache-dir", str(cache)],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0 and "(0 compiled, 1 cached)" in r.stdout, r.stdout + r.stderr
    assert r.stderr == ""  # a build with nothing to compile prints no progress


def test_sigterm_stops_a_parallel_build(tmp_path):
    (tmp_path / "c.yaml").write_text(CONFIG)
    out, cache = tmp_path / "out" / "bundle", tmp_path / "cache"
    b = Build(tmp_path, "c.yaml", "-o", str(out), "-j", "2", "--cache-dir", str(cache))
    b.wait_until(lambda: len(_compiles_running(str(cache))) == 2)
    with _frozen_compiles(str(cache), 2) as frozen:
        b.signal_and_wait(signal.SIGTERM, group=False)  # the builder alone, as a supervisor does
        gone = not set(frozen) & set(_compile_pids(str(cache)))
    log = "\n".join(b.lines)
    assert b.p.returncode == 143, log
    assert gone, f"the frozen compiles {frozen} outlived the build"
    assert "Traceback" not in log, log
    assert re.fullmatch(
        rf"interrupted \(SIGTERM\): \d of 8 specializations .*; nothing written to {re.escape(str(out))}",
        b.lines[-1],
    ), b.lines[-1]
    _assert_no_compiles_for(str(cache), 1.0)
    assert not out.parent.exists()  # nothing created, not even the parent folder
    _assert_cache_consistent(cache)
    assert not list(b.tmp_dir.iterdir())


def test_sigkill_of_the_builder_takes_its_compiles_along(tmp_path):
    """SIGKILL cannot be caught: the compile processes (own sessions) die with the builder by
    PR_SET_PDEATHSIG; the next build removes the dead build's work folder from the cache."""
    (tmp_path / "c.yaml").write_text(CONFIG)
    cache = tmp_path / "cache"
    b = Build(tmp_path, "c.yaml", "-o", str(tmp_path / "o"), "-j", "2", "--cache-dir", str(cache))
    b.wait_until(lambda: len(_compiles_running(str(cache))) == 2)
    b.signal_and_wait(signal.SIGKILL, group=False)
    _assert_no_compiles_for(str(cache), 0.5, grace=STOP_TIMEOUT_S)
    assert list(cache.glob(".work-*"))  # the killed build's, swept by the next one
    (tmp_path / "one.yaml").write_text("archs: [sm_90a]\nnorm:\n  residual: [false]\n")
    r = subprocess.run(
        [sys.executable, "-m", "flint_aot.cli", "build", "one.yaml", "-o", "o", "--cache-dir", str(cache)],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    _assert_cache_consistent(cache)

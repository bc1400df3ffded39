"""What the CLI prints: with stderr not a terminal (CI logs, `| tee`) one line per finished compile as it
finishes; on a terminal click's progress bar; nothing at all on stderr for a build with nothing to compile;
-j defaults to the CPUs the process may use; build/flint is every command's default bundle."""

import os
import pty
import re
import select
import subprocess
import sys

from click.testing import CliRunner

from flint_aot.cli import DEFAULT_BUNDLE, main
from tests.conftest import ROOT, needs_dsl


def _run(tmp_path, args, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "flint_aot.cli", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, text=True, timeout=300, **kw)


@needs_dsl
def test_progress_lines_bar_and_silent_noop(tmp_path):
    (tmp_path / "c.yaml").write_text("archs: [sm_90a]\nnorm:\n  residual: [true, false]\n")
    args = ["build", "c.yaml", "-o", "b", "--cache-dir", "cache"]
    # stderr a pipe, one usable CPU: -j defaults to 1
    r = _run(tmp_path, args, capture_output=True, preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == "compiling 2 of 2 specializations (0 cached), 1 at a time", r.stderr
    assert [re.sub(r"\(\d+\.\d s\)", "(T)", ln) for ln in lines[1:]] == [
        "[1/2] compiled norm_res1@sm_90a (T)",
        "[2/2] compiled norm_res0@sm_90a (T)",
    ], r.stderr
    assert "(2 compiled, 0 cached)" in r.stdout

    r = _run(tmp_path, args, capture_output=True)  # nothing to compile: no progress at all
    assert r.returncode == 0 and r.stderr == "" and "(0 compiled, 2 cached)" in r.stdout

    # stderr a terminal: click's bar, no per-compile lines
    (tmp_path / "d.yaml").write_text("archs: [sm_100a]\nnorm:\n  residual: [true]\n")
    master, slave = pty.openpty()
    p = subprocess.Popen(
        [sys.executable, "-m", "flint_aot.cli", "build", "d.yaml", "-o", "d", "--cache-dir", "cache"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, stderr=slave,
        text=True,
    )  # fmt: skip
    os.close(slave)
    tty = b""
    while True:
        ready, _, _ = select.select([master], [], [], 300)
        try:
            chunk = os.read(master, 4096) if ready else b""
        except OSError:  # EIO: the process closed the terminal
            chunk = b""
        if not chunk:
            break
        tty += chunk
    os.close(master)
    assert p.wait(60) == 0
    text = tty.decode(errors="replace")
    assert "compiling" in text and "1/1" in text and "[1/1]" not in text, text
    assert "(1 compiled, 0 cached)" in p.stdout.read()


def test_jobs_default_is_the_usable_cpus():
    from flint_aot.builder import usable_cores

    assert usable_cores() == len(os.sched_getaffinity(0))
    (jobs,) = [p for p in main.commands["build"].params if p.name == "jobs"]
    assert jobs.default is None  # -> usable_cores() at run time (the progress test sees 1 on one CPU)


def test_build_flint_is_every_commands_default_bundle(tmp_path, monkeypatch):
    for cmd in ("list", "verify", "pack", "doctor"):
        (p,) = [p for p in main.commands[cmd].params if p.name == "bundle"]
        assert p.default == DEFAULT_BUNDLE == "build/flint" and not p.required, cmd
    assert next(p for p in main.commands["build"].params if p.name == "out").default == DEFAULT_BUNDLE
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["verify"])  # no build/flint here: a one-line error naming it
    assert r.exit_code == 1 and "build/flint does not exist" in r.output, r.output
    r = CliRunner().invoke(main, ["list"])
    assert r.exit_code == 1 and "build/flint does not exist" in r.output, r.output


def test_cache_dir_help_gives_the_lookup_order(monkeypatch, tmp_path):
    """--cache-dir's help names the three places in the order default_cache_dir takes them."""
    from flint_aot.builder import default_cache_dir

    r = CliRunner().invoke(main, ["build", "--help"], terminal_width=200)
    text = " ".join(r.output.split())
    want = "[default: $FLINT_AOT_CACHE, else $XDG_CACHE_HOME/flint-aot, else ~/.cache/flint-aot]"
    assert want in text, text
    monkeypatch.delenv("FLINT_AOT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "flint-aot"

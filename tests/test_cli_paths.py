"""Output paths are checked before anything is compiled or packed: a file in the way, a read-only file
system, a mount point (which the atomic swap cannot rename) and an unwritable cache each give one line
naming the path and the fix, exit status 1, no traceback, and no compile (the cache is never created)."""

import contextlib
import os
import subprocess
import sys
import uuid

import pytest

from tests.conftest import ROOT

CONFIG = "archs: [sm_90a]\nnorm:\n  residual: [true, false]\n"


def _cli(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "flint_aot.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def _build(tmp_path, out, cache="cache"):
    (tmp_path / "c.yaml").write_text(CONFIG)
    return _cli(tmp_path, "build", "c.yaml", "-o", str(out), "--cache-dir", str(tmp_path / cache))


def _one_line_error(r, *needles):
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_output_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    r = _build(tmp_path, "afile/sub")
    _one_line_error(r, str(tmp_path / "afile" / "sub"), "which is a file", "choose another -o")
    assert not (tmp_path / "cache").exists(), "compiled before checking the output path"
    r = _build(tmp_path, "afile")
    _one_line_error(r, str(tmp_path / "afile"), "is a file", "choose another -o")
    assert (tmp_path / "afile").read_text() == "x"


def test_cache_dir_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    r = _build(tmp_path, "out", cache="afile/cache")
    _one_line_error(r, "cache directory", str(tmp_path / "afile" / "cache"), "--cache-dir")
    assert not (tmp_path / "out").exists()


def test_pack_output_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "bundle").mkdir()
    for o in ("afile", "afile/sub"):
        r = _cli(tmp_path, "pack", "bundle", "-o", o)
        _one_line_error(r, str(tmp_path / o), "choose another -o")


# ----------------------------------------------------------------------------- mounts (root only)
@contextlib.contextmanager
def _mount(target, *args):
    target.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a file system needs root")
    r = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here: {r.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=True)


def test_read_only_output_and_cache(tmp_path):
    with _mount(tmp_path / "ro", "-t", "tmpfs", "-o", "ro,size=1m", f"flint-ro-{uuid.uuid4().hex[:8]}"):
        r = _build(tmp_path, "ro/bundle")
        _one_line_error(r, str(tmp_path / "ro" / "bundle"), "read-only file system", "choose another -o")
        assert not (tmp_path / "cache").exists()
        r = _build(tmp_path, "out", cache="ro/cache")
        _one_line_error(r, "read-only file system", "--cache-dir")
        (tmp_path / "bundle").mkdir()
        r = _cli(tmp_path, "pack", "bundle", "-o", "ro/dist")
        _one_line_error(r, str(tmp_path / "ro" / "dist"), "read-only file system", "choose another -o")


@pytest.mark.parametrize("how", ["tmpfs", "bind"])
def test_output_is_a_mount_point(tmp_path, how):
    (tmp_path / "src").mkdir()
    args = (
        ["-t", "tmpfs", "-o", "size=1m", "flint-mnt"] if how == "tmpfs" else ["--bind", str(tmp_path / "src")]
    )
    with _mount(tmp_path / "mnt", *args):
        (tmp_path / "mnt" / "manifest.json").write_text("{}")  # a bundle there, as far as the build cares
        r = _build(tmp_path, "mnt")
        _one_line_error(r, str(tmp_path / "mnt"), "mount point", f"-o {tmp_path / 'mnt' / 'flint'}")
        assert not (tmp_path / "cache").exists()

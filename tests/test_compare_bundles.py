"""tools/compare_bundles.py: two bundles compared cubin by cubin; any byte or launch-record difference outside
the allowed patterns, a cubin on one side only, or an allowed pattern that matched no change fails it."""

import json
import subprocess
import sys

from tests.conftest import ROOT

TOOL = ROOT / "tools" / "compare_bundles.py"


def _bundle(path, cubins: dict[str, bytes], **launch):
    path.mkdir()
    kernels = []
    for key, data in cubins.items():
        name, arch = key.split("@")
        (path / f"{name}.{arch}.cubin").write_bytes(data)
        kernels.append({"name": name, "arch": arch, "file": f"{name}.{arch}.cubin", "size": len(data),
                        "entry": "e", "block": [128, 1, 1], "cluster": [8, 1, 1], "dyn_smem": 0,
                        "grid": ["ROW_BLOCKS", 1, 1], "params": [["x", "ptr", 16]],
                        **launch.get(key, {})})  # fmt: skip
    (path / "manifest.json").write_text(json.dumps({"kernels": kernels}))
    return path


def _run(*args):
    r = subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True)
    return r.returncode, r.stdout


def test_identical_bundles_pass(tmp_path):
    c = {"qkv_a@sm_90a": b"\x7fELF one", "qkv_b@sm_100a": b"\x7fELF two"}
    rc, out = _run(_bundle(tmp_path / "a", c), _bundle(tmp_path / "b", c))
    assert rc == 0 and "2 cubins: 2 byte-identical, 0 changed as allowed, 0 unexpected" in out


def test_a_changed_byte_fails_unless_allowed(tmp_path):
    a = _bundle(tmp_path / "a", {"qkv_a_m64@sm_90a": b"\x7fELF one", "qkv_b@sm_90a": b"same"})
    b = _bundle(tmp_path / "b", {"qkv_a_m64@sm_90a": b"\x7fELF 0ne", "qkv_b@sm_90a": b"same"})
    rc, out = _run(a, b)
    assert rc == 1 and "UNEXPECTED: qkv_a_m64@sm_90a: cubin differs" in out
    rc, out = _run(a, b, "--allow", "qkv_*_m64@sm_90a")
    assert rc == 0 and "changed: qkv_a_m64@sm_90a" in out
    rc, out = _run(a, b, "--allow", "qkv_*_m64@sm_90a", "--allow", "gemv_*@sm_90a")
    assert rc == 1 and "UNUSED --allow 'gemv_*@sm_90a'" in out  # expected a change that did not happen


def test_a_missing_cubin_or_launch_record_difference_fails(tmp_path):
    a = _bundle(tmp_path / "a", {"x@sm_90a": b"1", "y@sm_90a": b"2"})
    b = _bundle(tmp_path / "b", {"x@sm_90a": b"1"})
    rc, out = _run(a, b, "--allow", "*")
    assert rc == 1 and "y@sm_90a: only in" in out
    c = _bundle(tmp_path / "c", {"x@sm_90a": b"1", "y@sm_90a": b"2"}, **{"y@sm_90a": {"dyn_smem": 32}})
    rc, out = _run(a, c)
    assert rc == 1 and "y@sm_90a: launch record differs in dyn_smem" in out


def test_the_cubin_on_disk_counts_not_the_manifest(tmp_path):
    a = _bundle(tmp_path / "a", {"x@sm_90a": b"1"})
    b = _bundle(tmp_path / "b", {"x@sm_90a": b"1"})
    (b / "x.sm_90a.cubin").write_bytes(b"2")  # the manifest still says size 1
    rc, out = _run(a, b)
    assert rc == 1 and "cubin differs" in out

"""`flint-aot doctor` on the GPU: every variant passes on a sound bundle; a bundle with a wrong
cubin behind one entry fails that variant and exits non-zero."""

import json
import shutil

import pytest
from click.testing import CliRunner

from flint_aot.cli import main

pytestmark = pytest.mark.gpu


def test_doctor_passes_on_the_bundle(gpu_bundle):
    import loader

    try:
        r = CliRunner().invoke(main, ["doctor", str(gpu_bundle.path)])
    finally:
        loader.load_bundle(gpu_bundle.path)
    assert r.exit_code == 0, r.output
    entries = [e for e in gpu_bundle.manifest.kernels if e.arch == "sm_90a"]
    rows = [ln.split() for ln in r.output.splitlines()[2:] if "variants pass" not in ln]
    rows = [cols for cols in rows if len(cols) >= 5]  # variant, M=m, error, result, ms
    # each variant at the M of the doctor's default (1, 8, 9, 32, 64) that run it: the 8-token kernels at 1
    # and 8, the 16-, 32- and 64-token ones at 9, 32 and 64, the tile-less ones at all five
    want = sum({8: 2, 16: 1, 32: 1, 64: 1}.get(e.spec.get("max_m"), 5) for e in entries)
    assert len(rows) == want and {cols[0] for cols in rows} == {e.name for e in entries}
    assert [cols[3] for cols in rows] == ["pass"] * want and f"{want} of {want} variants pass" in r.output


def test_doctor_fails_a_wrong_cubin(gpu_bundle, tmp_path):
    import loader

    bad = tmp_path / "bad"
    shutil.copytree(gpu_bundle.path, bad)
    m = json.loads((bad / "manifest.json").read_text())
    by_name = {(e["name"], e["arch"]): e for e in m["kernels"]}
    # BF16 (16, 2) with RoPE, the input norm in its own kernel or in the qkv kernel's prologue
    name = next(
        n for n in ("qkv_bf16_rope1_h16x2", "qkv_bf16_rope1_h16x2_prologue") if (n, "sm_90a") in by_name
    )
    victim = by_name[(name, "sm_90a")]
    other = by_name[(name.replace("rope1", "rope0"), "sm_90a")]
    for key in ("file", "sha256", "size"):  # the entry now points at another variant's (intact) cubin
        victim[key] = other[key]
    (bad / "manifest.json").write_text(json.dumps(m))
    try:
        r = CliRunner().invoke(main, ["doctor", str(bad)])
    finally:
        loader.load_bundle(gpu_bundle.path)
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith(name + " ")]
    assert len(lines) == 2 and all("FAIL" in ln for ln in lines)  # at M = 1 and 8
    assert r.output.count("FAIL") == 2

"""Loader checks that need no GPU."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_loader_imports_neither_dsl_nor_builder():
    code = (
        "import sys, loader, loader.ops, loader.runtime, loader.bundle\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'flint_aot'))\n"
        "assert not bad, bad\n"
        "print('clean')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "clean" in r.stdout, r.stderr


def test_missing_bundle_message(tmp_path):
    import loader

    with pytest.raises(loader.BundleError, match="does not exist; build one"):
        loader.load_bundle(tmp_path / "nope")


def test_arch_selection_and_missing_arch():
    from loader.bundle import Bundle
    from loader.manifest import KernelEntry, Manifest, Param
    from loader.runtime import select_entry

    def entry(arch, res, **debug):
        return KernelEntry(
            "norm",
            f"norm_res{int(res)}" + "".join(f"_{k}" for k in debug),
            {"residual": res, **debug},
            arch,
            f"n.{arch}.cubin",
            1,
            "0" * 64,
            "e",
            (256, 1, 1),
            (1, 1, 1),
            0,
            ("M", 1, 1),
            (Param("x", "ptr"),),
            "k",
        )

    b = Bundle(ROOT, Manifest("g", "4.8.1", {}, [entry("sm_100a", True), entry("sm_100a", False)]))
    assert select_entry(b, (10, 0), "norm", {"residual": False}).name == "norm_res0"
    with pytest.raises(LookupError) as e:
        select_entry(b, (9, 0), "norm", {"residual": True})  # an H100/H200 against a Blackwell-only bundle
    assert "sm_90a" in str(e.value) and "holds sm_100a" in str(e.value) and "rebuild" in str(e.value)
    with pytest.raises(LookupError, match="does not target"):
        select_entry(b, (8, 0), "norm", {"residual": True})
    with pytest.raises(LookupError, match="no qkv kernel"):
        select_entry(b, (10, 0), "qkv", {"weight_format": "bf16"})
    # a debug build (debug_* spec keys) serves the same calls
    d = Bundle(ROOT, Manifest("g", "4.8.1", {}, [entry("sm_90a", True, debug_spin_cycles=5)]))
    assert select_entry(d, (9, 0), "norm", {"residual": True}).spec["debug_spin_cycles"] == 5


def test_param_offsets_natural_alignment():
    from loader.manifest import KernelEntry, Param

    e = KernelEntry(
        "k",
        "n",
        {},
        "sm_90a",
        "f",
        1,
        "0",
        "e",
        (1, 1, 1),
        (1, 1, 1),
        0,
        (1, 1, 1),
        tuple(Param(str(i), t) for i, t in enumerate(["ptr", "i32", "i64", "f32", "i32", "ptr"])),
        "k",
    )
    assert e.param_offsets() == [(0, 8), (8, 4), (16, 8), (24, 4), (28, 4), (32, 8)]

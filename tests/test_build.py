"""A real build of a small matrix for both archs, verify, caching, reproducibility, atomicity, refusals."""

import json
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from flint_aot.verify import verify
from loader.bundle import Bundle, BundleError
from loader.manifest import Manifest, ManifestError
from tests.conftest import ROOT, needs_dsl

pytestmark = needs_dsl

SMALL = "archs: [sm_90a, sm_100a]\nnorm:\n  residual: [true, false]\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from flint_aot.builder import build

    d = tmp_path_factory.mktemp("b")
    (d / "small.yaml").write_text(SMALL)
    res = build(d / "small.yaml", d / "bundle", jobs=2, cache_dir=d / "cache")
    return d, res


def _files(p):
    return {f.name: f.read_bytes() for f in sorted(p.iterdir())}


def test_build_small_matrix(built):
    d, res = built
    assert res.compiled == 4 and [r.status for r in res.rows] == ["compiled"] * 4
    b = Bundle.open(d / "bundle")
    assert sorted(b.manifest.archs()) == ["sm_100a", "sm_90a"]
    assert sorted(_files(d / "bundle")) == sorted(
        ["manifest.json"] + [f"norm_res{r}.{a}.cubin" for r in (0, 1) for a in ("sm_90a", "sm_100a")]
    )
    for e in b.manifest.kernels:
        assert e.entry == f"flint_{e.name}_0" and e.block == (256, 1, 1) and e.grid == ("M", 1, 1)
        assert [p.name for p in e.params] == ["x", "residual", "residual_out", "xn", "weight", "eps",
                                            "xn_group", "xn_row", "xn_quarter", "xn_pairs"]
        assert b.read(e)[:4] == b"\x7fELF"
    assert all(not p for p in verify(b).values())
    text = (d / "bundle" / "manifest.json").read_text()
    assert str(d) not in text and "time" not in text  # no absolute paths, no timestamps


def test_second_build_compiles_nothing_and_is_identical(built, tmp_path):
    from flint_aot.builder import build

    d, _ = built
    res = build(d / "small.yaml", tmp_path / "other", jobs=1, cache_dir=d / "cache")
    assert res.compiled == 0 and {r.status for r in res.rows} == {"cached"}
    assert _files(tmp_path / "other") == _files(d / "bundle")


def test_reproducible_from_scratch(built, tmp_path):
    """Fresh cache, another output folder, another working directory: byte-identical bundle."""
    d, _ = built
    r = subprocess.run(
        [sys.executable, "-m", "flint_aot.cli", "build", str(d / "small.yaml"), "-o", str(tmp_path / "fresh"),
         "--cache-dir", str(tmp_path / "cache2"), "-j", "2"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "4 compiled" in r.stdout
    assert _files(tmp_path / "fresh") == _files(d / "bundle")


def test_cli_verify_list_and_corruption(built, tmp_path):
    from flint_aot.cli import main

    d, _ = built
    runner = CliRunner()
    r = runner.invoke(main, ["verify", str(d / "bundle")])
    assert r.exit_code == 0 and "4 cubins verified" in r.output
    r = runner.invoke(main, ["list", str(d / "bundle")])
    assert r.exit_code == 0 and "flint_norm_res1_0" in r.output and "sm_100a" in r.output
    bad = tmp_path / "bad"
    shutil.copytree(d / "bundle", bad)
    f = bad / "norm_res1.sm_90a.cubin"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    r = runner.invoke(main, ["verify", str(bad)])
    assert r.exit_code != 0 and "FAIL norm_res1@sm_90a" in r.output and "sha256" in r.output
    assert "ok   norm_res0@sm_90a" in r.output
    with pytest.raises(BundleError, match="corrupt"):
        Bundle.open(bad).read(next(e for e in Bundle.open(bad).manifest.kernels if e.file == f.name))


def test_manifest_roundtrip(built):
    d, _ = built
    text = (d / "bundle" / "manifest.json").read_text()
    m = Manifest.from_dict(json.loads(text))
    assert m.dumps() == text
    assert m.config == {"archs": ["sm_90a", "sm_100a"], "norm": {"residual": [True, False]}}


def test_failed_build_keeps_previous_bundle(built, tmp_path, monkeypatch):
    """A compile that crashes (here: the compile process killed by a signal) fails the build loudly with the
    specialization's name, and the bundle in place is untouched."""
    from flint_aot import builder, kernels

    d, _ = built
    out = tmp_path / "keep"
    shutil.copytree(d / "bundle", out)
    before = _files(out)
    real_command = builder._compile_command

    def crashing(s, work):
        if s.label == "norm_res0@sm_100a":
            return [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
        return real_command(s, work)

    monkeypatch.setattr(builder, "_compile_command", crashing)
    # the fixture's cache without the victim's entry: only the crashing specialization compiles
    cache = shutil.copytree(d / "cache", tmp_path / "cache")
    plan = builder.prepare(d / "small.yaml", out, cache_dir=cache)
    victim = next(s for s in plan.todo if s.label == "norm_res0@sm_100a")
    shutil.rmtree(cache / builder.build_key(victim, kernels.source_hash(), plan.dsl))
    with pytest.raises(builder.BuildError) as e:
        builder.build(d / "small.yaml", out, jobs=2, cache_dir=cache)
    assert "norm_res0@sm_100a" in str(e.value) and "signal 11" in str(e.value)
    assert _files(out) == before
    assert not list(tmp_path.glob(".keep.tmp-*"))


def test_compiles_its_own_kernels_from_any_directory(built, tmp_path, monkeypatch):
    """A build started in a directory that holds another `flint_aot` (another checkout, an older copy)
    compiles the builder's own kernels: the compile processes (`python -m`, which puts the working directory
    first on sys.path) must not import the one there."""
    from flint_aot import builder, kernels

    d, _ = built
    decoy = tmp_path / "elsewhere"
    (decoy / "flint_aot").mkdir(parents=True)
    (decoy / "flint_aot" / "__init__.py").write_text("raise SystemExit('the decoy flint_aot was imported')\n")
    monkeypatch.chdir(decoy)
    cache = shutil.copytree(d / "cache", tmp_path / "cache")
    plan = builder.prepare(d / "small.yaml", tmp_path / "out", cache_dir=cache)
    victim = next(s for s in plan.todo if s.label == "norm_res1@sm_90a")
    shutil.rmtree(cache / builder.build_key(victim, kernels.source_hash(), plan.dsl))
    builder.build(d / "small.yaml", tmp_path / "out", jobs=1, cache_dir=cache)
    assert _files(tmp_path / "out") == _files(d / "bundle")


def test_refuses_to_replace_a_non_bundle(built, tmp_path):
    from flint_aot.builder import BuildError, build

    d, _ = built
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("mine")
    with pytest.raises(BuildError, match="not a flint-aot bundle"):
        build(d / "small.yaml", tmp_path / "precious", cache_dir=d / "cache")
    assert (tmp_path / "precious" / "notes.txt").read_text() == "mine"


def test_cli_config_error_exit_code(tmp_path):
    from flint_aot.cli import main

    p = tmp_path / "c.yaml"
    p.write_text("archs: [sm_90a]\nnorm: {residual: [maybe]}\n")
    r = CliRunner().invoke(main, ["build", str(p), "-o", str(tmp_path / "o")])
    assert r.exit_code != 0 and "norm.residual[0]" in r.output and "'maybe'" in r.output
    assert not (tmp_path / "o").exists()


def test_default_config_is_accepted_and_its_kinds_compile(tmp_path):
    """The shipped config (the README's Quickstart) is accepted by the builder: every specialization it
    expands to has a kernel, one bundle file each. Compiling all of it takes minutes: the two kinds no other
    build test compiles (norm and qkv are built by the others) go through the builder here; test_sass
    compiles the variants of every kind."""
    from flint_aot.builder import build, prepare

    plan = prepare(ROOT / "configs" / "flint.yaml", tmp_path / "b", cache_dir=tmp_path / "c")
    assert len(plan.pending) == len(plan.todo) > 100
    assert len({f"{s.name}.{s.arch}" for s in plan.todo}) == len(plan.todo)
    assert {s.kind for s in plan.todo} == {"norm", "qkv", "gemv", "qk_norm_rope_cache"}
    assert not (tmp_path / "c").exists() and not (tmp_path / "b").exists()  # prepare writes nothing

    (tmp_path / "kinds.yaml").write_text(
        "archs: [sm_90a]\ngemv: {weight_format: [nvfp4], max_m: [64]}\n"
        "qk_norm_rope_cache: {rope: [true], kv_cache_dtype: [fp8_e4m3]}\n"
    )
    res = build(tmp_path / "kinds.yaml", tmp_path / "b", cache_dir=tmp_path / "c", jobs=2)
    assert sorted(r.spec.kind for r in res.rows) == ["gemv", "qk_norm_rope_cache"]
    assert all(not p for p in verify(Bundle.open(tmp_path / "b")).values())


def test_loader_refuses_tampered_manifests(built, tmp_path):
    d, _ = built
    b = tmp_path / "t"
    shutil.copytree(d / "bundle", b)
    raw = json.loads((b / "manifest.json").read_text())

    def write(m):
        (b / "manifest.json").write_text(json.dumps(m))

    write(dict(raw, schema_version=99))
    with pytest.raises(ManifestError, match="schema version 99"):
        Bundle.open(b)
    for bad in ("../norm_res1.sm_90a.cubin", "/etc/passwd", "a/../../x.cubin", ""):
        m = json.loads(json.dumps(raw))
        m["kernels"][0]["file"] = bad
        write(m)
        with pytest.raises(ManifestError, match="leaves the bundle"):
            Bundle.open(b)
    (b / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Bundle.open(b)

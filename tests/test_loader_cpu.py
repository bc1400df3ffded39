"""Loader checks that need no GPU."""

import functools
import subprocess
import sys
import threading

import pytest
from click.testing import CliRunner

from tests.conftest import HAS_GPU, ROOT, needs_dsl


def test_loader_imports_neither_dsl_nor_builder():
    """Nor a plugin's kernel module (tests/test_plugins_cpu.py launches one through the example's op)."""
    code = (
        "import sys, loader, loader.ops, loader.runtime, loader.bundle, loader.kernels\n"
        "loader.launch_kernel\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'flint_aot', 'silu_mul'))\n"
        "assert not bad, bad\n"
        "print('clean')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "clean" in r.stdout, r.stderr


@pytest.mark.skipif(HAS_GPU, reason="the doctor runs on this machine's GPU")
def test_doctor_without_a_gpu_names_the_command_and_what_it_found():
    """One line on stderr, exit status 1: the command that was run, torch's version and CUDA build, and
    torch.cuda.is_available(), with the fix; `flint-aot doctor` names itself the same way."""
    import torch

    from flint_aot.cli import main

    r = subprocess.run([sys.executable, "-m", "loader.doctor"], cwd=ROOT, capture_output=True, text=True)
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert r.returncode == 1, r.stderr
    assert line.startswith("error: RuntimeError: python -m loader.doctor needs a CUDA GPU; found torch"), line
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    assert f"found torch {torch.__version__}, {build}" in line and "torch.cuda.is_available() = False" in line
    r = CliRunner().invoke(main, ["doctor"])
    assert r.exit_code == 1 and "flint-aot doctor needs a CUDA GPU; found torch" in r.output, r.output


def test_missing_bundle_message(tmp_path):
    import loader

    with pytest.raises(loader.BundleError, match="does not exist; build one"):
        loader.load_bundle(tmp_path / "nope")


def test_arch_selection_and_missing_arch():
    from loader.bundle import Bundle
    from loader.manifest import KernelEntry, Manifest, Param
    from loader.runtime import select_entry

    def entry(arch, res, **extra):
        return KernelEntry(
            "norm",
            f"norm_res{int(res)}" + "".join(f"_{k}" for k in extra),
            {"residual": res, **extra},
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
    # a spec key the loader does not know is another kernel, never one to strip and serve
    d = Bundle(ROOT, Manifest("g", "4.8.1", {}, [entry("sm_90a", True, spin_cycles=5)]))
    with pytest.raises(LookupError, match="no norm kernel"):
        select_entry(d, (9, 0), "norm", {"residual": True})


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


# ----------------------------------------------------------------------------- the kernel ABI, by name
def _default_bundle_entries():
    """Manifest entries (sm_90a) for every specialization of configs/flint.yaml, with each kernel's parameter
    list read from its @cute.kernel signature, as the build records it (no compile needed)."""

    from flint_aot.config import expand, load_config
    from flint_aot.kernels import kernel_class
    from flint_aot.kernels.compile import kernel_params
    from loader.abi import GRID
    from loader.manifest import KernelEntry, Param

    out = []
    for s in expand(load_config(ROOT / "configs" / "flint.yaml")):
        if s.arch != "sm_90a":
            continue
        k = kernel_class(s.kind)(s.spec, s.arch)
        params = kernel_params(k.entry_point(), k.ptr_types())
        out.append(KernelEntry(s.kind, s.name, s.spec, s.arch, f"{s.name}.cubin", 1, "0" * 64, s.name,
                               k.block, k.cluster, 0, k.grid or GRID[s.kind],
                               tuple(Param(*p) for p in params), "k"))  # fmt: skip
    return out


class _DryRun:
    """Runs the loader's ops on CPU tensors up to the launch: devices are faked as cuda:0, and a real
    runtime.Launcher (binding parameters by name, evaluating the manifest's grid rule) records which manifest
    entry it would launch, with every parameter's packed value, instead of calling the driver."""

    def __init__(self, monkeypatch, entries):
        import torch

        from loader import checks, ops, runtime
        from loader.bundle import Bundle
        from loader.manifest import Manifest

        self.bundle = Bundle(ROOT, Manifest("flint-aot test", "4.8.1", {}, list(entries)))
        self.launched = []
        dry = self

        class DryLauncher(runtime.Launcher):
            def __init__(self, entry):
                super().__init__(0, entry, 0, None)

            def launch(self, grid, stream, pdl):
                values = self._struct.unpack(self._buf.raw[: self._struct.size])
                dry.launched.append((self.entry, dict(zip(self.names, values, strict=True)), grid))

        monkeypatch.setattr(runtime, "_tls", threading.local())  # launchers and plans of this run only
        monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
        monkeypatch.setattr(ops, "_raw_stream", lambda dev: 0)
        monkeypatch.setitem(checks.NO_ROPE, 0, torch.zeros(1, 128))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(ops, "_launcher", lambda dev, kind, key, spec_of: DryLauncher(
            runtime.first_entry(self.bundle, (9, 0), kind, spec_of())))  # fmt: skip
        monkeypatch.setattr(runtime, "entry", lambda dev, kind, key, spec_of: runtime.first_entry(
            self.bundle, (9, 0), kind, spec_of()))  # fmt: skip


@functools.lru_cache
def _weight(n, fmt):
    import torch

    from loader import nvfp4

    w = (torch.randn(n, 2048) * 0.02).bfloat16()
    return nvfp4.quantize(w) if fmt == "nvfp4" else (w, None, None)


def _qkv_inputs(m, nq, nkv, fmt, rope, kv):
    import torch

    from loader.reference import make_cos_sin_cache

    w, ws, gs = _weight((nq + 2 * nkv) * 128, fmt)
    cdt = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
    kvc = torch.zeros(4, 2, 16, nkv, 128, dtype=cdt)
    c = dict(x=torch.randn(m, 2048).bfloat16(), residual=torch.randn(m, 2048).bfloat16(),
             norm_weight=torch.ones(2048).bfloat16(), eps=1e-6, weight=w, weight_scale=ws, global_scale=gs,
             q_norm_weight=torch.ones(128).bfloat16(), k_norm_weight=torch.ones(128).bfloat16(), qk_eps=1e-6,
             cos_sin_cache=make_cos_sin_cache(64) if rope else None, positions=torch.arange(m),
             k_cache=kvc[:, 0], v_cache=kvc[:, 1], slot_mapping=torch.arange(m), num_q_heads=nq,
             num_kv_heads=nkv)  # fmt: skip
    if kv != "bf16":
        c.update(k_scale=torch.full((1,), 0.5), v_scale=torch.full((1,), 0.25))
    return c


@needs_dsl
def test_ops_fill_exactly_the_manifest_parameters(monkeypatch):
    """For every op and every entry of the default bundle, the names the op fills are exactly the kernel's
    parameters (written once, in the kernel's signature), and the op launches the entry it should: for the
    GEMV kernels the smallest token tile that holds M (M = 3 and 12 here)."""
    import torch

    import loader

    entries = _default_bundle_entries()
    for subset in ("both designs", "prologue design only"):
        chosen = [e for e in entries if subset == "both designs" or e.spec.get("norm") != "separate"]
        dry = _DryRun(monkeypatch, chosen)
        for e in chosen:
            dry.launched.clear()
            s = e.spec
            if e.kind == "qkv":
                nq, nkv = s["heads"]
                m = {8: 3, 16: 12, 32: 20, 64: 50}[s["max_m"]]  # an M this tile serves
                c = _qkv_inputs(m, nq, nkv, s["weight_format"], s["rope"], s["kv_cache_dtype"])
                for design in (None, s["norm"]):  # the loader's choice, then this entry's design asked for
                    dry.launched.clear()
                    with loader.launch_options(design=design):
                        q, r = loader.flint_qkv_fused(**c)
                    want = design or "prologue"  # eagerly the prologue design, when the bundle has it
                    kinds = [x.kind for x, _, _ in dry.launched]
                    assert kinds == (["norm", "qkv"] if want == "separate" else ["qkv"]), kinds
                    assert dry.launched[-1][0].spec == dict(s, norm=want)
                    assert q.shape == (m, nq * 128) and r.shape == (m, 2048)
            elif e.kind == "norm":
                x, w = torch.randn(2, 2048).bfloat16(), torch.ones(2048).bfloat16()
                if s["residual"]:
                    loader.fused_add_rms_norm(x, x.clone(), w, 1e-6)
                else:
                    loader.rms_norm(x, w, 1e-6)
                assert [x.name for x, _, _ in dry.launched] == [e.name]
            elif e.kind == "gemv":
                m = {8: 2, 16: 12, 32: 30, 64: 64}[s["max_m"]]
                c = _qkv_inputs(m, 8, 1, s["weight_format"], True, "bf16")
                y = loader.gemv(c["x"], c["weight"], c["weight_scale"], c["global_scale"])
                assert [x.name for x, _, _ in dry.launched] == [e.name] and y.shape == (m, 1280)
            else:
                c = _qkv_inputs(2, 8, 1, "bf16", s["rope"], s["kv_cache_dtype"])
                keys = ("q_norm_weight", "k_norm_weight", "qk_eps", "cos_sin_cache", "positions", "k_cache",
                        "v_cache", "slot_mapping", "num_q_heads", "num_kv_heads", "k_scale",
                        "v_scale")  # fmt: skip
                qkv = torch.randn(2, 1280).bfloat16()
                loader.qk_norm_rope_cache(qkv, **{k: c[k] for k in keys if k in c})
                assert [x.name for x, _, _ in dry.launched] == [e.name]


@needs_dsl
def test_a_manifest_with_renamed_parameters_is_refused(monkeypatch):
    import dataclasses

    import loader
    from loader.bundle import BundleError
    from loader.manifest import Param

    entries = _default_bundle_entries()
    renamed = []
    for e in entries:
        if e.kind == "qkv":
            ps = tuple(Param("stride_blk" if p.name == "stride_block" else p.name, p.type, p.align)
                       for p in e.params)  # fmt: skip
            e = dataclasses.replace(e, params=ps)
        renamed.append(e)
    dry = _DryRun(monkeypatch, renamed)
    c = _qkv_inputs(2, 32, 4, "bf16", True, "bf16")
    with pytest.raises(BundleError, match="stride_blk.*different flint-aot versions"):
        loader.flint_qkv_fused(**c)
    assert not dry.launched


@needs_dsl
def test_a_plan_never_skips_a_check_that_could_fail(monkeypatch):
    """A call whose tensors match a plan's metadata skips only the checks that metadata decides. Every
    in-place change of a tensor's metadata, on the same Python object, and every pointer- or value-dependent
    fault behind metadata a plan accepts, is still refused before anything is launched."""
    import torch

    import loader
    from loader import ops, plans

    if not plans.GUARDS:
        pytest.skip("torch's TensorGuards is unavailable: every call is checked in full")
    dry = _DryRun(monkeypatch, _default_bundle_entries())
    base = _qkv_inputs(2, 32, 4, "bf16", True, "bf16")
    loader.flint_qkv_fused(**base)
    loader.flint_qkv_fused(**base)  # the second call takes the plan
    bf16 = torch.bfloat16
    changed_in_place = {
        "x": [lambda t: t.resize_(9, 2048), lambda t: t.as_strided_((2, 2048), (1, 2)),
              lambda t: t.set_(torch.empty(3, 2048, dtype=bf16)),
              lambda t: setattr(t, "data", t.data.float())],
        "weight": [lambda t: t.set_(torch.empty(5104, 2048, dtype=bf16))],
        "norm_weight": [lambda t: t.resize_(1024)],
        "k_cache": [lambda t: t.as_strided_(t.shape, (0, 512, 128, 1))],
        "positions": [lambda t: t.resize_(1)],
        "slot_mapping": [lambda t: t.resize_(3)],
        "cos_sin_cache": [lambda t: t.as_strided_((64, 128), (1, 64))],
    }  # fmt: skip
    refused = 0
    for name, changes in changed_in_place.items():
        for change in changes:
            c = dict(base, **{name: base[name].clone()})
            if name == "k_cache":
                v = base["v_cache"]
                c["k_cache"] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)  # the views' strides
            loader.flint_qkv_fused(**c)  # accepted, by a plan
            launched = len(dry.launched)
            change(c[name])
            with pytest.raises((TypeError, ValueError)):
                loader.flint_qkv_fused(**c)
            assert len(dry.launched) == launched
            refused += 1
    # metadata a plan accepts, with a misaligned pointer, the other cache's memory, or the no-RoPE placeholder
    from loader.reference import make_cos_sin_cache

    buf = torch.empty(129, dtype=bf16)
    same_memory = base["k_cache"][:]  # a distinct object with k_cache's metadata and memory
    one_row = dict(base, cos_sin_cache=make_cos_sin_cache(1))  # the placeholder's shape
    loader.flint_qkv_fused(**one_row)
    for args, name, bad, msg in [(base, "q_norm_weight", buf[1:], "aligned"),
                                 (base, "v_cache", same_memory, "overlap"),
                                 (one_row, "cos_sin_cache", ops._no_rope(0), "placeholder")]:  # fmt: skip
        launched = len(dry.launched)
        with pytest.raises(ValueError, match=msg):
            loader.flint_qkv_fused(**dict(args, **{name: bad}))
        assert len(dry.launched) == launched
    assert refused == 10
    # FP8 scales behind a plan: changed in place after a call accepted them, or a new tensor with a bad value
    fp8 = _qkv_inputs(2, 32, 4, "bf16", True, "fp8_e4m3")
    qkv = torch.randn(2, (32 + 8) * 128).bfloat16()
    head = {k: v for k, v in fp8.items() if k not in ("x", "residual", "norm_weight", "eps", "weight",
                                                      "weight_scale", "global_scale")}  # fmt: skip
    calls = (lambda c: loader.flint_qkv_fused(**c), lambda c: loader.qk_norm_rope_cache(qkv, **head | {
        k: c[k] for k in ("k_scale", "v_scale")}))  # fmt: skip
    for call in calls:
        call(fp8)
        call(fp8)
        for name, bad in (("k_scale", lambda t: t.fill_(0.0)), ("v_scale", lambda t: t.fill_(float("nan"))),
                          ("k_scale", lambda t: t.mul_(-1.0))):  # fmt: skip
            c = dict(fp8, **{name: fp8[name].clone()})
            call(c)  # accepted, its value read
            call(c)
            launched = len(dry.launched)
            bad(c[name])
            with pytest.raises(ValueError, match=name):
                call(c)
            assert len(dry.launched) == launched
        launched = len(dry.launched)
        with pytest.raises(ValueError, match="v_scale"):
            call(dict(fp8, v_scale=torch.full((1,), -1.0)))
        assert len(dry.launched) == launched


def test_numpy_is_declared_where_torch_warns_without_it():
    """torch warns on import when numpy is missing (here: hidden from the import system), so the build
    package, whose set-up the README's commands run, declares it; the serving wheel stays torch and
    cuda-bindings only (docs/bundle.md §8)."""
    tomllib = pytest.importorskip("tomllib")  # (Python >= 3.11)

    code = "import sys; sys.modules['numpy'] = None; import torch"
    r = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and "Failed to initialize NumPy" in r.stderr, r.stderr
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    serve = tomllib.loads((ROOT / "loader" / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in build), build
    assert sorted(d.split(">")[0].split("=")[0].strip() for d in serve) == ["cuda-bindings", "torch"], serve


def _cluster_entry(policy="", cluster=(8, 1, 1)):
    from loader.manifest import KernelEntry, Param

    return KernelEntry("qkv", "q", {}, "sm_90a", "q.sm_90a.cubin", 1, "0" * 64, "e", (128, 1, 1), cluster,
                       0, ("ROW_BLOCKS", 1, 1), (Param("x", "ptr", 16),), "k",
                       cluster_policy=policy)  # fmt: skip


def _policies(cfg) -> list:
    from cuda.bindings import driver as cu

    pid = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE
    return [a.value.clusterSchedulingPolicyPreference.name for a in cfg.attrs[: cfg.numAttrs] if a.id == pid]


def test_cluster_policy_is_launched_as_the_manifest_says(monkeypatch):
    """A cluster kernel's scheduling policy (the token stream's: load_balancing) becomes a launch attribute of
    both PDL configs; none without one. The manifest alone decides: no environment variable changes it (an
    A/B build of another policy is a diagnostic build, docs/config.md)."""
    from loader.runtime import Launcher

    monkeypatch.setenv("FLINT_CLUSTER_POLICY", "spread")  # (a research switch of earlier versions: ignored)
    for pdl in (True, False):
        assert _policies(Launcher._config(_cluster_entry("load_balancing"), pdl)) == [
            "CU_CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING"]  # fmt: skip
        assert _policies(Launcher._config(_cluster_entry(""), pdl)) == []
        assert _policies(Launcher._config(_cluster_entry("spread"), pdl)) == [
            "CU_CLUSTER_SCHEDULING_POLICY_SPREAD"]  # fmt: skip
    assert _policies(Launcher._config(_cluster_entry("", (1, 1, 1)), True)) == []  # no cluster: no policy


def test_manifest_cluster_policy_round_trip_and_refusals():
    """The policy is an optional manifest field: written and read back, absent (an older bundle) -> the
    driver's default; an unknown name, or a policy without a cluster, is refused with the fix."""
    from dataclasses import asdict

    from loader.manifest import ManifestError, _entry_from_dict

    d = asdict(_cluster_entry("load_balancing"))
    assert _entry_from_dict(d, "m").cluster_policy == "load_balancing"
    del d["cluster_policy"]
    assert _entry_from_dict(d, "m").cluster_policy == ""
    for bad, cluster in (("fast", [8, 1, 1]), ("spread", [1, 1, 1]), (3, [8, 1, 1])):
        with pytest.raises(ManifestError, match="rebuild the bundle"):
            _entry_from_dict(dict(d, cluster_policy=bad, cluster=cluster), "m")


def test_a_bundle_of_the_previous_xn_layout_is_refused_with_the_fix():
    """A bundle of schema 2 (built before the norm kernel wrote xn in the layout its qkv kernel reads), 3
    (before it wrote NVFP4's xn in the MMA pair order), 4 (before the 32-token NVFP4 kernel read it as wgmma
    tiles), 5 (before the 64-token one did) or 6 (before the BF16 ones did) would run with this loader's
    layouts and give wrong results or fail at launch, one of 7 marks a diagnostic build by spec keys this
    loader no longer strips, and one of 8 has specs without the hidden size and q/k norm keys, which this
    loader's lookups always ask for (every kernel would be "missing"); its manifest is refused at load, and
    the message says how to fix it (no GPU, no DSL: the manifest alone)."""
    from loader.manifest import SCHEMA_VERSION, Manifest, ManifestError

    assert SCHEMA_VERSION == 9
    d = {"schema_version": 2, "generator": "flint-aot 0.1.0", "dsl_version": "4.8.1", "config": {},
         "kernels": []}  # fmt: skip
    for old in (2, 3, 4, 5, 6, 7, 8):
        msg = rf"schema version {old}, this loader reads version 9; rebuild"
        with pytest.raises(ManifestError, match=msg):
            Manifest.from_dict(dict(d, schema_version=old))
    assert Manifest.from_dict(dict(d, schema_version=9)).schema_version == 9

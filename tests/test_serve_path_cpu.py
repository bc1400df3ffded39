"""The serve path without a GPU: misuse refused before any CUDA call, one tensor in two roles served by a
cached plan, plans bound by name, a short bundle summary, and documentation links that resolve."""

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, needs_dsl
from tests.test_loader_cpu import _default_bundle_entries, _DryRun, _qkv_inputs

_MISUSE = r"""
import torch, loader
from tests.test_loader_cpu import _qkv_inputs
out = []
for dev in ("cpu", "meta"):
    c = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in _qkv_inputs(2, 16, 2, "bf16", True,
                                                                                       "bf16").items()}
    qkv = torch.zeros(2, 20 * 128, dtype=torch.bfloat16, device=dev)
    head = {k: c[k] for k in ("q_norm_weight", "k_norm_weight", "qk_eps", "cos_sin_cache", "positions",
                              "k_cache", "v_cache", "slot_mapping", "num_q_heads", "num_kv_heads")}
    x, r, w = c["x"], c["residual"], c["norm_weight"]
    calls = {"flint_qkv_fused": lambda: loader.flint_qkv_fused(**c),
             "rms_norm": lambda: loader.rms_norm(x, w, 1e-6),
             "fused_add_rms_norm": lambda: loader.fused_add_rms_norm(x, r, w, 1e-6),
             "gemv": lambda: loader.gemv(x, c["weight"]),
             "qk_norm_rope_cache": lambda: loader.qk_norm_rope_cache(qkv, **head),
             "torch.ops.flint.qkv_fused": lambda: torch.ops.flint.qkv_fused(**c),
             "torch.ops.flint.rms_norm": lambda: torch.ops.flint.rms_norm(x, w, 1e-6),
             "torch.ops.flint.fused_add_rms_norm": lambda: torch.ops.flint.fused_add_rms_norm(x, r, w, 1e-6),
             "torch.ops.flint.gemv": lambda: torch.ops.flint.gemv(x, c["weight"]),
             "torch.ops.flint.qk_norm_rope_cache": lambda: torch.ops.flint.qk_norm_rope_cache(qkv, **head)}
    for name, call in calls.items():
        try:
            call()
            out.append(f"{dev} {name}: accepted")
        except (TypeError, ValueError) as e:
            out.append(f"{dev} {name}: {type(e).__name__}: {e}")
        except Exception as e:
            out.append(f"{dev} {name}: WRONG {type(e).__name__}: {e}")
print("\n".join(out))
print("cuda initialized:", torch.cuda.is_initialized())
"""


def test_cpu_and_meta_tensors_are_refused_before_any_cuda_call():
    """Every op and every torch.ops.flint.* refuses CPU and meta tensors with a ValueError naming the device,
    and no CUDA call happens (the process never initializes CUDA), on this torch: a CPU-only torch here, a
    CUDA torch on a GPU machine."""
    r = subprocess.run([sys.executable, "-c", _MISUSE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "cuda initialized: False", r.stdout
    assert len(lines) == 21
    for line in lines[:-1]:
        dev = line.split()[0]
        assert f"ValueError: x must be on a CUDA device, got {dev}" in line or (
            "qk_norm_rope_cache" in line and f"ValueError: qkv must be on a CUDA device, got {dev}" in line
        ), line


@pytest.mark.parametrize("m", [0, 65, 128])
def test_the_fused_op_refuses_m_outside_1_to_64_first(m):
    """flint_qkv_fused (and torch.ops.flint.qkv_fused) serve 1 <= M <= 64: M = 0, 65 (one token past the
    largest tile) or more is a ValueError naming the limit, raised before anything else is looked at (here
    CPU tensors, which M = 64 gets refused for instead: the limit is exactly 64). The GPU side is
    test_qkv_gpu.py's test_m_65_is_refused_and_writes_nothing."""
    import torch

    import loader

    c = _qkv_inputs(m, 16, 2, "bf16", True, "bf16")
    want = rf"^x must have shape \[M, K\] with 1 <= M <= 64 \(the kernels' limit\), got \[{m}, 2048\]$"
    for call in (loader.flint_qkv_fused, torch.ops.flint.qkv_fused):
        with pytest.raises(ValueError, match=want):
            call(**c)
    ok = _qkv_inputs(64, 16, 2, "bf16", True, "bf16")
    with pytest.raises(ValueError, match="^x must be on a CUDA device, got cpu"):
        loader.flint_qkv_fused(**ok)


def test_the_unfused_ops_take_prefill_chunks_and_refuse_past_their_limit():
    """The norms and qk_norm_rope_cache serve 1 <= M <= the bundle's max_tokens (16,384 by default, more than
    the fused op's 64): M = 16,384 passes the M check (refused for its CPU tensors instead), M = 16,385 is a
    ValueError naming the limit and the config key, before any CUDA call; the GEMV keeps 64."""
    import torch

    import loader
    from loader.abi import MAX_TOKENS

    w = torch.ones(2048, dtype=torch.bfloat16)
    limit = rf"with 1 <= M <= {MAX_TOKENS} \(the bundle's norm.max_tokens\)"
    for m, want in ((MAX_TOKENS, "^x must be on a CUDA device"), (MAX_TOKENS + 1, limit)):
        x = torch.empty(m, 2048, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=want):
            loader.rms_norm(x, w, 1e-6)
        with pytest.raises(ValueError, match=want):
            loader.fused_add_rms_norm(x, x, w, 1e-6)
    qkv = torch.empty(MAX_TOKENS + 1, 20 * 128, dtype=torch.bfloat16)
    c = _qkv_inputs(1, 16, 2, "bf16", True, "bf16")
    keys = ("q_norm_weight", "k_norm_weight", "qk_eps", "cos_sin_cache", "positions", "k_cache", "v_cache",
            "slot_mapping", "num_q_heads", "num_kv_heads")  # fmt: skip
    args = {k: c[k] for k in keys}
    with pytest.raises(ValueError, match=rf"1 <= M <= {MAX_TOKENS} \(the bundle's qk_norm_rope_cache\."):
        loader.qk_norm_rope_cache(qkv, **args)
    with pytest.raises(ValueError, match=r"1 <= M <= 64 \(the kernels' limit\)"):
        loader.gemv(torch.empty(65, 2048, dtype=torch.bfloat16), torch.empty(16, 2048, dtype=torch.bfloat16))


def _pointer_of(dry, role):
    return dry.launched[-1][1][role]


@needs_dsl
@pytest.mark.parametrize(
    "op, same",
    [("qkv", ("q_norm_weight", "k_norm_weight")), ("qkv", ("x", "residual")), ("qkv", ("k_scale", "v_scale")),
     ("norm", ("x", "residual")), ("qknrc", ("q_norm_weight", "k_norm_weight")),
     ("qknrc", ("k_scale", "v_scale"))],
)  # fmt: skip
def test_a_tensor_in_two_roles_reaches_a_cached_plan(monkeypatch, op, same):
    """One tensor passed in two roles is served by a plan after the first call (no rebuild, no full check),
    every kernel gets that tensor's pointer in both roles, and a later call with two distinct tensors of the
    same metadata is not mistaken for it."""
    import torch

    import loader
    from loader import plans

    dry = _DryRun(monkeypatch, _default_bundle_entries())
    c = _qkv_inputs(2, 32, 4, "bf16", True, "fp8_e4m3" if "k_scale" in same else "bf16")
    qkv = torch.randn(2, 40 * 128).bfloat16()
    head = {k: v for k, v in c.items() if k not in ("x", "residual", "norm_weight", "eps", "weight",
                                                    "weight_scale", "global_scale")}  # fmt: skip

    def call(a):
        if op == "qkv":
            loader.flint_qkv_fused(**a)
        elif op == "norm":
            loader.fused_add_rms_norm(a["x"], a["residual"], a["norm_weight"], 1e-6)
        else:
            loader.qk_norm_rope_cache(qkv, **{k: a[k] for k in head})

    one = dict(c, **{same[1]: c[same[0]]})
    call(one)
    built = plans.builds
    for _ in range(3):
        call(one)
    assert plans.builds == built, "an aliased call rebuilt its plan"
    ptr = one[same[0]].data_ptr()
    assert _pointer_of(dry, same[0]) == _pointer_of(dry, same[1]) == ptr
    two = dict(c, **{same[1]: c[same[0]].clone()})
    call(two)
    assert plans.builds == built + 1
    assert _pointer_of(dry, same[1]) == two[same[1]].data_ptr() != ptr


@needs_dsl
@pytest.mark.parametrize("role", ["x", "weight", "cos_sin_cache"])
def test_a_misaligned_pointer_is_refused_naming_its_role_on_a_new_and_on_a_cached_plan(monkeypatch, role):
    """A data pointer less aligned than the kernels assume (the manifest's) raises ValueError naming its role
    before anything is launched, both when the call builds its plan and when it finds a cached one; the same
    metadata with an aligned pointer is then served by that plan."""
    import torch

    import loader
    from loader import plans

    dry = _DryRun(monkeypatch, _default_bundle_entries())
    c = _qkv_inputs(2, 32, 4, "bf16", True, "bf16")
    t = c[role]
    shifted = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)  # one element past an aligned base
    shifted.copy_(t)
    for _ in ("the call that builds the plan", "a call that finds it"):
        with pytest.raises(ValueError, match=f"^{role} must be 16-byte aligned"):
            loader.flint_qkv_fused(**dict(c, **{role: shifted}))
        assert not dry.launched
        built = plans.builds
    loader.flint_qkv_fused(**c)
    assert plans.builds == built and len(dry.launched) == 1


@needs_dsl
def test_plans_are_kept_per_m_and_reused(monkeypatch):
    """Cycling M over every size calls of one op builds one plan per M, then only reuses them."""
    import torch

    import loader
    from loader import plans
    from loader.abi import MAX_M

    _DryRun(monkeypatch, _default_bundle_entries())
    w = torch.ones(2048).bfloat16()
    xs = [torch.randn(m, 2048).bfloat16() for m in range(1, MAX_M + 1)]
    built = plans.builds
    for _ in range(3):
        for x in xs:
            loader.rms_norm(x, w, 1e-6)
        assert plans.builds == built + MAX_M


@needs_dsl
def test_kernel_parameters_are_bound_by_name(monkeypatch):
    """The values a kernel receives, parameter by parameter, in both designs and every token tile: tensors'
    pointers under their own names, the norm kernel's xn as the two-kernel qkv kernel's x, the shapes'
    integers, placeholders (0) for what a specialization does not read, the grid from the manifest's rule
    (one CTA per 16 rows; no dynamic shared memory: the token stream's does not depend on M)."""
    import loader

    dry = _DryRun(monkeypatch, _default_bundle_entries())
    for m, design in [(m, d) for m in (3, 12, 17, 40, 64) for d in ("prologue", "separate")]:
        c = _qkv_inputs(m, 32, 4, "bf16", True, "bf16")
        dry.launched.clear()
        with loader.launch_options(design=design):
            q, r = loader.flint_qkv_fused(**c)
        *norm, (entry, a, grid) = dry.launched
        assert entry.kind == "qkv" and entry.spec["max_m"] == next(t for t in (8, 16, 32, 64) if m <= t)
        assert grid == (40 * 8, 1, 1, 0)
        for name in ("weight", "q_norm_weight", "k_norm_weight", "cos_sin_cache", "positions", "slot_mapping",
                     "k_cache", "v_cache"):  # fmt: skip
            assert a[name] == c[name].data_ptr(), name
        if design == "prologue":
            assert a["norm_weight"] == c["norm_weight"].data_ptr()
        values = {t.data_ptr(): n for n, t in c.items() if hasattr(t, "data_ptr")}
        for e, args, _ in dry.launched:  # every pointer a kernel gets is its own parameter's tensor
            for p in e.params:
                if p.type == "ptr" and args[p.name] in values and values[args[p.name]] != p.name:
                    assert (e.kind, p.name, values[args[p.name]]) in {("norm", "weight", "norm_weight")}, (
                        e.kind, p.name, values[args[p.name]])
        assert a["q"] == q.data_ptr() and a["weight_scale"] == a["global_scale"] == a["k_scale"] == 0
        assert (a["m"], a["num_slot_mapping"], a["max_pos"], a["block_size"]) == (m, m, 64, 16)
        assert (a["stride_block"], a["stride_slot"], a["stride_head"]) == c["k_cache"].stride()[:3]
        if design == "prologue":
            assert not norm and a["x"] == c["x"].data_ptr() and a["residual"] == c["residual"].data_ptr()
            assert a["residual_out"] == r.data_ptr() and a["has_residual"] == 1
        else:
            (ne, na, ngrid), = norm
            assert ne.kind == "norm" and ngrid == (m, 1, 1, 0) and na["x"] == c["x"].data_ptr()
            assert na["weight"] == c["norm_weight"].data_ptr() and na["residual"] == c["residual"].data_ptr()
            assert na["residual_out"] == r.data_ptr() and a["x"] == na["xn"] != c["x"].data_ptr()
            assert a["residual"] == a["residual_out"] == a["norm_weight"] == a["has_residual"] == 0
            # xn in the layout the qkv kernel reads: the 8-token kernels' padded rows (2080 elements for
            # BF16), the 16-token kernel's ring (a group's K quarter contiguous, rows of 544), the 32- and
            # 64-token kernels' wgmma tiles (8 KB a group's K quarter, BF16's pairs: xn_pairs 3)
            strides = (na["xn_group"], na["xn_row"], na["xn_quarter"], na["xn_pairs"])
            want = ((8 * 2080, 2080, 512, 0) if m <= 8 else (32 * 544, 544, 8 * 544, 0) if m <= 16
                    else (4 * 4096, 64, 4096, 3))  # fmt: skip
            assert strides == want, (m, strides)
    dry.launched.clear()
    loader.rms_norm(c["x"], c["norm_weight"], 1e-6)  # the op's xn: plain rows
    ((ne, na, _),) = dry.launched
    assert (na["xn_group"], na["xn_row"], na["xn_quarter"]) == (8 * 2048, 2048, 512)


def test_bundle_and_manifest_print_a_summary():
    from loader.bundle import Bundle
    from loader.manifest import Manifest

    entries = _default_bundle_entries() if _dsl() else []
    b = Bundle(ROOT / "build" / "flint", Manifest("flint-aot 0.1.0", "4.8.1", {"archs": ["sm_90a"]}, entries))
    text = repr(b)
    assert len(text) < 200 and "flint-aot 0.1.0" in text and "4.8.1" in text and str(b.path) in text
    assert f"{len(entries)} cubin" in text


def test_dir_of_loader_lists_each_public_name_once():
    import loader

    loader.flint_qkv_fused  # noqa: B018 (binds the public names as module attributes)
    names = dir(loader)
    assert len(names) == len(set(names)) and set(loader.__all__) <= set(names)


def _dsl() -> bool:
    try:
        import cutlass  # noqa: F401
    except ImportError:
        return False
    return True


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_links_in_readme_and_docs_resolve():
    """Every relative link of README.md, BENCHMARKS.md, examples/README.md and docs/*.md names a file or
    folder of the repository."""
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "examples" / "README.md",
             *sorted((ROOT / "docs").glob("*.md"))]  # fmt: skip
    checked = 0
    for page in pages:
        for target in _LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)}: link to {target} resolves to nothing"
            assert ROOT in path.parents or path == ROOT, f"{page.name}: {target} leaves the repository"
            checked += 1
    assert checked > 10


def test_the_readme_builds_the_bundle_once():
    """The README's first lines are the two commands a newcomer needs (install and build the bundle; install
    and run the tests), and its Quickstart goes on from the built bundle: a reader following both builds
    once."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    builds = [ln for b in blocks for ln in b.splitlines() if "flint-aot build configs/flint.yaml" in ln]
    assert len(builds) == 1 and builds[0] in blocks[0], builds
    first = blocks[0].replace("\\\n", " ").splitlines()
    assert len(first) == 2 and all("pip install" in ln for ln in first), first
    assert "flint-aot build configs/flint.yaml" in first[0] and "pytest" in first[1], first


def test_the_examples_readme_pins_transformers_as_the_extra_and_runs_python_one_way():
    tomllib = pytest.importorskip("tomllib")  # (Python >= 3.11)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pin,) = extras["example"]
    text = (ROOT / "examples" / "README.md").read_text(encoding="utf-8")
    lines = [ln for b in re.findall(r"```bash\n(.*?)```", text, re.S) for ln in b.splitlines()]
    assert [ln for ln in lines if "transformers" in ln] == [ln for ln in lines if f"'{pin}'" in ln] != []
    runs = [ln.split()[0] for ln in lines if "examples/" in ln and ".py" in ln]
    assert set(runs) == {"python"}, runs  # (PYTHONPATH=. is said once, in prose)


def test_fake_implementations_give_the_shapes_at_every_m():
    """torch.compile's fake tensors: each torch.ops.flint.* gives its outputs' shapes and dtypes at M = 1, 8
    and 16 (the fakes are named functions with the ops' signatures)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import loader  # noqa: F401  (registers torch.ops.flint.*)

    mode = FakeTensorMode()
    for m in (1, 8, 16):
        real = _qkv_inputs(m, 32, 4, "bf16", True, "bf16")
        qkv = torch.empty(m, 40 * 128, dtype=torch.bfloat16)
        with mode:
            c = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in real.items()}
            qkv = mode.from_tensor(qkv)
            q, r = torch.ops.flint.qkv_fused(**c)
            assert q.shape == (m, 32 * 128) and r.shape == (m, 2048) and q.dtype == torch.bfloat16
            q, r = torch.ops.flint.qkv_fused(**dict(c, residual=None))
            assert q.shape == (m, 32 * 128) and r.shape == (0,)
            x, w = c["x"], c["norm_weight"]
            assert torch.ops.flint.rms_norm(x, w, 1e-6).shape == (m, 2048)
            assert [t.shape for t in torch.ops.flint.fused_add_rms_norm(x, x, w, 1e-6)] == [(m, 2048)] * 2
            assert torch.ops.flint.gemv(x, c["weight"], None, None).shape == (m, 40 * 128)
            head = {k: c[k] for k in ("q_norm_weight", "k_norm_weight", "qk_eps", "cos_sin_cache",
                                      "positions", "k_cache", "v_cache", "slot_mapping", "num_q_heads",
                                      "num_kv_heads")}  # fmt: skip
            assert torch.ops.flint.qk_norm_rope_cache(qkv, **head).shape == (m, 32 * 128)


def test_a_value_outside_its_c_type_is_refused_when_bound_and_when_launched():
    """Launcher.bind refuses a constant that does not fit its parameter's C type (naming it) before any
    launch, and a run whose per-call value does not fit is refused the same way without launching; values
    that fit are packed at their parameters' offsets, the grid evaluated from the manifest's rule."""
    from loader import runtime
    from loader.manifest import KernelEntry, Param

    params = (Param("x", "ptr", 16), Param("m", "i32"), Param("stride", "i64"), Param("eps", "f32"))
    entry = KernelEntry("gemv", "k", {}, "sm_90a", "k.cubin", 1, "0" * 64, "k", (128, 1, 1), (1, 1, 1), 0,
                        ("ROW_BLOCKS", 1, 1), params, "b")  # fmt: skip
    launched = []

    class Dry(runtime.Launcher):
        def launch(self, dims, stream, pdl):
            launched.append((dims, self._struct.unpack(self._buf.raw[: self._struct.size])))

    k = Dry(0, entry, 0, None)
    sym = {"M": 3, "ROW_BLOCKS": 7}
    with pytest.raises(ValueError, match="stride = 9223372036854775808 does not fit the kernel's i64"):
        k.bind(("x", "eps"), sym, {"m": 3, "stride": 1 << 63}, {})
    run, masks = k.bind(("x", "eps"), sym, {"m": 3, "stride": -(1 << 40)}, {})
    assert masks == (15, 0) and not launched  # (alignment - 1: x 16 bytes, eps none)
    run((0x1000, 0.5), 0, True)
    assert launched == [((7, 1, 1, 0), (0x1000, 3, -(1 << 40), 0.5))]
    with pytest.raises(ValueError, match="x = -1 does not fit the kernel's ptr"):
        run((-1, 0.5), 0, True)
    assert len(launched) == 1
    assert k._struct.format == "<Qixxxxqf"  # natural C alignment: 4 bytes of padding before the i64

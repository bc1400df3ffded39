"""Plugin kernels without a GPU: the config's plugins section, the manifest's record of a plugin kernel, and
loader.launch_kernel's checks with the launch stubbed (a real runtime.Launcher packs the parameters by name,
its driver call is replaced): every misuse is a TypeError / ValueError naming the parameter, nothing
launched. The serve path imports neither the DSL nor the plugin's kernel module (a subprocess)."""

import json
import re
import subprocess
import sys
import threading

import pytest
import torch

from flint_aot.config import ConfigError, expand, validate
from loader.abi import CALLER_GRID
from loader.manifest import KernelEntry, Manifest, ManifestError, Param
from tests.conftest import ROOT

SILU = ((Param("x", "ptr", 16), Param("out", "ptr", 16), Param("m", "i32")), (128, 1, 1), (1, 1, 1))
SCALARS = ((Param("p", "ptr", 4), Param("n", "i64"), Param("s", "f32")), (64, 1, 1), (2, 1, 1))


def _entry(kind, spec, params, block, cluster, grid=CALLER_GRID, dyn_smem=0, arch="sm_90a"):
    name = kind + "".join(f"_{k}{v}" for k, v in spec.items())
    return KernelEntry(kind, name, spec, arch, f"{name}.{arch}.cubin", 1, "0" * 64, f"flint_{name}_0", block,
                       cluster, dyn_smem, grid, params, "k")  # fmt: skip


# ----------------------------------------------------------------------------- config
def _config_error(plugins) -> str:
    with pytest.raises(ConfigError) as e:
        validate({"archs": ["sm_90a"], "plugins": plugins}, "cfg.yaml")
    msg = str(e.value)
    assert msg.startswith("cfg.yaml: plugins") and "\n" not in msg, msg
    return msg


def test_a_kind_that_clashes_with_a_built_in_is_one_line():
    msg = _config_error({"qkv": {"module": "mine"}})
    assert msg.startswith("cfg.yaml: plugins.qkv: 'qkv' is a built-in kind") and "kind name of its own" in msg


@pytest.mark.parametrize("plugins, where", [
    ({"silu": {"module": "not a module"}}, "plugins.silu.module"),
    ({"silu": {"module": "m", "klass": "K"}}, "plugins.silu.klass"),
    ({"silu": {"module": "m", "class": "a.b"}}, "plugins.silu.class"),
    ({"Silu": {"module": "m"}}, "plugins.Silu"),
    ({"silu": {"module": "m", "spec": {"size": []}}}, "plugins.silu.spec.size"),
    ({"silu": {"module": "m", "spec": {"size": [1.5]}}}, "plugins.silu.spec.size[0]"),
    ({"silu": {"module": "m", "spec": {"size": ["a/b"]}}}, "plugins.silu.spec.size[0]"),
    ({"silu": {"module": "m", "spec": {"a": [1, "1"]}}}, "plugins.silu: the name of silu {'a': '1'}"),
])  # fmt: skip
def test_a_malformed_plugins_section_is_one_line(plugins, where):
    assert _config_error(plugins).startswith(f"cfg.yaml: {where}")


def test_the_plugin_matrix_is_the_product_of_its_axes():
    axes = {"size": [64, 128], "gated": [True, False], "tile": [[1, 2]]}
    c = validate({"archs": ["sm_90a", "sm_100a"], "norm": {"residual": [True]},
                  "plugins": {"act": {"module": "pkg.act", "spec": axes}}}, "cfg.yaml")  # fmt: skip
    specs = [s for s in expand(c) if s.kind == "act"]
    assert len(specs) == 2 * 2 * 2 and len({s.label for s in specs}) == 8
    assert {s.plugin for s in specs} == {("pkg.act", "KERNEL")}
    # (the name takes the axes in alphabetical order: gated, size, tile)
    assert specs[0].name == "act_gated1_size64_tile1x2" and specs[0].spec == {"size": 64, "gated": True,
                                                                              "tile": [1, 2]}  # fmt: skip
    assert [s.kind for s in expand(c)][:2] == ["norm", "norm"]  # the built-ins first, unchanged


def test_a_plugin_name_takes_its_axes_in_alphabetical_order_whatever_the_config_s_order():
    """Axes written out of alphabetical order (as a plugin author may): each specialization is named with its
    axes in alphabetical order (docs/config.md), so the names do not depend on how the config is serialized:
    the manifest records the config with sorted keys, and the variants `flint-aot verify` expands from that
    record are the ones the build named; the same axes in another order name the same specializations."""
    from flint_aot.cli import _against_config
    from loader.bundle import Bundle

    def config(spec):
        return validate({"archs": ["sm_90a"], "plugins": {"act": {"module": "pkg.act", "spec": spec}}}, "c")

    c = config({"mode": ["fast", "exact"], "block": [128, 256]})
    built = {s.label: s.spec for s in expand(c)}
    assert sorted(built) == [f"act_block{b}_mode{m}@sm_90a" for b in (128, 256) for m in ("exact", "fast")]
    assert built["act_block256_modefast@sm_90a"] == {"mode": "fast", "block": 256}
    recorded = json.loads(json.dumps(c, sort_keys=True))  # what the manifest holds (loader.manifest)
    assert {s.label: s.spec for s in expand(validate(recorded, "manifest"))} == built
    other = config({"block": [256, 128], "mode": ["exact", "fast"]})
    assert {s.label: s.spec for s in expand(other)} == built

    # `flint-aot verify`'s check of the manifest against its recorded config, on the entries a build writes
    entries = [KernelEntry(s.kind, s.name, s.spec, s.arch, f"{s.name}.{s.arch}.cubin", 1, "0" * 64,
                           f"flint_{s.name}_0", *SILU[1:], 0, CALLER_GRID, SILU[0], "k")
               for s in expand(c)]  # fmt: skip
    rec = {"module": "pkg.act", "class": "KERNEL", "source_sha256": "a" * 64, "files": [], "version": None}
    m = Manifest("flint-aot test", "4.8.1", c, entries, plugins={"act": rec})
    assert _against_config(Bundle(ROOT, Manifest.from_dict(json.loads(m.dumps())))) == {}


# ----------------------------------------------------------------------------- manifest
def test_the_manifest_records_a_plugin_kernel_and_its_version():
    e = _entry("silu_mul", {"intermediate": 6144}, *SILU)
    rec = {"module": "silu_mul.kernel", "class": "SiluMulKernel", "source_sha256": "a" * 64,
           "files": ["silu_mul/kernel.py"], "version": None}  # fmt: skip
    m = Manifest("flint-aot 0.1.0", "4.8.1", {"archs": ["sm_90a"]}, [e], plugins={"silu_mul": rec})
    d = json.loads(m.dumps())
    (k,) = d["kernels"]
    assert k["grid"] == ["GRID_X", "GRID_Y", "GRID_Z"] and k["block"] == [128, 1, 1] and k["dyn_smem"] == 0
    assert k["params"] == [{"name": "x", "type": "ptr", "align": 16},
                           {"name": "out", "type": "ptr", "align": 16},
                           {"name": "m", "type": "i32", "align": 0}]  # fmt: skip
    assert d["plugins"] == {"silu_mul": rec}
    back = Manifest.from_dict(d)
    assert back.kernels == [e] and back.plugins == {"silu_mul": rec} and back.dumps() == m.dumps()
    plain = Manifest("g", "4.8.1", {}, [])
    assert "plugins" not in json.loads(plain.dumps())  # a bundle without plugins keeps its bytes
    with pytest.raises(ManifestError, match="plugins: expected an object"):
        Manifest.from_dict(dict(d, plugins=["silu_mul"]))
    with pytest.raises(ManifestError, match="bad grid rule"):
        Manifest.from_dict(dict(d, kernels=[dict(k, grid=["GRID_W", 1, 1])]))


# ----------------------------------------------------------------------------- loader.launch_kernel
class _Dry:
    """launch_kernel against a bundle of the given entries: a real runtime.Launcher per (device, kernel),
    whose launch records the packed parameters by name, the grid, shared memory, stream and PDL. Tensors are
    CPU tensors standing for cuda:0 (cuda:N for a tensor with `fake_dev = N`)."""

    def __init__(self, monkeypatch, entries):
        from loader import kernels, runtime
        from loader.bundle import Bundle

        self.bundle = Bundle(ROOT, Manifest("flint-aot test", "4.8.1", {}, list(entries)))
        self.launched, self.loads, dry = [], 0, self

        class DryLauncher(runtime.Launcher):
            def launch(self, dims, stream, pdl):
                values = self._struct.unpack(self._buf.raw[: self._struct.size])
                named = dict(zip(self.names, values, strict=True))
                dry.launched.append((self.entry.name, named, dims, stream, pdl, self.dev))

        def launcher(dev, kind, key, spec_of):
            dry.loads += 1
            return DryLauncher(dev, runtime.first_entry(self.bundle, (9, 0), kind, spec_of()), 0, None)

        monkeypatch.setattr(runtime, "_tls", threading.local())
        monkeypatch.setattr(runtime, "launcher", launcher)
        monkeypatch.setattr(runtime, "entry", lambda dev, kind, key, spec_of: runtime.first_entry(
            self.bundle, (9, 0), kind, spec_of()))  # fmt: skip
        monkeypatch.setattr(torch.Tensor, "get_device", lambda t: getattr(t, "fake_dev", 0))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(kernels, "_raw_stream", lambda dev: 7000 + dev)


def _silu_args(m=3, i=6144):
    return {"x": torch.randn(m, 2 * i).bfloat16(), "out": torch.empty(m, i, dtype=torch.bfloat16), "m": m}


def test_launch_kernel_fills_the_parameters_by_name(monkeypatch):
    """Keywords in any order reach the kernel's parameters in the manifest's order, with the caller's grid,
    shared memory, stream and PDL; a repeated call reuses the thread's plan and launcher."""
    import loader
    from loader import kernels, runtime

    dry = _Dry(monkeypatch, [_entry("silu_mul", {"intermediate": 6144}, *SILU)])
    a = _silu_args()
    loader.launch_kernel("silu_mul", {"intermediate": 6144}, (6, 3), m=3, out=a["out"], x=a["x"])
    name, values, dims, stream, pdl, dev = dry.launched[-1]
    assert name == "silu_mul_intermediate6144" and dev == 0 and stream == 7000 and pdl is True
    assert values == {"x": a["x"].data_ptr(), "out": a["out"].data_ptr(), "m": 3} and dims == (6, 3, 1, 0)
    plans = {k for k in runtime.thread_cache() if k[0] is kernels.launch_kernel}
    with loader.launch_options(pdl=False):
        loader.launch_kernel("silu_mul", {"intermediate": 6144}, (6, 3, 1), m=3, out=a["out"], x=a["x"])
    assert dry.launched[-1][4] is False and dry.launched[-1][2] == (6, 3, 1, 0)
    loader.launch_kernel("silu_mul", {"intermediate": 6144}, (6, 3), pdl=False, m=3, out=a["out"], x=a["x"])
    assert {k for k in runtime.thread_cache() if k[0] is kernels.launch_kernel} == plans and dry.loads == 1
    b = _silu_args(m=5)
    loader.launch_kernel("silu_mul", {"intermediate": 6144}, [6, 5], m=5, out=b["out"], x=b["x"])
    assert dry.launched[-1][1] == {"x": b["x"].data_ptr(), "out": b["out"].data_ptr(), "m": 5}
    assert dry.launched[-1][2] == (6, 5, 1, 0) and len(dry.launched) == 4


def _misuses():
    """(what, call(launch, args), exception, message start): each names the parameter (or grid, smem,
    stream) at fault."""
    spec = {"intermediate": 6144}

    def call(**change):
        def f(launch, a):
            kw = dict(a, **{k: v for k, v in change.items() if v is not None})
            for k in [k for k, v in change.items() if v is None]:
                del kw[k]
            grid, smem, stream = kw.pop("grid", (6, 3)), kw.pop("smem", None), kw.pop("stream", None)
            launch("silu_mul", spec, grid, smem=smem, stream=stream, **kw)

        return f

    def moved(a, name, dev):
        t = a[name].clone()
        t.fake_dev = dev
        return t

    def shifted(t):
        s = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)  # 2 bytes past a 16-byte boundary
        return s.copy_(t)

    return [
        ("missing", lambda launch, a: call(m=None)(launch, a), TypeError,
         "silu_mul {'intermediate': 6144}: missing parameter 'm': the kernel takes x, out, m"),
        ("unknown", lambda launch, a: call(bias=a["x"])(launch, a), TypeError,
         "silu_mul {'intermediate': 6144}: unknown parameter 'bias'"),
        ("given twice", lambda launch, a: launch("silu_mul", spec, (6, 3), **a, x=a["x"]), TypeError,
         "launch_kernel() got multiple values for keyword argument 'x'"),
        ("wrong device", lambda launch, a: call(out=moved(a, "out", 1))(launch, a), ValueError,
         "out is on cpu, expected cuda:0, the launch device (x's)"),
        ("a CPU tensor", lambda launch, a: call(x=moved(a, "x", -1))(launch, a), ValueError,
         "x is on cpu, expected a CUDA device"),
        ("misaligned", lambda launch, a: call(out=shifted(a["out"]))(launch, a), ValueError,
         "out must be 16-byte aligned (data_ptr % 16 = 2)"),
        ("not a tensor", lambda launch, a: call(x=a["x"].data_ptr())(launch, a), TypeError,
         "x must be a torch.Tensor (a pointer), got int"),
        ("out of C range", lambda launch, a: call(m=1 << 31)(launch, a), ValueError,
         "m = 2147483648 does not fit the kernel's i32 parameter (-2147483648..2147483647)"),
        ("below C range", lambda launch, a: call(m=-(1 << 31) - 1)(launch, a), ValueError,
         "m = -2147483649 does not fit the kernel's i32 parameter"),
        ("a float for an int", lambda launch, a: call(m=3.0)(launch, a), TypeError,
         "m must be a Python int (an i32 parameter), got float"),
        ("a bool for an int", lambda launch, a: call(m=True)(launch, a), TypeError,
         "m must be a Python int (an i32 parameter), got bool"),
        ("grid of zero", lambda launch, a: call(grid=(0, 3))(launch, a), ValueError, "grid must be 1 to 3"),
        ("grid of floats", lambda launch, a: call(grid=(6.0, 3))(launch, a), ValueError, "grid must be"),
        ("grid of bools", lambda launch, a: call(grid=(6, True))(launch, a), ValueError, "grid must be"),
        ("smem a float", lambda launch, a: call(smem=0.0)(launch, a), ValueError, "smem must be an int"),
        ("grid too tall", lambda launch, a: call(grid=(6, 65536))(launch, a), ValueError, "grid must be"),
        ("too much smem", lambda launch, a: call(smem=1024)(launch, a), ValueError,
         "smem must be an int in 0..0 (what the kernel declares), got 1024"),
        ("not a stream", lambda launch, a: call(stream=5)(launch, a), ValueError,
         "stream must be a torch.cuda.Stream of the launch device cuda:0, got 5"),
        ("spec a list", lambda launch, a: launch("silu_mul", [6144], (6, 3), **a), TypeError,
         "kind must be a str, spec a dict"),
    ]  # fmt: skip


@pytest.mark.parametrize("what, call, exc, start", _misuses(), ids=[m[0] for m in _misuses()])
def test_launch_kernel_misuse_names_the_parameter_and_launches_nothing(monkeypatch, what, call, exc, start):
    """On a new plan and on the thread's cached one (a good call first), each misuse raises naming the
    parameter at fault, and nothing is launched."""
    import loader

    dry = _Dry(monkeypatch, [_entry("silu_mul", {"intermediate": 6144}, *SILU)])
    for warm in (False, True):
        if warm:
            loader.launch_kernel("silu_mul", {"intermediate": 6144}, (6, 3), **_silu_args())
        before = len(dry.launched)
        with pytest.raises(exc) as e:
            call(loader.launch_kernel, _silu_args())
        msg = str(e.value).removeprefix("loader.kernels.")  # (how Python >= 3.13 names the function)
        assert msg.startswith(start), msg
        assert len(dry.launched) == before


def test_launch_kernel_scalars_clusters_and_lookup(monkeypatch):
    """i64 and f32 parameters take their C ranges (an f32 an int or a float; inf and nan as such); a grid
    must be a multiple of the cluster; a spec the bundle lacks is a LookupError listing what it has."""
    import loader

    dry = _Dry(monkeypatch, [_entry("scale", {"v": 1}, *SCALARS, dyn_smem=4096)])
    p = torch.empty(8)
    ok = dict(p=p, n=-(1 << 63), s=1e38)
    for s in (1e38, 2, float("inf"), float("nan")):
        loader.launch_kernel("scale", {"v": 1}, (4,), **dict(ok, s=s))
    assert [v["n"] for _, v, *_ in dry.launched] == [-(1 << 63)] * 4 and dry.launched[1][1]["s"] == 2.0
    assert dry.launched[0][2] == (4, 1, 1, 4096)  # smem: what the kernel declares, unless given
    loader.launch_kernel("scale", {"v": 1}, (4,), smem=100, **ok)
    assert dry.launched[-1][2] == (4, 1, 1, 100)
    for bad, exc, msg in [
        (dict(ok, s=3.5e38), ValueError, "s = 3.5e+38 does not fit the kernel's f32"),
        (dict(ok, n=1 << 63), ValueError, "n = 9223372036854775808 does not fit the kernel's i64"),
        (dict(ok, s="1"), TypeError, "s must be a Python float (an f32 parameter), got str"),
    ]:
        with pytest.raises(exc, match="^" + re.escape(msg)):
            loader.launch_kernel("scale", {"v": 1}, (4,), **bad)
    with pytest.raises(ValueError, match=r"grid \(3, 1, 1\) does not fit scale's rule .* \(2, 1, 1\)"):
        loader.launch_kernel("scale", {"v": 1}, (3,), **ok)
    with pytest.raises(LookupError, match="no scale kernel for v=2 on sm_90a; it has: v=1"):
        loader.launch_kernel("scale", {"v": 2}, (4,), **ok)
    assert len(dry.launched) == 5


def test_launch_kernel_runs_a_built_in_kernel_by_its_grid_rule(monkeypatch):
    """A built-in kernel of the bundle by name too: its grid rule's symbols take the caller's grid, its
    constant dimensions must match."""
    import loader

    norm = _entry("norm", {"residual": False}, (Param("x", "ptr", 16), Param("eps", "f32")), (256, 1, 1),
                  (1, 1, 1), grid=("M", 1, 1))  # fmt: skip
    dry = _Dry(monkeypatch, [norm])
    x = torch.randn(5, 2048).bfloat16()
    loader.launch_kernel("norm", {"residual": False}, (5,), x=x, eps=1e-6)
    assert dry.launched[-1][2] == (5, 1, 1, 0) and dry.launched[-1][1]["x"] == x.data_ptr()
    with pytest.raises(ValueError, match=r"grid \(5, 2, 1\) does not fit norm's rule \('M', 1, 1\)"):
        loader.launch_kernel("norm", {"residual": False}, (5, 2), x=x, eps=1e-6)


_SERVE = r"""
import sys, threading, torch
sys.path.insert(0, "examples/custom_kernel")
import loader
from loader import kernels, runtime
from loader.abi import CALLER_GRID
from loader.bundle import Bundle
from loader.manifest import KernelEntry, Manifest, Param

params = (Param("x", "ptr", 16), Param("out", "ptr", 16), Param("m", "i32"))
e = KernelEntry("silu_mul", "silu_mul_intermediate1024", {"intermediate": 1024}, "sm_90a", "s.cubin", 1,
                "0" * 64, "flint_s_0", (128, 1, 1), (1, 1, 1), 0, CALLER_GRID, params, "k")
bundle = Bundle(".", Manifest("t", "4.8.1", {}, [e]))
launched = []

class Dry(runtime.Launcher):
    def launch(self, dims, stream, pdl):
        values = self._struct.unpack(self._buf.raw[: self._struct.size])
        launched.append((dict(zip(self.names, values)), dims))

runtime.entry = lambda dev, kind, key, spec_of: runtime.first_entry(bundle, (9, 0), kind, spec_of())
runtime.launcher = lambda dev, kind, key, spec_of: Dry(dev, runtime.entry(dev, kind, key, spec_of), 0, None)
torch.Tensor.get_device = lambda t: 0
kernels._raw_stream = lambda dev: 0
import silu_mul_op

x = torch.randn(3, 2048).bfloat16()
out = silu_mul_op.silu_mul(x)
want = [({"x": x.data_ptr(), "out": out.data_ptr(), "m": 3}, (1, 3, 1, 0))]
assert out.shape == (3, 1024) and launched == want, launched
try:
    silu_mul_op.silu_mul(x[:, :2000])
except ValueError as err:
    assert str(err).startswith("x must be a contiguous [M, 2*I] tensor"), err
else:  # (neither raised nor launched: a refusal that says nothing)
    raise AssertionError("silu_mul accepted x of another shape")
assert len(launched) == 1
print(sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "flint_aot") or m == "silu_mul.kernel"))
"""


def test_the_serve_path_imports_neither_the_dsl_nor_the_plugin_module():
    """The example's serve side (its op over loader.launch_kernel, the launch stubbed) launches the plugin
    kernel with its parameters by name, refuses x of another shape, and leaves cutlass, flint_aot and the
    plugin's kernel module unimported."""
    r = subprocess.run([sys.executable, "-c", _SERVE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout

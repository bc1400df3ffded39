"""The fuzz harness (tests/fuzz_harness.py) on the hidden-size and q/k-norm axes, on the CPU.

The harness's Kernels and strategies read the axes from the bundle's specs (hidden sizes per kind, q/k norm
settings), and its expectation model follows the loader: K is x's columns, the other tensors' shapes follow
it, a hidden size or q/k norm setting the bundle lacks is a LookupError after every argument check, exactly
one None q/k norm weight a ValueError. Checked here three ways:

* the model on hand-made examples, against a bundle of hidden 1024 only and one of two hidden sizes;
* the strategies: drawn examples cover the bundle's hidden sizes and q/k norm settings, mostly the bundle's;
* the model against the real loader: loader.ops runs dry on CPU tensors (devices faked as cuda:0, as
  tests/test_loader_cpu.py's _DryRun does; its kernel lookup in a hand-made manifest, nothing launched), with
  loader.reference standing in for the kernels, so that random examples run end to end through
  fuzz_harness.run_example (the outcome the model predicts, the values against the reference), and planted
  bugs of such a loader are caught.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections import Counter, defaultdict

import pytest
import torch

from tests.conftest import HAS_GPU

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from loader import abi, checks, nvfp4, ops, runtime  # noqa: E402
from loader.abi import HEAD_DIM as D  # noqa: E402
from loader.bundle import Bundle  # noqa: E402
from loader.manifest import KernelEntry, Manifest  # noqa: E402
from loader.reference import fp8_cache_value, qk_norm_rope_ref, rms_norm_ref  # noqa: E402
from tests import fuzz_harness as fh  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

# CPU work that says nothing about the GPU: not repeated on a GPU machine's (budgeted) test runs; the
# strategies' draws whatever other test modules a run loads (no_local_constants: tests/conftest.py)
pytestmark = [pytest.mark.skipif(
    HAS_GPU and not os.environ.get("FLINT_FUZZ_SELFTEST"),
    reason="CPU self-test of tests/fuzz_harness.py, for the CPU machine (FLINT_FUZZ_SELFTEST=1 runs it here)",
), pytest.mark.usefixtures("no_local_constants")]  # fmt: skip

TV, LOOKUP = {TypeError, ValueError}, {LookupError}
TILES = abi.M_TILES


# ============================================================================= bundles
def axes_specs() -> list[tuple[str, dict]]:
    """A bundle of two hidden sizes, in the manifest's own spec form (loader.abi's constructors): norm at 1024
    and 1536; gemv BF16 at 1024 only, NVFP4 at both; qkv heads 8x1 at 1024 with and without q/k norm, 16x2
    at 1536 with q/k norm only; qk_norm_rope_cache with q/k norm, and without it for RoPE only."""
    out = [("norm", abi.norm_spec(r, k)) for k in (1024, 1536) for r in (True, False)]
    out += [("gemv", abi.gemv_spec("bf16", t, 1024)) for t in TILES]
    out += [("gemv", abi.gemv_spec("nvfp4", t, k)) for k in (1024, 1536) for t in TILES]
    for nq, nkv, k, qk_norms in ((8, 1, 1024, (True, False)), (16, 2, 1536, (True,))):
        for fmt, rope, kv, qkn, t in itertools.product(("bf16", "nvfp4"), (True, False), abi.KV_CACHE_DTYPES,
                                                       qk_norms, TILES):  # fmt: skip
            out.append(("qkv", abi.qkv_spec(fmt, rope, nq, nkv, kv, "separate", t, k, qkn)))
    for rope in (True, False):
        for kv in abi.KV_CACHE_DTYPES:
            out.append(("qk_norm_rope_cache", abi.qk_norm_rope_cache_spec(rope, kv, True)))
            if rope:
                out.append(("qk_norm_rope_cache", abi.qk_norm_rope_cache_spec(rope, kv, False)))
    return out


def one_k_specs(k=1024, qk_norms=(True,)) -> list[tuple[str, dict]]:
    """Every kind at one hidden size k and these q/k norm settings: heads 8x1, both formats, RoPE or not,
    both cache dtypes."""
    out = [("norm", abi.norm_spec(r, k)) for r in (True, False)]
    out += [("gemv", abi.gemv_spec(f, t, k)) for f in ("bf16", "nvfp4") for t in TILES]
    for rope, kv, qkn in itertools.product((True, False), abi.KV_CACHE_DTYPES, qk_norms):
        out.append(("qk_norm_rope_cache", abi.qk_norm_rope_cache_spec(rope, kv, qkn)))
        for fmt, t in itertools.product(("bf16", "nvfp4"), TILES):
            out.append(("qkv", abi.qkv_spec(fmt, rope, 8, 1, kv, "separate", t, k, qkn)))
    return out


MAX_TOKENS = 256  # the hand-made bundles' norm and qk_norm_rope_cache max_tokens (small: CPU work)


def bundle_of(specs) -> Bundle:
    entries = []
    for kind, s in specs:
        name = abi.spec_name(kind, s)
        entries.append(KernelEntry(kind, name, s, "sm_90a", f"{name}.cubin", 1, "0" * 64, name, (128, 1, 1),
                                   (1, 1, 1), 0, abi.GRID[kind], (), "k"))  # fmt: skip
    config = {"norm": {"max_tokens": MAX_TOKENS}, "qk_norm_rope_cache": {"max_tokens": MAX_TOKENS}}
    return Bundle(ROOT, Manifest("flint-aot test", "4.8.1", config, entries))


AXES = fh.Kernels(axes_specs())
ONE_K = fh.Kernels(one_k_specs())  # hidden 1024 only, q/k norm on only
ONE_K_BOTH = fh.Kernels(one_k_specs(qk_norms=(True, False)))


def cfg_for(kernels, **kw) -> fh.FuzzConfig:
    return fh.FuzzConfig(kernels, foreign=(), homes=(0,), extra_heads=((4, 4), (8, 2)),
                         gemv_rows=(16, 48, 144), max_tokens=MAX_TOKENS, big_m=(65, 200), **kw)  # fmt: skip


# ============================================================================= Kernels
def test_kernels_record_hidden_sizes_and_qk_norm_per_kind():
    assert AXES.hiddens("norm") == [1024, 1536] and AXES.hiddens("norm", residual=True) == [1024, 1536]
    assert AXES.hiddens("gemv", weight_format="bf16") == [1024]
    assert AXES.hiddens("gemv", weight_format="nvfp4") == [1024, 1536]
    assert AXES.hiddens("qkv") == [1024, 1536]
    assert AXES.hiddens("qkv", heads=(8, 1)) == [1024] and AXES.hiddens("qkv", heads=[16, 2]) == [1536]
    assert AXES.qk_norms("qkv", heads=(8, 1), hidden=1024) == [False, True]
    assert AXES.qk_norms("qkv", heads=(16, 2), hidden=1536) == [True]
    assert AXES.qk_norms("qk_norm_rope_cache") == [False, True]
    assert AXES.qk_norms("qk_norm_rope_cache", rope=False) == [True]
    assert AXES.qkv_heads() == [(8, 1), (16, 2)] and AXES.qkv_heads(hidden=1536) == [(16, 2)]
    assert AXES.names("hidden") and AXES.names("qk_norm")
    assert AXES.has_qkv("bf16", True, (8, 1), "bf16", True, 1024, False)
    assert not AXES.has_qkv("bf16", True, (8, 1), "bf16", True, 1536, True)  # heads at the other K
    assert not AXES.has_qkv("bf16", True, (16, 2), "bf16", True, 1536, False)  # q/k norm on only
    # the input-norm kernel of the qkv kernel's hidden size is needed for the two-kernel design
    no_norm_1536 = fh.Kernels([(k, s) for k, s in axes_specs() if not (k == "norm" and s["hidden"] == 1536)])
    assert not no_norm_1536.has_qkv("bf16", True, (16, 2), "bf16", False, 1536, True)
    assert no_norm_1536.has_qkv("bf16", True, (8, 1), "bf16", False, 1024, True)


def test_specs_without_the_axes_have_their_defaults():
    old = fh.Kernels([("norm", {"residual": True}), ("qk_norm_rope_cache", {"rope": True}),
                      ("qkv", {"weight_format": "bf16", "rope": True, "heads": [8, 1]})])  # fmt: skip
    assert old.hiddens("norm") == [2048] and old.qk_norms("qkv") == [True]
    assert old.has("norm", residual=True, hidden=2048) and not old.has("norm", residual=True, hidden=1024)
    assert old.has_qkv("bf16", True, (8, 1), "bf16", True) and not old.has_qkv("bf16", True, (8, 1), "bf16",
                                                                               True, 2048, False)  # fmt: skip
    assert not old.names("hidden") and not old.names("qk_norm")
    assert fh.FuzzConfig(old).hidden_others() == () and not fh.FuzzConfig(old).qk_axis()
    on = fh.FuzzConfig(old, other_hidden=(1024,), qk_norm_axis=True)
    assert on.hidden_others() == (1024,) and on.qk_axis()
    assert fh.FuzzConfig(AXES).hidden_others() == fh.OTHER_HIDDEN and fh.FuzzConfig(AXES).qk_axis()


def test_kernels_from_a_bundle_keep_the_manifest_specs():
    k = fh.Kernels.from_bundle(bundle_of(axes_specs()), "sm_90a")
    assert k.hiddens("qkv") == [1024, 1536] and k.qk_norms("qk_norm_rope_cache") == [False, True]
    assert not fh.Kernels.from_bundle(bundle_of(axes_specs()), "sm_100a").entries


# ============================================================================= hand-made examples
def T(shape, dtype, fill, offset=0):
    shape = tuple(shape)
    return dict(shape=shape, stride=fh._contig(shape), offset=offset, dtype=dtype, dev="home", fill=fill)


def example(op="qkv", k=1024, fmt="bf16", kv="bf16", m=3, heads=(8, 1), qk_norm=True, rope=True):
    """A valid example of each op at hidden size k (qk_norm False: both q/k norm weights None)."""
    s = dict(op=op, seed=7, home=0, pdl=True, checked=False, m=m, hidden=k,
             m_limit=fh.m_limit(op, MAX_TOKENS))  # fmt: skip
    if op in ("rms_norm", "fused_add_rms_norm"):
        s["x"] = T((m, k), "bf16", ("randn", 3.0, 0.0))
        if op == "fused_add_rms_norm":
            s["residual"] = T((m, k), "bf16", ("randn", 1.0, 0.0))
        s.update(weight=T((k,), "bf16", ("randn", 0.5, 1.0)), eps=1e-6)
        return s
    nvfp4_scales = dict(weight_scale=dict(view="ok"), global_scale=dict(shape=(1,), dtype="f32", dev="home",
                                                                         offset=0))  # fmt: skip
    scales = nvfp4_scales if fmt == "nvfp4" else dict(weight_scale=None, global_scale=None)
    if op == "gemv":
        s.update(fmt=fmt, x=T((m, k), "bf16", ("randn", 2.0, 0.0)),
                 weight=dict(fmt=fmt, rows=48, view="ok", dev="home"), **scales)  # fmt: skip
        return s
    nq, nkv = s["heads"] = heads
    n = (nq + 2 * nkv) * D
    if op == "qkv":
        s.update(fmt=fmt, x=T((m, k), "bf16", ("randn", 2.0, 0.0)),
                 residual=T((m, k), "bf16", ("randn", 1.0, 0.0)),
                 norm_weight=T((k,), "bf16", ("randn", 0.3, 1.0)), eps=1e-6,
                 weight=dict(fmt=fmt, rows=n, view="ok", dev="home"), **scales)  # fmt: skip
    else:
        s["qkv"] = T((m, n), "bf16", ("randn", 3.0, 0.0))
    cdt = "bf16" if kv == "bf16" else "e4m3"
    norm_w = T((D,), "bf16", ("randn", 0.3, 1.0)) if qk_norm else None
    s.update(
        qk_norm=qk_norm, q_norm_weight=norm_w, k_norm_weight=norm_w and dict(norm_w), qk_eps=1e-6,
        cos_sin_cache=T((4096, D), "f32", ("table", 4096)) if rope else None,
        pos_values=[5, 17, 4000, 9, 1, 2, 3, 4, 5, 6, 70, 8, 900, 10, 11, 12, *range(100, 148)][:m],
        positions=T((m,), "i64", ("ints",)),
        slot_values=[3, 20, 0, 1, 2, *range(4, 20), *range(21, 32), *[-1] * 32][:m],
        slot_mapping=T((m,), "i64", ("ints",)),
        caches=dict(layout="separate", nb=2, bs=16, nkv=nkv, dtype=cdt, vdtype=cdt, koff=0, voff=0,
                    pad=(0, 0), kdev="home", vdev="home"),
    )  # fmt: skip
    sc = dict(shape=(1,), dtype="f32", dev="home", offset=0, value=0.01)
    s["k_scale"], s["v_scale"] = (sc, dict(sc, value=0.02)) if kv != "bf16" else (None, None)
    return s


def with_(s, **kw):
    out = dict(s)
    for key, v in kw.items():
        out[key] = {**out[key], **v} if isinstance(v, dict) and isinstance(out.get(key), dict) else v
    return out


def judged(s, kernels):
    """The model's verdict: "valid", "either", or (must reject) the set of exception types it allows."""
    e = fh.expect(s, kernels)
    if e.must_reject:
        return set(e.allowed())
    return "either" if e.may_reject else "valid"


OPS_WITH_K = [("rms_norm", "bf16"), ("fused_add_rms_norm", "bf16"), ("gemv", "bf16"), ("gemv", "nvfp4"),
              ("qkv", "bf16"), ("qkv", "nvfp4")]  # fmt: skip


@pytest.mark.parametrize("op,fmt", OPS_WITH_K)
def test_a_hidden_size_the_bundle_lacks_is_a_lookup_error(op, fmt):
    assert judged(example(op, 1024, fmt), ONE_K) == "valid"
    assert judged(example(op, 2048, fmt), ONE_K) == LOOKUP
    assert judged(example(op, 1536, fmt), ONE_K) == LOOKUP
    assert judged(example(op, 2048, fmt), fh.Kernels(one_k_specs(2048))) == "valid"


@pytest.mark.parametrize("op", ["qkv", "qk_norm_rope_cache"])
def test_q_k_norm_settings(op):
    # both None: no q/k norm, served by qk_norm false kernels, a LookupError without them
    assert judged(example(op, qk_norm=False), ONE_K_BOTH) == "valid"
    assert judged(example(op, qk_norm=False), ONE_K) == LOOKUP
    assert judged(example(op, qk_norm=True), ONE_K_BOTH) == "valid"
    # exactly one None: a ValueError, whatever the bundle has
    for kernels in (ONE_K, ONE_K_BOTH):
        on = example(op)
        assert judged(with_(on, q_norm_weight=None), kernels) == {ValueError}
        assert judged(with_(on, k_norm_weight=None), kernels) == {ValueError}
    # a norm weight of the wrong dtype: the argument checks refuse it
    bad = with_(example(op), q_norm_weight=dict(dtype="f32"))
    assert judged(bad, ONE_K_BOTH) == TV


def test_shapes_follow_x_s_columns():
    s = example("qkv", 1024)
    assert judged(with_(s, norm_weight=T((2048,), "bf16", ("randn", 0.3, 1.0))), ONE_K) <= TV
    assert judged(with_(s, residual=T((3, 2048), "bf16", ("randn", 1.0, 0.0))), ONE_K) <= TV
    assert judged(with_(example("fused_add_rms_norm", 1024), weight=T((1536,), "bf16", ("randn", 0.5, 1.0))),
                  ONE_K) <= TV  # fmt: skip
    # a weight drawn at another K than x's: its columns (BF16 K, NVFP4 K / 2) or its scales' (K / 16)
    for fmt in ("bf16", "nvfp4"):
        assert judged(with_(example("gemv", 1024, fmt), hidden=1536), ONE_K) <= TV
        assert judged(with_(example("qkv", 1024, fmt), hidden=2048), ONE_K) <= TV | LOOKUP
    # x and every tensor of a K the bundle lacks agree: the checks pass, the lookup refuses it
    k = 1024 + 64
    norm = with_(example("rms_norm", 1024), x=T((3, k), "bf16", ("randn", 3.0, 0.0)),
                 weight=T((k,), "bf16", ("randn", 0.5, 1.0)))  # fmt: skip
    assert judged(norm, ONE_K) == LOOKUP
    # an odd K: NVFP4 takes K // 2 bytes and K // 16 scales a row, those of K - 1: a LookupError
    assert judged(with_(example("gemv", 1024, "nvfp4"), x=T((3, 1025), "bf16", ("randn", 2.0, 0.0))),
                  ONE_K) == LOOKUP  # fmt: skip
    # (a BF16 weight of 1024 columns: a ValueError, and the lacking K may be reported first)
    assert judged(with_(example("gemv", 1024, "bf16"), x=T((3, 1025), "bf16", ("randn", 2.0, 0.0))),
                  ONE_K) == {ValueError, LookupError}  # fmt: skip
    assert judged(with_(example("gemv", 1024), x=T((3, 0), "bf16", ("randn", 2.0, 0.0))), ONE_K) == TV


def test_gemv_rows_limit_follows_k():
    k = 4096
    rows = abi.max_gemv_rows(k) + 16
    assert rows < abi.max_gemv_rows(1024)
    s = with_(example("gemv", k), weight=dict(rows=rows))
    assert judged(s, fh.Kernels(one_k_specs(k))) == {ValueError}
    assert judged(with_(example("gemv", 1024), weight=dict(rows=rows)), ONE_K) == "valid"


# ============================================================================= the strategies
def draws(op, cfg, n=300):
    """n drawn examples of op (derandomized)."""
    out = []

    @settings(max_examples=n, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.data())
    def draw(data):
        out.append(data.draw(fh.SPECS[op](cfg)))

    draw()
    return out


def _qk_setting(s):
    q, k = s["q_norm_weight"], s["k_norm_weight"]
    return "one None" if (q is None) != (k is None) else q is not None


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "gemv", "qkv"])
def test_drawn_hidden_sizes_are_mostly_the_bundle_s(op):
    cfg = cfg_for(AXES)
    got = Counter(s["hidden"] for s in draws(op, cfg))
    assert got[1024] >= 30 and got[1536] >= 30, got  # both of the bundle's
    lacking = sum(v for k, v in got.items() if k not in (1024, 1536))
    assert 3 <= lacking <= 0.25 * sum(got.values()), got  # some it lacks, not many
    assert set(got) <= {1024, 1536, *fh.OTHER_HIDDEN}, got


def test_qkv_draws_the_hidden_size_of_its_heads_and_both_qk_norm_settings():
    cfg = cfg_for(AXES)
    ex = draws("qkv", cfg, 400)
    by_heads = defaultdict(Counter)
    for s in ex:
        by_heads[tuple(s["heads"])][s["hidden"]] += 1
    for heads, k in (((8, 1), 1024), ((16, 2), 1536)):
        c = by_heads[heads]
        assert c[k] >= 0.75 * sum(c.values()), (heads, c)
    qk = Counter(_qk_setting(s) for s in ex)
    assert qk[True] >= 100 and qk[False] >= 20 and qk["one None"] >= 1, qk
    # q/k norm off mostly where the bundle has it (heads 8x1 at 1024)
    off = Counter((tuple(s["heads"]), s["hidden"]) for s in ex if _qk_setting(s) is False)
    assert off[(8, 1), 1024] >= 0.5 * sum(off.values()), off
    judged_ = Counter("lookup" if fh.expect(s, AXES).allowed() == LOOKUP else "other" for s in ex)
    assert judged_["lookup"] >= 10, judged_


def test_qk_norm_rope_cache_draws_both_qk_norm_settings():
    ex = draws("qk_norm_rope_cache", cfg_for(AXES))
    qk = Counter(_qk_setting(s) for s in ex)
    assert qk[True] >= 60 and qk[False] >= 60 and qk["one None"] >= 1, qk
    ones = [s for s in ex if _qk_setting(s) == "one None"]
    assert all(ValueError in fh.expect(s, AXES).allowed() for s in ones)


def test_a_bundle_without_the_axes_draws_flint_s_only():
    old = fh.Kernels([(k, {a: v for a, v in s.items() if a not in ("hidden", "qk_norm")})
                      for k, s in one_k_specs(2048)])  # fmt: skip
    for op in ("qkv", "qk_norm_rope_cache", "gemv", "rms_norm"):
        for s in draws(op, cfg_for(old), 60):
            assert fh.hidden_of(s) == 2048 and ("q_norm_weight" not in s or _qk_setting(s) is True)


# ============================================================================= the real loader, run dry
class RefLoader:
    """loader.ops's five ops on CPU tensors: every argument check, the plan, the kernel lookup in `bundle`;
    nothing launched (a stub launcher records which manifest entries each call would launch); the results
    (outputs, cache writes) are the float64 reference's, as a correct kernel's. bug: one planted defect."""

    # what the kernels assume of each pointer (the manifest's parameter alignments), as fuzz_harness models it
    ALIGN = {"weight_scale": 4, "global_scale": 4, "positions": 8, "slot_mapping": 8, "k_scale": 4,
             "v_scale": 4, "k_cache": 2, "v_cache": 2}  # fmt: skip

    def __init__(self, bundle, bug=None):
        self.bundle, self.bug, self.launched = bundle, bug, []
        self.launch_options = runtime.launch_options

    @contextlib.contextmanager
    def active(self):
        """The process patched for the dry run (as tests/test_loader_cpu.py's _DryRun)."""
        loader = self

        class Stub:
            def __init__(self, entry):
                self.entry = entry

            def bind(self, values, symbols, consts, renames):
                masks = tuple(loader.ALIGN.get(n, 16) - 1 for n in values)
                return (lambda vals, stream, pdl: loader.launched.append(self.entry.spec)), masks

        def lookup(dev, kind, key, spec_of):
            return runtime.first_entry(self.bundle, (9, 0), kind, spec_of())

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(runtime, "_tls", threading.local())  # this run's launchers and plans only
            mp.setattr(runtime, "current_bundle", lambda: self.bundle)
            mp.setattr(torch.Tensor, "get_device", lambda t: 0)
            mp.setattr(ops, "_raw_stream", lambda dev: 0)
            mp.setattr(ops, "_OUT", {})
            mp.setitem(checks.NO_ROPE, 0, torch.zeros(1, D))
            mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
            mp.setattr(ops, "_launcher", lambda *a: Stub(lookup(*a)))
            mp.setattr(runtime, "entry", lookup)
            yield self

    def no_rope_table(self, device):
        return checks.NO_ROPE[0]

    def _call(self, name, args):
        """The real op (its results ignored: nothing ran); then every kernel it would launch must be of the
        call's hidden size (x's columns) and q/k norm setting (norm weights given or None)."""
        self.launched.clear()
        try:
            getattr(ops, name)(**args)
        except LookupError:
            if self.bug != "accept_lacking":
                raise
            return
        assert self.launched, f"{name}: an accepted call launches nothing"
        k = args["x"].shape[1] if "x" in args else None
        qk_norm = args["q_norm_weight"] is not None if "q_norm_weight" in args else None
        for spec in self.launched:
            assert k is None or spec.get("hidden", k) == k, f"{name} at hidden size {k} launches {spec}"
            assert qk_norm is None or spec.get("qk_norm", qk_norm) == qk_norm, f"{name} launches {spec}"

    # ------------------------------------------------------------------ the ops
    def rms_norm(self, x, weight, eps):
        self._call("rms_norm", dict(x=x, weight=weight, eps=eps))
        return rms_norm_ref(x, None, weight, float(eps))[0].clone()

    def fused_add_rms_norm(self, x, residual, weight, eps):
        self._call("fused_add_rms_norm", dict(x=x, residual=residual, weight=weight, eps=eps))
        xn, r = rms_norm_ref(x, residual, weight, float(eps))
        return xn, r.clone()

    @staticmethod
    def _dense(weight, weight_scale, global_scale):
        if weight.dtype == torch.bfloat16:
            return weight.double()
        return nvfp4.dequantize(weight, weight_scale, global_scale)

    def gemv(self, x, weight, weight_scale=None, global_scale=None):
        args = dict(x=x, weight=weight, weight_scale=weight_scale, global_scale=global_scale)
        self._call("gemv", args)
        return (x.double() @ self._dense(weight, weight_scale, global_scale).T).bfloat16()

    def flint_qkv_fused(self, x, residual, norm_weight, eps, weight, weight_scale, global_scale, **head):
        args = dict(x=x, residual=residual, norm_weight=norm_weight, eps=eps, weight=weight,
                    weight_scale=weight_scale, global_scale=global_scale, **head)  # fmt: skip
        self._call("flint_qkv_fused", args)
        xn, r = rms_norm_ref(x, residual, norm_weight, float(eps))
        qkv = (xn.double() @ self._dense(weight, weight_scale, global_scale).T).bfloat16()
        return self._head_stage(qkv, **head), (x if residual is None else r.clone())

    def qk_norm_rope_cache(self, qkv, **head):
        self._call("qk_norm_rope_cache", dict(qkv=qkv, **head))
        return self._head_stage(qkv, **head)

    def _head_stage(self, qkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache,
                    v_cache, slot_mapping, num_q_heads, num_kv_heads, k_scale=None,
                    v_scale=None):  # fmt: skip
        m, nq, nkv = qkv.shape[0], num_q_heads, num_kv_heads
        bad, pos = set(), positions
        if cos_sin_cache is not None:
            bad = {t for t, p in enumerate(positions.tolist()) if not 0 <= p < cos_sin_cache.shape[0]}
            pos = positions.clamp(0, cos_sin_cache.shape[0] - 1)
        if self.bug == "qk_norm_anyway" and q_norm_weight is None:  # unit weights: still normalizes
            q_norm_weight = k_norm_weight = torch.ones(D, dtype=torch.bfloat16)
        qn, kn = q_norm_weight, k_norm_weight
        q, k, v = qk_norm_rope_ref(qkv, qn, kn, float(qk_eps), cos_sin_cache, pos, nq, nkv)
        for t in bad:
            q[t] = k[t] = float("nan")
        nb, bs = k_cache.shape[0], k_cache.shape[1]
        for t, sl in enumerate(slot_mapping.tolist()[:m]):
            if not 0 <= sl < nb * bs:
                continue
            for cache, val, scale in ((k_cache, k[t], k_scale), (v_cache, v[t], v_scale)):
                dst = cache[sl // bs, sl % bs]
                if cache.dtype == torch.bfloat16:
                    dst.copy_(val.to(torch.bfloat16))
                else:
                    dst.view(torch.uint8).copy_(fp8_cache_value(val, scale.reshape(-1)[0]).view(torch.uint8))
        return q.reshape(m, nq * D).to(torch.bfloat16)


_WEIGHTS: dict = {}  # random weights (and their NVFP4 quantization), shared by every environment


def env_for(loader, kernels) -> fh.Env:
    env = fh.Env(loader, kernels, "cpu", sync=False, counts=defaultdict(Counter))
    env.weights = _WEIGHTS
    return env


HAND_MADE = [(op, fmt, True) for op, fmt in OPS_WITH_K] + [
    ("qkv", "bf16", False), ("qkv", "nvfp4", False), ("qk_norm_rope_cache", "bf16", True),
    ("qk_norm_rope_cache", "bf16", False)]  # fmt: skip


@pytest.mark.parametrize("op,fmt,qk_norm", HAND_MADE, ids=[f"{o}-{f}-qk{int(q)}" for o, f, q in HAND_MADE])
def test_hand_made_examples_against_the_real_loader(op, fmt, qk_norm):
    """Valid examples at hidden 1024 (q/k norm on and off) pass with their values checked; at hidden sizes
    the bundle lacks they are LookupErrors, with exactly one None q/k norm weight ValueErrors."""
    loader = RefLoader(bundle_of(one_k_specs(qk_norms=(True, False))))
    kernels = fh.Kernels.from_bundle(loader.bundle, "sm_90a")
    with loader.active():
        env = env_for(loader, kernels)
        for kv in ("bf16", "fp8_e4m3") if op in ("qkv", "qk_norm_rope_cache") else ("bf16",):
            s = example(op, 1024, fmt, kv, qk_norm=qk_norm)
            fh.run_example(env, s)
            assert env.counts[op]["result checked"] >= 1
        for k in (2048, 1536) if op != "qk_norm_rope_cache" else ():
            before = env.counts[op]["LookupError"]
            fh.run_example(env, example(op, k, fmt, qk_norm=qk_norm))  # the model says LookupError
            assert env.counts[op]["LookupError"] == before + 1
        if op in ("qkv", "qk_norm_rope_cache"):
            before = env.counts[op]["ValueError"]
            fh.run_example(env, with_(example(op, 1024, fmt), k_norm_weight=None))
            assert env.counts[op]["ValueError"] == before + 1


@pytest.mark.parametrize("served", ["same", "smaller"])
@pytest.mark.parametrize("op", fh.OPS)
def test_random_examples_against_the_real_loader(op, served):
    """Examples drawn for the two-hidden bundle (both hidden sizes, both q/k norm settings, and now and then
    what it lacks) through run_example with the real loader's checks and lookup: the outcome is what the
    model predicts, the results (the reference's) pass the harness's checks, and an accepted call launches
    kernels of its hidden size and q/k norm setting. "smaller": run against a bundle of hidden 1024 and q/k
    norm on only, which lacks much of what was drawn (many LookupErrors, beside every other refusal)."""
    drawn_for = bundle_of(axes_specs())
    loader = RefLoader(drawn_for if served == "same" else bundle_of(one_k_specs()))
    kernels = fh.Kernels.from_bundle(loader.bundle, "sm_90a")
    cfg = cfg_for(fh.Kernels.from_bundle(drawn_for, "sm_90a"))
    with loader.active():
        env = env_for(loader, kernels)

        @settings(max_examples=150, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(st.data())
        def run(data):
            fh.run_example(env, data.draw(fh.SPECS[op](cfg), label="example"))

        run()
    c = env.counts[op]
    assert c["TypeError"] + c["ValueError"] >= 10, c
    if served == "smaller":  # (hidden 1536 and q/k norm off are lacking: a third of the draws or more)
        assert c["LookupError"] >= 20 and c["result checked"] >= 5, c
    else:
        assert c["result checked"] >= 20, c


BUGS = [
    ("qk_norm_anyway", example("qkv", qk_norm=False), "relative error|elements off"),
    ("qk_norm_anyway", example("qk_norm_rope_cache", qk_norm=False), "relative error|elements off"),
    ("accept_lacking", example("qkv", 2048), "accepted an invalid example"),
    ("accept_lacking", example("gemv", 1536, "bf16"), "accepted an invalid example"),
    ("accept_lacking", example("rms_norm", 2048), "accepted an invalid example"),
    ("accept_lacking", example("qk_norm_rope_cache", qk_norm=False), "accepted an invalid example"),
]


@pytest.mark.parametrize("bug,s,msg", BUGS, ids=[f"{b}-{s['op']}" for b, s, _ in BUGS])
def test_a_planted_bug_is_caught(bug, s, msg):
    kernels_specs = one_k_specs()  # hidden 1024, q/k norm on only
    if bug == "qk_norm_anyway":
        kernels_specs = one_k_specs(qk_norms=(True, False))
    good, buggy = RefLoader(bundle_of(kernels_specs)), RefLoader(bundle_of(kernels_specs), bug)
    kernels = fh.Kernels.from_bundle(good.bundle, "sm_90a")
    with good.active():
        fh.run_example(env_for(good, kernels), s)  # the correct loader passes this very example
    with buggy.active(), pytest.raises(AssertionError, match=msg):
        fh.run_example(env_for(buggy, kernels), s)

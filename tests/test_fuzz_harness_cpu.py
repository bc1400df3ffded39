"""The fuzz harness (tests/fuzz_harness.py) and the shared helpers (tests/helpers.py) on the CPU.

The harness runs end to end against FakeLoader: the loader's validation rules written a second time, in the
loader's own style (inspecting the tensors it is given, not the example's description), with the float64
reference as its kernels. Random examples must all pass against it, in a strict and a lenient variant (the
two ways a loader may decide what the rules leave open); every check of the harness must catch the fake
with one bug planted (a guard byte written, a negative slot written, a NaN eps accepted, ...).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from collections import Counter, defaultdict

import pytest
import torch

from tests.conftest import HAS_GPU

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from loader import nvfp4  # noqa: E402
from loader.abi import F32_MAX, M_TILES, MAX_GEMV_ROWS, MAX_M, MAX_TOKENS  # noqa: E402
from loader.reference import fp8_cache_value, make_cos_sin_cache, qk_norm_rope_ref, rms_norm_ref  # noqa: E402
from tests import fuzz_harness as fh  # noqa: E402
from tests import helpers as h  # noqa: E402

# A minute of CPU work that says nothing about the GPU: not repeated on a GPU machine's (budgeted) test runs.
pytestmark = pytest.mark.skipif(
    HAS_GPU and not os.environ.get("FLINT_FUZZ_SELFTEST"),
    reason="CPU self-test of tests/fuzz_harness.py, for the CPU machine (FLINT_FUZZ_SELFTEST=1 runs it here)",
)

K, D = h.K, h.D
CPU = torch.device("cpu")


# ============================================================================= a loader on the CPU
class FakeLoader:
    """flint_qkv_fused, qk_norm_rope_cache, gemv, rms_norm, fused_add_rms_norm, launch_options and
    no_rope_table of the serve-time API, for CPU tensors ("the op's device" is the CPU here). strict: reject
    what the rules leave open (positions, slots, scales not 16-byte aligned; k and v blocks interleaved; an
    eps above the fp32 maximum that rounds to it; head counts outside the fused variants for the unfused
    op). bug: one planted defect (see the mutation tests)."""

    def __init__(self, kernels: fh.Kernels, strict=True, bug=None):
        self.kernels, self.strict, self.bug = kernels, strict, bug
        self._opts = contextvars.ContextVar("opts", default=(("pdl", True), ("bounds_check", False)))
        self._placeholder = torch.zeros(1, D, dtype=torch.float32)

    @contextlib.contextmanager
    def launch_options(self, *, pdl=None, bounds_check=None):
        new = dict(self._opts.get())
        new = dict(new)
        if pdl is not None:
            new["pdl"] = bool(pdl)
        if bounds_check is not None:
            new["bounds_check"] = bool(bounds_check)
        tok = self._opts.set(tuple(new.items()))
        try:
            yield
        finally:
            self._opts.reset(tok)

    def no_rope_table(self, device):
        return self._placeholder

    # ------------------------------------------------------------------ checks
    def _t(self, name, t, dtypes, shape=None, align=16):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name} has dtype {t.dtype}")
        if t.device != CPU:
            raise ValueError(f"{name} is on {t.device}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {list(t.shape)}, expected {list(shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous")
        if align and t.data_ptr() % align:
            raise ValueError(f"{name} is not {align}-byte aligned")
        return t

    def _loose(self):
        return 16 if self.strict else None

    def _eps(self, name, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name} must be a Python float")
        if self.bug == "accept_nan_eps" and v != v:
            return float(v)
        try:
            f = float(v)
        except OverflowError:
            raise ValueError(f"{name} is too large") from None
        big = f > F32_MAX if self.strict else not math.isfinite(float(torch.tensor(f, dtype=torch.float32)))
        if not math.isfinite(f) or f < 0 or big:
            raise ValueError(f"{name} must be finite, >= 0 and at most the fp32 maximum, got {v}")
        return f

    def _heads(self, nq, nkv):
        for name, v in (("num_q_heads", nq), ("num_kv_heads", nkv)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int")
            if v < 1:
                raise ValueError(f"{name} must be >= 1")
        if nq % nkv:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads")
        return nq, nkv

    def _x(self, name, x, limit=MAX_M):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor")
        if x.dim() != 2 or x.shape[1] != K:
            raise ValueError(f"{name} must have shape [M, {K}]")
        if not 1 <= x.shape[0] <= limit:
            raise ValueError(f"{name} has M = {x.shape[0]}; 1 <= M <= {limit}")
        return self._t(name, x, (torch.bfloat16,))

    def _weight(self, w, ws, gs, rows):
        if not isinstance(w, torch.Tensor):
            raise TypeError("weight must be a tensor")
        if w.dtype not in (torch.bfloat16, torch.uint8):
            raise TypeError(f"weight has dtype {w.dtype}")
        fmt = "bf16" if w.dtype == torch.bfloat16 else "nvfp4"
        cols = K if fmt == "bf16" else K // 2
        if w.dim() != 2 or w.shape[1] != cols:
            raise ValueError("weight has the wrong shape")
        n = w.shape[0]
        if rows is None and (n < 16 or n % 16 or n > MAX_GEMV_ROWS):
            raise ValueError(f"gemv weight rows must be a multiple of 16 in [16, {MAX_GEMV_ROWS}]")
        self._t("weight", w, (w.dtype,), (rows if rows is not None else n, cols))
        if fmt == "bf16":
            if ws is not None or gs is not None:
                raise ValueError("a BF16 weight takes no scales")
            return fmt, w.double()
        if ws is None or gs is None:
            raise ValueError("an NVFP4 weight needs weight_scale and global_scale")
        self._t("weight_scale", ws, (torch.float8_e4m3fn, torch.uint8), (-(-n // 128) * 128, K // 16), 4)
        if not isinstance(gs, torch.Tensor):
            raise TypeError("global_scale must be a tensor")
        if gs.dtype != torch.float32:
            raise TypeError("global_scale must be fp32")
        if gs.numel() != 1:
            raise ValueError("global_scale must hold one element")
        self._t("global_scale", gs, (torch.float32,), None, self._loose())
        return fmt, nvfp4.dequantize(w, ws, gs)

    def _caches(self, k, v, nkv):
        for name, c in (("k_cache", k), ("v_cache", v)):
            if not isinstance(c, torch.Tensor):
                raise TypeError(f"{name} must be a tensor")
            if c.dtype not in (torch.bfloat16, torch.float8_e4m3fn, torch.uint8):
                raise TypeError(f"{name} has dtype {c.dtype}")
            if c.device != CPU:
                raise ValueError(f"{name} is on {c.device}")
            if c.dim() != 4 or c.shape[2] != nkv or c.shape[3] != D or c.shape[0] < 1 or c.shape[1] < 1:
                raise ValueError(f"{name} has shape {list(c.shape)}")
            if c.stride(3) != 1:
                raise ValueError(f"{name} last stride must be 1")
            if any(st == 0 and sz > 1 for sz, st in zip(c.shape, c.stride(), strict=True)):
                raise ValueError(f"{name} has a zero stride")
            if not h.non_overlapping(c.shape, c.stride()):
                raise ValueError(f"{name} overlaps itself")
            strides = [st for st, sz in zip(c.stride()[:3], c.shape[:3], strict=True) if sz > 1]
            if self.strict and (c.data_ptr() % 16 or any(st * c.element_size() % 16 for st in strides)):
                raise ValueError(f"{name} is not 16-byte aligned")
        if k.dtype != v.dtype or k.shape != v.shape or k.stride() != v.stride():
            raise ValueError("k_cache and v_cache must have the same dtype, shape and strides")
        if k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr():
            if self.bug == "reject_shared":
                raise ValueError("k and v share a buffer")
            es = k.element_size()
            inner = h.extent(k.shape[1:], k.stride()[1:]) * es
            kr = [(k.data_ptr() + b * k.stride(0) * es, k.data_ptr() + b * k.stride(0) * es + inner)
                  for b in range(k.shape[0])]  # fmt: skip
            vr = [(v.data_ptr() + b * v.stride(0) * es, v.data_ptr() + b * v.stride(0) * es + inner)
                  for b in range(v.shape[0])]  # fmt: skip
            if any(a0 < b1 and b0 < a1 for a0, a1 in kr for b0, b1 in vr):
                if self.strict:
                    raise ValueError("k_cache and v_cache overlap")
                base = min(k.data_ptr(), v.data_ptr())
                kel = {(k.data_ptr() - base) // es + sum(i * s for i, s in zip(ix, k.stride(), strict=True))
                       for ix in _indices(k.shape)}  # fmt: skip
                vel = {(v.data_ptr() - base) // es + sum(i * s for i, s in zip(ix, v.stride(), strict=True))
                       for ix in _indices(v.shape)}  # fmt: skip
                if kel & vel:
                    raise ValueError("k_cache and v_cache overlap")
        return "bf16" if k.dtype == torch.bfloat16 else "fp8_e4m3"

    def _scales(self, kv, ks, vs):
        if kv == "bf16":
            if ks is not None or vs is not None:
                raise ValueError("k_scale / v_scale are for an FP8 cache only")
            return None, None
        out = []
        for name, s in (("k_scale", ks), ("v_scale", vs)):
            if s is None:
                raise ValueError(f"an FP8 cache needs {name}")
            if not isinstance(s, torch.Tensor):
                raise TypeError(f"{name} must be a tensor")
            if s.dtype != torch.float32:
                raise TypeError(f"{name} must be fp32")
            if s.numel() != 1:
                raise ValueError(f"{name} must hold one element")
            self._t(name, s, (torch.float32,), None, self._loose())
            val = s.reshape(-1)[0].item()
            if not (math.isfinite(val) and val > 0):
                raise ValueError(f"{name} must be finite and > 0")
            out.append(val)
        return out

    def _qk(
        self, m, nq, nkv, qn, kn, qk_eps, cs, positions, k_cache, v_cache, slot_mapping, k_scale, v_scale
    ):
        self._t("q_norm_weight", qn, (torch.bfloat16,), (D,))
        self._t("k_norm_weight", kn, (torch.bfloat16,), (D,))
        eps = self._eps("qk_eps", qk_eps)
        if cs is self._placeholder:
            raise ValueError("cos_sin_cache: pass None for no RoPE, not the placeholder table")
        if cs is not None:
            if not isinstance(cs, torch.Tensor) or cs.dim() != 2:
                raise ValueError("cos_sin_cache must be fp32 [max_pos, 128] or None")
            self._t("cos_sin_cache", cs, (torch.float32,), (cs.shape[0], D))
            if cs.shape[0] < 1:
                raise ValueError("cos_sin_cache has no rows")
        self._t("positions", positions, (torch.int64,), (m,), self._loose())
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
            raise ValueError("slot_mapping must be a 1-D int64 tensor")
        self._t("slot_mapping", slot_mapping, (torch.int64,), None, self._loose())
        if slot_mapping.shape[0] > m:
            raise ValueError("slot_mapping has more entries than tokens")
        kv = self._caches(k_cache, v_cache, nkv)
        scales = self._scales(kv, k_scale, v_scale)
        return eps, kv, scales

    def _bounds(self, cs, positions, k_cache, slot_mapping):
        if not dict(self._opts.get())["bounds_check"] or self.bug == "ignore_checked":
            return
        if cs is not None and any(not 0 <= p < cs.shape[0] for p in positions.tolist()):
            raise ValueError("positions outside the cos/sin table")
        ns = k_cache.shape[0] * k_cache.shape[1]
        used = slot_mapping.tolist()
        if any(s >= ns for s in used):
            raise ValueError("slots outside the cache")
        nonneg = [s for s in used if s >= 0]
        if len(nonneg) != len(set(nonneg)):
            raise ValueError("duplicate slots")

    def _lookup(self, ok, what):
        if not ok:
            if self.bug == "lookup_keyerror":
                raise KeyError(what)
            raise LookupError(f"the bundle has no {what}; add it to the config and rebuild")

    # ------------------------------------------------------------------ "kernels"
    def _head_stage(self, qkv, nq, nkv, qn, kn, eps, cs, positions, k_cache, v_cache, slot_mapping, scales):
        m = qkv.shape[0]
        bad = set()
        pos = positions
        if cs is not None:
            bad = {t for t, p in enumerate(positions.tolist()) if not 0 <= p < cs.shape[0]}
            pos = positions.clamp(0, cs.shape[0] - 1)
            if self.bug == "no_nan_for_bad_position":
                bad = set()
        q, k, v = qk_norm_rope_ref(qkv, qn, kn, eps, cs, pos, nq, nkv)
        for t in bad:
            q[t] = float("nan")
            k[t] = float("nan")
        if self.bug == "wrong_q":
            q = q * 1.05
        if self.bug == "one_q_element":  # half its head's RMS off: a norm-wise check over M = 16 misses it
            _one_element_off(q.view(m, nq, D), 0.5)
        if self.bug == "one_v_element":  # (a BF16 cache)
            _one_element_off(v.view(m, nkv, D), 0.25)
        ns = k_cache.shape[0] * k_cache.shape[1]
        bs = k_cache.shape[1]
        for t, s in enumerate(slot_mapping.tolist()[:m]):
            if self.bug == "write_negative_slot" and s < 0:
                s = s % ns
            if not 0 <= s < ns:
                continue
            for cache, val, scale in ((k_cache, k[t], scales[0]), (v_cache, v[t], scales[1])):
                dst = cache[s // bs, s % bs]
                if cache.dtype == torch.bfloat16:
                    dst.copy_(val.to(torch.bfloat16))
                else:
                    sc = scale * (2 if self.bug == "fp8_scale" else 1)
                    dst.view(torch.uint8).copy_(fp8_cache_value(val, sc).view(torch.uint8))
        return q.reshape(m, nq * D).to(torch.bfloat16)

    def _after(self, x):
        if self.bug == "write_guard":  # one element just before x's data: the guard band
            torch.as_strided(x, (1,), (1,), x.storage_offset() - 1).fill_(0)

    # ------------------------------------------------------------------ the API
    def flint_qkv_fused(self, x, residual, norm_weight, eps, weight, weight_scale, global_scale,
                        q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache,
                        slot_mapping, num_q_heads, num_kv_heads, *, k_scale=None, v_scale=None):  # fmt: skip
        x = self._x("x", x)
        m = x.shape[0]
        nq, nkv = self._heads(num_q_heads, num_kv_heads)
        if residual is not None:
            self._t("residual", residual, (torch.bfloat16,), (m, K))
        self._t("norm_weight", norm_weight, (torch.bfloat16,), (K,))
        if self.bug == "write_on_reject":
            poison = isinstance(eps, float) and eps != eps
            if poison and isinstance(k_cache, torch.Tensor) and k_cache.is_contiguous():
                k_cache.view(torch.uint8).view(-1)[:1].fill_(0)
        e = self._eps("eps", eps)
        fmt, dense = self._weight(weight, weight_scale, global_scale, (nq + 2 * nkv) * D)
        qe, kv, scales = self._qk(m, nq, nkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache,
                                  positions, k_cache, v_cache, slot_mapping, k_scale, v_scale)  # fmt: skip
        have = self.kernels.has_qkv(fmt, cos_sin_cache is not None, (nq, nkv), kv, residual is not None)
        self._lookup(have, f"qkv kernel {fmt} {nq}x{nkv}")
        self._bounds(cos_sin_cache, positions, k_cache, slot_mapping)
        xn, r = rms_norm_ref(x, residual, norm_weight, e)
        qkv = (xn.double() @ dense.T).bfloat16()
        q = self._head_stage(qkv, nq, nkv, q_norm_weight, k_norm_weight, qe, cos_sin_cache, positions,
                             k_cache, v_cache, slot_mapping, scales)  # fmt: skip
        self._after(x)
        return q, (x if residual is None else r.clone())

    def qk_norm_rope_cache(self, qkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions,
                           k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads, *, k_scale=None,
                           v_scale=None):  # fmt: skip
        nq, nkv = self._heads(num_q_heads, num_kv_heads)
        if not isinstance(qkv, torch.Tensor):
            raise TypeError("qkv must be a tensor")
        n = (nq + 2 * nkv) * D
        if qkv.dim() != 2 or qkv.shape[1] != n or not 1 <= qkv.shape[0] <= MAX_TOKENS:
            raise ValueError(f"qkv must have shape [M, {n}], 1 <= M <= {MAX_TOKENS}")
        self._t("qkv", qkv, (torch.bfloat16,))
        m = qkv.shape[0]
        qe, kv, scales = self._qk(m, nq, nkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache,
                                  positions, k_cache, v_cache, slot_mapping, k_scale, v_scale)  # fmt: skip
        have = self.kernels.has("qk_norm_rope_cache", rope=cos_sin_cache is not None, kv_cache_dtype=kv)
        self._lookup(have, "qk_norm_rope_cache kernel")
        if self.strict:
            self._lookup((nq, nkv) in self.kernels.qkv_heads(), f"heads {nq}x{nkv}")
        self._bounds(cos_sin_cache, positions, k_cache, slot_mapping)
        return self._head_stage(qkv, nq, nkv, q_norm_weight, k_norm_weight, qe, cos_sin_cache, positions,
                                k_cache, v_cache, slot_mapping, scales)  # fmt: skip

    def gemv(self, x, weight, weight_scale=None, global_scale=None):
        x = self._x("x", x)
        fmt, dense = self._weight(weight, weight_scale, global_scale, None)
        self._lookup(self.kernels.has("gemv", weight_format=fmt), f"gemv {fmt}")
        y = (x.double() @ dense.T).bfloat16()
        if self.bug == "wrong_q":
            y = y * 1.05
        if self.bug == "one_y_element":
            _one_element_off(y, 0.25)
        self._after(x)
        return y

    def rms_norm(self, x, weight, eps):
        x = self._x("x", x, MAX_TOKENS)
        self._t("weight", weight, (torch.bfloat16,), (K,))
        e = self._eps("eps", eps)
        self._lookup(self.kernels.has("norm", residual=False), "norm")
        xn = rms_norm_ref(x, None, weight, e)[0].clone()
        if self.bug == "one_xn_element":  # 8 ulps off: more than a 1-ulp shift before the weight explains
            xn.view(torch.int16)[x.shape[0] // 2, 5] += 8
        return xn

    def fused_add_rms_norm(self, x, residual, weight, eps):
        x = self._x("x", x, MAX_TOKENS)
        self._t("residual", residual, (torch.bfloat16,), (x.shape[0], K))
        self._t("weight", weight, (torch.bfloat16,), (K,))
        e = self._eps("eps", eps)
        self._lookup(self.kernels.has("norm", residual=True), "norm")
        xn, r = rms_norm_ref(x, residual, weight, e)
        return xn, r.clone()


def _one_element_off(t, by):
    """Move one element of token M // 2 (its last dimension's element 5, of its second row if it has rows)
    by `by` times the RMS of its row, in place."""
    row = t[t.shape[0] // 2]
    if row.dim() > 1:
        row = row[min(1, row.shape[0] - 1)]
    row[5] += by * row.double().pow(2).mean().sqrt().item()


def _indices(shape):
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (i, *rest)


def fake_kernels(heads=((8, 1), (16, 2))):
    """A bundle of the fixed-K era (no hidden or q/k norm keys: FakeLoader knows one K) with every token tile
    of the qkv and gemv kernels, as configs/flint.yaml builds (the harness asks for a tile that holds M;
    FakeLoader serves any M up to 64)."""
    e = [("norm", {"residual": r}) for r in (True, False)]
    e += [("gemv", {"weight_format": f, "max_m": t}) for f in ("bf16", "nvfp4") for t in M_TILES]
    for rope in (True, False):
        for kv in ("bf16", "fp8_e4m3"):
            e.append(("qk_norm_rope_cache", {"rope": rope, "kv_cache_dtype": kv}))
            for f in ("bf16", "nvfp4"):
                for nq, nkv in heads:
                    spec = {"weight_format": f, "rope": rope, "heads": [nq, nkv], "kv_cache_dtype": kv}
                    e += [("qkv", {**spec, "norm": "separate", "max_m": t}) for t in M_TILES]
    return fh.Kernels(e)


KERNELS = fake_kernels()
CFG = fh.FuzzConfig(KERNELS, foreign=(), homes=(0,), extra_heads=((4, 4), (8, 2)), gemv_rows=(16, 48, 144))
_ENVS: dict = {}
_WEIGHTS: dict = {}  # shared by every environment: random weights (and their NVFP4 quantization) are slow


def env_for(strict=True, bug=None) -> fh.Env:
    key = (strict, bug)
    if key not in _ENVS:
        _ENVS[key] = fh.Env(FakeLoader(KERNELS, strict, bug), KERNELS, "cpu", sync=False,
                            counts=defaultdict(Counter))  # fmt: skip
        _ENVS[key].weights = _WEIGHTS
    return _ENVS[key]


# ============================================================================= random examples pass
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
@pytest.mark.parametrize("op", fh.OPS)
@settings(max_examples=15, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(data=st.data())
def test_random_examples_pass_against_a_correct_loader(op, strict, data):
    spec = data.draw(fh.SPECS[op](CFG), label="example")
    fh.run_example(env_for(strict), spec)


@pytest.mark.parametrize("op", fh.OPS)
def test_strategies_draw_valid_invalid_and_open_examples(op, no_local_constants):
    """Of 400 drawn examples (judged by the rules, not run), some must pass, some must be rejected, and the
    fused op sees variants the bundle lacks: the strategies are not lopsided."""
    seen = Counter()

    @settings(max_examples=400, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.data())
    def draw(data):
        e = fh.expect(data.draw(fh.SPECS[op](CFG)), KERNELS)
        seen["reject" if e.must_reject else "either" if e.may_reject else "valid"] += 1
        seen["lookup only"] += e.must_reject and e.allowed() == {LookupError}

    draw()
    assert seen["valid"] >= 120 and seen["reject"] >= 30, seen
    if op == "qkv":
        assert seen["lookup only"] >= 1, seen


# ============================================================================= hand-made examples
def T(shape, dtype, fill, offset=0):
    return dict(
        shape=tuple(shape), stride=fh._contig(shape), offset=offset, dtype=dtype, dev="home", fill=fill
    )


def base_spec(op="qkv", kv="bf16", fmt="bf16", m=3):
    """A valid example of each op, built by hand: heads (8, 1), M = 3, RoPE, slots 3, 20, 0."""
    s = dict(op=op, seed=7, home=0, pdl=True, checked=False, m=m)
    if op in ("rms_norm", "fused_add_rms_norm"):
        s["x"] = T((m, K), "bf16", ("randn", 3.0, 0.0))
        if op == "fused_add_rms_norm":
            s["residual"] = T((m, K), "bf16", ("randn", 1.0, 0.0))
        s.update(weight=T((K,), "bf16", ("randn", 0.5, 1.0)), eps=1e-6)
        return s
    if op == "gemv":
        s.update(
            fmt=fmt,
            x=T((m, K), "bf16", ("randn", 2.0, 0.0)),
            weight=dict(fmt=fmt, rows=48, view="ok", dev="home"),
        )
        s["weight_scale"] = dict(view="ok") if fmt == "nvfp4" else None
        s["global_scale"] = dict(shape=(1,), dtype="f32", dev="home", offset=0) if fmt == "nvfp4" else None
        return s
    s["heads"] = (8, 1)
    if op == "qkv":
        s.update(
            fmt=fmt,
            x=T((m, K), "bf16", ("randn", 2.0, 0.0)),
            residual=T((m, K), "bf16", ("randn", 1.0, 0.0)),
            norm_weight=T((K,), "bf16", ("randn", 0.3, 1.0)),
            eps=1e-6,
            weight=dict(fmt=fmt, rows=10 * D, view="ok", dev="home"),
        )
        s["weight_scale"] = dict(view="ok") if fmt == "nvfp4" else None
        s["global_scale"] = dict(shape=(1,), dtype="f32", dev="home", offset=0) if fmt == "nvfp4" else None
    else:
        s["qkv"] = T((m, 10 * D), "bf16", ("randn", 3.0, 0.0))
    fp8 = kv != "bf16"
    cdt = "e4m3" if fp8 else "bf16"
    s.update(
        q_norm_weight=T((D,), "bf16", ("randn", 0.3, 1.0)),
        k_norm_weight=T((D,), "bf16", ("randn", 0.3, 1.0)),
        qk_eps=1e-6,
        cos_sin_cache=T((4096, D), "f32", ("table", 4096)),
        pos_values=[5, 17, 4000, 9, 1, 2, 3, 4, 5, 6, 70, 8, 900, 10, 11, 12, 13, *range(100, 147)][:m],
        positions=T((m,), "i64", ("ints",)),
        # the cache's 32 slots, each once, then negative slots (not written) for tokens 32.. of M = 64
        slot_values=[3, 20, 0, 1, 2, *range(4, 20), *range(21, 32), *[-1] * 32][:m],
        slot_mapping=T((m,), "i64", ("ints",)),
        caches=dict(layout="separate", nb=2, bs=16, nkv=1, dtype=cdt, vdtype=cdt, koff=0, voff=0, pad=(0, 0),
                    kdev="home", vdev="home"),
    )  # fmt: skip
    sc = dict(shape=(1,), dtype="f32", dev="home", offset=0, value=0.01)
    s["k_scale"], s["v_scale"] = (sc, dict(sc, value=0.02)) if fp8 else (None, None)
    return s


def with_(s, **kw):
    out = dict(s)
    for k, v in kw.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


@pytest.mark.parametrize(
    "op,kv,fmt",
    [("qkv", "bf16", "bf16"), ("qkv", "fp8", "nvfp4"), ("qk_norm_rope_cache", "fp8", "bf16"),
     ("qk_norm_rope_cache", "bf16", "bf16"), ("gemv", "bf16", "nvfp4"), ("gemv", "bf16", "bf16"),
     ("rms_norm", "bf16", "bf16"), ("fused_add_rms_norm", "bf16", "bf16")],
)  # fmt: skip
def test_base_examples_are_valid_and_pass(op, kv, fmt):
    s = base_spec(op, kv, fmt)
    e = fh.expect(s, KERNELS)
    assert not e.violations and not e.unsure, str(e)
    env = env_for()  # (cached: its counts hold every earlier test's examples too)
    before = env.counts[op].copy()
    fh.run_example(env, s)
    assert env.counts[op] - before == {"result checked": 1}, "this example's values were not compared"


EXPECTATIONS = [
    # (changes to the qkv base example, expected exception types, or None = must succeed, "either")
    (dict(m=0), {ValueError}),
    (dict(m=MAX_M + 1), {ValueError}),
    (dict(m=MAX_M), None),
    (dict(eps=float("nan")), {ValueError}),
    (dict(eps=True), {TypeError, ValueError}),
    (dict(eps=10**400), {TypeError, ValueError}),
    (dict(eps=3.4028235e38), "either"),
    (dict(qk_eps=F32_MAX), None),
    (dict(heads=(24, 4), weight=dict(rows=32 * D), caches=dict(nkv=4)), {LookupError}),
    (dict(heads=(4, 4), weight=dict(rows=12 * D), caches=dict(nkv=4)), {LookupError}),
    (dict(heads=(24, 4), weight=dict(rows=32 * D)), {LookupError, TypeError, ValueError}),
    (dict(cos_sin_cache="placeholder"), {ValueError}),
    (dict(caches=dict(layout="split")), None),
    (dict(caches=dict(layout="same")), {ValueError}),
    (dict(caches=dict(layout="overlap")), {ValueError}),
    (dict(caches=dict(layout="interleave")), "either"),
    (dict(caches=dict(layout="zero1")), {ValueError}),
    (dict(caches=dict(layout="zero0")), {ValueError}),  # nb = 2
    (dict(caches=dict(layout="zero0", nb=1)), None),  # a zero stride on a dim of size 1
    (dict(caches=dict(layout="selfoverlap")), {ValueError}),
    (dict(caches=dict(layout="padded", pad=(8, 8))), None),
    (dict(caches=dict(layout="padded", pad=(8, 1))), "either"),
    (dict(caches=dict(layout="blocks_inner")), None),
    (dict(caches=dict(layout="heads_outer")), None),
    (dict(k_scale=dict(shape=(1,), dtype="f32", dev="home", offset=0, value=0.5)), {TypeError, ValueError}),
    (dict(positions=dict(offset=1)), "either"),
    (dict(slot_values=[3, 3, 0]), None),  # duplicates: a caller error, unchecked
    (dict(slot_values=[3, 3, 0], checked=True), {ValueError}),
    (dict(slot_values=[-1, -1, 0], checked=True), None),
    (dict(slot_values=[3, 32, 0], checked=True), {ValueError}),
    (dict(slot_values=[3, 32, -5]), None),
    (dict(pos_values=[5, 4096, -1]), None),  # NaN q/k for tokens 1 and 2
    (dict(pos_values=[5, 4096, 1], checked=True), {ValueError}),
    (dict(slot_values=[3, 20], slot_mapping=T((2,), "i64", ("ints",))), None),
    (dict(slot_values=[3, 20, 0, 1], slot_mapping=T((4,), "i64", ("ints",))), {ValueError}),
    (dict(residual=None), None),
    (dict(x=dict(offset=1)), {TypeError, ValueError}),
    (dict(x=dict(dtype="f16")), {TypeError, ValueError}),
    (dict(weight=dict(view="transpose")), {TypeError, ValueError}),
    (dict(weight=dict(view="short")), {TypeError, ValueError}),
]


@pytest.mark.parametrize("change,want", EXPECTATIONS, ids=[str(i) for i in range(len(EXPECTATIONS))])
def test_expectations_of_hand_made_examples(change, want):
    s = with_(base_spec(m=change.pop("m", 3)), **change)
    e = fh.expect(s, KERNELS)
    if want is None:
        assert not e.violations and not e.unsure, str(e)
    elif want == "either":
        assert not e.violations and e.unsure, str(e)
    else:
        assert e.violations and not (e.allowed() - want), str(e)
    for strict in (True, False):  # and the fake agrees, both ways the open cases may go
        fh.run_example(env_for(strict), s)


def test_fp8_example_checks_the_stored_bytes():
    s = base_spec("qkv", "fp8")
    fh.run_example(env_for(), s)
    fh.run_example(env_for(), with_(s, caches=dict(dtype="u8", vdtype="u8")))
    bads = [
        dict(k_scale=None),
        dict(v_scale=dict(value=0.0)),
        dict(k_scale=dict(value=float("inf"))),
        dict(k_scale=dict(shape=(2,))),
        dict(v_scale=dict(dtype="f16")),
        dict(caches=dict(vdtype="u8")),
    ]
    for bad in bads:
        e = fh.expect(with_(s, **bad), KERNELS)
        assert e.must_reject, bad
        fh.run_example(env_for(), with_(s, **bad))


# ============================================================================= every check can fail
BUGS = [
    ("write_guard", base_spec("gemv"), "guard band"),
    ("accept_nan_eps", with_(base_spec(), qk_eps=float("nan")), "accepted an invalid example"),
    ("write_negative_slot", with_(base_spec(), slot_values=[3, -1, 0]), "outside the mapped slots"),
    ("wrong_q", base_spec(), "relative error"),
    ("wrong_q", base_spec("gemv"), "relative error"),
    # one element off, too little for a norm-wise bound over the whole output
    ("one_q_element", base_spec(m=16), "elements off the reference"),
    ("one_q_element", base_spec("qk_norm_rope_cache", m=16), "elements off the reference"),
    ("one_v_element", base_spec(m=16), "v_cache: 1 of"),
    ("one_y_element", with_(base_spec("gemv", m=16), weight=dict(rows=144)), "y: 1 of"),
    ("one_xn_element", base_spec("rms_norm", m=16), "xn: 1 of"),
    ("fp8_scale", base_spec("qkv", "fp8"), "e4m3 values off"),
    ("reject_shared", with_(base_spec(), caches=dict(layout="split")), "rejected a valid example"),
    (
        "lookup_keyerror",
        with_(base_spec(), heads=(24, 4), weight=dict(rows=32 * D), caches=dict(nkv=4)),
        "KeyError",
    ),
    ("write_on_reject", with_(base_spec(), eps=float("nan")), "changed"),
    ("no_nan_for_bad_position", with_(base_spec(), pos_values=[5, 4096, 1]), "must be NaN"),
    (
        "ignore_checked",
        with_(base_spec(), checked=True, slot_values=[3, 99, 0]),
        "accepted an invalid example",
    ),
]


@pytest.mark.parametrize("bug,spec,msg", BUGS, ids=[f"{b}-{s['op']}" for b, s, _ in BUGS])
def test_a_planted_bug_is_caught(bug, spec, msg):
    fh.run_example(env_for(), spec)  # the correct fake passes this very example
    with pytest.raises(AssertionError, match=msg):
        fh.run_example(env_for(bug=bug), spec)


# ============================================================================= tests/helpers.py
def test_strides_contiguity_extent_overlap():
    assert h.is_contiguous((3, 4), (4, 1)) and not h.is_contiguous((3, 4), (5, 1))
    assert h.is_contiguous((1, 2048), (1, 1))  # torch ignores the stride of a dim of size 1
    assert h.is_contiguous((0, 5), (7, 3))
    assert h.extent((2, 3), (10, 1)) == 13 and h.extent((0, 3), (3, 1)) == 0 and h.extent((4,), (0,)) == 1
    assert h.non_overlapping((2, 16, 2, 128), (4096, 256, 128, 1))
    assert h.non_overlapping((2, 16, 2, 128), (2 * 4096, 256, 128, 1))  # vLLM's kv[:, 0]
    assert not h.non_overlapping((2, 16, 2, 128), (256, 256, 128, 1))
    assert not h.non_overlapping((2, 16), (0, 1)) and h.non_overlapping((1, 16), (0, 1))
    for shape, stride in (((3, 4), (4, 1)), ((3, 4), (1, 3)), ((2, 3, 4), (24, 8, 2)), ((3, 4), (2, 1))):
        t = torch.arange(100).as_strided(shape, stride)
        assert h.is_contiguous(shape, stride) == t.is_contiguous()
        assert h.non_overlapping(shape, stride) == (t.flatten().unique().numel() == t.numel())


def test_guarded_carve_and_change_detection():
    v, g = h.carve((3, 5), torch.bfloat16, "cpu", offset=3, data=torch.arange(15.0).view(3, 5))
    assert torch.equal(v.float(), torch.arange(15.0).view(3, 5))
    assert (v.data_ptr() - g.buf.data_ptr()) == g.guard + 6 and g.guard_intact()
    g.snapshot()
    g.assert_unchanged("fresh")
    assert not g.changed_elements(torch.bfloat16).any()
    torch.as_strided(v, (1,), (1,), v.storage_offset() + 15).fill_(1)  # the element after the view
    ch = g.changed_elements(torch.bfloat16)
    assert ch.sum() == 1 and ch.nonzero().item() == g.guard // 2 + 3 + 15
    with pytest.raises(AssertionError, match="1 bytes changed|2 bytes changed"):
        g.assert_unchanged("after")
    idx = h.element_index(v, g)
    assert idx[0, 0].item() == g.guard // 2 + 3 and idx[2, 4].item() == g.guard // 2 + 3 + 14
    e, ge = h.carve((4, 3), torch.float32, "cpu", stride=(0, 1), data=torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(e, torch.tensor([[1.0, 2.0, 3.0]] * 4))  # written through the expanded view's base
    u8 = h.Guarded(10, "cpu")
    assert u8.buf.numel() == 2 * 4096 + 16 and bool((u8.buf == 0xFF).all())
    assert u8.view(torch.bfloat16, (2,), (1,)).isnan().all() and u8.view(torch.int64, (1,), (1,)).item() == -1
    with pytest.raises(ValueError, match="does not fit"):
        u8.view(torch.uint8, (4096 + 17,), (1,))


def test_e4m3_ulp_is_the_spacing_of_e4m3_values():
    vals = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # 0 .. 448
    spacing = vals[1:] - vals[:-1]
    assert torch.equal(h.e4m3_ulp(vals[:-1]), spacing)
    assert h.e4m3_ulp(torch.tensor([448.0, 1000.0])).tolist() == [32.0, 32.0]


def test_fp8_close():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 128, generator=g, dtype=torch.float64) * 3
    scale = 0.01
    stored = fp8_cache_value(ref, scale).float()
    assert h.fp8_close(stored, ref, scale).all()
    assert h.fp8_close(fp8_cache_value(ref, scale / 4).float(), ref, scale / 4).all()  # saturated
    # one bf16 ulp on the value (the kernel's rounding) stays close
    nudged = fp8_cache_value(ref.bfloat16().double() * (1 + 2.0**-8), scale).float()
    assert h.fp8_close(nudged, ref, scale).all()
    assert not h.fp8_close(fp8_cache_value(ref, scale * 1.25).float(), ref, scale).all()  # wrong scale
    assert not h.fp8_close(fp8_cache_value(ref * 1.1, scale).float(), ref, scale).all()
    assert not h.fp8_close(torch.full((4, 128), float("nan")), ref, scale).any()


@pytest.mark.parametrize("kv,cache_u8,split", [("bf16", False, False), ("fp8_e4m3", False, True),
                                                ("fp8_e4m3", True, False)])  # fmt: skip
def test_make_case_and_check_on_cpu(kv, cache_u8, split):
    """make_case and check() on the CPU, with the op done by the reference (what a correct kernel stores)."""
    c = h.make_case(3, 8, 1, True, seed=5, fmt="nvfp4", kv_dtype=kv, cache_u8=cache_u8, split_kv=split,
                    num_blocks=4, block_size=16, device="cpu")  # fmt: skip
    if kv == "bf16":
        assert "k_scale" not in c and c["k_cache"].dtype == torch.bfloat16
    else:
        assert c["k_cache"].dtype == (torch.uint8 if cache_u8 else torch.float8_e4m3fn)
        assert (c["k_cache"].view(torch.uint8) == h.FP8_CACHE_POISON).all()
        for name in ("k_scale", "v_scale"):
            assert c[name].dtype == torch.float32 and c[name].numel() == 1 and c[name].item() > 0
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    fake = FakeLoader(KERNELS)
    q, r = fake.flint_qkv_fused(**h.op_args(c))
    h.check(c, q, r, kb, vb)
    # a stray write anywhere else in a cache fails the check
    slot_set = {s for _, s in h.mapped_slots(c["slot_mapping"], 3, 64)}
    free = next(s for s in range(64) if s not in slot_set)
    c["v_cache"][free // 16, free % 16, 0, 0] = c["v_cache"][
        c["slot_mapping"][0] // 16, c["slot_mapping"][0] % 16, 0, 0
    ]
    with pytest.raises(AssertionError, match="wrong set of elements"):
        h.check(c, q, r, kb, vb)


def test_make_case_fp8_inputs_equal_the_bf16_case():
    a = h.make_case(2, 8, 1, True, seed=9, device="cpu")
    b = h.make_case(2, 8, 1, True, seed=9, kv_dtype="fp8_e4m3", device="cpu")
    for key in ("x", "residual", "weight", "positions", "slot_mapping", "q_norm_weight"):
        assert torch.equal(a[key], b[key]), key


def test_variants_reads_kv_and_format():
    class E:
        def __init__(self, kind, spec, arch="sm_90a"):
            self.kind, self.spec, self.arch = kind, spec, arch

    class B:
        class manifest:  # noqa: N801
            kernels = [
                E("qkv", {"weight_format": "bf16", "rope": True, "heads": [32, 4]}),
                E(
                    "qkv",
                    {"weight_format": "bf16", "rope": True, "heads": [32, 4], "kv_cache_dtype": "fp8_e4m3"},
                ),
                E("qkv", {"weight_format": "bf16", "rope": False, "heads": [16, 2], "norm": "prologue"}),
                E("qkv", {"weight_format": "nvfp4", "rope": True, "heads": [8, 1]}),
                E("qkv", {"weight_format": "bf16", "rope": True, "heads": [4, 1]}, arch="sm_100a"),
            ]

    assert h.variants(B, "bf16", arch="sm_90a") == [(False, (16, 2)), (True, (32, 4))]
    assert h.variants(B, "bf16", "fp8_e4m3", arch="sm_90a") == [(True, (32, 4))]
    assert h.variants(B, "nvfp4", arch="sm_90a") == [(True, (8, 1))]
    k = fh.Kernels((e.kind, e.spec) for e in B.manifest.kernels if e.arch == "sm_90a")
    assert not k.has_qkv("bf16", True, (32, 4), "bf16", True)  # separate norm, but no norm kernel
    assert k.has_qkv("bf16", False, (16, 2), "bf16", True)  # prologue: no norm kernel needed


def test_count_table_lists_each_op():
    counts = defaultdict(Counter)
    counts["gemv"]["ValueError"] += 2
    counts["gemv"]["result checked"] += 5
    lines = fh.count_table(counts)
    row = next(ln for ln in lines if ln.startswith("gemv"))
    assert row.split()[:2] == ["gemv", "7"]


def test_make_cos_sin_helper_copies():
    t = h._cos_sin(8, torch.device("cpu"))
    t.fill_(0)
    assert torch.equal(h._cos_sin(8, torch.device("cpu")), make_cos_sin_cache(8))

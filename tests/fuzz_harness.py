"""Property-based fuzzing of the serve-time ops (tests/test_fuzz_gpu.py): hypothesis strategies that draw an
example as plain data (a dict: readable when hypothesis prints a failing one), the validation rules of the
loader (docs/api.md §2, §7-§9, §15, §16) as data (`expect`: must it be rejected, and with which exception
types; may it go either way, where the rules leave it open), the materialization of an example into tensors
carved out of poisoned guard buffers (tests.helpers.Guarded), the call, and the checks:

* a rejected call raised TypeError / ValueError / LookupError (never KeyError, IndexError or anything else),
  one the rules allow, and no byte of any buffer changed (inputs, caches, their guard bands);
* an accepted call was allowed; its new outputs have the right shape, dtype and device; its values match the
  float64 reference (loader.reference; relative Frobenius error < 1e-2, no NaN except the q/k heads of a
  token whose position is outside the cos/sin table) and so does every element: q and BF16 k/v within
  tests.helpers.ELEMENT_TOL of their head's RMS, xn within one bf16 ulp of rms_norm_ref (the norm tests'
  bound), the GEMV's y within one bf16 rounding plus the fp32 accumulation bound (the unfused tests'); the
  caches changed only at the mapped slots (NaN poison everywhere else stays bit-identical) and hold the right
  values there (FP8: tests.helpers.fp8_close); every input buffer, guard bands included, is bit-identical;
* after every example the device synchronizes without error (else every later example reports the first
  one that broke the context).

The specialization axes come from the bundle (Kernels): each example draws its hidden size K mostly (90 %)
from those the bundle has for the op's kernels (for the fused op: for its head counts and weight format), else
one it lacks (OTHER_HIDDEN), and the q/k norm setting (both norm weights given, or both None: no q/k norm)
mostly from those its qkv / qk_norm_rope_cache kernels have, sometimes the other one, rarely exactly one None.
The loader takes K from x's columns (any K > 0; the other tensors' shapes must follow it) and refuses a K or
a q/k norm setting the bundle lacks by LookupError, after every argument check; so does the model.

Works on any device: the CPU tests (tests/test_fuzz_harness_cpu.py) run it against a fake loader.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from loader import nvfp4
from loader.abi import F32_MAX, HEAD_DIM, HIDDEN, MAX_M, MAX_TOKENS, max_gemv_rows
from loader.reference import gemv_ref, make_cos_sin_cache, qk_norm_rope_ref, qkv_fused_ref, rms_norm_ref
from tests.helpers import (
    Guarded,
    as_float,
    assert_elements_close,
    assert_gemv_close,
    assert_xn_close,
    carve,
    element_index,
    extent,
    fp8_close,
    is_contiguous,
    non_overlapping,
    rel,
)

K, D = HIDDEN, HEAD_DIM  # K: the default hidden size (an example's own: hidden_of)
# hidden sizes an example may be drawn at that the bundle lacks (those it has are left out): multiples of 512,
# within and beyond what the kernels can be built for (loader.abi.hidden_refusal): the loader refuses each one
# the bundle lacks by LookupError, whatever it could be built for
OTHER_HIDDEN = (1024, 1536, 2048, 2560, 4096)
OPS = ("qkv", "qk_norm_rope_cache", "gemv", "rms_norm", "fused_add_rms_norm")
FN = {"qkv": "flint_qkv_fused", "qk_norm_rope_cache": "qk_norm_rope_cache", "gemv": "gemv",
      "rms_norm": "rms_norm", "fused_add_rms_norm": "fused_add_rms_norm"}  # fmt: skip
REJECT = (TypeError, ValueError, LookupError)
TV = frozenset({TypeError, ValueError})
LOOKUP = frozenset({LookupError})
DT = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": torch.float64,
      "i64": torch.int64, "i32": torch.int32, "u8": torch.uint8, "i8": torch.int8,
      "e4m3": torch.float8_e4m3fn}  # fmt: skip
ESIZE = {k: torch.empty((), dtype=v).element_size() for k, v in DT.items()}
FP8_NAMES = ("e4m3", "u8")

# Example counts per op and outcome, printed at the end of the session (tests/conftest.py).
COUNTS: dict[str, Counter] = defaultdict(Counter)
OUTCOMES = ("TypeError", "ValueError", "LookupError", "result checked", "accepted, values not compared")


def count_table(counts=None) -> list[str]:
    counts = COUNTS if counts is None else counts
    head = f"{'op':<20} {'examples':>8}  " + "  ".join(f"{o:>{max(len(o), 6)}}" for o in OUTCOMES)
    lines = [head]
    for op in OPS:
        c = counts.get(op)
        if c:
            cells = "  ".join(f"{c[o]:>{max(len(o), 6)}}" for o in OUTCOMES)
            lines.append(f"{op:<20} {sum(c.values()):>8}  {cells}")
    lines.append("(every call hypothesis made: generation, shrinking and the replay of a failure alike)")
    return lines


# ============================================================================= the bundle's kernels
class Kernels:
    """What kernels a bundle has for one architecture: (kind, spec) pairs. A spec without one of Flint's axes
    has its default value (DEFAULTS: hidden 2048, q/k norm on, ...), as loader.abi's spec constructors."""

    DEFAULTS = {"kv_cache_dtype": "bf16", "norm": "separate", "hidden": HIDDEN, "qk_norm": True}

    def __init__(self, entries):
        self.entries = [(k, dict(s)) for k, s in entries]

    @classmethod
    def from_bundle(cls, bundle, arch: str) -> Kernels:
        return cls((e.kind, e.spec) for e in bundle.manifest.kernels if e.arch == arch)

    def specs(self, kind: str, **want) -> list[dict]:
        """The specs of this kind whose values (defaults filled in) are those of want (heads as a pair)."""
        out = []
        for k, s in self.entries:
            if k != kind:
                continue
            full = {**self.DEFAULTS, **s}
            if all(_norm_value(full.get(a)) == _norm_value(b) for a, b in want.items()):
                out.append(full)
        return out

    def has(self, kind: str, **want) -> bool:
        return bool(self.specs(kind, **want))

    def hiddens(self, kind: str, **want) -> list[int]:
        """The hidden sizes the bundle has kernels of this kind for (with the values of want)."""
        return sorted({s["hidden"] for s in self.specs(kind, **want)})

    def qk_norms(self, kind: str, **want) -> list[bool]:
        """The q/k norm settings (True: on) the bundle has kernels of this kind for (with want's values)."""
        return sorted({bool(s["qk_norm"]) for s in self.specs(kind, **want)})

    def names(self, axis: str) -> bool:
        """Whether the bundle's specs name this axis (every spec of a schema-9 manifest names its hidden size
        and q/k norm setting; a hand-made list of specs of the fixed-K era names neither)."""
        return any(axis in s for _, s in self.entries)

    def has_qkv(self, fmt, rope, heads, kv, residual, hidden=HIDDEN, qk_norm=True, m=1) -> bool:
        """A qkv kernel for these whose token tile holds m, and (unless it normalizes in its prologue) the
        input-norm kernel of this hidden size."""
        want = dict(weight_format=fmt, rope=rope, heads=heads, kv_cache_dtype=kv, hidden=hidden)
        for s in self.specs("qkv", qk_norm=qk_norm, **want):
            norm = s["norm"] == "prologue" or self.has("norm", residual=residual, hidden=hidden)
            if s.get("max_m", 8) >= m and norm:
                return True
        return False

    def has_gemv(self, fmt, hidden, m=1) -> bool:
        """A gemv kernel of this format and hidden size whose token tile holds m (past hidden 2048 the
        bundle has only 8-token kernels: loader.abi.max_tile)."""
        return any(s.get("max_m", 8) >= m for s in self.specs("gemv", weight_format=fmt, hidden=hidden))

    def qkv_heads(self, **want) -> list[tuple[int, int]]:
        return sorted({tuple(s["heads"]) for s in self.specs("qkv", **want)})


def _norm_value(v):
    return tuple(v) if isinstance(v, list) else v


@dataclass
class FuzzConfig:
    kernels: Kernels
    foreign: tuple = ("cpu",)  # where a tensor may be put instead of the op's device: "cpu", "other"
    homes: tuple = (0,)  # CUDA device indices an example may run on
    extra_heads: tuple = ((24, 4), (8, 2), (4, 4), (64, 8))  # valid head counts, likely not in the bundle
    gemv_rows: tuple = (16, 48, 144, 2064, 5120)
    max_tokens: int = MAX_TOKENS  # the bundle's limit on M for the unfused norms and per-head op
    big_m: tuple = (65, 257, 1000, 4096, MAX_TOKENS)  # prefill sizes the unfused ops' M is drawn from
    # hidden sizes to draw now and then that the bundle lacks; None: OTHER_HIDDEN where the bundle's specs
    # name their hidden size (Kernels.names), else none (a fake bundle of the fixed-K era, whose loader knows
    # one K)
    other_hidden: tuple | None = None
    # whether to draw q/k norm settings the bundle lacks and exactly one None norm weight (a ValueError);
    # None: where the bundle's specs name their q/k norm setting (as other_hidden)
    qk_norm_axis: bool | None = None

    def hidden_others(self) -> tuple:
        if self.other_hidden is not None:
            return tuple(self.other_hidden)
        return OTHER_HIDDEN if self.kernels.names("hidden") else ()

    def qk_axis(self) -> bool:
        return self.kernels.names("qk_norm") if self.qk_norm_axis is None else bool(self.qk_norm_axis)


BAD_HEADS = ((31, 4), (0, 1), (8, 0), (-8, -1), (True, 1), (16.0, 2), (16, 2.0), (4, 8))
EPS_OK = (1e-6, 1e-5, 0.0, 0, 1, 0.5, 1000.0, -0.0)
EPS_BAD = (-1e-6, -1, float("nan"), float("inf"), float("-inf"), 1e39, 10**400, True, False, None, "1e-6")
EPS_EDGE = (F32_MAX, 3.4028235e38)  # the largest fp32; a double just above it that fp32 rounds down to it


# ============================================================================= strategies
def _rare(draw, pct: int) -> bool:
    """True with probability pct %, shrinking to False."""
    return draw(st.integers(0, 99)) >= 100 - pct


def _contig(shape) -> tuple:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def tensor_arg(draw, cfg, shape, dtype, fill, wrong_dtypes, *, pct_bad=2, shape_dims=None, align_bad=True,
               none_bad=True):  # fmt: skip
    """A tensor argument: shape, strides, storage offset (elements past the guard), dtype, device, fill; valid
    (contiguous, 16-byte aligned, on the op's device) unless one corruption is drawn (pct_bad %); none_bad:
    None is one of them."""
    shape = tuple(shape)
    per16 = max(16 // ESIZE[dtype], 1)
    a = dict(shape=shape, stride=_contig(shape), offset=draw(st.integers(0, 3)) * per16, dtype=dtype,
             dev="home", fill=fill)  # fmt: skip
    if not _rare(draw, pct_bad):
        return a
    kinds = ["dtype", "shape", "stride", "transpose", "expand", "py"] + ["none"] * none_bad
    kinds += ["misalign"] * align_bad
    kinds += ["device"] * bool(cfg.foreign)
    how = draw(st.sampled_from(kinds))
    if how == "misalign" and per16 > 1:
        a["offset"] += draw(st.integers(1, per16 - 1))
    elif how == "dtype":
        a["dtype"] = draw(st.sampled_from(wrong_dtypes))
    elif how == "shape" and shape:
        dims = range(len(shape)) if shape_dims is None else shape_dims
        i = draw(st.sampled_from(list(dims)))
        new = list(shape)
        new[i] = max(0, new[i] + draw(st.sampled_from([1, -1, 64])))
        a["shape"], a["stride"] = tuple(new), _contig(new)
    elif how == "stride" and shape:
        pad = draw(st.sampled_from([per16, 1, 2 * per16]))
        a["stride"] = (a["stride"][0] * 2,) if len(shape) == 1 else (shape[-1] + pad,) + a["stride"][1:]
    elif how == "transpose" and len(shape) == 2:
        a["stride"] = (1, max(shape[0], 1))
    elif how == "expand" and any(s > 1 for s in shape):
        i = next(i for i, s in enumerate(shape) if s > 1)
        a["stride"] = a["stride"][:i] + (0,) + a["stride"][i + 1 :]
    elif how == "py":
        return {"py": draw(st.sampled_from([1.0, [1.0, 2.0], "tensor"]))}
    elif how == "none":
        return None
    elif how == "device":
        a["dev"] = draw(st.sampled_from(cfg.foreign))
    return a


def eps_value(draw):
    r = draw(st.integers(0, 99))
    if r < 95:
        return draw(st.sampled_from(EPS_OK))
    if r < 98:
        return draw(st.sampled_from(EPS_BAD))
    return draw(st.sampled_from(EPS_EDGE))


def positions_values(draw, m, max_pos):
    out = []
    for _ in range(m):
        if _rare(draw, 8):
            out.append(
                draw(st.sampled_from([-1, max_pos, max_pos + 3, -(2**63), 2**63 - 1, 2**31, -(2**31)]))
            )
        else:
            out.append(draw(st.integers(0, max_pos - 1)))
    return out


def slot_values(draw, m, nslots):
    s = m if not _rare(draw, 12) else draw(st.sampled_from([0, max(m - 1, 0), m + 1, m + 3]))
    if nslots >= s:
        vals = draw(st.lists(st.integers(0, nslots - 1), min_size=s, max_size=s, unique=True))
    else:
        vals = draw(st.lists(st.integers(0, nslots - 1), min_size=s, max_size=s))
    for i in range(s):
        r = draw(st.integers(0, 99))
        if r >= 94:
            vals[i] = draw(st.sampled_from([nslots, nslots + 5, 2**31, 2**63 - 1]))
        elif r >= 88:
            vals[i] = draw(st.sampled_from([-1, -7, -(2**63)]))
        elif r >= 84 and i:
            vals[i] = vals[draw(st.integers(0, i - 1))]  # a duplicate
    return vals


CACHE_LAYOUTS_OK = ("separate", "split", "padded", "heads_outer", "blocks_inner")
CACHE_LAYOUTS_BAD = ("same", "overlap", "interleave", "zero0", "zero1", "zero2", "last2", "selfoverlap",
                     "strides_differ", "shape_differ", "3d", "nkv", "headdim")  # fmt: skip


def caches_arg(draw, cfg, nkv: int, kv: str):
    """The two caches: a layout name and its numbers (cache_views turns them into views)."""
    esize = 2 if kv == "bf16" else 1
    per16 = 16 // esize
    c = dict(
        layout="separate",
        nb=draw(st.integers(1, 5)),
        bs=draw(st.sampled_from([16, 1, 2, 3, 32])),
        nkv=nkv,
        dtype="bf16" if kv == "bf16" else draw(st.sampled_from(FP8_NAMES)),
        koff=draw(st.integers(0, 2)) * per16,
        voff=draw(st.integers(0, 2)) * per16,
        pad=(draw(st.integers(0, 2)) * per16, draw(st.integers(0, 2)) * per16),
        kdev="home",
        vdev="home",
    )
    c["vdtype"] = c["dtype"]
    if _rare(draw, 40):
        c["layout"] = draw(st.sampled_from(CACHE_LAYOUTS_OK))
    if _rare(draw, 5):
        c["layout"] = draw(st.sampled_from(CACHE_LAYOUTS_BAD))
    if _rare(draw, 3):
        how = draw(st.sampled_from(["kdtype", "vdtype", "misalign", "device"]))
        if how == "kdtype":
            c["dtype"] = c["vdtype"] = draw(st.sampled_from(["f16", "f32", "i8"]))
        elif how == "vdtype":
            c["vdtype"] = draw(st.sampled_from([d for d in ("bf16", "e4m3", "u8", "f16") if d != c["dtype"]]))
        elif how == "misalign":
            c[draw(st.sampled_from(["koff", "voff"]))] += 1
            c["pad"] = (c["pad"][0] + draw(st.integers(0, 1)), c["pad"][1])
        elif cfg.foreign:
            c[draw(st.sampled_from(["kdev", "vdev"]))] = draw(st.sampled_from(cfg.foreign))
    return c


def scale_arg(draw, cfg, fp8: bool):
    """k_scale or v_scale: for an FP8 cache mostly a valid fp32 one-element tensor, for BF16 mostly None."""
    valid = dict(shape=draw(st.sampled_from([(1,), (), (1, 1)])), dtype="f32", dev="home",
                 offset=4 * draw(st.integers(0, 3)), value=2.0 ** draw(st.floats(-9, -3)))  # fmt: skip
    if fp8 != _rare(draw, 3):  # fp8 and not rare, or bf16 and rare
        if not _rare(draw, 5):
            return valid
        how = draw(st.sampled_from(["value", "shape", "dtype", "device", "py", "none", "offset"]))
        if how == "value":
            valid["value"] = draw(st.sampled_from([0.0, -0.01, float("nan"), float("inf"), float("-inf")]))
        elif how == "shape":
            valid["shape"] = (2,)
        elif how == "dtype":
            valid["dtype"] = draw(st.sampled_from(["f16", "f64", "bf16"]))
        elif how == "device" and cfg.foreign:
            valid["dev"] = draw(st.sampled_from(cfg.foreign))
        elif how == "py":
            return {"py": valid["value"]}
        elif how == "none":
            return None
        elif how == "offset":
            valid["offset"] += 1  # 4-byte aligned, not 16: the rules say nothing: either outcome
        return valid
    return None


def weight_arg(draw, cfg, fmt: str, rows: int):
    w = dict(fmt=fmt, rows=rows, view="ok", dev="home")
    if _rare(draw, 4):
        w["view"] = draw(st.sampled_from(["misalign", "transpose", "expand", "dtype", "short", "py"]))
    if cfg.foreign and _rare(draw, 2):
        w["dev"] = draw(st.sampled_from(cfg.foreign))
    return w


def wscale_arg(draw, cfg, fmt: str):
    if fmt == "bf16":
        return dict(view="ok") if _rare(draw, 3) else None
    r = draw(st.integers(0, 99))
    if r < 75:
        return dict(view="ok")
    if r < 93:
        return dict(view=draw(st.sampled_from(["u8", "offset4"])))
    if r < 98:
        return dict(view=draw(st.sampled_from(["misalign", "short", "transpose", "dtype", "py"] +
                                              ["device"] * bool(cfg.foreign))))  # fmt: skip
    return None


def gscale_arg(draw, cfg, fmt: str):
    g = dict(shape=draw(st.sampled_from([(1,), (), (1, 1)])), dtype="f32", dev="home",
             offset=4 * draw(st.integers(0, 2)))  # fmt: skip
    if fmt == "bf16":
        return g if _rare(draw, 3) else None
    if not _rare(draw, 5):
        return g
    how = draw(st.sampled_from(["shape", "dtype", "device", "py", "none", "offset"]))
    if how == "shape":
        g["shape"] = (2,)
    elif how == "dtype":
        g["dtype"] = draw(st.sampled_from(["f16", "f64"]))
    elif how == "device" and cfg.foreign:
        g["dev"] = draw(st.sampled_from(cfg.foreign))
    elif how == "py":
        return {"py": 1.0}
    elif how == "none":
        return None
    elif how == "offset":
        g["offset"] += 1
    return g


def _m(draw, cfg=None):
    """M: a decode size (1..64) mostly; for the unfused norms and per-head op (cfg given) also prefill
    sizes up to the bundle's max_tokens (10 %); a size past the op's limit now and then (5 %)."""
    limit = MAX_M if cfg is None else cfg.max_tokens
    if _rare(draw, 5):
        return draw(st.sampled_from([0, limit + 1, 2 * limit]))
    if cfg is not None and _rare(draw, 10):
        return draw(st.sampled_from([b for b in cfg.big_m if b <= limit] + [limit]))
    return draw(st.integers(1, MAX_M))


def m_limit(op: str, cfg_max_tokens: int = MAX_TOKENS) -> int:
    """The most tokens a call of op may have: the fused op and the GEMV MAX_M, the unfused norms and the
    per-head op the bundle's max_tokens."""
    return MAX_M if op in ("qkv", "gemv") else cfg_max_tokens


def _common(draw, cfg, op):
    return dict(op=op, seed=draw(st.integers(0, 2**31 - 1)), home=draw(st.sampled_from(cfg.homes)),
                pdl=not _rare(draw, 25), checked=_rare(draw, 15),
                m_limit=m_limit(op, cfg.max_tokens))  # fmt: skip


def _heads(draw, cfg):
    """Mostly head counts of the bundle; else valid ones it likely lacks (5 %), or invalid ones (4 %)."""
    r = draw(st.integers(0, 99))
    if r < 91 and cfg.kernels.qkv_heads():
        return draw(st.sampled_from(cfg.kernels.qkv_heads()))
    return draw(st.sampled_from(list(cfg.extra_heads) if r < 96 else list(BAD_HEADS)))


def _proper_heads(nq, nkv) -> bool:
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (nq, nkv))
    return ok and nq % nkv == 0


def _hidden(draw, cfg, have) -> int:
    """K: mostly (90 %) one of `have`, the hidden sizes the bundle has for the op's kernels (2048 if none),
    else one it lacks (FuzzConfig.hidden_others)."""
    have = sorted(have) or [HIDDEN]
    lacking = [k for k in cfg.hidden_others() if k not in have]
    if lacking and _rare(draw, 10):
        return draw(st.sampled_from(lacking))
    return draw(st.sampled_from(have))


def _qk_norm(draw, cfg, have):
    """The q/k norm setting: True (both norm weights), False (both None: no q/k norm), or "q only" / "k only"
    (exactly one given: a ValueError); mostly (90 %) one the bundle has (`have`), else the other one (7 %),
    or exactly one None (3 %)."""
    have = sorted(have) or [True]
    if not cfg.qk_axis():
        return True
    r = draw(st.integers(0, 99))
    if r < 90:
        return draw(st.sampled_from(have))
    if r < 97:
        return not draw(st.sampled_from(have))
    return draw(st.sampled_from(["q only", "k only"]))


def _qk_part(draw, cfg, s, m, nkv_dim, qk_have):
    """The per-head stage's arguments (shared by qkv and qk_norm_rope_cache); qk_have: the q/k norm settings
    the bundle has for the op's kernels."""
    qkn = s["qk_norm"] = _qk_norm(draw, cfg, qk_have)
    for name, only in (("q_norm_weight", "q only"), ("k_norm_weight", "k only")):
        s[name] = None
        given = qkn is True or qkn == only
        if given:  # (a None drawn as a corruption is exactly one None too: only where the axis is drawn)
            s[name] = tensor_arg(draw, cfg, (D,), "bf16", ("randn", 0.3, 1.0), ["f32", "f16"],
                                 none_bad=cfg.qk_axis())  # fmt: skip
    s["qk_eps"] = eps_value(draw)
    rope = draw(st.booleans())
    max_pos = draw(st.sampled_from([4096, 1, 7])) if rope else 4096
    if not rope:
        s["cos_sin_cache"] = None
    elif _rare(draw, 3):
        s["cos_sin_cache"] = "placeholder"  # loader.no_rope_table(device): must be rejected
    else:
        s["cos_sin_cache"] = tensor_arg(draw, cfg, (max_pos, D), "f32", ("table", max_pos), ["f64", "bf16"])
    s["pos_values"] = positions_values(draw, m, max_pos)
    s["positions"] = tensor_arg(draw, cfg, (m,), "i64", ("ints",), ["i32"], align_bad=False)
    kv = draw(st.sampled_from(["bf16", "fp8_e4m3"]))
    s["caches"] = caches_arg(draw, cfg, nkv_dim, kv)
    s["slot_values"] = slot_values(draw, m, s["caches"]["nb"] * s["caches"]["bs"])
    s["slot_mapping"] = tensor_arg(draw, cfg, (len(s["slot_values"]),), "i64", ("ints",), ["i32"],
                                   align_bad=False)  # fmt: skip
    s["k_scale"] = scale_arg(draw, cfg, kv != "bf16")
    s["v_scale"] = scale_arg(draw, cfg, kv != "bf16")


@st.composite
def qkv_spec(draw, cfg: FuzzConfig):
    s = _common(draw, cfg, "qkv")
    m = s["m"] = _m(draw)
    nq, nkv = s["heads"] = _heads(draw, cfg)
    proper = _proper_heads(nq, nkv)
    fmt = s["fmt"] = draw(st.sampled_from(["bf16", "nvfp4"]))
    kn = cfg.kernels
    # K: a hidden size the bundle has for these head counts and this format (any qkv kernel's if none)
    k = s["hidden"] = _hidden(draw, cfg, kn.hiddens("qkv", heads=(nq, nkv), weight_format=fmt)
                              or kn.hiddens("qkv"))  # fmt: skip
    rows = (nq + 2 * nkv) * D if proper else 16 * D
    s["x"] = tensor_arg(draw, cfg, (m, k), "bf16", ("randn", 2.0, 0.0), ["f32", "f16"], shape_dims=[1])
    s["residual"] = None
    if draw(st.booleans()):
        s["residual"] = tensor_arg(draw, cfg, (m, k), "bf16", ("randn", 1.0, 0.0), ["f32", "f16"])
    s["norm_weight"] = tensor_arg(draw, cfg, (k,), "bf16", ("randn", 0.3, 1.0), ["f32", "f16"])
    s["eps"] = eps_value(draw)
    s["weight"] = weight_arg(draw, cfg, fmt, rows)
    s["weight_scale"] = wscale_arg(draw, cfg, fmt)
    s["global_scale"] = gscale_arg(draw, cfg, fmt)
    qk_have = kn.qk_norms("qkv", heads=(nq, nkv), hidden=k) or kn.qk_norms("qkv")
    _qk_part(draw, cfg, s, m, nkv if proper else 1, qk_have)
    return s


@st.composite
def qk_norm_rope_cache_spec(draw, cfg: FuzzConfig):
    s = _common(draw, cfg, "qk_norm_rope_cache")
    m = s["m"] = _m(draw, cfg)
    nq, nkv = s["heads"] = _heads(draw, cfg)
    proper = _proper_heads(nq, nkv)
    n = (nq + 2 * nkv) * D if proper else 2560
    s["qkv"] = tensor_arg(draw, cfg, (m, n), "bf16", ("randn", 3.0, 0.0), ["f32", "f16"], shape_dims=[1])
    _qk_part(draw, cfg, s, m, nkv if proper else 1, cfg.kernels.qk_norms("qk_norm_rope_cache"))
    return s


@st.composite
def gemv_spec(draw, cfg: FuzzConfig):
    s = _common(draw, cfg, "gemv")
    m = s["m"] = _m(draw)
    fmt = s["fmt"] = draw(st.sampled_from(["bf16", "nvfp4"]))
    k = s["hidden"] = _hidden(draw, cfg, cfg.kernels.hiddens("gemv", weight_format=fmt))
    rows = draw(st.sampled_from(cfg.gemv_rows)) if not _rare(draw, 5) else draw(st.sampled_from([40, 0]))
    s["x"] = tensor_arg(
        draw, cfg, (m, k), "bf16", ("randn", 2.0, 0.0), ["f32", "f16"], shape_dims=[1], pct_bad=6
    )
    s["weight"] = weight_arg(draw, cfg, fmt, rows)
    s["weight_scale"] = wscale_arg(draw, cfg, fmt)
    s["global_scale"] = gscale_arg(draw, cfg, fmt)
    return s


def _norm_spec(draw, cfg, op):
    s = _common(draw, cfg, op)
    m = s["m"] = _m(draw, cfg)
    k = s["hidden"] = _hidden(draw, cfg, cfg.kernels.hiddens("norm", residual=op == "fused_add_rms_norm"))
    bad = 8  # % per tensor: these ops have few arguments
    s["x"] = tensor_arg(
        draw, cfg, (m, k), "bf16", ("randn", 3.0, 0.0), ["f32", "f16"], shape_dims=[1], pct_bad=bad
    )
    if op == "fused_add_rms_norm":
        s["residual"] = tensor_arg(
            draw, cfg, (m, k), "bf16", ("randn", 1.0, 0.0), ["f32", "f16"], pct_bad=bad
        )
    s["weight"] = tensor_arg(draw, cfg, (k,), "bf16", ("randn", 0.5, 1.0), ["f32", "f16"], pct_bad=bad)
    s["eps"] = eps_value(draw) if not _rare(draw, 5) else draw(st.sampled_from(EPS_BAD))
    return s


@st.composite
def rms_norm_spec(draw, cfg: FuzzConfig):
    return _norm_spec(draw, cfg, "rms_norm")


@st.composite
def fused_add_rms_norm_spec(draw, cfg: FuzzConfig):
    return _norm_spec(draw, cfg, "fused_add_rms_norm")


SPECS = {"qkv": qkv_spec, "qk_norm_rope_cache": qk_norm_rope_cache_spec, "gemv": gemv_spec,
         "rms_norm": rms_norm_spec, "fused_add_rms_norm": fused_add_rms_norm_spec}  # fmt: skip


# ============================================================================= the rules, as data
@dataclass
class Expect:
    """What an example should give. violations: (reason, exception types that may report it); when there is
    any, the call must raise one of their union. unsure: reasons for accepting either outcome (a rejection
    by TypeError/ValueError/LookupError, or the right result). check_values: compare with the reference."""

    violations: list = field(default_factory=list)
    unsure: list = field(default_factory=list)
    check_values: bool = True

    def bad(self, why: str, exc=TV):
        self.violations.append((why, frozenset(exc)))

    def maybe(self, why: str):
        self.unsure.append(why)

    @property
    def must_reject(self) -> bool:
        return bool(self.violations)

    @property
    def may_reject(self) -> bool:
        return bool(self.violations or self.unsure)

    def allowed(self) -> frozenset:
        """The exceptions the call may raise: those of the violations, and any rejection when a reason is
        unsure (a call the loader may refuse for that reason may say so first, whatever else is wrong)."""
        if self.unsure:
            return frozenset(REJECT)
        return frozenset().union(*(e for _, e in self.violations))

    def __str__(self):
        return f"violations={[w for w, _ in self.violations]} unsure={self.unsure}"


def _check_tensor(E, name, a, dtypes, shape, align=16):
    """align: 16 or 4 (bytes the rules ask for), or None (the rules ask for none: a data pointer that is
    not 16-byte aligned may go either way)."""
    if a is None:
        E.bad(f"{name} is None")
        return False
    if "py" in a:
        E.bad(f"{name} is not a tensor")
        return False
    ok = True
    if a["dtype"] not in dtypes:
        E.bad(f"{name} dtype {a['dtype']}")
        ok = False
    if a["dev"] != "home":
        E.bad(f"{name} on {a['dev']}")
        ok = False
    if tuple(a["shape"]) != tuple(shape):
        E.bad(f"{name} shape {a['shape']} != {tuple(shape)}")
        ok = False
    if not is_contiguous(a["shape"], a["stride"]):
        E.bad(f"{name} not contiguous {a['stride']}")
        ok = False
    off = a["offset"] * ESIZE[a["dtype"]]
    if align and off % align:
        E.bad(f"{name} not {align}-byte aligned")
        ok = False
    elif align is None and off % 16:
        E.maybe(f"{name} not 16-byte aligned (no rule)")
    return ok


def _check_eps(E, name, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        E.bad(f"{name} = {v!r}")
        return
    try:
        f = float(v)
    except OverflowError:
        E.bad(f"{name} = {v!r} overflows a double")
        return
    if f != f or f < 0 or f in (float("inf"), float("-inf")):
        E.bad(f"{name} = {v!r}", {ValueError})
    elif f > F32_MAX:
        if torch.tensor(f, dtype=torch.float32).isfinite():
            E.maybe(f"{name} = {v!r}: above the fp32 maximum, rounds to it")
            E.check_values = False
        else:
            E.bad(f"{name} = {v!r} is inf in fp32", {ValueError})
    elif f > 1e4:
        E.check_values = False  # valid, numerically degenerate (everything normalizes to ~0)


def _check_heads(E, nq, nkv) -> bool:
    for name, v in (("num_q_heads", nq), ("num_kv_heads", nkv)):
        if isinstance(v, bool) or not isinstance(v, int):
            E.bad(f"{name} = {v!r}")
            return False
        if v < 1:
            E.bad(f"{name} = {v}", {ValueError})
            return False
    if nq % nkv:
        E.bad(f"num_q_heads {nq} not a multiple of num_kv_heads {nkv}", {ValueError})
    return True


def _check_weight(E, s, rows_wanted, k):
    """The weight, its scales and their shapes for hidden size k (x's columns); returns the weight format
    when it can be told (for the bundle lookup), else None."""
    w, ws, gs = s["weight"], s["weight_scale"], s["global_scale"]
    fmt = w["fmt"]
    if w["view"] == "py":
        E.bad("weight is not a tensor")
        return None
    view = weight_view_props(w, hidden_of(s))
    if view["dtype"] != ("bf16" if fmt == "bf16" else "u8"):
        E.bad(f"weight dtype {view['dtype']}")
        fmt = None
    rows = view["shape"][0]
    if rows_wanted is not None:
        if rows != rows_wanted:
            E.bad(f"weight rows {rows} != {rows_wanted}", {ValueError})
    elif rows < 16 or rows % 16 or rows > max_gemv_rows(k):
        E.bad(f"gemv weight rows {rows}", {ValueError})
    cols = k if w["fmt"] == "bf16" else k // 2  # (NVFP4: two e2m1 codes a byte)
    if fmt is not None and view["shape"][1] != cols:
        E.bad(f"weight columns {view['shape'][1]} != {cols} for hidden size {k}", {ValueError})
    if not is_contiguous(view["shape"], view["stride"]):
        E.bad("weight not contiguous")
    if view["offset"] * ESIZE[view["dtype"]] % 16:
        E.bad("weight not 16-byte aligned")
    if w["dev"] != "home":
        E.bad(f"weight on {w['dev']}")
    if w["fmt"] == "bf16":
        if ws is not None or gs is not None:
            E.bad("BF16 weight with weight_scale or global_scale", {ValueError})
        return fmt
    if ws is None or gs is None:
        E.bad("NVFP4 weight without weight_scale or global_scale", {ValueError})
    if ws is not None:
        if ws["view"] == "py":
            E.bad("weight_scale is not a tensor")
        else:
            p = wscale_view_props(ws, w["rows"], hidden_of(s))
            _check_tensor(E, "weight_scale", p, ("e4m3", "u8"), (-(-rows // 128) * 128, k // 16), align=4)
    if gs is not None:
        if "py" in gs:
            E.bad("global_scale is not a tensor")
        else:
            if gs["dtype"] != "f32":
                E.bad(f"global_scale dtype {gs['dtype']}")
            if _numel(gs["shape"]) != 1:
                E.bad(f"global_scale shape {gs['shape']}", {ValueError})
            if gs["dev"] != "home":
                E.bad(f"global_scale on {gs['dev']}")
            if gs["offset"] * ESIZE[gs["dtype"]] % 16:
                E.maybe("global_scale not 16-byte aligned (no rule)")
    return fmt


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def cache_views(c) -> dict:
    """The two cache views of a caches_arg: {"bufs": [(elements, dev)], "k"/"v": (buf, shape, stride,
    offset, dtype, dev)}; offsets in elements past the buffer's front guard."""
    nb, bs, nkv, lay = c["nb"], c["bs"], c["nkv"], c["layout"]
    hd = 64 if lay == "headdim" else D
    nkv = nkv + 1 if lay == "nkv" else nkv
    e = nkv * hd
    shape = (nb, bs, nkv, hd)
    canon = (bs * e, e, hd, 1)
    ko, vo = c["koff"], c["voff"]
    p0, p1 = c["pad"]

    def sep(kstride, vstride=None, vshape=None):
        vstride, vshape = vstride or kstride, vshape or shape
        return {"bufs": [(ko + extent(shape, kstride), c["kdev"]), (vo + extent(vshape, vstride), c["vdev"])],
                "k": (0, shape, kstride, ko), "v": (1, vshape, vstride, vo)}  # fmt: skip

    def one(kstride, voff, size):
        return {"bufs": [(size, c["kdev"])], "k": (0, shape, kstride, ko), "v": (0, shape, kstride, voff)}

    if lay in ("separate", "nkv", "headdim"):
        out = sep(canon)
    elif lay == "split":
        out = one((2 * bs * e, e, hd, 1), ko + bs * e, ko + nb * 2 * bs * e)
    elif lay == "padded":
        out = sep((bs * (e + p1) + p0, e + p1, hd, 1))
    elif lay == "heads_outer":
        out = sep((nkv * bs * hd, hd, bs * hd, 1))
    elif lay == "blocks_inner":
        out = sep((e, nb * e, hd, 1))
    elif lay == "same":
        out = one(canon, ko, ko + nb * bs * e)
    elif lay == "overlap":
        h = max(bs // 2, 1)
        out = one(((bs + h) * e, e, hd, 1), ko + h * e, ko + nb * (bs + h) * e)
    elif lay == "interleave":
        out = one((bs * 2 * e, 2 * e, hd, 1), ko + e, ko + nb * bs * 2 * e)
    elif lay == "zero0":
        out = sep((0, e, hd, 1))
    elif lay == "zero1":
        out = sep((bs * e, 0, hd, 1))
    elif lay == "zero2":
        out = sep((bs * e, e, 0, 1))
    elif lay == "last2":
        out = sep((2 * bs * e, 2 * e, 2 * hd, 2))
    elif lay == "selfoverlap":
        out = sep((e, e, hd, 1))
    elif lay == "strides_differ":
        out = sep(canon, (bs * (e + 8) + 16, e + 8, hd, 1))
    elif lay == "shape_differ":
        out = sep(canon, None, (nb + 1, bs, nkv, hd))
    elif lay == "3d":
        s3 = (nb * bs, nkv, hd)
        st3 = (e, hd, 1)
        out = {"bufs": [(ko + extent(s3, st3), c["kdev"]), (vo + extent(s3, st3), c["vdev"])],
               "k": (0, s3, st3, ko), "v": (1, s3, st3, vo)}  # fmt: skip
    else:
        raise ValueError(f"unknown cache layout {lay!r}")
    b, sh, stv, off = out["k"]
    out["k"] = (b, sh, stv, off, c["dtype"], out["bufs"][b][1])
    b, sh, stv, off = out["v"]
    out["v"] = (b, sh, stv, off, c["vdtype"], c["vdev"] if b == 1 else out["bufs"][b][1])
    return out


def _elements(shape, stride, offset) -> torch.Tensor:
    n = offset + extent(shape, stride)
    return torch.arange(max(n, 1)).as_strided(shape, stride, offset).flatten()


def _block_ranges(shape, stride, offset):
    inner = extent(shape[1:], stride[1:])
    return [(offset + b * stride[0], offset + b * stride[0] + inner) for b in range(shape[0])]


def _check_caches(E, c, nkv) -> str | None:
    """Returns the caches' kv dtype ("bf16" / "fp8_e4m3") when it can be told, else None."""
    cv = cache_views(c)
    kb, ks, kst, ko, kd, kdev = cv["k"]
    vb, vs, vst, vo, vd, vdev = cv["v"]
    kv = None
    if kd != vd:
        E.bad(f"k_cache {kd} and v_cache {vd}")
    elif kd == "bf16":
        kv = "bf16"
    elif kd in FP8_NAMES:
        kv = "fp8_e4m3"
    else:
        E.bad(f"cache dtype {kd}")
    if kdev != "home" or vdev != "home":
        E.bad("cache on another device")
    if len(ks) != 4 or len(vs) != 4:
        E.bad("caches not 4-D", {ValueError})
        return kv
    if ks[2] != nkv or ks[3] != D or ks[0] < 1 or ks[1] < 1:
        E.bad(f"cache shape {ks} for {nkv} kv heads", {ValueError})
    if ks != vs or kst != vst:
        E.bad("k_cache and v_cache differ in shape or strides", {ValueError})
    for shape, stride in ((ks, kst), (vs, vst)):
        if stride[3] != 1:
            E.bad(f"cache last stride {stride[3]}", {ValueError})
        if any(st == 0 and s > 1 for s, st in zip(shape, stride, strict=True)):
            E.bad(f"cache zero stride {stride}", {ValueError})
        elif not non_overlapping(shape, stride):
            E.bad(f"cache view overlaps itself {stride}", {ValueError})
    esize = ESIZE.get(kd, 2)
    strides = [st for st, sz in zip(kst[:3] + vst[:3], ks[:3] + vs[:3], strict=True) if sz > 1]
    if any((o * esize) % 16 for o in (ko, vo)) or any((st * esize) % 16 for st in strides):
        E.maybe("cache data or strides not 16-byte aligned (no rule)")
    if kb == vb:  # one buffer: k and v must not overlap
        ke, ve = _elements(ks, kst, ko), _elements(vs, vst, vo)
        if torch.isin(ke, ve).any():
            E.bad("k_cache and v_cache overlap", {ValueError})
        else:
            kr, vr = _block_ranges(ks, kst, ko), _block_ranges(vs, vst, vo)
            if any(a0 < b1 and b0 < a1 for a0, a1 in kr for b0, b1 in vr):
                E.maybe("k and v blocks interleave without sharing an element")
    return kv


def _check_scales(E, kv, s):
    for name in ("k_scale", "v_scale"):
        a = s[name]
        if kv == "bf16":
            if a is not None:
                E.bad(f"{name} given with a BF16 cache", {ValueError, TypeError})
            continue
        if kv is None:
            continue
        if a is None:
            E.bad(f"FP8 cache without {name}", {ValueError, TypeError})
        elif "py" in a:
            E.bad(f"{name} is not a tensor")
        else:
            if a["dtype"] != "f32":
                E.bad(f"{name} dtype {a['dtype']}")
            if _numel(a["shape"]) != 1:
                E.bad(f"{name} shape {a['shape']}", {ValueError})
            if a["dev"] != "home":
                E.bad(f"{name} on {a['dev']}")
            v = a["value"]
            if not (v == v and 0 < v < float("inf")):
                E.bad(f"{name} = {v}", {ValueError})
            if a["offset"] * ESIZE[a["dtype"]] % 16:
                E.maybe(f"{name} not 16-byte aligned (no rule)")


def effective_slots(s) -> list[int]:
    """The values the slot_mapping tensor of an example holds (its length may differ from the drawn values
    after a shape corruption: padded with 0 / cut; an expanded view repeats the first)."""
    a, vals = s["slot_mapping"], s["slot_values"]
    if a is None or "py" in a:
        return vals
    n = _numel(a["shape"])
    if any(st == 0 and sz > 1 for sz, st in zip(a["shape"], a["stride"], strict=True)):
        return [vals[0] if vals else 0] * n
    return (list(vals) + [0] * n)[:n]


def _check_qk(E, s, m, nkv):
    """The per-head stage's rules; returns (rope, kv, q/k norm) for the lookup (kv and the q/k norm setting
    None where they cannot be told)."""
    qn, kn = s["q_norm_weight"], s["k_norm_weight"]
    qk_norm = None
    if (qn is None) != (kn is None):
        E.bad("exactly one of q_norm_weight and k_norm_weight is None", {ValueError})
    elif qn is None:
        qk_norm = False  # both None: no q/k norm (the kernels built with qk_norm false)
    else:
        qk_norm = True
        _check_tensor(E, "q_norm_weight", qn, ("bf16",), (D,))
        _check_tensor(E, "k_norm_weight", kn, ("bf16",), (D,))
    _check_eps(E, "qk_eps", s["qk_eps"])
    cs = s["cos_sin_cache"]
    rope = cs is not None
    max_pos = None
    if cs == "placeholder":
        E.bad("the no-RoPE placeholder table as cos_sin_cache", {ValueError})
    elif cs is not None:
        if "py" not in cs and len(cs["shape"]) == 2:
            max_pos = cs["shape"][0]
            if max_pos < 1:
                E.bad("cos_sin_cache with no rows", {ValueError})
        _check_tensor(E, "cos_sin_cache", cs, ("f32",), (max_pos if max_pos is not None else -1, D))
    _check_tensor(E, "positions", s["positions"], ("i64",), (m,), align=None)
    sl = s["slot_mapping"]
    n_slots = sl["shape"][0] if sl is not None and "py" not in sl and len(sl["shape"]) == 1 else -1
    if n_slots > m:
        E.bad(f"slot_mapping has {n_slots} entries for M = {m}", {ValueError})
    _check_tensor(E, "slot_mapping", sl, ("i64",), (n_slots,), align=None)
    kv = _check_caches(E, s["caches"], nkv)
    _check_scales(E, kv, s)
    if s["checked"]:
        nslots = s["caches"]["nb"] * s["caches"]["bs"]
        if rope and max_pos:
            if any(not 0 <= p < max_pos for p in s["pos_values"][:m]):
                E.bad("checked mode: a position outside the table", {ValueError})
        elif any(p < 0 for p in s["pos_values"]):
            E.maybe("checked mode without RoPE, negative position")
        used = effective_slots(s)[:m]
        if any(v >= nslots for v in used):
            E.bad("checked mode: a slot past the cache", {ValueError})
        nonneg = [v for v in used if v >= 0]
        if len(set(nonneg)) != len(nonneg):
            E.bad("checked mode: duplicate slots", {ValueError})
    return rope, kv, qk_norm


def hidden_of(s: dict) -> int:
    """The hidden size an example was drawn at (examples without one: HIDDEN)."""
    return s.get("hidden", HIDDEN)


def x_cols(s: dict) -> int:
    """K as the loader takes it: x's columns, any K > 0 (the other tensors' shapes must follow it); the drawn
    hidden size where x is no 2-D tensor of columns (then the call is refused for x anyway)."""
    a = s.get("x")
    if isinstance(a, dict) and "py" not in a and len(a["shape"]) == 2 and a["shape"][1] > 0:
        return a["shape"][1]
    return hidden_of(s)


def expect(s: dict, kernels: Kernels) -> Expect:
    """What the loader must do with example s, given the bundle's kernels. A variant the bundle lacks (hidden
    size, q/k norm setting, head counts, format, RoPE, cache dtype, residual) is a LookupError, one of the
    violations: alone, the call must raise it; beside an argument the checks refuse, either may be raised."""
    E = Expect()
    op, m = s["op"], s["m"]
    k = x_cols(s)
    if not 1 <= m <= s.get("m_limit", MAX_M):
        E.bad(f"M = {m}", {ValueError})
    if op in ("rms_norm", "fused_add_rms_norm", "gemv", "qkv"):
        _check_tensor(E, "x", s["x"], ("bf16",), (m, k))
    if op in ("rms_norm", "fused_add_rms_norm"):
        res = s.get("residual")
        if op == "fused_add_rms_norm":
            _check_tensor(E, "residual", res, ("bf16",), (m, k))
        _check_tensor(E, "weight", s["weight"], ("bf16",), (k,))
        _check_eps(E, "eps", s["eps"])
        if not kernels.has("norm", residual=op == "fused_add_rms_norm", hidden=k):
            E.bad(f"no norm kernel for hidden size {k} in the bundle", LOOKUP)
        return E
    if op == "gemv":
        fmt = _check_weight(E, s, None, k)
        if fmt is not None and not kernels.has_gemv(fmt, k, m if 1 <= m <= MAX_M else 1):
            E.bad(f"no gemv {fmt} kernel for hidden size {k} and M = {m}", LOOKUP)
        return E
    nq, nkv = s["heads"]
    proper = _check_heads(E, nq, nkv)
    if op == "qkv":
        if s["residual"] is not None:
            _check_tensor(E, "residual", s["residual"], ("bf16",), (m, k))
        _check_tensor(E, "norm_weight", s["norm_weight"], ("bf16",), (k,))
        _check_eps(E, "eps", s["eps"])
        fmt = _check_weight(E, s, (nq + 2 * nkv) * D if proper else -1, k)
        rope, kv, qkn = _check_qk(E, s, m, nkv if proper else 1)
        if proper and fmt is not None and kv is not None and qkn is not None:
            tile_m = m if 1 <= m <= MAX_M else 1  # (an M the checks refuse asks for no tile)
            if not kernels.has_qkv(fmt, rope, (nq, nkv), kv, s["residual"] is not None, k, qkn, tile_m):
                E.bad(f"no qkv kernel {fmt} rope={rope} heads={nq}x{nkv} kv={kv} hidden={k} qk_norm={qkn} "
                      f"M={m}", LOOKUP)  # fmt: skip
        return E
    # qk_norm_rope_cache: its kernel does not depend on the head counts (nor on a hidden size)
    n = (nq + 2 * nkv) * D if proper else -1
    _check_tensor(E, "qkv", s["qkv"], ("bf16",), (m, n))
    rope, kv, qkn = _check_qk(E, s, m, nkv if proper else 1)
    if kv is not None and qkn is not None:
        if not kernels.has("qk_norm_rope_cache", rope=rope, kv_cache_dtype=kv, qk_norm=qkn):
            E.bad(f"no qk_norm_rope_cache kernel rope={rope} kv={kv} qk_norm={qkn}", LOOKUP)
    if proper and (nq, nkv) not in kernels.qkv_heads():
        E.maybe("head counts the fused op's bundle does not have (the unfused kernel takes any)")
    return E


# ============================================================================= weights (cached)
def weight_view_props(w, k: int = HIDDEN) -> dict:
    """shape / stride / offset / dtype of the weight view a weight_arg asks for at hidden size k (offsets in
    elements)."""
    fmt, n = w["fmt"], w["rows"]
    cols = k if fmt == "bf16" else k // 2
    dtype = "bf16" if fmt == "bf16" else "u8"
    p = dict(shape=(n, cols), stride=(cols, 1), offset=0, dtype=dtype)
    v = w["view"]
    if v == "misalign":
        p["offset"] = 1
    elif v == "transpose":
        p["stride"] = (1, max(n, 1))
    elif v == "expand":
        p["stride"] = (0, 1)
    elif v == "dtype":
        p["dtype"] = "f16" if fmt == "bf16" else "i8"
    elif v == "short":
        p["shape"] = (max(n - 16, 0), cols)
    return p


def wscale_view_props(ws, rows, k: int = HIDDEN) -> dict:
    npad, cols = -(-rows // 128) * 128, k // 16
    p = dict(shape=(npad, cols), stride=(cols, 1), offset=0, dtype="e4m3", dev="home")
    v = ws["view"]
    if v == "u8":
        p["dtype"] = "u8"
    elif v == "offset4":
        p["offset"] = 4
    elif v == "misalign":
        p["offset"] = 1
    elif v == "short":
        p["shape"] = (npad - 128, cols) if npad >= 128 else (npad, cols // 2)  # (fits in the buffer)
    elif v == "transpose":
        p["stride"] = (1, max(npad, 1))
    elif v == "dtype":
        p["dtype"] = "i8"
    elif v == "device":
        p["dev"] = "cpu"
    return p


@dataclass
class WeightEntry:
    """One random weight of (format, rows, hidden size) on one device, carved out of guard buffers once and
    reused by every example (their bytes are checked after every example against their state at creation)."""

    fmt: str
    rows: int
    w: Guarded
    scales: Guarded | None
    gs: float
    dense: torch.Tensor | None = None
    wview: torch.Tensor | None = None
    sview: torch.Tensor | None = None
    k: int = HIDDEN


class Env:
    """Where examples run: the loader (real, or a fake on the CPU), the devices, the kernels, the caches."""

    def __init__(self, loader, kernels: Kernels, device, other=None, sync=True, counts=None):
        self.loader = loader
        self.kernels = kernels
        self.device = torch.device(device)
        self.other = torch.device(other) if other is not None else None
        self.sync = sync
        self.counts = COUNTS if counts is None else counts
        self.weights: dict = {}
        self.tables: dict = {}
        self.broken: str | None = None

    def dev(self, where: str, home: torch.device) -> torch.device:
        if where == "home":
            return home
        if where == "cpu":
            return torch.device("cpu")
        if where == "other":
            if self.other is None:
                raise ValueError("example asks for another CUDA device; there is none")
            return self.device if home == self.other else self.other
        raise ValueError(where)

    def home_of(self, s) -> torch.device:
        if s["home"] == 0 or self.other is None:
            return self.device
        return self.other

    def weight(self, fmt: str, rows: int, dev: torch.device, k: int = HIDDEN) -> WeightEntry:
        key = (fmt, rows, str(dev)) if k == HIDDEN else (fmt, rows, str(dev), k)
        e = self.weights.get(key)
        if e is not None:
            return e
        g = torch.Generator(device=dev).manual_seed(1000 + rows)
        w = torch.randn(rows, k, device=dev, generator=g) * 0.03
        if k != HIDDEN:
            w *= (HIDDEN / k) ** 0.5  # (q/k/v of the same scale at any K, as tests.helpers.make_case)
        w = w.bfloat16()
        if fmt == "bf16":
            wv, wg = carve((rows, k), torch.bfloat16, dev, data=w)
            e = WeightEntry(fmt, rows, wg, None, 1.0, wview=wv, k=k)
        else:
            if rows:
                packed, scales, gs = nvfp4.quantize(w)
                gsv = float(gs.reshape(-1)[0])
            else:
                packed = torch.zeros(0, k // 2, dtype=torch.uint8, device=dev)
                scales = torch.zeros(0, k // 16, dtype=torch.float8_e4m3fn, device=dev)
                gsv = 1.0
            wv, wg = carve(packed.shape, torch.uint8, dev, data=packed)
            sv, sg = carve(scales.shape, torch.float8_e4m3fn, dev, data=scales.view(torch.uint8))
            e = WeightEntry(fmt, rows, wg, sg, gsv, wview=wv, sview=sv, k=k)
        for gb in (e.w, e.scales):
            if gb is not None:
                gb.snapshot()
        self.weights[key] = e
        return e

    def dense(self, e: WeightEntry) -> torch.Tensor:
        if e.dense is None:
            if e.fmt == "bf16":
                e.dense = e.wview.double()
            else:
                gs = torch.tensor([e.gs], dtype=torch.float32, device=e.wview.device)
                e.dense = nvfp4.dequantize(e.wview, e.sview, gs)
        return e.dense

    def table(self, max_pos: int) -> torch.Tensor:
        if max_pos not in self.tables:
            self.tables[max_pos] = make_cos_sin_cache(max_pos)
        return self.tables[max_pos]


class Ctx:
    """One materialized example: the call's arguments, the buffers to check, the values for the reference."""

    def __init__(self):
        self.args: dict = {}
        self.inputs: list[tuple[str, Guarded]] = []
        self.caches: list[Guarded] = []
        self.weights: list[WeightEntry] = []
        self.k = self.v = None
        self.kg = self.vg = None
        self.dense = None

    def guarded(self):
        return [g for _, g in self.inputs] + self.caches

    def snapshot(self):
        for g in self.guarded():
            g.snapshot()

    def assert_inputs_unchanged(self):
        for name, g in self.inputs:
            g.assert_unchanged(f"input {name} or its guard band")
        for e in self.weights:
            e.w.assert_unchanged(f"the {e.fmt} weight ({e.rows} rows) or its guard band")
            if e.scales is not None:
                e.scales.assert_unchanged("the NVFP4 block scales or their guard band")

    def assert_all_unchanged(self):
        self.assert_inputs_unchanged()
        for g in self.caches:
            g.assert_unchanged("a KV cache (rejected call)")


def _data(env: Env, fill, shape, gen: torch.Generator, values=None):
    """Values for a tensor argument (float64 or int64 on the CPU; carve casts and moves them)."""
    kind = fill[0]
    if kind == "ints":
        n = _numel(shape)
        v = list(values[:n]) + [0] * max(0, n - len(values))
        return torch.tensor(v, dtype=torch.int64).reshape(shape)
    if kind == "table" and tuple(shape) == (fill[1], D):
        return env.table(fill[1])
    if kind in ("randn", "table"):
        scale, bias = fill[1:] if kind == "randn" else (1.0, 0.0)
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale + bias
    raise ValueError(f"unknown fill {fill!r}")


def _tensor(env, ctx, name, a, home, gen, values=None):
    if a is None:
        return None
    if "py" in a:
        return a["py"]
    dev = env.dev(a["dev"], home)
    data = _data(env, a["fill"], a["shape"], gen, values)
    v, g = carve(a["shape"], DT[a["dtype"]], dev, stride=a["stride"], offset=a["offset"], data=data)
    ctx.inputs.append((name, g))
    return v


def _scalar_tensor(env, ctx, name, a, home, value):
    if a is None:
        return None
    if "py" in a:
        return a["py"]
    dev = env.dev(a["dev"], home)
    v, g = carve(
        a["shape"], DT[a["dtype"]], dev, offset=a["offset"], data=torch.tensor(value, dtype=torch.float64)
    )
    ctx.inputs.append((name, g))
    return v


def _weights(env, ctx, s, home):
    w, k = s["weight"], hidden_of(s)
    if w["view"] == "py":
        ctx.args["weight"] = 1.0
    else:
        p = weight_view_props(w, k)
        dt = DT[p["dtype"]]
        if w["dev"] != "home":  # on another device: contents never read
            ctx.args["weight"] = torch.empty(p["shape"], dtype=dt, device=env.dev(w["dev"], home))
        else:
            e = env.weight(w["fmt"], w["rows"], home, k)
            ctx.weights.append(e)
            ctx.dense = e
            base = e.wview
            ctx.args["weight"] = e.w.view(base.dtype, p["shape"], p["stride"], p["offset"]).view(dt)
    ws, gs = s["weight_scale"], s["global_scale"]
    rows = w["rows"]
    if ws is None:
        ctx.args["weight_scale"] = None
    elif ws["view"] == "py":
        ctx.args["weight_scale"] = 1.0
    else:
        e = env.weight("nvfp4", rows, home, k)
        if e not in ctx.weights:
            ctx.weights.append(e)
        p = wscale_view_props(ws, rows, k)
        if p["dev"] != "home":  # on another device: contents never read
            ctx.args["weight_scale"] = torch.empty(
                p["shape"], dtype=torch.uint8, device=env.dev(p["dev"], home)
            )
        elif ws["view"] == "offset4":
            v, g = carve(p["shape"], torch.uint8, home, offset=4, data=e.sview.view(torch.uint8))
            ctx.inputs.append(("weight_scale", g))
            ctx.args["weight_scale"] = v.view(torch.float8_e4m3fn)
        else:
            ctx.args["weight_scale"] = e.scales.view(torch.uint8, p["shape"], p["stride"], p["offset"]).view(
                DT[p["dtype"]]
            )
    if gs is None:
        ctx.args["global_scale"] = None
    else:
        value = env.weight("nvfp4", rows, home, k).gs if w["fmt"] == "nvfp4" else 1.0
        ctx.args["global_scale"] = _scalar_tensor(env, ctx, "global_scale", gs, home, value)


def _caches(env, ctx, s, home):
    """Both caches, carved out of one or two Guarded buffers (poison: NaN in every cache dtype)."""
    c = s["caches"]
    cv = cache_views(c)
    esize = max(ESIZE[c["dtype"]], ESIZE[c["vdtype"]])
    bufs = [Guarded(n_el * esize, env.dev(where, home)) for n_el, where in cv["bufs"]]
    ctx.caches.extend(bufs)
    views = []
    for key in ("k", "v"):
        b, shape, stride, off, dtname, _ = cv[key]
        views.append((bufs[b].view(DT[dtname], shape, stride, off), bufs[b]))
    (ctx.k, ctx.kg), (ctx.v, ctx.vg) = views
    ctx.args["k_cache"], ctx.args["v_cache"] = ctx.k, ctx.v


def materialize(env: Env, s: dict) -> Ctx:
    ctx = Ctx()
    home = env.home_of(s)
    gen = torch.Generator().manual_seed(s["seed"])
    a = ctx.args
    op = s["op"]
    if op != "qk_norm_rope_cache":
        a["x"] = _tensor(env, ctx, "x", s["x"], home, gen)
    if op in ("rms_norm", "fused_add_rms_norm"):
        if op == "fused_add_rms_norm":
            a["residual"] = _tensor(env, ctx, "residual", s["residual"], home, gen)
        a["weight"] = _tensor(env, ctx, "weight", s["weight"], home, gen)
        a["eps"] = s["eps"]
        return ctx
    if op == "gemv":
        _weights(env, ctx, s, home)
        return ctx
    if op == "qkv":
        a["residual"] = _tensor(env, ctx, "residual", s["residual"], home, gen)
        a["norm_weight"] = _tensor(env, ctx, "norm_weight", s["norm_weight"], home, gen)
        a["eps"] = s["eps"]
        _weights(env, ctx, s, home)
    else:
        a["qkv"] = _tensor(env, ctx, "qkv", s["qkv"], home, gen)
    a["q_norm_weight"] = _tensor(env, ctx, "q_norm_weight", s["q_norm_weight"], home, gen)
    a["k_norm_weight"] = _tensor(env, ctx, "k_norm_weight", s["k_norm_weight"], home, gen)
    a["qk_eps"] = s["qk_eps"]
    cs = s["cos_sin_cache"]
    if cs == "placeholder":
        a["cos_sin_cache"] = env.loader.no_rope_table(home)
    else:
        a["cos_sin_cache"] = _tensor(env, ctx, "cos_sin_cache", cs, home, gen)
    a["positions"] = _tensor(env, ctx, "positions", s["positions"], home, gen, s["pos_values"])
    _caches(env, ctx, s, home)
    a["slot_mapping"] = _tensor(env, ctx, "slot_mapping", s["slot_mapping"], home, gen, s["slot_values"])
    a["num_q_heads"], a["num_kv_heads"] = s["heads"]
    for name in ("k_scale", "v_scale"):
        sc = s[name]
        a[name] = _scalar_tensor(env, ctx, name, sc, home, sc["value"] if sc and "py" not in sc else 0.0)
    return ctx


# ============================================================================= running and checking
def _outcome_name(err) -> str:
    for t in REJECT:
        if isinstance(err, t):
            return t.__name__
    return type(err).__name__


def _fresh(t, shape, home, what):
    assert isinstance(t, torch.Tensor), f"{what} is a {type(t).__name__}, not a tensor"
    assert tuple(t.shape) == tuple(shape), f"{what} has shape {list(t.shape)}, expected {list(shape)}"
    assert t.dtype == torch.bfloat16, f"{what} is {t.dtype}, expected bf16"
    assert t.device == home, f"{what} is on {t.device}, expected {home}"


def run_example(env: Env, s: dict):
    """Materialize, call, check one example; raises AssertionError describing what is wrong."""
    op = s["op"]
    if env.broken:
        raise AssertionError(f"the device context was already broken by an earlier example: {env.broken}")
    E = expect(s, env.kernels)
    ctx = materialize(env, s)
    ctx.snapshot()
    home = env.home_of(s)
    if env.sync:
        torch.cuda.synchronize(home)
    fn = getattr(env.loader, FN[op])
    err = out = None
    try:
        with env.loader.launch_options(pdl=s["pdl"], bounds_check=s["checked"]):
            out = fn(**ctx.args)
    except Exception as e:  # judged below
        err = e
    if env.sync:
        try:
            for d in {home} | ({env.other} if env.other is not None else set()):
                torch.cuda.synchronize(d)
        except Exception as e:
            env.broken = f"{s!r} ({type(e).__name__}: {e})"
            raise AssertionError(f"the device context is broken after this example: {e}") from e
    if err is not None:
        if isinstance(err, (KeyError, IndexError)) or not isinstance(err, REJECT):
            raise AssertionError(f"{op} raised {type(err).__name__} (not TypeError/ValueError/LookupError): "
                                 f"{err}; expected {E}") from err  # fmt: skip
        if not E.may_reject:
            raise AssertionError(f"{op} rejected a valid example: {type(err).__name__}: {err}") from err
        allowed = E.allowed()
        if not isinstance(err, tuple(allowed)):
            raise AssertionError(f"{op} raised {type(err).__name__}: {err}; expected one of "
                                 f"{sorted(t.__name__ for t in allowed)} for {E}") from err  # fmt: skip
        if isinstance(err, LookupError) and "build" not in str(err).lower():
            raise AssertionError(f"a LookupError must say how to rebuild the bundle: {err}")
        ctx.assert_all_unchanged()
        env.counts[op][_outcome_name(err)] += 1
        return
    if E.must_reject:
        raise AssertionError(f"{op} accepted an invalid example: {E}")
    CHECKS[op](env, s, E, ctx, out, home)
    ctx.assert_inputs_unchanged()
    env.counts[op]["result checked" if E.check_values else "accepted, values not compared"] += 1


def _check_rows(got, ref, what, nan_rows=(), heads=False):
    """got [M, ...] bf16 against the float64 reference: rows in nan_rows all NaN, the others NaN-free and
    within 1e-2 relative Frobenius error; with heads (got [M, heads, 128]), every element of them within
    ELEMENT_TOL of its head's RMS too."""
    m = got.shape[0]
    good = [t for t in range(m) if t not in nan_rows]
    for t in nan_rows:
        assert got[t].isnan().all(), f"{what}: token {t} (position outside the table) must be NaN"
    if good:
        g, r = got[good], ref[good].to(got.device)
        assert not g.isnan().any(), f"{what}: NaN in tokens {good}"
        e = rel(g, r)
        assert e < 1e-2, f"{what}: relative error {e:.3g}"
        if heads:
            assert_elements_close(g, r, what)


def _check_norms(env, s, E, ctx, out, home):
    x, w = ctx.args["x"], ctx.args["weight"]
    m = s["m"]
    if s["op"] == "rms_norm":
        xn, res_out, res = out, None, None
    else:
        assert isinstance(out, tuple) and len(out) == 2, f"fused_add_rms_norm returned {type(out).__name__}"
        xn, res_out = out
        res = ctx.args["residual"]
        _fresh(res_out, (m, x.shape[1]), home, "residual_out")
        assert torch.equal(res_out, (x.float() + res.float()).bfloat16()), (
            "residual_out != bf16(x + residual)"
        )
    _fresh(xn, (m, x.shape[1]), home, "xn")
    if E.check_values:
        ref, _ = rms_norm_ref(x, res, w, float(s["eps"]))
        _check_rows(xn, ref.double(), "xn")
        assert_xn_close(xn, x, res, w, float(s["eps"]))


def _check_gemv(env, s, E, ctx, out, home):
    x, w = ctx.args["x"], ctx.args["weight"]
    n = w.shape[0]
    _fresh(out, (s["m"], n), home, "y")
    if E.check_values:
        dense = env.dense(ctx.dense)[:n]
        ref = gemv_ref(x, dense)
        _check_rows(out, ref, "y")
        assert_gemv_close(out, x, dense, ref, "y")


def _bad_tokens(s, ctx, m):
    cs = ctx.args["cos_sin_cache"]
    if cs is None:
        return set(), None
    max_pos = cs.shape[0]
    bad = {t for t, p in enumerate(s["pos_values"][:m]) if not 0 <= p < max_pos}
    clamped = torch.tensor([min(max(p, 0), max_pos - 1) for p in s["pos_values"][:m]], dtype=torch.int64)
    return bad, clamped.to(cs.device)


def _check_qkv(env, s, E, ctx, out, home):
    assert isinstance(out, tuple) and len(out) == 2, f"flint_qkv_fused returned {type(out).__name__}"
    q, res_out = out
    a = ctx.args
    m, (nq, nkv) = s["m"], s["heads"]
    _fresh(q, (m, nq * D), home, "q")
    x, res = a["x"], a["residual"]
    if res is None:
        assert res_out is x or (res_out.data_ptr() == x.data_ptr() and res_out.shape == x.shape), (
            "residual_out must be x itself without a residual"
        )
    else:
        _fresh(res_out, (m, x.shape[1]), home, "residual_out")
        assert torch.equal(res_out, (x.float() + res.float()).bfloat16()), (
            "residual_out != bf16(x + residual)"
        )
    bad, pos = _bad_tokens(s, ctx, m)
    ref = None
    if E.check_values:
        pos = pos if pos is not None else a["positions"]
        ref = qkv_fused_ref(x, res, a["norm_weight"], float(s["eps"]), env.dense(ctx.dense),
                            a["q_norm_weight"], a["k_norm_weight"], float(s["qk_eps"]), a["cos_sin_cache"],
                            pos, nq, nkv)  # fmt: skip
        _check_rows(q.view(m, nq, D), ref["q"], "q", bad, heads=True)
    _verify_caches(env, s, E, ctx, m, nkv, ref, bad)


def _check_qk_op(env, s, E, ctx, out, home):
    a = ctx.args
    m, (nq, nkv) = s["m"], s["heads"]
    _fresh(out, (m, nq * D), home, "q")
    bad, pos = _bad_tokens(s, ctx, m)
    ref = None
    if E.check_values:
        pos = pos if pos is not None else a["positions"]
        rq, rk, rv = qk_norm_rope_ref(a["qkv"], a["q_norm_weight"], a["k_norm_weight"], float(s["qk_eps"]),
                                      a["cos_sin_cache"], pos, nq, nkv)  # fmt: skip
        ref = {"q": rq, "k": rk, "v": rv}
        _check_rows(out.view(m, nq, D), rq, "q", bad, heads=True)
    _verify_caches(env, s, E, ctx, m, nkv, ref, bad)


def _verify_caches(env, s, E, ctx, m, nkv, ref, bad):
    """Only the mapped slots changed; there, the reference's k (NaN for a token in `bad`) and v."""
    k, v = ctx.k, ctx.v
    nb, bs = k.shape[0], k.shape[1]
    mapped = [(t, sl) for t, sl in enumerate(effective_slots(s)[:m]) if 0 <= sl < nb * bs]
    seen = Counter(sl for _, sl in mapped)
    allowed = {id(g): torch.zeros(g.size // k.element_size(), dtype=torch.bool, device=k.device)
               for g in ctx.caches}  # fmt: skip
    for view, g in ((k, ctx.kg), (v, ctx.vg)):
        idx = element_index(view, g)
        for _, sl in mapped:
            allowed[id(g)][idx[sl // bs, sl % bs].flatten()] = True
    for g in ctx.caches:
        changed = g.changed_elements(k.dtype)
        outside = changed & ~allowed[id(g)]
        if outside.any():
            first = outside.nonzero().flatten()[0].item()
            raise AssertionError(
                f"cache memory outside the mapped slots was written ({int(outside.sum())} elements; first at "
                f"element {first} of a buffer; mapped (token, slot) {mapped})"
            )
    if ref is None:
        return
    fp8 = k.dtype in (torch.float8_e4m3fn, torch.uint8)
    scales = [float(ctx.args[n].reshape(-1)[0]) for n in ("k_scale", "v_scale")] if fp8 else [None, None]
    got = {"k": [], "v": []}
    want = {"k": [], "v": []}
    for t, sl in mapped:
        if seen[sl] > 1:
            continue  # duplicate slots: a caller error with no defined winner (only the write set is checked)
        b, o = divmod(sl, bs)
        for name, view, scale in (("k", k, scales[0]), ("v", v, scales[1])):
            gv = as_float(view[b, o])
            r = ref[name][t].reshape(nkv, D)
            if name == "k" and t in bad:
                assert gv.isnan().all(), f"k of token {t} (position outside the table) must be NaN"
                continue
            if fp8:
                ok = fp8_close(gv, r.to(gv.device), scale)
                assert ok.all(), f"{name}_cache slot {sl} (token {t}): {int((~ok).sum())} e4m3 values off"
            else:
                got[name].append(gv)
                want[name].append(r)
    for name in ("k", "v"):
        if got[name]:
            g, r = torch.stack(got[name]), torch.stack(want[name])
            assert not g.isnan().any(), f"{name}_cache: a mapped slot holds NaN"
            e = rel(g, r.to(g.device))
            assert e < 1e-2, f"{name}_cache: relative error {e:.3g}"
            assert_elements_close(g, r.to(g.device), f"{name}_cache")


CHECKS = {"qkv": _check_qkv, "qk_norm_rope_cache": _check_qk_op, "gemv": _check_gemv,
          "rms_norm": _check_norms, "fused_add_rms_norm": _check_norms}  # fmt: skip

"""The YAML variant matrix: loading, validation and expansion into specializations.

    archs: [sm_90a, sm_100a]
    hidden: [2048]              # optional, default [2048]: the model's hidden sizes (K)
    norm:                       # input RMSNorm, for every hidden size
      residual: [true, false]
    qkv:                        # fused qkv GEMV
      weight_format: [bf16, nvfp4]
      rope: [true, false]
      heads: [[32, 4], [16, 8]] # (num_q_heads, num_kv_heads): for every hidden size; [q, kv, hidden]: for one
      qk_norm: [true]                    # optional, default [true]; false: Llama's numerics
      kv_cache_dtype: [bf16, fp8_e4m3]   # optional, default [bf16]
      norm: [separate, prologue]         # optional, default [separate]
      max_m: [8, 16, 32, 64]             # optional, default all: token tiles (64 required)
    gemv:                       # for every hidden size
      weight_format: [bf16, nvfp4]
      max_m: [8, 16, 32, 64]             # optional, as qkv.max_m
    plugins:                    # your own kernels (docs/plugins.md)
      silu_mul:                          # the kind: a name of your own, not a built-in kind
        module: silu_mul.kernel          # importable (the config file's folder is searched last)
        class: SiluMulKernel             # optional: default the module's KERNEL
        spec: {intermediate: [6144]}     # axes; their product is the variant matrix (axes sorted by name)

Every error names the file, the key path, the offending value and what is accepted. What only importing a
plugin's module can tell (does it import, is its class a flint_aot.Kernel, does it accept each spec) is
checked by flint_aot.plugins, in a subprocess, before anything compiles.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from loader import abi
from loader.abi import KINDS, KV_CACHE_DTYPES, M_TILES, MAX_M, NORM_MODES, WEIGHT_FORMATS

ARCHS = tuple(abi.ARCH_CC)
MAX_HEADS = 128
# diagnostics.norm_spin_cycles: a diagnostic build of the norm kernel that busy-waits this many clock cycles
# before writing xn (a slow producer; proves that the qkv kernel waits for it). Never for serving.
MAX_SPIN = 1 << 31
DIAGNOSTIC_CLUSTER_POLICIES = ("default", "spread", "load_balancing")
_IDENT = re.compile(r"[a-z][a-z0-9_]*\Z")  # a plugin's kind and spec axes
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")
_TOKEN = re.compile(r"[A-Za-z0-9_]+\Z")  # a plugin spec's string value (it becomes part of file names)
MAX_NAME = 120  # a specialization's name: the cubin's file name and entry symbol derive from it


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Specialization:
    kind: str
    name: str  # unique per arch, also the cubin's base name and entry prefix
    spec: dict
    arch: str
    plugin: tuple = ()  # a plugin's (module, class attribute): compiled from that module's class
    # the config's diagnostics (built-in kinds only): what a diagnostic build asks of the kernels
    diagnostics: tuple = ()  # ((key, value), ...), sorted

    @property
    def label(self) -> str:
        return f"{self.name}@{self.arch}"


def spec_name(kind: str, spec: dict) -> str:
    try:
        return abi.spec_name(kind, spec)
    except ValueError as e:
        raise ConfigError(str(e)) from None


class _Checker:
    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, value, accepted: str):
        raise ConfigError(f"{self.source}: {path}: got {value!r}; accepted: {accepted}")

    def mapping(self, d, path: str, allowed: dict[str, bool]) -> dict:
        """allowed: key -> required."""
        if not isinstance(d, dict):
            self.fail(path or "<top level>", d, "a mapping with keys " + ", ".join(allowed))
        for k in d:
            if k not in allowed:
                self.fail(f"{path}.{k}".lstrip("."), k, "known keys " + ", ".join(allowed))
        for k, required in allowed.items():
            if required and k not in d:
                raise ConfigError(f"{self.source}: {(path + '.' + k).lstrip('.')}: missing (required)")
        return d

    def max_tokens(self, v, path: str, hidden=(abi.HIDDEN,)) -> int:
        """The most tokens a call of an unfused norm or per-head op may have: at least the fused op's MAX_M
        (its two-kernel design runs the norm kernel), at most what the kernels' grids and offsets hold at the
        config's largest hidden size."""
        limit = abi.tokens_limit(max(hidden))
        if isinstance(v, bool) or not isinstance(v, int) or not MAX_M <= v <= limit:
            self.fail(path, v, f"an integer in {MAX_M}..{limit} (default {min(abi.MAX_TOKENS, limit)})")
        return v

    def hidden(self, v, path: str) -> list:
        """The config's hidden sizes: each one the norm kernel can be built for (the other kinds are checked
        where they are asked for)."""
        v = self.nonempty_unique_list(v, path, "hidden sizes, e.g. [2048]")
        for i, k in enumerate(v):
            why = abi.hidden_refusal("norm", k)
            if why:
                self.fail(f"{path}[{i}]", k, why)
        return v

    def nonempty_unique_list(self, v, path: str, accepted: str) -> list:
        if not isinstance(v, list) or not v:
            self.fail(path, v, f"a non-empty list of {accepted}")
        seen = []
        for i, item in enumerate(v):
            if item in seen:
                self.fail(f"{path}[{i}]", item, f"each value once ({accepted})")
            seen.append(item)
        return v

    def choices(self, v, path: str, options: tuple) -> list:
        accepted = " | ".join(map(str, options))
        v = self.nonempty_unique_list(v, path, accepted)
        for i, item in enumerate(v):
            if not isinstance(item, str) or item not in options:
                self.fail(f"{path}[{i}]", item, accepted)
        return v

    def bools(self, v, path: str) -> list:
        v = self.nonempty_unique_list(v, path, "true | false")
        for i, item in enumerate(v):
            if not isinstance(item, bool):
                self.fail(f"{path}[{i}]", item, "true | false")
        return v

    def tiles(self, v, path: str) -> list:
        accepted = " | ".join(map(str, M_TILES))
        v = self.nonempty_unique_list(v, path, accepted)
        for i, item in enumerate(v):
            if isinstance(item, bool) or item not in M_TILES:
                self.fail(f"{path}[{i}]", item, accepted)
        if MAX_M not in v:  # (calls above the largest tile could not run)
            self.fail(path, v, f"a list holding {MAX_M}: the tile that serves M up to {MAX_M}")
        return sorted(v)

    def heads(self, v, path: str, hidden: list) -> list:
        """[q, kv] pairs (for every hidden size of the config) or [q, kv, hidden] (for that one, which the
        config's `hidden` must list), as [q, kv, hidden] triples, one per (heads, hidden size)."""
        what = ("[num_q_heads, num_kv_heads] pairs of positive integers, q a multiple of kv, or "
                "[num_q_heads, num_kv_heads, hidden] for one hidden size of `hidden`")  # fmt: skip
        v = self.nonempty_unique_list(v, path, what)
        out = []
        for i, item in enumerate(v):
            p = f"{path}[{i}]"
            if not (isinstance(item, list) and len(item) in (2, 3)):
                self.fail(p, item, what)
            if len(item) == 3 and (item[2] not in hidden or isinstance(item[2], bool)):
                self.fail(f"{p}[2]", item[2], f"a hidden size of `hidden` ({', '.join(map(str, hidden))})")
            q, kv = item[:2]
            for j, n in enumerate(item[:2]):
                if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_HEADS:
                    self.fail(f"{p}[{j}]", n, f"an integer in 1..{MAX_HEADS}")
            if q % kv:
                self.fail(p, item, f"num_q_heads a multiple of num_kv_heads ({q} % {kv} = {q % kv})")
            for k in item[2:] or hidden:
                if [q, kv, k] in out:
                    self.fail(p, item, f"each (heads, hidden) once: [{q}, {kv}] at hidden {k} is given twice")
                out.append([q, kv, k])
        return out


def validate(raw, source: str = "<config>") -> dict:
    """Check a parsed config and return it normalized (plain lists, canonical order of keys)."""
    c = _Checker(source)
    c.mapping(raw, "", {"archs": True, "hidden": False, **{k: False for k in KINDS}, "plugins": False,
                        "diagnostics": False})  # fmt: skip
    out = {"archs": list(c.choices(raw["archs"], "archs", ARCHS))}
    hidden = list(c.hidden(raw.get("hidden", [abi.HIDDEN]), "hidden"))
    if "hidden" in raw:
        out["hidden"] = hidden
    if "norm" in raw:
        n = c.mapping(raw["norm"], "norm", {"residual": True, "max_tokens": False})
        out["norm"] = {"residual": list(c.bools(n["residual"], "norm.residual"))}
        if "max_tokens" in n:
            out["norm"]["max_tokens"] = c.max_tokens(n["max_tokens"], "norm.max_tokens", hidden)
    if "qkv" in raw:
        q = c.mapping(raw["qkv"], "qkv", {"weight_format": True, "rope": True, "heads": True,
                                          "qk_norm": False, "kv_cache_dtype": False, "norm": False,
                                          "max_m": False})  # fmt: skip
        out["qkv"] = {
            "weight_format": list(c.choices(q["weight_format"], "qkv.weight_format", WEIGHT_FORMATS)),
            "rope": list(c.bools(q["rope"], "qkv.rope")),
            "heads": c.heads(q["heads"], "qkv.heads", hidden),
            "qk_norm": list(c.bools(q.get("qk_norm", [True]), "qkv.qk_norm")),
            "kv_cache_dtype": list(c.choices(q.get("kv_cache_dtype", ["bf16"]), "qkv.kv_cache_dtype",
                                             KV_CACHE_DTYPES)),
            "norm": list(c.choices(q.get("norm", ["separate"]), "qkv.norm", NORM_MODES)),
            "max_m": c.tiles(q.get("max_m", list(M_TILES)), "qkv.max_m"),
        }  # fmt: skip
        _buildable(c, "qkv", sorted({h[2] for h in out["qkv"]["heads"]}), out["qkv"]["norm"])
    if "gemv" in raw:
        g = c.mapping(raw["gemv"], "gemv", {"weight_format": True, "max_m": False})
        fmts = c.choices(g["weight_format"], "gemv.weight_format", WEIGHT_FORMATS)
        tiles = c.tiles(g.get("max_m", list(M_TILES)), "gemv.max_m")
        out["gemv"] = {"weight_format": list(fmts), "max_m": tiles}
        _buildable(c, "gemv", hidden)
    if "qk_norm_rope_cache" in raw:
        g = c.mapping(raw["qk_norm_rope_cache"], "qk_norm_rope_cache",
                      {"rope": True, "qk_norm": False, "kv_cache_dtype": False,
                       "max_tokens": False})  # fmt: skip
        out["qk_norm_rope_cache"] = {
            "rope": list(c.bools(g["rope"], "qk_norm_rope_cache.rope")),
            "qk_norm": list(c.bools(g.get("qk_norm", [True]), "qk_norm_rope_cache.qk_norm")),
            "kv_cache_dtype": list(c.choices(g.get("kv_cache_dtype", ["bf16"]),
                                             "qk_norm_rope_cache.kv_cache_dtype", KV_CACHE_DTYPES)),
        }  # fmt: skip
        if "max_tokens" in g:
            limit = c.max_tokens(g["max_tokens"], "qk_norm_rope_cache.max_tokens", hidden)
            out["qk_norm_rope_cache"]["max_tokens"] = limit
    if "plugins" in raw:
        out["plugins"] = _plugins(c, raw["plugins"])
    if not any(k in out for k in (*KINDS, "plugins")):
        raise ConfigError(
            f"{source}: <top level>: no kernels requested; accepted: one or more of the sections "
            + ", ".join((*KINDS, "plugins"))
        )
    _servable(out, source)
    if "plugins" in out:
        _unique_names(out, source)
    if "diagnostics" in raw:
        d = _diagnostics(c, raw["diagnostics"])
        if d:
            out["diagnostics"] = d
    return out


def _buildable(c: _Checker, kind: str, hidden: list, norms=("separate",)) -> None:
    """Refuse a hidden size that this kind's kernels (in these designs) cannot be built for."""
    for k in hidden:
        for norm in norms:
            why = abi.hidden_refusal(kind, k, norm)
            if why:
                where = "hidden" if kind == "gemv" else f"{kind}.heads"
                c.fail(where, k, f"{why} ({kind}" + (f", norm: {norm})" if kind == "qkv" else ")"))


def _plugins(c: _Checker, raw) -> dict:
    """plugins: {kind: {module, class (optional), spec: {axis: [values]} (optional)}}, checked without
    importing anything."""
    if not isinstance(raw, dict) or not raw:
        c.fail("plugins", raw, "a mapping of kinds to {module: ..., class: ..., spec: {axis: [values]}}")
    out = {}
    for kind, p in raw.items():
        path = f"plugins.{kind}"
        if kind in KINDS:
            raise ConfigError(f"{c.source}: {path}: {kind!r} is a built-in kind ({', '.join(KINDS)}); give "
                              "your kernel a kind name of its own")  # fmt: skip
        if not isinstance(kind, str) or not _IDENT.match(kind):
            c.fail(path, kind, "a kind named in lower case: a letter, then letters, digits or _")
        c.mapping(p, path, {"module": True, "class": False, "spec": False})
        if not isinstance(p["module"], str) or not _MODULE.match(p["module"]):
            c.fail(f"{path}.module", p["module"], "an importable module name, e.g. mypkg.kernels")
        if "class" in p and (not isinstance(p["class"], str) or not p["class"].isidentifier()):
            c.fail(f"{path}.class", p["class"], "the name of the module's kernel class")
        spec = p.get("spec", {})
        if not isinstance(spec, dict):
            c.fail(f"{path}.spec", spec, "a mapping of axes to lists of values, e.g. {size: [1024, 2048]}")
        axes = {}
        for axis, values in spec.items():
            where = f"{path}.spec.{axis}"
            if not isinstance(axis, str) or not _IDENT.match(axis):
                c.fail(where, axis, "an axis named in lower case: a letter, then letters, digits or _")
            what = "true | false | integers | strings of letters, digits and _ | lists of integers or strings"
            for i, v in enumerate(c.nonempty_unique_list(values, where, what)):
                if not (_value(v) or isinstance(v, list) and v and all(_value(x, bool) for x in v)):
                    c.fail(f"{where}[{i}]", v, what)
            axes[axis] = list(values)
        # the axes in alphabetical order, the one order of a spec's axes (the manifest records the config
        # with sorted keys; names, expansion and `flint-aot verify` must not depend on the file's order)
        axes = {axis: axes[axis] for axis in sorted(axes)}
        out[kind] = {"module": p["module"], **({"class": p["class"]} if "class" in p else {}), "spec": axes}
    return out


def _value(v, refused=()) -> bool:
    """v is a plugin spec value: a bool, an int or a string of letters, digits and _ (not of `refused`)."""
    return not isinstance(v, refused) and (isinstance(v, int) or isinstance(v, str) and bool(_TOKEN.match(v)))


def _unique_names(config: dict, source: str) -> None:
    """Every specialization has a name of its own (its cubin's file name), of at most MAX_NAME characters."""
    seen: dict[str, Specialization] = {}
    for s in expand(config):
        other = seen.setdefault(s.name, s)
        if s.arch == other.arch and s is not other or len(s.name) > MAX_NAME:
            what = f"{len(s.name)} characters long" if s is other else f"also {other.kind} {other.spec}'s"
            raise ConfigError(f"{source}: plugins.{s.kind}: the name of {s.kind} {s.spec}, {s.name!r}, is "
                              f"{what}; names must be unique and at most {MAX_NAME} characters: rename the "
                              "kind or the axis, or change the values")  # fmt: skip


def plugin_spec_name(kind: str, spec: dict) -> str:
    """A plugin specialization's name: the kind, then each axis in alphabetical order (sorted: whatever the
    order of the config's or the manifest's keys) and its value (lists joined by x)."""
    tok = lambda v: ("x".join(map(tok, v)) if isinstance(v, list) else str(int(v)) if isinstance(v, bool)  # noqa: E731
                     else str(v).replace("-", "m"))  # fmt: skip
    return kind + "".join(f"_{axis}{tok(spec[axis])}" for axis in sorted(spec))


def _servable(c: dict, source: str) -> None:
    """Refuse a config from which an op could not run: flint_qkv_fused in the two-kernel design launches the
    norm kernel before the qkv kernel, with a residual or without (the first layer)."""
    if "separate" in c.get("qkv", {}).get("norm", []):
        have = set(c.get("norm", {}).get("residual", []))
        if have != {True, False}:
            missing = " and ".join(f"residual={str(r).lower()}" for r in (True, False) if r not in have)
            raise ConfigError(f"{source}: qkv.norm: the separate design needs the norm kernel with "
                              f"{missing}, which the config does not build; add `norm: {{residual: [true, "
                              "false]}` or drop `separate` from qkv.norm")  # fmt: skip


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, mark, first):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.mark, self.first = key, mark, first


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last).
    Keys brought in by a merge (`<<: *anchor`) may still be overridden, as YAML intends."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.get(key)
                except TypeError:
                    continue  # an unhashable key: the base constructor reports it
                if seen is not None:
                    raise _DuplicateKey(key, key_node.start_mark, seen)
                first[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path) -> dict:
    """Read, parse and validate a config file. Every error is one line: FILE[:LINE:COLUMN]: what."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(
            f"{path}:{line}:{col}: not UTF-8 text (byte 0x{data[e.start]:02x}); save the file as UTF-8"
        ) from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as e:
        raise ConfigError(
            f"{path}:{e.mark.line + 1}:{e.mark.column + 1}: duplicate key {e.key!r} (first given at line "
            f"{e.first.line + 1}); give each key once"
        ) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = e.problem or e.context or "syntax error"
        if e.problem and e.context:
            start = f" started at line {e.context_mark.line + 1}" if e.context_mark else ""
            what += f" ({e.context}{start})"
        raise ConfigError(f"{where}: not valid YAML: {' '.join(what.split())}") from None
    except yaml.YAMLError as e:
        what = " ".join(str(e).replace("<unicode string>", str(path)).split())
        raise ConfigError(f"{path}: not valid YAML: {what}") from None
    return validate(raw, str(path))


def _diagnostics(c, raw) -> dict:
    """The diagnostics section, normalized (keys that ask for nothing dropped): build-side switches of a
    diagnostic bundle (docs/config.md), never for serving."""
    d = c.mapping(raw, "diagnostics", {"timeline": False, "norm_spin_cycles": False, "cluster_policy": False})
    out = {}
    if not isinstance(d.get("timeline", False), bool):  # (1 == True: a membership test would take 1)
        c.fail("diagnostics.timeline", d["timeline"], "true or false")
    if d.get("timeline"):
        out["timeline"] = True
    v = d.get("norm_spin_cycles", 0)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_SPIN:
        c.fail("diagnostics.norm_spin_cycles", v, f"an integer in 0..{MAX_SPIN} (0 = off)")
    if v:
        out["norm_spin_cycles"] = v
    if "cluster_policy" in d:
        if d["cluster_policy"] not in DIAGNOSTIC_CLUSTER_POLICIES:
            c.fail("diagnostics.cluster_policy", d["cluster_policy"],
                   " or ".join(DIAGNOSTIC_CLUSTER_POLICIES))  # fmt: skip
        out["cluster_policy"] = d["cluster_policy"]
    return out


def expand(config: dict) -> list[Specialization]:
    """Every (kernel, specialization, arch) of a validated config, in a stable order."""
    specs: list[tuple[str, dict]] = []
    hidden = config.get("hidden", [abi.HIDDEN])
    if "norm" in config:
        for k, res in itertools.product(hidden, config["norm"]["residual"]):
            specs.append(("norm", abi.norm_spec(res, k)))
    if "qkv" in config:
        q = config["qkv"]
        # (validate gives the heads as [q, kv, hidden] triples)
        axes = (q["weight_format"], q["rope"], q.get("qk_norm", [True]), q["heads"],
                q.get("kv_cache_dtype", ["bf16"]), q.get("norm", ["separate"]),
                q.get("max_m", list(M_TILES)))  # fmt: skip
        for fmt, rope, qkn, (nq, nkv, k), kv, norm, tile in itertools.product(*axes):
            specs.append(("qkv", abi.qkv_spec(fmt, rope, nq, nkv, kv, norm, tile, k, qkn)))
    g = config.get("gemv", {})
    for k, fmt, tile in itertools.product(hidden if g else [], g.get("weight_format", []),
                                          g.get("max_m", list(M_TILES))):  # fmt: skip
        specs.append(("gemv", abi.gemv_spec(fmt, tile, k)))
    g = config.get("qk_norm_rope_cache", {})
    for rope, qkn, kv in itertools.product(g.get("rope", []), g.get("qk_norm", [True]),
                                           g.get("kv_cache_dtype", ["bf16"])):  # fmt: skip
        specs.append(("qk_norm_rope_cache", abi.qk_norm_rope_cache_spec(rope, kv, qkn)))
    diag = tuple(sorted(config.get("diagnostics", {}).items()))
    out = [Specialization(kind, spec_name(kind, spec), spec, arch, diagnostics=diag) for kind, spec in specs
           for arch in config["archs"]]  # fmt: skip
    for kind, p in config.get("plugins", {}).items():
        plugin = (p["module"], p.get("class", "KERNEL"))
        for values in itertools.product(*p["spec"].values()):
            spec = dict(zip(p["spec"], values, strict=True))
            out += [Specialization(kind, plugin_spec_name(kind, spec), spec, arch, plugin)
                    for arch in config["archs"]]  # fmt: skip
    return out

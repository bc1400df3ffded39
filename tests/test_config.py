import re

import pytest
import yaml

from flint_aot.config import ConfigError, expand, load_config, validate
from tests.conftest import ROOT

GOOD = {
    "archs": ["sm_90a", "sm_100a"],
    "norm": {"residual": [True, False]},
    "qkv": {"weight_format": ["bf16", "nvfp4"], "rope": [True, False], "heads": [[32, 4], [16, 8]],
            "kv_cache_dtype": ["bf16"], "norm": ["separate"], "max_m": [8, 16, 32, 64]},
}  # fmt: skip


def _err(raw, *needles):
    with pytest.raises(ConfigError) as e:
        validate(raw, "cfg.yaml")
    msg = str(e.value)
    assert msg.startswith("cfg.yaml: "), msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_default_config_loads_and_expands():
    cfg = load_config("configs/flint.yaml")
    specs = expand(cfg)
    # per arch: norm 2 + qkv (formats 2 x rope 2 x heads 4 x kv dtypes 2 x norm modes 2 x token tiles 4)
    # + gemv (formats 2 x token tiles 4) + unfused 4
    assert len(specs) == 2 * (2 + 2 * 2 * 4 * 2 * 2 * 4 + 2 * 4 + 2 * 2)
    names = {s.label for s in specs}
    assert len(names) == len(specs)
    assert "norm_res1@sm_90a" in names and "qkv_nvfp4_rope0_h8x1@sm_100a" in names
    assert "gemv_nvfp4@sm_90a" in names and "qk_norm_rope_cache_rope0@sm_100a" in names
    assert "qkv_bf16_rope1_h32x4_kvfp8_prologue_m16@sm_90a" in names and "gemv_bf16_m16@sm_100a" in names
    assert "qkv_nvfp4_rope1_h16x2_m64@sm_90a" in names and "gemv_nvfp4_m32@sm_100a" in names


def test_expansion_of_small_matrix():
    specs = expand(
        validate(
            {
                "archs": ["sm_90a"],
                "norm": {"residual": [True, False]},
                "qkv": {"weight_format": ["bf16"], "rope": [True, False], "heads": [[16, 2]]},
            }
        )
    )
    names = ["norm_res1", "norm_res0", *(f"qkv_bf16_rope{r}_h16x2{t}" for r in (1, 0)
                                         for t in ("", "_m16", "_m32", "_m64"))]  # fmt: skip
    assert [s.name for s in specs] == names
    assert specs[2].spec == {"weight_format": "bf16", "rope": True, "heads": [16, 2],
                             "kv_cache_dtype": "bf16", "norm": "separate", "max_m": 8, "hidden": 2048,
                             "qk_norm": True}  # fmt: skip
    assert specs[0].spec == {"residual": True, "hidden": 2048}
    assert all(s.arch == "sm_90a" for s in specs)


@pytest.mark.parametrize("norm, missing", [(None, "residual=true and residual=false"),
                                           ({"residual": [True]}, "residual=false"),
                                           ({"residual": [False]}, "residual=true")])  # fmt: skip
def test_a_config_from_which_an_op_could_not_run_is_refused(norm, missing):
    """flint_qkv_fused in the two-kernel design (the default of qkv.norm) launches the norm kernel, with a
    residual or without: a config that does not build both is refused in one line naming the fix."""
    raw = {"archs": ["sm_90a"], "qkv": {"weight_format": ["bf16"], "rope": [True], "heads": [[16, 2]]}}
    if norm is not None:
        raw["norm"] = norm
    for designs in (None, ["separate"], ["separate", "prologue"]):
        if designs:
            raw["qkv"]["norm"] = designs
        msg = _err(raw, "qkv.norm", missing, "norm: {residual: [true, false]}")
        assert "\n" not in msg
    raw["qkv"]["norm"] = ["prologue"]  # the input norm in the qkv kernel: no norm kernel needed
    assert validate(raw)["qkv"]["norm"] == ["prologue"]


def test_diagnostics_stay_on_the_build_side():
    """A diagnostic build (the slow producer's spin, the timeline's trace points, a cluster policy for A/B
    runs) names what it asks in the config's `diagnostics` section: its specializations and their names are
    a serving bundle's (the loader selects kernels by spec alone), each carries the diagnostics into its
    build (and cache key); a section that asks for nothing is dropped; bad values are refused by name."""
    cfg = load_config("configs/debug_slow_producer.yaml")
    assert cfg["diagnostics"] == {"norm_spin_cycles": 2000000}
    norms = [s for s in expand(cfg) if s.kind == "norm"]
    assert [s.name for s in norms] == ["norm_res1", "norm_res0"]
    assert norms[0].spec == {"residual": True, "hidden": 2048}
    assert all(s.diagnostics == (("norm_spin_cycles", 2000000),) for s in expand(cfg))
    timeline = load_config("configs/timeline.yaml")
    assert timeline["diagnostics"] == {"timeline": True}
    serving = {(s.kind, s.name) for s in expand(load_config("configs/flint.yaml"))}
    assert {(s.kind, s.name) for s in expand(timeline)} <= serving
    off = validate({"archs": ["sm_90a"], "diagnostics": {"norm_spin_cycles": 0, "timeline": False},
                    "norm": {"residual": [True]}})  # fmt: skip
    assert "diagnostics" not in off and expand(off)[0].diagnostics == ()
    both = validate({"archs": ["sm_90a"], "diagnostics": {"cluster_policy": "spread", "timeline": True},
                     "norm": {"residual": [True]}})  # fmt: skip
    assert expand(both)[0].diagnostics == (("cluster_policy", "spread"), ("timeline", True))
    base = {"archs": ["sm_90a"], "norm": {"residual": [True]}}
    for bad in (-1, True, 1.5, "10", 1 << 40):
        _err({**base, "diagnostics": {"norm_spin_cycles": bad}}, "diagnostics.norm_spin_cycles", "0..")
    _err({**base, "diagnostics": {"timeline": "yes"}}, "diagnostics.timeline", "true or false")
    _err({**base, "diagnostics": {"timeline": 1}}, "diagnostics.timeline", "true or false")
    _err({**base, "diagnostics": {"cluster_policy": "balanced"}}, "diagnostics.cluster_policy", "spread")
    _err({**base, "diagnostics": {"spin": 5}}, "diagnostics.spin", "known keys")
    old = {"archs": ["sm_90a"], "norm": {"residual": [True], "debug_spin_cycles": 5}}
    _err(old, "norm.debug_spin_cycles", "known keys")  # (the old key, in the product's spec, is gone)


def test_valid_config_roundtrip():
    """validate() normalizes: heads pairs become [q, kv, hidden] triples (one per hidden size of the config),
    qkv gets its qk_norm list (default [true]); `hidden` is only in the output when the raw config has it.
    A normalized config validates to itself."""
    import copy

    want = copy.deepcopy(GOOD)
    want["qkv"]["heads"] = [[32, 4, 2048], [16, 8, 2048]]
    want["qkv"] = {k: want["qkv"][k] for k in ("weight_format", "rope", "heads")} | {"qk_norm": [True]} | {
        k: want["qkv"][k] for k in ("kv_cache_dtype", "norm", "max_m")}
    got = validate(GOOD)
    assert got == want and list(got["qkv"]) == list(want["qkv"]) and "hidden" not in got
    assert validate(got) == got
    assert validate({**GOOD, "hidden": [2048]}) == {**want, "hidden": [2048]}


@pytest.mark.parametrize(
    "mutate, needles",
    [
        (lambda c: c.update(extra=1), ["extra", "known keys"]),
        (lambda c: c["norm"].update(residul=[True]), ["norm.residul", "known keys"]),
        (lambda c: c.update(archs=["sm_80"]), ["archs[0]", "'sm_80'", "sm_90a | sm_100a"]),
        (lambda c: c.update(archs="sm_90a"), ["archs", "non-empty list"]),
        (lambda c: c.update(archs=[]), ["archs", "non-empty list"]),
        (lambda c: c.update(archs=["sm_90a", "sm_90a"]), ["archs[1]", "once"]),
        (lambda c: c["norm"].update(residual=["yes"]), ["norm.residual[0]", "true | false"]),
        (lambda c: c["qkv"].update(weight_format=["fp8"]), ["qkv.weight_format[0]", "bf16 | nvfp4"]),
        (lambda c: c["qkv"].update(heads=[[32, 5]]), ["qkv.heads[0]", "multiple", "32 % 5 = 2"]),
        (lambda c: c["qkv"].update(heads=[[32]]), ["qkv.heads[0]", "pairs"]),
        (lambda c: c["qkv"].update(heads=[[0, 1]]), ["qkv.heads[0][0]", "1..128"]),
        (lambda c: c["qkv"].update(heads=[[8, True]]), ["qkv.heads[0][1]"]),
        (lambda c: c["qkv"].update(heads=[[8, 2.0]]), ["qkv.heads[0][1]"]),
        (lambda c: c["qkv"].pop("rope"), ["qkv.rope", "missing"]),
        (lambda c: c["qkv"].update(max_m=[8, 32]), ["qkv.max_m", "holding 64", "M up to 64"]),
        (lambda c: c["qkv"].update(max_m=[8, 12, 64]), ["qkv.max_m[1]", "8 | 16 | 32 | 64"]),
        (lambda c: c["qkv"].update(max_m=[64, True]), ["qkv.max_m[1]", "8 | 16 | 32 | 64"]),
        (lambda c: c.update(gemv={"weight_format": ["bf16"], "max_m": [8]}), ["gemv.max_m", "holding 64"]),
        (lambda c: c.pop("archs"), ["archs", "missing"]),
        (lambda c: (c.pop("norm"), c.pop("qkv")), ["no kernels"]),
    ],
)
def test_invalid_configs(mutate, needles):
    import copy

    c = copy.deepcopy(GOOD)
    mutate(c)
    _err(c, *needles)


def test_not_a_mapping():
    _err(["archs"], "<top level>", "mapping")


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("archs: [sm_90a\n")
    with pytest.raises(ConfigError, match="not valid YAML") as e:
        load_config(p)
    assert str(p) in str(e.value)
    p.write_text(yaml.safe_dump({"archs": ["sm_90a"], "norm": {"residual": [1]}}))
    with pytest.raises(ConfigError, match=r"bad.yaml: norm.residual\[0\]: got 1"):
        load_config(p)


def _load_error(tmp_path, data: bytes) -> str:
    p = tmp_path / "c.yaml"
    p.write_bytes(data)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "\n" not in msg and "<unicode string>" not in msg, msg
    assert msg.startswith(f"{p}:"), msg
    return msg.removeprefix(f"{p}:")


def test_not_utf8(tmp_path):
    msg = _load_error(tmp_path, b"archs: [sm_90a]\nnorm:\n  residual: [tr\xffue]\n")
    assert msg == "3:16: not UTF-8 text (byte 0xff); save the file as UTF-8"


DUPLICATES = [
    ("archs: [sm_90a]\nnorm: {residual: [true]}\narchs: [sm_100a]\n", "3:1", "'archs'", 1),
    ("archs: [sm_90a]\nnorm:\n  residual: [true]\n  residual: [false]\n", "4:3", "'residual'", 3),
    ("archs: [sm_90a]\nnorm: {residual: [true], residual: [false]}\n", "2:26", "'residual'", 2),
]


@pytest.mark.parametrize("text, where, key, first", DUPLICATES)
def test_duplicate_keys_rejected(tmp_path, text, where, key, first):
    msg = _load_error(tmp_path, text.encode())
    assert msg == f"{where}: duplicate key {key} (first given at line {first}); give each key once"


def test_merge_keys_may_override(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("archs: [sm_90a]\nnorm: {<<: {residual: [true]}, residual: [false]}\n")
    assert load_config(p)["norm"] == {"residual": [False]}


SYNTAX = [
    ("archs: [sm_90a\n", "2:1", "expected ',' or ']', but got '<stream end>' (while parsing a flow sequence "
     "started at line 1)"),
    ("archs: [sm_90a]\nnorm: a: b\n", "2:8", "mapping values are not allowed here"),
    ("archs: [sm_90a]\n\tnorm: {}\n", "2:1", "found character '\\t' that cannot start any token (while "
     "scanning for the next token)"),
    ("archs: *x\n", "1:8", "found undefined alias 'x'"),
]  # fmt: skip


@pytest.mark.parametrize("text, where, what", SYNTAX)
def test_syntax_errors_are_one_line_with_file_line_column(tmp_path, text, where, what):
    assert _load_error(tmp_path, text.encode()) == f"{where}: not valid YAML: {what}"


def test_cli_prints_one_line_before_anything_else(tmp_path):
    from click.testing import CliRunner

    from flint_aot.cli import main

    p = tmp_path / "c.yaml"
    p.write_text("archs: [sm_90a]\narchs: [sm_100a]\n")
    r = CliRunner().invoke(main, ["build", str(p), "-o", str(tmp_path / "o")])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit)
    assert r.output == f"Error: {p}:2:1: duplicate key 'archs' (first given at line 1); give each key once\n"


def test_sanitizer_bundle_holds_every_kernel_its_script_reaches():
    """configs/sanitize.yaml (the bundle compute-sanitizer loads, tools/sanitize_case.py --bundle) holds every
    kernel that `tools/sanitize_case.py 1 16 32 64` launches: the fused cases with those M in both formats,
    both cache dtypes and both designs, on the smallest token tile that holds M; the norm with and without a
    residual; the unfused path at the largest M. The script's cases are read from its source (it runs on
    import)."""
    import ast
    from pathlib import Path

    from loader import abi

    src = Path("tools/sanitize_case.py").read_text()
    (cases,) = [ast.literal_eval(n.value) for n in ast.parse(src).body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "CASES"]  # fmt: skip
    have = [(s.kind, s.spec) for s in expand(load_config("configs/sanitize.yaml"))]
    need = [("norm", abi.norm_spec(r)) for r in (True, False)]
    ms = (1, 16, 32, 64)
    for rope, (nq, nkv), m in cases:
        if m not in ms:
            continue
        tile = abi.m_tiles(m)[0]  # the loader's pick
        for fmt in ("bf16", "nvfp4"):
            for kv in ("bf16", "fp8_e4m3"):
                for design in ("separate", "prologue"):
                    need.append(("qkv", abi.qkv_spec(fmt, rope, nq, nkv, kv, design, tile)))
    need += [
        ("gemv", abi.gemv_spec("bf16", max(ms))),
        ("qk_norm_rope_cache", abi.qk_norm_rope_cache_spec(True, "fp8_e4m3")),
    ]  # the unfused path
    n_qkv = sum(k == "qkv" for k, _ in need)
    assert n_qkv >= 4 * 2 * 2 * 2, "the script's cases no longer reach M = 1, 16, 32, 64"
    missing = [n for n in need if n not in have]
    assert not missing, missing


def test_the_unfused_ops_token_limit_is_named_by_the_config():
    """norm.max_tokens and qk_norm_rope_cache.max_tokens: the most tokens a call of the unfused norms and
    per-head op may have (prefill chunks; default loader.abi.MAX_TOKENS), at least the fused op's 64, at most
    what their grids and offsets hold; recorded as given, refused by name otherwise. The loader reads it
    from the bundle's manifest (loader.bundle.Bundle.max_tokens)."""
    from loader import abi
    from loader.bundle import Bundle
    from loader.manifest import Manifest

    raw = {"archs": ["sm_90a"], "norm": {"residual": [True], "max_tokens": 4096},
           "qk_norm_rope_cache": {"rope": [True], "max_tokens": abi.TOKENS_LIMIT}}  # fmt: skip
    cfg = validate(raw)
    assert cfg["norm"]["max_tokens"] == 4096 and cfg["qk_norm_rope_cache"]["max_tokens"] == abi.TOKENS_LIMIT
    norms = [s.spec for s in expand(cfg) if s.kind == "norm"]
    assert norms == [{"residual": True, "hidden": 2048}]  # (max_tokens: not a spec key)
    b = Bundle(ROOT, Manifest("g", "4.8.1", cfg, []))
    assert b.max_tokens("norm") == 4096 and b.max_tokens("qk_norm_rope_cache") == abi.TOKENS_LIMIT
    assert Bundle(ROOT, Manifest("g", "4.8.1", validate(GOOD), [])).max_tokens("norm") == abi.MAX_TOKENS
    assert abi.TOKENS_LIMIT * abi.HIDDEN < 1 << 31 and -(-abi.TOKENS_LIMIT // abi.QKNRC_TOKENS) <= 65535
    for bad in (63, 0, -1, abi.TOKENS_LIMIT + 1, 1.5, True, "16384"):
        _err({**raw, "norm": {"residual": [True], "max_tokens": bad}}, "norm.max_tokens", "64..")
        _err({**raw, "qk_norm_rope_cache": {"rope": [True], "max_tokens": bad}},
             "qk_norm_rope_cache.max_tokens", "64..")  # fmt: skip


# ----------------------------------------------------------------------- the hidden-size and q/k norm axes
NORMS = {"residual": [True, False]}
QKV = {"weight_format": ["bf16"], "rope": [True], "heads": [[16, 8]], "max_m": [8, 64]}


def _combos(specs):
    """The (num_q_heads, num_kv_heads, hidden) of a list of qkv specializations, in order, once each."""
    return list(dict.fromkeys((*s.spec["heads"], s.spec["hidden"]) for s in specs if s.kind == "qkv"))


def test_flint_yaml_names_are_those_before_the_axes():
    """configs/flint.yaml (hidden 2048, q/k norm on: the axes' defaults) expands to the 540 specializations of
    the bundles before the hidden-size and q/k-norm axes, in the same order and with the same names: the
    digest is of the labels its expansion gave at the commit before the axes (flint_aot/config.py and
    loader/abi.py of that commit); every spec now names the defaults."""
    import hashlib

    specs = expand(load_config("configs/flint.yaml"))
    labels = [s.label for s in specs]
    assert len(labels) == 540 and len(set(labels)) == 540
    assert [sum(s.arch == a for s in specs) for a in ("sm_90a", "sm_100a")] == [270, 270]
    assert hashlib.sha256("\n".join(labels).encode()).hexdigest() == (
        "ad9aeccbd9af5a071e2c108c857e8c893f15a8d36ad256f1fa93357f4c2209f4")  # fmt: skip
    assert not [n for n in labels if re.search(r"_k\d|_qkn", n)]
    for s in specs:
        assert s.spec.get("hidden", 2048) == 2048 and s.spec.get("qk_norm", True) is True, s.label
        assert ("hidden" in s.spec) == (s.kind in ("norm", "qkv", "gemv")), s.label
        assert ("qk_norm" in s.spec) == (s.kind in ("qkv", "qk_norm_rope_cache")), s.label


def test_hidden_pairs_expand_at_every_hidden_size_of_the_config():
    """hidden: [1024] with [q, kv] pairs: every norm, qkv and gemv spec at hidden 1024, named _k1024 (after
    the heads, res{0,1} and the format); the per-head op has no hidden size. The normalized config holds the
    heads as [q, kv, 1024] and `hidden` as given, and validates to itself."""
    raw = {"archs": ["sm_90a"], "hidden": [1024], "norm": NORMS, "qkv": QKV,
           "gemv": {"weight_format": ["nvfp4"], "max_m": [16, 64]},
           "qk_norm_rope_cache": {"rope": [True]}}  # fmt: skip
    cfg = validate(raw)
    assert cfg["hidden"] == [1024] and cfg["qkv"]["heads"] == [[16, 8, 1024]] and validate(cfg) == cfg
    specs = expand(cfg)
    assert [s.name for s in specs] == ["norm_res1_k1024", "norm_res0_k1024", "qkv_bf16_rope1_h16x8_k1024",
                                       "qkv_bf16_rope1_h16x8_k1024_m64", "gemv_nvfp4_k1024_m16",
                                       "gemv_nvfp4_k1024_m64", "qk_norm_rope_cache_rope1"]  # fmt: skip
    assert all(s.spec["hidden"] == 1024 for s in specs if s.kind != "qk_norm_rope_cache")
    assert specs[0].spec == {"residual": True, "hidden": 1024}
    assert specs[4].spec == {"weight_format": "nvfp4", "max_m": 16, "hidden": 1024}
    assert "hidden" not in specs[-1].spec
    both = expand(validate({**raw, "hidden": [1024, 2048]}))  # pairs: at each hidden size
    assert _combos(both) == [(16, 8, 1024), (16, 8, 2048)]
    assert [s.name for s in both if s.kind == "norm"] == ["norm_res1_k1024", "norm_res0_k1024", "norm_res1",
                                                          "norm_res0"]  # fmt: skip
    assert [s.name for s in both if s.kind == "gemv"] == ["gemv_nvfp4_k1024_m16", "gemv_nvfp4_k1024_m64",
                                                          "gemv_nvfp4_m16", "gemv_nvfp4_m64"]  # fmt: skip


def test_hidden_triples_restrict_the_heads_to_one_hidden_size():
    """[q, kv, hidden] items are built at that hidden size only (no cross product with `hidden`), pairs at
    each; the norm and gemv at each hidden size."""
    raw = {"archs": ["sm_90a"], "hidden": [1024, 2048], "norm": NORMS,
           "qkv": {**QKV, "heads": [[16, 8, 1024], [32, 4, 2048]]},
           "gemv": {"weight_format": ["bf16"]}}  # fmt: skip
    cfg = validate(raw)
    assert cfg["qkv"]["heads"] == [[16, 8, 1024], [32, 4, 2048]] and validate(cfg) == cfg
    specs = expand(cfg)
    assert _combos(specs) == [(16, 8, 1024), (32, 4, 2048)]
    assert [s.name for s in specs if s.kind == "qkv"] == ["qkv_bf16_rope1_h16x8_k1024",
                                                          "qkv_bf16_rope1_h16x8_k1024_m64",
                                                          "qkv_bf16_rope1_h32x4",
                                                          "qkv_bf16_rope1_h32x4_m64"]  # fmt: skip
    assert sorted({s.spec["hidden"] for s in specs if s.kind in ("norm", "gemv")}) == [1024, 2048]
    mixed = validate({**raw, "qkv": {**QKV, "heads": [[16, 8], [32, 4, 2048]]}})
    assert mixed["qkv"]["heads"] == [[16, 8, 1024], [16, 8, 2048], [32, 4, 2048]]
    assert _combos(expand(mixed)) == [(16, 8, 1024), (16, 8, 2048), (32, 4, 2048)]
    pairs = expand(validate({**raw, "qkv": {**QKV, "heads": [[16, 8], [32, 4]]}}))  # the cross product
    assert _combos(pairs) == [(16, 8, 1024), (16, 8, 2048), (32, 4, 1024), (32, 4, 2048)]
    assert len(pairs) == 4 + 2 * 2 * 2 + 4 * 2  # norm 2 x 2, qkv 2 heads x 2 hidden x 2 tiles, gemv 4 x 2


@pytest.mark.parametrize(
    "hidden, heads, needles",
    [
        ([1024], [[16, 8, 2048]], ["qkv.heads[0][2]", "got 2048", "a hidden size of `hidden` (1024)"]),
        (None, [[16, 8, 1024]], ["qkv.heads[0][2]", "got 1024", "(2048)"]),
        ([1024, 2048], [[16, 8, 1536]], ["qkv.heads[0][2]", "(1024, 2048)"]),
        ([1024], [[16, 8, True]], ["qkv.heads[0][2]", "got True"]),
        ([1024], [[16, 8, 1024, 1]], ["qkv.heads[0]", "pairs", "[num_q_heads, num_kv_heads, hidden]"]),
        ([1024, 2048], [[16, 8], [16, 8, 1024]], ["qkv.heads[1]", "[16, 8] at hidden 1024 is given twice"]),
        ([1024], [[16, 8, 1024], [16, 8, 1024]], ["qkv.heads[1]", "once"]),
        ([1024], [[16, 8], [16, 8, 1024]], ["qkv.heads[1]", "given twice"]),
    ],
)  # fmt: skip
def test_heads_and_their_hidden_sizes_are_refused_by_name(hidden, heads, needles):
    raw = {"archs": ["sm_90a"], "norm": NORMS, "qkv": {**QKV, "heads": heads}}
    if hidden is not None:
        raw["hidden"] = hidden
    _err(raw, *needles)


def test_hidden_sizes_a_kind_cannot_build_are_refused():
    """hidden sizes: the norm's multiples of 512 in 512..8192 (a norm-only config of 4096 or 8192 builds);
    qkv and gemv 1024..2048, larger ones refused naming the weight stream of several waves they would need
    (qkv by qkv.heads, gemv by hidden); the prologue design 2048 only; not a bool, a string or a float."""
    base = {"archs": ["sm_90a"], "norm": NORMS}
    for k in (4096, 8192, 512):
        assert [s.name for s in expand(validate({**base, "hidden": [k]}))] == [f"norm_res1_k{k}",
                                                                              f"norm_res0_k{k}"]  # fmt: skip
    for k in (2560, 4096, 5120):
        msg = _err({**base, "hidden": [k], "qkv": QKV}, "qkv.heads", f"got {k}", "1024..2048 for qkv",
                   "several waves")  # fmt: skip
        assert "\n" not in msg
        _err({**base, "hidden": [k], "gemv": {"weight_format": ["bf16"]}}, f"hidden: got {k}", "1024..2048",
             "(gemv)", "several waves")  # fmt: skip
    _err({**base, "hidden": [1024, 8192], "qkv": {**QKV, "heads": [[16, 8]]}}, "qkv.heads", "got 8192",
         "1024..2048")  # fmt: skip
    ok = validate({**base, "hidden": [1024, 8192], "qkv": {**QKV, "heads": [[16, 8, 1024]]}})  # (qkv: 1024)
    assert [s.name for s in expand(ok) if s.kind == "norm"] == ["norm_res1_k1024", "norm_res0_k1024",
                                                                "norm_res1_k8192",
                                                                "norm_res0_k8192"]  # fmt: skip
    _err({**base, "hidden": [512], "gemv": {"weight_format": ["bf16"]}}, "hidden: got 512", "1024..2048")
    for bad in (1000, 0, 256, 8704, -512):
        _err({**base, "hidden": [2048, bad]}, "hidden[1]", f"got {bad}", "multiple of 512 in 512..8192")
    for bad in (True, "2048", 2048.0, None, [2048]):
        _err({**base, "hidden": [bad]}, "hidden[0]", "an integer")
    for bad in ([], 2048, "2048", {"k": 2048}):
        _err({**base, "hidden": bad}, "hidden: got", "non-empty list")
    _err({**base, "hidden": [1024, 1024]}, "hidden[1]", "once")
    _err({**base, "hidden": [1024], "qkv": {**QKV, "norm": ["prologue"]}}, "qkv.heads", "got 1024",
         "2048 for the prologue design (use norm: separate)")  # fmt: skip
    _err({**base, "hidden": [1536], "qkv": {**QKV, "norm": ["prologue"]}}, "qkv.heads", "got 1536",
         "prologue design")  # fmt: skip
    _err({**base, "hidden": [1024, 2048], "qkv": {**QKV, "norm": ["separate", "prologue"]}}, "prologue")
    pro = validate({**base, "hidden": [1024, 2048], "qkv": {**QKV, "heads": [[16, 8, 2048]],
                                                             "norm": ["separate", "prologue"]}})  # fmt: skip
    assert {s.spec["norm"] for s in expand(pro) if s.kind == "qkv"} == {"separate", "prologue"}


def test_qk_norm_is_an_axis_of_qkv_and_the_per_head_op():
    """qkv.qk_norm: [true, false] doubles the qkv specs, those without q/k norm named _qkn0 after rope{0,1};
    qk_norm_rope_cache.qk_norm likewise; the default [true] is in the normalized config; not a bool:
    refused."""
    base = {"archs": ["sm_90a"], "norm": NORMS}
    one = expand(validate({**base, "qkv": QKV}))
    cfg = validate({**base, "qkv": {**QKV, "qk_norm": [True, False]}})
    assert cfg["qkv"]["qk_norm"] == [True, False] and validate(cfg) == cfg
    two = [s for s in expand(cfg) if s.kind == "qkv"]
    assert len(two) == 2 * sum(s.kind == "qkv" for s in one) == 4
    assert [s.name for s in two] == ["qkv_bf16_rope1_h16x8", "qkv_bf16_rope1_h16x8_m64",
                                     "qkv_bf16_rope1_qkn0_h16x8",
                                     "qkv_bf16_rope1_qkn0_h16x8_m64"]  # fmt: skip
    assert [s.spec["qk_norm"] for s in two] == [True, True, False, False]
    assert validate({**base, "qkv": QKV})["qkv"]["qk_norm"] == [True]
    off = validate({**base, "hidden": [1024], "qkv": {**QKV, "qk_norm": [False],
                                                      "kv_cache_dtype": ["fp8_e4m3"]}})  # fmt: skip
    names = [s.name for s in expand(off) if s.kind == "qkv"]
    assert names == ["qkv_bf16_rope1_qkn0_h16x8_k1024_kvfp8", "qkv_bf16_rope1_qkn0_h16x8_k1024_kvfp8_m64"]
    qk = validate({"archs": ["sm_90a"], "qk_norm_rope_cache": {"rope": [True, False], "qk_norm": [False]}})
    assert qk["qk_norm_rope_cache"] == {"rope": [True, False], "qk_norm": [False], "kv_cache_dtype": ["bf16"]}
    assert [(s.name, s.spec) for s in expand(qk)] == [
        ("qk_norm_rope_cache_rope1_qkn0", {"rope": True, "kv_cache_dtype": "bf16", "qk_norm": False}),
        ("qk_norm_rope_cache_rope0_qkn0", {"rope": False, "kv_cache_dtype": "bf16", "qk_norm": False})]
    dflt = validate({"archs": ["sm_90a"], "qk_norm_rope_cache": {"rope": [True]}})
    assert dflt["qk_norm_rope_cache"]["qk_norm"] == [True]
    assert [s.name for s in expand(dflt)] == ["qk_norm_rope_cache_rope1"]
    for bad in ("no", 0, None):
        _err({**base, "qkv": {**QKV, "qk_norm": [bad]}}, "qkv.qk_norm[0]", "true | false")
        _err({"archs": ["sm_90a"], "qk_norm_rope_cache": {"rope": [True], "qk_norm": [bad]}},
             "qk_norm_rope_cache.qk_norm[0]", "true | false")  # fmt: skip
    _err({**base, "qkv": {**QKV, "qk_norm": [True, True]}}, "qkv.qk_norm[1]", "once")
    _err({**base, "qkv": {**QKV, "qk_norm": []}}, "qkv.qk_norm", "non-empty list")


def test_the_token_limit_follows_the_largest_hidden_size():
    """max_tokens is bounded by the norm kernel's 32-bit offsets at the config's largest hidden size
    (loader.abi.tokens_limit): a limit that hidden 2048 holds is refused beside hidden 8192."""
    from loader import abi

    raw = {"archs": ["sm_90a"], "norm": {"residual": [True], "max_tokens": 300000}}
    assert abi.tokens_limit(8192) < 300000 <= abi.tokens_limit(2048)
    assert validate(raw)["norm"]["max_tokens"] == 300000
    _err({**raw, "hidden": [2048, 8192]}, "norm.max_tokens", f"64..{abi.tokens_limit(8192)}")
    at = {**raw, "hidden": [8192], "norm": {"residual": [True], "max_tokens": abi.tokens_limit(8192)}}
    assert validate(at)["norm"]["max_tokens"] == abi.tokens_limit(8192)
    qk = {"archs": ["sm_90a"], "hidden": [8192], "norm": {"residual": [True]},
          "qk_norm_rope_cache": {"rope": [True], "max_tokens": abi.tokens_limit(8192) + 1}}  # fmt: skip
    _err(qk, "qk_norm_rope_cache.max_tokens", f"64..{abi.tokens_limit(8192)}")

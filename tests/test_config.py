import pytest
import yaml

from flint_aot.config import ConfigError, expand, load_config, validate

GOOD = {
    "archs": ["sm_90a", "sm_100a"],
    "norm": {"residual": [True, False]},
    "qkv": {"weight_format": ["bf16", "nvfp4"], "rope": [True, False], "heads": [[32, 4], [16, 8]]},
}


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
    assert len(specs) == 2 * 2 + 2 * 2 * 4 * 2 + 2 * 2 + 2 * 2
    names = {s.label for s in specs}
    assert len(names) == len(specs)
    assert "norm_res1@sm_90a" in names and "qkv_nvfp4_rope0_h8x1@sm_100a" in names
    assert "gemv_nvfp4@sm_90a" in names and "qk_norm_rope_cache_rope0@sm_100a" in names


def test_expansion_of_small_matrix():
    specs = expand(validate({"archs": ["sm_90a"], "qkv": {"weight_format": ["bf16"], "rope": [True, False],
                                                          "heads": [[16, 2]]}}))
    assert [s.name for s in specs] == ["qkv_bf16_rope1_h16x2", "qkv_bf16_rope0_h16x2"]
    assert specs[0].spec == {"weight_format": "bf16", "rope": True, "heads": [16, 2]}
    assert all(s.arch == "sm_90a" and s.kind == "qkv" for s in specs)


def test_debug_spin_norm():
    cfg = load_config("configs/debug_slow_producer.yaml")
    norms = [s for s in expand(cfg) if s.kind == "norm"]
    assert [s.name for s in norms] == ["norm_res1_spin2000000", "norm_res0_spin2000000"]
    assert norms[0].spec == {"residual": True, "debug_spin_cycles": 2000000}
    off = validate({"archs": ["sm_90a"], "norm": {"residual": [True], "debug_spin_cycles": 0}})
    assert expand(off)[0].spec == {"residual": True} and expand(off)[0].name == "norm_res1"
    for bad in (-1, True, 1.5, "10", 1 << 40):
        _err({"archs": ["sm_90a"], "norm": {"residual": [True], "debug_spin_cycles": bad}},
             "norm.debug_spin_cycles", "0..")


def test_valid_config_roundtrip():
    assert validate(GOOD) == GOOD


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

"""The fused qkv op (BF16 and NVFP4 weights, BF16 and FP8 KV caches) on the GPU against the float64
reference (loader.reference)."""

import pytest
import torch

from loader.reference import fp8_cache_value
from tests.helpers import (
    FP8_CACHE_POISON,
    D,
    K,
    as_float,
    check,
    device_arch,
    kv_of,
    make_case,
    op_args,
    pick_heads,
    poison_cache_,
    run,
    variants,
)

pytestmark = pytest.mark.gpu
KV = ["bf16", "fp8_e4m3"]
DESIGNS = ["separate", "prologue"]  # the input norm in its own kernel, or in the qkv kernel's prologue
# every M of the 8- and 16-token tiles, then both sides of each larger tile's edges and a few inside
MS = [*range(1, 18), 24, 31, 32, 33, 40, 48, 56, 57, 63, 64]


def _has_design(bundle, design) -> bool:
    return any(e.kind == "qkv" and e.spec.get("norm", "separate") == design for e in bundle.manifest.kernels)


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", MS)
def test_every_variant(gpu_bundle, m, fmt, kv, design):
    import loader

    if not _has_design(gpu_bundle, design):
        pytest.skip(f"the bundle has no {design}-design qkv kernels")
    vs = variants(gpu_bundle, fmt, kv)
    assert vs, f"the bundle has no {fmt} qkv kernels with a {kv} KV cache"
    for i, (rope, (nq, nkv)) in enumerate(vs):
        c = make_case(
            m, nq, nkv, rope, seed=1000 * m + i, residual=(i % 2 == 0), fmt=fmt, scale_u8=(i % 3 == 1),
            kv_dtype=kv, cache_u8=(i % 2 == 1),
        )  # fmt: skip
        kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
        with loader.launch_options(design=design):
            q, res_out = run(c)
        torch.cuda.synchronize()
        check(c, q, res_out, kb, vb)


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_designs_bit_identical(gpu_bundle, fmt, kv):
    """The prologue design computes the input norm with the norm kernel's roundings and summation order, and
    then runs the same GEMV and epilogue: q, residual_out and every cache byte (written or not) must equal
    the two-kernel design's, for every variant, M = 1, 4, 8, 12, 16, 17, 33, 64, with and without a
    residual."""
    import loader

    if not all(_has_design(gpu_bundle, d) for d in DESIGNS):
        pytest.skip("the bundle lacks one of the two designs")
    for i, (rope, (nq, nkv)) in enumerate(variants(gpu_bundle, fmt, kv)):
        for m in (1, 4, 8, 12, 16, 17, 33, 64):
            for residual in (True, False):
                c = make_case(
                    m, nq, nkv, rope, seed=3000 + 10 * m + i, residual=residual, fmt=fmt, kv_dtype=kv
                )
                outs = []
                for design in DESIGNS:
                    poison_cache_(c["k_cache"])
                    poison_cache_(c["v_cache"])
                    with loader.launch_options(design=design):
                        q, r = run(c)
                    torch.cuda.synchronize()
                    outs.append(
                        [t.contiguous().view(torch.uint8).clone() for t in (q, r, c["k_cache"], c["v_cache"])]
                    )
                for what, a, b in zip(("q", "residual_out", "k_cache", "v_cache"), *outs, strict=True):
                    assert torch.equal(a, b), (what, fmt, kv, rope, nq, nkv, m, residual)


@pytest.mark.parametrize("m", [8, 16, 64])
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("split_kv", [False, True])
def test_cache_layouts_and_slot_mapping(gpu_bundle, block_size, split_kv, fmt, kv, m):
    nq, nkv = pick_heads(gpu_bundle, fmt, kv)
    nb = 160 // block_size + 2
    slots = [5, -1, nb * block_size - 1, 0, -7, 17]  # shorter than M, negatives
    if m > 8:
        slots += [33, -2, 40, 41, 9, 2, -5]  # 13 slots for 16 tokens
    if m > 16:  # 45 more for 64 tokens: a gap, a run, the last slots, negatives
        slots += [*range(60, 80), *range(100, 110), nb * block_size - 2, -3, 11, *range(140, 152), -9]
    slots = torch.tensor(slots, device="cuda")
    c = make_case(
        m, nq, nkv, True, seed=block_size, num_blocks=nb, block_size=block_size, split_kv=split_kv,
        slots=slots, fmt=fmt, kv_dtype=kv,
    )  # fmt: skip
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    q, res_out = run(c)
    torch.cuda.synchronize()
    check(c, q, res_out, kb, vb)


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_token_tiles_agree(gpu_bundle, fmt, design):
    """Every tile gives each token the bits the 8-token kernel gives it (docs/numerics.md §2): a call of M
    tokens on either side of each tile edge (8/9, 16/17, 32/33, 64) equals, q and residual_out row by row
    and every cache byte, calls of 8 tokens at a time on the same inputs. Every variant at every such M,
    with a residual and without (without one, residual_out is x itself: only the residual case compares
    the kernels' residual_out)."""
    if not _has_design(gpu_bundle, design):
        pytest.skip(f"the bundle has no {design}-design qkv kernels")
    vs = variants(gpu_bundle, fmt)
    assert vs, f"the bundle has no {fmt} qkv kernels"
    for i, (rope, (nq, nkv)) in enumerate(vs):
        for m in (9, 16, 17, 32, 33, 64):
            for residual in (True, False):
                seed = 6100 + 1000 * i + 10 * m + residual
                c = make_case(m, nq, nkv, rope, seed=seed, residual=residual, fmt=fmt)
                _agrees_with_8_token_calls(c, design, (rope, nq, nkv, m, residual))


def _agrees_with_8_token_calls(c, design, what):
    """Case c called whole equals, q row by row and every cache byte, calls of 8 tokens at a time on the
    same inputs."""
    import loader

    m = c["x"].shape[0]
    parts = dict(c, k_cache=c["k_cache"].clone(), v_cache=c["v_cache"].clone())
    with loader.launch_options(design=design):
        q, r = run(c)
        pieces = []
        for a in range(0, m, 8):
            b = min(a + 8, m)
            h = dict(parts, **{k: None if c[k] is None else c[k][a:b].contiguous()
                               for k in ("x", "residual", "positions", "slot_mapping")})  # fmt: skip
            pieces.append(run(h))
    torch.cuda.synchronize()
    bits = lambda t: t.contiguous().view(torch.int16)  # noqa: E731
    assert torch.equal(bits(q), bits(torch.cat([h[0] for h in pieces]))), what
    assert torch.equal(bits(r), bits(torch.cat([h[1] for h in pieces]))), what
    for name in ("k_cache", "v_cache"):
        assert torch.equal(bits(c[name]), bits(parts[name])), (name, *what)


def test_the_64_token_nvfp4_schedules_agree(gpu_bundle):
    """The two-kernel design's 64-token NVFP4 kernel runs its 5 to 8 groups of tokens in four schedules
    (docs/kernels.md §2.6: group 0 by mma.sync and groups 1-3 in one wgmma pass, then groups 4 .. by mma.sync,
    or, with all 8, group 4 and a second pass): at M = 40, 48, 56 and 64 (and at 41, 49 and 57, one token into
    the group) each token has the bits of the 8-token kernel, q and every cache byte."""
    if not _has_design(gpu_bundle, "separate"):
        pytest.skip("the bundle has no separate-design qkv kernels")
    vs = variants(gpu_bundle, "nvfp4")
    for j, m in enumerate((40, 41, 48, 49, 56, 57, 64)):
        rope, (nq, nkv) = vs[j % len(vs)]
        c = make_case(m, nq, nkv, rope, seed=6900 + m, residual=(j % 2 == 0), fmt="nvfp4")
        _agrees_with_8_token_calls(c, "separate", (rope, nq, nkv, m))


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_two_runs_bit_identical(gpu_bundle, fmt, kv):
    nq, nkv = pick_heads(gpu_bundle, fmt, kv, prefer=((32, 4),))
    c = make_case(5, nq, nkv, True, seed=3, fmt=fmt, kv_dtype=kv)
    q1, r1 = run(c)
    k1, v1 = c["k_cache"].clone(), c["v_cache"].clone()
    q2, r2 = run(c)
    torch.cuda.synchronize()
    assert torch.equal(q1, q2) and torch.equal(r1, r2)
    bits = torch.int16 if kv == "bf16" else torch.uint8
    for a, b in ((k1, c["k_cache"]), (v1, c["v_cache"])):  # bit patterns: the NaN poison included
        assert torch.equal(a.view(bits), b.view(bits))


@pytest.mark.parametrize("m", [4, 16])
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_graph_capture_replay(gpu_bundle, fmt, kv, m):
    nq, nkv = pick_heads(gpu_bundle, fmt, kv, prefer=((32, 4),))
    c = make_case(m, nq, nkv, True, seed=4, fmt=fmt, kv_dtype=kv)
    run(c)  # load modules before capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        q, res_out = run(c)
    for seed in (5, 6):
        n = make_case(m, nq, nkv, True, seed=seed, fmt=fmt, kv_dtype=kv)
        for key in ("x", "residual", "positions", "slot_mapping"):
            c[key].copy_(n[key])
        poison_cache_(c["k_cache"])
        poison_cache_(c["v_cache"])
        kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
        graph.replay()
        torch.cuda.synchronize()
        check(c, q, res_out, kb, vb)


@pytest.mark.parametrize("m", [5, 16])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_default_design_eager_and_captured(gpu_bundle, fmt, m):
    """Without launch_options(design=): eager calls run the prologue design (one launch: the least host time),
    calls captured in a CUDA graph the two-kernel design (the least GPU time); both write the same bytes."""
    import loader
    from loader import runtime

    if not all(_has_design(gpu_bundle, d) for d in DESIGNS):
        pytest.skip("the bundle lacks one of the two designs")

    def designs():
        keys = [k for k in runtime.thread_cache() if k[0] == "qkv"]  # (xn: the norm kernel writes it)
        return {"separate" if p.xn else "prologue" for k in keys for p in runtime.thread_cache()[k]}

    nq, nkv = pick_heads(gpu_bundle, fmt, "bf16", prefer=((32, 4),))
    c = make_case(m, nq, nkv, True, seed=41, fmt=fmt)
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    runtime.thread_cache().clear()
    q, r = loader.flint_qkv_fused(**op_args(c))
    torch.cuda.synchronize()
    assert designs() == {"prologue"}
    check(c, q, r, kb, vb)
    eager = [t.clone() for t in (q, r, c["k_cache"], c["v_cache"])]
    c["k_cache"].copy_(kb)
    c["v_cache"].copy_(vb)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        q, r = loader.flint_qkv_fused(**op_args(c))
    assert designs() == {"prologue", "separate"}
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, (q, r, c["k_cache"], c["v_cache"]), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("kv", KV)
def test_out_of_range_positions_and_slots_are_safe(gpu_bundle, kv):
    import loader

    nq, nkv = pick_heads(gpu_bundle, "bf16", kv)
    c = make_case(3, nq, nkv, True, seed=8, num_blocks=4, block_size=16, kv_dtype=kv)
    c["positions"] = torch.tensor([1, 4096, -3], device="cuda")
    c["slot_mapping"] = torch.tensor([0, 64, 1], device="cuda")  # 64 = one past the cache
    q, _ = run(c)
    torch.cuda.synchronize()
    q = q.view(3, nq, D)
    assert not q[0].isnan().any() and q[1].isnan().all() and q[2].isnan().all()
    # token 1's slot is past the cache: not written; token 2's k is NaN (bad position) but v is written
    k, v = as_float(c["k_cache"]), as_float(c["v_cache"])
    assert (~k.isnan()).sum().item() == nkv * D
    assert (~v.isnan()).sum().item() == 2 * nkv * D
    assert not v[0, 1].isnan().any() and k[0, 1].isnan().all()
    with loader.launch_options(bounds_check=True):
        with pytest.raises(ValueError, match=r"(?i)position"):
            run(c)
        c["positions"] = torch.tensor([1, 2, 3], device="cuda")
        with pytest.raises(ValueError, match=r"(?i)slot"):
            run(c)
        c["slot_mapping"] = torch.tensor([0, -1, 63], device="cuda")  # negative: allowed in checked mode too
        kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
        q, r = run(c)
        torch.cuda.synchronize()
    check(c, q, r, kb, vb)


def test_bad_inputs_raise_and_write_nothing(gpu_bundle):
    """Each bad argument raises before anything is launched; the messages name the argument."""
    import loader

    nq, nkv = pick_heads(gpu_bundle, "bf16", "bf16", prefer=((32, 4),))
    case = make_case(2, nq, nkv, True, seed=9)
    base = op_args(case)
    # (value, exception types, regex the message must match)
    bad = {
        "x": (base["x"].float(), TypeError, r"\bx\b"),
        "weight": (base["weight"][:-16], ValueError, r"weight"),
        "weight_scale": (base["weight"], ValueError, r"weight_scale|BF16"),
        "positions": (base["positions"].int(), TypeError, r"positions"),
        "slot_mapping": (torch.zeros(3, dtype=torch.int64, device="cuda"), ValueError, r"slot_mapping"),
        "v_cache": (base["v_cache"][:, :8], ValueError, r"v_cache|k_cache"),
        "k_cache": (base["k_cache"].float(), TypeError, r"k_cache"),
        "cos_sin_cache": (base["cos_sin_cache"][:, :64], ValueError, r"cos_sin_cache"),
        "q_norm_weight": (base["q_norm_weight"][:64], ValueError, r"q_norm_weight"),
        "num_q_heads": (nq - 1, (ValueError, LookupError), r"(?i)head|weight|cache"),
        "num_kv_heads": (
            nkv * 2 if nq % (nkv * 2) == 0 else nq,
            (ValueError, LookupError),
            r"(?i)head|weight|cache",
        ),
        "qk_eps": (None, TypeError, r"qk_eps"),
    }
    for key, (val, exc, msg) in bad.items():
        c = dict(base, **{key: val})
        with pytest.raises(exc, match=msg):
            loader.flint_qkv_fused(**c)
    other = (24, 4) if (24, 4) not in [h for _, h in variants(gpu_bundle)] else (8, 8)
    w = torch.zeros((other[0] + 2 * other[1]) * D, K, dtype=torch.bfloat16, device="cuda")
    c = dict(base, num_q_heads=other[0], num_kv_heads=other[1], weight=w)
    c["k_cache"] = torch.full((16, 16, other[1], D), float("nan"), dtype=torch.bfloat16, device="cuda")
    c["v_cache"] = torch.full_like(c["k_cache"], float("nan"))
    with pytest.raises(LookupError, match=r"(?i)build"):
        loader.flint_qkv_fused(**c)
    assert c["k_cache"].isnan().all() and c["v_cache"].isnan().all()
    torch.cuda.synchronize()
    assert base["k_cache"].isnan().all() and base["v_cache"].isnan().all()
    kb, vb = case["k_cache"].clone(), case["v_cache"].clone()
    q, r = loader.flint_qkv_fused(**base)  # the context is still healthy and the op right
    torch.cuda.synchronize()
    check(case, q, r, kb, vb)


@pytest.mark.parametrize("design", DESIGNS)
def test_m_65_is_refused_and_writes_nothing(gpu_bundle, design):
    """M = 65, one token past the largest tile, is refused (ValueError naming the limit) with nothing written:
    on a new shape, and again after the same inputs' first 64 tokens ran (and were right); through
    torch.ops.flint.qkv_fused too. Every cache byte stays as it was."""
    import loader

    if not _has_design(gpu_bundle, design):
        pytest.skip(f"the bundle has no {design}-design qkv kernels")
    nq, nkv = pick_heads(gpu_bundle, "bf16", "bf16", prefer=((32, 4),))
    c = make_case(65, nq, nkv, True, seed=65)
    c64 = dict(c, **{k: c[k][:64] for k in ("x", "residual", "positions", "slot_mapping")})
    bits = lambda t: t.view(torch.int16).clone()  # noqa: E731 (NaN poison compared bit for bit)

    def refused(when):
        before = [bits(c["k_cache"]), bits(c["v_cache"])]
        for call in (loader.flint_qkv_fused, torch.ops.flint.qkv_fused):
            with loader.launch_options(design=design), pytest.raises(ValueError, match=r"1 <= M <= 64"):
                call(**op_args(c))
        torch.cuda.synchronize()
        for name, b in zip(("k_cache", "v_cache"), before, strict=True):
            assert torch.equal(bits(c[name]), b), f"{when}: {name} written by a refused call"

    refused("a new shape")
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    with loader.launch_options(design=design):
        q, r = run(c64)
    torch.cuda.synchronize()
    check(c64, q, r, kb, vb)
    refused("after M = 64 ran")


def test_bad_nvfp4_inputs_raise_and_write_nothing(gpu_bundle):
    import loader

    nq, nkv = pick_heads(gpu_bundle, "nvfp4", "bf16", prefer=((32, 4),))
    case = make_case(2, nq, nkv, True, seed=10, fmt="nvfp4")
    base = op_args(case)
    ws, gs = base["weight_scale"], base["global_scale"]
    bad = {
        "weight_scale": [
            (None, ValueError, r"weight_scale"),
            (ws.view(torch.uint8).bfloat16(), TypeError, r"weight_scale"),
            (ws[:-128], ValueError, r"weight_scale"),
            (ws.cpu(), ValueError, r"weight_scale"),
            (ws.view(torch.uint8).t(), ValueError, r"weight_scale"),
        ],
        "global_scale": [
            (None, ValueError, r"global_scale"),
            (gs.half(), TypeError, r"global_scale"),
            (torch.ones(2, device="cuda"), ValueError, r"global_scale"),
            (1.0, TypeError, r"global_scale"),
        ],
        "weight": [
            (base["weight"][:, :512], ValueError, r"weight"),
            (base["weight"].view(torch.int8), TypeError, r"weight"),
        ],
    }
    for key, cases in bad.items():
        for val, exc, msg in cases:
            with pytest.raises(exc, match=msg):
                loader.flint_qkv_fused(**dict(base, **{key: val}))
    torch.cuda.synchronize()
    assert base["k_cache"].isnan().all() and base["v_cache"].isnan().all()
    kb, vb = case["k_cache"].clone(), case["v_cache"].clone()
    q, r = loader.flint_qkv_fused(**base)
    torch.cuda.synchronize()
    check(case, q, r, kb, vb)


def test_bad_fp8_cache_inputs_raise_and_write_nothing(gpu_bundle):
    """FP8 caches need k_scale and v_scale (fp32, one element, on the device, finite, > 0); a BF16 cache takes
    none; k and v must have the same dtype. Nothing is written on a rejected call."""
    import loader

    nq, nkv = pick_heads(gpu_bundle, "bf16", "fp8_e4m3")
    case = make_case(3, nq, nkv, True, seed=11, kv_dtype="fp8_e4m3")
    base = op_args(case)
    ks = base["k_scale"]
    cuda = dict(dtype=torch.float32, device="cuda")
    bad = [
        ("k_scale", None, (TypeError, ValueError), r"k_scale"),
        ("v_scale", None, (TypeError, ValueError), r"v_scale"),
        ("k_scale", torch.zeros(1, **cuda), ValueError, r"k_scale"),
        ("v_scale", torch.full((1,), -0.5, **cuda), ValueError, r"v_scale"),
        ("k_scale", torch.full((1,), float("nan"), **cuda), ValueError, r"k_scale"),
        ("v_scale", torch.full((1,), float("inf"), **cuda), ValueError, r"v_scale"),
        ("k_scale", ks.expand(2).contiguous(), ValueError, r"k_scale"),
        ("k_scale", ks.half(), TypeError, r"k_scale"),
        ("k_scale", ks.cpu(), ValueError, r"k_scale"),
        ("k_scale", 0.5, TypeError, r"k_scale"),
        ("v_cache", base["v_cache"].view(torch.uint8), (TypeError, ValueError), r"v_cache|k_cache"),
    ]
    for key, val, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            loader.flint_qkv_fused(**dict(base, **{key: val}))
    torch.cuda.synchronize()
    for name in ("k_cache", "v_cache"):
        assert (base[name].view(torch.uint8) == FP8_CACHE_POISON).all(), f"{name} written by a rejected call"
    bf = make_case(3, *pick_heads(gpu_bundle), True, seed=11)  # a BF16 cache with scales
    with pytest.raises(ValueError, match=r"k_scale|v_scale|scale"):
        loader.flint_qkv_fused(**op_args(bf), k_scale=ks, v_scale=ks)
    assert bf["k_cache"].isnan().all() and bf["v_cache"].isnan().all()
    kb, vb = case["k_cache"].clone(), case["v_cache"].clone()
    q, r = loader.flint_qkv_fused(**base)
    torch.cuda.synchronize()
    check(case, q, r, kb, vb)


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_fp8_cache_bytes_from_the_bf16_values(gpu_bundle, fmt, design):
    """An FP8 cache holds, bit for bit, e4m3(bf16 value / scale) (round to nearest even, saturated at ±448) of
    the values the same call writes into a BF16 cache; q is bit-identical. Every FP8 variant, M = 1..17 and
    M = 32, 33 and 64, so every token tile's kernel runs (asserted): check() holds FP8 caches to fp8_close
    only, which accepts a truncating conversion or one from the fp32 value, and test_token_tiles_agree runs
    BF16 caches."""
    import loader
    from loader import runtime

    if not _has_design(gpu_bundle, design):
        pytest.skip(f"the bundle has no {design}-design qkv kernels")
    have16 = set(variants(gpu_bundle, fmt, "bf16"))
    both = [v for v in variants(gpu_bundle, fmt, "fp8_e4m3") if v in have16]
    assert both, f"the bundle has no {fmt} qkv variant with both a BF16 and an FP8 KV cache"
    runtime.thread_cache().clear()  # (what ran, below: this test's launchers only)
    for i, (rope, (nq, nkv)) in enumerate(both):
        for m in (*range(1, 18), 32, 33, 64):
            seed = 5000 + 100 * i + m
            c8 = make_case(m, nq, nkv, rope, seed=seed, fmt=fmt, kv_dtype="fp8_e4m3", cache_u8=(m % 2 == 0))
            c16 = make_case(m, nq, nkv, rope, seed=seed, fmt=fmt)
            with loader.launch_options(design=design):
                q8, r8 = run(c8)
                q16, r16 = run(c16)
            torch.cuda.synchronize()
            assert torch.equal(q8, q16) and torch.equal(r8, r16), f"{rope} {nq}x{nkv} M={m}: q differs"
            for name, scale in (("k_cache", c8["k_scale"]), ("v_cache", c8["v_scale"])):
                b16 = c16[name]
                written = ~b16.isnan()
                want = torch.full(b16.shape, FP8_CACHE_POISON, dtype=torch.uint8, device="cuda")
                want[written] = fp8_cache_value(b16[written], scale).view(torch.uint8)
                got = c8[name].view(torch.uint8)
                diff = got != want
                assert not diff.any(), (
                    f"{rope} {nq}x{nkv} M={m} {name}: {int(diff.sum())} bytes differ from e4m3(bf16 / scale)"
                )

    def fp8(e):  # this test's kernels: the fused op's with an FP8 cache, of this format and design
        return (e.kind == "qkv" and kv_of(e.spec) == "fp8_e4m3" and e.spec["weight_format"] == fmt
                and e.spec.get("norm", "separate") == design)  # fmt: skip

    ran = {v.entry.spec.get("max_m", 8) for v in runtime.thread_cache().values()
           if isinstance(v, runtime.Launcher) and fp8(v.entry)}  # fmt: skip
    arch = device_arch()
    tiles = {e.spec.get("max_m", 8) for e in gpu_bundle.manifest.kernels if fp8(e) and e.arch == arch}
    assert ran == tiles, f"FP8-cache kernels of tiles {sorted(tiles - ran)} never ran"


def test_slow_producer(gpu_bundle):
    """A debug bundle whose norm kernel busy-waits ~1 ms before writing xn (configs/debug_slow_producer.yaml,
    built into build/debug or $FLINT_AOT_DEBUG_BUNDLE): the qkv kernel, which starts streaming its weights
    as soon as the norm kernel starts, must still read the new xn. Inputs change between calls, so a kernel
    that did not wait would read the previous call's activations (or garbage) and fail the comparison. The
    bundle has no 32-token tile: M = 17..32 runs the 64-token kernels, whose NVFP4 one then takes its
    fewer-group paths (no pass at 3 groups; one pass and no refill at 4), which a full bundle never
    reaches."""
    import os

    import loader
    from loader import runtime
    from tests.conftest import ROOT

    path = os.environ.get("FLINT_AOT_DEBUG_BUNDLE") or str(ROOT / "build" / "debug")
    if not os.path.exists(os.path.join(path, "manifest.json")):
        how = f"no debug bundle at {path}: flint-aot build configs/debug_slow_producer.yaml -o {path}"
        if os.environ.get("FLINT_REQUIRE_DEBUG_BUNDLE"):
            pytest.fail(how)
        pytest.skip(how)
    with pytest.warns(UserWarning, match="diagnostic build"):
        b = loader.load_bundle(path)
    try:
        assert b.manifest.config["diagnostics"]["norm_spin_cycles"] >= 1_000_000, b.manifest.config
        norms = [e for e in b.manifest.kernels if e.kind == "norm" and e.arch == "sm_90a"]
        assert norms
        tiles = {e.spec.get("max_m", 8) for e in b.manifest.kernels if e.kind == "qkv"}
        assert 64 in tiles and 32 not in tiles, tiles
        cases = [("bf16", m) for m in (1, 5, 8, 13, 16, 24)]
        cases += [("nvfp4", m) for m in (3, 17, 24, 25, 32, 40, 64)]
        for fmt, m in cases:
            for i, (rope, (nq, nkv)) in enumerate(variants(b, fmt)):
                c = make_case(m, nq, nkv, rope, seed=7000 + 10 * m + i, residual=(m % 2 == 1), fmt=fmt)
                kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
                q, res_out = run(c)
                torch.cuda.synchronize()
                check(c, q, res_out, kb, vb)
                if fmt == "nvfp4" and m in (17, 25):  # the 64-token kernel's fewer-group paths, bit for bit
                    c = make_case(m, nq, nkv, rope, seed=7500 + m + i, residual=True, fmt=fmt)
                    _agrees_with_8_token_calls(c, "separate", (rope, nq, nkv, m))
        # what ran (this thread's plans and launchers, emptied by load_bundle): every call the two-kernel
        # design, its norm kernel a spinning one of the debug bundle
        cache = runtime.thread_cache()
        plans = [p for k, ps in cache.items() if k[0] == "qkv" for p in ps]
        assert plans and all(p.xn for p in plans), "a call did not run the norm kernel (prologue design?)"
        ran = [v.entry for v in cache.values() if isinstance(v, runtime.Launcher) and v.entry.kind == "norm"]
        assert ran and all(e.sha256 in {n.sha256 for n in norms} for e in ran), ran
    finally:
        loader.load_bundle(gpu_bundle.path)


def test_graph_of_28_layers_at_m64(gpu_bundle):
    """A decode step's attention inputs at the op's largest M: 28 layers of distinct weights (a Qwen3-1.7B
    depth) at M = 64 captured in one CUDA graph and replayed on new inputs give, bit for bit, what the same
    calls give eagerly (q, residual_out and every cache byte of every layer), and agree with the reference."""
    nq, nkv = pick_heads(gpu_bundle, "bf16", "bf16", prefer=((16, 8),))
    m, layers = 64, 28
    cs = [make_case(m, nq, nkv, True, seed=9000 + i, num_blocks=8) for i in range(layers)]

    def step():
        return [run(c) for c in cs]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # modules loaded, plans built
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        outs = step()
    for i, c in enumerate(cs):  # new inputs into the captured tensors, caches poisoned
        n = make_case(m, nq, nkv, True, seed=9100 + i, num_blocks=8)
        for key in ("x", "residual", "positions"):
            c[key].copy_(n[key])
        poison_cache_(c["k_cache"])
        poison_cache_(c["v_cache"])
    before = [(c["k_cache"].clone(), c["v_cache"].clone()) for c in cs]
    g.replay()
    torch.cuda.synchronize()
    replayed = [(q.clone(), r.clone(), c["k_cache"].clone(), c["v_cache"].clone())
                for (q, r), c in zip(outs, cs, strict=True)]  # fmt: skip
    for c, (kb, vb) in zip(cs, before, strict=True):
        c["k_cache"].copy_(kb)
        c["v_cache"].copy_(vb)
    eager = step()
    torch.cuda.synchronize()
    bits = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    for i, (c, (q, r, k, v), (qe, re)) in enumerate(zip(cs, replayed, eager, strict=True)):
        assert torch.equal(bits(q), bits(qe)) and torch.equal(bits(r), bits(re)), i
        assert torch.equal(bits(k), bits(c["k_cache"])) and torch.equal(bits(v), bits(c["v_cache"])), i
    check(cs[-1], eager[-1][0], eager[-1][1], *before[-1])

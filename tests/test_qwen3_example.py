"""examples/qwen3_decode.py: a Qwen3 model (transformers, random weights) decoding through the op.

CPU: the example end to end with its pure-torch op (--backend reference --tiny), its exit status on a failed
bound, and that pure-torch op (it stands in for the kernel there) against the op written out in float64 in
this file, itself checked against Hugging Face's own Qwen3 modules.
GPU: short loader-backed runs (BF16 and NVFP4 weights, FP8 cache) held to the example's acceptance bounds.

The cases that build the model need `transformers` (the `example` extra, not installed by CI: it is large)
and skip one by one without it (they fail instead with FLINT_REQUIRE_TRANSFORMERS=1, as tools/gpu_check.sh
runs them); the op's own cases need torch only and run everywhere (tests/test_suite_cpu.py checks that they
do).
"""

import importlib.util
import os

import pytest
import torch

from tests.conftest import ROOT, needs_gpu

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.fixture
def transformers_installed():
    """Skip without transformers; fail where FLINT_REQUIRE_TRANSFORMERS=1 (tools/gpu_check.sh sets it on the
    GPU machine, whose image has it: there the GPU case at M = 64 must not skip unnoticed)."""
    if not HAS_TRANSFORMERS:
        why = "needs transformers (pip install -e '.[example]'): builds the Qwen3 model"
        if os.environ.get("FLINT_REQUIRE_TRANSFORMERS"):
            pytest.fail(f"{why}; required here (FLINT_REQUIRE_TRANSFORMERS is set)")
        pytest.skip(why)


needs_transformers = pytest.mark.usefixtures("transformers_installed")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("qwen3_decode", ROOT / "examples" / "qwen3_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TINY = ["--backend", "reference", "--tiny", "--layers", "2", "--steps", "8", "--device", "cpu"]


@needs_transformers
def test_cpu_reference_backend_passes(example, capsys):
    r = example.run(TINY)
    out = capsys.readouterr().out
    assert r["passed"], r["checks"]
    tf = r["comparisons"]["ours eager vs model"]
    assert tf["top1"] == 1.0
    assert len(tf["rel"]) == 8 and 0 < tf["max"] <= r["bound"]  # > 0: the two paths do round differently
    assert r["divergence"] is None and r["tokens_ours"] == r["tokens_model"]
    assert len(set(r["tokens_model"])) > 1  # the random model does not just repeat a token
    static = r["comparisons"]["ours static step (CPU, no graph) vs model"]
    assert static["ok"] and static["top1"] == 1.0
    assert set(r["latency_ms"]) and all(v > 0 for v in r["latency_ms"].values())
    assert "PASS" in out and "per-token decode latency" in out


@needs_transformers
@pytest.mark.parametrize("model", ["qwen3-0.6b", "qwen3-8b", "llama-3.1-8b"])
def test_cpu_reference_backend_other_models(example, model, capsys):
    """The other model shapes (hidden 1024 and 4096; Llama without q/k norm, LlamaForCausalLM's own modules
    as the reference), a sequence and a batch of three: the logits within the bound measured in the same run
    at every step, top-1 agreeing wherever the reference's margin is not a near-tie (r["passed"]: the
    example's own rule; these random models have near-ties at some steps)."""
    r = example.run([*TINY, "--model", model, "--steps", "6", "--no-latency", "--batch", "3"])
    out = capsys.readouterr().out
    assert r["passed"], r["checks"]
    tf = r["comparisons"]["ours eager vs model"]
    assert tf["ok"] and tf["top1"] >= 0.5 and 0 < tf["max"] <= r["bound"]
    assert r["batch"]["ok"] and 0 < r["batch"]["max"] <= r["batch"]["bound"]
    want = "LlamaForCausalLM" if model.startswith("llama") else "Qwen3ForCausalLM"
    assert f"{want} ({model})" in out and f"hidden {example.MODELS[model]['hidden']}," in out


@needs_transformers
def test_cpu_batched_decode_passes(example):
    """Three sequences of different prompt lengths decoding together (one op call of M = 3 per layer and
    step, each token at its own position and slots): each sequence within the bound against the model."""
    r = example.run([*TINY, "--steps", "4", "--no-latency", "--batch", "3"])
    b = r["batch"]
    assert r["passed"] and b["ok"] and b["lens"] == [20, 23, 26]
    assert 0 < b["max"] <= b["bound"] and b["top1"] == 1.0


@needs_transformers
def test_cpu_failed_bound_exits_nonzero(example):
    # the same run with every bound scaled to ~0: the (nonzero) logit error must fail it
    assert example.main([*TINY, "--steps", "4", "--no-latency", "--bound-scale", "1e-6"]) == 1


M, NQ, NKV, D, THETA = 4, 16, 8, 128, 1e6


def _op_case(weights):
    """Random inputs of one call (M = 4, heads (16, 8), positions up to 4095), the dense float64 weight."""
    from loader import nvfp4

    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    c = dict(
        x=r(M, 2048).bfloat16(), residual=r(M, 2048).bfloat16(), norm_weight=(1 + 0.2 * r(2048)).bfloat16(),
        q_norm_weight=(1 + 0.2 * r(D)).bfloat16(), k_norm_weight=(1 + 0.2 * r(D)).bfloat16(),
        weight=(0.02 * r((NQ + 2 * NKV) * D, 2048)).bfloat16(), weight_scale=None, global_scale=None,
        positions=torch.tensor([5, 17, 1000, 4095]),
    )  # fmt: skip
    c["dense"] = c["weight"].double()
    if weights == "nvfp4":
        c["weight"], c["weight_scale"], c["global_scale"] = nvfp4.quantize(c["weight"])
        c["dense"] = nvfp4.dequantize(c["weight"], c["weight_scale"], c["global_scale"], dtype=torch.float64)
    return c


def _float64_op(c, eps=1e-6, qk_eps=1e-6):
    """The op written out in float64, no rounding after the residual add (docs/numerics.md §1-3): RMSNorm,
    the projection, per-head RMSNorm of q and k, NeoX RoPE as a complex rotation with angles computed here
    (theta 1e6). Shares no code with the op or loader.reference. Returns r (bf16), q [M, 16, 128], k and v
    [M, 8, 128] (float64)."""
    r = (c["x"].double() + c["residual"].double()).bfloat16()
    h = r.double()
    xn = h / (h.pow(2).mean(-1, keepdim=True) + eps).sqrt() * c["norm_weight"].double()
    heads = torch.einsum("mk,nk->mn", xn, c["dense"]).view(M, NQ + 2 * NKV, D)
    q, k, v = heads.split([NQ, NKV, NKV], dim=1)

    def norm_rope(y, w):
        y = y / (y.pow(2).mean(-1, keepdim=True) + qk_eps).sqrt() * w.double()
        ang = c["positions"].double()[:, None] * THETA ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        z = (
            torch.complex(y[..., : D // 2], y[..., D // 2 :])
            * torch.polar(torch.ones_like(ang), ang)[:, None]
        )
        return torch.cat([z.real, z.imag], dim=-1)

    return r, norm_rope(q, c["q_norm_weight"]), norm_rope(k, c["k_norm_weight"]), v


def _per_head_error(got, want):
    """|got - want| per element over the RMS of want's head ([..., 128], per token and head)."""
    return (got.double() - want).abs() / want.pow(2).mean(-1, keepdim=True).sqrt()


# The op's bf16 roundings (xn twice, qkv, the output: 2^-9 each, relative) against exact arithmetic: per
# element a few of them times the element's size, which reaches ~4x its head's RMS. Measured on this case
# (BF16 / NVFP4 weights): worst element of q 2.1 / 1.9 %, k 1.9 / 1.7 %, v 1.1 / 1.1 % of its head's RMS;
# q norm-wise 0.33 / 0.33 %. A fault (a wrong weight, head, norm or rotation) moves elements by tens of %.
ELEMENT = 2**-5  # per element, of the head's RMS (3.1 %)
NORMWISE = 2**-7  # relative Frobenius error of q (0.78 %)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_torch_op_matches_float64(example, weights, kv):
    """The example's TorchQKVFused (its --backend reference) against the op written out in float64 here
    (_float64_op): the residual exact, q and the written k/v within the op's bf16 roundings, element by
    element; k/v written at exactly the mapped slots (nothing else), a negative slot and tokens beyond
    len(slot_mapping) not written."""
    from loader.reference import make_cos_sin_cache
    from tests.helpers import fp8_close

    c = _op_case(weights)
    slots = torch.tensor([3, 40, -1])  # token 2 not written (negative), token 3 beyond the mapping
    dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    kc = torch.full((4, 16, NKV, D), float("nan")).to(dtype)
    vc = torch.full((4, 16, NKV, D), float("nan")).to(dtype)
    scales = {"k_scale": torch.tensor([0.02]), "v_scale": torch.tensor([0.015])} if kv == "fp8" else {}
    cos_sin = make_cos_sin_cache(4096, base=THETA)

    q, r_out = example.TorchQKVFused()(
        c["x"], c["residual"], c["norm_weight"], 1e-6, c["weight"], c["weight_scale"], c["global_scale"],
        c["q_norm_weight"], c["k_norm_weight"], 1e-6, cos_sin, c["positions"], kc, vc, slots, NQ, NKV,
        **scales,
    )  # fmt: skip
    r, q64, k64, v64 = _float64_op(c)
    assert torch.equal(r_out.view(torch.int16), r.view(torch.int16))
    assert q.shape == (M, NQ * D) and q.dtype == torch.bfloat16
    q = q.view(M, NQ, D)
    assert ((q.double() - q64).norm() / q64.norm()).item() < NORMWISE
    assert _per_head_error(q, q64).max().item() < ELEMENT
    # the caches: written at slots 3 and 40 (tokens 0 and 1), NaN everywhere else
    written = torch.zeros(4 * 16, dtype=torch.bool)
    written[[3, 40]] = True
    for name, got, want, scale in (
        ("k", kc, k64, scales.get("k_scale")),
        ("v", vc, v64, scales.get("v_scale")),
    ):
        g = got.float().view(64, NKV, D)
        assert g[~written].isnan().all() and not g[written].isnan().any(), f"{name}: wrong slots written"
        if kv == "fp8":
            assert fp8_close(g[written], want[:2], scale.item()).all(), name
        else:
            assert _per_head_error(g[written], want[:2]).max().item() < ELEMENT, name


@needs_transformers
def test_float64_op_matches_hf_modules():
    """_float64_op, the yardstick above, against Hugging Face's own Qwen3 modules in float64 (input RMSNorm,
    q/k/v projections, q_norm / k_norm, rotary embedding and apply_rotary_pos_emb): the same conventions
    (NeoX halves, norm before RoPE, head order, theta). HF computes the norms in fp32 and the RoPE angles in
    fp32 (at position 4095 an fp32 angle is ~2.4e-4 rad off), hence 2^-8 of a head's RMS per element."""
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3 as hf

    c = _op_case("bf16")
    cfg = Qwen3Config(hidden_size=2048, num_attention_heads=NQ, num_key_value_heads=NKV, head_dim=D,
                      rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": THETA},
                      attention_bias=False)  # fmt: skip
    norm = hf.Qwen3RMSNorm(2048, eps=1e-6).double()
    attn = hf.Qwen3Attention(cfg, layer_idx=0).double()
    rotary = hf.Qwen3RotaryEmbedding(cfg)
    with torch.no_grad():
        norm.weight.copy_(c["norm_weight"].double())
        wq, wk, wv = c["dense"].split([NQ * D, NKV * D, NKV * D])
        for lin, w in ((attn.q_proj, wq), (attn.k_proj, wk), (attn.v_proj, wv)):
            lin.weight.copy_(w)
        attn.q_norm.weight.copy_(c["q_norm_weight"].double())
        attn.k_norm.weight.copy_(c["k_norm_weight"].double())
        r, q64, k64, v64 = _float64_op(c)
        h = norm(r.double())[None]  # [1, M, 2048]: the M tokens as one sequence at their positions
        q = attn.q_norm(attn.q_proj(h).view(1, M, NQ, D)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(1, M, NKV, D)).transpose(1, 2)
        v = attn.v_proj(h).view(1, M, NKV, D)
        cos, sin = rotary(h, c["positions"][None])
        q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    for name, got, want in (
        ("q", q[0].transpose(0, 1), q64),
        ("k", k[0].transpose(0, 1), k64),
        ("v", v[0], v64),
    ):
        assert _per_head_error(got, want).max().item() < 2**-8, name


@needs_gpu
@needs_transformers
@pytest.mark.parametrize(
    "weights,kv", [("bf16", "bf16"), ("nvfp4", "bf16"), ("bf16", "fp8")], ids=["bf16", "nvfp4", "fp8-cache"]
)
def test_gpu_loader_backend(example, gpu_bundle, weights, kv, capsys):
    """4 layers, 16 steps through loader.flint_qkv_fused (eager and CUDA graph) against the model, and 64
    sequences decoding together (M = 64, the op's largest tile)."""
    # no --bundle: the example uses the bundle gpu_bundle loaded (a reload would unload the kernels that
    # other tests' graphs may hold)
    args = ["--backend", "loader", "--layers", "4", "--steps", "16", "--weights", weights, "--kv-cache", kv,
            "--no-latency", "--batch", "64"]  # fmt: skip
    r = example.run(args)
    assert str(gpu_bundle.path) in capsys.readouterr().out
    assert r["passed"], r["checks"]
    for name, c in r["comparisons"].items():
        if c["bound"] is not None:
            assert c["max"] <= c["bound"], name
    assert r["comparisons"]["ours CUDA graph vs model"]["ok"]
    assert r["batch"]["ok"] and len(r["batch"]["lens"]) == 64  # 64 sequences: the op at M = 64

"""examples/qwen3_decode.py: a Qwen3 model (transformers, random weights) decoding through the op.

CPU: the example end to end with its pure-torch op (--backend reference --tiny), its exit status on a failed
bound, and that pure-torch op against loader.reference's float64 chain (docs/numerics.md): it stands in for
the kernel there.
GPU: short loader-backed runs (BF16 and NVFP4 weights, FP8 cache) held to the example's acceptance bounds.

The cases that build the model need `transformers` (the `example` extra, not installed by CI: it is large)
and skip one by one without it; the op's own cases need torch only and run everywhere
(tests/test_suite_cpu.py checks that they do).
"""

import importlib.util

import pytest
import torch

from tests.conftest import ROOT, needs_gpu

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="needs transformers (pip install -e '.[example]'): builds the Qwen3 model"
)


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


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_torch_op_matches_reference(example, weights, kv):
    """The example's TorchQKVFused (its --backend reference) against loader.reference's float64 chain:
    q within bf16 rounding, the residual exact, k/v written at exactly the mapped slots (nothing else), a
    negative slot and tokens beyond len(slot_mapping) not written."""
    from loader import nvfp4
    from loader.reference import expected_cache, make_cos_sin_cache, qkv_fused_ref

    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    m, nq, nkv, d = 4, 16, 8, 128
    x, res = r(m, 2048).bfloat16(), r(m, 2048).bfloat16()
    norm_w, qn, kn = (1 + 0.2 * r(2048)).bfloat16(), (1 + 0.2 * r(d)).bfloat16(), (1 + 0.2 * r(d)).bfloat16()
    w = (0.02 * r((nq + 2 * nkv) * d, 2048)).bfloat16()
    ws = gs = None
    dense = w
    if weights == "nvfp4":
        w, ws, gs = nvfp4.quantize(w)
        dense = nvfp4.dequantize(w, ws, gs)
    cos_sin = make_cos_sin_cache(4096, base=1e6)
    pos = torch.tensor([5, 17, 1000, 4095])
    slots = torch.tensor([3, 40, -1])  # token 2 not written (negative), token 3 beyond the mapping
    dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    kc = torch.zeros(4, 16, nkv, d).to(dtype)
    vc = torch.zeros(4, 16, nkv, d).to(dtype)
    scales = {"k_scale": torch.tensor([0.02]), "v_scale": torch.tensor([0.015])} if kv == "fp8" else {}
    ek, ev = kc.clone(), vc.clone()

    q, r_out = example.TorchQKVFused()(x, res, norm_w, 1e-6, w, ws, gs, qn, kn, 1e-6, cos_sin, pos, kc, vc,
                                       slots, nq, nkv, **scales)  # fmt: skip
    ref = qkv_fused_ref(x, res, norm_w, 1e-6, dense, qn, kn, 1e-6, cos_sin, pos, nq, nkv)
    assert torch.equal(r_out, ref["residual_out"])
    qr = ref["q"].reshape(m, -1)
    assert ((q.double() - qr).norm() / qr.norm()).item() < 2**-8  # bf16 rounding alone is ~2^-9.8 RMS
    assert ((q.double() - qr).abs().amax(-1) <= 2**-6 * qr.abs().amax(-1)).all()
    ek, ev = expected_cache(ek, ev, ref["k"], ref["v"], slots, scales.get("k_scale"), scales.get("v_scale"))
    # written values may differ by one rounding step (fp32 vs float64 chain); unwritten slots stay zero
    written = torch.zeros(4 * 16, dtype=torch.bool)
    written[[3, 40]] = True
    for got, want in ((kc, ek), (vc, ev)):
        gf, wf = got.float().reshape(64, -1), want.float().reshape(64, -1)
        assert (gf[~written] == 0).all()
        tol = (2**-3 * wf[written].abs() + 2**-9) if kv == "fp8" else (2**-7 * wf[written].abs() + 1e-6)
        assert ((gf[written] - wf[written]).abs() <= tol).all()
        assert (gf[written] == wf[written]).float().mean() > 0.98  # almost all bit-identical


@needs_gpu
@needs_transformers
@pytest.mark.parametrize(
    "weights,kv", [("bf16", "bf16"), ("nvfp4", "bf16"), ("bf16", "fp8")], ids=["bf16", "nvfp4", "fp8-cache"]
)
def test_gpu_loader_backend(example, gpu_bundle, weights, kv, capsys):
    """4 layers, 16 steps through loader.flint_qkv_fused (eager and CUDA graph) against the model, and 16
    sequences decoding together (M = 16)."""
    # no --bundle: the example uses the bundle gpu_bundle loaded (a reload would unload the kernels that
    # other tests' graphs may hold)
    args = ["--backend", "loader", "--layers", "4", "--steps", "16", "--weights", weights, "--kv-cache", kv,
            "--no-latency", "--batch", "16"]  # fmt: skip
    r = example.run(args)
    assert str(gpu_bundle.path) in capsys.readouterr().out
    assert r["passed"], r["checks"]
    for name, c in r["comparisons"].items():
        if c["bound"] is not None:
            assert c["max"] <= c["bound"], name
    assert r["comparisons"]["ours CUDA graph vs model"]["ok"]
    assert r["batch"]["ok"] and len(r["batch"]["lens"]) == 16  # 16 sequences: the op at M = 16

"""benchmarks/bench_decoder.py runs its torch variants on the CPU (a smoke test of the script: the model,
the attention input written in torch ops, torch.compile of it, the tables, its check of every variant's final
hidden state), and its torch attention input writes the new tokens' k and v into their own cache slots and
nowhere else, with the right values."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

_CXX = shutil.which("g++") or shutil.which("c++")


@pytest.mark.skipif(not _CXX, reason="torch.compile on the CPU needs a C++ compiler")
def test_bench_decoder_runs_on_cpu():
    args = ["--device", "cpu", "--layers", "1", "--m", "2", "--ctx", "32"]
    r = subprocess.run([sys.executable, "benchmarks/bench_decoder.py", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| torch eager | nan |" in r.stdout and "| torch.compile | nan |" in r.stdout
    # torch.compile against torch eager after one layer: measured 4.9e-3 (their roundings differ); the
    # script's own bound (MAX_ERROR, for 28 layers) is looser
    found = re.findall(
        r"^M=2 (.+): final hidden state within (\S+) of torch eager's .*: (ok|FAIL)", r.stdout, re.M
    )
    assert {name for name, _, _ in found} == {"torch eager", "torch.compile"}, r.stdout
    for name, err, verdict in found:
        assert verdict == "ok" and float(err) <= 0.02, (name, err, verdict)


BAD_SIZES = [(["--m", "65"], "--m takes 1..64"), (["--m", "0"], "--m takes 1..64"),
             (["--ctx", "100"], "--ctx must be a multiple of 16")]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), BAD_SIZES)
def test_bench_decoder_refuses_bad_sizes_by_name(args, message):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "benchmarks/bench_decoder.py", "--device", "cpu", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_torch_attention_input_writes_its_slots_and_no_other():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_decoder as bd

    md = bd.Model(3, 32, 1, "cpu")
    w = md.layers[0]
    kc0, vc0 = md.kc[0].clone(), md.vc[0].clone()
    q, r = bd.torch_attn_input(md.x, md.residual, w["in_norm"], w["qkv"], w["q_norm"], w["k_norm"],
                               md.cos_sin, md.positions, md.kc[0], md.vc[0], md.slots)  # fmt: skip
    assert q.shape == (3, bd.NQ * bd.D) and torch.equal(r, md.x + md.residual)
    changed = (md.kc[0] != kc0).flatten(1).any(1) | (md.vc[0] != vc0).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == sorted((md.slots // bd.BLOCK).tolist())
    slots = md.slots.tolist()
    flat_k = md.kc[0].view(-1, bd.NKV, bd.D)
    untouched = [s for s in range(flat_k.shape[0]) if s not in slots]
    assert torch.equal(flat_k[untouched], kc0.view(-1, bd.NKV, bd.D)[untouched])
    # the v rows written are the projection's v part, unnormalised
    xn = torch.nn.functional.rms_norm(r, (bd.H,), w["in_norm"], bd.EPS)
    qkv = xn @ w["qkv"].t()
    v = qkv[:, (bd.NQ + bd.NKV) * bd.D :].view(3, bd.NKV, bd.D)
    assert torch.equal(md.vc[0].view(-1, bd.NKV, bd.D)[slots], v)
    # the k rows written: the projection's k part through the per-head RMSNorm (k_norm) and NeoX RoPE at the
    # token's position, here in float64 (angles for theta 1e4 computed here, the rotation as a complex
    # product); the script's bf16 roundings (the norm's output and its weight product, RoPE's output) keep
    # each element within 2^-5 of its head's RMS (measured: 1.4 %)
    k = qkv[:, bd.NQ * bd.D : (bd.NQ + bd.NKV) * bd.D].double().view(3, bd.NKV, bd.D)
    k = k / (k.pow(2).mean(-1, keepdim=True) + bd.EPS).sqrt() * w["k_norm"].double()
    half = bd.D // 2
    ang = md.positions.double()[:, None] * 1e4 ** (-torch.arange(half, dtype=torch.float64) * 2 / bd.D)
    z = torch.complex(k[..., :half], k[..., half:]) * torch.polar(torch.ones_like(ang), ang)[:, None]
    k = torch.cat([z.real, z.imag], dim=-1)
    got = md.kc[0].view(-1, bd.NKV, bd.D)[slots].double()
    err = (got - k).abs() / k.pow(2).mean(-1, keepdim=True).sqrt()
    assert err.max().item() < 2**-5, err.max().item()

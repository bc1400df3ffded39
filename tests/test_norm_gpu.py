"""Input-norm kernel on the GPU against the torch reference of SPEC §3.1."""

import pytest
import torch

from loader.reference import rms_norm_ref
from tests.conftest import needs_gpu

pytestmark = needs_gpu
K = 2048


def _inputs(m, seed, residual=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, K, device="cuda", generator=g).mul_(3).bfloat16()
    r = torch.randn(m, K, device="cuda", generator=g).bfloat16() if residual else None
    w = (1 + 0.5 * torch.randn(K, device="cuda", generator=g)).bfloat16()
    return x, r, w


def _ulp_diff(a, b):
    """Distance in bf16 ulps (integer view of the ordered bit patterns)."""
    def key(t):
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (key(a) - key(b)).abs()


def _check_xn(xn, ref):
    assert not xn.isnan().any()
    d = _ulp_diff(xn, ref)
    assert d.max().item() <= 1, f"max {d.max().item()} ulp"
    assert (d == 0).float().mean().item() >= 0.999


@pytest.mark.parametrize("m", range(1, 9))
def test_fused_add_rms_norm(gpu_bundle, m):
    import loader

    x, r, w = _inputs(m, 100 + m)
    xn, res_out = loader.fused_add_rms_norm(x, r, w, 1e-6)
    torch.cuda.synchronize()
    ref_xn, ref_res = rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(res_out, ref_res)
    _check_xn(xn, ref_xn)
    assert xn.data_ptr() != x.data_ptr() and res_out.data_ptr() not in (x.data_ptr(), r.data_ptr())


@pytest.mark.parametrize("m", range(1, 9))
def test_rms_norm(gpu_bundle, m):
    import loader

    x, _, w = _inputs(m, 200 + m, residual=False)
    xn = loader.rms_norm(x, w, 1e-5)
    torch.cuda.synchronize()
    _check_xn(xn, rms_norm_ref(x, None, w, 1e-5)[0])


def test_outputs_fully_written_over_poison(gpu_bundle, monkeypatch):
    """Outputs come from torch.empty; make that memory NaN first so unwritten elements would show."""
    import loader

    x, r, w = _inputs(8, 7)
    real_empty_like = torch.empty_like

    def poisoned(t, **kw):
        out = real_empty_like(t, **kw)
        return out.fill_(float("nan"))

    monkeypatch.setattr(torch, "empty_like", poisoned)
    xn, res_out = loader.fused_add_rms_norm(x, r, w, 1e-6)
    torch.cuda.synchronize()
    assert not xn.isnan().any() and not res_out.isnan().any()


def test_graph_capture_replay_with_new_inputs(gpu_bundle):
    import loader

    x, r, w = _inputs(4, 11)
    loader.fused_add_rms_norm(x, r, w, 1e-6)  # load the module before capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        xn, res_out = loader.fused_add_rms_norm(x, r, w, 1e-6)
        xn2 = loader.rms_norm(xn, w, 1e-6)
    for seed in (12, 13):
        nx, nr, _ = _inputs(4, seed)
        x.copy_(nx)
        r.copy_(nr)
        graph.replay()
        torch.cuda.synchronize()
        ref_xn, ref_res = rms_norm_ref(nx, nr, w, 1e-6)
        assert torch.equal(res_out, ref_res)
        _check_xn(xn, ref_xn)
        _check_xn(xn2, rms_norm_ref(xn, None, w, 1e-6)[0])


def test_pdl_chain_matches_serial(gpu_bundle):
    """Two norms chained (the second reads the first's output) give the same bits with and without PDL."""
    import loader

    x, r, w = _inputs(8, 21)
    outs = []
    for pdl in (True, False):
        loader.set_pdl(pdl)
        try:
            xn, res = loader.fused_add_rms_norm(x, r, w, 1e-6)
            xn2, res2 = loader.fused_add_rms_norm(xn, res, w, 1e-6)
            torch.cuda.synchronize()
            outs.append((xn2, res2))
        finally:
            loader.set_pdl(True)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ref1 = rms_norm_ref(x, r, w, 1e-6)
    ref2 = rms_norm_ref(ref1[0], ref1[1], w, 1e-6)
    _check_xn(outs[0][0], ref2[0])


def test_bad_arguments_raise_before_launch(gpu_bundle):
    import loader

    x, r, w = _inputs(2, 5)
    cases = [
        (lambda: loader.rms_norm(x.float(), w, 1e-6), TypeError, "x must be torch.bfloat16"),
        (lambda: loader.rms_norm(x[:, :1024], w, 1e-6), ValueError, r"x must have shape \[M, 2048\]"),
        (lambda: loader.rms_norm(torch.zeros(9, K, dtype=torch.bfloat16, device="cuda"), w, 1e-6),
         ValueError, "M = 9"),
        (lambda: loader.rms_norm(x.cpu(), w, 1e-6), ValueError, "CUDA device"),
        (lambda: loader.rms_norm(x.t().contiguous().t()[:, :], w, 1e-6), ValueError, "shape|contiguous"),
        (lambda: loader.rms_norm(x, w[:1024], 1e-6), ValueError, r"norm weight must have shape \[2048\]"),
        (lambda: loader.rms_norm(x, w, "1e-6"), TypeError, "eps must be a Python float"),
        (lambda: loader.rms_norm(x, w, float("nan")), ValueError, "eps must be finite"),
        (lambda: loader.fused_add_rms_norm(x, r[:1], w, 1e-6), ValueError, "residual must have shape"),
        (lambda: loader.fused_add_rms_norm(x, None, w, 1e-6), TypeError, "residual must be a tensor"),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn()
    torch.cuda.synchronize()
    xn = loader.rms_norm(x, w, 1e-6)  # the context is still healthy
    torch.cuda.synchronize()
    _check_xn(xn, rms_norm_ref(x, None, w, 1e-6)[0])

"""Input-norm kernel on the GPU against the torch reference (loader.reference.rms_norm_ref)."""

import pytest
import torch

from loader.reference import rms_norm_ref
from tests.helpers import K, assert_xn_close, bf16_ulps

pytestmark = pytest.mark.gpu


def _inputs(m, seed, residual=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, K, device="cuda", generator=g).mul_(3).bfloat16()
    r = torch.randn(m, K, device="cuda", generator=g).bfloat16() if residual else None
    w = (1 + 0.5 * torch.randn(K, device="cuda", generator=g)).bfloat16()
    return x, r, w


def _check_xn(xn, ref):
    assert not xn.isnan().any()
    d = bf16_ulps(xn, ref)
    assert d.max().item() <= 1, f"max {d.max().item()} ulp"
    assert (d == 0).float().mean().item() >= 0.999


@pytest.mark.parametrize("m", [*range(1, 18), 33, 64])
def test_fused_add_rms_norm(gpu_bundle, m):
    import loader

    x, r, w = _inputs(m, 100 + m)
    xn, res_out = loader.fused_add_rms_norm(x, r, w, 1e-6)
    torch.cuda.synchronize()
    ref_xn, ref_res = rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(res_out, ref_res)
    _check_xn(xn, ref_xn)
    assert xn.data_ptr() != x.data_ptr() and res_out.data_ptr() not in (x.data_ptr(), r.data_ptr())


@pytest.mark.parametrize("m", [*range(1, 18), 33, 64])
def test_rms_norm(gpu_bundle, m):
    import loader

    x, _, w = _inputs(m, 200 + m, residual=False)
    xn = loader.rms_norm(x, w, 1e-5)
    torch.cuda.synchronize()
    _check_xn(xn, rms_norm_ref(x, None, w, 1e-5)[0])


def test_outputs_fully_written_over_poison(gpu_bundle, monkeypatch):
    """The loader's outputs come from torch.empty / empty_like / empty_strided / Tensor.new_empty; make that
    memory NaN first so that an element the kernel does not write would show."""
    import loader

    x, r, w = _inputs(8, 7)
    poisoned = []

    def poisoning(real):
        def alloc(*args, **kw):
            out = real(*args, **kw)
            if out.is_floating_point():
                out.fill_(float("nan"))
                poisoned.append(out.data_ptr())
            return out

        return alloc

    for owner, name in ((torch, "empty_like"), (torch, "empty"), (torch, "empty_strided"),
                        (torch.Tensor, "new_empty")):  # fmt: skip
        monkeypatch.setattr(owner, name, poisoning(getattr(owner, name)))
    xn, res_out = loader.fused_add_rms_norm(x, r, w, 1e-6)
    xn1 = loader.rms_norm(x, w, 1e-6)
    torch.cuda.synchronize()
    monkeypatch.undo()
    assert {xn.data_ptr(), res_out.data_ptr(), xn1.data_ptr()} <= set(poisoned), (
        "the loader allocated an output with neither torch.empty nor torch.empty_like: poison it here too"
    )
    assert not xn.isnan().any() and not res_out.isnan().any() and not xn1.isnan().any()


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
        with loader.launch_options(pdl=pdl):
            xn, res = loader.fused_add_rms_norm(x, r, w, 1e-6)
            xn2, res2 = loader.fused_add_rms_norm(xn, res, w, 1e-6)
        torch.cuda.synchronize()
        outs.append((xn2, res2))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ref1 = rms_norm_ref(x, r, w, 1e-6)
    ref2 = rms_norm_ref(ref1[0], ref1[1], w, 1e-6)
    _check_xn(outs[0][0], ref2[0])


def test_bad_arguments_raise_before_launch(gpu_bundle):
    import loader

    x, r, w = _inputs(2, 5)
    cases = [
        (lambda: loader.rms_norm(x.float(), w, 1e-6), TypeError, r"\bx\b"),
        (lambda: loader.rms_norm(x[:, :1024], w, 1e-6), ValueError, r"\bx\b"),
        (lambda: loader.rms_norm(torch.zeros(gpu_bundle.max_tokens("norm") + 1, K, dtype=torch.bfloat16,
                                             device="cuda"), w, 1e-6),
         ValueError, rf"\bM\b.*{gpu_bundle.max_tokens('norm')} \(the bundle's norm.max_tokens\)"),
        (lambda: loader.rms_norm(x.cpu(), w, 1e-6), ValueError, r"(?i)cuda|device"),
        (lambda: loader.rms_norm(torch.zeros(2, 2 * K, dtype=torch.bfloat16, device="cuda")[:, :K], w, 1e-6),
         ValueError, r"(?i)contiguous"),
        (lambda: loader.rms_norm(x, w[:1024], 1e-6), ValueError, r"weight"),
        (lambda: loader.rms_norm(x, w, "1e-6"), TypeError, r"eps"),
        (lambda: loader.rms_norm(x, w, float("nan")), ValueError, r"eps"),
        (lambda: loader.rms_norm(x, w, -1e-6), ValueError, r"eps"),
        (lambda: loader.rms_norm(x, w, True), TypeError, r"eps"),
        (lambda: loader.fused_add_rms_norm(x, r[:1], w, 1e-6), ValueError, r"residual"),
        (lambda: loader.fused_add_rms_norm(x, None, w, 1e-6), (TypeError, ValueError), r"residual"),
    ]  # fmt: skip
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn()
    torch.cuda.synchronize()
    xn = loader.rms_norm(x, w, 1e-6)  # the context is still healthy
    torch.cuda.synchronize()
    _check_xn(xn, rms_norm_ref(x, None, w, 1e-6)[0])


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m,tile", [(1, 8), (5, 8), (8, 8), (1, 64), (9, 16), (13, 16), (16, 16), (17, 32),
                                    (32, 32), (40, 64), (64, 64)])  # fmt: skip
def test_the_qkv_kernels_layouts_are_written_exactly(gpu_bundle, fmt, m, tile):
    """The norm kernel writing the layout a two-kernel qkv kernel reads (loader.abi.xn_strides: the 8-token
    kernels' padded rows, the token stream's ring; loader.abi.xn_pairs: for NVFP4 each 8 elements in the
    MMA pair order k0, k0 + 4, k0 + 1, k0 + 5, .., and for the 32- and 64-token kernels those pairs (BF16:
    plain pairs) in the wgmma tiles of loader.abi.WG_STRIDES), launched by name into a NaN-poisoned buffer
    with guard bands: every token's values land at their offsets with the bits of the op's plain-row xn; the
    pads, the rows of tokens past M in the ring's last group and the guard bands stay NaN."""
    import loader
    from loader import abi

    x, r, w = _inputs(m, 300 + m)
    want, want_res = loader.fused_add_rms_norm(x, r, w, 1e-6)
    spec = abi.qkv_spec(fmt, True, 16, 2, max_m=tile)
    s, pairs = abi.xn_strides(spec), abi.xn_pairs(spec)
    assert pairs == (3 if fmt == "bf16" else 2) if tile in (32, 64) else pairs == (0 if fmt == "bf16" else 1)
    n, guard = abi.xn_numel(m, s), 4096
    buf = torch.full((n + 2 * guard,), float("nan"), device="cuda").bfloat16()
    res_out = torch.full_like(x, float("nan"))
    loader.launch_kernel("norm", {"residual": True}, (m,), x=x, residual=r, residual_out=res_out,
                         xn=buf[guard:], weight=w, eps=1e-6, xn_group=s[0], xn_row=s[1],
                         xn_quarter=s[2], xn_pairs=pairs)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(res_out, want_res)
    t = torch.arange(m, device="cuda")[:, None]
    k = torch.arange(2048, device="cuda")[None, :]
    j = k % 8  # k's slot in its chunk: plain, or the pair order (k0 + j at 2 j, k0 + 4 + j at 2 j + 1)
    slot = torch.where(j < 4, 2 * j, 2 * (j - 4) + 1) if pairs in (1, 2) else j
    off = guard + (t // 8) * s[0] + (t % 8) * s[1] + (k // 512) * s[2] + (k % 512 - j + slot)
    if pairs == 2:  # k's 16-byte chunk cq of its quarter is lane tq's at MMA step i; pair j % 4 of it goes to
        # word tq of logical chunk 4 i + j % 4 of token n's row, swizzled (docs/kernels.md §2.6)
        cq, n = k % 512 // 8, t % 8
        tq = cq // 4 % 4
        c = 4 * (cq // 16 * 4 + (cq % 4 ^ tq & 2)) + j % 4
        within = c // 8 * 512 + n * 64 + (c % 8 ^ n) * 8 + tq * 2 + j // 4
        off = guard + (t // 8) * s[0] + (k // 512) * s[2] + within
    if pairs == 3:  # BF16: k's chunk cq of its quarter is lane cq % 4's at step (k block) cq // 4; its pair
        # j // 2 goes to word cq % 4 of logical chunk 4 (cq // 4) + j // 2, swizzled
        cq, n = k % 512 // 8, t % 8
        tq = cq % 4
        c = 4 * (cq // 4) + j // 2
        within = c // 8 * 512 + n * 64 + (c % 8 ^ n) * 8 + tq * 2 + j % 2
        off = guard + (t // 8) * s[0] + (k // 512) * s[2] + within
    assert torch.equal(buf[off], want), "a value not at its layout's offset"
    rest = torch.ones_like(buf, dtype=torch.bool)
    rest[off.flatten()] = False
    assert buf[rest].isnan().all(), f"{(~buf[rest].isnan()).sum().item()} elements written outside the layout"


@pytest.mark.parametrize("m", [65, 1000, 16384])
def test_the_norms_at_prefill_sizes(gpu_bundle, m):
    """M past the decode sizes (a prefill chunk, up to the bundle's norm.max_tokens): one CTA per token as at
    M <= 64, every element of xn within what a one-ulp shift of the normalised value explains and 99.9 %
    exact (tests.helpers.assert_xn_close: over 33 million elements a few are 2 ulps off, as the arithmetic
    allows), residual_out exact, outputs poisoned first (torch.empty_like is NaN-filled) and written whole."""
    import loader

    assert m <= gpu_bundle.max_tokens("norm")
    x, r, w = _inputs(m, 300 + m)
    real = torch.empty_like
    try:
        torch.empty_like = lambda t, **kw: real(t, **kw).fill_(float("nan"))
        xn, res_out = loader.fused_add_rms_norm(x, r, w, 1e-6)
        xn0 = loader.rms_norm(x, w, 1e-5)
    finally:
        torch.empty_like = real
    torch.cuda.synchronize()
    assert torch.equal(res_out, rms_norm_ref(x, r, w, 1e-6)[1])
    assert_xn_close(xn, x, r, w, 1e-6)
    assert_xn_close(xn0, x, None, w, 1e-5)


def test_the_norms_refuse_more_tokens_than_the_bundle_serves(gpu_bundle):
    import loader

    limit = gpu_bundle.max_tokens("norm")
    x, r, w = _inputs(limit + 1, 5)
    for call in (lambda: loader.rms_norm(x, w, 1e-6), lambda: loader.fused_add_rms_norm(x, r, w, 1e-6)):
        with pytest.raises(ValueError, match=rf"1 <= M <= {limit} \(the bundle's norm.max_tokens\)"):
            call()

"""The hidden-size and q/k-norm axes on the GPU: every (hidden, q/k norm, RoPE, heads) variant of the bundle
at the tile edges against the float64 reference, its tiles agreeing bit for bit, the unfused path giving the
fused op's bits, the norms and the GEMV at every hidden size, and calls the bundle cannot serve refused with
what it has. Run against the axes bundle (`flint-aot build configs/axes.yaml -o build/axes`, hidden 1024 and
1536, q/k norm on and off: tools/gpu_check.sh runs this file with FLINT_AOT_BUNDLE=build/axes) these cover
the axes; against Flint's own bundle the same tests cover hidden 2048 with q/k norm."""

import pytest
import torch

from loader import abi, nvfp4
from loader.reference import gemv_ref, rms_norm_ref
from tests.helpers import (
    D,
    assert_gemv_close,
    assert_xn_close,
    check,
    device_arch,
    kv_of,
    make_case,
    op_args,
    rel,
    run,
    run_unfused,
)

pytestmark = pytest.mark.gpu
KV = ["bf16", "fp8_e4m3"]
EDGES = (1, 7, 8, 9, 16, 17, 32, 33, 63, 64)  # both sides of every token tile's edge


def shapes(bundle, fmt: str, kv: str = "bf16") -> list[tuple]:
    """Sorted (hidden, qk_norm, rope, (nq, nkv)) of the bundle's two-kernel-design qkv kernels of weight
    format fmt and KV-cache dtype kv on this GPU's architecture."""
    arch = device_arch()
    out = set()
    for e in bundle.manifest.kernels:
        s = e.spec
        if (e.kind == "qkv" and e.arch == arch and s["weight_format"] == fmt and kv_of(s) == kv
                and s.get("norm", "separate") == "separate"):  # fmt: skip
            out.add((abi.spec_hidden(s), s.get("qk_norm", True), s["rope"], tuple(s["heads"])))
    return sorted(out)


def hiddens(bundle, kind: str) -> list[int]:
    arch = device_arch()
    return sorted({abi.spec_hidden(e.spec) for e in bundle.manifest.kernels
                   if e.kind == kind and e.arch == arch})  # fmt: skip


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_every_shape_at_the_tile_edges(gpu_bundle, fmt, kv):
    """Every variant, at both sides of every tile edge, with and without a residual: q per element within
    ELEMENT_TOL of its head's RMS in the float64 reference, residual_out exact, the NaN-poisoned caches
    written at exactly the mapped slots (tests.helpers.check)."""
    vs = shapes(gpu_bundle, fmt, kv)
    assert vs, f"the bundle has no {fmt} qkv kernels with a {kv} cache"
    for i, (hidden, qkn, rope, (nq, nkv)) in enumerate(vs):
        for m in EDGES:
            c = make_case(m, nq, nkv, rope, seed=40_000 + 100 * i + m, residual=(m % 2 == 1), fmt=fmt,
                          kv_dtype=kv, hidden=hidden, qk_norm=qkn)  # fmt: skip
            kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
            q, res_out = run(c)
            torch.cuda.synchronize()
            check(c, q, res_out, kb, vb)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_token_bits_do_not_depend_on_m(gpu_bundle, fmt):
    """A token's bits are those of the 8-token kernel whatever the tile: a call of M tokens equals, q row by
    row and every cache byte, calls of 8 tokens at a time, at every hidden size and q/k-norm setting."""
    vs = shapes(gpu_bundle, fmt)
    assert vs
    bits = lambda t: t.contiguous().view(torch.int16)  # noqa: E731
    for i, (hidden, qkn, rope, (nq, nkv)) in enumerate(vs):
        for m in (9, 17, 33, 64):
            c = make_case(m, nq, nkv, rope, seed=41_000 + 100 * i + m, fmt=fmt, hidden=hidden, qk_norm=qkn)
            parts = dict(c, k_cache=c["k_cache"].clone(), v_cache=c["v_cache"].clone())
            q, r = run(c)
            pieces = []
            for a in range(0, m, 8):
                h = dict(parts, **{k: c[k][a : a + 8].contiguous()
                                   for k in ("x", "residual", "positions", "slot_mapping")})  # fmt: skip
                pieces.append(run(h))
            torch.cuda.synchronize()
            what = (hidden, qkn, rope, nq, nkv, m)
            assert torch.equal(bits(q), bits(torch.cat([p[0] for p in pieces]))), what
            assert torch.equal(bits(r), bits(torch.cat([p[1] for p in pieces]))), what
            for name in ("k_cache", "v_cache"):
                assert torch.equal(bits(c[name]), bits(parts[name])), (name, *what)


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_fused_equals_unfused(gpu_bundle, fmt, kv):
    """norm -> gemv -> qk_norm_rope_cache gives the fused op's bits at every hidden size and q/k-norm setting
    the bundle has both paths for: residual_out, q and every cache byte."""
    import loader

    arch = device_arch()
    qknrc = {(e.spec.get("qk_norm", True), e.spec["rope"], kv_of(e.spec)) for e in gpu_bundle.manifest.kernels
             if e.kind == "qk_norm_rope_cache" and e.arch == arch}  # fmt: skip
    gemv = set(hiddens(gpu_bundle, "gemv"))
    vs = [v for v in shapes(gpu_bundle, fmt, kv) if (v[1], v[2], kv) in qknrc and v[0] in gemv]
    if not vs:
        pytest.skip(f"the bundle has no unfused path beside its {fmt} {kv}-cache qkv kernels")
    bits = lambda t: t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.uint8)  # noqa: E731
    for i, (hidden, qkn, rope, (nq, nkv)) in enumerate(vs):
        for m in (1, 8, 9, 33, 64):
            c = make_case(m, nq, nkv, rope, seed=42_000 + 100 * i + m, residual=(m != 8), fmt=fmt,
                          kv_dtype=kv, hidden=hidden, qk_norm=qkn)  # fmt: skip
            u = {k: (v.clone() if k in ("k_cache", "v_cache") else v) for k, v in c.items()}
            q, res_out = loader.flint_qkv_fused(**op_args(c))
            q2, r2, _ = run_unfused(c, u)
            torch.cuda.synchronize()
            what = (hidden, qkn, rope, nq, nkv, m)
            assert torch.equal(bits(res_out), bits(r2)), what
            assert torch.equal(bits(q), bits(q2)), ("q", *what)
            for name in ("k_cache", "v_cache"):
                assert torch.equal(bits(c[name]), bits(u[name])), (name, *what)


def test_norms_at_every_hidden_size(gpu_bundle):
    """rms_norm and fused_add_rms_norm at every hidden size of the bundle, decode and prefill M: xn within
    one ulp of the normalised value (assert_xn_close), residual_out exact, NaN-poisoned outputs never read."""
    import loader

    ks = hiddens(gpu_bundle, "norm")
    assert ks
    g = torch.Generator(device="cuda").manual_seed(43)
    for k in ks:
        w = (1 + 0.3 * torch.randn(k, device="cuda", generator=g)).bfloat16()
        for m in (1, 8, 64, 65, 1000):
            x = (2 * torch.randn(m, k, device="cuda", generator=g)).bfloat16()
            res = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            xn = loader.rms_norm(x, w, 1e-6)
            xn2, ro = loader.fused_add_rms_norm(x, res, w, 1e-6)
            torch.cuda.synchronize()
            assert_xn_close(xn, x, None, w, 1e-6, f"rms_norm K={k} M={m}")
            assert_xn_close(xn2, x, res, w, 1e-6, f"fused_add_rms_norm K={k} M={m}")
            assert torch.equal(ro, rms_norm_ref(x, res, w, 1e-6)[1]), (k, m)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_gemv_at_every_hidden_size(gpu_bundle, fmt):
    """loader.gemv at every hidden size of the bundle: every element within one bf16 rounding plus the fp32
    accumulation bound of the float64 reference, and a call of M > 8 equal bit for bit to calls of 8."""
    import loader

    ks = hiddens(gpu_bundle, "gemv")
    assert ks
    g = torch.Generator(device="cuda").manual_seed(44)
    for k in ks:
        for n in (48, 1040):
            w = (torch.randn(n, k, device="cuda", generator=g) * 0.03).bfloat16()
            args = (w,) if fmt == "bf16" else nvfp4.quantize(w)
            dense = w if fmt == "bf16" else nvfp4.dequantize(*args)
            for m in (1, 8, 9, 17, 33, 64):
                x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
                y = loader.gemv(x, *args)
                small = torch.cat([loader.gemv(x[i : i + 8], *args) for i in range(0, m, 8)])
                torch.cuda.synchronize()
                ref = gemv_ref(x, dense)
                assert rel(y, ref) < 1e-2
                assert_gemv_close(y, x, dense, ref, f"{fmt} K={k} N={n} M={m}")
                assert torch.equal(y.view(torch.int16), small.view(torch.int16)), (k, n, m)


def test_a_shape_the_bundle_lacks_is_refused_naming_what_it_has(gpu_bundle):
    """A hidden size (or q/k-norm setting) the bundle has no kernel for: LookupError naming the bundle's
    kernels, before anything is written (the NaN-poisoned caches stay untouched)."""
    fmt = "bf16"
    vs = shapes(gpu_bundle, fmt)
    assert vs
    hidden, qkn, rope, (nq, nkv) = vs[0]
    have = {(v[0], v[1], v[2], v[3]) for v in vs}
    other = next(k for k in (1024, 1536, 2048, 512) if (k, qkn, rope, (nq, nkv)) not in have)
    c = make_case(4, nq, nkv, rope, seed=45, hidden=other, qk_norm=qkn)
    with pytest.raises(LookupError, match=f"hidden={hidden}"):
        run(c)
    if (hidden, not qkn, rope, (nq, nkv)) not in have:
        c = make_case(4, nq, nkv, rope, seed=46, hidden=hidden, qk_norm=not qkn)
        with pytest.raises(LookupError, match=f"qk_norm={qkn}"):
            run(c)
    torch.cuda.synchronize()
    assert c["k_cache"].isnan().all() and c["v_cache"].isnan().all()
    assert D == abi.HEAD_DIM


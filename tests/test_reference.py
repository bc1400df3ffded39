"""CPU tests of loader.reference (docs/numerics.md) and loader.nvfp4 (docs/nvfp4.md)."""

import cmath
import math

import pytest
import torch

from loader import nvfp4
from loader import reference as ref
from loader.abi import HIDDEN

E2M1_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Largest half-gap to a neighbouring e2m1 magnitude, per magnitude code (code 7 also covers
# saturation of values slightly above 6 when the block scale rounded down).
HALF_GAP = (0.25, 0.25, 0.25, 0.25, 0.5, 0.5, 1.0, 1.0)
E4M3_448 = 0x7E
E4M3_ONE = 0x38


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _e4m3_from_bytes(b):
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def _code_values(codes):
    return torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)[codes.long()]


def _exact_weights(n, k, g, seed):
    """bf16 w = e2m1(code) * e4m3(scale) * g, each block holding a +-6 code and one block scale 448."""
    gen = _gen(seed)
    nb = k // 16
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    pos = torch.randint(0, 16, (n, nb), generator=gen)
    six = torch.where(torch.rand(n, nb, generator=gen) < 0.5, 7, 15).to(torch.uint8)
    codes.view(n, nb, 16).scatter_(2, pos[..., None], six[..., None])
    sbytes = torch.randint(1, E4M3_448 + 1, (n, nb), generator=gen, dtype=torch.uint8)
    sbytes[n // 3, nb // 2] = E4M3_448
    scales = _e4m3_from_bytes(sbytes).double()
    w64 = (_code_values(codes).view(n, nb, 16) * scales[..., None]).reshape(n, k) * g
    w = w64.bfloat16()
    assert torch.equal(w.double(), w64), "test construction must be bf16-exact"
    return w, codes, sbytes


# ------------------------------------------------------------------------------------------
# NVFP4
# ------------------------------------------------------------------------------------------


def test_e2m1_table_matches_spec():
    mags = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert len(nvfp4.E2M1_VALUES) == 16
    for c in range(8):
        assert nvfp4.E2M1_VALUES[c] == mags[c]
        assert nvfp4.E2M1_VALUES[c + 8] == -mags[c]


@pytest.mark.parametrize("n,k,seed", [(256, 512, 1), (384, 2048, 2)])
def test_quantize_roundtrip_exact(n, k, seed):
    g = 2.0**-10
    w, codes, sbytes = _exact_weights(n, k, g, seed)
    packed, scales, gs = nvfp4.quantize(w)
    assert packed.dtype == torch.uint8 and packed.shape == (n, k // 2)
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (n, k // 16)
    assert gs.dtype == torch.float32 and gs.shape == (1,)
    assert gs.item() == g
    assert torch.equal(nvfp4.unswizzle_scales(scales, n), sbytes)
    got_codes = nvfp4.unpack_e2m1(packed)
    canon = torch.where(codes == 8, torch.zeros_like(codes), codes)  # -0 may be stored as +0
    assert torch.equal(got_codes, canon)
    deq = nvfp4.dequantize(packed, scales, gs)
    assert deq.dtype == torch.float64
    assert torch.equal(deq, w.double())
    # uint8 view of the scales and a Python float global scale give the same result
    deq2 = nvfp4.dequantize(packed, scales.view(torch.uint8), g, dtype=torch.float32)
    assert torch.equal(deq2.double(), w.double())


def test_largest_scale_and_code_survive():
    g = 2.0**-4
    n, k = 128, 64
    gen = _gen(3)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    codes[:, ::16] = 7  # each block holds +6
    sbytes = torch.randint(0x20, 0x50, (n, k // 16), generator=gen, dtype=torch.uint8)
    sbytes[5, 2] = E4M3_448
    codes[5, 32:48] = torch.tensor([15, 7] * 8, dtype=torch.uint8)  # +-6 * 448 * g: the amax
    w64 = (_code_values(codes).view(n, -1, 16) * _e4m3_from_bytes(sbytes).double()[..., None]) * g
    w = w64.reshape(n, k).bfloat16()
    packed, scales, gs = nvfp4.quantize(w)
    s = nvfp4.unswizzle_scales(scales, n)
    assert s[5, 2].item() == E4M3_448
    assert _e4m3_from_bytes(s[5, 2:3]).float().item() == 448.0
    c = nvfp4.unpack_e2m1(packed)
    assert torch.equal(c[5, 32:48], codes[5, 32:48])
    deq = nvfp4.dequantize(packed, scales, gs)
    assert deq[5, 32].item() == -6 * 448 * g and deq[5, 33].item() == 6 * 448 * g
    assert torch.equal(deq, w.double())


def test_ties_round_to_even_code():
    g = 2.0**-6
    n, k = 128, 64
    gen = _gen(4)
    w64 = torch.randn(n, k, generator=gen, dtype=torch.float64).clamp(-5, 5)
    w64[0, 0] = 6 * 448  # amax -> global scale 1 before the factor g
    # block (1, 0): scale 2 (a +6 sets it), the 7 midpoints, and their negatives
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    w64[1, :16] = torch.cat((torch.tensor([6.0, 0.0]), mids, -mids)) * 2
    w = (w64 * g).bfloat16()
    packed, scales, gs = nvfp4.quantize(w)
    assert gs.item() == g
    assert _e4m3_from_bytes(nvfp4.unswizzle_scales(scales, n)[1, 0:1]).float().item() == 2.0
    c = nvfp4.unpack_e2m1(packed)[1, :16].tolist()
    assert c[:2] == [7, 0]
    assert c[2:9] == [0, 2, 2, 4, 4, 6, 6]
    assert c[9:16] == [0, 10, 10, 12, 12, 14, 14]


def test_all_codes_pack_unpack_and_decode():
    n, k = 128, 64
    codes = torch.arange(16, dtype=torch.uint8).repeat(n, k // 16)
    gen = _gen(5)
    perm = torch.randperm(k, generator=gen)
    codes = codes[:, perm].contiguous()
    packed = nvfp4.pack_e2m1(codes)
    assert packed.shape == (n, k // 2)
    assert torch.equal(packed, codes[:, 0::2] + 16 * codes[:, 1::2])  # low nibble = even k
    assert torch.equal(nvfp4.unpack_e2m1(packed), codes)
    row = nvfp4.pack_e2m1(torch.arange(16, dtype=torch.uint8)[None])
    assert row.tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]
    ones = nvfp4.swizzle_scales(torch.full((n, k // 16), E4M3_ONE, dtype=torch.uint8))
    deq = nvfp4.dequantize(packed, ones, torch.tensor([1.0]))
    expect = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)[codes.long()]
    assert torch.equal(deq, expect)
    for c in range(16):
        vals = deq[codes == c]
        assert vals.numel() > 0 and bool((vals == nvfp4.E2M1_VALUES[c]).all())


def test_zero_blocks():
    gen = _gen(6)
    n, k = 256, 256
    w = torch.randn(n, k, generator=gen).bfloat16()
    w[3, 80:96] = 0  # block (3, 5)
    w[7] = 0  # whole row
    w[200, 0:16] = -0.0
    packed, scales, gs = nvfp4.quantize(w)
    s = nvfp4.unswizzle_scales(scales, n)
    c = nvfp4.unpack_e2m1(packed)
    deq = nvfp4.dequantize(packed, scales, gs)
    assert not torch.isnan(deq).any()
    for r, c0 in [(3, 80), (7, 0), (7, 240), (200, 0)]:
        assert s[r, c0 // 16].item() == 0
        assert bool((c[r, c0 : c0 + 16] == 0).all())
        assert bool((deq[r, c0 : c0 + 16] == 0).all())
    assert s[4, 5].item() != 0  # neighbours are real blocks
    # all-zero weight: global scale guard
    pz, sz, gz = nvfp4.quantize(torch.zeros(128, 64, dtype=torch.bfloat16))
    assert gz.item() == 1.0
    assert bool((pz == 0).all()) and bool((sz.view(torch.uint8) == 0).all())
    dz = nvfp4.dequantize(pz, sz, gz)
    assert not torch.isnan(dz).any() and bool((dz == 0).all())


def test_quantization_error_bound():
    gen = _gen(7)
    n, k = 256, HIDDEN
    w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
    packed, scales, gs = nvfp4.quantize(w)
    assert abs(gs.item() - w.float().abs().max().item() / (6 * 448)) <= 1e-6 * gs.item()
    deq = nvfp4.dequantize(packed, scales, gs)
    w64 = w.double()
    rel = ((deq - w64).norm() / w64.norm()).item()
    assert rel < 0.15, rel
    block_scale = nvfp4.unswizzle_scales(scales, n).view(torch.float8_e4m3fn).double() * gs.double()
    per_elem = block_scale.repeat_interleave(16, dim=1)
    mag = (nvfp4.unpack_e2m1(packed) & 7).long()
    allowed = torch.tensor(HALF_GAP, dtype=torch.float64)[mag] * per_elem * (1 + 1e-6)
    err = (deq - w64).abs()
    assert bool((err <= allowed).all()), (err - allowed).max().item()
    assert bool((per_elem > 0).all())
    # block scales are e4m3(block_amax / 6 / gs)
    bamax = w64.view(n, k // 16, 16).abs().amax(-1)
    want = (bamax.float() / 6 / gs).clamp(max=448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(nvfp4.unswizzle_scales(scales, n), want)


# ------------------------------------------------------------------------------------------
# Swizzle
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows,seed", [(256, 8), (384, 9)])
def test_swizzle_matches_offset_formula(rows, seed):
    cols = 128
    gen = _gen(seed)
    logical = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    sw = nvfp4.swizzle_scales(logical)
    assert sw.dtype == torch.uint8 and sw.shape == (rows, cols)
    flat = sw.reshape(-1)
    rs = torch.randint(0, rows, (400,), generator=gen).tolist()
    cs = torch.randint(0, cols, (400,), generator=gen).tolist()
    for r, c in zip(rs, cs, strict=True):
        assert flat[nvfp4.swizzle_offset(r, c, cols)].item() == logical[r, c].item(), (r, c)
    # spot values of the formula itself
    assert nvfp4.swizzle_offset(0, 0, cols) == 0
    assert nvfp4.swizzle_offset(0, 1, cols) == 1
    assert nvfp4.swizzle_offset(32, 0, cols) == 4
    assert nvfp4.swizzle_offset(1, 0, cols) == 16
    assert nvfp4.swizzle_offset(0, 4, cols) == 512
    assert nvfp4.swizzle_offset(128, 0, cols) == 512 * (cols // 4)
    offsets = sorted(nvfp4.swizzle_offset(r, c, cols) for r in range(rows) for c in range(0, cols, 7))
    assert len(set(offsets)) == len(offsets)
    assert torch.equal(nvfp4.unswizzle_scales(sw, rows), logical)
    as_fp8 = nvfp4.swizzle_scales(logical.view(torch.float8_e4m3fn))
    assert torch.equal(as_fp8, sw)
    assert torch.equal(nvfp4.unswizzle_scales(sw.view(torch.float8_e4m3fn), rows), logical)


def test_swizzle_pads_rows():
    rows, cols = 200, 16
    gen = _gen(10)
    logical = torch.randint(1, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    sw = nvfp4.swizzle_scales(logical)
    assert sw.shape == (256, cols)
    flat = sw.reshape(-1)
    written = torch.zeros(256 * cols, dtype=torch.bool)
    for r in range(rows):
        for c in range(cols):
            off = nvfp4.swizzle_offset(r, c, cols)
            assert flat[off].item() == logical[r, c].item()
            written[off] = True
    assert bool((flat[~written] == 0).all())
    assert int((~written).sum()) == (256 - rows) * cols
    assert torch.equal(nvfp4.unswizzle_scales(sw, rows), logical)
    with pytest.raises(ValueError):
        nvfp4.swizzle_scales(torch.zeros(128, 6, dtype=torch.uint8))


# ------------------------------------------------------------------------------------------
# Norm, q/k norm + RoPE, cache
# ------------------------------------------------------------------------------------------


def _bf16_ulp(x):
    e = torch.floor(torch.log2(x.abs().clamp(min=2.0**-120)))
    return torch.exp2(e - 7)


@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_ref(with_residual):
    gen = _gen(11)
    m, eps = 5, 1e-6
    x = torch.randn(m, HIDDEN, generator=gen).bfloat16()
    res = (torch.randn(m, HIDDEN, generator=gen) * 2).bfloat16() if with_residual else None
    w = (1 + 0.3 * torch.randn(HIDDEN, generator=gen)).bfloat16()
    xn, r_out = ref.rms_norm_ref(x, res, w, eps)
    assert xn.dtype == torch.bfloat16 and r_out.dtype == torch.bfloat16 and xn.shape == x.shape
    if with_residual:
        want_r = (x.double() + res.double()).bfloat16()
        assert torch.equal(r_out.view(torch.int16), want_r.view(torch.int16))
    else:
        assert r_out is x
        want_r = x
    r64 = want_r.double()
    xn64 = r64 / torch.sqrt((r64 * r64).mean(-1, keepdim=True) + eps) * w.double()
    # two bf16 roundings of up to half an ulp each: within 2 ulps of the exact formula
    diff = (xn.double() - xn64).abs()
    assert bool((diff <= 2 * _bf16_ulp(xn64)).all()), (diff / _bf16_ulp(xn64)).max().item()
    # with the intermediate rounding done in float64 too: within 1 ulp
    a64 = (r64 / torch.sqrt((r64 * r64).mean(-1, keepdim=True) + eps)).bfloat16().double()
    xn64r = a64 * w.double()
    diff = (xn.double() - xn64r).abs()
    assert bool((diff <= _bf16_ulp(xn64r)).all()), (diff / _bf16_ulp(xn64r)).max().item()
    # explicit rounding points: bf16(bf16(r * s) * w)
    s = torch.rsqrt(want_r.float().pow(2).mean(-1, keepdim=True) + eps)
    assert torch.equal(xn, ((want_r.float() * s).bfloat16().float() * w.float()).bfloat16())


def _loop_qk_norm_rope(qkv, qw, kw, eps, table, positions, nq, nkv, round_qkv):
    """Per token, per head, with complex rotation: (y1 + i y2) * (cos + i sin)."""
    m = qkv.shape[0]
    src = qkv.bfloat16() if round_qkv else qkv
    src = src.double()
    q = torch.empty(m, nq, 128, dtype=torch.float64)
    k = torch.empty(m, nkv, 128, dtype=torch.float64)
    v = torch.empty(m, nkv, 128, dtype=torch.float64)
    for t in range(m):
        p = int(positions[t])
        for hi in range(nq + 2 * nkv):
            h = src[t, hi * 128 : (hi + 1) * 128].tolist()
            if hi >= nq + nkv:
                v[t, hi - nq - nkv] = torch.tensor(h, dtype=torch.float64)
                continue
            wt = (qw if hi < nq else kw).double().tolist()
            inv = 1.0 / math.sqrt(sum(a * a for a in h) / 128 + eps)
            y = [a * inv * b for a, b in zip(h, wt, strict=True)]
            if table is not None:
                out1, out2 = [], []
                for i in range(64):
                    z = complex(y[i], y[i + 64]) * complex(float(table[p, i]), float(table[p, 64 + i]))
                    out1.append(z.real)
                    out2.append(z.imag)
                y = out1 + out2
            if hi < nq:
                q[t, hi] = torch.tensor(y, dtype=torch.float64)
            else:
                k[t, hi - nq] = torch.tensor(y, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("round_qkv,use_rope", [(True, True), (False, True), (True, False)])
def test_qk_norm_rope_against_loop(round_qkv, use_rope):
    gen = _gen(12)
    m, nq, nkv, eps = 3, 4, 2, 1e-6
    n = (nq + 2 * nkv) * 128
    qkv = torch.randn(m, n, generator=gen, dtype=torch.float64) * 3
    qw = (1 + 0.2 * torch.randn(128, generator=gen)).bfloat16()
    kw = (1 + 0.2 * torch.randn(128, generator=gen)).bfloat16()
    table = ref.make_cos_sin_cache(4096) if use_rope else None
    positions = torch.randint(0, 4096, (m,), generator=gen, dtype=torch.int64)
    q, k, v = ref.qk_norm_rope_ref(qkv, qw, kw, eps, table, positions, nq, nkv, round_qkv=round_qkv)
    assert q.shape == (m, nq, 128) and k.shape == (m, nkv, 128) and v.shape == (m, nkv, 128)
    assert q.dtype == k.dtype == v.dtype == torch.float64
    lq, lk, lv = _loop_qk_norm_rope(qkv, qw, kw, eps, table, positions, nq, nkv, round_qkv)
    torch.testing.assert_close(q, lq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k, lk, rtol=1e-12, atol=1e-12)
    assert torch.equal(v, lv)
    if not round_qkv:  # rounding must matter, or the flag is untested
        q2, _, _ = ref.qk_norm_rope_ref(qkv, qw, kw, eps, table, positions, nq, nkv, round_qkv=True)
        assert not torch.equal(q, q2)


def test_rope_position_zero_identity_and_pair_norms():
    gen = _gen(13)
    m, nq, nkv, eps = 4, 2, 1, 1e-5
    qkv = torch.randn(m, (nq + 2 * nkv) * 128, generator=gen).bfloat16()
    qw = (1 + 0.2 * torch.randn(128, generator=gen)).bfloat16()
    kw = (1 + 0.2 * torch.randn(128, generator=gen)).bfloat16()
    table = ref.make_cos_sin_cache(1024)
    args = (qkv, qw, kw, eps)
    q0, k0, v0 = ref.qk_norm_rope_ref(*args, None, torch.zeros(m, dtype=torch.int64), nq, nkv)
    qz, kz, vz = ref.qk_norm_rope_ref(*args, table, torch.zeros(m, dtype=torch.int64), nq, nkv)
    assert torch.equal(q0, qz) and torch.equal(k0, kz) and torch.equal(v0, vz)
    pos = torch.randint(1, 1024, (m,), generator=gen, dtype=torch.int64)
    qr, kr, _ = ref.qk_norm_rope_ref(*args, table, pos, nq, nkv)
    assert not torch.allclose(qr, q0)
    for a, b in ((qr, q0), (kr, k0)):
        na = a[..., :64] ** 2 + a[..., 64:] ** 2
        nb = b[..., :64] ** 2 + b[..., 64:] ** 2
        torch.testing.assert_close(na, nb, rtol=1e-6, atol=1e-9)
    # the head RMS norm: each unrotated head has mean((y / w)^2) ~= 1
    ratio = (q0 / qw.double()).pow(2).mean(-1)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=1e-4, atol=0)


def test_make_cos_sin_cache():
    t = ref.make_cos_sin_cache(300, base=10000.0)
    assert t.dtype == torch.float32 and t.shape == (300, 128)
    assert bool((t[0, :64] == 1).all()) and bool((t[0, 64:] == 0).all())
    gen = _gen(14)
    for p, i in zip(
        torch.randint(0, 300, (50,), generator=gen).tolist(),
        torch.randint(0, 64, (50,), generator=gen).tolist(),
        strict=True,
    ):
        z = cmath.exp(1j * p * 10000.0 ** (-2 * i / 128))
        assert t[p, i].item() == torch.tensor(z.real, dtype=torch.float32).item()
        assert t[p, 64 + i].item() == torch.tensor(z.imag, dtype=torch.float32).item()
    t2 = ref.make_cos_sin_cache(10, base=500000.0)
    assert t2[3, 5].item() == pytest.approx(math.cos(3 * 500000.0 ** (-10 / 128)), abs=1e-7)


def test_expected_cache_writes_only_mapped_slots():
    gen = _gen(15)
    nblocks, bs, nkv, m = 5, 8, 2, 6
    kc = torch.randn(nblocks, bs, nkv, 128, generator=gen).bfloat16()
    vc = torch.randn(nblocks, bs, nkv, 128, generator=gen).bfloat16()
    kc0, vc0 = kc.clone(), vc.clone()
    k = torch.randn(m, nkv, 128, generator=gen, dtype=torch.float64)
    v = torch.randn(m, nkv * 128, generator=gen, dtype=torch.float64)
    slots = torch.tensor([13, -1, 0, 30, -7], dtype=torch.int64)  # S = 5 < M: token 5 skipped
    nk, nv = ref.expected_cache(kc, vc, k, v, slots)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)  # inputs untouched
    assert nk.dtype == torch.bfloat16 and nk.shape == kc.shape
    written = {(1, 5): 0, (0, 0): 2, (3, 6): 3}  # -1 / -7 would wrap to (4, 7) / (4, 1)
    v3 = v.view(m, nkv, 128)
    for b in range(nblocks):
        for o in range(bs):
            if (b, o) in written:
                t = written[(b, o)]
                assert torch.equal(nk[b, o], k[t].bfloat16())
                assert torch.equal(nv[b, o], v3[t].bfloat16())
            else:
                assert torch.equal(nk[b, o], kc0[b, o]) and torch.equal(nv[b, o], vc0[b, o])
    for t in (1, 4, 5):  # never appears anywhere
        assert not (nk == k[t].bfloat16()).all(-1).all(-1).any()


def test_qkv_fused_ref_chain():
    """qkv_fused_ref against the chain written out here in float64, with the roundings of docs/numerics.md
    §1-3 and no code of loader.reference: residual_out exact; xn within one bf16 ulp of the float64 norm
    (§6: the reference's fp32 statistics may move a rare element); from its xn on, q, k and v to float64
    accuracy (the bf16 rounding of qkv included: leaving it out moves them by ~2^-9)."""
    gen = _gen(16)
    m, nq, nkv, eps, qk_eps = 3, 4, 2, 1e-6, 1e-6
    n = (nq + 2 * nkv) * 128
    x = torch.randn(m, HIDDEN, generator=gen).bfloat16()
    res = torch.randn(m, HIDDEN, generator=gen).bfloat16()
    nw = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).bfloat16()
    w = (torch.randn(n, HIDDEN, generator=gen) * 0.02).bfloat16()
    packed, scales, gs = nvfp4.quantize(w)
    wd = nvfp4.dequantize(packed, scales, gs)
    qw = (1 + 0.2 * torch.randn(128, generator=gen)).bfloat16()
    kw = (1 + 0.2 * torch.randn(128, generator=gen)).bfloat16()
    table = ref.make_cos_sin_cache(2048)
    pos = torch.randint(0, 2048, (m,), generator=gen, dtype=torch.int64)
    out = ref.qkv_fused_ref(x, res, nw, eps, wd, qw, kw, qk_eps, table, pos, nq, nkv)
    assert set(out) == {"q", "k", "v", "xn", "residual_out"}
    assert all(out[k].dtype == torch.float64 for k in "qkv")
    # §1: r = bf16(x + residual), xn = bf16(bf16(r / rms(r)) * w)
    r = (x.double() + res.double()).bfloat16()
    assert torch.equal(out["residual_out"].view(torch.int16), r.view(torch.int16))
    h = r.double()
    xn64 = ((h / (h.pow(2).mean(-1, keepdim=True) + eps).sqrt()).bfloat16().double() * nw.double()).bfloat16()
    xn = out["xn"]
    assert xn.dtype == torch.bfloat16 and xn.shape == x.shape
    diff = (xn.double() - xn64.double()).abs()
    assert bool((diff <= _bf16_ulp(xn64.double())).all())
    assert (diff == 0).double().mean().item() >= 0.999
    # §2-3 from the reference's xn: qkv rounded to bf16 once, per-head norm, NeoX RoPE (complex rotation)
    qkv = torch.einsum("mk,nk->mn", xn.double(), wd.double()).bfloat16().double().view(m, nq + 2 * nkv, 128)
    rows = table[pos].double()
    rot = torch.complex(rows[:, None, :64], rows[:, None, 64:])

    def norm_rope(y, wt):
        y = y / (y.pow(2).mean(-1, keepdim=True) + qk_eps).sqrt() * wt.double()
        z = torch.complex(y[..., :64], y[..., 64:]) * rot
        return torch.cat([z.real, z.imag], dim=-1)

    want = {
        "q": norm_rope(qkv[:, :nq], qw),
        "k": norm_rope(qkv[:, nq : nq + nkv], kw),
        "v": qkv[:, nq + nkv :],
    }
    for key, val in want.items():
        assert out[key].shape == val.shape, key
        torch.testing.assert_close(out[key], val, rtol=1e-12, atol=1e-12, msg=key)
    # an fp32 chain stays within the tolerance of docs/numerics.md §6 of the float64 one
    out32 = ref.qkv_fused_ref(x, None, nw, eps, wd, qw, kw, qk_eps, table, pos, nq, nkv, dtype=torch.float32)
    out64 = ref.qkv_fused_ref(x, None, nw, eps, wd, qw, kw, qk_eps, table, pos, nq, nkv)
    assert out32["residual_out"] is x
    for key in ("q", "k", "v"):
        a, b = out32[key].double(), out64[key]
        assert a.dtype == torch.float64 and not torch.isnan(a).any()
        assert ((a - b).norm() / b.norm()).item() < 1e-2

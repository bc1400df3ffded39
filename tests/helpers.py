"""What the GPU test modules and tools/ncu_case.py, tools/sanitize_case.py share: random cases for the fused
op (BF16 or NVFP4 weights, BF16 or FP8 KV caches), the check of a result against the float64 reference
(loader.reference), tensors carved out of poisoned guard buffers, and a runner of child processes (run_child)
for tests whose failure could crash the process.

Imports on a machine without CUDA: torch and the loader's pure-torch modules only (loader.abi, loader.nvfp4,
loader.reference); `loader` itself, which needs the CUDA driver bindings, is imported where an op is called.
The cases themselves are made on a CUDA device (make_case's `device`), the guard-buffer helpers on any.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from loader import nvfp4
from loader.abi import ARCH_CC, E4M3_MAX, HEAD_DIM, HIDDEN
from loader.reference import expected_cache, qk_norm_rope_ref, qkv_fused_ref, rms_norm_ref

K, D = HIDDEN, HEAD_DIM
FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # an FP8 (e4m3) KV cache, or its uint8 view
FP8_CACHE_POISON = 0x7F  # an e4m3fn NaN byte: what make_case fills FP8 caches with
POISON = 0xFF  # the guard-buffer byte: NaN as bf16, fp32 and e4m3fn, -1 as int64
# The per-element bound that check(), check_qk(), check_caches() and the fuzz (tests/fuzz_harness.py) put on
# q, k and v (BF16 caches) next to the norm-wise 1e-2: |got - ref| <= ELEMENT_TOL x the RMS of that token's
# head (its 128 reference values). A norm-wise bound over a whole output lets a few wrong elements through
# (six of 65,536 at M = 16); this one does not, and it stays fair to a rounding error in an element that
# RoPE has cancelled to near zero.
# Measured on the CPU, `PYTHONPATH=. python -m tests.test_helpers_cpu 2000`: the kernels' arithmetic emulated
# by loader.reference in fp32 (qkv_fused_ref(dtype=torch.float32), outputs rounded to bf16 as the kernels
# store them) against the float64 reference these checks use, over 2000 make_case cases (heads (8, 1),
# (16, 2), (16, 8), (32, 4), M = 1..16, BF16 and NVFP4 weights, RoPE and residual on and off): worst element
# of q 0.0235, of k 0.0164, of v 0.0122 of its head's RMS. ELEMENT_TOL = 0.05 is 2.1x the worst.
# Loosen it only for a measured reason (say which, and the new worst, here).
ELEMENT_TOL = 0.05


# ----------------------------------------------------------------------------- the bundle
def device_arch(device=None) -> str | None:
    """The bundle architecture (loader.abi.ARCH_CC) of a CUDA device, None if flint-aot does not target it."""
    cc = tuple(torch.cuda.get_device_capability(device))
    return next((arch for arch, c in ARCH_CC.items() if tuple(c) == cc), None)


def kv_of(spec: dict) -> str:
    """A kernel spec's KV-cache dtype (bundles built before the axis existed hold BF16 kernels only)."""
    return spec.get("kv_cache_dtype", "bf16")


def variants(bundle, fmt: str = "bf16", kv: str = "bf16", arch: str | None = None) -> list:
    """Sorted (rope, (num_q_heads, num_kv_heads)) of the bundle's qkv kernels for weight format `fmt` and
    KV-cache dtype `kv` on `arch` (default: the current CUDA device's), whatever their norm mode."""
    arch = arch or device_arch()
    return sorted(
        {
            (e.spec["rope"], tuple(e.spec["heads"]))
            for e in bundle.manifest.kernels
            if e.kind == "qkv" and e.arch == arch and e.spec["weight_format"] == fmt and kv_of(e.spec) == kv
        }
    )


def pick_heads(bundle, fmt="bf16", kv="bf16", rope=True, prefer=((16, 2), (32, 4))) -> tuple[int, int]:
    """Head counts of a qkv kernel the bundle has for (fmt, kv, rope): the first of `prefer` it has, else its
    first. Fails (an assertion naming what is missing) when it has none."""
    have = [heads for r, heads in variants(bundle, fmt, kv) if r == rope]
    assert have, f"the bundle has no {fmt} qkv kernel with a {kv} KV cache and rope={rope}: rebuild it"
    return next((p for p in prefer if p in have), have[0])


def run_child(*args: str, timeout: float = 600) -> str:
    """`python3 *args` in a fresh process from the repository root (PYTHONPATH: the root first): a crash there
    (a signal, a sticky CUDA error) fails the calling test with the child's output, not the whole run. The
    child must exit 0 having printed 'child ok'; returns its stdout."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    try:
        r = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True,
                           timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = "".join(t if isinstance(t, str) else t.decode(errors="replace") for t in (e.stdout, e.stderr)
                      if t)  # fmt: skip
        raise AssertionError(f"child still running after {timeout} s:\n{out[-8000:]}") from None
    how = f"killed by signal {-r.returncode} ({signal.strsignal(-r.returncode)})" if r.returncode < 0 else (
        f"exit {r.returncode}")  # fmt: skip
    assert r.returncode == 0 and "child ok" in r.stdout, f"child {how}:\n{(r.stdout + r.stderr)[-8000:]}"
    return r.stdout


def altered_copy(src, dst) -> Path:
    """A copy of the bundle at src, at dst, whose every cubin has other bytes and the same code: 16 bytes
    appended past the end of the ELF, which nothing reads (the driver finds an ELF's parts through its
    headers and is given no size for the image), with the manifest's size and sha256 updated. The loader
    takes each for a cubin of its own: loaded into a new module, not keyed to src's (for reload tests of a
    bundle whose cubins changed, where no second build can be had)."""
    import dataclasses
    import shutil

    from loader.manifest import MANIFEST_NAME, Manifest, sha256_bytes

    dst = Path(shutil.copytree(src, dst))
    m = Manifest.load(dst)
    kernels = []
    for e in m.kernels:
        data = (dst / e.file).read_bytes() + b"another cubin\0\0\0"
        (dst / e.file).write_bytes(data)
        kernels.append(dataclasses.replace(e, size=len(data), sha256=sha256_bytes(data)))
    (dst / MANIFEST_NAME).write_text(dataclasses.replace(m, kernels=kernels).dumps())
    return dst


# ----------------------------------------------------------------------------- comparisons
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of a against b (float64)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def head_error(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| per element over the RMS of ref's head (the last dimension, 128: one token's head),
    float64. NaN where either is NaN."""
    ref = ref.double()
    return (got.double() - ref).abs() / ref.pow(2).mean(-1, keepdim=True).sqrt()


def assert_elements_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Every element of got within ELEMENT_TOL of its head's RMS in ref ([..., 128] both, ref NaN-free)."""
    err = head_error(got, ref)
    bad = ~(err <= ELEMENT_TOL)  # (NaN is bad)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        worst = err.nan_to_num(float("inf")).max().item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements off the reference by more than "
            f"ELEMENT_TOL = {ELEMENT_TOL:g} of their head's RMS (worst {worst:.3g}; first at {i}: "
            f"{got[i].item():.6g} vs {ref[i].item():.6g})"
        )


def assert_gemv_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, what: str):
    """Every element of y = x @ w.T (bf16) within one bf16 rounding of the float64 ref plus the fp32
    accumulation bound: |y - ref| <= ulp(ref) + K 2^-24 sum_k |x w| (K terms of 2^-24 each; 2^-13 at 2048)."""
    _, e = torch.frexp(ref)
    ulp = torch.ldexp(torch.ones_like(ref), e - 8)
    mag = x.double().abs() @ w.double().abs().t()
    bad = ~((y.double() - ref).abs() <= ulp + x.shape[-1] * 2.0**-24 * mag)  # (NaN is bad)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond one bf16 rounding "
                             f"and the fp32 accumulation bound (first at {i}: {y[i].item():.6g} vs "
                             f"{ref[i].item():.6g})")  # fmt: skip


def assert_ulps_close(got: torch.Tensor, ref: torch.Tensor, ulps: int, what: str) -> None:
    """Every element of the bf16 tensor got within `ulps` bf16 ulps of the bf16 tensor ref (finite)."""
    d = bf16_ulps(got, ref)
    bad = ~(d <= ulps) | got.isnan()
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements more than {ulps} bf16 "
                             f"ulp(s) off the reference (worst {d.max().item()}; first at {i}: "
                             f"{got[i].item():.6g} vs {ref[i].item():.6g})")  # fmt: skip


def bf16_spacing(v: torch.Tensor) -> torch.Tensor:
    """The gap from each bf16 value's magnitude to the next bf16 up (its ulp), as fp64."""
    a = v.abs().contiguous()
    up = (a.view(torch.int16) + 1).view(torch.bfloat16)
    return up.double() - a.double()


def assert_xn_close(xn: torch.Tensor, x, residual, weight, eps: float, what: str = "xn") -> None:
    """xn against rms_norm_ref, element by element: within what one bf16 ulp of the normalised value
    t = bf16(r * s) explains, |xn - ref| <= |w| ulp(t) + ulp(ref) (the kernel adds the 2048 squares in
    another fp32 order than the reference, so s may differ in its last bits and t by one ulp; then
    bf16(t w) by one or two ulps of xn), and at least 99.9 % of the elements exact."""
    ref, r = rms_norm_ref(x, residual, weight, eps)
    rf = r.float()
    t = (rf * torch.rsqrt(rf.pow(2).mean(dim=-1, keepdim=True) + eps)).bfloat16()
    d = (xn.double() - ref.double()).abs()
    bound = weight.double().abs() * bf16_spacing(t) + torch.maximum(bf16_spacing(ref), bf16_spacing(xn))
    bad = ~(d <= bound)  # (NaN is bad)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond one ulp of the "
                             f"normalised value and one of the result (first at {i}: {xn[i].item():.6g} vs "
                             f"{ref[i].item():.6g})")  # fmt: skip
    exact = (d == 0).double().mean().item()
    assert exact >= 0.999, f"{what}: only {100 * exact:.3f} % of the elements exact"


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps between two bf16 tensors of finite values (sign-magnitude order)."""

    def order(t):
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (order(a) - order(b)).abs()


def as_float(cache: torch.Tensor) -> torch.Tensor:
    """A BF16 or FP8 (float8_e4m3fn / uint8 view) cache as float32 values; NaN bytes stay NaN."""
    if cache.dtype == torch.uint8:
        cache = cache.view(torch.float8_e4m3fn)
    return cache.float()


def e4m3_ulp(a: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3fn values at magnitude a (>= 0): 2^(e-3) in the binade [2^e, 2^(e+1)), 2^-9 among
    the subnormals (below 2^-6), 32 from 256 up (448 is the largest finite value)."""
    e = torch.floor(torch.log2(a.double().clamp(min=2.0**-6))).clamp(max=8)
    return torch.pow(2.0, e - 3)


def fp8_close(got: torch.Tensor, ref: torch.Tensor, scale: float) -> torch.Tensor:
    """Mask of the FP8 cache values `got` (float, dequantization NOT applied: the stored e4m3 values) that
    are what the kernel may store for the float64 reference values `ref` ([..., 128], one head per row) with
    the fp32 scale `scale`: the kernel rounds its own bf16 value (which may differ from bf16(ref) by the
    bf16 roundings of the GEMV and the q/k norm: allowed 2^-7 of the value plus 2^-7 of the head's largest
    value) to e4m3 after dividing by the scale, saturating at +-448. So: |got - clamp(ref / scale)| <= one
    e4m3 ulp at that magnitude + that bf16 allowance (both in units of the scaled value). NaN never passes.
    Bit-exactness is for the dedicated tests that compare against the kernel's own bf16 values."""
    t = ref.double() / scale
    head = t.abs().amax(dim=-1, keepdim=True)
    delta = 2.0**-7 * (t.abs() + head)
    tc = t.clamp(-E4M3_MAX, E4M3_MAX)
    tol = e4m3_ulp(tc.abs() + delta) + delta
    return (got.double() - tc).abs() <= tol


# ----------------------------------------------------------------------------- the fused op's cases
def poison_cache_(cache: torch.Tensor) -> torch.Tensor:
    """Fill a KV cache (any layout) with NaN: bf16 NaN, or the e4m3 NaN byte for an FP8 cache."""
    if cache.dtype in FP8_DTYPES:
        cache.view(torch.uint8).fill_(FP8_CACHE_POISON)
        return cache
    return cache.fill_(float("nan"))


def make_case(
    m, nq, nkv, rope, seed, residual=True, num_blocks=16, block_size=16, split_kv=False, slots=None,
    fmt="bf16", scale_u8=False, kv_dtype="bf16", cache_u8=False, device="cuda", hidden=K, qk_norm=True,
):  # fmt: skip
    """Fresh random inputs for one flint_qkv_fused call; keys starting with '_' are for the checks only.
    hidden: the hidden size (x [m, hidden]); qk_norm False: no q/k norm weights (None: Llama's numerics).

    fmt="nvfp4" quantizes the random weight (the reference uses its float64 dequantization); scale_u8 passes
    the block scales as a uint8 view. kv_dtype="fp8_e4m3" makes FP8 caches (float8_e4m3fn, or their uint8
    view with cache_u8) filled with the e4m3 NaN byte 0x7F, and k_scale / v_scale (fp32, one element) drawn
    around amax / 448 of the reference's k and v, so that the stored values use the e4m3 range (a few
    saturate at +-448). split_kv: k and v are the two halves of one [num_blocks, 2, ...] allocation (vLLM).
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    n = (nq + 2 * nkv) * D
    c = dict(
        x=r(m, hidden).mul_(2).bfloat16(),
        residual=r(m, hidden).bfloat16() if residual else None,
        norm_weight=(1 + 0.3 * r(hidden)).bfloat16(),
        eps=1e-6,
        weight=(r(n, hidden) * 0.03 * (K / hidden) ** 0.5).bfloat16(),  # (q/k/v of the same scale at any K)
        weight_scale=None,
        global_scale=None,
        q_norm_weight=(1 + 0.3 * r(D)).bfloat16() if qk_norm else None,
        k_norm_weight=(1 + 0.3 * r(D)).bfloat16() if qk_norm else None,
        qk_eps=1e-6,
        cos_sin_cache=_cos_sin(4096, dev) if rope else None,
        positions=torch.randint(0, 4096, (m,), device=dev, generator=g),
    )
    fp8 = kv_dtype == "fp8_e4m3"
    if kv_dtype not in ("bf16", "fp8_e4m3"):
        raise ValueError(f"kv_dtype must be 'bf16' or 'fp8_e4m3', got {kv_dtype!r}")

    def cache(*shape):
        if fp8:
            t = torch.full(shape, FP8_CACHE_POISON, dtype=torch.uint8, device=dev)
            return t if cache_u8 else t.view(torch.float8_e4m3fn)
        return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=dev)

    if split_kv:  # vLLM layout: k and v are the two halves of one allocation
        kv = cache(num_blocks, 2, block_size, nkv, D)
        c["k_cache"], c["v_cache"] = kv[:, 0], kv[:, 1]
    else:
        c["k_cache"] = cache(num_blocks, block_size, nkv, D)
        c["v_cache"] = cache(num_blocks, block_size, nkv, D)
    if slots is None:
        slots = torch.randperm(num_blocks * block_size, device=dev, generator=g)[:m]
    c["slot_mapping"] = slots
    c["num_q_heads"], c["num_kv_heads"] = nq, nkv
    c["_w_dense"] = c["weight"]
    if fmt == "nvfp4":
        packed, scales, gs = nvfp4.quantize(c["weight"])
        gs = gs.to(dev)
        c["_w_dense"] = nvfp4.dequantize(packed, scales, gs)
        c["weight"], c["global_scale"] = packed, gs
        c["weight_scale"] = scales.view(torch.uint8) if scale_u8 else scales
    if fp8:  # last, so that every other input equals the BF16-cache case of the same seed
        ref = reference(c)
        for name, val in (("k_scale", ref["k"]), ("v_scale", ref["v"])):
            amax = val.abs().amax().item()
            spread = 2.0 ** (torch.rand((), device=dev, generator=g).item() * 1.5 - 0.5)  # 2^[-0.5, 1)
            c[name] = torch.tensor([amax / E4M3_MAX * spread], dtype=torch.float32, device=dev)
    return c


_COS_SIN: dict = {}


def _cos_sin(max_pos: int, dev: torch.device) -> torch.Tensor:
    """make_cos_sin_cache(max_pos) on dev, computed once per (max_pos, device); a fresh copy per call (a
    test may write it)."""
    from loader.reference import make_cos_sin_cache

    if dev.type == "cuda" and dev.index is None:  # "cuda": the current device, which may change
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (max_pos, str(dev))
    if key not in _COS_SIN:
        _COS_SIN[key] = make_cos_sin_cache(max_pos, device=dev)
    return _COS_SIN[key].clone()


def op_args(c: dict) -> dict:
    """The case's keyword arguments of loader.flint_qkv_fused (k_scale / v_scale only for an FP8 cache)."""
    return {k: v for k, v in c.items() if not k.startswith("_")}


def run(c: dict):
    import loader

    return loader.flint_qkv_fused(**op_args(c))


def reference(c: dict) -> dict:
    """loader.reference.qkv_fused_ref of a case (float64 q, k, v)."""
    return qkv_fused_ref(
        c["x"], c["residual"], c["norm_weight"], c["eps"], c["_w_dense"], c["q_norm_weight"],
        c["k_norm_weight"], c["qk_eps"], c["cos_sin_cache"], c["positions"], c["num_q_heads"],
        c["num_kv_heads"],
    )  # fmt: skip


def mapped_slots(slot_mapping: torch.Tensor, m: int, num_slots: int) -> list[tuple[int, int]]:
    """(token, slot) of every token t < min(len(slot_mapping), m) whose slot is in [0, num_slots)."""
    return [(t, s) for t, s in enumerate(slot_mapping.tolist()[:m]) if 0 <= s < num_slots]


def check(c: dict, q: torch.Tensor, res_out: torch.Tensor, k_before: torch.Tensor, v_before: torch.Tensor):
    """The op's outputs of case c against the float64 reference: residual_out exact (x itself without a
    residual), q within 1e-2 (relative Frobenius), every element within ELEMENT_TOL of its head's RMS, and
    NaN-free; the caches changed exactly at the mapped slots (NaN-poison pattern of expected_cache) and right
    there: BF16 as q, FP8 within fp8_close of the reference (k_scale / v_scale of the case)."""
    if c["residual"] is None:
        assert res_out.data_ptr() == c["x"].data_ptr(), "residual_out must be x itself without a residual"
    else:
        assert torch.equal(res_out, rms_norm_ref(c["x"], c["residual"], c["norm_weight"], c["eps"])[1])
    check_q_and_caches(c, q, k_before, v_before)


def check_q_and_caches(c: dict, q: torch.Tensor, k_before: torch.Tensor, v_before: torch.Tensor):
    """check() but residual_out: q and the caches of case c against the float64 reference."""
    m, nq = c["x"].shape[0], c["num_q_heads"]
    ref = reference(c)
    _check_q(q, ref["q"], m, nq, c["x"].device)
    check_caches(c, ref["k"], ref["v"], k_before, v_before, m)


def _check_q(q, ref_q, m, nq, device):
    assert q.shape == (m, nq * D) and q.dtype == torch.bfloat16 and q.device == device
    assert not q.isnan().any(), "q must be written everywhere"
    e = rel(q.view(m, nq, D), ref_q)
    assert e < 1e-2, f"q: relative error {e:.3g}"
    assert_elements_close(q.view(m, nq, D), ref_q, "q")


def qk_args(c: dict, qkv: torch.Tensor) -> dict:
    """loader.qk_norm_rope_cache's keyword arguments: qkv and the per-head arguments of case c."""
    keys = ("q_norm_weight", "k_norm_weight", "qk_eps", "cos_sin_cache", "positions", "k_cache", "v_cache",
            "slot_mapping", "num_q_heads", "num_kv_heads", "k_scale", "v_scale")  # fmt: skip
    return {"qkv": qkv, **{k: c[k] for k in keys if k in c}}


def run_unfused(c: dict, u: dict):
    """The unfused chain on case c's inputs: the norm (with c's residual, or without), the GEMV, then the
    per-head stage writing u's caches (a copy of c with caches of its own). Returns (q, residual_out, xn):
    what the fused op's results must equal bit for bit."""
    import loader

    if c["residual"] is None:
        xn, r = loader.rms_norm(c["x"], c["norm_weight"], c["eps"]), c["x"]
    else:
        xn, r = loader.fused_add_rms_norm(c["x"], c["residual"], c["norm_weight"], c["eps"])
    qkv = loader.gemv(xn, c["weight"], c["weight_scale"], c["global_scale"])
    return loader.qk_norm_rope_cache(**qk_args(u, qkv)), r, xn


def check_qk(c: dict, qkv: torch.Tensor, q: torch.Tensor, k_before: torch.Tensor, v_before: torch.Tensor):
    """loader.qk_norm_rope_cache(**qk_args(c, qkv)) against the float64 reference, as check() does."""
    m, nq, nkv = qkv.shape[0], c["num_q_heads"], c["num_kv_heads"]
    rq, rk, rv = qk_norm_rope_ref(qkv, c["q_norm_weight"], c["k_norm_weight"], c["qk_eps"],
                                  c["cos_sin_cache"], c["positions"], nq, nkv)  # fmt: skip
    _check_q(q, rq, m, nq, qkv.device)
    check_caches(c, rk, rv, k_before, v_before, m)


def check_caches(c, ref_k, ref_v, k_before, v_before, m, skip_slots=()):
    """The caches of case c after a call: changed exactly at the mapped slots of c["slot_mapping"] (NaN-poison
    pattern of expected_cache), holding ref_k / ref_v ([M, nkv, 128] float64) there: BF16 within 1e-2
    (relative Frobenius) and every element within ELEMENT_TOL of its head's RMS, FP8 within fp8_close
    (k_scale / v_scale of the case). Slots in skip_slots are only required to be written."""
    nkv = c["num_kv_heads"]
    fp8 = c["k_cache"].dtype in FP8_DTYPES
    scales = (c.get("k_scale"), c.get("v_scale")) if fp8 else (None, None)
    ek, ev = expected_cache(k_before, v_before, ref_k, ref_v, c["slot_mapping"], *scales)
    bs = c["k_cache"].shape[1]
    slots = mapped_slots(c["slot_mapping"], m, c["k_cache"].shape[0] * bs)
    for name, got, exp, val, scale in (
        ("k", c["k_cache"], ek, ref_k, scales[0]),
        ("v", c["v_cache"], ev, ref_v, scales[1]),
    ):
        g, e = as_float(got), as_float(exp)
        written = ~e.isnan()
        for s in skip_slots:  # a written slot whose value is not checked
            assert not g[s // bs, s % bs].isnan().any(), f"{name}_cache slot {s} not written"
            g[s // bs, s % bs] = e[s // bs, s % bs]
        assert torch.equal(g.isnan(), e.isnan()), f"{name}_cache: wrong set of elements written"
        if not slots:
            continue
        if not fp8:
            err = rel(g[written], e[written])
            assert err < 1e-2, f"{name}_cache: relative error {err:.3g}"
            heads = ~e.isnan().reshape(-1, D).any(-1)  # the written (or already set) heads
            assert_elements_close(g.reshape(-1, D)[heads], e.reshape(-1, D)[heads], f"{name}_cache")
            continue
        s = scale.item()
        for t, slot in slots:
            if slot in skip_slots:
                continue
            ok = fp8_close(g[slot // bs, slot % bs], val[t].reshape(nkv, D), s)
            assert ok.all(), (
                f"{name}_cache slot {slot} (token {t}): {int((~ok).sum())} of {ok.numel()} e4m3 values off "
                f"the reference (scale {s})"
            )


# ----------------------------------------------------------------------------- guard buffers
def is_contiguous(shape, stride) -> bool:
    """torch's definition: dims of size 1 are ignored; a tensor of no elements is contiguous."""
    if any(s == 0 for s in shape):
        return True
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1:
            if st != expected:
                return False
            expected *= size
    return True


def extent(shape, stride) -> int:
    """Elements spanned from the first element to the last one, inclusive (0 for an empty tensor)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))


def non_overlapping(shape, stride) -> bool:
    """True when no two indices of the view reach the same element, decided the usual way: with the dims of
    size > 1 sorted by stride, each stride is at least the extent of the dims inside it (no zero stride).
    (A few exotic interleavings that do not overlap are reported as overlapping; the views built here are
    never such.)"""
    dims = sorted((st, s) for s, st in zip(shape, stride, strict=True) if s > 1)
    inner = 1
    for st, s in dims:
        if st < inner:
            return False
        inner = st * (s - 1) + inner
    return True


class Guarded:
    """A flat byte buffer filled with a poison byte, guard bands of `guard` bytes at both ends, out of which
    tensor views are carved (Guarded.view). snapshot() records every byte; changed_elements() and
    assert_unchanged() compare against that record bit for bit (NaN poison included)."""

    def __init__(self, nbytes: int, device, guard: int = 4096, poison: int = POISON):
        if guard % 16:
            raise ValueError(f"guard must be a multiple of 16 bytes, got {guard}")
        self.guard = guard
        self.size = guard + -(-nbytes // 16) * 16 + guard
        self.buf = torch.full((self.size,), poison, dtype=torch.uint8, device=device)
        if self.buf.data_ptr() % 64:
            raise AssertionError(
                f"allocator returned a buffer at {self.buf.data_ptr():#x}, not 64-byte aligned"
            )
        self.poison = poison
        self.before: torch.Tensor | None = None

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        return self.buf.view(dtype)

    def view(self, dtype: torch.dtype, shape, stride, offset: int = 0) -> torch.Tensor:
        """A view of `dtype` elements at element `offset` past the front guard (which must fit)."""
        esize = torch.empty((), dtype=dtype).element_size()
        start = self.guard // esize + offset
        if offset < -(self.guard // esize) or (start + extent(shape, stride)) * esize > self.size:
            raise ValueError(f"view {list(shape)} {stride} at offset {offset} does not fit in the buffer")
        return self.typed(dtype).as_strided(tuple(shape), tuple(stride), start)

    def snapshot(self):
        self.before = self.buf.clone()

    def changed_elements(self, dtype: torch.dtype) -> torch.Tensor:
        """Bool [size / element size]: which elements of `dtype` (indexed as in typed(dtype)) differ from
        the snapshot in any byte."""
        esize = torch.empty((), dtype=dtype).element_size()
        return (self.buf.view(-1, esize) != self.before.view(-1, esize)).any(dim=1)

    def guard_intact(self) -> bool:
        """Both guard bands still hold the poison byte (checked without a snapshot)."""
        g = self.guard
        return bool((self.buf[:g] == self.poison).all()) and bool(
            (self.buf[self.size - g :] == self.poison).all()
        )

    def assert_unchanged(self, what: str):
        if not torch.equal(self.buf, self.before):
            idx = (self.buf != self.before).nonzero().flatten()
            raise AssertionError(
                f"{what}: {idx.numel()} bytes changed (first at byte {idx[0].item() - self.guard} from the "
                f"view's buffer start, guard {self.guard} bytes)"
            )


def element_index(t: torch.Tensor, guarded: Guarded) -> torch.Tensor:
    """For a view carved out of `guarded`: int64 tensor of t's shape holding each element's index in
    guarded.typed(t.dtype)."""
    n = guarded.size // t.element_size()
    return torch.arange(n, device=t.device).as_strided(t.shape, t.stride(), t.storage_offset())


def carve(shape, dtype, device, *, stride=None, offset: int = 0, guard: int = 4096, data=None) -> tuple:
    """A view of `shape` (and `stride`, default contiguous) at element `offset` in its own Guarded buffer;
    `data` (broadcastable to shape) is written into it: through the view when it does not overlap itself,
    else through the view with its zero-stride dims reduced to one element. Returns (view, guarded)."""
    shape = tuple(shape)
    if stride is None:
        stride = tuple(torch.empty(shape, device="meta").stride()) if shape else ()
    esize = torch.empty((), dtype=dtype).element_size()
    need = (max(offset, 0) + extent(shape, stride)) * esize
    g = Guarded(need, device, guard=guard)
    v = g.view(dtype, shape, stride, offset)
    if data is not None:
        data = torch.as_tensor(data).to(device=v.device)
        if non_overlapping(shape, stride):
            v.copy_(data.expand(shape).to(dtype))
        else:
            base_shape = tuple(1 if st == 0 else s for s, st in zip(shape, stride, strict=True))
            base = v.as_strided(base_shape, stride, v.storage_offset())
            if not non_overlapping(base_shape, stride):
                raise ValueError(f"cannot write data through the self-overlapping view {shape} {stride}")
            idx = tuple(slice(0, n) for n in base_shape)
            base.copy_(data.expand(shape)[idx].to(dtype))
    return v, g

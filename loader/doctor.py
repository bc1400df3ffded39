"""`flint-aot doctor`: run every variant of a bundle once on the GPU, on random inputs, against the torch
reference (float64), and report. What an operator runs after deploying a serving container. Needs torch,
cuda-bindings and a GPU; not the DSL."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from loader import nvfp4
from loader import reference as ref

K, D = 2048, 128
TOL = 1e-2  # SPEC §3: relative Frobenius error of q, k, v


@dataclass
class Result:
    variant: str
    max_err: float  # the largest relative error over the outputs checked
    ok: bool
    ms: float  # wall time of the (first) call, including the module load
    note: str = ""


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _weights(fmt, n, g):
    w = (torch.randn(n, K, device="cuda", generator=g) * 0.03).bfloat16()
    if fmt == "bf16":
        return (w, None, None), w
    packed, scales, gs = nvfp4.quantize(w)
    return (packed, scales, gs), nvfp4.dequantize(packed, scales, gs)


def _timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def _check_norm(e, m, g):
    import loader

    x = torch.randn(m, K, device="cuda", generator=g).bfloat16()
    w = (1 + 0.3 * torch.randn(K, device="cuda", generator=g)).bfloat16()
    if e.spec["residual"]:
        r = torch.randn(m, K, device="cuda", generator=g).bfloat16()
        (xn, ro), ms = _timed(lambda: loader.fused_add_rms_norm(x, r, w, 1e-6))
        exn, ero = ref.rms_norm_ref(x, r, w, 1e-6)
        return max(_rel(xn, exn), _rel(ro, ero)), ms
    xn, ms = _timed(lambda: loader.rms_norm(x, w, 1e-6))
    return _rel(xn, ref.rms_norm_ref(x, None, w, 1e-6)[0]), ms


def _qk_case(m, nq, nkv, rope, g):
    nb, bs = 8, 16
    c = dict(
        q_norm_weight=(1 + 0.3 * torch.randn(D, device="cuda", generator=g)).bfloat16(),
        k_norm_weight=(1 + 0.3 * torch.randn(D, device="cuda", generator=g)).bfloat16(),
        qk_eps=1e-6,
        cos_sin_cache=ref.make_cos_sin_cache(4096, device="cuda") if rope else None,
        positions=torch.randint(0, 4096, (m,), device="cuda", generator=g),
        k_cache=torch.full((nb, bs, nkv, D), float("nan"), dtype=torch.bfloat16, device="cuda"),
        slot_mapping=torch.randperm(nb * bs, device="cuda", generator=g)[:m],
    )
    c["v_cache"] = torch.full_like(c["k_cache"], float("nan"))
    return c


def _cache_err(c, k, v, kb, vb):
    ek, ev = ref.expected_cache(kb, vb, k, v, c["slot_mapping"])
    err = 0.0
    for got, exp in ((c["k_cache"], ek), (c["v_cache"], ev)):
        if not torch.equal(got.isnan(), exp.isnan()):
            return float("inf")
        w = ~exp.isnan()
        err = max(err, _rel(got[w], exp[w]))
    return err


def _check_qkv(e, m, g):
    import loader

    nq, nkv = e.spec["heads"]
    n = (nq + 2 * nkv) * D
    x = torch.randn(m, K, device="cuda", generator=g).bfloat16()
    r = torch.randn(m, K, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.3 * torch.randn(K, device="cuda", generator=g)).bfloat16()
    (w, ws, gs), dense = _weights(e.spec["weight_format"], n, g)
    c = _qk_case(m, nq, nkv, e.spec["rope"], g)
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    (q, ro), ms = _timed(lambda: loader.flint_qkv_fused(x, r, nw, 1e-6, w, ws, gs, num_q_heads=nq,
                                                        num_kv_heads=nkv, **c))  # fmt: skip
    exp = ref.qkv_fused_ref(x, r, nw, 1e-6, dense, c["q_norm_weight"], c["k_norm_weight"], 1e-6,
                            c["cos_sin_cache"], c["positions"], nq, nkv)  # fmt: skip
    if q.isnan().any():
        return float("inf"), ms
    return max(_rel(q.view(m, nq, D), exp["q"]), _rel(ro, exp["residual_out"]),
               _cache_err(c, exp["k"], exp["v"], kb, vb)), ms  # fmt: skip


def _check_gemv(e, m, g):
    import loader

    n = 1024 + 16
    x = torch.randn(m, K, device="cuda", generator=g).bfloat16()
    (w, ws, gs), dense = _weights(e.spec["weight_format"], n, g)
    y, ms = _timed(lambda: loader.gemv(x, w, ws, gs))
    return _rel(y, ref.gemv_ref(x, dense)), ms


def _check_qk(e, m, g):
    import loader

    nq, nkv = 8, 2
    qkv = (torch.randn(m, (nq + 2 * nkv) * D, device="cuda", generator=g) * 3).bfloat16()
    c = _qk_case(m, nq, nkv, e.spec["rope"], g)
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    q, ms = _timed(lambda: loader.qk_norm_rope_cache(qkv, num_q_heads=nq, num_kv_heads=nkv, **c))
    eq, ek, ev = ref.qk_norm_rope_ref(qkv, c["q_norm_weight"], c["k_norm_weight"], 1e-6, c["cos_sin_cache"],
                                      c["positions"], nq, nkv)  # fmt: skip
    if q.isnan().any():
        return float("inf"), ms
    return max(_rel(q.view(m, nq, D), eq), _cache_err(c, ek, ev, kb, vb)), ms


CHECKS = {"norm": _check_norm, "qkv": _check_qkv, "gemv": _check_gemv, "qk_norm_rope_cache": _check_qk}


def run(bundle_path=None, m: int = 3, seed: int = 0) -> list[Result]:
    """One call per variant of the bundle for this GPU's architecture."""
    import loader
    from loader import runtime

    if not torch.cuda.is_available():
        raise RuntimeError("flint-aot doctor needs a CUDA GPU")
    b = loader.load_bundle(bundle_path)
    arch = runtime.arch_for(torch.cuda.get_device_capability())
    entries = [e for e in b.manifest.kernels if e.arch == arch]
    if not entries:
        have = ", ".join(b.manifest.archs())
        raise RuntimeError(f"bundle {b.path} has no cubins for this GPU ({arch}); it has: {have}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for e in entries:
        check = CHECKS.get(e.kind)
        if check is None:
            out.append(Result(e.name, float("nan"), False, 0.0, f"unknown kernel kind {e.kind!r}"))
            continue
        try:
            err, ms = check(e, m, g)
            out.append(Result(e.name, err, err < TOL, ms))
        except Exception as ex:  # report every failure, keep checking the others
            out.append(Result(e.name, float("nan"), False, 0.0, f"{type(ex).__name__}: {ex}"[:200]))
    return out

"""The self-check a serving image runs after deployment (docs/bundle.md §7): every variant of a bundle, once,
on this GPU, on random inputs, against the float64 torch reference; exit status 1 if any fails.

    python -m loader.doctor [BUNDLE] [-m M ...]    (`flint-aot doctor` runs the same code)

Needs torch, cuda-bindings and a GPU; not the DSL, not the build package. A plugin kernel (docs/plugins.md),
for which it knows no reference, is verified and loaded but not run.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from loader import abi, nvfp4
from loader import reference as ref

D = 128
TOL = 1e-2  # docs/numerics.md §6: relative Frobenius error of q, k, v
FP8_TOL = 5e-2  # an e4m3 cache: 3 mantissa bits, RMS rounding error ~3 % of the value
MS = (1, 8, 9, 32, 64)  # the token counts checked unless asked: the 8-token tile's ends and each stream tile


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


def _weights(fmt, n, k, g):
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.03).bfloat16()
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

    k = abi.spec_hidden(e.spec)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (1 + 0.3 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    if e.spec["residual"]:
        r = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        (xn, ro), ms = _timed(lambda: loader.fused_add_rms_norm(x, r, w, 1e-6))
        exn, ero = ref.rms_norm_ref(x, r, w, 1e-6)
        return max(_rel(xn, exn), _rel(ro, ero)), ms
    xn, ms = _timed(lambda: loader.rms_norm(x, w, 1e-6))
    return _rel(xn, ref.rms_norm_ref(x, None, w, 1e-6)[0]), ms


def _qk_case(m, nq, nkv, rope, kv, g, qk_norm=True):
    """Inputs of the per-head stage; caches poisoned with NaN (bf16 NaN, or the e4m3 NaN byte 0x7f)."""
    nb, bs = 8, 16
    def nw():  # (None without q/k norm)
        return (1 + 0.3 * torch.randn(D, device="cuda", generator=g)).bfloat16() if qk_norm else None

    c = dict(
        q_norm_weight=nw(),
        k_norm_weight=nw(),
        qk_eps=1e-6,
        cos_sin_cache=ref.make_cos_sin_cache(4096, device="cuda") if rope else None,
        positions=torch.randint(0, 4096, (m,), device="cuda", generator=g),
        slot_mapping=torch.randperm(nb * bs, device="cuda", generator=g)[:m],
    )
    if kv == "bf16":
        c["k_cache"] = torch.full((nb, bs, nkv, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    else:  # per-tensor scales that keep these values (|k| <~ 5, |v| <~ 15) inside e4m3's +-448
        nan = torch.full((nb, bs, nkv, D), 0x7F, dtype=torch.uint8, device="cuda")
        c["k_cache"] = nan.view(torch.float8_e4m3fn)
        c["k_scale"] = torch.tensor([0.05], device="cuda")
        c["v_scale"] = torch.tensor([0.05], device="cuda")
    c["v_cache"] = c["k_cache"].clone()
    return c


def _cache_err(c, k, v, kb, vb):
    """Relative error of the written slots against the reference (an FP8 cache: its dequantized values
    against the unquantized reference, whose e4m3 rounding alone is a few percent: see FP8_TOL); inf when
    the set of written elements is wrong."""
    err = 0.0
    for name, before, want in (("k", kb, k), ("v", vb, v)):
        got, scale = c[f"{name}_cache"], c.get(f"{name}_scale")
        exp = ref.expected_cache(before.float(), before.float(), want, want, c["slot_mapping"])[0]
        g = got.float() * (1.0 if scale is None else scale.item())
        if not torch.equal(g.isnan(), exp.isnan()):
            return float("inf")
        w = ~exp.isnan()
        err = max(err, _rel(g[w], exp[w]))
    return err


def _check_qkv(e, m, g):
    import loader

    nq, nkv = e.spec["heads"]
    n, k = (nq + 2 * nkv) * D, abi.spec_hidden(e.spec)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    r = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.3 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    (w, ws, gs), dense = _weights(e.spec["weight_format"], n, k, g)
    c = _qk_case(m, nq, nkv, e.spec["rope"], e.spec["kv_cache_dtype"], g, e.spec.get("qk_norm", True))
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    with loader.launch_options(design=e.spec["norm"]):
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

    n, k = 1024 + 16, abi.spec_hidden(e.spec)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    (w, ws, gs), dense = _weights(e.spec["weight_format"], n, k, g)
    y, ms = _timed(lambda: loader.gemv(x, w, ws, gs))
    return _rel(y, ref.gemv_ref(x, dense)), ms


def _check_qk(e, m, g):
    import loader

    nq, nkv = 8, 2
    qkv = (torch.randn(m, (nq + 2 * nkv) * D, device="cuda", generator=g) * 3).bfloat16()
    c = _qk_case(m, nq, nkv, e.spec["rope"], e.spec["kv_cache_dtype"], g, e.spec.get("qk_norm", True))
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    q, ms = _timed(lambda: loader.qk_norm_rope_cache(qkv, num_q_heads=nq, num_kv_heads=nkv, **c))
    eq, ek, ev = ref.qk_norm_rope_ref(qkv, c["q_norm_weight"], c["k_norm_weight"], 1e-6, c["cos_sin_cache"],
                                      c["positions"], nq, nkv)  # fmt: skip
    if q.isnan().any():
        return float("inf"), ms
    return max(_rel(q.view(m, nq, D), eq), _cache_err(c, ek, ev, kb, vb)), ms


CHECKS = {"norm": _check_norm, "qkv": _check_qkv, "gemv": _check_gemv, "qk_norm_rope_cache": _check_qk}


def _runs_at(e, m: int) -> bool:
    """Whether a call of m tokens runs entry e (a GEMV kernel serves the calls its token tile is the smallest
    of the tiles to hold)."""
    return "max_m" not in e.spec or abi.m_tiles(m)[0] == e.spec["max_m"]


def no_gpu(prog: str) -> str:
    """Why `prog` cannot run here: what torch says of CUDA, and the fix."""
    cuda, available = torch.version.cuda, torch.cuda.is_available()
    build = f"built for CUDA {cuda}" if cuda else "a CPU-only build (torch.version.cuda is None)"
    fix = ("no GPU is visible to it: check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES" if cuda else
           "run it on the GPU machine, with a CUDA build of torch")  # fmt: skip
    return (f"{prog} needs a CUDA GPU; found torch {torch.__version__}, {build}, and "
            f"torch.cuda.is_available() = {available}: {fix}")  # fmt: skip


def run(bundle_path=None, ms=MS, seed: int = 0, prog: str = "python -m loader.doctor") -> list[Result]:
    """One call per variant of the bundle for this GPU's architecture and M of ms that runs it (by default the
    8-token kernels at M = 1 and 8, the 16-, 32- and 64-token ones at M = 9, 32 and 64). prog: the command,
    for the messages."""
    import loader
    from loader import runtime

    if not torch.cuda.is_available():
        raise RuntimeError(no_gpu(prog))
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
        if check is None:  # a plugin kernel (docs/plugins.md): no reference here; its cubin checked, loaded
            try:
                runtime.launcher(torch.cuda.current_device(), e.kind, ("doctor", e.name), lambda e=e: e.spec)
                out.append(Result(e.name, float("nan"), True, 0.0, "plugin kernel: loaded, not run"))
            except Exception as ex:  # a bad cubin: reported like a failed variant
                out.append(Result(e.name, float("nan"), False, 0.0, f"{type(ex).__name__}: {ex}"[:200]))
            continue
        for m in [m for m in ms if _runs_at(e, m)]:
            name = f"{e.name} M={m}"
            try:
                err, t = check(e, m, g)
                tol = FP8_TOL if e.spec.get("kv_cache_dtype") == "fp8_e4m3" else TOL
                out.append(Result(name, err, err < tol, t))
            except Exception as ex:  # report every failure, keep checking the others
                out.append(Result(name, float("nan"), False, 0.0, f"{type(ex).__name__}: {ex}"[:200]))
    return out


def report(results: list[Result]) -> str:
    """The table `python -m loader.doctor` and `flint-aot doctor` print."""
    rows = [["variant", "max rel err", "result", "ms (first call)", "note"]]
    rows += [[r.variant, f"{r.max_err:.2e}", "pass" if r.ok else "FAIL", f"{r.ms:.2f}", r.note]
             for r in results]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    bad = sum(not r.ok for r in results)
    lines.append(f"{len(results) - bad} of {len(results)} variants pass (tolerance {TOL:g}, "
                 f"FP8 caches {FP8_TOL:g})")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loader.doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", nargs="?", default=None,
                    help="bundle directory (default: as the loader finds it: $FLINT_AOT_BUNDLE, the packed "
                         "bundle, build/flint)")  # fmt: skip
    ap.add_argument("-m", dest="tokens", type=int, action="append", choices=range(1, abi.MAX_M + 1),
                    metavar="M",
                    help=f"tokens per call (1..{abi.MAX_M}; repeatable; default "
                         f"{', '.join(map(str, MS))})")  # fmt: skip
    a = ap.parse_args(argv)
    try:
        results = run(a.bundle, ms=a.tokens or MS)
    except Exception as e:  # no GPU, no bundle, no cubins for this GPU: one line, exit 1
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(report(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

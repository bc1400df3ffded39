"""What `torch.ops.flint.*` costs over the plain functions, against the dispatcher's own floor (BENCHMARKS.md
"Host cost per call"): for each of the five ops, the plain function, the custom op, and a no-op custom op of
the same schema registered the same way (Library.define + impl for CUDA), interleaved over five rounds, min
and median of the rounds in µs per eager call (M = 1, heads (32, 4), BF16, BF16 cache).

    PYTHONPATH=. python3 benchmarks/bench_dispatch.py [--bundle build/flint] [--calls 2000]

The target (docs/api.md §11): torch.ops.flint.X - plain X <= the no-op's cost + 2 µs, i.e. what the
registration adds beyond the dispatcher's own boxing of that many arguments is at most 2 µs.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from bench_host import QKV_ARGS, case, per_call  # (benchmarks/ is the script's directory)

import loader


def _schema(op) -> str:
    s = str(op.default._schema)
    return s[s.index("(") :]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default=os.environ.get("FLINT_AOT_BUNDLE", "build/flint"))
    ap.add_argument("--calls", type=int, default=2000)
    opt = ap.parse_args()
    loader.load_bundle(opt.bundle)
    c = case(1, 32, 4, "bf16", "bf16", torch.Generator(device="cuda").manual_seed(0))
    x, r, nw, w = c["x"], c["residual"], c["norm_weight"], c["weight"]
    qkv = torch.randn(1, (32 + 2 * 4) * 128, device="cuda").bfloat16()
    head = [c[k] for k in ("q_norm_weight", "k_norm_weight", "qk_eps", "cos_sin_cache", "positions",
                           "k_cache", "v_cache", "slot_mapping", "num_q_heads", "num_kv_heads")]  # fmt: skip
    ops = {  # op name: (plain function, positional arguments)
        "rms_norm": (loader.rms_norm, [x, nw, 1e-6]),
        "fused_add_rms_norm": (loader.fused_add_rms_norm, [x, r, nw, 1e-6]),
        "gemv": (loader.gemv, [x, w, None, None]),
        "qkv_fused": (loader.flint_qkv_fused, [c[k] for k in QKV_ARGS]),
        "qk_norm_rope_cache": (loader.qk_norm_rope_cache, [qkv, *head]),
    }
    lib = torch.library.Library("flint_dispatch", "FRAGMENT")
    out = torch.empty(0, device="cuda")
    for name in ops:
        op = getattr(torch.ops.flint, name)
        results = len(op.default._schema.returns)
        lib.define(f"noop_{name}" + _schema(op))
        lib.impl(f"noop_{name}", (lambda *a, k=results, **kw: out if k == 1 else (out,) * k), "CUDA")
    a_ = torch.randn(1, 2048, device="cuda").bfloat16()
    calls = {"torch.add(a, a)": lambda: torch.add(a_, a_)}
    for name, (fn, args) in ops.items():
        calls[f"{name}: plain"] = lambda fn=fn, args=args: fn(*args)
        calls[f"{name}: torch.ops.flint"] = lambda name=name, args=args: getattr(torch.ops.flint, name)(*args)
        calls[f"{name}: no-op of its schema"] = lambda name=name, args=args: getattr(
            torch.ops.flint_dispatch, f"noop_{name}")(*args)  # fmt: skip
    times = {k: [] for k in calls}
    for _ in range(5):
        for k, f in calls.items():
            times[k].append(per_call(f, opt.calls, 5))
    print("| call | min µs | median µs |\n|---|---|---|")
    for k, v in times.items():
        print(f"| `{k}` | {min(v):.2f} | {statistics.median(v):.2f} |")
    print("\n| op | torch.ops - plain, µs | no-op of the schema, µs | excess over the floor, µs "
          "(target <= 2) |")  # fmt: skip
    print("|---|---|---|---|")
    for name in ops:
        best = {k: min(times[f"{name}: {k}"]) for k in ("plain", "torch.ops.flint", "no-op of its schema")}
        over = best["torch.ops.flint"] - best["plain"]
        floor = best["no-op of its schema"]
        verdict = "met" if over - floor <= 2 else "MISSED"
        print(f"| {name} | {over:.2f} | {floor:.2f} | {over - floor:.2f} {verdict} |")


if __name__ == "__main__":
    main()

"""What the dispatcher costs a Python custom op (BENCHMARKS.md "Host cost per call"): the plain functions
beside `torch.ops.flint.*` and beside ops of the same schemas registered other ways, interleaved over five
rounds, min and median of the rounds in µs per eager call (M = 1, heads (32, 4), BF16, BF16 cache).

    PYTHONPATH=. python3 benchmarks/bench_dispatch.py [--bundle build/flint] [--calls 2000]

Rows: the `torch.ops.flint.*` op as registered (a wrapper for qkv_fused, the plain function for
qk_norm_rope_cache); the plain function registered as the op's implementation directly (no wrapper);
the same also registered for AutogradCUDA (skipping the autograd and ADInplaceOrView fallbacks); and
no-ops of each schema registered for CUDA, for CUDA + AutogradCUDA and as CompositeExplicitAutograd: the
dispatcher's own cost, which no Python implementation can go below.
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
    args = [c[k] for k in QKV_ARGS]
    qkv = torch.randn(1, (32 + 2 * 4) * 128, device="cuda").bfloat16()
    qa = [qkv, c["q_norm_weight"], c["k_norm_weight"], c["qk_eps"], c["cos_sin_cache"], c["positions"],
          c["k_cache"], c["v_cache"], c["slot_mapping"], c["num_q_heads"], c["num_kv_heads"]]  # fmt: skip
    out = torch.empty(0, device="cuda")
    lib = torch.library.Library("flint_dispatch", "FRAGMENT")
    fused, noop2 = torch.ops.flint.qkv_fused, lambda *a, **k: (out, out)
    regs = {  # name: (schema of, implementation, dispatch keys)
        "qkv_direct": (fused, loader.flint_qkv_fused, ("CUDA",)),
        "qkv_direct_ag": (fused, loader.flint_qkv_fused, ("CUDA", "AutogradCUDA")),
        "qkv_noop": (fused, noop2, ("CUDA",)),
        "qkv_noop_ag": (fused, noop2, ("CUDA", "AutogradCUDA")),
        "qkv_noop_cea": (fused, noop2, ("CompositeExplicitAutograd",)),
        "qknrc_noop": (torch.ops.flint.qk_norm_rope_cache, lambda *a, **k: out, ("CUDA",)),
    }
    for name, (like, fn, keys) in regs.items():
        lib.define(name + _schema(like))
        for k in keys:
            lib.impl(name, fn, k)
    d = torch.ops.flint_dispatch
    a_ = torch.randn(1, 2048, device="cuda").bfloat16()
    variants = {
        "torch.add(a, a)": lambda: torch.add(a_, a_),
        "loader.flint_qkv_fused, positional": lambda: loader.flint_qkv_fused(*args),
        "torch.ops.flint.qkv_fused, positional": lambda: torch.ops.flint.qkv_fused(*args),
        "the plain function as the op's implementation": lambda: d.qkv_direct(*args),
        "the same, also for AutogradCUDA": lambda: d.qkv_direct_ag(*args),
        "no-op, qkv_fused's schema, CUDA": lambda: d.qkv_noop(*args),
        "no-op, qkv_fused's schema, CUDA + AutogradCUDA": lambda: d.qkv_noop_ag(*args),
        "no-op, qkv_fused's schema, CompositeExplicitAutograd": lambda: d.qkv_noop_cea(*args),
        "loader.qk_norm_rope_cache, positional": lambda: loader.qk_norm_rope_cache(*qa),
        "torch.ops.flint.qk_norm_rope_cache, positional": lambda: torch.ops.flint.qk_norm_rope_cache(*qa),
        "no-op, qk_norm_rope_cache's schema, CUDA": lambda: d.qknrc_noop(*qa),
    }
    times = {k: [] for k in variants}
    for _ in range(5):
        for k, f in variants.items():
            times[k].append(per_call(f, opt.calls, 5))
    print("| call | min µs | median µs |\n|---|---|---|")
    for k, v in times.items():
        print(f"| {k} | {min(v):.2f} | {statistics.median(v):.2f} |")


if __name__ == "__main__":
    main()

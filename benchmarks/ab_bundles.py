"""A/B of kernel builds: the fused op's per-layer time for each bundle and design, interleaved in one process
and measured twice (bundle order A, B, ..., then again), with bench_qkv.py's harness (CUDA-graph replay of
many layers with distinct weights, L2 defeated). For kernel experiments: build each variant into its own
bundle (only the variants compared are needed), then

    PYTHONPATH=. python3 benchmarks/ab_bundles.py --bundles build/a build/b [--heads 32x4 16x2] [--m 1 8]
        [--fmt bf16 nvfp4] [--designs separate prologue]

Prints one markdown row per (heads, weights, M, bundle, design): µs per layer, first and second pass.
"""

import argparse

import torch
from bench_qkv import LayerChain, median_graph_us  # (benchmarks/ is the script's directory)

import loader


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundles", nargs="+", required=True)
    ap.add_argument("--heads", nargs="*", default=["32x4", "16x2"])
    ap.add_argument("--m", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--fmt", nargs="*", default=["bf16", "nvfp4"])
    ap.add_argument("--designs", nargs="*", default=["separate", "prologue"])
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for h in args.heads:
        nq, nkv = (int(v) for v in h.split("x"))
        for fmt in args.fmt:
            chain = LayerChain(nq, nkv, fmt)
            for m in args.m:
                fused = chain.fn(m)
                times = {}
                for _ in range(2):
                    for b in args.bundles:
                        loader.load_bundle(b)
                        for d in args.designs:
                            with loader.launch_options(design=d):
                                times.setdefault((b, d), []).append(median_graph_us(fused, chain.layers))
                for (b, d), (t0, t1) in times.items():
                    rows.append(f"| ({nq},{nkv}) | {fmt} | {m} | {b} | {d} | {t0:.2f} | {t1:.2f} |")
                    print(rows[-1], flush=True)
            chain = None
            torch.cuda.empty_cache()
    print("\n| heads | weights | M | bundle | design | µs/layer | again |\n|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

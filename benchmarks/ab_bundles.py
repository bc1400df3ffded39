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
from bench_qkv import D, K, make_weights, median_graph_us  # (benchmarks/ is the script's directory)

import loader
from loader.reference import make_cos_sin_cache


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
        n = (nq + 2 * nkv) * D
        for fmt in args.fmt:
            wbytes = n * K * 2 if fmt == "bf16" else n * K // 2 + n * K // 16
            layers = max(8, int(600e6 // wbytes))
            ws = make_weights(fmt, n, layers)
            cs = make_cos_sin_cache(4096, device="cuda")
            nw = torch.ones(K, dtype=torch.bfloat16, device="cuda")
            qn = torch.ones(D, dtype=torch.bfloat16, device="cuda")
            kc = torch.zeros(layers, 64, 16, nkv, D, dtype=torch.bfloat16, device="cuda")
            vc = torch.zeros_like(kc)
            for m in args.m:
                x, r = (torch.randn(m, K, device="cuda").bfloat16() for _ in range(2))
                pos = torch.arange(m, device="cuda") + 100
                slots = torch.arange(m, device="cuda") + 32

                def fused():
                    for i in range(layers):
                        w, wsc, gs = ws[i]
                        loader.flint_qkv_fused(x, r, nw, 1e-6, w, wsc, gs, qn, qn, 1e-6, cs, pos, kc[i],
                                               vc[i], slots, nq, nkv)  # fmt: skip

                times = {}
                for _ in range(2):
                    for b in args.bundles:
                        loader.load_bundle(b)
                        for d in args.designs:
                            with loader.launch_options(design=d):
                                times.setdefault((b, d), []).append(median_graph_us(fused, layers))
                for (b, d), (t0, t1) in times.items():
                    rows.append(f"| ({nq},{nkv}) | {fmt} | {m} | {b} | {d} | {t0:.2f} | {t1:.2f} |")
                    print(rows[-1], flush=True)
            ws = kc = vc = None
            torch.cuda.empty_cache()
    print("\n| heads | weights | M | bundle | design | µs/layer | again |\n|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

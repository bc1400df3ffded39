"""The standalone GEMV's weight stream against the number of CTAs per layer: per-layer time and achieved
bandwidth of loader.gemv (BF16 and NVFP4, one CTA per 16 rows) for N rows around multiples of the 132 SMs,
CUDA-graph replay of many layers with distinct weights (L2 defeated), the copy bandwidth in the same run.
Whether a layer whose CTAs do not divide evenly over the SMs (heads (16, 2): 160 CTAs) streams slower per
byte than one that does (docs/benchmarks-history.md §0.6, "an even load").

    PYTHONPATH=. python3 benchmarks/gemv_sweep.py [--n 2112 2560 ...] [--m 1 8] [--fmt bf16 nvfp4]
"""

import argparse

import torch
from bench_qkv import TARGET_BYTES, copy_bandwidth, gemv_layers, make_weights, median_graph_us  # (script dir)

import loader

K = 2048
SMS = 132


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", nargs="*", type=int, default=[1056, 2112, 2560, 2640, 3168, 4224, 5120, 6336])
    ap.add_argument("--m", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--fmt", nargs="*", default=["bf16", "nvfp4"])
    ap.add_argument("--bundle", default=None)
    a = ap.parse_args()
    loader.load_bundle(a.bundle)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    for fmt in a.fmt:
        for n in a.n:
            wbytes = n * K * 2 if fmt == "bf16" else n * K // 2 + n * K // 16
            layers = max(8, int(TARGET_BYTES // wbytes))
            ws = make_weights(fmt, n, layers)
            for m in a.m:
                us = median_graph_us(gemv_layers(ws, m), layers)
                ctas, tbs = n // 16, wbytes / us / 1e6
                rows.append(f"| {fmt} | {n} | {ctas} | {ctas / SMS:.2f} | {m} | {us:.2f} | {tbs:.2f} | "
                            f"{tbs / (bw / 1e12) * 100:.0f}% |")  # fmt: skip
                print(rows[-1], flush=True)
            del ws
            torch.cuda.empty_cache()
    print("\n| weights | N | CTAs | CTAs per SM | M | µs per layer | TB/s | % of copy BW |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

"""Which design an eager call should run, per M: wall time per layer of back-to-back eager flint_qkv_fused
calls over many layers of distinct weights (L2 defeated, as in a model), in each design, beside the loader's
own eager choice. Eager calls are host-bound at small M (the prologue design launches one kernel and
allocates no xn: ~5 µs less host time) and GPU-bound at large M (the two-kernel design's GPU time grows
less with M), so the faster design changes with M; the loader's choice per token tile (loader/ops.py
_EAGER) is set from this table (BENCHMARKS.md).

    PYTHONPATH=. python3 benchmarks/eager_design.py [--bundle build/flint] [--m 1 8 16 32 64]
        [--heads 32x4 16x8 16x2] [--fmt bf16 nvfp4]
"""

import argparse
import statistics
import time

import torch
from bench_qkv import LayerChain  # (benchmarks/ is the script's directory)

import loader


def per_layer_us(fn, layers: int, reps: int = 15) -> float:
    """Median over reps of one eager pass over every layer (synchronized), per layer."""
    fn()  # plans built, modules loaded
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / layers)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="build/flint")
    ap.add_argument("--m", nargs="*", type=int, default=[1, 8, 9, 16, 17, 32, 33, 64])
    ap.add_argument("--heads", nargs="*", default=["32x4", "16x8", "16x2"])
    ap.add_argument("--fmt", nargs="*", default=["bf16", "nvfp4"])
    a = ap.parse_args()
    loader.load_bundle(a.bundle)
    torch.manual_seed(0)
    print("| heads | weights | M | prologue µs/layer | two-kernel µs/layer | the loader's choice | faster |")
    print("|---|---|---|---|---|---|---|")
    for h in a.heads:
        nq, nkv = (int(v) for v in h.split("x"))
        for fmt in a.fmt:
            chain = LayerChain(nq, nkv, fmt)
            for m in a.m:
                fn = chain.fn(m)
                t = {}
                for design in ("prologue", "separate", None):
                    with loader.launch_options(design=design):
                        t[design] = per_layer_us(fn, chain.layers)
                best = min(("prologue", "separate"), key=t.get)
                print(f"| ({nq},{nkv}) | {fmt} | {m} | {t['prologue']:.1f} | {t['separate']:.1f} | "
                      f"{t[None]:.1f} | {best} |", flush=True)  # fmt: skip
            chain = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""The weight stream at the layer shapes past one wave of registers (Qwen3-4B, 8B, 14B, 32B and their TP
shards), measured before any epilogue is built on it: the stream probe (benchmarks/stream_probe, a plugin
kernel) as a register ring of the 8-token GEMV (mode ring, 8 blocks a lane in flight, 3 CTAs per SM) and as
the bare stream of the same loads (mode load), with the weight rows dense and padded by 64 elements (the
stride of a power of two, K = 4096, against another), beside cuBLAS's GEMM of the same weights and
the copy bandwidth, all in one run. CUDA graphs of enough layers with distinct weights to defeat L2, medians
of replays, µs per layer (bench_qkv's method).

    flint-aot build benchmarks/stream_probe.yaml -o build/stream_probe      # (on the CPU machine)
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_stream.py [--bundle build/stream_probe] [--m 1 8]
        [--out FILE.md] [--commit HASH]

Every ring variant's y is checked against a float64 reference before it is timed: every element within
3e-2 of its token's RMS (bf16 rounding of elements up to ~4x the RMS, and the fp32 sums; a wrong layout or
order of k is off by the RMS itself).
"""

import argparse
import time
from pathlib import Path

import torch
from stream_probe.abi import KIND, grid, smem_bytes

import loader
from benchmarks.bench_qkv import copy_bandwidth, git_commit, median_graph_us

# (model, N, K): the qkv layers of notes' table at K > 2048
SHAPES = [("Qwen3-4B", 6144, 2560), ("Qwen3-8B", 6144, 4096), ("Qwen3-8B TP2", 3072, 4096),
          ("Qwen3-14B", 7168, 5120), ("Qwen3-32B", 10240, 5120), ("Qwen3-32B TP4", 2560, 5120),
          ("Qwen3-235B TP4", 2304, 4096)]  # fmt: skip
# (mode, weight row pad in elements): pad 64 makes the rows' stride other than the power of two of K = 4096
VARIANTS = [(mode, pad) for mode in ("ring", "load") for pad in (0, 64)]
PADS = (0, 64)
TARGET_BYTES = 800e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="build/stream_probe")
    ap.add_argument("--m", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    loader.load_bundle(args.bundle)
    commit = args.commit or git_commit()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, commit {commit}", flush=True)
    rows = []
    for model, n, k in SHAPES:
        wbytes = n * k * 2
        layers = max(2, int(TARGET_BYTES // wbytes) + 1)
        wp = {pad: [(torch.randn(n, k + pad, device="cuda") * 0.02).bfloat16() for _ in range(layers)]
              for pad in PADS}  # fmt: skip
        ws = wp[0]
        for m in args.m:
            x = torch.randn(m, k, device="cuda").bfloat16()
            ys = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
            # limit: the weights' bytes at the copy rate (bytes read + written per second), as notes and
            # BENCHMARKS.md count it
            row = {"model": model, "N": n, "K": k, "MB": wbytes / 1e6, "M": m, "limit": wbytes / bw * 1e6}
            for mode, pad in VARIANTS:
                spec = {"ctas": 3, "depth": 8, "k": k, "mode": mode, "pad": pad}

                def run(spec=spec, w=wp[pad]):
                    for i in range(layers):
                        loader.launch_kernel(KIND, spec, grid(n), smem=smem_bytes(k), x=x, w=w[i], y=ys[i],
                                             m=m, n=n)  # fmt: skip

                if mode == "ring":
                    ys[0].fill_(float("nan"))
                    run()
                    torch.cuda.synchronize()
                    ref = x.double() @ wp[pad][0][:, :k].double().t()
                    err = (ys[0].double() - ref).abs() / ref.pow(2).mean(-1, keepdim=True).sqrt()
                    worst = err.max().item()
                    assert (err <= 3e-2).all(), f"{model} {spec}: y off the reference ({worst:.3g})"
                row[f"{mode}_pad{pad}"] = median_graph_us(run, layers)

            def cublas():
                for i in range(layers):
                    torch.matmul(x, ws[i].t(), out=ys[i])

            row["cublas"] = median_graph_us(cublas, layers)
            rows.append(row)
            print(row, flush=True)
        ws = wp = None
        torch.cuda.empty_cache()
    cols = [f"{mode}_pad{pad}" for mode, pad in VARIANTS] + ["cublas"]
    text = (f"commit {commit}; copy bandwidth {bw / 1e12:.2f} TB/s (read + write). µs per layer; (%): of the "
            "copy bandwidth (the weights' bytes over the time, over the copy's rate).\n\n"
            "| model | N | K | MB | M | limit | " + " | ".join(cols) + " |\n|"
            + "---|" * (6 + len(cols)) + "\n")  # fmt: skip
    for r in rows:
        cells = [f"{r[c]:.2f} ({100 * r['limit'] / r[c]:.0f})" for c in cols]
        text += (f"| {r['model']} | {r['N']} | {r['K']} | {r['MB']:.1f} | {r['M']} | {r['limit']:.2f} | "
                 + " | ".join(cells) + " |\n")  # fmt: skip
    print(text)
    print(f"took {time.perf_counter() - t0:.0f} s")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

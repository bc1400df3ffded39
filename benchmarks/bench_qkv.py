"""Per-layer time of the fused qkv op under CUDA-graph replay of many layers with distinct weights (L2
defeated): BF16 and NVFP4 weights, both designs (the input norm in the qkv kernel's prologue, and the
two-kernel design), BF16 and FP8 KV caches, M = 1 .. 16, beside cuBLAS's GEMV alone, the op called on two
halves of the batch (M > 8: what a caller did before the op served 16 tokens) and the device copy
bandwidth, all in one run (BENCHMARKS.md §1).

    PYTHONPATH=. python3 benchmarks/bench_qkv.py [--out FILE.md] [--heads 32x4 ...] [--m 1 ...]
        [--fmt bf16 nvfp4] [--bundle build/flint] [--compare BUNDLE ...] [--all]

The designs are chosen with loader.launch_options(design=...). --all adds the prologue design with an FP8
cache and without PDL. --compare adds, per row, the fused op from other bundles (A/B of kernel versions in
one run; each bundle needs the variants benchmarked).
"""

import argparse
import statistics
from pathlib import Path

import torch

import loader
from loader.reference import make_cos_sin_cache

K, D = 2048, 128
HEADS = [(32, 4), (16, 8), (16, 2)]
MS = [1, 2, 4, 8, 12, 16]
TARGET_BYTES = 600e6  # weights per graph: > 10x the 60 MB L2


def median_graph_us(fn, layers, reps=30, warmup=3):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # load modules, warm allocator
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        fn()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / layers)
    return statistics.median(times)


def copy_bandwidth():
    """Device-to-device copy of 4 GiB: bytes read + written per second, best of eager and graph medians."""
    n = 1 << 30  # 1 Gi float32 = 4 GiB
    a = torch.empty(n, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    t = min(statistics.median(times[2:]), median_graph_us(lambda: b.copy_(a), 1, reps=10))
    return 2 * n * 4 / (t * 1e-6)


def make_weights(fmt, n, layers):
    """Distinct weights per layer: bf16 [N, K]; or NVFP4 random codes, e4m3 scales in [2^-3, 2^2) (their rows
    padded to a multiple of 128, as the swizzled layout has them), gs 0.01."""
    if fmt == "bf16":
        return [((torch.randn(n, K, device="cuda") * 0.02).bfloat16(), None, None) for _ in range(layers)]
    gs = torch.tensor([0.01], device="cuda")
    out = []
    for _ in range(layers):
        codes = torch.randint(0, 256, (n, K // 2), dtype=torch.uint8, device="cuda")
        sc = torch.randint(0x18, 0x38, (-(-n // 128) * 128, K // 16), dtype=torch.uint8, device="cuda")
        sc = sc.view(torch.float8_e4m3fn)
        out.append((codes, sc, gs))
    return out


def gemv_layers(ws, m: int):
    """A function running loader.gemv once over each layer's weights ws [(w, scales, gs)], for m tokens."""
    x = torch.randn(m, K, device="cuda").bfloat16()

    def run():
        for w, wsc, gs in ws:
            loader.gemv(x, w, wsc, gs)

    return run


class LayerChain:
    """L layers of the fused op with distinct weights (enough bytes to defeat the L2) and a BF16 KV cache
    each, RoPE on: the workload of ab_bundles.py and tools/timeline.py."""

    def __init__(self, nq: int, nkv: int, fmt: str):
        self.nq, self.nkv = nq, nkv
        n = (nq + 2 * nkv) * D
        self.wbytes = n * K * 2 if fmt == "bf16" else n * K // 2 + n * K // 16
        self.layers = max(8, int(TARGET_BYTES // self.wbytes))
        self.ws = make_weights(fmt, n, self.layers)
        self.cs = make_cos_sin_cache(4096, device="cuda")
        self.nw = torch.ones(K, dtype=torch.bfloat16, device="cuda")
        self.qn = torch.ones(D, dtype=torch.bfloat16, device="cuda")
        self.kc = torch.zeros(self.layers, 64, 16, nkv, D, dtype=torch.bfloat16, device="cuda")
        self.vc = torch.zeros_like(self.kc)

    def fn(self, m: int, before_layer=None):
        """A function running every layer once for m tokens (random activations and residual, positions from
        100, slots from 32); before_layer(i), if given, runs before layer i's call."""
        x, r = (torch.randn(m, K, device="cuda").bfloat16() for _ in range(2))
        pos, slots = torch.arange(m, device="cuda") + 100, torch.arange(m, device="cuda") + 32

        def run():
            for i in range(self.layers):
                if before_layer is not None:
                    before_layer(i)
                w, wsc, gs = self.ws[i]
                loader.flint_qkv_fused(x, r, self.nw, 1e-6, w, wsc, gs, self.qn, self.qn, 1e-6, self.cs, pos,
                                       self.kc[i], self.vc[i], slots, self.nq, self.nkv)  # fmt: skip

        return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--heads", nargs="*", default=None, help="e.g. 32x4 16x2 (default: all)")
    ap.add_argument("--m", nargs="*", type=int, default=MS)
    ap.add_argument("--fmt", nargs="*", default=["bf16", "nvfp4"])
    ap.add_argument("--bundle", default="build/flint")
    ap.add_argument("--compare", nargs="*", default=[], help="other bundle directories (A/B, fused op only)")
    ap.add_argument("--all", action="store_true", help="also the prologue design with an FP8 cache, no PDL")
    args = ap.parse_args()
    heads = HEADS if not args.heads else [tuple(int(v) for v in h.split("x")) for h in args.heads]
    main_bundle = Path(args.bundle).resolve()
    loader.load_bundle(main_bundle)
    ab = []
    torch.manual_seed(0)
    bw = copy_bandwidth()
    rows = []
    cublas_us = {}
    for nq, nkv in heads:
        n = (nq + 2 * nkv) * D
        for fmt in args.fmt:
            wbytes = n * K * 2 if fmt == "bf16" else n * K // 2 + n * K // 16
            layers = max(8, int(TARGET_BYTES // wbytes))
            ws = make_weights(fmt, n, layers)
            cs = make_cos_sin_cache(4096, device="cuda")
            nw = torch.ones(K, dtype=torch.bfloat16, device="cuda")
            qn = torch.ones(D, dtype=torch.bfloat16, device="cuda")
            caches = {}
            for kv, dt in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
                kc = torch.zeros(layers, 64, 16, nkv, D, dtype=dt, device="cuda")
                caches[kv] = (kc, torch.zeros_like(kc))
            scale = torch.full((1,), 0.05, device="cuda")
            for m in args.m:
                x = torch.randn(m, K, device="cuda").bfloat16()
                r = torch.randn(m, K, device="cuda").bfloat16()
                pos = torch.arange(m, device="cuda") + 100
                slots = torch.arange(m, device="cuda") + 32

                def fused(kv="bf16", parts=((0, m),)):
                    kc, vc = caches[kv]
                    sc = {"k_scale": scale, "v_scale": scale} if kv == "fp8" else {}
                    for i in range(layers):
                        w, wsc, gs = ws[i]
                        for a, b in parts:  # (two halves: the tokens a..b of the batch per call)
                            loader.flint_qkv_fused(x[a:b], r[a:b], nw, 1e-6, w, wsc, gs, qn, qn, 1e-6,
                                                   cs, pos[a:b], kc[i], vc[i], slots[a:b], nq, nkv,
                                                   **sc)  # fmt: skip

                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

                def cublas():
                    for i in range(layers):
                        torch.matmul(x, ws[i][0].t(), out=out)

                nan = float("nan")
                with loader.launch_options(design="prologue"):
                    t_pro = median_graph_us(fused, layers)
                    t_fp8 = median_graph_us(lambda: fused("fp8"), layers) if args.all else nan
                with loader.launch_options(design="prologue", pdl=False):
                    t_nopdl = median_graph_us(fused, layers) if args.all else nan
                with loader.launch_options(design="separate"):
                    t_sep = median_graph_us(fused, layers)
                    t_sep_fp8 = median_graph_us(lambda: fused("fp8"), layers)
                    halves = ((0, m // 2), (m // 2, m))
                    t_halves = median_graph_us(lambda: fused(parts=halves), layers) if m > 8 else nan
                if fmt == "bf16":
                    cublas_us[(nq, nkv, m)] = median_graph_us(cublas, layers)
                t_cublas = cublas_us.get((nq, nkv, m), float("nan"))
                for path in args.compare:
                    loader.load_bundle(path)
                    try:
                        ab.append((f"({nq},{nkv})", fmt, m, path, median_graph_us(fused, layers)))
                        print(ab[-1], flush=True)
                    except LookupError as e:  # this bundle lacks the variant
                        print(f"skip {path}: {e}", flush=True)
                    finally:
                        loader.load_bundle(main_bundle)
                best = min(t_pro, t_sep)
                limit = wbytes / bw * 1e6
                rows.append((f"({nq},{nkv})", fmt, m, layers, wbytes / 1e6, t_pro, t_sep, t_fp8, t_sep_fp8,
                             t_nopdl, t_halves, t_cublas, limit, 100 * limit / best,
                             t_cublas / best))  # fmt: skip
                print(rows[-1], flush=True)
            ws = caches = None  # free before the next shape
            torch.cuda.empty_cache()
    head = (
        f"copy bandwidth (read+write, 4 GiB device copy, graph, median): {bw / 1e12:.2f} TB/s\n\n"
        "| heads | weights | M | layers | weight MB | prologue µs/layer | two-kernel µs/layer | "
        "prologue, FP8 cache | two-kernel, FP8 cache | prologue, no PDL | two calls of M/2 (two-kernel) | "
        "cuBLAS BF16 GEMV alone | limit µs (weights / copy BW) | % of copy BW (best) | cuBLAS / best |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    fmt_us = lambda v: "–" if v != v else f"{v:.2f}"  # noqa: E731 (NaN: not measured)
    body = "".join(
        f"| {h} | {fmt} | {m} | {lay} | {mb:.1f} | {tp:.2f} | {ts:.2f} | {fmt_us(tf8)} | {tsf8:.2f} | "
        f"{fmt_us(tn)} | {fmt_us(th)} | {fmt_us(tc)} | {lim:.2f} | {pct:.0f}% | {ratio:.2f}x |\n"
        for h, fmt, m, lay, mb, tp, ts, tf8, tsf8, tn, th, tc, lim, pct, ratio in rows
    )
    text = head + body
    if ab:
        text += f"\nA/B against {main_bundle} (µs per layer):\n\n"
        text += "| heads | weights | M | bundle | fused |\n|---|---|---|---|---|\n"
        text += "".join(f"| {h} | {f_} | {m} | {p} | {f:.2f} |\n" for h, f_, m, p, f in ab)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

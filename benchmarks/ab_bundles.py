"""A/B of kernel builds: the fused op's per-layer time for each bundle and design, interleaved in one process
and measured twice (bundle order A, B, ..., then again), with bench_qkv.py's harness (CUDA-graph replay of
many layers with distinct weights, L2 defeated). For kernel experiments: build each variant into its own
bundle (only the variants compared are needed), then

    PYTHONPATH=. python3 benchmarks/ab_bundles.py --bundles build/a build/b [--heads 32x4 16x2] [--m 1 8]
        [--fmt bf16 nvfp4] [--designs separate prologue] [--op qkv gemv]

Another cluster scheduling policy is another bundle: a diagnostic build of the same config with
`diagnostics: {cluster_policy: spread}` (docs/config.md).

Prints one markdown row per (op, heads, weights, M, bundle, design): µs per layer, first and second pass, and
whether its results (q and the cache of every layer, or y) are bit-identical to the first bundle's.
`--op gemv` times the standalone GEMV (loader.gemv) on the same layers' weights instead: the weight stream
without the norm, the cluster and the epilogue.
"""

import argparse

import torch
from bench_qkv import LayerChain, gemv_layers, median_graph_us  # (benchmarks/ is the script's directory)

import loader


def results(chain: LayerChain, op: str, m: int, design: str) -> list:
    """The outputs of a few layers for fixed inputs (seeded): q and both caches, or y."""
    g = torch.Generator(device="cuda").manual_seed(m)
    x, r = (torch.randn(m, 2048, device="cuda", generator=g).bfloat16() for _ in range(2))
    pos, slots = torch.arange(m, device="cuda") + 100, torch.arange(m, device="cuda") + 32
    out = []
    with loader.launch_options(design=None if design == "-" else design):
        for i in range(min(4, chain.layers)):
            w, wsc, gs = chain.ws[i]
            if op == "gemv":
                out.append(loader.gemv(x, w, wsc, gs))
                continue
            chain.kc[i].fill_(float("nan"))
            chain.vc[i].fill_(float("nan"))
            kc, vc = chain.kc[i], chain.vc[i]
            q, _ = loader.flint_qkv_fused(x, r, chain.nw, 1e-6, w, wsc, gs, chain.qn, chain.qn, 1e-6,
                                          chain.cs, pos, kc, vc, slots, chain.nq, chain.nkv)  # fmt: skip
            out += [q, chain.kc[i].clone().nan_to_num_(7.0), chain.vc[i].clone().nan_to_num_(7.0)]
    torch.cuda.synchronize()
    return out


def use(b: str) -> None:
    """Serve from bundle b."""
    loader.load_bundle(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundles", nargs="+", required=True)
    ap.add_argument("--heads", nargs="*", default=["32x4", "16x2"])
    ap.add_argument("--m", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--fmt", nargs="*", default=["bf16", "nvfp4"])
    ap.add_argument("--designs", nargs="*", default=["separate", "prologue"])
    ap.add_argument("--op", nargs="*", default=["qkv"], choices=["qkv", "gemv"])
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for h in args.heads:
        nq, nkv = (int(v) for v in h.split("x"))
        for fmt in args.fmt:
            chain = LayerChain(nq, nkv, fmt)
            for m, op in ((m, op) for m in args.m for op in args.op):
                fn = chain.fn(m) if op == "qkv" else gemv_layers(chain.ws, m)
                times, same = {}, {}
                for b in args.bundles:  # results of one pass, against the first bundle's that has them
                    use(b)
                    for d in args.designs if op == "qkv" else ["-"]:
                        try:
                            same[b, d] = results(chain, op, m, d)
                        except LookupError:  # the bundle lacks the variant (e.g. a tile it does not have)
                            print(f"| {op} | ({nq},{nkv}) | {fmt} | {m} | {b} | {d} | – | – | not in it |")
                if not same:
                    continue
                ref = next(iter(same.values()))
                same = {k: all(map(torch.equal, r, ref)) for k, r in same.items()}
                for _ in range(2):
                    for b in args.bundles:
                        use(b)
                        for d in args.designs if op == "qkv" else ["-"]:
                            if (b, d) not in same:
                                continue
                            with loader.launch_options(design=None if d == "-" else d):
                                times.setdefault((b, d), []).append(median_graph_us(fn, chain.layers))
                for (b, d), (t0, t1) in times.items():
                    rows.append(f"| {op} | ({nq},{nkv}) | {fmt} | {m} | {b} | {d} | {t0:.2f} | {t1:.2f} | "
                                f"{'yes' if same[b, d] else '**no**'} |")  # fmt: skip
                    print(rows[-1], flush=True)
            chain = None
            torch.cuda.empty_cache()
    print("\n| op | heads | weights | M | bundle | design | µs/layer | again | bit-identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

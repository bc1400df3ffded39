"""Per-layer time of the fused qkv op under CUDA-graph replay of many layers with distinct weights (L2
defeated): BF16 and NVFP4 weights, both designs (the input norm in the qkv kernel's prologue, and the
two-kernel design), BF16 and FP8 KV caches, M = 1 .. 64, beside two peers and the device copy bandwidth, all
in one run (docs/benchmarks-history.md §1):

* cuBLAS's GEMM alone, torch.matmul(x, W.t(), out=y);
* a plain Triton GEMM (benchmarks/triton_gemm.py), the best of its config sweep per (heads, M), each config
  checked against a float64 reference (every element bounded) before it is timed.

Both peers run on BF16 weights (those of the op's BF16 rows) and are measured once per (heads, M): the NVFP4
rows show the same numbers, since torch has no NVFP4 GEMM on sm_90a. Neither has PDL nor any fusion.

    PYTHONPATH=. python3 benchmarks/bench_qkv.py [--out FILE.md] [--json FILE.json] [--heads 32x4 ...]
        [--m 1 ...] [--fmt bf16 nvfp4] [--bundle build/flint] [--compare BUNDLE ...] [--all | --quick]
        [--hidden K] [--no-qk-norm]
        [--commit HASH]     # (the commit recorded; default `git rev-parse --short HEAD`, else 'unknown')
    python benchmarks/plot_qkv.py FILE.json FILE.png        # the plot, from the JSON (needs matplotlib)

The designs are chosen with loader.launch_options(design=...). --all adds the prologue design with an FP8
cache and without PDL; --quick measures the two-kernel design and the peers only. --compare adds, per row,
the fused op from other bundles (A/B of kernel versions in one run; each bundle needs the variants
benchmarked). Rows with M above the loader's limit (loader.abi.MAX_M) have peers but no op columns.
--hidden runs another hidden size K (the bundle must hold its variants, e.g. configs/models/qwen3-0.6b.yaml);
--no-qk-norm the kernels without q/k norm (q_norm_weight = k_norm_weight = None).
"""

import argparse
import json
import math
import statistics
import subprocess
import time
from pathlib import Path

import torch

import loader
from loader.abi import MAX_M
from loader.reference import make_cos_sin_cache

K, D = 2048, 128  # (K: --hidden)
HEADS = [(32, 4), (16, 8), (16, 2)]
MS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
M_MAX_HERE = 64  # the most tokens this script sizes its caches, positions and slots for
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


def weight_bytes(fmt: str, n: int) -> int:
    """Bytes of one layer's qkv weights with n rows: BF16, or NVFP4 codes + e4m3 block scales."""
    return n * K * 2 if fmt == "bf16" else n * K // 2 + n * K // 16


def layer_count(wbytes: int) -> int:
    """Layers per graph: enough weight bytes to defeat the L2 (TARGET_BYTES), at least 8."""
    return max(8, int(TARGET_BYTES // wbytes))


def git_commit() -> str:
    """The repository's short HEAD, or 'unknown' (a copy without .git, no git)."""
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                           capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "unknown"


def load_triton_gemm():
    """benchmarks/triton_gemm.py, or None (with a note) where triton is not installed."""
    try:
        import triton_gemm  # (benchmarks/ is the script's directory)
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        print("note: triton is not installed (pip install triton): no Triton GEMM column", flush=True)
        return None
    return triton_gemm


def check_triton(tg, cfg, x, w) -> float:
    """Run tg.gemm once with cfg on x [M, K], w [N, K] into a NaN-poisoned y, then require every element
    within 1e-2 relative (plus 1e-4 of the fp32 accumulation scale sum |x| |w|, for elements that cancel)
    of a float64 reference; returns max |y - ref| / max |ref|. A mismatch raises: a wrong peer is a bug."""
    m, n = x.shape[0], w.shape[0]
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    tg.gemm(x, w, y, cfg)
    ref = x.double() @ w.double().t()
    bound = 1e-2 * ref.abs() + 1e-4 * (x.double().abs() @ w.double().abs().t())
    err = (y.double() - ref).abs()
    bad = ~(err <= bound)  # (NaN: not written)
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise RuntimeError(f"Triton GEMM {cfg} at M={m}, N={n}: {int(bad.sum())} elements beyond the bound, "
                           f"first at {i}: {y[i[0], i[1]].item()} vs {ref[i[0], i[1]].item()}")  # fmt: skip
    return (err.max() / ref.abs().max()).item()


def measure_peers(x, ws, tg) -> dict:
    """The peers of one (heads, M) row on BF16 weights ws [(w, None, None)] per layer: cuBLAS's GEMM alone and
    the Triton GEMM's sweep (each config checked, then captured in its own graph over all layers; a config
    that does not compile or launch is skipped with a note), µs per layer."""
    m, n, layers = x.shape[0], ws[0][0].shape[0], len(ws)
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    res = {"peer_layers": layers, "peer_weight_bytes": weight_bytes("bf16", n)}

    def cublas():
        for w, _, _ in ws:
            torch.matmul(x, w.t(), out=y)

    res["cublas"] = median_graph_us(cublas, layers)
    res.update(triton=None, triton_config=None, triton_err=None, triton_sweep={})
    if tg is None:
        return res
    acc = torch.empty(m, n, dtype=torch.float32, device="cuda")  # the split-K workspace
    for cfg in tg.CONFIGS:
        try:
            tg.gemm(x, ws[0][0], y, cfg, acc)  # compiles (Triton caches it per token block)
            torch.cuda.synchronize()
        except Exception as e:  # out of shared memory, a compiler error: skip this config
            note = f"skipped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"  Triton {cfg} M={m}: {note}", flush=True)
            res["triton_sweep"][str(cfg)] = note
            continue
        err = check_triton(tg, cfg, x, ws[0][0])

        def run(cfg=cfg):
            for w, _, _ in ws:
                tg.gemm(x, w, y, cfg, acc)

        us = median_graph_us(run, layers)
        res["triton_sweep"][str(cfg)] = us
        if res["triton"] is None or us < res["triton"]:
            res.update(triton=us, triton_config=str(cfg), triton_err=err)
    return res


# (key, Markdown header, format); a column that no row of the run measured is left out of the table
COLUMNS = [
    ("prologue", "prologue µs/layer", "{:.2f}"),
    ("two_kernel", "two-kernel µs/layer (the op)", "{:.2f}"),
    ("prologue_fp8", "prologue, FP8 cache", "{:.2f}"),
    ("two_kernel_fp8", "two-kernel, FP8 cache", "{:.2f}"),
    ("prologue_no_pdl", "prologue, no PDL", "{:.2f}"),
    ("cublas", "cuBLAS GEMM (BF16)", "{:.2f}"),
    ("triton", "Triton GEMM (BF16, best)", "{:.2f}"),
    ("triton_config", "Triton config", "{}"),
    ("limit", "limit µs (weights / copy BW)", "{:.2f}"),
    ("pct_copy_bw", "% of copy BW (op)", "{:.0f}%"),
    ("op_over_cublas", "op / cuBLAS", "{:.2f}x"),
    ("op_over_triton", "op / Triton", "{:.2f}x"),
]


def finish_row(row: dict, bw: float, commit: str) -> dict:
    """Add a row's derived numbers: the bandwidth limit (its weight bytes / copy bandwidth), the op's share of
    the copy bandwidth and its ratios to the peers (the op = the two-kernel design; None where not
    measured)."""
    op = row.get("two_kernel")
    row["limit"] = row["weight_bytes"] / bw * 1e6
    row["copy_bw"], row["commit"] = bw, commit
    row["pct_copy_bw"] = 100 * row["limit"] / op if op else None
    for peer in ("cublas", "triton"):
        row[f"op_over_{peer}"] = op / row[peer] if op and row.get(peer) else None
    return row


def markdown(rows: list, bw: float, commit: str, ab: list, main_bundle) -> str:
    """The run's table (and its A/B table, if any) in Markdown."""
    cols = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]

    def cell(v, f):
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f.format(v)

    text = (
        f"commit {commit}; hidden size {K}; copy bandwidth (read+write, 4 GiB device copy, graph, median): "
        f"{bw / 1e12:.2f} TB/s.\n"
        "µs per layer, CUDA graph of many layers with distinct weights, median of 30 replays. The op: "
        "flint_qkv_fused, two-kernel design (% of copy BW and the ratios use it; below 1x the op is faster). "
        "Peers, measured once per (heads, M) on BF16 weights of the same heads and shown in both formats' "
        "rows (torch has no NVFP4 GEMM on sm_90a), neither with PDL nor fusion: cuBLAS = "
        "torch.matmul(x, W.t(), out=y); Triton = benchmarks/triton_gemm.py, the best of its sweep "
        "(config: rows per program, K tile, stages, split K). – = not measured (the op: M above "
        f"loader.abi.MAX_M = {MAX_M}).\n\n"
        "| heads | weights | M | layers | weight MB | " + " | ".join(h for _, h, _ in cols) + " |\n"
        "|---|---|---|---|---|" + "---|" * len(cols) + "\n"
    )
    for r in rows:
        text += f"| ({r['heads'][0]},{r['heads'][1]}) | {r['fmt']} | {r['M']} | {r['layers']} | "
        text += f"{r['weight_bytes'] / 1e6:.1f} | " + " | ".join(cell(r.get(k), f) for k, _, f in cols)
        text += " |\n"
    if ab:
        text += f"\nA/B against {main_bundle} (µs per layer):\n\n"
        text += "| heads | weights | M | bundle | fused |\n|---|---|---|---|---|\n"
        text += "".join(f"| {h} | {f_} | {m} | {p} | {f:.2f} |\n" for h, f_, m, p, f in ab)
    return text


def main():
    global K  # (--hidden: every helper of this script sizes its tensors by K)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="the table in Markdown")
    ap.add_argument("--json", default=None, help="every row's numbers (for benchmarks/plot_qkv.py)")
    ap.add_argument("--heads", nargs="*", default=None, help="e.g. 32x4 16x2 (default: all)")
    ap.add_argument("--m", nargs="*", type=int, default=MS)
    ap.add_argument("--fmt", nargs="*", default=["bf16", "nvfp4"], choices=["bf16", "nvfp4"])
    ap.add_argument("--bundle", default="build/flint")
    ap.add_argument("--commit", default=None, help="recorded commit (default: git rev-parse --short HEAD)")
    ap.add_argument("--compare", nargs="*", default=[], help="other bundle directories (A/B, fused op only)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--all", action="store_true", help="also the prologue design with an FP8 cache, no PDL")
    mode.add_argument("--quick", action="store_true", help="only the two-kernel design and the peers")
    ap.add_argument("--hidden", type=int, default=K, help="the hidden size K (default 2048)")
    ap.add_argument("--no-qk-norm", action="store_true", help="the kernels without q/k norm")
    args = ap.parse_args()
    K = args.hidden
    if not args.m or not all(1 <= m <= M_MAX_HERE for m in args.m):
        ap.error(f"--m takes token counts 1..{M_MAX_HERE}, got {args.m}")
    heads = HEADS if not args.heads else [tuple(int(v) for v in h.split("x")) for h in args.heads]
    fmts = sorted(set(args.fmt), key=lambda f: f != "bf16")  # BF16 first: its weights serve the peers
    t_start = time.perf_counter()
    commit = args.commit or git_commit()
    main_bundle = Path(args.bundle).resolve()
    loader.load_bundle(main_bundle)
    tg = load_triton_gemm()
    ab = []
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, commit {commit}", flush=True)
    rows = []
    peers = {}  # (nq, nkv, m) -> the peers' columns, measured at the first row of that shape
    for nq, nkv in heads:
        n = (nq + 2 * nkv) * D
        peer_ws = None
        for fmt in fmts:
            wbytes = weight_bytes(fmt, n)
            layers = layer_count(wbytes)
            ws = make_weights(fmt, n, layers)
            if fmt == "bf16":
                peer_ws = ws
            elif peer_ws is None and any((nq, nkv, m) not in peers for m in args.m):
                peer_ws = make_weights("bf16", n, layer_count(weight_bytes("bf16", n)))
            cs = make_cos_sin_cache(4096, device="cuda")
            nw = torch.ones(K, dtype=torch.bfloat16, device="cuda")
            qn = None if args.no_qk_norm else torch.ones(D, dtype=torch.bfloat16, device="cuda")
            caches = {}
            for kv, dt in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
                kc = torch.zeros(layers, 64, 16, nkv, D, dtype=dt, device="cuda")  # 1024 slots a layer
                caches[kv] = (kc, torch.zeros_like(kc))
            scale = torch.full((1,), 0.05, device="cuda")
            for m in args.m:
                x = torch.randn(m, K, device="cuda").bfloat16()
                r = torch.randn(m, K, device="cuda").bfloat16()
                pos = torch.arange(m, device="cuda") + 100
                slots = torch.arange(m, device="cuda") + 32

                def fused(kv="bf16"):
                    kc, vc = caches[kv]
                    sc = {"k_scale": scale, "v_scale": scale} if kv == "fp8" else {}
                    for i in range(layers):
                        w, wsc, gs = ws[i]
                        loader.flint_qkv_fused(x, r, nw, 1e-6, w, wsc, gs, qn, qn, 1e-6, cs, pos, kc[i],
                                               vc[i], slots, nq, nkv, **sc)  # fmt: skip

                row = {"heads": [nq, nkv], "fmt": fmt, "M": m, "layers": layers, "weight_bytes": wbytes,
                       "hidden": K, "qk_norm": qn is not None}  # fmt: skip
                if m > MAX_M:
                    print(f"({nq},{nkv}) {fmt} M={m}: the op refuses M > loader.abi.MAX_M = {MAX_M}: "
                          "peers only", flush=True)  # fmt: skip
                else:
                    with loader.launch_options(design="separate"):
                        row["two_kernel"] = median_graph_us(fused, layers)
                        if not args.quick:
                            row["two_kernel_fp8"] = median_graph_us(lambda: fused("fp8"), layers)
                    if not args.quick:
                        with loader.launch_options(design="prologue"):
                            row["prologue"] = median_graph_us(fused, layers)
                            if args.all:
                                row["prologue_fp8"] = median_graph_us(lambda: fused("fp8"), layers)
                    if args.all:
                        with loader.launch_options(design="prologue", pdl=False):
                            row["prologue_no_pdl"] = median_graph_us(fused, layers)
                    for path in args.compare:
                        loader.load_bundle(path)
                        try:
                            with loader.launch_options(design="separate"):
                                ab.append((f"({nq},{nkv})", fmt, m, path, median_graph_us(fused, layers)))
                            print(ab[-1], flush=True)
                        except LookupError as e:  # this bundle lacks the variant
                            print(f"skip {path}: {e}", flush=True)
                        finally:
                            loader.load_bundle(main_bundle)
                if (nq, nkv, m) not in peers:
                    peers[(nq, nkv, m)] = measure_peers(x, peer_ws, tg)
                row.update(peers[(nq, nkv, m)])
                rows.append(finish_row(row, bw, commit))
                print({k: v for k, v in row.items() if k != "triton_sweep"}, flush=True)
            ws = peer_ws = caches = None  # free before the next shape
            torch.cuda.empty_cache()
    text = markdown(rows, bw, commit, ab, main_bundle)
    print(text)
    print(f"took {time.perf_counter() - t_start:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        meta = {"commit": commit, "copy_bw": bw, "device": torch.cuda.get_device_name(), "max_m": MAX_M,
                "torch": torch.__version__, "triton": tg.triton.__version__ if tg else None}  # fmt: skip
        ab_rows = [{"heads": h, "fmt": f_, "M": m, "bundle": p, "two_kernel": f} for h, f_, m, p, f in ab]
        Path(args.json).write_text(json.dumps({**meta, "rows": rows, "ab": ab_rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Peer benchmark (docs/benchmarks-history.md §3): per-layer time of the fused op against the unfused paths a
user could pick, all in one run, same harness as bench_qkv.py (CUDA-graph replay of many layers with distinct
weights, medians, copy bandwidth measured in the same run).

    PYTHONPATH=. python3 benchmarks/bench_peers.py --json peers.json [--out peers.md] [--no-compile]
    python benchmarks/plot_peers.py peers.json BENCHMARKS_peers.png      # on a machine with matplotlib

Rows: fused (PDL) | fused without PDL | ours unfused (norm -> gemv -> qk_norm_rope_cache, PDL) |
torch eager unfused | torch.compile'd unfused | cuBLAS BF16 GEMV alone | weight bytes / copy bandwidth.
The torch paths use dense bf16 weights for both formats (torch has no NVFP4 GEMV on sm_90a): what a user
without an NVFP4 kernel would run. Ratios are against the fused op.
"""

import argparse
import json

import torch

import loader
from benchmarks.bench_qkv import HEADS, MS, TARGET_BYTES, copy_bandwidth, make_weights, median_graph_us
from loader import nvfp4
from loader.reference import make_cos_sin_cache

K, D = 2048, 128
EPS = 1e-6


def torch_unfused(x, r, nw, w, qn, kn, cs, pos, kc, vc, slots, nq: int, nkv: int):
    """The op as a user would write it in torch (docs/numerics.md §1-§3)."""
    h = (x.float() + r.float()).bfloat16()
    hf = h.float()
    xn = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).bfloat16() * nw
    qkv = xn @ w.t()
    m = x.shape[0]
    q, k, v = qkv.view(m, nq + 2 * nkv, D).split([nq, nkv, nkv], dim=1)

    def norm_rope(t, wt):
        t = t.float()
        y = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS) * wt.float()
        c, s = cs[pos].unsqueeze(1).chunk(2, dim=-1)
        y1, y2 = y.chunk(2, dim=-1)
        return torch.cat((y1 * c - y2 * s, y2 * c + y1 * s), dim=-1).bfloat16()

    q = norm_rope(q, qn)
    k = norm_rope(k, kn)
    kc.view(-1, nkv, D).index_copy_(0, slots, k)
    vc.view(-1, nkv, D).index_copy_(0, slots, v)
    return q.reshape(m, nq * D), h


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--heads", nargs="*", default=None)
    ap.add_argument("--m", nargs="*", type=int, default=MS)
    ap.add_argument("--fmt", nargs="*", default=["bf16", "nvfp4"])
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    args = ap.parse_args()
    heads = HEADS if not args.heads else [tuple(int(v) for v in h.split("x")) for h in args.heads]
    torch.manual_seed(0)
    bw = copy_bandwidth()
    compiled = None if args.no_compile else torch.compile(torch_unfused, dynamic=True)
    rows = []
    peers_us = {}  # (nq, nkv, m) -> the dense-weight peers' times
    for nq, nkv in heads:
        n = (nq + 2 * nkv) * D
        for fmt in args.fmt:
            wbytes = n * K * 2 if fmt == "bf16" else n * K // 2 + n * K // 16
            layers = max(8, int(TARGET_BYTES // wbytes))
            ws = make_weights(fmt, n, layers)
            # dense bf16 weights for the torch paths and cuBLAS (the same for both formats: measured once per
            # shape); 21 MB/layer at (32,4), so fewer layers suffice to defeat the L2
            dl = max(8, int(TARGET_BYTES // (n * K * 2)))
            need_dense = any((nq, nkv, m) not in peers_us for m in args.m)
            dense = []
            if need_dense:
                dense = [w if fmt == "bf16" else nvfp4.dequantize(w, s, g).bfloat16() for w, s, g in ws[:dl]]
            cs = make_cos_sin_cache(4096, device="cuda")
            nw = torch.ones(K, dtype=torch.bfloat16, device="cuda")
            qn = torch.ones(D, dtype=torch.bfloat16, device="cuda")
            kc = torch.zeros(layers, 64, 16, nkv, D, dtype=torch.bfloat16, device="cuda")
            vc = torch.zeros_like(kc)
            for m in args.m:
                x = torch.randn(m, K, device="cuda").bfloat16()
                r = torch.randn(m, K, device="cuda").bfloat16()
                pos = torch.arange(m, device="cuda") + 100
                slots = torch.arange(m, device="cuda") + 32
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

                def fused():
                    for i in range(layers):
                        w, sc, gs = ws[i]
                        loader.flint_qkv_fused(x, r, nw, EPS, w, sc, gs, qn, qn, EPS, cs, pos, kc[i], vc[i],
                                               slots, nq, nkv)  # fmt: skip

                def unfused():
                    for i in range(layers):
                        w, sc, gs = ws[i]
                        xn, _ = loader.fused_add_rms_norm(x, r, nw, EPS)
                        qkv = loader.gemv(xn, w, sc, gs)
                        loader.qk_norm_rope_cache(qkv, qn, qn, EPS, cs, pos, kc[i], vc[i], slots, nq, nkv)

                def eager():
                    for i in range(dl):
                        torch_unfused(x, r, nw, dense[i], qn, qn, cs, pos, kc[i], vc[i], slots, nq, nkv)

                def comp():
                    for i in range(dl):
                        compiled(x, r, nw, dense[i], qn, qn, cs, pos, kc[i], vc[i], slots, nq, nkv)

                def cublas():
                    for i in range(dl):
                        torch.matmul(x, dense[i].t(), out=out)

                res = {"heads": [nq, nkv], "fmt": fmt, "M": m, "layers": layers, "weight_bytes": wbytes}
                res["fused"] = median_graph_us(fused, layers)
                with loader.launch_options(pdl=False):
                    res["fused_no_pdl"] = median_graph_us(fused, layers)
                res["unfused_ours"] = median_graph_us(unfused, layers)
                if (nq, nkv, m) not in peers_us:
                    p = peers_us[(nq, nkv, m)] = {"torch_eager": median_graph_us(eager, dl)}
                    p["torch_compile"] = None
                    if compiled is not None:
                        try:
                            p["torch_compile"] = median_graph_us(comp, dl)
                        except Exception as e:  # report, keep going
                            print(f"torch.compile failed: {type(e).__name__}: {e}", flush=True)
                    p["cublas_gemv"] = median_graph_us(cublas, dl)
                res.update(peers_us[(nq, nkv, m)])
                res["limit"] = wbytes / bw * 1e6
                rows.append(res)
                print(res, flush=True)
            ws = dense = kc = vc = None
            torch.cuda.empty_cache()
    cols = ["fused", "fused_no_pdl", "unfused_ours", "torch_eager", "torch_compile", "cublas_gemv", "limit"]
    text = f"copy bandwidth (read+write, 4 GiB device copy): {bw / 1e12:.2f} TB/s\n\n"
    text += "| heads | weights | M | " + " | ".join(cols)
    text += " | unfused / fused | eager / fused | compile / fused |\n"
    text += "|" + "---|" * (len(cols) + 6) + "\n"

    def f(v):
        return "n/a" if v is None else f"{v:.2f}"

    for r_ in rows:
        peers = ("unfused_ours", "torch_eager", "torch_compile")
        ratio = [r_[c] / r_["fused"] if r_[c] else None for c in peers]
        text += f"| ({r_['heads'][0]},{r_['heads'][1]}) | {r_['fmt']} | {r_['M']} | "
        text += " | ".join(f(r_[c]) for c in cols) + " | "
        text += " | ".join(f(v) + ("x" if v else "") for v in ratio) + " |\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"copy_bw": bw, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

"""The unfused ops per call, for decode steps and prefill chunks (M = 1 … 16,384), beside torch and the copy
bandwidth, in one run:

* rms_norm, fused_add_rms_norm and qk_norm_rope_cache (heads (32, 4) and (16, 8), BF16 and FP8 caches, RoPE
  on): µs per call (a CUDA graph of calls on distinct buffers, enough of them to defeat the L2, median of
  replays), the bytes the call must move (its reads and writes, once each) and their share of the copy
  bandwidth measured in the same run; beside the same computation in eager torch and torch.compile'd;
* the chain a deployment with its own GEMM builds, fused_add_rms_norm -> cuBLAS (torch.matmul) ->
  qk_norm_rope_cache, per layer at M = 1 … 64, beside the fused op (two-kernel design), both over layers of
  distinct weights (benchmarks/bench_qkv.py's LayerChain).

vLLM and FlashInfer kernels are not installed on the GPU machine; their numbers are not here.

    PYTHONPATH=. python3 benchmarks/bench_unfused.py [--quick] [--commit HASH] [--json F.json] [--out F.md]
"""

import argparse
import json
import math

import torch
from bench_qkv import LayerChain, copy_bandwidth, git_commit, median_graph_us  # (benchmarks/ on the path)

import loader
from loader.reference import make_cos_sin_cache

K, D = 2048, 128
MS = [1, 8, 16, 32, 64, 256, 1024, 4096, 16384]
HEADS = [(32, 4), (16, 8)]
L2_BYTES = 256e6  # bytes moved per graph: several times the L2
CHAIN_MS = [1, 2, 4, 8, 16, 32, 48, 64]


def calls_per_graph(nbytes: int) -> int:
    return max(2, min(48, math.ceil(L2_BYTES / nbytes)))


def timed(make, nbytes: int) -> float:
    """µs per call: make() returns a function of one call on buffers of its own; L of them in a graph."""
    n = calls_per_graph(nbytes)
    fns = [make() for _ in range(n)]
    return median_graph_us(lambda: [f() for f in fns], n)


# ----------------------------------------------------------------------------- the norms
def norm_case(m: int, residual: bool):
    x = torch.randn(m, K, device="cuda").bfloat16()
    r = torch.randn(m, K, device="cuda").bfloat16() if residual else None
    w = (1 + 0.3 * torch.randn(K, device="cuda")).bfloat16()
    return x, r, w


def torch_norm(x, r, w, eps: float = 1e-6):
    """The norm's numerics in torch (loader.reference.rms_norm_ref's arithmetic, fp32 statistics)."""
    h = x if r is None else (x.float() + r.float()).bfloat16()
    hf = h.float()
    xn = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).bfloat16().float() * w.float()
    return xn.bfloat16(), h


def norm_rows(ms, compiled):
    rows = []
    for op, residual in (("rms_norm", False), ("fused_add_rms_norm", True)):
        for m in ms:
            nbytes = m * K * 2 * (4 if residual else 2)

            def flint():
                x, r, w = norm_case(m, residual)
                return (lambda: loader.fused_add_rms_norm(x, r, w, 1e-6)) if residual else (
                    lambda: loader.rms_norm(x, w, 1e-6))  # fmt: skip

            def eager(fn=torch_norm):
                x, r, w = norm_case(m, residual)
                return lambda: fn(x, r, w)

            us = timed(flint, nbytes)
            rows.append(dict(op=op, m=m, bytes=nbytes, us=us, eager=timed(eager, nbytes),
                             compiled=timed(lambda: eager(compiled(torch_norm)), nbytes)))  # fmt: skip
            print(rows[-1], flush=True)
    return rows


# ----------------------------------------------------------------------------- the per-head stage
def qk_case(m: int, nq: int, nkv: int, kv: str):
    n = (nq + 2 * nkv) * D
    nb = -(-m // 16) + 4
    cache = lambda: torch.zeros(nb, 16, nkv, D, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    kc, vc = cache(), cache()
    if kv == "fp8_e4m3":
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    ones = torch.ones(D, dtype=torch.bfloat16, device="cuda")
    return dict(
        qkv=(torch.randn(m, n, device="cuda") * 3).bfloat16(), q_norm_weight=ones, k_norm_weight=ones,
        qk_eps=1e-6,
        cos_sin_cache=COS_SIN, positions=torch.randint(0, COS_SIN.shape[0], (m,), device="cuda"),
        k_cache=kc, v_cache=vc, slot_mapping=torch.randperm(nb * 16, device="cuda")[:m], num_q_heads=nq,
        num_kv_heads=nkv, **({} if kv == "bf16" else dict(k_scale=SCALE, v_scale=SCALE)),
    )  # fmt: skip


def torch_qk(qkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache,
             slot_mapping, num_q_heads, num_kv_heads, k_scale=None, v_scale=None):  # fmt: skip
    """The per-head stage in torch: q/k RMSNorm (fp32), NeoX RoPE (fp32), one bf16 rounding, q returned and
    k, v written into the paged caches at the slots (e4m3 of value / scale for an FP8 cache)."""
    m, nq, nkv = qkv.shape[0], num_q_heads, num_kv_heads
    h = qkv.view(m, nq + 2 * nkv, D)
    qk = h[:, : nq + nkv].float()
    w = torch.cat([q_norm_weight.float().expand(nq, D), k_norm_weight.float().expand(nkv, D)])
    y = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + qk_eps) * w
    cs = cos_sin_cache[positions].unsqueeze(1)
    c, s = cs[..., : D // 2], cs[..., D // 2 :]
    y1, y2 = y[..., : D // 2], y[..., D // 2 :]
    y = torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], -1).bfloat16()
    kf, vf = k_cache.view(-1, nkv, D), v_cache.view(-1, nkv, D)
    k, v = y[:, nq:], h[:, nq + nkv :]
    if k_scale is not None:  # (index_copy_ has no e4m3 kernel: the bytes, as uint8)
        k = (k.float() / k_scale).clamp(-448, 448).to(k_cache.dtype).view(torch.uint8)
        v = (v.float() / v_scale).clamp(-448, 448).to(v_cache.dtype).view(torch.uint8)
        kf, vf = kf.view(torch.uint8), vf.view(torch.uint8)
    kf.index_copy_(0, slot_mapping, k)
    vf.index_copy_(0, slot_mapping, v)
    return y[:, :nq].reshape(m, nq * D)


def qk_bytes(m: int, nq: int, nkv: int, kv: str) -> int:
    """Read: qkv, the position, slot and cos|sin row of each token; written: q, k and v."""
    esize = 1 if kv == "fp8_e4m3" else 2
    return m * ((nq + 2 * nkv) * D * 2 + 16 + D * 4 + nq * D * 2 + 2 * nkv * D * esize)


def qk_rows(ms, compiled):
    rows = []
    ctorch = compiled(torch_qk)
    for nq, nkv in HEADS:
        for kv in ("bf16", "fp8_e4m3"):
            for m in ms:
                nbytes = qk_bytes(m, nq, nkv, kv)

                def run(fn):
                    def make():
                        c = qk_case(m, nq, nkv, kv)
                        return lambda: fn(**c)

                    return make

                rows.append(dict(op="qk_norm_rope_cache", heads=f"({nq},{nkv})", kv=kv, m=m, bytes=nbytes,
                                 us=timed(run(loader.qk_norm_rope_cache), nbytes),
                                 eager=timed(run(torch_qk), nbytes),
                                 compiled=timed(run(ctorch), nbytes)))  # fmt: skip
                print(rows[-1], flush=True)
    return rows


# ----------------------------------------------------------------------------- the chain per layer
def chain_rows(ms):
    rows = []
    for nq, nkv in HEADS:
        rows += chain_rows_of(LayerChain(nq, nkv, "bf16"), ms)
        torch.cuda.empty_cache()
    return rows


def chain_rows_of(chain: LayerChain, ms) -> list:
    rows = []
    for m in ms:
        x, r = (torch.randn(m, K, device="cuda").bfloat16() for _ in range(2))
        pos, slots = torch.arange(m, device="cuda") + 100, torch.arange(m, device="cuda") + 32

        def unfused():
            for i in range(chain.layers):
                xn, _ = loader.fused_add_rms_norm(x, r, chain.nw, 1e-6)
                qkv = torch.matmul(xn, chain.ws[i][0].t())
                loader.qk_norm_rope_cache(qkv, chain.qn, chain.qn, 1e-6, chain.cs, pos, chain.kc[i],
                                          chain.vc[i], slots, chain.nq, chain.nkv)  # fmt: skip

        with loader.launch_options(design="separate"):
            fused = median_graph_us(chain.fn(m), chain.layers)
        rows.append(dict(heads=f"({chain.nq},{chain.nkv})", m=m, chain=median_graph_us(unfused, chain.layers),
                         fused=fused))  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def markdown(res: dict) -> str:
    bw = res["copy_bw"]
    pct = lambda r, key="us": f"{100 * r['bytes'] / (r[key] * 1e-6) / bw:.0f}"  # noqa: E731
    out = [f"Commit {res['commit']}; copy bandwidth {bw / 1e12:.2f} TB/s; µs per call (% of the copy "
           "bandwidth for the bytes the call moves)", "",
           "| op | heads | cache | M | flint µs | % | torch eager µs | torch.compile µs |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["ops"]:
        out.append(f"| {r['op']} | {r.get('heads', '')} | {r.get('kv', '')} | {r['m']} | {r['us']:.2f} | "
                   f"{pct(r)} | {r['eager']:.2f} | {r['compiled']:.2f} |")  # fmt: skip
    out += ["", "Per layer (BF16 weights, BF16 cache): the chain fused_add_rms_norm -> cuBLAS -> "
            "qk_norm_rope_cache beside the fused op (two-kernel design), µs", "",
            "| heads | M | chain | fused op |", "|---|---|---|---|"]  # fmt: skip
    for r in res["chain"]:
        out.append(f"| {r['heads']} | {r['m']} | {r['chain']:.2f} | {r['fused']:.2f} |")
    return "\n".join(out) + "\n"


def main():
    global COS_SIN, SCALE
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="build/flint")
    ap.add_argument("--m", nargs="*", type=int, default=MS)
    ap.add_argument("--quick", action="store_true", help="the torch.compile column runs eager torch instead")
    ap.add_argument("--no-chain", action="store_true")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--json")
    ap.add_argument("--out")
    args = ap.parse_args()
    loader.load_bundle(args.bundle)
    torch.manual_seed(0)
    COS_SIN = make_cos_sin_cache(4096, device="cuda")
    SCALE = torch.tensor([0.05], device="cuda")
    compiled = (lambda f: f) if args.quick else (lambda f: torch.compile(f, dynamic=True))  # (one per op)
    res = dict(commit=args.commit or git_commit(), copy_bw=copy_bandwidth())
    res["ops"] = norm_rows(args.m, compiled) + qk_rows(args.m, compiled)
    res["chain"] = [] if args.no_chain else chain_rows(CHAIN_MS)
    md = markdown(res)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)


COS_SIN = SCALE = None

if __name__ == "__main__":
    main()

"""The op inside a whole decoder step: Qwen3-1.7B shape (hidden 2048, 16 q / 8 kv heads of 128, MLP 6144), 28
layers of distinct BF16 weights (about 100 MB per layer: L2 defeated), M sequences decoding one token each
over a paged BF16 KV cache of CTX cached tokens, the whole step in one CUDA graph per variant, ms per step
(median of graph replays; BENCHMARKS.md "The op inside a decoder step").

    PYTHONPATH=. python3 benchmarks/bench_decoder.py [--m 1 4 8 16 32 64] [--ctx 512] [--out FILE.md]

The variants differ only in the attention input (residual add + input RMSNorm, qkv projection, q/k RMSNorm,
NeoX RoPE, the k/v write into the cache); the rest of each layer is the same torch code in all of them:
attention over each sequence's CTX cached tokens (gathered through its block table, then
scaled_dot_product_attention with GQA), o_proj, residual add + post-attention RMSNorm, gate/up, SiLU, down.

* `flint op`: loader.flint_qkv_fused (inside a graph the loader runs the two-kernel design); `flint op,
  prologue design`: launch_options(design="prologue"); `flint op, PDL off`: launch_options(pdl=False);
* `flint unfused`: loader.fused_add_rms_norm -> loader.gemv -> loader.qk_norm_rope_cache;
* `torch eager`: the same arithmetic in torch ops (in the graph); `torch.compile`: that function compiled
  (fullgraph, static shapes), captured in the same graph;
* `rest of the layer only`: no attention input at all (q from a fixed buffer): the floor, so that
  (step - floor) / 28 is the attention input's cost per layer.

`--device cpu --layers 2` runs the torch variants without a GPU (a smoke test of the script itself).

Every variant's final hidden state is compared with torch eager's; one that is NaN or further than
`--max-error` (MAX_ERROR) is reported as FAIL and the script exits with status 1 (after the tables).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_qkv import copy_bandwidth, median_graph_us  # (benchmarks/ is the script's directory)

import loader
from loader.abi import MAX_M
from loader.reference import make_cos_sin_cache

H, NQ, NKV, D, INTER, LAYERS, BLOCK = 2048, 16, 8, 128, 6144, 28, 16
M_MAX = 64  # sequences this script sizes for (K/V caches of M x CTX tokens a layer: 3.5 GiB at 64 x 512)
EPS = 1e-6
# The final hidden state of a variant against torch eager's, max|a - b| / max|b|: the variants round
# differently (the op: fp32 norm and RoPE with one bf16 rounding; torch: bf16 between ops), and the random
# model carries that through the layers: measured on the H200 2.4-3.2 % after 28 layers for every variant,
# torch.compile's own included (docs/benchmarks-history.md §0.7), 0.49 % on the CPU after one layer. A broken
# attention input moves it further: planted in the torch variant on the CPU (1 layer, M = 2), q zeroed 16 %,
# RoPE at position 0 12 %, k/v not written to the cache 4.4 %, residual_out = x 68 %.
MAX_ERROR = 0.06


class Model:
    """28 layers of random weights and one paged KV cache per layer; M sequences of ctx cached tokens, each
    decoding the token at position ctx - 1 (its k/v written there, then attended to with the others)."""

    def __init__(self, m: int, ctx: int, layers: int, device):
        g = torch.Generator(device=device).manual_seed(0)

        def r(*s, scale=0.02):
            return (torch.randn(*s, device=device, generator=g) * scale).bfloat16()

        self.m, self.ctx, self.dev = m, ctx, device
        self.layers = [
            dict(qkv=r((NQ + 2 * NKV) * D, H), o=r(H, NQ * D), gate_up=r(2 * INTER, H), down=r(H, INTER),
                 in_norm=1 + r(H, scale=0.1), post_norm=1 + r(H, scale=0.1), q_norm=1 + r(D, scale=0.1),
                 k_norm=1 + r(D, scale=0.1))
            for _ in range(layers)
        ]  # fmt: skip
        nblk = ctx // BLOCK
        self.tables = torch.arange(m * nblk, device=device).view(m, nblk)  # sequence s owns its own blocks
        self.kc = [r(m * nblk, BLOCK, NKV, D, scale=1.0) for _ in range(layers)]
        self.vc = [r(m * nblk, BLOCK, NKV, D, scale=1.0) for _ in range(layers)]
        self.positions = torch.full((m,), ctx - 1, device=device)
        self.slots = self.tables[:, -1] * BLOCK + (ctx - 1) % BLOCK  # position ctx - 1 of each sequence
        self.cos_sin = make_cos_sin_cache(4096, device=device)
        self.x = r(m, H, scale=1.0)
        self.residual = r(m, H, scale=1.0)
        self.q_fixed = r(m, NQ * D, scale=1.0)

    def attend(self, i: int, q):
        """Each sequence's new token against its ctx cached tokens (GQA), [M, 16 * 128]."""
        m, ctx = self.m, self.ctx
        k = self.kc[i][self.tables].view(m, ctx, NKV, D).transpose(1, 2)
        v = self.vc[i][self.tables].view(m, ctx, NKV, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.view(m, NQ, 1, D), k, v, enable_gqa=True)
        return o.reshape(m, NQ * D)

    def step(self, attn_input):
        """One decode step of every layer; attn_input(model, i, x, residual) -> (q, residual_out)."""
        x, residual = self.x, self.residual
        for i, w in enumerate(self.layers):
            q, residual = attn_input(self, i, x, residual)
            h = self.attend(i, q) @ w["o"].t()
            residual = h + residual
            xn = F.rms_norm(residual, (H,), w["post_norm"], EPS)
            gate, up = (xn @ w["gate_up"].t()).chunk(2, dim=-1)
            x = (F.silu(gate) * up) @ w["down"].t()
        return x + residual


def torch_attn_input(x, residual, in_norm, qkv_w, q_norm, k_norm, cos_sin, positions, kc, vc, slots):
    """The attention input in torch ops: bf16 tensors between ops, fp32 inside rms_norm, RoPE in fp32."""
    m = x.shape[0]
    r = x + residual
    qkv = F.rms_norm(r, (H,), in_norm, EPS) @ qkv_w.t()
    q, k, v = qkv.split([NQ * D, NKV * D, NKV * D], dim=-1)
    q = F.rms_norm(q.view(m, NQ, D), (D,), q_norm, EPS)
    k = F.rms_norm(k.reshape(m, NKV, D), (D,), k_norm, EPS)
    cs = cos_sin[positions]
    cos, sin = cs[:, None, : D // 2], cs[:, None, D // 2 :]

    def rope(t):
        a, b = t.float().chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).bfloat16()

    q, k = rope(q), rope(k)
    kc.view(-1, NKV, D).index_copy_(0, slots, k)
    vc.view(-1, NKV, D).index_copy_(0, slots, v.reshape(m, NKV, D))
    return q.reshape(m, NQ * D), r


def variants(compiled):
    """name -> (attention input, launch options for the flint op or None)."""

    def flint(md, i, x, res):
        w = md.layers[i]
        return loader.flint_qkv_fused(x, res, w["in_norm"], EPS, w["qkv"], None, None, w["q_norm"],
                                      w["k_norm"], EPS, md.cos_sin, md.positions, md.kc[i], md.vc[i],
                                      md.slots, NQ, NKV)  # fmt: skip

    def unfused(md, i, x, res):
        w = md.layers[i]
        xn, r = loader.fused_add_rms_norm(x, res, w["in_norm"], EPS)
        qkv = loader.gemv(xn, w["qkv"])
        q = loader.qk_norm_rope_cache(qkv, w["q_norm"], w["k_norm"], EPS, md.cos_sin, md.positions, md.kc[i],
                                      md.vc[i], md.slots, NQ, NKV)  # fmt: skip
        return q, r

    def eager(md, i, x, res, fn=torch_attn_input):
        w = md.layers[i]
        return fn(x, res, w["in_norm"], w["qkv"], w["q_norm"], w["k_norm"], md.cos_sin, md.positions,
                  md.kc[i], md.vc[i], md.slots)  # fmt: skip

    def rest_only(md, i, x, res):
        return md.q_fixed, x + res

    out = {
        "flint op": (flint, {}),
        "flint op, prologue design": (flint, {"design": "prologue"}),
        "flint op, PDL off": (flint, {"pdl": False}),
        "flint unfused": (unfused, {}),
        "torch eager": (eager, None),
        "torch.compile": (lambda md, i, x, res: eager(md, i, x, res, compiled), None),
        "rest of the layer only": (rest_only, None),
    }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", nargs="*", type=int, default=[1, 4, 8, 16, 32, 64], help=f"sequences, 1..{M_MAX}")
    ap.add_argument("--ctx", type=int, default=512, help="cached tokens per sequence (a multiple of 16)")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--bundle", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--max-error", type=float, default=MAX_ERROR,
        help=f"bound on each final hidden state against torch eager's (default {MAX_ERROR})",
    )  # fmt: skip
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if not a.m or not all(1 <= m <= M_MAX for m in a.m):
        ap.error(f"--m takes 1..{M_MAX} sequences, got {a.m}")
    if cuda and max(a.m) > MAX_M:  # (fail before minutes of torch variants, not at the first flint call)
        ap.error(f"--m {max(a.m)}: the loader serves at most loader.abi.MAX_M = {MAX_M} tokens per call")
    if a.ctx < BLOCK or a.ctx % BLOCK or a.ctx > 4096:
        ap.error(f"--ctx must be a multiple of {BLOCK} in {BLOCK}..4096 (the RoPE table), got {a.ctx}")
    if cuda:
        loader.load_bundle(a.bundle)
        print(f"device copy bandwidth: {copy_bandwidth() / 1e12:.2f} TB/s", flush=True)
    compiled = torch.compile(torch_attn_input, fullgraph=True, dynamic=False)
    # static shapes: one compile per M, and fullgraph raises past the recompile limit (8 by default)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(a.m))
    table = {}
    failed = []
    for m in a.m:
        md = Model(m, a.ctx, a.layers, a.device)
        finals = {}
        for name, (fn, opts) in variants(compiled).items():
            if not cuda and opts is not None:
                continue  # the flint variants need the GPU
            t0 = time.perf_counter()
            if cuda:
                with loader.launch_options(**(opts or {})):
                    md.step(fn)  # (a first eager step: torch.compile compiles here, before any capture)
                    # median µs of a replay of the whole step's graph (one more eager step first) -> ms
                    table[m, name] = median_graph_us(lambda fn=fn, md=md: md.step(fn), 1) / 1e3
                    finals[name] = md.step(fn).float()
            else:
                finals[name] = md.step(fn).float()
                table[m, name] = float("nan")
            took = time.perf_counter() - t0
            print(f"M={m} {name}: {table[m, name]:.3f} ms per step ({took:.1f} s)", flush=True)
        ref = finals["torch eager"]
        for name, f in finals.items():
            if name != "rest of the layer only":
                err = ((f - ref).abs().max() / ref.abs().max()).item()
                ok = err <= a.max_error  # (False for NaN)
                if not ok:
                    failed.append(f"M={m} {name}")
                print(f"M={m} {name}: final hidden state within {err:.2e} of torch eager's (max-normalised): "
                      f"{'ok' if ok else 'FAIL'} (bound {a.max_error:g})")  # fmt: skip
        del md
        if cuda:
            torch.cuda.empty_cache()
    names = list(variants(None))
    lines = ["| variant | " + " | ".join(f"M = {m}" for m in a.m) + " |", "|---|" + "---|" * len(a.m)]
    for name in names:
        if (a.m[0], name) in table:
            lines.append(f"| {name} | " + " | ".join(f"{table[m, name]:.3f}" for m in a.m) + " |")
    floor = "rest of the layer only"
    lines += ["", "attention input per layer, µs ((step - floor) / layers):", "", lines[0], lines[1]]
    for name in names:
        if name != floor and (a.m[0], name) in table:
            per = [(table[m, name] - table[m, floor]) * 1e3 / a.layers for m in a.m]
            lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in per) + " |")
    out = "\n".join(lines)
    print("\nms per decode step (CUDA graph of the whole step, median of replays)\n\n" + out)
    if a.out:
        Path(a.out).write_text(out + "\n")
    if failed:
        print(f"\nFAIL: final hidden state NaN or further than {a.max_error:g} from torch eager's: "
              + ", ".join(failed))  # fmt: skip
        sys.exit(1)


if __name__ == "__main__":
    main()

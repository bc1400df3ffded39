"""Fused qkv calls for compute-sanitizer (memcheck / racecheck / synccheck): both weight formats, both designs
(the input norm in the qkv kernel's prologue, and the two-kernel design), BF16 and FP8 caches, with and
without a residual, M = 1, 3, 8 (the 8-token tile), 16, 20, 25, 32, 33, 48, 56 and 64 (the token stream's
tiles; in NVFP4's two-kernel design 20 and 25-32 are the 32-token kernel with 3 and 4 groups, 33-56 the
64-token kernel's one wgmma pass, 64 its two, docs/kernels.md §2.6), bad slots among them; then the unfused
path (norm, gemv, qk_norm_rope_cache) at M = 5, 13 and 64, or at the M of --unfused (past 64, a prefill
chunk: the norms and qk_norm_rope_cache, whose slots are spread over the cache, negative ones among them).

    compute-sanitizer --tool racecheck --report-api-errors no python3 tools/sanitize_case.py [M ...]
        [--design separate|prologue] [--fmt bf16|nvfp4] [--no-unfused | --unfused M ...] [--bundle DIR]

Given token counts, only the fused calls with those M, and the unfused path at the largest (racecheck is slow:
`1 16 32 64` checks the 8-, 16-, 32- and 64-token kernels). --design / --fmt keep one design or weight format,
so that a slow tool can run as parallel processes that split the cases between them. --bundle: a smaller
bundle loads faster under a sanitizer; `configs/sanitize.yaml` builds one with every kernel these calls reach
but the one at M = 8.
"""

import argparse

import torch

import loader
from tests.helpers import make_case, op_args

ap = argparse.ArgumentParser()
ap.add_argument("m", nargs="*", type=int)
ap.add_argument("--design", choices=["separate", "prologue"])
ap.add_argument("--fmt", choices=["bf16", "nvfp4"])
ap.add_argument("--no-unfused", action="store_true")
ap.add_argument("--unfused", nargs="+", type=int, default=None, metavar="M")
ap.add_argument("--bundle", default="build/flint")
args = ap.parse_args()
ONLY = set(args.m)
# (rope, heads, M) of the fused calls
# (the heads of M = 1, 16, 20, 25, 32, 33, 48, 56 and 64 are in configs/sanitize.yaml's bundle)
CASES = ((True, (32, 4), 3), (False, (16, 2), 8), (True, (16, 8), 16), (True, (16, 8), 20),
         (True, (16, 8), 25), (True, (32, 4), 32), (True, (16, 8), 33), (True, (32, 4), 48),
         (True, (16, 8), 56), (True, (32, 4), 64), (True, (16, 8), 1))  # fmt: skip
loader.load_bundle(args.bundle)
for design in [args.design] if args.design else ("prologue", "separate"):
    with loader.launch_options(design=design):
        for fmt in [args.fmt] if args.fmt else ("bf16", "nvfp4"):
            for kv in ("bf16", "fp8_e4m3"):
                for rope, (nq, nkv), m in CASES:
                    if ONLY and m not in ONLY:
                        continue
                    slots = [3, -1, 70, 200, 9, -3, 11, 12, 40, 41, 42, 43, 44][:m]
                    slots = torch.tensor(slots, device="cuda")
                    c = op_args(make_case(m, nq, nkv, rope, seed=m, slots=slots, fmt=fmt, kv_dtype=kv))
                    q, r = loader.flint_qkv_fused(**c)
                    c["residual"] = None
                    q, r = loader.flint_qkv_fused(**c)
keys = ("q_norm_weight", "k_norm_weight", "qk_eps", "cos_sin_cache", "positions", "k_cache", "v_cache",
        "slot_mapping", "num_q_heads", "num_kv_heads", "k_scale", "v_scale")  # fmt: skip
unfused = () if args.no_unfused else args.unfused or ((5, 13, 64) if not ONLY else (max(ONLY),))
for m in unfused:  # the 8-token GEMV and the stream; past 64 tokens no GEMV (it serves decode only)
    for kv in ("bf16", "fp8_e4m3"):
        nb = -(-m // 16) + 4
        slots = torch.randperm(nb * 16, device="cuda")[:m]
        slots[::7] = -1
        c = op_args(make_case(m, 16, 2, True, seed=1, kv_dtype=kv, num_blocks=nb, slots=slots))
        xn, ro = loader.fused_add_rms_norm(c["x"], c["residual"], c["norm_weight"], c["eps"])
        loader.rms_norm(c["x"], c["norm_weight"], c["eps"])
        qkv = loader.gemv(xn, c["weight"]) if m <= 64 else torch.randn(m, 20 * 128, device="cuda").bfloat16()
        q = loader.qk_norm_rope_cache(qkv, **{k: c[k] for k in keys if k in c})
torch.cuda.synchronize()
print("sanitize case done")

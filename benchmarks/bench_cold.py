"""Cold start (BENCHMARKS.md "Cold start"): what a fresh serving process pays before its first results, beside
what compiling the same kernels costs on the build machine (the JIT a process would pay without a bundle).

    PYTHONPATH=. python3 benchmarks/bench_cold.py [--bundle build/flint]     # on the GPU machine
    PYTHONPATH=. python3 benchmarks/bench_cold.py --compile                  # on the build machine (DSL)

Serve mode: in a new Python process (torch already imported, as in any serving process), the time of
`import loader` (which registers torch.ops.flint.*), `load_bundle` (manifest read and checked), then the
first and second call of each op (M = 1, heads (32, 4), BF16, BF16 cache; a first call loads its cubins:
sha256 and ELF checks, cuModuleLoadData, plus the plan), each synchronized. Compile mode: in a new process,
`import cutlass` and the compile of each kernel those first calls load (sm_90a).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

SERVE = r"""
import json, sys, time
import torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()  # the CUDA context, as a serving process has it
t = {}
t0 = time.perf_counter(); import loader; t["import loader"] = time.perf_counter() - t0
t0 = time.perf_counter(); loader.load_bundle(sys.argv[1]); t["load_bundle"] = time.perf_counter() - t0
sys.path.insert(0, "benchmarks")
from bench_host import case
c = case(1, 32, 4, "bf16", "bf16", torch.Generator(device="cuda").manual_seed(0))
x, r, nw = c["x"], c["residual"], c["norm_weight"]
qkv = torch.randn(1, 40 * 128, device="cuda").bfloat16()
head = {k: c[k] for k in ("q_norm_weight", "k_norm_weight", "qk_eps", "cos_sin_cache", "positions", "k_cache",
                          "v_cache", "slot_mapping", "num_q_heads", "num_kv_heads")}
calls = {"flint_qkv_fused (prologue design: 1 cubin)": lambda: loader.flint_qkv_fused(**c),
         "flint_qkv_fused, two-kernel design (2 cubins)": lambda: _separate(c),
         "rms_norm": lambda: loader.rms_norm(x, nw, 1e-6),
         "fused_add_rms_norm": lambda: loader.fused_add_rms_norm(x, r, nw, 1e-6),
         "gemv": lambda: loader.gemv(x, c["weight"]),
         "qk_norm_rope_cache": lambda: loader.qk_norm_rope_cache(qkv, **head)}
def _separate(c):
    with loader.launch_options(design="separate"):
        return loader.flint_qkv_fused(**c)
for name, f in calls.items():
    for which in ("first", "second"):
        torch.cuda.synchronize(); t0 = time.perf_counter(); f(); torch.cuda.synchronize()
        t[f"{name}: {which} call"] = time.perf_counter() - t0
print(json.dumps(t))
"""

COMPILE = r"""
import json, os, time
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
t = {}
t0 = time.perf_counter(); import cutlass, cutlass.cute; t["import cutlass"] = time.perf_counter() - t0
from flint_aot.kernels import kernel_class, entry_prefix
from loader import abi
for kind, spec in (("qkv", abi.qkv_spec("bf16", True, 32, 4, "bf16", "prologue")),
                   ("qkv", abi.qkv_spec("bf16", True, 32, 4, "bf16", "separate")),
                   ("norm", abi.norm_spec(True)), ("norm", abi.norm_spec(False)),
                   ("gemv", abi.gemv_spec("bf16")),
                   ("qk_norm_rope_cache", abi.qk_norm_rope_cache_spec(True))):
    name = abi.spec_name(kind, spec)
    t0 = time.perf_counter(); kernel_class(kind)(spec, "sm_90a").compile("sm_90a", entry_prefix(name))
    t[f"compile {name}"] = time.perf_counter() - t0
print(json.dumps(t))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="build/flint")
    ap.add_argument("--compile", action="store_true", help="the build machine's side (needs the DSL)")
    ap.add_argument("--runs", type=int, default=3, help="fresh processes (the table gives the median)")
    a = ap.parse_args()
    code, argv = (COMPILE, []) if a.compile else (SERVE, [a.bundle])
    runs = []
    for _ in range(a.runs):
        out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"| step (a fresh process) | ms, median of {a.runs} processes | min | max |\n|---|---|---|---|")
    for k in runs[0]:
        v = sorted(r[k] * 1e3 for r in runs)
        print(f"| {k} | {v[len(v) // 2]:.1f} | {v[0]:.1f} | {v[-1]:.1f} |")


if __name__ == "__main__":
    main()

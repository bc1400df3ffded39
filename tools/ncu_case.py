"""One fused call per (format, M) for Nsight Compute, after a warm-up call (modules loaded):

    ncu --clock-control none --launch-skip 4 --metrics ... python3 tools/ncu_case.py

ncu serializes kernels, so PDL overlap is absent: per-kernel duration and memory counters only."""

import torch

import loader
from tests.helpers import make_case, op_args

loader.load_bundle("build/flint")
cases = [op_args(make_case(m, 32, 4, True, seed=m, fmt=f)) for f in ("bf16", "nvfp4") for m in (1, 8)]
for c in cases:  # warm-up: 2 launches each (norm + qkv)
    loader.flint_qkv_fused(**c)
torch.cuda.synchronize()
for c in cases:
    loader.flint_qkv_fused(**c)
torch.cuda.synchronize()
print("ncu case done")

"""One fused qkv call per variant kind for compute-sanitizer (memcheck / racecheck / synccheck)."""

import torch

import loader
from tests.helpers import make_case, op_args

loader.load_bundle("build/flint")
for fmt in ("bf16", "nvfp4"):
    for rope, (nq, nkv), m in ((True, (32, 4), 3), (False, (16, 2), 8)):
        c = make_case(m, nq, nkv, rope, seed=m, slots=torch.tensor([3, -1, 70][:m], device="cuda"), fmt=fmt)
        c = op_args(c)
        q, r = loader.flint_qkv_fused(**c)
        c["residual"] = None
        q, r = loader.flint_qkv_fused(**c)
torch.cuda.synchronize()
print("sanitize case done")

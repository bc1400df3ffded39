"""Step-by-step launch of the norm kernel with a watchdog (prints where a hang happens)."""
import faulthandler
import sys
import time

faulthandler.dump_traceback_later(20, exit=True)
t0 = time.time()


def say(*a):
    print(f"[{time.time() - t0:6.2f}s]", *a, flush=True)


import torch  # noqa: E402

import loader  # noqa: E402
from loader import runtime  # noqa: E402

say("imports ok; stream", torch.cuda.current_stream().cuda_stream)
b = loader.load_bundle("build/flint")
say("bundle", b.path)
x = torch.randn(2, 2048, device="cuda").bfloat16()
w = torch.ones(2048, device="cuda").bfloat16()
torch.cuda.synchronize()
say("inputs ok")
k = runtime.get_kernel(x.device, "norm", {"residual": False})
say("module loaded", k.entry.entry)
mode = sys.argv[1] if len(sys.argv) > 1 else "pdl"
runtime.set_pdl(mode == "pdl")
s = torch.cuda.Stream() if "stream" in sys.argv else torch.cuda.current_stream()
with torch.cuda.stream(s):
    xn = loader.rms_norm(x, w, 1e-6)
say("launched", mode, "stream", s.cuda_stream)
torch.cuda.synchronize()
ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True))
say("synced", (xn.float() - ref).abs().max().item())

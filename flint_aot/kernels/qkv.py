"""The fused qkv kernel (docs/kernels.md §2-§3): qkv GEMV + per-head q/k RMSNorm + NeoX RoPE + paged KV-cache
write, and in the prologue design the input RMSNorm too. `KERNEL(spec, arch)` makes the kernel of one
specialization: `Tile8Qkv` for the 8-token tile, `StreamQkv` (the token stream) for tiles of 16, 32 and 64.

Where each part lives:
* qkv_base.py: what every fused kernel shares (configuration, the parameter list, the thread's coordinates);
* qkv_tile8.py, qkv_stream.py: the two kernel shapes, each a short sequence of steps;
* activations.py: how x reaches shared memory, one part per design (a copy of xn, or the input norm);
* epilogue.py: the per-head q/k norm, RoPE, q and cache stores, and the 8-token kernel's exchange;
* weights.py, mma.py, fp4.py, wgmma.py: the weight slice and the MMA fragments (shared with the GEMV);
* stream_gemv.py, schedules.py: the token stream's CTA and how its groups run.
"""

from __future__ import annotations

from flint_aot.kernels.diagnostics import SERVING, Diagnostics
from flint_aot.kernels.qkv_base import QkvKernel
from flint_aot.kernels.qkv_stream import StreamQkv
from flint_aot.kernels.qkv_tile8 import Tile8Qkv
from loader.abi import TOKEN_GROUP


def KERNEL(spec: dict, arch: str, diag: Diagnostics = SERVING) -> QkvKernel:  # noqa: N802
    """The fused kernel of one specialization for one architecture."""
    return (StreamQkv if spec.get("max_m", 8) > TOKEN_GROUP else Tile8Qkv)(spec, arch, diag)

"""The serve side of the example kernel: SiLU-and-mul launched from the bundle by name, as a plain function
and as a torch.library custom op (usable under torch.compile). Needs torch and the loader only: it imports the
kernel's shared sizes (silu_mul.abi, standard library), never the kernel module or the CuTe DSL.

    out = silu_mul(x)                            # x bf16 [M, 2*I] -> out bf16 [M, I]
    out = torch.ops.flint_example.silu_mul(x)    # the same, as a custom op
"""

from __future__ import annotations

import torch
from silu_mul.abi import KIND, grid
from torch import Tensor

import loader

MAX_ROWS = 65535  # the grid's y dimension: one row of CTAs per token


def silu_mul(x: Tensor, out: Tensor | None = None) -> Tensor:
    """out[M, I] = silu(x[:, :I]) * x[:, I:] (fp32 math, one bf16 rounding) for a contiguous bf16 x [M, 2*I]
    on a CUDA device, 1 <= M <= 65535; I must be an intermediate size the bundle was built for. Writes into
    `out` (contiguous bf16 [M, I]) when given, else into a new tensor; returns it.

    The loader checks what the manifest knows (device, alignment, the int's range); what the kernel indexes
    is checked here, as the kernel's author must: it reads m rows of 2*I elements from x and writes m rows
    of I into out, so both must be contiguous and of exactly these shapes."""
    if not isinstance(x, Tensor) or x.dtype != torch.bfloat16:
        raise TypeError(f"x must be a bf16 torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 2 or x.shape[1] % 2 or not 1 <= x.shape[0] <= MAX_ROWS or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [M, 2*I] tensor with 1 <= M <= {MAX_ROWS}, got shape "
                         f"{list(x.shape)}, strides {x.stride()}")  # fmt: skip
    m, i = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(m, i, dtype=x.dtype, device=x.device)
    elif not isinstance(out, Tensor) or (out.dtype, out.shape) != (x.dtype, (m, i)) or out.stride() != (i, 1):
        raise ValueError(f"out must be a contiguous bf16 [{m}, {i}] tensor, got {getattr(out, 'shape', out)}")
    loader.launch_kernel(KIND, {"intermediate": i}, grid(m, i), x=x, out=out, m=m)
    return out


@torch.library.custom_op("flint_example::silu_mul", mutates_args=())
def silu_mul_op(x: Tensor) -> Tensor:
    """torch.ops.flint_example.silu_mul: silu_mul(x) as one node of a torch.compile graph."""
    return silu_mul(x)


@silu_mul_op.register_fake
def _(x: Tensor) -> Tensor:  # shapes and dtype for torch.compile's fake tensors
    return x.new_empty(x.shape[0], x.shape[1] // 2)

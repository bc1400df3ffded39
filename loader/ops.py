"""Public ops: argument validation, output allocation and launches. Every check runs before anything is
launched or written, and raises TypeError/ValueError (bad arguments) or LookupError (not in the bundle)."""

from __future__ import annotations

import math

import torch

from loader import runtime
from loader.bundle import BundleError  # noqa: F401  (re-exported)
from loader.runtime import current_bundle, load_bundle, set_pdl  # noqa: F401  (re-exported)

K = 2048
HEAD_DIM = 128
MAX_M = 8


# ----------------------------------------------------------------------------- validation helpers
def _tensor(name: str, t, dtype: torch.dtype, shape: tuple | None = None, device=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all tensors on one device)")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned (data_ptr % 16 = {t.data_ptr() % 16})")
    return t


def _eps(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a Python float, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {v}")
    return v


def _activations(x) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must have shape [M, {K}], got {list(x.shape)}")
    m = x.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"x has M = {m} tokens; supported: 1 <= M <= {MAX_M}")
    _tensor("x", x, torch.bfloat16, (m, K))
    return m


# ----------------------------------------------------------------------------- input norm
def _norm(x, residual, weight, eps):
    m = _activations(x)
    dev = x.device
    if residual is not None:
        _tensor("residual", residual, torch.bfloat16, (m, K), dev)
    _tensor("norm weight", weight, torch.bfloat16, (K,), dev)
    eps = _eps("eps", eps)
    k = runtime.get_kernel(dev, "norm", {"residual": residual is not None})
    xn = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    res_in = residual if residual is not None else x
    with torch.cuda.device(dev):
        runtime.launch(
            k,
            {"M": m},
            [x.data_ptr(), res_in.data_ptr(), res_out.data_ptr(), xn.data_ptr(), weight.data_ptr(), eps],
            torch.cuda.current_stream(dev),
        )
    return xn, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """xn = bf16(bf16(x * rsqrt(mean(x²) + eps)) * weight) for x bf16 [M, 2048], 1 <= M <= 8."""
    return _norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """r = bf16(x + residual); returns (rms_norm(r, weight, eps), r), both new tensors."""
    if residual is None:
        raise TypeError("residual must be a tensor (use rms_norm when there is none)")
    return _norm(x, residual, weight, eps)

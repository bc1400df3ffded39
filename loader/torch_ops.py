"""The ops as torch custom ops, `torch.ops.flint.*`, registered when `loader` is imported, as vLLM registers
its own (docs/api.md §11): a schema inferred from each op's signature, `Library.define` + `Library.impl`
(without the per-call overhead of `torch.library.custom_op`), a fake implementation per op with the op's
signature; the KV caches declared mutated. Outputs never alias inputs (with residual None the fused op
returns an empty residual_out). Under Dynamo the plain functions call these ops: one graph node."""

from __future__ import annotations

import torch
from torch import Tensor

from loader import ops
from loader.abi import HEAD_DIM

_lib = torch.library.Library("flint", "FRAGMENT")


def _register(name: str, fn, fake, impl=None, mutates=()) -> None:
    """The op on CUDA tensors; on CPU and meta tensors the same function, whose checks refuse them with a
    ValueError (as the plain functions do); the fake implementation serves torch.compile's fake tensors."""
    _lib.define(name + torch.library.infer_schema(fn, mutates_args=mutates))
    for key in ("CUDA", "CPU"):
        _lib.impl(name, impl or fn, key)
    torch.library.register_fake(f"flint::{name}", fake, lib=_lib)
    try:  # (register_fake registered the fake as the meta kernel)
        _lib.impl(name, impl or fn, "Meta", allow_override=True)
    except TypeError:  # pragma: no cover (a torch without allow_override: meta tensors get shapes)
        pass


def rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


def fused_add_rms_norm_fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def qkv_fused(x, residual, norm_weight, eps, weight, weight_scale, global_scale, q_norm_weight, k_norm_weight,
              qk_eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads, *,
              k_scale=None, v_scale=None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """ops.flint_qkv_fused, except that residual_out is never x (a custom op may not return an input)."""
    q, r = ops.flint_qkv_fused(x, residual, norm_weight, eps, weight, weight_scale, global_scale,
                               q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache,
                               v_cache, slot_mapping, num_q_heads, num_kv_heads, k_scale=k_scale,
                               v_scale=v_scale)  # fmt: skip
    return q, (r if residual is not None else x.new_empty(0))


def qkv_fused_fake(x, residual, norm_weight, eps, weight, weight_scale, global_scale, q_norm_weight,
                   k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
                   num_q_heads, num_kv_heads, *, k_scale=None,
                   v_scale=None) -> tuple[Tensor, Tensor]:  # fmt: skip
    q = x.new_empty(x.shape[0], num_q_heads * HEAD_DIM)
    return q, (torch.empty_like(x) if residual is not None else x.new_empty(0))


def gemv_fake(x: Tensor, weight: Tensor, weight_scale=None, global_scale=None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def qk_norm_rope_cache_fake(qkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache,
                            v_cache, slot_mapping, num_q_heads, num_kv_heads, *, k_scale=None,
                            v_scale=None) -> Tensor:  # fmt: skip
    return qkv.new_empty(qkv.shape[0], num_q_heads * HEAD_DIM)


_register("rms_norm", ops.rms_norm, rms_norm_fake)
_register("fused_add_rms_norm", ops.fused_add_rms_norm, fused_add_rms_norm_fake)
_register("qkv_fused", ops.flint_qkv_fused, qkv_fused_fake, impl=qkv_fused, mutates=("k_cache", "v_cache"))
_register("gemv", ops.gemv, gemv_fake)
_register("qk_norm_rope_cache", ops.qk_norm_rope_cache, qk_norm_rope_cache_fake,
          mutates=("k_cache", "v_cache"))  # fmt: skip

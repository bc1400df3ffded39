"""torch.library custom ops (namespace `flint`) for the loader's ops, so that torch.compile(fullgraph=True)
traces code calling them without graph breaks (loader.ops switches to these while Dynamo traces). Real
implementations: loader.ops' functions, called at run time outside tracing (validation + launch); fake
implementations: shapes only. The
paged KV cache is declared mutated. Outputs never alias inputs: when residual is None the fused op returns
an empty residual_out here, and loader.flint_qkv_fused hands back x itself, as in eager mode."""

from __future__ import annotations

import torch
from torch import Tensor

from loader import ops

K, D = ops.K, ops.HEAD_DIM


@torch.library.custom_op("flint::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return ops.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("flint::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return ops.fused_add_rms_norm(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("flint::qkv_fused", mutates_args=("k_cache", "v_cache"))
def qkv_fused(
    x: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    weight_scale: Tensor | None,
    global_scale: Tensor | None,
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    qk_eps: float,
    cos_sin_cache: Tensor | None,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> tuple[Tensor, Tensor]:
    q, r = ops.flint_qkv_fused(
        x, residual, norm_weight, eps, weight, weight_scale, global_scale, q_norm_weight, k_norm_weight,
        qk_eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads,
    )  # fmt: skip
    return q, (r if residual is not None else x.new_empty(0))


@qkv_fused.register_fake
def _(x, residual, norm_weight, eps, weight, weight_scale, global_scale, q_norm_weight, k_norm_weight,
      qk_eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads):
    q = x.new_empty(x.shape[0], num_q_heads * D)
    return q, (torch.empty_like(x) if residual is not None else x.new_empty(0))


@torch.library.custom_op("flint::gemv", mutates_args=())
def gemv(x: Tensor, weight: Tensor, weight_scale: Tensor | None, global_scale: Tensor | None) -> Tensor:
    return ops.gemv(x, weight, weight_scale, global_scale)


@gemv.register_fake
def _(x, weight, weight_scale, global_scale):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("flint::qk_norm_rope_cache", mutates_args=("k_cache", "v_cache"))
def qk_norm_rope_cache(
    qkv: Tensor,
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    qk_eps: float,
    cos_sin_cache: Tensor | None,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> Tensor:
    return ops.qk_norm_rope_cache(
        qkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
        num_q_heads, num_kv_heads,
    )  # fmt: skip


@qk_norm_rope_cache.register_fake
def _(qkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
      num_q_heads, num_kv_heads):  # fmt: skip
    return qkv.new_empty(qkv.shape[0], num_q_heads * D)

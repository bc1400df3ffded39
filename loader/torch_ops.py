"""The ops as torch custom ops, `torch.ops.flint.*`, registered when `loader` is imported, the way vLLM
registers its own (docs/api.md §11): a schema inferred from each op's typed signature, `Library.define` +
`Library.impl(..., "CUDA")` (a dispatcher entry without the per-call overhead of `torch.library.custom_op`),
and one fake (shape) implementation per op for torch.compile. The KV caches are declared mutated. Outputs
never alias inputs: with residual None the fused op returns an empty residual_out (the plain function hands
back x).
Under Dynamo tracing the plain functions call these ops, so `torch.compile(fullgraph=True)` sees one node.
"""

from __future__ import annotations

import torch

from loader import ops

_lib = torch.library.Library("flint", "FRAGMENT")


def _register(name: str, fn, fake, impl=None, mutates=()) -> None:
    _lib.define(name + torch.library.infer_schema(fn, mutates_args=mutates))
    _lib.impl(name, impl or fn, "CUDA")
    torch.library.register_fake(f"flint::{name}", fake, lib=_lib)


def _qkv_fused(x, residual, nw, eps, w, ws, gs, qn, kn, qk_eps, cs, pos, kc, vc, sm, nq, nkv, *, k_scale=None,
               v_scale=None):  # fmt: skip
    """The plain function, except that residual_out is never x (the dispatcher passes arguments positionally,
    the keyword-only ones by name)."""
    q, r = ops.flint_qkv_fused(x, residual, nw, eps, w, ws, gs, qn, kn, qk_eps, cs, pos, kc, vc, sm, nq, nkv,
                               k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    return q, (r if residual is not None else x.new_empty(0))


_register("rms_norm", ops.rms_norm, lambda x, weight, eps: torch.empty_like(x))
_register("fused_add_rms_norm", ops.fused_add_rms_norm,
          lambda x, residual, weight, eps: (torch.empty_like(x), torch.empty_like(x)))  # fmt: skip
_register(
    "qkv_fused", ops.flint_qkv_fused,
    lambda x, residual, *a, **kw: (x.new_empty(x.shape[0], a[13] * ops.HEAD_DIM),
                                   torch.empty_like(x) if residual is not None else x.new_empty(0)),
    impl=_qkv_fused, mutates=("k_cache", "v_cache"),
)  # fmt: skip
_register("gemv", ops.gemv, lambda x, weight, *a: x.new_empty(x.shape[0], weight.shape[0]))
_register(
    "qk_norm_rope_cache", ops.qk_norm_rope_cache,
    lambda qkv, *a, **kw: qkv.new_empty(qkv.shape[0], a[8] * ops.HEAD_DIM), mutates=("k_cache", "v_cache"),
)  # fmt: skip

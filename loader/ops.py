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
def _tensor(
    name: str, t, dtype: torch.dtype, shape: tuple | None = None, device=None, align: int = 16
) -> torch.Tensor:
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
    if t.data_ptr() % align:
        raise ValueError(f"{name} must be {align}-byte aligned (data_ptr % {align} = {t.data_ptr() % align})")
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
    with torch.cuda.device(dev):
        return _launch_norm(k, x, residual, weight, eps, torch.cuda.current_stream(dev))


def _launch_norm(k, x, residual, weight, eps, stream):
    """Allocate xn and residual_out (x itself without a residual) and launch the norm kernel k."""
    xn = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    res_in = residual if residual is not None else x
    runtime.launch(
        k,
        {"M": x.shape[0]},
        [x.data_ptr(), res_in.data_ptr(), res_out.data_ptr(), xn.data_ptr(), weight.data_ptr(), eps],
        stream,
    )
    return xn, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """xn = bf16(bf16(x * rsqrt(mean(x²) + eps)) * weight) for x bf16 [M, 2048], 1 <= M <= 8."""
    if torch.compiler.is_compiling():
        return torch.ops.flint.rms_norm(x, weight, eps)
    return _norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """r = bf16(x + residual); returns (rms_norm(r, weight, eps), r), both new tensors."""
    if torch.compiler.is_compiling():
        return torch.ops.flint.fused_add_rms_norm(x, residual, weight, eps)
    if residual is None:
        raise TypeError("residual must be a tensor (use rms_norm when there is none)")
    return _norm(x, residual, weight, eps)


# ----------------------------------------------------------------------------- fused qkv
_NO_ROPE: dict[torch.device, torch.Tensor] = {}
_bounds_check = False


def set_bounds_check(enabled: bool) -> None:
    """Opt-in checked mode for flint_qkv_fused: raise ValueError when a position lies outside the cos/sin
    table or a slot outside the cache, instead of the kernel's safe default (NaN q/k for that token; slot not
    written). Costs a device-to-host copy per call and cannot be used inside CUDA-graph capture."""
    global _bounds_check
    _bounds_check = bool(enabled)


def no_rope_table(device) -> torch.Tensor:
    """Placeholder fp32 cos|sin argument for kernels compiled without RoPE (a zero [1, 128] table)."""
    device = torch.device(device)
    t = _NO_ROPE.get(device)
    if t is None:
        t = _NO_ROPE[device] = torch.zeros(1, HEAD_DIM, dtype=torch.float32, device=device)
    return t


def _heads(num_q_heads, num_kv_heads) -> tuple[int, int]:
    for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_q_heads, num_kv_heads


def _cache(name, t, nkv, dev) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be torch.bfloat16, got {t.dtype}")
    if t.device != dev:
        raise ValueError(f"{name} is on {t.device}, expected {dev} (all tensors on one device)")
    if t.dim() != 4 or t.shape[2] != nkv or t.shape[3] != HEAD_DIM or t.shape[0] < 1 or t.shape[1] < 1:
        raise ValueError(
            f"{name} must have shape [num_blocks, block_size, {nkv}, {HEAD_DIM}], got {list(t.shape)}"
        )
    if t.stride(3) != 1:
        raise ValueError(f"{name} must have last stride 1, got strides {t.stride()}")
    return t


def _weight(weight, weight_scale, global_scale, dev, n: int | None):
    """Validate a BF16 or NVFP4 weight of n rows (any multiple of 16 when n is None). Returns
    (fmt, n, scale_ptr, global_scale_ptr); BF16 kernels never read the scale pointers (the weight's)."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in (torch.bfloat16, torch.uint8):
        raise TypeError(f"weight must be bf16 [N, {K}] or NVFP4 uint8 [N, {K // 2}], got {weight.dtype}")
    fmt = "bf16" if weight.dtype == torch.bfloat16 else "nvfp4"
    cols = K if fmt == "bf16" else K // 2
    if n is None:
        if weight.dim() != 2 or weight.shape[0] < 16 or weight.shape[0] % 16 or weight.shape[1] != cols:
            raise ValueError(f"weight must have shape [N, {cols}] with N a positive multiple of 16, "
                             f"got {list(weight.shape)}")  # fmt: skip
        n = weight.shape[0]
    _tensor("weight", weight, weight.dtype, (n, cols), dev)
    if fmt == "bf16":
        if weight_scale is not None or global_scale is not None:
            raise ValueError("weight_scale and global_scale must be None for a BF16 weight")
        return fmt, n, weight.data_ptr(), weight.data_ptr()
    if weight_scale is None or global_scale is None:
        raise ValueError("an NVFP4 weight (uint8) needs weight_scale and global_scale")
    if not isinstance(weight_scale, torch.Tensor):
        raise TypeError(f"weight_scale must be a torch.Tensor, got {type(weight_scale).__name__}")
    if weight_scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(
            "weight_scale must be torch.float8_e4m3fn (or a torch.uint8 view of it), "
            f"got {weight_scale.dtype}"
        )
    n_pad = -(-n // 128) * 128  # the 128x4 swizzle pads rows to a multiple of 128
    _tensor("weight_scale", weight_scale, weight_scale.dtype, (n_pad, K // 16), dev, align=4)
    if not isinstance(global_scale, torch.Tensor):
        raise TypeError(f"global_scale must be a torch.Tensor, got {type(global_scale).__name__}")
    if global_scale.numel() != 1:
        raise ValueError(f"global_scale must hold one fp32 element, got shape {list(global_scale.shape)}")
    _tensor("global_scale", global_scale.reshape(1), torch.float32, (1,), dev, align=4)
    return fmt, n, weight_scale.data_ptr(), global_scale.data_ptr()


class _QK:
    """Validated inputs of the per-head stage (shared by flint_qkv_fused and qk_norm_rope_cache)."""

    def __init__(self, m, nkv, dev, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions,
                 k_cache, v_cache, slot_mapping):  # fmt: skip
        _tensor("q_norm_weight", q_norm_weight, torch.bfloat16, (HEAD_DIM,), dev)
        _tensor("k_norm_weight", k_norm_weight, torch.bfloat16, (HEAD_DIM,), dev)
        self.eps = _eps("qk_eps", qk_eps)
        self.rope = cos_sin_cache is not None
        if self.rope:
            if not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.dim() != 2:
                raise ValueError("cos_sin_cache must be an fp32 tensor [max_pos, 128] or None")
            max_pos = cos_sin_cache.shape[0]
            _tensor("cos_sin_cache", cos_sin_cache, torch.float32, (max_pos, HEAD_DIM), dev)
            if not 1 <= max_pos < 2**31:
                raise ValueError(f"cos_sin_cache must have 1 <= max_pos < 2**31 rows, got {max_pos}")
            self.cs = cos_sin_cache
        else:
            self.cs = no_rope_table(dev)
        _tensor("positions", positions, torch.int64, (m,), dev)
        _cache("k_cache", k_cache, nkv, dev)
        _cache("v_cache", v_cache, nkv, dev)
        if tuple(v_cache.shape) != tuple(k_cache.shape) or v_cache.stride() != k_cache.stride():
            raise ValueError(
                f"k_cache and v_cache must have the same shape and strides, got {list(k_cache.shape)} "
                f"{k_cache.stride()} and {list(v_cache.shape)} {v_cache.stride()}"
            )
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
            raise ValueError("slot_mapping must be a 1-D int64 tensor of at most M entries")
        self.s = slot_mapping.shape[0]
        _tensor("slot_mapping", slot_mapping, torch.int64, (self.s,), dev)
        if self.s > m:
            raise ValueError(f"slot_mapping has {self.s} entries, more than the M = {m} tokens")
        self.nb, self.bs = k_cache.shape[0], k_cache.shape[1]
        self.args = (q_norm_weight, k_norm_weight, positions, slot_mapping, k_cache, v_cache)

    def check_bounds(self, positions, slot_mapping):
        if _bounds_check:
            _check_bounds(positions, slot_mapping, self.cs.shape[0] if self.rope else None, self.nb * self.bs)

    def tail(self, k_cache):
        """The kernels' trailing scalars: num_slot_mapping, max_pos, block_size, num_cache_slots, strides."""
        return [self.s, self.cs.shape[0], self.bs, self.nb * self.bs,
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)]  # fmt: skip


def flint_qkv_fused(
    x,
    residual,
    norm_weight,
    eps,
    weight,
    weight_scale,
    global_scale,
    q_norm_weight,
    k_norm_weight,
    qk_eps,
    cos_sin_cache,
    positions,
    k_cache,
    v_cache,
    slot_mapping,
    num_q_heads,
    num_kv_heads,
):
    """Residual-add RMSNorm + qkv GEMV + q/k RMSNorm, NeoX RoPE, paged KV-cache write, for M <= 8 tokens.

    Returns (q bf16 [M, num_q_heads * 128], residual_out bf16 [M, 2048]); residual_out is x itself when
    residual is None. Shapes and semantics: SPEC §2. A position outside cos_sin_cache makes that token's
    q/k heads NaN and a slot >= num_blocks * block_size is not written (no out-of-bounds access either
    way); `set_bounds_check(True)` raises on them instead.
    """
    if torch.compiler.is_compiling():
        q, r = torch.ops.flint.qkv_fused(
            x, residual, norm_weight, eps, weight, weight_scale, global_scale, q_norm_weight, k_norm_weight,
            qk_eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads,
        )  # fmt: skip
        return q, (x if residual is None else r)  # (the op never aliases an input)
    m = _activations(x)
    dev = x.device
    nq, nkv = _heads(num_q_heads, num_kv_heads)
    n = (nq + 2 * nkv) * HEAD_DIM
    if residual is not None:
        _tensor("residual", residual, torch.bfloat16, (m, K), dev)
    _tensor("norm_weight", norm_weight, torch.bfloat16, (K,), dev)
    eps = _eps("eps", eps)
    fmt, _, ws, gs = _weight(weight, weight_scale, global_scale, dev, n)
    qk = _QK(m, nkv, dev, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache,
             slot_mapping)  # fmt: skip
    norm_k = runtime.get_kernel(dev, "norm", {"residual": residual is not None})
    qkv_k = runtime.get_kernel(dev, "qkv", {"weight_format": fmt, "rope": qk.rope, "heads": [nq, nkv]})
    qk.check_bounds(positions, slot_mapping)

    q = torch.empty(m, nq * HEAD_DIM, dtype=torch.bfloat16, device=dev)
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev)
        xn, res_out = _launch_norm(norm_k, x, residual, norm_weight, eps, stream)
        args = [xn.data_ptr(), weight.data_ptr(), ws, gs, q_norm_weight.data_ptr(), k_norm_weight.data_ptr(),
                qk.cs.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(), q.data_ptr(),
                k_cache.data_ptr(), v_cache.data_ptr(), m, *qk.tail(k_cache), qk.eps]  # fmt: skip
        runtime.launch(qkv_k, {"ROW_BLOCKS": n // 16}, args, stream)
    return q, res_out


# ----------------------------------------------------------------------------- the unfused path
def gemv(x, weight, weight_scale=None, global_scale=None) -> torch.Tensor:
    """y = bf16(x · Wᵀ) for x bf16 [M, 2048] (1 <= M <= 8) and W BF16 [N, 2048] or NVFP4 (uint8 [N, 1024],
    e4m3/uint8 128x4-swizzled scales [ceil(N/128)*128, 128], fp32 global scale of one element), N any
    multiple of 16. Same fragment math, K split and summation order as the fused kernel: bit-identical to
    its qkv values. Returns a new bf16 [M, N] tensor."""
    if torch.compiler.is_compiling():
        return torch.ops.flint.gemv(x, weight, weight_scale, global_scale)
    m = _activations(x)
    dev = x.device
    fmt, n, ws, gs = _weight(weight, weight_scale, global_scale, dev, None)
    k = runtime.get_kernel(dev, "gemv", {"weight_format": fmt})
    y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    with torch.cuda.device(dev):
        args = [x.data_ptr(), weight.data_ptr(), ws, gs, y.data_ptr(), m, n]
        runtime.launch(k, {"ROW_BLOCKS": n // 16}, args, torch.cuda.current_stream(dev))
    return y


def qk_norm_rope_cache(
    qkv,
    q_norm_weight,
    k_norm_weight,
    qk_eps,
    cos_sin_cache,
    positions,
    k_cache,
    v_cache,
    slot_mapping,
    num_q_heads,
    num_kv_heads,
) -> torch.Tensor:
    """SPEC §3.3 on a bf16 qkv [M, (num_q_heads + 2 num_kv_heads) * 128]: per-head q/k RMSNorm, NeoX RoPE
    (cos_sin_cache None = none), k and v written to the paged cache at slot_mapping (same rules and memory
    safety as flint_qkv_fused). Returns q bf16 [M, num_q_heads * 128]."""
    if torch.compiler.is_compiling():
        return torch.ops.flint.qk_norm_rope_cache(qkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache,
                                                  positions, k_cache, v_cache, slot_mapping, num_q_heads,
                                                  num_kv_heads)  # fmt: skip
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    nq, nkv = _heads(num_q_heads, num_kv_heads)
    n = (nq + 2 * nkv) * HEAD_DIM
    if qkv.dim() != 2 or qkv.shape[1] != n or not 1 <= qkv.shape[0] <= MAX_M:
        raise ValueError(f"qkv must have shape [M, {n}] with 1 <= M <= {MAX_M} for {nq} q and {nkv} kv "
                         f"heads, got {list(qkv.shape)}")  # fmt: skip
    m = qkv.shape[0]
    dev = qkv.device
    _tensor("qkv", qkv, torch.bfloat16, (m, n))
    qk = _QK(m, nkv, dev, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache,
             slot_mapping)  # fmt: skip
    k = runtime.get_kernel(dev, "qk_norm_rope_cache", {"rope": qk.rope})
    qk.check_bounds(positions, slot_mapping)
    q = torch.empty(m, nq * HEAD_DIM, dtype=torch.bfloat16, device=dev)
    with torch.cuda.device(dev):
        args = [qkv.data_ptr(), q_norm_weight.data_ptr(), k_norm_weight.data_ptr(), qk.cs.data_ptr(),
                positions.data_ptr(), slot_mapping.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
                v_cache.data_ptr(), m, nq, nkv, *qk.tail(k_cache), qk.eps]  # fmt: skip
        runtime.launch(k, {"HEADS": nq + 2 * nkv}, args, torch.cuda.current_stream(dev))
    return q


def _check_bounds(positions, slot_mapping, max_pos, num_slots):
    pos = positions.tolist()
    if max_pos is not None:
        bad = [(t, p) for t, p in enumerate(pos) if not 0 <= p < max_pos]
        if bad:
            raise ValueError(f"positions outside the cos/sin table [0, {max_pos}): token, position = {bad}")
    bad = [(t, sl) for t, sl in enumerate(slot_mapping.tolist()) if sl >= num_slots]
    if bad:
        raise ValueError(
            f"slots outside the cache (num_blocks * block_size = {num_slots}): token, slot = {bad}"
        )


# Under torch.compile (Dynamo tracing) each public op below becomes the custom op of loader/torch_ops.py
# (namespace `flint`: fake implementation, the KV-cache mutation declared), whose real implementation calls
# the same function again at run time, outside tracing: no graph break, and the compiled graph captures.
from loader import torch_ops  # noqa: E402,F401  (registers the flint:: custom ops)

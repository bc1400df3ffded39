"""The public ops (docs/api.md §3-§6): argument checks, output allocation and launches.

Every check runs before anything is launched or written, and raises TypeError / ValueError (bad arguments) or
LookupError (not in the bundle). This is the eager hot path: checks are plain attribute reads and integer
arithmetic, kernel arguments are filled by parameter name into a launcher built once (loader.runtime).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from loader import abi, runtime
from loader.abi import F32_MAX, HEAD_DIM, HIDDEN, MAX_M

_BF16, _F32, _I64, _U8, _E4M3 = torch.bfloat16, torch.float32, torch.int64, torch.uint8, torch.float8_e4m3fn
_I32_MAX = (1 << 31) - 1
# torch's current stream of a device as a raw handle (0.1 µs; torch.cuda.current_stream costs ~5 µs)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda d: torch.cuda.current_stream(d).cuda_stream
)
_compiling = torch.compiler.is_compiling
# expected shapes as torch.Size: comparing a tensor's shape with a torch.Size is twice as fast as with a tuple
_ROWS = [torch.Size([m, HIDDEN]) for m in range(MAX_M + 1)]
_TOKENS = [torch.Size([m]) for m in range(MAX_M + 1)]
_HIDDEN, _HEAD = torch.Size([HIDDEN]), torch.Size([HEAD_DIM])
_options = runtime.options
_launcher = runtime.launcher


# ----------------------------------------------------------------------------- checks
def _t(name: str, t, dtype, shape: tuple, dev: int, align: int = 16) -> int:
    """data_ptr of t, a contiguous tensor of this dtype and shape on CUDA device dev, `align`-byte aligned."""
    if isinstance(t, Tensor) and t.dtype is dtype and t.get_device() == dev and t.shape == shape:
        p = t.data_ptr()
        if t.is_contiguous() and not p % align:
            return p
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype is not dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.get_device() != dev:
        raise ValueError(f"{name} is on {t.device}, expected cuda:{dev} (all tensors on x's CUDA device)")
    if t.shape != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
    raise ValueError(f"{name} must be {align}-byte aligned (data_ptr % {align} = {t.data_ptr() % align})")


def _eps(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a Python float, got {type(v).__name__}")
    if not 0 <= v <= F32_MAX:  # also refuses NaN, and values that are infinite as the kernel's fp32
        raise ValueError(f"{name} must be finite and >= 0 as an fp32 (0 <= {name} <= {F32_MAX:.4g}), got {v}")
    return float(v)


def _x(x, name: str = "x", cols: int = HIDDEN) -> tuple[int, int]:
    """(M, device index) of activations: a 2-D tensor [M, cols] on a CUDA device, 1 <= M <= 8."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    s = x.shape
    if len(s) != 2 or s[1] != cols or not 1 <= s[0] <= MAX_M:
        raise ValueError(f"{name} must have shape [M, {cols}] with 1 <= M <= {MAX_M}, got {list(s)}")
    dev = x.get_device()
    if dev < 0:
        raise ValueError(f"{name} must be on a CUDA device, got {x.device}")
    return s[0], dev


def _heads(nq, nkv) -> tuple[int, int]:
    if type(nq) is int and type(nkv) is int and 1 <= nkv <= nq <= 4096 and not nq % nkv:
        return nq, nkv
    for name, v in (("num_q_heads", nq), ("num_kv_heads", nkv)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if not 1 <= v <= 4096:
            raise ValueError(f"{name} must be in 1..4096, got {v}")
    if nq % nkv:
        raise ValueError(f"num_q_heads ({nq}) must be a multiple of num_kv_heads ({nkv})")
    return nq, nkv


def _weight(a: dict, weight, weight_scale, global_scale, dev: int, n: int | None) -> tuple[str, int]:
    """(format, N) of a BF16 or NVFP4 weight of n rows (when n is None: any multiple of 16 up to
    abi.MAX_GEMV_ROWS); its kernel arguments go into a. BF16 kernels never read the scale pointers (they get
    the weight's)."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    fmt = "bf16" if weight.dtype is _BF16 else "nvfp4" if weight.dtype is _U8 else None
    if fmt is None:
        raise TypeError(f"weight must be bf16 [N, {HIDDEN}] or NVFP4 uint8 [N, {HIDDEN // 2}], "
                        f"got {weight.dtype}")  # fmt: skip
    cols = HIDDEN if fmt == "bf16" else abi.NVFP4_ROW_BYTES
    if n is None:
        n = weight.shape[0] if weight.dim() == 2 else 0
        if not (16 <= n <= abi.MAX_GEMV_ROWS and n % 16 == 0):
            raise ValueError(f"weight must have shape [N, {cols}], N a multiple of 16 in "
                             f"16..{abi.MAX_GEMV_ROWS} (the kernels' 32-bit row offsets), got "
                             f"{list(weight.shape)}")  # fmt: skip
    w = _t("weight", weight, weight.dtype, (n, cols), dev)
    if fmt == "bf16":
        if weight_scale is not None or global_scale is not None:
            raise ValueError("weight_scale and global_scale must be None for a BF16 weight")
        a["weight"] = a["weight_scale"] = a["global_scale"] = w
        return fmt, n
    if weight_scale is None or global_scale is None:
        raise ValueError("an NVFP4 weight (uint8) needs weight_scale and global_scale")
    sdt = weight_scale.dtype if isinstance(weight_scale, Tensor) else None
    if sdt is not _E4M3 and sdt is not _U8:
        raise TypeError(f"weight_scale must be a torch.float8_e4m3fn (or torch.uint8 view) tensor, got {sdt}")
    n_pad = -(-n // 128) * 128  # the 128x4 swizzle pads rows to a multiple of 128
    a["weight"] = w
    a["weight_scale"] = _t("weight_scale", weight_scale, sdt, (n_pad, abi.SCALE_COLS), dev, align=4)
    a["global_scale"] = _scalar("global_scale", global_scale, dev)
    return fmt, n


def _scalar(name: str, t, dev: int) -> int:
    """data_ptr of a one-element fp32 tensor on device dev."""
    if isinstance(t, Tensor) and t.numel() == 1:
        return _t(name, t, _F32, t.shape, dev, align=4)
    raise (TypeError if not isinstance(t, Tensor) else ValueError)(
        f"{name} must be a one-element fp32 tensor, got {list(t.shape) if isinstance(t, Tensor) else type(t)}"
    )


_scale_ok: dict[int, tuple] = {}  # id(tensor) -> (weak reference, its _version when read and found valid)


def _kv_scale(name: str, t, dev: int, recheck: bool) -> int:
    """data_ptr of an FP8 cache scale, checked to be one finite fp32 > 0 on device dev. The value is read
    (a device-to-host copy) again after every in-place change torch records (the tensor's version counter;
    an inference-mode tensor, which has none, is read once), and on every call in checked mode; not during
    CUDA-graph capture, where an unread scale is refused."""
    p = _scalar(name, t, dev)
    ref, version = _scale_ok.get(id(t), (None, None))
    now = -1 if t.is_inference() else t._version  # inference tensors keep no version counter
    if recheck or version != now or ref() is not t:
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(f"{name} was never checked and cannot be read during CUDA-graph capture: call "
                             "the op once before capturing")  # fmt: skip
        v = t.item()
        if not 0 < v <= F32_MAX:
            raise ValueError(f"{name} must be finite and > 0, got {v}")
        _scale_ok[id(t)] = (weakref.ref(t), now)
    return p


def _cache(name: str, t, nkv: int, dev: int):
    """(num_blocks, block_size, strides) of a paged KV cache view (docs/api.md §7): no zero or overlapping
    strides (the kernels write it), block size within the kernels' int32."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype is not _BF16 and t.dtype is not _E4M3 and t.dtype is not _U8:
        raise TypeError(f"{name} must be torch.bfloat16, or torch.float8_e4m3fn / torch.uint8 (an FP8 e4m3 "
                        f"cache), got {t.dtype}")  # fmt: skip
    if t.get_device() != dev:
        raise ValueError(f"{name} is on {t.device}, expected cuda:{dev} (all tensors on x's CUDA device)")
    shape, st = t.shape, t.stride()
    if len(shape) != 4 or shape[2] != nkv or shape[3] != HEAD_DIM or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"{name} must have shape [num_blocks, block_size, {nkv}, {HEAD_DIM}], "
                         f"got {list(shape)}")  # fmt: skip
    nb, bs = shape[0], shape[1]
    if st[3] != 1:
        raise ValueError(f"{name} must have last stride 1, got strides {st}")
    if bs > _I32_MAX:
        raise ValueError(f"{name}: block_size {bs} exceeds the kernels' int32 block size ({_I32_MAX})")
    head = (nkv - 1) * st[2] + HEAD_DIM
    if not (st[2] >= HEAD_DIM and st[1] >= head and st[0] >= (bs - 1) * st[1] + head):  # not the usual order
        span = 1
        for stride, size in sorted((d, s) for s, d in zip(shape, st, strict=True) if s > 1):
            if stride < span:
                raise ValueError(f"{name} must not have zero or overlapping strides (the kernels write it): "
                                 f"shape {list(shape)}, strides {st}")  # fmt: skip
            span += stride * (size - 1)
    return nb, bs, st


def _disjoint(k: Tensor, v: Tensor, nb: int, bs: int, nkv: int, st) -> bool:
    """Whether two cache views of identical shape and strides share no block's memory: block b of k spans
    [k + b s0, + extent), of v [v + b s0, + extent) (elements)."""
    isz = k.element_size()
    extent = (bs - 1) * st[1] + (nkv - 1) * st[2] + HEAD_DIM
    d, rem = divmod(abs(v.data_ptr() - k.data_ptr()), isz)
    if d >= (nb - 1) * st[0] + extent:  # whole views apart
        return True
    if rem or nb == 1:
        return not rem and d >= extent
    q, r = divmod(d, st[0])  # the nearest blocks of the other view lie r before and s0 - r after
    return r >= extent and (q + 1 >= nb or st[0] - r >= extent)


def _epilogue(a, m, nkv, dev, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache,
              v_cache, slot_mapping, k_scale, v_scale, checked) -> tuple[bool, str]:  # fmt: skip
    """RoPE on/off and cache dtype of the per-head stage (flint_qkv_fused, qk_norm_rope_cache); its kernel
    arguments go into a."""
    if cos_sin_cache is not None:
        if cos_sin_cache is _NO_ROPE.get(dev):
            raise ValueError("cos_sin_cache is loader.no_rope_table(), a placeholder: pass None for no RoPE")
        is2d = isinstance(cos_sin_cache, Tensor) and cos_sin_cache.dim() == 2
        max_pos = cos_sin_cache.shape[0] if is2d else 0
        if not 1 <= max_pos <= _I32_MAX:
            raise ValueError("cos_sin_cache must be None or fp32 [max_pos, 128] with 1 <= max_pos < 2**31")
        cs = _t("cos_sin_cache", cos_sin_cache, _F32, torch.Size([max_pos, HEAD_DIM]), dev)
    else:
        max_pos, cs = 1, _no_rope(dev).data_ptr()
    if not isinstance(slot_mapping, Tensor) or slot_mapping.dim() != 1 or slot_mapping.shape[0] > m:
        raise ValueError(f"slot_mapping must be a 1-D int64 tensor of at most M = {m} entries")
    s = slot_mapping.shape[0]
    nb, bs, st = _cache("k_cache", k_cache, nkv, dev)
    vst = _cache("v_cache", v_cache, nkv, dev)[2]
    kdt = k_cache.dtype
    if v_cache.shape != k_cache.shape or vst != st or v_cache.dtype is not kdt:
        raise ValueError(f"k_cache and v_cache must have the same shape, strides and dtype, got "
                         f"{list(k_cache.shape)} {st} {kdt} and {list(v_cache.shape)} {vst} "
                         f"{v_cache.dtype}")  # fmt: skip
    if not _disjoint(k_cache, v_cache, nb, bs, nkv, st):
        raise ValueError("k_cache and v_cache overlap (the same memory, or a block of one inside the "
                         "other's): the kernels would write k and v to the same elements")  # fmt: skip
    kv = "bf16" if kdt is _BF16 else "fp8_e4m3"
    if kv == "bf16":
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale and v_scale are for FP8 caches only: pass None with a bf16 cache")
        ks = vs = cs  # never read by a BF16 build
    else:
        if k_scale is None or v_scale is None:
            raise ValueError(f"an FP8 cache ({kdt}) needs k_scale and v_scale (one-element fp32 tensors)")
        ks, vs = _kv_scale("k_scale", k_scale, dev, checked), _kv_scale("v_scale", v_scale, dev, checked)
    a.update(
        q_norm_weight=_t("q_norm_weight", q_norm_weight, _BF16, _HEAD, dev),
        k_norm_weight=_t("k_norm_weight", k_norm_weight, _BF16, _HEAD, dev),
        cos_sin_cache=cs, positions=_t("positions", positions, _I64, _TOKENS[m], dev, align=8),
        slot_mapping=_t("slot_mapping", slot_mapping, _I64, _TOKENS[s], dev, align=8),
        k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(), k_scale=ks, v_scale=vs, m=m,
        num_slot_mapping=s, max_pos=max_pos, block_size=bs, num_cache_slots=nb * bs, stride_block=st[0],
        stride_slot=st[1], stride_head=st[2], qk_eps=_eps("qk_eps", qk_eps),
    )  # fmt: skip
    if checked:
        _check_bounds(positions, slot_mapping, max_pos if cos_sin_cache is not None else None, nb * bs)
    return cos_sin_cache is not None, kv


def _check_bounds(positions, slot_mapping, max_pos, num_slots):
    """Checked mode: values the kernels would skip (NaN q/k, slot not written) raise instead."""
    if torch.cuda.is_current_stream_capturing():
        raise ValueError("bounds_check reads positions and slots on the host: not usable in graph capture")
    if max_pos is not None:
        bad = [(t, p) for t, p in enumerate(positions.tolist()) if not 0 <= p < max_pos]
        if bad:
            raise ValueError(f"positions outside the cos/sin table [0, {max_pos}): token, position = {bad}")
    slots = slot_mapping.tolist()
    bad = [(t, s) for t, s in enumerate(slots) if s >= num_slots]
    if bad:
        raise ValueError(f"slots outside the cache (num_blocks * block_size = {num_slots}): token, slot = "
                         f"{bad}")  # fmt: skip
    seen: dict[int, int] = {}
    for t, s in enumerate(slots):
        if s >= 0 and seen.setdefault(s, t) != t:
            raise ValueError(f"slot {s} is mapped twice (tokens {seen[s]} and {t}): each token needs its "
                             "own slot")  # fmt: skip


def _norm_args(a: dict, x, residual, weight, eps, m: int, dev: int) -> Tensor:
    """The input norm's kernel arguments (norm kernel or prologue) into a; returns residual_out (a new
    tensor, or x itself without a residual)."""
    a["x"] = _t("x", x, _BF16, _ROWS[m], dev)
    a["norm_weight"] = _t("norm_weight", weight, _BF16, _HIDDEN, dev)
    a["eps"] = _eps("eps", eps)
    if residual is None:
        a["residual"] = a["residual_out"] = a["x"]
        return x
    a["residual"] = _t("residual", residual, _BF16, _ROWS[m], dev)
    res_out = torch.empty(m, HIDDEN, dtype=_BF16, device=x.device)
    a["residual_out"] = res_out.data_ptr()
    return res_out


def _norm_kernel(a: dict, x: Tensor, m: int, dev: int, has_res: bool) -> tuple:
    """The norm kernel's launcher, packed (arguments from a) with a new xn, and xn."""
    k = _launcher(dev, "norm", has_res, lambda: abi.norm_spec(has_res))
    xn = torch.empty(m, HIDDEN, dtype=_BF16, device=x.device)
    k.pack({"x": a["x"], "residual": a["residual"], "residual_out": a["residual_out"], "xn": xn.data_ptr(),
            "weight": a["norm_weight"], "eps": a["eps"]})  # fmt: skip
    return k, xn


def _norm(x, residual, weight, eps) -> tuple[Tensor, Tensor]:
    m, dev = _x(x)
    a: dict = {}
    res_out = _norm_args(a, x, residual, weight, eps, m, dev)
    k, xn = _norm_kernel(a, x, m, dev, residual is not None)
    k.launch(m, _raw_stream(dev), _options().pdl)
    return xn, res_out


# ----------------------------------------------------------------------------- input norm
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """xn = bf16(bf16(x * rsqrt(mean(x²) + eps)) * weight) for x bf16 [M, 2048], 1 <= M <= 8
    (docs/api.md §4)."""
    if _compiling():
        return torch.ops.flint.rms_norm(x, weight, eps)
    return _norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """r = bf16(x + residual); returns (rms_norm(r, weight, eps), r), both new tensors (docs/api.md §4)."""
    if _compiling():
        return torch.ops.flint.fused_add_rms_norm(x, residual, weight, eps)
    if residual is None:
        raise TypeError("residual must be a tensor (use rms_norm when there is none)")
    return _norm(x, residual, weight, eps)


# ----------------------------------------------------------------------------- fused qkv
_NO_ROPE: dict[int, Tensor] = {}


def _no_rope(dev: int) -> Tensor:
    t = _NO_ROPE.get(dev)
    if t is None:
        t = _NO_ROPE[dev] = torch.zeros(1, HEAD_DIM, dtype=_F32, device=torch.device("cuda", dev))
    return t


def no_rope_table(device) -> Tensor:
    """The placeholder fp32 table that kernels built without RoPE receive (zeros [1, 128]). Not a valid
    `cos_sin_cache`: pass None for no RoPE (docs/api.md §8)."""
    device = torch.device(device)
    return _no_rope(device.index if device.index is not None else torch.cuda.current_device())


def flint_qkv_fused(
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
    *,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Residual-add RMSNorm + qkv GEMV + q/k RMSNorm, NeoX RoPE, paged KV-cache write, for M <= 8 tokens
    (docs/api.md §3; numerics: docs/numerics.md).

    Returns (q bf16 [M, num_q_heads * 128], residual_out bf16 [M, 2048]); residual_out is x itself when
    residual is None. An FP8 cache (float8_e4m3fn, or uint8 meaning e4m3) needs k_scale and v_scale. A
    position outside cos_sin_cache makes that token's q/k heads NaN; a negative slot or one >= num_blocks *
    block_size is not written; `launch_options(bounds_check=True)` raises on them instead. PDL input contract
    (docs/api.md §14): the weights, their scales and the norm weights may be read before the kernel waits for
    its predecessor on the stream, so that predecessor must not write them.
    """
    if _compiling():
        q, r = torch.ops.flint.qkv_fused(
            x, residual, norm_weight, eps, weight, weight_scale, global_scale, q_norm_weight, k_norm_weight,
            qk_eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        return q, (x if residual is None else r)  # (the op never aliases an input)
    m, dev = _x(x)
    nq, nkv = _heads(num_q_heads, num_kv_heads)
    a: dict = {}
    fmt, n = _weight(a, weight, weight_scale, global_scale, dev, (nq + 2 * nkv) * HEAD_DIM)
    opts = _options()
    res_out = _norm_args(a, x, residual, norm_weight, eps, m, dev)
    rope, kv = _epilogue(a, m, nkv, dev, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions,
                         k_cache, v_cache, slot_mapping, k_scale, v_scale, opts.bounds_check)  # fmt: skip
    # the two-kernel design (norm kernel + qkv kernel) unless asked otherwise or not built: it measures faster
    # than the prologue design on the H200 (BENCHMARKS.md §1)
    designs = (opts.design,) if opts.design else ("separate", "prologue")
    k = _launcher(dev, "qkv", (fmt, rope, nq, nkv, kv, designs), lambda: [
        abi.qkv_spec(fmt, rope, nq, nkv, kv, norm) for norm in designs])  # fmt: skip
    q = torch.empty(m, nq * HEAD_DIM, dtype=_BF16, device=x.device)
    a["q"] = q.data_ptr()
    stream, has_res = _raw_stream(dev), residual is not None
    if k.entry.spec["norm"] == "prologue":
        a["has_residual"] = int(has_res)
        k.pack(a)
    else:  # the norm kernel writes xn, which the qkv kernel reads as x; both packed before either launches
        nk, xn = _norm_kernel(a, x, m, dev, has_res)
        a.update(x=xn.data_ptr(), residual=0, residual_out=0, norm_weight=0, eps=0.0, has_residual=0)
        k.pack(a)
        nk.launch(m, stream, opts.pdl)
    k.launch(n // abi.ROWS_PER_CTA, stream, opts.pdl)
    return q, res_out


# ----------------------------------------------------------------------------- the unfused path
def gemv(
    x: Tensor, weight: Tensor, weight_scale: Tensor | None = None, global_scale: Tensor | None = None
) -> Tensor:
    """y = bf16(x · Wᵀ) for x bf16 [M, 2048] (1 <= M <= 8) and W BF16 [N, 2048] or NVFP4 (uint8 [N, 1024],
    e4m3/uint8 128x4-swizzled scales [ceil(N/128)*128, 128], fp32 global scale of one element), N a multiple
    of 16 up to loader.abi.MAX_GEMV_ROWS. Bit-identical to the fused kernel's qkv values (docs/numerics.md
    §2). Returns a new bf16 [M, N] tensor (docs/api.md §5)."""
    if _compiling():
        return torch.ops.flint.gemv(x, weight, weight_scale, global_scale)
    m, dev = _x(x)
    a = {"x": _t("x", x, _BF16, _ROWS[m], dev)}
    fmt, n = _weight(a, weight, weight_scale, global_scale, dev, None)
    k = _launcher(dev, "gemv", fmt, lambda: abi.gemv_spec(fmt))
    y = torch.empty(m, n, dtype=_BF16, device=x.device)
    a.update(y=y.data_ptr(), m=m, n=n)
    k.pack(a)
    k.launch(n // abi.ROWS_PER_CTA, _raw_stream(dev), _options().pdl)
    return y


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
    *,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """docs/numerics.md §3-§4 on a bf16 qkv [M, (num_q_heads + 2 num_kv_heads) * 128]: per-head q/k RMSNorm,
    NeoX RoPE (cos_sin_cache None = none), k and v written to the paged (BF16 or FP8) cache at slot_mapping
    (same rules and memory safety as flint_qkv_fused). Returns q bf16 [M, num_q_heads * 128]
    (docs/api.md §6)."""
    if _compiling():
        return torch.ops.flint.qk_norm_rope_cache(
            qkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache,
            slot_mapping, num_q_heads, num_kv_heads, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    nq, nkv = _heads(num_q_heads, num_kv_heads)
    n = (nq + 2 * nkv) * HEAD_DIM
    m, dev = _x(qkv, "qkv", n)
    a = {"qkv": _t("qkv", qkv, _BF16, (m, n), dev), "num_q_heads": nq, "num_kv_heads": nkv}
    rope, kv = _epilogue(a, m, nkv, dev, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions,
                         k_cache, v_cache, slot_mapping, k_scale, v_scale,
                         _options().bounds_check)  # fmt: skip
    k = _launcher(dev, "qk_norm_rope_cache", (rope, kv), lambda: abi.qk_norm_rope_cache_spec(rope, kv))
    q = torch.empty(m, nq * HEAD_DIM, dtype=_BF16, device=qkv.device)
    a["q"] = q.data_ptr()
    k.pack(a)
    k.launch(nq + 2 * nkv, _raw_stream(dev), _options().pdl)
    return q

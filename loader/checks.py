"""The ops' argument checks (docs/api.md §2, §7, §15): each raises TypeError / ValueError naming the argument
and the fix, before anything is launched or written, and makes no CUDA call (a CPU or meta tensor is refused
for its device first); loader.plans keeps what they conclude from the tensors' metadata."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from loader.abi import F32_MAX, HEAD_DIM, HIDDEN, MAX_M, max_gemv_rows, nvfp4_row_bytes, scale_cols

BF16, F32, I64, U8, E4M3 = torch.bfloat16, torch.float32, torch.int64, torch.uint8, torch.float8_e4m3fn
I32_MAX = (1 << 31) - 1
# expected shapes as torch.Size: comparing a tensor's shape with a torch.Size is twice as fast as with a tuple
HIDDEN_SHAPE, HEAD_SHAPE = torch.Size([HIDDEN]), torch.Size([HEAD_DIM])
ROWS = [torch.Size([m, HIDDEN]) for m in range(MAX_M + 1)]
TOKENS = [torch.Size([m]) for m in range(MAX_M + 1)]


def rows(m: int, k: int = HIDDEN) -> torch.Size:
    """torch.Size([m, k]): at HIDDEN the decode sizes (m <= MAX_M) from ROWS, built once; others anew."""
    return ROWS[m] if m <= MAX_M and k == HIDDEN else torch.Size([m, k])


def hidden(k: int) -> torch.Size:
    """torch.Size([k]): a norm weight's shape."""
    return HIDDEN_SHAPE if k == HIDDEN else torch.Size([k])


def tokens(m: int) -> torch.Size:
    return TOKENS[m] if m <= MAX_M else torch.Size([m])


def tensor(name: str, t, dtype, shape, dev: int) -> None:
    """t is a contiguous tensor of this dtype and shape on CUDA device dev."""
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


def aligned(names, tensors, align) -> None:
    """Every tensor's data pointer is aligned as the kernels reading it assume (bytes, from the manifest)."""
    for name, t, a in zip(names, tensors, align, strict=True):
        if t.data_ptr() % a:
            raise ValueError(f"{name} must be {a}-byte aligned (data_ptr % {a} = {t.data_ptr() % a})")


def eps(name: str, v) -> float:
    if type(v) is float and 0 <= v <= F32_MAX:
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a Python float, got {type(v).__name__}")
    if not 0 <= v <= F32_MAX:  # also refuses NaN, and values that are infinite as the kernel's fp32
        raise ValueError(f"{name} must be finite and >= 0 as an fp32 (0 <= {name} <= {F32_MAX:.4g}), got {v}")
    return float(v)


def activations(x, name: str = "x", cols: int | None = None, limit: int = MAX_M,
                why: str = "the kernels' limit") -> tuple[int, int]:  # fmt: skip
    """(M, device index) of a contiguous bf16 [M, cols] on a CUDA device, 1 <= M <= limit (the fused op and
    the GEMV: MAX_M; the unfused norm and per-head ops: the bundle's max_tokens, named by `why`). cols None:
    the hidden size K, any (the kernel lookup refuses one the bundle lacks, naming those it has)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    s = x.shape
    if len(s) != 2 or s[1] != (cols or s[1]) or not s[1] or not 1 <= s[0] <= limit:
        raise ValueError(f"{name} must have shape [M, {cols or 'K'}] with 1 <= M <= {limit} ({why}), "
                         f"got {list(s)}")  # fmt: skip
    dev = x.get_device()
    if dev < 0:
        raise ValueError(f"{name} must be on a CUDA device, got {x.device}")
    tensor(name, x, BF16, s, dev)
    return s[0], dev


def heads(nq, nkv) -> tuple[int, int]:
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


def weight(w, weight_scale, global_scale, dev: int, n: int | None, k: int = HIDDEN) -> tuple[str, int]:
    """(format, N) of a BF16 or NVFP4 weight of n rows and hidden size k (n None: any multiple of 16 up to
    loader.abi.max_gemv_rows(k))."""
    if not isinstance(w, Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(w).__name__}")
    fmt = "bf16" if w.dtype is BF16 else "nvfp4" if w.dtype is U8 else None
    if fmt is None:
        raise TypeError(f"weight must be bf16 [N, {k}] or NVFP4 uint8 [N, {nvfp4_row_bytes(k)}], "
                        f"got {w.dtype}")  # fmt: skip
    cols = k if fmt == "bf16" else nvfp4_row_bytes(k)
    if n is None:
        n, most = (w.shape[0] if w.dim() == 2 else 0), max_gemv_rows(k)
        if not (16 <= n <= most and n % 16 == 0):
            raise ValueError(f"weight must have shape [N, {cols}], N a multiple of 16 in 16..{most} "
                             f"(the kernels' 32-bit row offsets), got {list(w.shape)}")  # fmt: skip
    tensor("weight", w, w.dtype, (n, cols), dev)
    if fmt == "bf16":
        if weight_scale is not None or global_scale is not None:
            raise ValueError("weight_scale and global_scale must be None for a BF16 weight")
        return fmt, n
    if weight_scale is None or global_scale is None:
        raise ValueError("an NVFP4 weight (uint8) needs weight_scale and global_scale")
    sdt = weight_scale.dtype if isinstance(weight_scale, Tensor) else None
    if sdt is not E4M3 and sdt is not U8:
        raise TypeError(f"weight_scale must be a torch.float8_e4m3fn (or torch.uint8 view) tensor, got {sdt}")
    tensor("weight_scale", weight_scale, sdt, (-(-n // 128) * 128, scale_cols(k)), dev)  # rows padded to 128
    scalar("global_scale", global_scale, dev)
    return fmt, n


def scalar(name: str, t, dev: int) -> None:
    """t is a one-element fp32 tensor on device dev."""
    if isinstance(t, Tensor) and t.numel() == 1:
        return tensor(name, t, F32, t.shape, dev)
    raise (TypeError if not isinstance(t, Tensor) else ValueError)(
        f"{name} must be a one-element fp32 tensor, got {list(t.shape) if isinstance(t, Tensor) else type(t)}"
    )


# ----------------------------------------------------------------------------- FP8 cache scales
_scale_ok: dict[int, tuple] = {}  # id(tensor) -> (weak reference, its _version when read and found valid)


def kv_scale(name: str, t, dev: int, recheck: bool) -> None:
    """An FP8 cache scale: one finite fp32 > 0 on device dev. The value is read (a device-to-host copy) again
    after every in-place change torch records (the tensor's version counter; an inference-mode tensor, which
    has none, is read once), and on every call in checked mode; not during CUDA-graph capture, where an
    unread scale is refused."""
    scalar(name, t, dev)
    if recheck or not scales_seen(t, t):
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(f"{name} was never checked and cannot be read during CUDA-graph capture: call "
                             "the op once before capturing")  # fmt: skip
        v = t.item()
        if not 0 < v <= F32_MAX:
            raise ValueError(f"{name} must be finite and > 0, got {v}")
        _scale_ok[id(t)] = (weakref.ref(t), _version(t))


def _version(t) -> int:
    return -1 if t.is_inference() else t._version  # inference tensors keep no version counter


def scales_seen(k_scale, v_scale) -> bool:
    """Whether both FP8 scales' values were read and found valid, and not changed in place since (one call
    for both: the hot path's form; two calls measured 0.4-0.5 µs slower per FP8 call on the H200)."""
    a, b = _scale_ok.get(id(k_scale)), _scale_ok.get(id(v_scale))
    if a is None or b is None or a[0]() is not k_scale or b[0]() is not v_scale:
        return False
    try:
        return a[1] == k_scale._version and b[1] == v_scale._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        return a[1] == _version(k_scale) and b[1] == _version(v_scale)


# ----------------------------------------------------------------------------- paged KV caches
def cache(name: str, t, nkv: int, dev: int):
    """(num_blocks, block_size, strides) of a paged KV cache view (docs/api.md §7): no zero or overlapping
    strides (the kernels write it), slots (num_blocks * block_size) within the kernels' int32."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype is not BF16 and t.dtype is not E4M3 and t.dtype is not U8:
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
    if nb * bs > I32_MAX:
        raise ValueError(f"{name}: num_blocks * block_size = {nb * bs} slots exceeds the kernels' int32 slot "
                         f"index ({I32_MAX})")  # fmt: skip
    head = (nkv - 1) * st[2] + HEAD_DIM
    if not (st[2] >= HEAD_DIM and st[1] >= head and st[0] >= (bs - 1) * st[1] + head):  # not the usual order
        span = 1
        for stride, size in sorted((d, s) for s, d in zip(shape, st, strict=True) if s > 1):
            if stride < span:
                raise ValueError(f"{name} must not have zero or overlapping strides (the kernels write it): "
                                 f"shape {list(shape)}, strides {st}")  # fmt: skip
            span += stride * (size - 1)
    return nb, bs, st


def disjoint(k: Tensor, v: Tensor, nb: int, bs: int, nkv: int, st) -> None:
    """Two cache views of identical shape and strides share no block's memory: block b of k spans
    [k + b s0, + extent), of v [v + b s0, + extent) (elements)."""
    extent = (bs - 1) * st[1] + (nkv - 1) * st[2] + HEAD_DIM
    d, rem = divmod(abs(v.data_ptr() - k.data_ptr()), k.element_size())
    if d >= (nb - 1) * st[0] + extent:  # whole views apart
        return
    if rem or nb == 1:
        ok = not rem and d >= extent
    else:
        q, r = divmod(d, st[0])  # the nearest blocks of the other view lie r before and s0 - r after
        ok = r >= extent and (q + 1 >= nb or st[0] - r >= extent)
    if not ok:
        raise ValueError("k_cache and v_cache overlap (the same memory, or a block of one inside the "
                         "other's): the kernels would write k and v to the same elements")  # fmt: skip


def caches(k, v, nkv: int, dev: int) -> tuple:
    """(cache dtype, (num_blocks, block_size, nkv, strides)) of a pair of paged cache views (api.md §7)."""
    nb, bs, st = cache("k_cache", k, nkv, dev)
    same = isinstance(v, Tensor) and v.dtype is k.dtype and v.shape == k.shape and v.get_device() == dev
    vst = v.stride() if same else cache("v_cache", v, nkv, dev)[2]  # (k's metadata: k's checks hold)
    if v.shape != k.shape or vst != st or v.dtype is not k.dtype:
        raise ValueError(f"k_cache and v_cache must have the same shape, strides and dtype, got "
                         f"{list(k.shape)} {st} {k.dtype} and {list(v.shape)} {vst} {v.dtype}")  # fmt: skip
    disjoint(k, v, nb, bs, nkv, st)
    return "bf16" if k.dtype is BF16 else "fp8_e4m3", (nb, bs, nkv, st)


NO_ROPE: dict[int, Tensor] = {}  # device -> the placeholder table no-RoPE kernels get (ops.no_rope_table)


def placeholder(cos_sin_cache, dev: int) -> None:
    if cos_sin_cache is NO_ROPE.get(dev):
        raise ValueError("cos_sin_cache is loader.no_rope_table(), a placeholder: pass None for no RoPE")


def bounds(positions, slot_mapping, max_pos, num_slots) -> None:
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

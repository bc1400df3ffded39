"""The public ops (docs/api.md §3-§6): argument checks, output allocation and launches.

Every check runs before anything is launched or written, and raises TypeError / ValueError (bad arguments) or
LookupError (not in the bundle). This is the eager hot path: a call with tensors whose metadata an earlier
call validated passes that call's plan's guard (one C++ check of all of them) and re-checks only what depends
on pointers and values ("argument plans" below; docs/api.md §15); kernel arguments go by parameter name into a
launcher built once (loader.runtime).
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
_options = runtime._options.get  # this thread's LaunchOptions
_launcher = runtime.launcher
_data_ptr = Tensor.data_ptr


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
    if type(v) is float and 0 <= v <= F32_MAX:
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a Python float, got {type(v).__name__}")
    if not 0 <= v <= F32_MAX:  # also refuses NaN, and values that are infinite as the kernel's fp32
        raise ValueError(f"{name} must be finite and >= 0 as an fp32 (0 <= {name} <= {F32_MAX:.4g}), got {v}")
    return float(v)


def _x(x, name: str = "x", cols: int = HIDDEN) -> tuple[int, int]:
    """(M, device index) of activations: a contiguous bf16 [M, cols] on a CUDA device, 16-byte aligned,
    1 <= M <= 8."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    s = x.shape
    if len(s) != 2 or s[1] != cols or not 1 <= s[0] <= MAX_M:
        raise ValueError(f"{name} must have shape [M, {cols}] with 1 <= M <= {MAX_M}, got {list(s)}")
    dev = x.get_device()
    if dev < 0:
        raise ValueError(f"{name} must be on a CUDA device, got {x.device}")
    _t(name, x, _BF16, s, dev)
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


def _weight(weight, weight_scale, global_scale, dev: int, n: int | None) -> tuple[str, int]:
    """(format, N) of a BF16 or NVFP4 weight of n rows (when n is None: any multiple of 16 up to
    abi.MAX_GEMV_ROWS)."""
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
    _t("weight", weight, weight.dtype, (n, cols), dev)
    if fmt == "bf16":
        if weight_scale is not None or global_scale is not None:
            raise ValueError("weight_scale and global_scale must be None for a BF16 weight")
        return fmt, n
    if weight_scale is None or global_scale is None:
        raise ValueError("an NVFP4 weight (uint8) needs weight_scale and global_scale")
    sdt = weight_scale.dtype if isinstance(weight_scale, Tensor) else None
    if sdt is not _E4M3 and sdt is not _U8:
        raise TypeError(f"weight_scale must be a torch.float8_e4m3fn (or torch.uint8 view) tensor, got {sdt}")
    n_pad = -(-n // 128) * 128  # the 128x4 swizzle pads rows to a multiple of 128
    _t("weight_scale", weight_scale, sdt, (n_pad, abi.SCALE_COLS), dev, align=4)
    _scalar("global_scale", global_scale, dev)
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
    if not _scale_seen(t, recheck):
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(f"{name} was never checked and cannot be read during CUDA-graph capture: call "
                             "the op once before capturing")  # fmt: skip
        v = t.item()
        if not 0 < v <= F32_MAX:
            raise ValueError(f"{name} must be finite and > 0, got {v}")
        _scale_ok[id(t)] = (weakref.ref(t), _version(t))
    return p


def _version(t) -> int:
    return -1 if t.is_inference() else t._version  # inference tensors keep no version counter


def _scale_seen(t, checked: bool) -> bool:
    """Whether an FP8 scale's value was read and found valid, and not changed in place since."""
    return not checked and _scales_seen(t, t)


def _scales_seen(k_scale, v_scale) -> bool:
    """_scale_seen of both scales of an FP8 call in one call: the hot path's form (with two calls of
    _scale_seen instead, an FP8 qk_norm_rope_cache call measured 11.9-12.0 µs on the H200, 11.4-11.6 so)."""
    a, b = _scale_ok.get(id(k_scale)), _scale_ok.get(id(v_scale))
    if a is None or b is None or a[0]() is not k_scale or b[0]() is not v_scale:
        return False
    try:
        return a[1] == k_scale._version and b[1] == v_scale._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        return a[1] == _version(k_scale) and b[1] == _version(v_scale)


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


def _caches(k, v, nkv: int, dev: int) -> tuple:
    """(cache dtype, block_size, num_cache_slots, stride_block, stride_slot, stride_head) of a pair of paged
    cache views (docs/api.md §7)."""
    nb, bs, st = _cache("k_cache", k, nkv, dev)
    vst = _cache("v_cache", v, nkv, dev)[2]
    kdt = k.dtype
    if v.shape != k.shape or vst != st or v.dtype is not kdt:
        raise ValueError(f"k_cache and v_cache must have the same shape, strides and dtype, got "
                         f"{list(k.shape)} {st} {kdt} and {list(v.shape)} {vst} {v.dtype}")  # fmt: skip
    _check_disjoint(k, v, nb, bs, nkv, st)
    return "bf16" if kdt is _BF16 else "fp8_e4m3", bs, nb * bs, *st[:3]


def _check_disjoint(k, v, nb, bs, nkv, st) -> None:
    if not _disjoint(k, v, nb, bs, nkv, st):
        raise ValueError("k_cache and v_cache overlap (the same memory, or a block of one inside the "
                         "other's): the kernels would write k and v to the same elements")  # fmt: skip


def _epilogue(m, nkv, dev, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache,
              v_cache, slot_mapping, k_scale, v_scale) -> tuple[bool, str, dict]:  # fmt: skip
    """Checks the per-head stage's arguments (flint_qkv_fused, qk_norm_rope_cache): RoPE on/off, cache dtype
    and the kernel arguments that follow from the tensors' shapes and strides."""
    if cos_sin_cache is None:
        max_pos = 1
    else:
        s = cos_sin_cache.shape if isinstance(cos_sin_cache, Tensor) else ()
        max_pos = s[0] if len(s) == 2 else 0
        if not 1 <= max_pos <= _I32_MAX:
            raise ValueError("cos_sin_cache must be None or fp32 [max_pos, 128] with 1 <= max_pos < 2**31")
        _t("cos_sin_cache", cos_sin_cache, _F32, (max_pos, HEAD_DIM), dev)
        _placeholder(cos_sin_cache, dev)
    s = slot_mapping.shape if isinstance(slot_mapping, Tensor) else ()
    if len(s) != 1 or s[0] > m:
        raise ValueError(f"slot_mapping must be a 1-D int64 tensor of at most M = {m} entries")
    kv, bs, num_slots, s0, s1, s2 = _caches(k_cache, v_cache, nkv, dev)
    if kv == "bf16":
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale and v_scale are for FP8 caches only: pass None with a bf16 cache")
    else:
        if k_scale is None or v_scale is None:
            raise ValueError(f"an FP8 cache ({k_cache.dtype}) needs k_scale and v_scale (one-element fp32 "
                             "tensors)")  # fmt: skip
        _kv_scale("k_scale", k_scale, dev, False), _kv_scale("v_scale", v_scale, dev, False)
    _t("q_norm_weight", q_norm_weight, _BF16, _HEAD, dev)
    _t("k_norm_weight", k_norm_weight, _BF16, _HEAD, dev)
    _t("positions", positions, _I64, _TOKENS[m], dev, align=8)
    _t("slot_mapping", slot_mapping, _I64, s, dev, align=8)
    _eps("qk_eps", qk_eps)
    consts = dict(m=m, num_slot_mapping=s[0], max_pos=max_pos, block_size=bs, num_cache_slots=num_slots,
                  stride_block=s0, stride_slot=s1, stride_head=s2)  # fmt: skip
    return cos_sin_cache is not None, kv, consts


def _placeholder(cos_sin_cache, dev: int) -> None:
    if cos_sin_cache is _NO_ROPE.get(dev):
        raise ValueError("cos_sin_cache is loader.no_rope_table(), a placeholder: pass None for no RoPE")


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


# ----------------------------------------------------------------------------- argument plans
# A call's checks split in two: what follows from its tensors' metadata (dtype, device, shape, strides) and
# what follows from their data pointers and values. The first call with new metadata runs every check (the
# functions above) and leaves a plan: the kernel launchers, the kernel arguments that follow from the
# metadata, and a guard (torch's C++ TensorGuards, as torch.compile uses) that verifies in one call that later
# tensors have exactly the plan's dtypes, devices, shapes and strides. A call whose tensors pass the guard
# re-checks only what depends on pointers and values: alignment, k/v cache overlap, the no-RoPE placeholder,
# FP8 scale values, scalars. Without TensorGuards (or if it fails its self-test) every call checks in full.
try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover
    _TensorGuards = None


def _guard(tensors):
    return _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                         dynamic_dims_strides=[list(t.stride()) for t in tensors])  # fmt: skip


def _guards_work() -> bool:
    """TensorGuards is private to torch: use it only if it accepts and refuses what the plans rely on."""
    try:
        a, b = torch.empty(4, 6), torch.empty(2, 4, 6)[1]
        g = _guard((a, a))
        refused = (a.double(), a[:, :5], torch.empty(6, 4).t(), torch.empty(4, 7)[:, :6], a.view(2, 12), 1)
        return g.check(b, a) and not any(g.check(a, t) or g.check(t, a) for t in refused)
    except Exception:  # noqa: BLE001 (any failure means: do not use it)
        return False


_GUARDS = _TensorGuards is not None and _guards_work()
# stand-ins for arguments that are None, one per role (a guard refuses the same tensor twice)
_N = tuple(torch.empty(0) for _ in range(6))
_PLANS_PER_KEY = 16


class _Plan:
    __slots__ = ("guard", "dev", "m", "grid", "k", "nk", "pack", "pack_norm", "like", "deltas", "no_rope",
                 "fp4", "fp8", "max_pos", "num_slots", "placeholder", "geometry")  # fmt: skip

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))


def _plan(key: tuple, tensors: tuple, build, args: tuple = ()) -> _Plan:
    """The first of this key's plans whose guard passes `tensors`, or build(*args) (every check: raises on bad
    arguments) made into a new one."""
    plans = runtime.thread_cache().get(key)
    if plans:
        if plans[0].guard.check(*tensors):
            return plans[0]
        for i, p in enumerate(plans):
            if p.guard.check(*tensors):
                plans.insert(0, plans.pop(i))  # most recently used first
                return p
    p = build(*args)
    if _GUARDS:
        p.guard = _guard(tensors)
        if not p.guard.check(*tensors):  # one tensor in two roles: such calls are checked in full each time
            return p
        plans = runtime.thread_cache().setdefault(key, [])
        plans.insert(0, p)
        del plans[_PLANS_PER_KEY:]
    return p


def _misaligned(build, args: tuple = ()) -> None:
    build(*args)  # a data pointer is misaligned: the full checks raise the error that names it
    raise AssertionError("a misaligned data pointer passed the checks")


def _per_call(p: _Plan, P: tuple, ik: int, rope: bool, cos_sin_cache, k_cache, v_cache, k_scale, v_scale,
              positions, slot_mapping, checked: bool) -> None:  # fmt: skip
    """The per-head stage's checks that depend on pointers and values (P: the tensors' pointers, k_cache's at
    P[ik], v_cache's at P[ik + 1])."""
    if P[ik + 1] - P[ik] not in p.deltas:
        _check_disjoint(k_cache, v_cache, *p.geometry)
        if len(p.deltas) < 256:
            p.deltas.add(P[ik + 1] - P[ik])
    if rope and p.max_pos == 1:  # (the placeholder's shape: a plan for another shape never sees it)
        _placeholder(cos_sin_cache, p.dev)
    if p.fp8:
        _kv_scale("k_scale", k_scale, p.dev, checked)  # (reads a value only if _scale_seen says so)
        _kv_scale("v_scale", v_scale, p.dev, checked)
    if checked:
        _check_bounds(positions, slot_mapping, p.max_pos if rope else None, p.num_slots)


def _head_plan(p: _Plan, m, dev, rope, kv, consts, k_cache, v_cache, nkv):
    """The per-head stage's part of a plan."""
    p.deltas = {v_cache.data_ptr() - k_cache.data_ptr()}  # v - k addresses found not to overlap
    p.geometry = (k_cache.shape[0], consts["block_size"], nkv, k_cache.stride())  # _disjoint's arguments
    p.no_rope = None if rope else _no_rope(dev).data_ptr()
    p.fp8, p.max_pos, p.num_slots = kv != "bf16", consts["max_pos"], consts["num_cache_slots"]
    p.placeholder = rope and p.max_pos == 1  # calls must check for the no-RoPE placeholder table


# ----------------------------------------------------------------------------- input norm
_NORM_ARGS = ("x", "residual", "residual_out", "xn", "weight", "eps")


def _norm_launcher(dev: int, has_res: bool):
    return _launcher(dev, "norm", has_res, lambda: abi.norm_spec(has_res))


def _norm(x, residual, weight, eps) -> tuple[Tensor, Tensor]:
    e, has_res = _eps("eps", eps), residual is not None
    ts = (x, weight, residual) if has_res else (x, weight)  # (an absent tensor costs the guard nothing)

    def build():
        m, dev = _x(x)
        if has_res:
            _t("residual", residual, _BF16, _ROWS[m], dev)
        _t("weight", weight, _BF16, _HIDDEN, dev)
        k = _norm_launcher(dev, has_res)
        return _Plan(dev=dev, m=m, k=k, pack=k.packer(_NORM_ARGS, {}))

    p = _plan(("norm", has_res), ts, build)
    P = tuple(map(_data_ptr, ts))
    if (P[0] | P[1] | P[-1]) & 15:
        _misaligned(build)
    xn = torch.empty_like(x)
    res_out = torch.empty_like(x) if has_res else x
    p.pack((P[0], P[2] if has_res else P[0], res_out.data_ptr(), xn.data_ptr(), P[1], e))
    p.k.launch(p.m, _raw_stream(p.dev), _options().pdl)
    return xn, res_out


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


# the qkv kernel's arguments that change from call to call, in the order the ops pass them
_QKV_ARGS = ("x", "residual", "residual_out", "norm_weight", "weight", "weight_scale", "global_scale",
             "q_norm_weight", "k_norm_weight", "cos_sin_cache", "positions", "slot_mapping", "q", "k_cache",
             "v_cache", "k_scale", "v_scale", "eps", "qk_eps")  # fmt: skip


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
    nq, nkv = _heads(num_q_heads, num_kv_heads)
    e, qe, opts = _eps("eps", eps), _eps("qk_eps", qk_eps), _options()
    has_res, rope = residual is not None, cos_sin_cache is not None
    ts = (x, residual if has_res else _N[0], norm_weight, weight,
          _N[1] if weight_scale is None else weight_scale, _N[2] if global_scale is None else global_scale,
          q_norm_weight, k_norm_weight, cos_sin_cache if rope else _N[3], positions, k_cache, v_cache,
          slot_mapping)  # fmt: skip
    if k_scale is not None or v_scale is not None:  # (absent, they cost the plan's guard nothing)
        ts += (_N[4] if k_scale is None else k_scale, _N[5] if v_scale is None else v_scale)

    def build():
        m, dev = _x(x)
        fmt, n = _weight(weight, weight_scale, global_scale, dev, (nq + 2 * nkv) * HEAD_DIM)
        if has_res:
            _t("residual", residual, _BF16, _ROWS[m], dev)
        _t("norm_weight", norm_weight, _BF16, _HIDDEN, dev)
        rope_, kv, consts = _epilogue(
            m, nkv, dev, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache,
            slot_mapping, k_scale, v_scale,
        )  # fmt: skip
        designs = (design,) if opts.design else (design, "prologue" if design == "separate" else "separate")
        k = _launcher(dev, "qkv", (fmt, rope_, nq, nkv, kv, designs), lambda: [
            abi.qkv_spec(fmt, rope_, nq, nkv, kv, norm) for norm in designs])  # fmt: skip
        prologue = k.entry.spec["norm"] == "prologue"
        nk = None if prologue else _norm_launcher(dev, has_res)
        p = _Plan(dev=dev, m=m, grid=n // abi.ROWS_PER_CTA, k=k, nk=nk, fp4=fmt == "nvfp4",
                  pack=k.packer(_QKV_ARGS, dict(consts, has_residual=int(has_res and prologue))),
                  pack_norm=nk and nk.packer(_NORM_ARGS, {}),
                  like=torch.empty(1, 1, dtype=_BF16, device=x.device).expand(m, nq * HEAD_DIM))  # fmt: skip
        _head_plan(p, m, dev, rope_, kv, consts, k_cache, v_cache, nkv)
        return p

    # Unless asked for one, the design that costs least where the call is: eagerly, the host's work per call
    # (prologue: one launch, no xn); in a CUDA graph, only the GPU's (separate; BENCHMARKS.md §1 and §4).
    # The two give bit-identical results. A design the bundle lacks falls back to the other.
    design = opts.design or ("separate" if torch.cuda.is_current_stream_capturing() else "prologue")
    p = _plan(("qkv", nq, nkv, has_res, weight_scale is None, global_scale is None, rope, k_scale is None,
               v_scale is None, design, opts.design is None), ts, build)  # fmt: skip
    P = tuple(map(_data_ptr, ts))
    if (P[0] | P[1] | P[2] | P[3] | P[6] | P[7] | P[8]) & 15 or (P[9] | P[12]) & 7 or (P[4] | P[5]) & 3 or (
            len(P) > 13 and (P[13] | P[14]) & 3):  # fmt: skip
        _misaligned(build)
    if (p.placeholder or opts.bounds_check or P[11] - P[10] not in p.deltas
            or p.fp8 and not _scales_seen(k_scale, v_scale)):  # fmt: skip
        _per_call(p, P, 10, rope, cos_sin_cache, k_cache, v_cache, k_scale, v_scale, positions, slot_mapping,
                  opts.bounds_check)  # fmt: skip
    w, cs = P[3], P[8] if rope else p.no_rope
    ws, gs = (P[4], P[5]) if p.fp4 else (w, w)  # BF16 kernels never read the scale pointers
    ks, vs = (P[13], P[14]) if p.fp8 else (cs, cs)
    q = torch.empty_like(p.like)
    res_out = torch.empty_like(x) if has_res else x
    qp, rop, rp, stream = q.data_ptr(), res_out.data_ptr(), P[1] if has_res else P[0], _raw_stream(p.dev)
    if p.nk is None:  # the prologue design: one kernel
        p.pack((P[0], rp, rop, P[2], w, ws, gs, P[6], P[7], cs, P[9], P[12], qp, P[10], P[11], ks, vs, e,
                qe))  # fmt: skip
    else:  # the norm kernel writes xn, which the qkv kernel reads as x; both packed before either launches
        xn_t = torch.empty_like(x)  # (held until both kernels are launched: freed earlier, another thread's
        xn = xn_t.data_ptr()  # allocation on this stream could take the block before they run)
        p.pack_norm((P[0], rp, rop, xn, P[2], e))
        p.pack((xn, 0, 0, 0, w, ws, gs, P[6], P[7], cs, P[9], P[12], qp, P[10], P[11], ks, vs, 0.0, qe))
        p.nk.launch(p.m, stream, opts.pdl)
    p.k.launch(p.grid, stream, opts.pdl)
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
    ts = (x, weight)
    if weight_scale is not None or global_scale is not None:  # (absent, they cost the plan's guard nothing)
        ts += (_N[1] if weight_scale is None else weight_scale,
               _N[2] if global_scale is None else global_scale)  # fmt: skip

    def build():
        m, dev = _x(x)
        fmt, n = _weight(weight, weight_scale, global_scale, dev, None)
        k = _launcher(dev, "gemv", fmt, lambda: abi.gemv_spec(fmt))
        return _Plan(dev=dev, m=m, grid=n // abi.ROWS_PER_CTA, k=k, fp4=fmt == "nvfp4",
                     pack=k.packer(("x", "weight", "weight_scale", "global_scale", "y"), {"m": m, "n": n}),
                     like=torch.empty(1, 1, dtype=_BF16, device=x.device).expand(m, n))  # fmt: skip

    p = _plan(("gemv", weight_scale is None, global_scale is None), ts, build)
    P = tuple(map(_data_ptr, ts))
    if (P[0] | P[1]) & 15 or len(P) > 2 and (P[2] | P[3]) & 3:
        _misaligned(build)
    y = torch.empty_like(p.like)
    p.pack((P[0], P[1], *(P[2:] if p.fp4 else (P[1], P[1])), y.data_ptr()))
    p.k.launch(p.grid, _raw_stream(p.dev), _options().pdl)
    return y


def _qknrc_plan(qkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache,
                slot_mapping, nq, nkv, k_scale, v_scale) -> _Plan:  # fmt: skip
    """qk_norm_rope_cache's checks, all of them, and its plan."""
    m, dev = _x(qkv, "qkv", (nq + 2 * nkv) * HEAD_DIM)
    rope_, kv, consts = _epilogue(
        m, nkv, dev, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache,
        slot_mapping, k_scale, v_scale,
    )  # fmt: skip
    k = _launcher(dev, "qk_norm_rope_cache", (rope_, kv), lambda: abi.qk_norm_rope_cache_spec(rope_, kv))
    names = ("qkv", "q_norm_weight", "k_norm_weight", "cos_sin_cache", "positions", "k_cache", "v_cache",
             "slot_mapping", "k_scale", "v_scale", "q", "qk_eps")  # fmt: skip
    p = _Plan(dev=dev, m=m, grid=nq + 2 * nkv, k=k,
              pack=k.packer(names, dict(consts, num_q_heads=nq, num_kv_heads=nkv)),
              like=torch.empty(1, 1, dtype=_BF16, device=qkv.device).expand(m, nq * HEAD_DIM))  # fmt: skip
    _head_plan(p, m, dev, rope_, kv, consts, k_cache, v_cache, nkv)
    return p


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
    qe, opts, rope = _eps("qk_eps", qk_eps), _options(), cos_sin_cache is not None
    ts = (qkv, q_norm_weight, k_norm_weight, cos_sin_cache if rope else _N[3], positions, k_cache, v_cache,
          slot_mapping)  # fmt: skip
    if k_scale is not None or v_scale is not None:  # (absent, they cost the plan's guard nothing)
        ts += (_N[4] if k_scale is None else k_scale, _N[5] if v_scale is None else v_scale)

    args = (qkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache,
            slot_mapping, nq, nkv, k_scale, v_scale)  # fmt: skip
    p = _plan(("qknrc", nq, nkv, rope, k_scale is None, v_scale is None), ts, _qknrc_plan, args)
    P = tuple(map(_data_ptr, ts))
    if (P[0] | P[1] | P[2] | P[3]) & 15 or (P[4] | P[7]) & 7 or len(P) > 8 and (P[8] | P[9]) & 3:
        _misaligned(_qknrc_plan, args)
    if (p.placeholder or opts.bounds_check or P[6] - P[5] not in p.deltas
            or p.fp8 and not _scales_seen(k_scale, v_scale)):  # fmt: skip
        _per_call(p, P, 5, rope, cos_sin_cache, k_cache, v_cache, k_scale, v_scale, positions, slot_mapping,
                  opts.bounds_check)  # fmt: skip
    cs = P[3] if rope else p.no_rope
    ks, vs = (P[8], P[9]) if p.fp8 else (cs, cs)
    q = torch.empty_like(p.like)
    p.pack((P[0], P[1], P[2], cs, P[4], P[5], P[6], P[7], ks, vs, q.data_ptr(), qe))
    p.k.launch(p.grid, _raw_stream(p.dev), opts.pdl)
    return q

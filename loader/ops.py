"""The public ops (docs/api.md §3-§6). A call gathers its tensors in the op's order (the tuple named beside
each op), finds the plan its tensors' metadata selects (loader.plans) or builds one with every check
(loader.checks), re-checks what depends on pointers and values, allocates its outputs and runs the plan's
kernels, which take their parameters by name from the call's values: its distinct tensors' data pointers,
then its outputs and scalars (loader.runtime.Launcher.bind). Bad arguments raise TypeError / ValueError,
a variant the bundle lacks LookupError, before anything is launched or written."""

from __future__ import annotations

from operator import and_

import torch
from torch import Tensor

from loader import abi, checks, plans, runtime
from loader.abi import HEAD_DIM
from loader.bundle import BundleError
from loader.checks import BF16, F32, HEAD_SHAPE, I32_MAX, I64
from loader.manifest import ManifestError

# torch's current stream of a device as a raw handle (0.1 µs; torch.cuda.current_stream costs ~5 µs)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda d: torch.cuda.current_stream(d).cuda_stream
)
_compiling = torch.compiler.is_compiling
_options = runtime._options.get  # this thread's LaunchOptions
_data_ptr = Tensor.data_ptr
_plan = plans.get
_launcher = runtime.launcher  # (tests replace it)


def _rows(x) -> int:
    """M of a call, for its plan key (0 when x is not a tensor of rows: the full checks say what is wrong)."""
    try:
        return x.shape[0]
    except (AttributeError, IndexError, TypeError):
        return 0


def _misaligned(p: plans.Plan, ts: tuple) -> None:
    checks.aligned(p.names, ts, [mask + 1 for mask in p.masks])  # a data pointer is misaligned: names it
    raise AssertionError("a misaligned data pointer passed the checks")


def _also(renames: dict, **params) -> dict:
    """renames (the call's repeated roles) plus a kernel's own: parameter -> the call's value of that name."""
    return {**renames, **{p: renames.get(name, name) for p, name in params.items()}}


_OUT: dict = {}  # (device, m, n) -> an [m, n] bf16 view without memory: torch.empty_like of it allocates


def _out(x: Tensor, dev: int, m: int, n: int) -> Tensor:
    """The view with an op's output shape, dtype and device (x's), kept per shape: no tensor op per plan."""
    t = _OUT.get(key := (dev, m, n))
    if t is None:
        t = _OUT[key] = torch.empty(1, 1, dtype=BF16, device=x.device).expand(m, n)
    return t


# ----------------------------------------------------------------------------- input norm
_NORM = ("x", "residual", "weight")  # the tensors of a norm call, in the op's order
_NORM_VALUES = ("residual_out", "xn", "eps")  # its other values, after the tensors' data pointers


def _buildable(op: str, kind: str, k: int) -> None:
    """A hidden size no bundle can hold (loader.abi.hidden_refusal) is a LookupError saying so, instead of the
    lookup's advice to add it to the config and rebuild."""
    why = abi.hidden_refusal(kind, k)
    if why is not None:
        raise LookupError(f"{op}: x has {k} columns, a hidden size flint-aot cannot build {kind} kernels for "
                          f"(accepted: {why}); no bundle has them")  # fmt: skip


def _norm_launcher(dev: int, has_res: bool, k: int):
    return _launcher(dev, "norm", (has_res, k), lambda: abi.norm_spec(has_res, k))


def _xn_layout(strides: tuple[int, int, int], pairs: int = 0) -> dict:
    """The norm kernel's xn layout (loader.abi.xn_strides, loader.abi.xn_pairs) as its parameters."""
    return dict(zip(("xn_group", "xn_row", "xn_quarter"), strides, strict=True)) | {"xn_pairs": pairs}


def _token_limit(kind: str) -> tuple[int, str]:
    """An unfused op's limit on M (the bundle's max_tokens of its kind) and its name, for the checks; without
    a readable bundle the default (the kernel lookup after the checks then says what is wrong with it)."""
    try:
        limit = runtime.current_bundle().max_tokens(kind)
    except (BundleError, ManifestError):
        limit = abi.MAX_TOKENS
    return limit, f"the bundle's {kind}.max_tokens"


def _norm_plan(names, renames, args, has_res) -> plans.Plan:
    x, residual, weight = args
    m, dev = checks.activations(x, "x", None, *_token_limit("norm"))
    k = x.shape[1]
    if has_res:
        checks.tensor("residual", residual, BF16, checks.rows(m, k), dev)
    checks.tensor("weight", weight, BF16, checks.hidden(k), dev)
    _buildable("fused_add_rms_norm" if has_res else "rms_norm", "norm", k)
    p = plans.Plan(dev, (), names=names)
    consts = _xn_layout(abi.row_major(k)) | ({} if has_res else {"residual": 0})  # (without: it reads none)
    plans.bind(p, names + _NORM_VALUES, [(_norm_launcher(dev, has_res, k), {"M": m}, consts, renames)])
    return p


def _norm(x, residual, weight, eps) -> tuple[Tensor, Tensor]:
    e, args = checks.eps("eps", eps), (x, residual, weight)
    key = ("norm", _rows(x), residual is None)
    p, ts = _plan(key, _NORM, args, _norm_plan, args, residual is not None)
    P = tuple(map(_data_ptr, ts))
    if any(map(and_, P, p.masks)):
        _misaligned(p, ts)
    xn = torch.empty_like(x)
    res_out = x if residual is None else torch.empty_like(x)
    p.launches[0](P + (res_out.data_ptr(), xn.data_ptr(), e), _raw_stream(p.dev), _options().pdl)
    return xn, res_out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """xn = bf16(bf16(x * rsqrt(mean(x²) + eps)) * weight) for x bf16 [M, K] (K a hidden size of the bundle),
    1 <= M <= the bundle's norm.max_tokens (16384 by default; docs/api.md §4)."""
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


# ----------------------------------------------------------------------------- the per-head stage
def _no_rope(dev: int) -> Tensor:
    t = checks.NO_ROPE.get(dev)
    if t is None:
        t = checks.NO_ROPE[dev] = torch.zeros(1, HEAD_DIM, dtype=F32, device=torch.device("cuda", dev))
    return t


def no_rope_table(device) -> Tensor:
    """The placeholder fp32 table that kernels built without RoPE receive (zeros [1, 128]). Not a valid
    `cos_sin_cache`: pass None for no RoPE (docs/api.md §8)."""
    device = torch.device(device)
    return _no_rope(device.index if device.index is not None else torch.cuda.current_device())


def _stage(m, nkv, dev, q_norm_weight, k_norm_weight, cos_sin_cache, positions, k_cache, v_cache,
           slot_mapping, k_scale, v_scale) -> tuple[str, dict, plans.Stage]:  # fmt: skip
    """Checks the per-head stage's arguments (flint_qkv_fused, qk_norm_rope_cache): (cache dtype, the kernel
    arguments that follow from the tensors' metadata, the plan's Stage). Both q/k norm weights None: no q/k
    norm (the kernels built with qk_norm false)."""
    max_pos, rope = 1, cos_sin_cache is not None
    if rope:
        s = cos_sin_cache.shape if isinstance(cos_sin_cache, Tensor) else ()
        max_pos = s[0] if len(s) == 2 else 0
        if not 1 <= max_pos <= I32_MAX:
            raise ValueError("cos_sin_cache must be None or fp32 [max_pos, 128] with 1 <= max_pos < 2**31")
        checks.tensor("cos_sin_cache", cos_sin_cache, F32, (max_pos, HEAD_DIM), dev)
        checks.placeholder(cos_sin_cache, dev)
    s = slot_mapping.shape if isinstance(slot_mapping, Tensor) else ()
    if len(s) != 1 or s[0] > m:
        raise ValueError(f"slot_mapping must be a 1-D int64 tensor of at most M = {m} entries")
    kv, geometry = checks.caches(k_cache, v_cache, nkv, dev)
    if kv == "bf16":
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale and v_scale are for FP8 caches only: pass None with a bf16 cache")
    else:
        if k_scale is None or v_scale is None:
            raise ValueError(f"an FP8 cache ({k_cache.dtype}) needs k_scale and v_scale (one-element fp32 "
                             "tensors)")  # fmt: skip
        checks.scalar("k_scale", k_scale, dev)
        checks.scalar("v_scale", v_scale, dev)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight must both be tensors (q/k norm) or both None "
                         "(no q/k norm)")  # fmt: skip
    if q_norm_weight is not None:
        checks.tensor("q_norm_weight", q_norm_weight, BF16, HEAD_SHAPE, dev)
        checks.tensor("k_norm_weight", k_norm_weight, BF16, HEAD_SHAPE, dev)
    checks.tensor("positions", positions, I64, checks.tokens(m), dev)
    checks.tensor("slot_mapping", slot_mapping, I64, s, dev)
    if kv != "bf16":  # the values last: reading them is the first CUDA call
        checks.kv_scale("k_scale", k_scale, dev, False)
        checks.kv_scale("v_scale", v_scale, dev, False)
    nb, bs, _, st = geometry
    consts = dict(m=m, num_slot_mapping=s[0], max_pos=max_pos, block_size=bs, num_cache_slots=nb * bs,
                  stride_block=st[0], stride_slot=st[1], stride_head=st[2])  # fmt: skip
    if not rope:
        consts["cos_sin_cache"] = _no_rope(dev).data_ptr()
    if kv == "bf16":
        consts.update(k_scale=0, v_scale=0)  # (a BF16-cache kernel reads no scale)
    if q_norm_weight is None:
        consts.update(q_norm_weight=0, k_norm_weight=0)  # (a kernel without q/k norm reads none)
    stage = plans.Stage(dev, geometry, {v_cache.data_ptr() - k_cache.data_ptr()}, kv != "bf16", rope,
                        max_pos, nb * bs, rope and max_pos == 1)  # fmt: skip
    return kv, consts, stage


# ----------------------------------------------------------------------------- fused qkv
_QKV = ("x", "residual", "norm_weight", "weight", "weight_scale", "global_scale", "q_norm_weight",
        "k_norm_weight", "cos_sin_cache", "positions", "k_cache", "v_cache", "slot_mapping", "k_scale",
        "v_scale")  # the tensors of a flint_qkv_fused call, in the op's order  # fmt: skip
_QKV_VALUES = ("q", "residual_out", "xn", "eps", "qk_eps")  # its other values, after the tensors' pointers
# Unless asked for one, the design that costs least where the call is: eagerly, the host's work per call
# (prologue: one launch, no xn; at M = 16 its GPU time, 14-19 us per layer, is about the host time of an
# eager call, and the two-kernel design's is 7-11 us for ~5 us more host time); in a CUDA graph, only the
# GPU's (separate; docs/benchmarks-history.md §1 and §4; measured again at M = 1..64 with the token stream:
# BENCHMARKS.md §4). The two give bit-identical results; a design the bundle lacks falls back to the other.
_EAGER, _GRAPH = ("prologue", "separate"), ("separate", "prologue")
_PREFER = {None: _EAGER, "separate": ("separate",), "prologue": ("prologue",)}  # by launch_options' design


def _qkv_specs(m, fmt, rope, nq, nkv, kv, prefer, hidden, qk_norm) -> list[dict]:
    """The qkv specs that serve a call, in order of preference: the designs of `prefer`, each with the token
    tiles that hold m, the smallest first."""
    return [abi.qkv_spec(fmt, rope, nq, nkv, kv, d, t, hidden, qk_norm) for d in prefer
            for t in abi.m_tiles(m)]  # fmt: skip


def _qkv_plan(names, renames, args, nq, nkv, prefer) -> plans.Plan:
    x, residual, norm_weight, weight, weight_scale, global_scale, *head = args
    m, dev = checks.activations(x)
    hid, qkn = x.shape[1], head[0] is not None  # (head[0]: q_norm_weight)
    fmt, n = checks.weight(weight, weight_scale, global_scale, dev, (nq + 2 * nkv) * HEAD_DIM, hid)
    has_res = residual is not None
    if has_res:
        checks.tensor("residual", residual, BF16, checks.rows(m, hid), dev)
    checks.tensor("norm_weight", norm_weight, BF16, checks.hidden(hid), dev)
    kv, consts, stage = _stage(m, nkv, dev, *head)
    _buildable("flint_qkv_fused", "qkv", hid)
    if fmt == "bf16":
        consts.update(weight_scale=0, global_scale=0)  # (a BF16 kernel reads no scale)
    symbols, tile = {"M": m, "ROW_BLOCKS": n // abi.ROWS_PER_CTA, "HEADS": nq + 2 * nkv}, abi.m_tiles(m)[0]
    k = _launcher(dev, "qkv", (fmt, stage.rope, nq, nkv, kv, prefer, tile, hid, qkn),
                  lambda: _qkv_specs(m, fmt, stage.rope, nq, nkv, kv, prefer, hid, qkn))  # fmt: skip
    p = plans.Plan(dev, (), out=_out(x, dev, m, nq * HEAD_DIM), stage=stage, names=names)
    if k.entry.spec["norm"] == "prologue":  # one kernel, the input norm in its prologue
        c = dict(consts, has_residual=int(has_res), **({} if has_res else {"residual": 0}))
        launches = [(k, symbols, c, renames)]
    else:  # the norm kernel writes xn, which the qkv kernel reads as x, in the layout it reads
        strides = abi.xn_strides(k.entry.spec)  # (the token stream's: its ring layout or wgmma tiles)
        p.xn = abi.xn_numel(m, strides)
        c = dict(consts, residual=0, residual_out=0, norm_weight=0, has_residual=0, eps=0.0)
        nc = _xn_layout(strides, abi.xn_pairs(k.entry.spec)) | ({} if has_res else {"residual": 0})
        norm = (_norm_launcher(dev, has_res, hid), symbols, nc, _also(renames, weight="norm_weight"))
        launches = [norm, (k, symbols, c, _also(renames, x="xn"))]
    plans.bind(p, names + _QKV_VALUES, launches)
    if prefer is _EAGER:  # a capture would run the other design (loaded at the first capture)
        graph = runtime.entry(dev, "qkv", (fmt, stage.rope, nq, nkv, kv, _GRAPH, tile, hid, qkn),
                              lambda: _qkv_specs(m, fmt, stage.rope, nq, nkv, kv, _GRAPH, hid,
                                                 qkn))  # fmt: skip
        p.graph = graph is not k.entry
    return p


def flint_qkv_fused(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor,
                    weight_scale: Tensor | None, global_scale: Tensor | None,
                    q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, qk_eps: float,
                    cos_sin_cache: Tensor | None, positions: Tensor, k_cache: Tensor, v_cache: Tensor,
                    slot_mapping: Tensor, num_q_heads: int, num_kv_heads: int, *,
                    k_scale: Tensor | None = None,
                    v_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Residual-add RMSNorm + qkv GEMV + q/k RMSNorm, NeoX RoPE, paged KV-cache write, 1 <= M <= MAX_M tokens
    of hidden size K = x.shape[1] (docs/api.md §3, numerics: docs/numerics.md); q_norm_weight and
    k_norm_weight None: no q/k norm (Llama). Returns (q bf16 [M, num_q_heads * 128], residual_out bf16
    [M, K]; x itself when residual is None). An FP8 cache needs k_scale and v_scale. A position outside
    cos_sin_cache gives NaN q/k for that token, a slot outside the cache is not written (docs/api.md §9:
    checked mode raises). PDL (docs/api.md §14): the weights, their scales and the norm weights may be read
    before the kernel waits for its predecessor, which must not write them."""
    if _compiling():
        q, r = torch.ops.flint.qkv_fused(
            x, residual, norm_weight, eps, weight, weight_scale, global_scale, q_norm_weight, k_norm_weight,
            qk_eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        return q, (x if residual is None else r)  # (the op never aliases an input)
    nq, nkv = checks.heads(num_q_heads, num_kv_heads)
    e, qe, opts = checks.eps("eps", eps), checks.eps("qk_eps", qk_eps), _options()
    args = (x, residual, norm_weight, weight, weight_scale, global_scale, q_norm_weight, k_norm_weight,
            cos_sin_cache, positions, k_cache, v_cache, slot_mapping, k_scale, v_scale)  # _QKV  # fmt: skip
    key = ("qkv", _rows(x), nq, nkv, residual is None, weight_scale is None, global_scale is None,
           q_norm_weight is None, k_norm_weight is None, cos_sin_cache is None, k_scale is None,
           v_scale is None, _PREFER[opts.design])  # fmt: skip
    p, ts = _plan(key, _QKV, args, _qkv_plan, args, nq, nkv, key[-1])
    if p.graph and torch.cuda.is_current_stream_capturing():  # the design for CUDA graphs
        key = (*key[:-1], _GRAPH)
        p, ts = _plan(key, _QKV, args, _qkv_plan, args, nq, nkv, _GRAPH)
    P = tuple(map(_data_ptr, ts))
    if any(map(and_, P, p.masks)):
        _misaligned(p, ts)
    s = p.stage
    if (s.placeholder or opts.bounds_check or v_cache.data_ptr() - k_cache.data_ptr() not in s.deltas
            or s.fp8 and not checks.scales_seen(k_scale, v_scale)):  # fmt: skip
        s.recheck(k_cache, v_cache, cos_sin_cache, k_scale, v_scale, positions, slot_mapping,
                  opts.bounds_check)  # fmt: skip
    q = torch.empty_like(p.out)
    res_out = x if residual is None else torch.empty_like(x)
    xn = x.new_empty(p.xn) if p.xn else q  # (held until both kernels are launched: freed earlier, another
    values = P + (q.data_ptr(), res_out.data_ptr(), xn.data_ptr(), e, qe)  # thread could take its block)
    stream, pdl = _raw_stream(p.dev), opts.pdl
    for run in p.launches:
        run(values, stream, pdl)
    return q, res_out


# ----------------------------------------------------------------------------- the unfused path
_GEMV = ("x", "weight", "weight_scale", "global_scale")  # the tensors of a gemv call, in the op's order


def _gemv_plan(names, renames, args) -> plans.Plan:
    x, weight, weight_scale, global_scale = args
    m, dev = checks.activations(x)
    hid = x.shape[1]
    fmt, n = checks.weight(weight, weight_scale, global_scale, dev, None, hid)
    _buildable("gemv", "gemv", hid)
    tiles = abi.m_tiles(m)
    k = _launcher(dev, "gemv", (fmt, tiles[0], hid), lambda: [abi.gemv_spec(fmt, t, hid) for t in tiles])
    p = plans.Plan(dev, (), out=_out(x, dev, m, n), names=names)
    consts = dict(m=m, n=n, **({"weight_scale": 0, "global_scale": 0} if fmt == "bf16" else {}))
    rb, c = n // abi.ROWS_PER_CTA, abi.STREAM_CLUSTER_GEMV  # (ROW_BLOCKS_4: to the stream's cluster)
    plans.bind(p, names + ("y",), [(k, {"M": m, "ROW_BLOCKS": rb, "ROW_BLOCKS_4": -(-rb // c) * c}, consts,
                                    renames)])  # fmt: skip
    return p


def gemv(x: Tensor, weight: Tensor, weight_scale: Tensor | None = None,
         global_scale: Tensor | None = None) -> Tensor:  # fmt: skip
    """y = bf16(x · Wᵀ) for x bf16 [M, K] (1 <= M <= MAX_M, K a hidden size of the bundle) and W BF16 [N, K]
    or NVFP4 (uint8 [N, K / 2], e4m3/uint8 128x4-swizzled scales [ceil(N/128)*128, K / 16], fp32 global
    scale of one element), N a multiple of 16 up to loader.abi.max_gemv_rows(K). Bit-identical to the fused
    kernel's qkv values (docs/numerics.md §2). Returns a new bf16 [M, N] tensor (docs/api.md §5)."""
    if _compiling():
        return torch.ops.flint.gemv(x, weight, weight_scale, global_scale)
    args = (x, weight, weight_scale, global_scale)
    key = ("gemv", _rows(x), weight_scale is None, global_scale is None)
    p, ts = _plan(key, _GEMV, args, _gemv_plan, args)
    P = tuple(map(_data_ptr, ts))
    if any(map(and_, P, p.masks)):
        _misaligned(p, ts)
    y = torch.empty_like(p.out)
    p.launches[0](P + (y.data_ptr(),), _raw_stream(p.dev), _options().pdl)
    return y


_QKNRC = ("qkv", "q_norm_weight", "k_norm_weight", "cos_sin_cache", "positions", "k_cache", "v_cache",
          "slot_mapping", "k_scale", "v_scale")  # the tensors of a qk_norm_rope_cache call, in the op's order


def _qknrc_plan(names, renames, args, nq, nkv) -> plans.Plan:
    qkv, *head = args
    cols, limit = (nq + 2 * nkv) * HEAD_DIM, _token_limit("qk_norm_rope_cache")
    m, dev = checks.activations(qkv, "qkv", cols, *limit)
    kv, consts, stage = _stage(m, nkv, dev, *head)
    rope, qkn = stage.rope, head[0] is not None  # (head[0]: q_norm_weight)
    k = _launcher(dev, "qk_norm_rope_cache", (rope, kv, qkn),
                  lambda: abi.qk_norm_rope_cache_spec(rope, kv, qkn))  # fmt: skip
    p = plans.Plan(dev, (), out=_out(qkv, dev, m, nq * HEAD_DIM), stage=stage, names=names)
    consts.update(num_q_heads=nq, num_kv_heads=nkv)
    symbols = {"M": m, "HEADS": nq + 2 * nkv, "HEAD_BLOCKS": -(-(nq + 2 * nkv) // abi.QKNRC_HEADS),
               "TOKEN_BLOCKS": -(-m // abi.QKNRC_TOKENS)}  # fmt: skip
    plans.bind(p, names + ("q", "qk_eps"), [(k, symbols, consts, renames)])
    return p


def qk_norm_rope_cache(qkv: Tensor, q_norm_weight: Tensor | None, k_norm_weight: Tensor | None,
                       qk_eps: float, cos_sin_cache: Tensor | None, positions: Tensor, k_cache: Tensor,
                       v_cache: Tensor, slot_mapping: Tensor, num_q_heads: int, num_kv_heads: int, *,
                       k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:  # fmt: skip
    """docs/numerics.md §3-§4 on a bf16 qkv [M, (num_q_heads + 2 num_kv_heads) * 128]: per-head q/k RMSNorm,
    NeoX RoPE (cos_sin_cache None = none; both norm weights None = no q/k norm), k and v written to the
    paged (BF16 or FP8) cache at slot_mapping (same rules and memory safety as flint_qkv_fused). Returns q
    bf16 [M, num_q_heads * 128] (docs/api.md §6)."""
    if _compiling():
        return torch.ops.flint.qk_norm_rope_cache(
            qkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache,
            slot_mapping, num_q_heads, num_kv_heads, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    nq, nkv = checks.heads(num_q_heads, num_kv_heads)
    qe, opts = checks.eps("qk_eps", qk_eps), _options()
    args = (qkv, q_norm_weight, k_norm_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
            k_scale, v_scale)  # _QKNRC  # fmt: skip
    key = ("qknrc", _rows(qkv), nq, nkv, q_norm_weight is None, k_norm_weight is None, cos_sin_cache is None,
           k_scale is None, v_scale is None)  # fmt: skip
    p, ts = _plan(key, _QKNRC, args, _qknrc_plan, args, nq, nkv)
    P = tuple(map(_data_ptr, ts))
    if any(map(and_, P, p.masks)):
        _misaligned(p, ts)
    s = p.stage
    if (s.placeholder or opts.bounds_check or v_cache.data_ptr() - k_cache.data_ptr() not in s.deltas
            or s.fp8 and not checks.scales_seen(k_scale, v_scale)):  # fmt: skip
        s.recheck(k_cache, v_cache, cos_sin_cache, k_scale, v_scale, positions, slot_mapping,
                  opts.bounds_check)  # fmt: skip
    q = torch.empty_like(p.out)
    p.launches[0](P + (q.data_ptr(), qe), _raw_stream(p.dev), opts.pdl)
    return q

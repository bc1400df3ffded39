"""The fused qkv kernel (docs/kernels.md §2-§3): qkv GEMV + per-head q/k RMSNorm + NeoX RoPE + paged KV-cache
write, and in the prologue design the input RMSNorm too.

Grid: one CTA of 128 threads per 16 weight rows; the 8 CTAs of one head (128 rows) form a cluster (8,1,1).
Each CTA
1. releases its own PDL dependents, initialises its mbarriers, arrives on the cluster barrier, issues its
   whole weight slice (BF16: 64 KiB into registers; NVFP4: codes + scales, and 3/4 of the decode), and only
   then waits (griddepcontrol.wait) for the kernel before it: the weight stream overlaps that kernel;
2. gets the activations of every token into its shared memory, 1/8 of them (k in [256 r, 256 r + 256),
   rank r) from each CTA of the cluster, so that they are read from L2 once per cluster, not once per CTA.
   The threads that fetch them wait for the predecessor themselves; with BF16 weights they start as soon
   as the weight loads are issued (before step 1's wait, while the weights still arrive), with NVFP4
   after it;
   - separate design: the activations are xn, written by the norm kernel before it: one multicast bulk
     copy per token into all 8 CTAs;
   - prologue design: the input RMSNorm split over the cluster. Rank r reads slice r of x and the
     residual of every token (one warp per token: exactly the norm kernel's warp r), sends r = bf16(x +
     residual) and the slice's sum of squares to its 7 peers (st.async), and once every slice is in,
     each CTA adds the 8 sums in warp order and turns r into xn (device.norm_*: the norm kernel's
     arithmetic and order, so xn is bit-identical); the 8 CTAs of the first head write residual_out;
3. computes its 16 rows for all tokens (gemv_core: fragment math, K split, summation order) and rounds them
   to bf16;
4. v head: writes its rows to the paged cache. q/k head: sends its per-token partial sums of squares to
   every CTA of the head and its rows to its RoPE partner (rank ^ 4) with st.async on their mbarriers,
   then applies the RMSNorm (fp32, sums in rank order: the same in all 8 CTAs), NeoX RoPE from the fp32
   cos|sin table (or none) and one bf16 rounding to its own 16 dims, and stores q or writes k. An FP8 cache
   gets e4m3(value / scale) of the same bf16 values (device.store_cache).

One parameter list serves both designs: a separate build reads its activations from `x` (the loader passes
xn there) and ignores residual, residual_out, norm_weight, has_residual and eps.

Memory safety (docs/api.md §6): a position outside [0, max_pos) reads row 0 of the table and turns that
token's q/k head into NaN; a slot >= num_cache_slots is not written (like a negative slot).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot.kernels import device
from flint_aot.kernels import gemv_core as core
from flint_aot.kernels.compile import compile_kernel
from flint_aot.kernels.device import NORM_VEC
from loader.abi import CLUSTER, HALF_DIM, HEAD_DIM, MAX_M

R = core.ROWS
K_PART = core.K // CLUSTER  # activations each CTA of a cluster copies for all 8


def smem_row(fp4: bool) -> int:
    """Row stride (elements) of the activations in shared memory, padded against bank conflicts."""
    return core.K + (8 if fp4 else 32)


def make_kernel(weight_format: str, rope: bool, nq: int, nkv: int, fp8: bool, prologue: bool):
    assert weight_format in ("bf16", "nvfp4"), weight_format
    fp4 = weight_format == "nvfp4"
    xrow = smem_row(fp4)
    # bytes each CTA of a q/k head receives over DSMEM: the 8 ranks' per-token sums of squares, and
    # (RoPE) the 16 x 8 values of its rotation partner (rank ^ 4), as fp32
    rx_bytes = CLUSTER * MAX_M * 4 + (R * MAX_M * 4 if rope else 0)

    @cute.kernel
    def qkv(
        x: cute.Pointer, residual: cute.Pointer, residual_out: cute.Pointer, norm_weight: cute.Pointer,
        weight: cute.Pointer, weight_scale: cute.Pointer, global_scale: cute.Pointer,
        q_norm_weight: cute.Pointer, k_norm_weight: cute.Pointer, cos_sin_cache: cute.Pointer,
        positions: cute.Pointer, slot_mapping: cute.Pointer, q: cute.Pointer, k_cache: cute.Pointer,
        v_cache: cute.Pointer, k_scale: cute.Pointer, v_scale: cute.Pointer,
        m: Int32, has_residual: Int32, num_slot_mapping: Int32, max_pos: Int32, block_size: Int32,
        num_cache_slots: Int64, stride_block: Int64, stride_slot: Int64, stride_head: Int64,
        eps: Float32, qk_eps: Float32,
    ):  # fmt: skip
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        head = cta // CLUSTER  # uniform over the cluster
        rank = cute.arch.block_idx_in_cluster()
        is_v = head >= nq + nkv
        r = tid % R  # after reduce_rows: this thread's row (within the CTA) and token
        tk = tid // R
        dim = rank * R + r
        ssq = cute.arch.alloc_smem(Float32, CLUSTER * MAX_M, alignment=16)  # [src rank][token]
        pv = cute.arch.alloc_smem(Float32, R * MAX_M, alignment=16)  # partner rows [row][token]
        mbar = cute.arch.alloc_smem(Int64, 1, alignment=8)
        # The activations arrive on mbx: the cluster's multicast copies (separate design) or the peers' slices
        # of r and sums of squares (prologue design; ssn: [src rank][token], apart from ssq, which a peer
        # ahead of this CTA may already be writing). q/k heads also receive their peers' st.async on mbar.
        # Both are initialised now, before this CTA arrives on the cluster barrier; the wait comes before
        # anyone targets a peer.
        xs = cute.arch.alloc_smem(BFloat16, MAX_M * xrow, alignment=128)
        ssn = ssq
        if cutlass.const_expr(prologue):
            ssn = cute.arch.alloc_smem(Float32, CLUSTER * MAX_M, alignment=16)
        mbx = cute.arch.alloc_smem(Int64, 1, alignment=8)
        if tid == 0:
            cute.arch.mbarrier_init(mbx, 1)
            if not is_v:
                cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_warp()  # orders the inits before the arrives for racecheck (same thread anyway)
        if tid == 0:
            act_bytes = m * (core.K * 2)  # the multicast copies of x
            if cutlass.const_expr(prologue):  # the 7 peers' slices of r and the 8 slices' sums of squares
                act_bytes = m * ((CLUSTER - 1) * K_PART * 2 + CLUSTER * 4)
            cute.arch.mbarrier_arrive_and_expect_tx(mbx, act_bytes)
            if not is_v:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, rx_bytes)
        cute.arch.cluster_arrive_relaxed()
        # q/k norm weights of this thread's dim and of its rotation partner (model constants)
        qw = cute.make_tensor(q_norm_weight, cute.make_layout(HEAD_DIM))
        kw = cute.make_tensor(k_norm_weight, cute.make_layout(HEAD_DIM))
        wn = Float32(cutlass.select_(head < nq, qw[dim].to(Float32), kw[dim].to(Float32)))
        wp = Float32(
            cutlass.select_(head < nq, qw[dim ^ HALF_DIM].to(Float32), kw[dim ^ HALF_DIM].to(Float32))
        )

        # ---- the weight stream, issued before griddepcontrol.wait (which follows it)
        # BF16: the activations are fetched as soon as the weight loads are issued (by threads that wait for
        # the predecessor themselves), NVFP4 after the guarded wait: a waiting thread's warp cannot decode
        # (measured, two-kernel design: BF16 up to 0.17 us per layer faster, NVFP4 0.1-0.35 slower that way)
        def copy():
            if cutlass.const_expr(prologue):
                norm_slices(xs, xrow, ssn, x, residual, residual_out, m, has_residual, tid, head, rank, mbx)
            else:
                copy_activations(tid, m, rank, xs, x, mbx, xrow)

        wst = core.weights_then_wait(fp4, weight, weight_scale, global_scale, cta * R, tid, m,
                                     core.FP4_PRE_QKV, issued=None if fp4 else copy)  # fmt: skip
        if cutlass.const_expr(fp4):
            copy()
        # per-token inputs of the epilogue, issued now so their latency hides under the GEMV
        slot = Int64(-1)
        if tk < num_slot_mapping:
            slot = cute.make_tensor(slot_mapping, cute.make_layout(MAX_M))[tk]
        c = Float32(1.0)
        sn = Float32(0.0)
        ok = True
        if cutlass.const_expr(rope):
            p = cute.make_tensor(positions, cute.make_layout(MAX_M))[cutlass.min(tk, m - 1)]
            ok, c, sn = device.rope_coeffs(cos_sin_cache, p, max_pos, dim)
        scale = Float32(1.0)
        if cutlass.const_expr(fp8):
            scale = Float32(cutlass.select_(is_v, device.at(v_scale, 0)[0], device.at(k_scale, 0)[0]))

        if cutlass.const_expr(prologue):
            input_norm(xs, xrow, ssn, norm_weight, m, eps, tid, mbx)

        acc = core.row_sums(fp4, wst, core.SharedX(xs, xrow, mbx), m, tid)
        h = acc.to(BFloat16)  # qkv[tk, head * 128 + dim], rounded once

        geom = (num_cache_slots, block_size, stride_block, stride_slot, stride_head)
        if is_v:
            if tk < m:
                device.store_cache(v_cache, slot, *geom, head - (nq + nkv), dim, h, fp8, scale)
        else:
            hv = h.to(Float32)
            part = hv * hv  # this CTA's 16 dims of token tk: a 16-lane butterfly (same sum in every lane)
            for o in (1, 2, 4, 8):
                part = part + cute.arch.shuffle_sync_bfly(part, o)
            if r < CLUSTER:  # lane r sends the partial to rank r
                cute.arch.store_async_dsmem(ssq + (rank * MAX_M + tk), device.f32_bits(part), mbar, r)
            if cutlass.const_expr(rope):
                cute.arch.store_async_dsmem(
                    pv + (r * MAX_M + tk), device.f32_bits(hv), mbar, rank ^ (CLUSTER // 2)
                )
            cute.arch.mbarrier_wait(mbar, 0)
            st = cute.make_tensor(ssq, cute.make_layout(CLUSTER * MAX_M))
            tot = st[tk]
            for j in range(1, CLUSTER):  # rank order: the same sum in every CTA of the head
                tot = tot + st[j * MAX_M + tk]
            inv = cute.math.rsqrt(tot * Float32(1.0 / HEAD_DIM) + qk_eps)
            y = hv * inv * wn
            if cutlass.const_expr(rope):
                yp = cute.make_tensor(pv, cute.make_layout(R * MAX_M))[r * MAX_M + tk] * inv * wp
                y = device.rotate(y, yp, ok, c, sn, dim)
            yb = y.to(BFloat16)
            if tk < m:
                if head < nq:
                    device.at(q, tk * (nq * HEAD_DIM) + head * HEAD_DIM + dim)[0] = yb
                else:
                    device.store_cache(k_cache, slot, *geom, head - nq, dim, yb, fp8, scale)

    return qkv


@cute.jit
def copy_activations(tid, m, rank, xs, x, mbx, xrow: cutlass.Constexpr):
    """Wait on the cluster barrier (every peer's mbarriers are initialised), then threads tid < m wait for
    the predecessor themselves (griddepcontrol.wait: the copies need no weights, which may still be in
    flight) and copy this CTA's 1/8 of token tid's activations into all 8 CTAs."""
    cute.arch.cluster_wait()
    if tid < m:
        cute.arch.griddepcontrol_wait()
        part = rank * K_PART
        device.bulk_multicast(xs + (tid * xrow + part), x + (tid * core.K + part), mbx, K_PART * 2)


@cute.jit
def norm_slices(xs, xrow: cutlass.Constexpr, ssn, x, residual, residual_out, m, has_residual, tid, head, rank,
                mbx):  # fmt: skip
    """The prologue design's input RMSNorm, first half, split over the cluster: once every peer's mbarrier is
    initialised (cluster barrier) and the predecessor is done (each thread waits for it itself), CTA rank r
    computes slice r of every token (k in [256 r, 256 r + 256): exactly the norm kernel's warp r; one warp
    per token here, 8 elements per lane, the same butterfly), keeps r = bf16(x + residual) in its shared
    memory and sends it (st.async) and its warp sum to the 7 peers. The CTAs of the first head write
    residual_out, slice r each."""
    cute.arch.cluster_wait()
    cute.arch.griddepcontrol_wait()
    warp, lane, _, _ = device.lanes(tid)
    col = rank * K_PART + lane * NORM_VEC  # this lane's chunk of the CTA's slice
    for j in range(MAX_M // core.WARPS):  # token warp + 4 j
        t = warp + j * core.WARPS
        if t < m:
            if has_residual != 0:
                norm_slice(xs, xrow, ssn, x, residual, residual_out, t, col, lane, head, rank, mbx, True)
            else:
                norm_slice(xs, xrow, ssn, x, residual, residual_out, t, col, lane, head, rank, mbx, False)


@cute.jit
def input_norm(xs, xrow: cutlass.Constexpr, ssn, norm_weight, m, eps, tid, mbx):
    """The second half, after norm_slices: once the mbarrier has every peer's slice and sum, every CTA holds
    r and the 8 sums of every token, adds the sums in warp order (device.norm_scale) and turns xs into xn.
    The norm kernel's arithmetic and order: xn is bit-identical."""
    chunks = (tid, tid + core.THREADS)
    w = [device.load_vec(norm_weight + v * NORM_VEC, NORM_VEC) for v in chunks]
    cute.arch.mbarrier_wait(mbx, 0)
    cute.arch.sync_threads()  # (this CTA's own slice was written by its threads, not through the mbarrier)
    sn = cute.make_tensor(ssn, cute.make_layout(CLUSTER * MAX_M))
    for i in range(m):
        s = device.norm_scale([sn[j * MAX_M + i] for j in range(CLUSTER)], eps)
        for j, v in enumerate(chunks):
            off = cute.assume(i * xrow + v * NORM_VEC, divby=NORM_VEC)
            r = device.load_vec(xs + off, NORM_VEC).to(Float32)
            device.store_vec(xs + off, device.norm_apply(r, s, w[j]), NORM_VEC)
    cute.arch.sync_threads()


@cute.jit
def norm_slice(xs, xrow: cutlass.Constexpr, ssn, x, residual, residual_out, t, col, lane, head, rank, mbx,
               res: cutlass.Constexpr):  # fmt: skip
    """input_norm's part of one token in one warp: this lane's chunk of r, the warp's sum of squares; r kept
    in xs and sent to the 7 peers, the sum to all 8 (lane d to rank d)."""
    off = cute.assume(t * core.K + col, divby=NORM_VEC)
    if cutlass.const_expr(res):
        rv = device.load_vec(residual + off, NORM_VEC)
    else:  # r = x + (-0.0) = x exactly: the same arithmetic as with a residual
        rv = cute.full((NORM_VEC,), -0.0, BFloat16)
    r, ss = device.norm_residual(device.load_vec(x + off, NORM_VEC), rv)
    ss = cute.arch.warp_reduction_sum(ss)
    rb = r.to(BFloat16)
    if cutlass.const_expr(res):
        if head == 0:
            device.store_vec(residual_out + off, rb, NORM_VEC)
    xo = cute.assume(t * xrow + col, divby=NORM_VEC)
    device.store_vec(xs + xo, rb, NORM_VEC)
    words = device.load_vec(cute.recast_ptr(xs + xo, dtype=Int32), 4)  # (this thread's own store)
    for d in range(1, CLUSTER):
        cute.arch.store_async_dsmem(xs + xo, (words[0], words[1], words[2], words[3]), mbx,
                                    (rank + d) % CLUSTER)  # fmt: skip
    if lane < CLUSTER:  # lane d sends the slice's sum to rank d
        cute.arch.store_async_dsmem(ssn + (rank * MAX_M + t), device.f32_bits(ss), mbx, lane)


def kernel(spec: dict):
    nq, nkv = spec["heads"]
    fp8 = spec.get("kv_cache_dtype", "bf16") == "fp8_e4m3"
    return make_kernel(
        spec["weight_format"], bool(spec["rope"]), nq, nkv, fp8, spec.get("norm") == "prologue"
    )


def ptr_types(spec: dict) -> dict:
    """Element type and assumed alignment (bytes) of the pointers that are not bf16 16-byte aligned."""
    fp4 = spec["weight_format"] == "nvfp4"
    cache = (cutlass.Uint8, 1) if spec.get("kv_cache_dtype", "bf16") == "fp8_e4m3" else (BFloat16, 2)
    return {
        "weight": (cutlass.Uint8 if fp4 else BFloat16, 16), "weight_scale": (cutlass.Uint8, 4),
        "global_scale": (Float32, 4), "cos_sin_cache": (Float32, 16), "positions": (Int64, 8),
        "slot_mapping": (Int64, 8), "k_cache": cache, "v_cache": cache, "k_scale": (Float32, 4),
        "v_scale": (Float32, 4),
    }  # fmt: skip


def compile(spec: dict, arch: str, entry_prefix: str):
    return compile_kernel(kernel(spec), kind="qkv", arch=arch, entry_prefix=entry_prefix,
                          block=(core.THREADS, 1, 1), cluster=(CLUSTER, 1, 1),
                          ptr_types=ptr_types(spec))  # fmt: skip

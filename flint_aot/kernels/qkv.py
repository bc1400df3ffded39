"""The fused qkv kernel (docs/kernels.md §2-§3): qkv GEMV + per-head q/k RMSNorm + NeoX RoPE + paged KV-cache
write, and in the prologue design the input RMSNorm too.

Grid: one CTA of 128 threads per 16 weight rows; the 8 CTAs of one head (128 rows) form a cluster (8,1,1).
Each CTA
1. releases its own PDL dependents, initialises its mbarriers, arrives on the cluster barrier, issues its
   whole weight slice (BF16: 64 KiB into registers; NVFP4: codes + scales, and 3/4 of the decode), and only
   then waits (griddepcontrol.wait) for the kernel before it: the weight stream overlaps that kernel;
2. copies 1/8 of the activations (k in [256 r, 256 r + 256) of every token) with one multicast bulk copy per
   token into all 8 CTAs' shared memory: x is read from L2 once per cluster, not once per CTA. The copying
   threads wait for the predecessor themselves; with BF16 weights they copy as soon as the weight loads are
   issued (before step 1's wait, while the weights still arrive), with NVFP4 after it;
   - separate design: the activations are xn, written by the norm kernel before it;
   - prologue design: they are x (and the residual, into a second buffer), and every CTA then computes the
     input RMSNorm of all tokens in its shared memory (device.norm_*: the norm kernel's arithmetic and
     summation order, so xn is bit-identical); the 8 CTAs of the first head write residual_out, 1/8 each;
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
from flint_aot.kernels.device import NORM_VEC, NORM_WARPS
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
        # The activations are read once per cluster: CTA r copies k in [256 r, 256 r + 256) of every token
        # with a multicast bulk copy into all 8 CTAs' shared memory, completing on mbx. q/k heads also receive
        # their peers' st.async on mbar. Both are initialised now, before this CTA arrives on the cluster
        # barrier; the wait comes before anyone targets a peer.
        xs = cute.arch.alloc_smem(BFloat16, MAX_M * xrow, alignment=128)
        rs = xs
        if cutlass.const_expr(prologue):
            rs = cute.arch.get_dyn_smem(
                BFloat16, alignment=128
            )  # the residual, same layout (> 48 KiB static)
        mbx = cute.arch.alloc_smem(Int64, 1, alignment=8)
        if tid == 0:
            cute.arch.mbarrier_init(mbx, 1)
            if not is_v:
                cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_warp()  # orders the inits before the arrives for racecheck (same thread anyway)
        if tid == 0:
            act_bytes = m * (core.K * 2)
            if cutlass.const_expr(prologue):
                act_bytes = act_bytes * (1 + has_residual)
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
        # BF16: the activations are copied as soon as the weight loads are issued (by threads that wait for
        # the predecessor themselves), NVFP4 after the guarded wait: a copying thread's warp cannot decode
        # while it waits (measured: BF16 up to 0.17 us per layer faster, NVFP4 0.1-0.35 slower that way)
        def copy():
            copy_activations(tid, m, rank, xs, rs, x, residual, mbx, has_residual, xrow, prologue)

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
            input_norm(xs, rs, xrow, residual_out, norm_weight, m, has_residual, eps, tid, cta, mbx)

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
def copy_activations(tid, m, rank, xs, rs, x, residual, mbx, has_residual, xrow: cutlass.Constexpr,
                     prologue: cutlass.Constexpr):  # fmt: skip
    """Wait on the cluster barrier (every peer's mbarriers are initialised), then threads tid < m wait for
    the predecessor themselves (griddepcontrol.wait: the copies need no weights, which may still be in
    flight) and copy this CTA's 1/8 of token tid's activations into all 8 CTAs (the residual too in the
    prologue design)."""
    cute.arch.cluster_wait()
    if tid < m:
        cute.arch.griddepcontrol_wait()
        part = rank * K_PART
        device.bulk_multicast(xs + (tid * xrow + part), x + (tid * core.K + part), mbx, K_PART * 2)
        if cutlass.const_expr(prologue):
            if has_residual != 0:
                device.bulk_multicast(rs + (tid * xrow + part), residual + (tid * core.K + part), mbx,
                                      K_PART * 2)  # fmt: skip


@cute.jit
def input_norm(
    xs, rs, xrow: cutlass.Constexpr, residual_out, norm_weight, m, has_residual, eps, tid, cta, mbx
):
    """The prologue design's input RMSNorm, in shared memory, for all m tokens (x in xs, the residual in rs,
    both brought in by the cluster's multicast copies): xs becomes xn. Thread tid plays the norm kernel's
    threads tid and tid + 128 (8-element chunks; virtual warps w and w + 4), so sums and roundings are those
    of the norm kernel. The CTAs of the first head write residual_out: CTA c the chunks of virtual warp c."""
    chunks = (tid, tid + core.THREADS)
    w = [device.load_vec(norm_weight + v * NORM_VEC, NORM_VEC) for v in chunks]
    red = cute.make_tensor(cute.arch.alloc_smem(Float32, MAX_M * NORM_WARPS, alignment=16),
                           cute.make_layout(MAX_M * NORM_WARPS))  # fmt: skip
    if has_residual == 0:  # r = x + (-0.0) = x exactly, with the same code path
        for i in range(m):
            for v in chunks:
                off = cute.assume(i * xrow + v * NORM_VEC, divby=NORM_VEC)
                device.store_vec(rs + off, cute.full((NORM_VEC,), -0.0, BFloat16), NORM_VEC)
    cute.arch.mbarrier_wait(mbx, 0)
    lane = tid % 32
    for i in range(m):
        for v in chunks:
            off = cute.assume(i * xrow + v * NORM_VEC, divby=NORM_VEC)
            r, ss = device.norm_residual(
                device.load_vec(xs + off, NORM_VEC), device.load_vec(rs + off, NORM_VEC)
            )
            rb = r.to(BFloat16)
            device.store_vec(xs + off, rb, NORM_VEC)
            if has_residual != 0 and cta == v // 32:
                device.store_vec(
                    residual_out + cute.assume(i * core.K + v * NORM_VEC, divby=NORM_VEC), rb, NORM_VEC
                )
            ss = cute.arch.warp_reduction_sum(ss)
            if lane == 0:
                red[i * NORM_WARPS + v // 32] = ss
    cute.arch.sync_threads()
    for i in range(m):
        s = device.norm_scale([red[i * NORM_WARPS + j] for j in range(NORM_WARPS)], eps)
        for j, v in enumerate(chunks):
            off = cute.assume(i * xrow + v * NORM_VEC, divby=NORM_VEC)
            r = device.load_vec(xs + off, NORM_VEC).to(Float32)
            device.store_vec(xs + off, device.norm_apply(r, s, w[j]), NORM_VEC)
    cute.arch.sync_threads()


def kernel(spec: dict):
    nq, nkv = spec["heads"]
    fp8 = spec.get("kv_cache_dtype", "bf16") == "fp8_e4m3"
    return make_kernel(
        spec["weight_format"], bool(spec["rope"]), nq, nkv, fp8, spec.get("norm") == "prologue"
    )


def compile(spec: dict, arch: str, entry_prefix: str):
    fp4 = spec["weight_format"] == "nvfp4"
    fp8 = spec.get("kv_cache_dtype", "bf16") == "fp8_e4m3"
    prologue = spec.get("norm", "separate") == "prologue"
    cache = (cutlass.Uint8, 1) if fp8 else (BFloat16, 2)
    ptr_types = {
        "weight": (cutlass.Uint8 if fp4 else BFloat16, 16), "weight_scale": (cutlass.Uint8, 4),
        "global_scale": (Float32, 4), "cos_sin_cache": (Float32, 16), "positions": (Int64, 8),
        "slot_mapping": (Int64, 8), "k_cache": cache, "v_cache": cache, "k_scale": (Float32, 4),
        "v_scale": (Float32, 4),
    }  # fmt: skip
    dyn = MAX_M * smem_row(fp4) * 2 if prologue else 0
    return compile_kernel(kernel(spec), kind="qkv", arch=arch, entry_prefix=entry_prefix,
                          block=(core.THREADS, 1, 1), cluster=(CLUSTER, 1, 1), dyn_smem=dyn,
                          ptr_types=ptr_types)  # fmt: skip

"""The fused qkv kernel (SPEC §3, §5): qkv GEMV + per-head q/k RMSNorm + NeoX RoPE + paged KV-cache write.

Grid: one CTA of 128 threads per 16 weight rows; the 8 CTAs of one head (128 rows) form a cluster (8,1,1).
Each CTA
1. releases its own PDL dependents, issues all of its 64 KiB weight slice (BF16) into registers, and only
   then waits (griddepcontrol.wait) for the norm kernel: the weight stream overlaps the norm;
2. reads xn, computes its 16 rows for all tokens (gemv.py: fragment math, K split, summation order),
   rounds them to bf16 and stores them into rank 0's shared memory (DSMEM);
3. cluster barrier; rank 0 holds the head's 128 x M bf16 values and applies, for a q or k head, the RMSNorm
   over the 128 dims in fp32, NeoX RoPE from the fp32 cos|sin table (or none) and one bf16 rounding, then
   stores q, or writes k / v into the paged cache at slot_mapping.

Memory safety (documented in the loader): a position outside [0, max_pos) reads row 0 of the table and turns
that token's q/k head into NaN; a slot >= num_blocks * block_size is not written (like a negative slot).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm

from flint_aot.kernels import common, gemv

HEAD_DIM = 128
CLUSTER = HEAD_DIM // gemv.ROWS  # 8 CTAs per head

PARAMS = (
    ("xn", "ptr"),
    ("weight", "ptr"),
    ("weight_scale", "ptr"),
    ("global_scale", "ptr"),
    ("q_norm_weight", "ptr"),
    ("k_norm_weight", "ptr"),
    ("cos_sin_cache", "ptr"),
    ("positions", "ptr"),
    ("slot_mapping", "ptr"),
    ("q", "ptr"),
    ("k_cache", "ptr"),
    ("v_cache", "ptr"),
    ("m", "i32"),
    ("num_slot_mapping", "i32"),
    ("max_pos", "i32"),
    ("block_size", "i32"),
    ("num_cache_slots", "i64"),
    ("stride_block", "i64"),
    ("stride_slot", "i64"),
    ("stride_head", "i64"),
    ("qk_eps", "f32"),
)
PTR_DTYPES = {
    "weight_scale": cutlass.Uint8,
    "global_scale": Float32,
    "cos_sin_cache": Float32,
    "positions": Int64,
    "slot_mapping": Int64,
}


def _at(ptr, idx):
    """Element view at ptr + idx (idx may be Int64)."""
    return cute.make_tensor(ptr + idx, cute.make_layout(1))


def make_kernel(weight_format: str, rope: bool, nq: int, nkv: int, entry_prefix: str):
    assert weight_format == "bf16", "nvfp4 is not implemented yet"
    M8 = gemv.MAX_M

    @cute.kernel
    def qkv(
        xn: cute.Pointer, w: cute.Pointer, wsc: cute.Pointer, gsc: cute.Pointer,
        qnw: cute.Pointer, knw: cute.Pointer, cs: cute.Pointer, pos: cute.Pointer, slots: cute.Pointer,
        q: cute.Pointer, kc: cute.Pointer, vc: cute.Pointer,
        m: Int32, nsm: Int32, max_pos: Int32, bs: Int32, nslots: Int64, s0: Int64, s1: Int64, s2: Int64,
        eps: Float32,
    ):  # fmt: skip
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        # A CTA may write a peer's shared memory only once the peer is running: arrive now, wait just
        # before the DSMEM stores (by then every CTA of the cluster has long started).
        cute.arch.cluster_arrive_relaxed()
        A = gemv.issue_weight_loads(w, cta * gemv.ROWS, tid)
        flat = []
        for lo, hi in A:
            flat.extend(lo)
            flat.extend(hi)
        zero = gemv.runtime_zero(flat, m)
        if zero == 0:  # always true; keeps the weight loads above the wait
            cute.arch.griddepcontrol_wait()
        d = gemv.mma_partials(A, xn, m, tid, zero)
        red = cute.make_tensor(
            cute.arch.alloc_smem(Float32, gemv.WARPS * gemv.ROWS * 8, alignment=16),
            cute.make_layout(gemv.WARPS * gemv.ROWS * 8),
        )
        s = gemv.reduce_rows(d, tid, red)  # row tid % 16, token tid // 16

        # ---- gather the head's rows in rank 0 (DSMEM): head_buf[row][token], bf16
        rank = cute.arch.block_idx_in_cluster()
        hb = cute.arch.alloc_smem(BFloat16, HEAD_DIM * M8, alignment=16)
        slot_in_head = (rank * gemv.ROWS + tid % gemv.ROWS) * M8 + tid // gemv.ROWS
        cute.arch.cluster_wait()
        remote = cute.arch.map_dsmem_ptr(hb + slot_in_head, 0)
        llvm.store(s.to(BFloat16).ir_value(), remote.to_llvm_ptr())
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

        if rank == 0:
            head = cta // CLUSTER
            dim = tid
            hbt = cute.make_tensor(hb, cute.make_layout(HEAD_DIM * M8))
            st = cute.make_tensor(slots, cute.make_layout(M8))
            if head >= nq + nkv:  # v head: raw bf16 rows into v_cache
                kvh = head - (nq + nkv)
                for t in cutlass.range_constexpr(M8):
                    if t < m and t < nsm:
                        slot = st[t]
                        if slot >= 0 and slot < nslots:
                            off = (slot // bs) * s0 + (slot % bs) * s1 + kvh * s2 + dim
                            _at(vc, off)[0] = hbt[dim * M8 + t]
            else:
                wq = cute.make_tensor(qnw, cute.make_layout(HEAD_DIM))[dim].to(Float32)
                wk = cute.make_tensor(knw, cute.make_layout(HEAD_DIM))[dim].to(Float32)
                wn = Float32(cutlass.select_(head < nq, wq, wk))
                vals = [hbt[dim * M8 + t].to(Float32) for t in range(M8)]
                red2 = cute.make_tensor(cute.arch.alloc_smem(Float32, gemv.WARPS * M8, alignment=16),
                                        cute.make_layout(gemv.WARPS * M8))  # fmt: skip
                warp = tid // 32
                for t in cutlass.range_constexpr(M8):
                    ss = cute.arch.warp_reduction_sum(vals[t] * vals[t])
                    if tid % 32 == 0:
                        red2[warp * M8 + t] = ss
                cute.arch.sync_threads()
                ys = []
                for t in cutlass.range_constexpr(M8):
                    tot = red2[t]
                    for q_ in cutlass.range_constexpr(1, gemv.WARPS):
                        tot = tot + red2[q_ * M8 + t]
                    inv = cute.math.rsqrt(tot * Float32(1.0 / HEAD_DIM) + eps)
                    ys.append(vals[t] * inv * wn)
                if cutlass.const_expr(rope):
                    yb = cute.make_tensor(cute.arch.alloc_smem(Float32, M8 * HEAD_DIM, alignment=16),
                                          cute.make_layout(M8 * HEAD_DIM))  # fmt: skip
                    for t in cutlass.range_constexpr(M8):
                        yb[t * HEAD_DIM + dim] = ys[t]
                    cute.arch.sync_threads()
                    pt = cute.make_tensor(pos, cute.make_layout(M8))
                    sign = Float32(cutlass.select_(dim < HEAD_DIM // 2, Float32(-1.0), Float32(1.0)))
                    half = dim % (HEAD_DIM // 2)
                    outs = []
                    for t in cutlass.range_constexpr(M8):
                        p = pt[cutlass.min(t, m - 1)]
                        ok = p >= 0 and p < max_pos
                        ps = Int64(cutlass.select_(ok, p, Int64(0)))
                        c = _at(cs, ps * HEAD_DIM + half)[0]
                        sn = _at(cs, ps * HEAD_DIM + HEAD_DIM // 2 + half)[0]
                        other = yb[t * HEAD_DIM + (dim ^ (HEAD_DIM // 2))]
                        r = ys[t] * c + sign * other * sn
                        outs.append(Float32(cutlass.select_(ok, r, Float32(float("nan")))))
                    ys = outs
                if head < nq:
                    for t in cutlass.range_constexpr(M8):
                        if t < m:
                            _at(q, t * (nq * HEAD_DIM) + head * HEAD_DIM + dim)[0] = ys[t].to(BFloat16)
                else:
                    kvh = head - nq
                    for t in cutlass.range_constexpr(M8):
                        if t < m and t < nsm:
                            slot = st[t]
                            if slot >= 0 and slot < nslots:
                                off = (slot // bs) * s0 + (slot % bs) * s1 + kvh * s2 + dim
                                _at(kc, off)[0] = ys[t].to(BFloat16)

    qkv.set_name_prefix(entry_prefix, remove_cutlass_symbol=True, keep_mangled_name=False)

    @cute.jit
    def host(
        xn: cute.Pointer, w: cute.Pointer, wsc: cute.Pointer, gsc: cute.Pointer,
        qnw: cute.Pointer, knw: cute.Pointer, cs: cute.Pointer, pos: cute.Pointer, slots: cute.Pointer,
        q: cute.Pointer, kc: cute.Pointer, vc: cute.Pointer,
        m: Int32, nsm: Int32, max_pos: Int32, bs: Int32, nslots: Int64, s0: Int64, s1: Int64, s2: Int64,
        eps: Float32, stream,
    ):  # fmt: skip
        qkv(xn, w, wsc, gsc, qnw, knw, cs, pos, slots, q, kc, vc, m, nsm, max_pos, bs, nslots, s0, s1, s2,
            eps).launch(grid=[(nq + 2 * nkv) * CLUSTER, 1, 1], block=[gemv.THREADS, 1, 1],
                        cluster=[CLUSTER, 1, 1], use_pdl=True, stream=stream)  # fmt: skip

    return host


def compile(spec: dict, arch: str, entry_prefix: str) -> common.Compiled:
    nq, nkv = spec["heads"]
    host = make_kernel(spec["weight_format"], bool(spec["rope"]), nq, nkv, entry_prefix)
    args = common.fake_args(PARAMS, BFloat16, PTR_DTYPES)
    return common.compile_host(
        host, args, arch=arch, params=PARAMS, block=(gemv.THREADS, 1, 1), cluster=(CLUSTER, 1, 1),
        grid=("ROW_BLOCKS", 1, 1), dyn_smem=0,
    )  # fmt: skip

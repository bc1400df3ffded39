"""The fused qkv kernel (SPEC §3, §5): qkv GEMV + per-head q/k RMSNorm + NeoX RoPE + paged KV-cache write.

Grid: one CTA of 128 threads per 16 weight rows; the 8 CTAs of one head (128 rows) form a cluster (8,1,1).
Each CTA
1. releases its own PDL dependents, initialises its mbarriers, arrives on the cluster barrier, issues its
   whole weight slice (BF16: 64 KiB into registers; NVFP4: codes + scales, and half of the decode), and only
   then waits (griddepcontrol.wait) for the norm kernel: the weight stream overlaps the norm;
2. copies 1/8 of xn (k in [256 r, 256 r + 256) of every token) with one multicast bulk copy per token into
   all 8 CTAs' shared memory: x is read from L2 once per cluster, not once per CTA;
3. computes its 16 rows for all tokens (gemv.py: fragment math, K split, summation order) and rounds them
   to bf16;
4. v head: writes its rows to the paged cache. q/k head: sends its per-token partial sums of squares to
   every CTA of the head and its rows to its RoPE partner (rank ^ 4) with st.async on their mbarriers,
   then applies the RMSNorm (fp32, sums in rank order: the same in all 8 CTAs), NeoX RoPE from the fp32
   cos|sin table (or none) and one bf16 rounding to its own 16 dims, and stores q or writes k.

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


@cute.jit
def _store_cache(cache, slot, nslots, bs, s0, s1, s2, kvh, dim, val):
    """cache[slot // bs, slot % bs, kvh, dim] = val, for 0 <= slot < nslots only."""
    if slot >= 0 and slot < nslots:
        _at(cache, (slot // bs) * s0 + (slot % bs) * s1 + kvh * s2 + dim)[0] = val


def _f32_bits(v):
    return Int32(llvm.bitcast(Int32.mlir_type, v.ir_value()))


def _bulk_multicast(dst, src, mbar):
    """512 bytes global -> the same shared-memory offset in all 8 CTAs of the cluster (one L2 read),
    completing on each CTA's mbarrier at mbar's offset."""
    cute.arch.inline_ptx(
        "{ .reg .b16 msk; mov.b16 msk, 0xFF;"
        " cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [{$r0}], [{$r1}], 512, [{$r2}], msk; }",
        read_only_args=[dst, src, mbar],
    )


def make_kernel(weight_format: str, rope: bool, nq: int, nkv: int, entry_prefix: str):
    assert weight_format in ("bf16", "nvfp4"), weight_format
    fp4 = weight_format == "nvfp4"
    M8 = gemv.MAX_M
    R = gemv.ROWS
    HALF = HEAD_DIM // 2
    # bytes each CTA of a q/k head receives over DSMEM: the 8 ranks' per-token sums of squares, and
    # (RoPE) the 16 x 8 values of its rotation partner (rank ^ 4), as fp32
    rx_bytes = CLUSTER * M8 * 4 + (R * M8 * 4 if rope else 0)

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
        head = cta // CLUSTER  # uniform over the cluster
        rank = cute.arch.block_idx_in_cluster()
        is_v = head >= nq + nkv
        r = tid % R  # after reduce_rows: this thread's row (within the CTA) and token
        tk = tid // R
        dim = rank * R + r
        ssq = cute.arch.alloc_smem(Float32, CLUSTER * M8, alignment=16)  # [src rank][token]
        pv = cute.arch.alloc_smem(Float32, R * M8, alignment=16)  # partner rows [row][token]
        mbar = cute.arch.alloc_smem(Int64, 1, alignment=8)
        # x is read once per cluster: CTA r copies k in [256 r, 256 r + 256) of every token with a multicast
        # bulk copy into all 8 CTAs' shared memory (rows padded against bank conflicts), completing on mbx.
        # q/k heads also receive their peers' st.async on mbar. Both are initialised now, before this CTA
        # arrives on the cluster barrier; the wait comes before anyone targets a peer.
        xrow = gemv.K + (8 if fp4 else 32)
        xs = cute.arch.alloc_smem(BFloat16, M8 * xrow, alignment=128)
        mbx = cute.arch.alloc_smem(Int64, 1, alignment=8)
        if tid == 0:
            cute.arch.mbarrier_init(mbx, 1)
            if not is_v:
                cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_warp()  # orders the inits before the arrives for racecheck (same thread anyway)
        if tid == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbx, m * (gemv.K * 2))
            if not is_v:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, rx_bytes)
        cute.arch.cluster_arrive_relaxed()
        # q/k norm weights of this thread's dim and of its rotation partner (model constants)
        qw = cute.make_tensor(qnw, cute.make_layout(HEAD_DIM))
        kw = cute.make_tensor(knw, cute.make_layout(HEAD_DIM))
        wn = Float32(cutlass.select_(head < nq, qw[dim].to(Float32), kw[dim].to(Float32)))
        wp = Float32(cutlass.select_(head < nq, qw[dim ^ HALF].to(Float32), kw[dim ^ HALF].to(Float32)))

        # ---- the weight stream, issued before griddepcontrol.wait (which follows it)
        wst = gemv.weights_then_wait(fp4, w, wsc, gsc, cta * R, tid, m)
        cute.arch.cluster_wait()  # every peer's mbarriers are initialised
        if tid < m:
            part = rank * (gemv.K // CLUSTER)
            _bulk_multicast(xs + (tid * xrow + part), xn + (tid * gemv.K + part), mbx)
        # per-token inputs of the epilogue, issued now so their latency hides under the GEMV
        slot = Int64(-1)
        if tk < nsm:
            slot = cute.make_tensor(slots, cute.make_layout(M8))[tk]
        c = Float32(1.0)
        sn = Float32(0.0)
        ok = True
        if cutlass.const_expr(rope):
            p = cute.make_tensor(pos, cute.make_layout(M8))[cutlass.min(tk, m - 1)]
            ok = p >= 0 and p < max_pos
            row = Int64(cutlass.select_(ok, p, Int64(0))) * HEAD_DIM + dim % HALF
            c = _at(cs, row)[0]
            sn = _at(cs, row + HALF)[0]

        acc = gemv.row_sums(fp4, wst, gemv.SharedX(xs, xrow, mbx), m, tid)
        h = acc.to(BFloat16)  # qkv[tk, head * 128 + dim], rounded once

        if is_v:
            if tk < m:
                _store_cache(vc, slot, nslots, bs, s0, s1, s2, head - (nq + nkv), dim, h)
        else:
            hv = h.to(Float32)
            part = hv * hv  # this CTA's 16 dims of token tk: a 16-lane butterfly (same sum in every lane)
            for o in (1, 2, 4, 8):
                part = part + cute.arch.shuffle_sync_bfly(part, o)
            if r < CLUSTER:  # lane r sends the partial to rank r
                cute.arch.store_async_dsmem(ssq + (rank * M8 + tk), _f32_bits(part), mbar, r)
            if cutlass.const_expr(rope):
                cute.arch.store_async_dsmem(pv + (r * M8 + tk), _f32_bits(hv), mbar, rank ^ (CLUSTER // 2))
            cute.arch.mbarrier_wait(mbar, 0)
            st = cute.make_tensor(ssq, cute.make_layout(CLUSTER * M8))
            tot = st[tk]
            for j in range(1, CLUSTER):  # rank order: the same sum in every CTA of the head
                tot = tot + st[j * M8 + tk]
            inv = cute.math.rsqrt(tot * Float32(1.0 / HEAD_DIM) + eps)
            y = hv * inv * wn
            if cutlass.const_expr(rope):
                yp = cute.make_tensor(pv, cute.make_layout(R * M8))[r * M8 + tk] * inv * wp
                sign = Float32(cutlass.select_(dim < HALF, Float32(-1.0), Float32(1.0)))
                y = Float32(cutlass.select_(ok, y * c + sign * yp * sn, Float32(float("nan"))))
            yb = y.to(BFloat16)
            if tk < m:
                if head < nq:
                    _at(q, tk * (nq * HEAD_DIM) + head * HEAD_DIM + dim)[0] = yb
                else:
                    _store_cache(kc, slot, nslots, bs, s0, s1, s2, head - nq, dim, yb)

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
    dtypes = dict(PTR_DTYPES, weight=cutlass.Uint8) if spec["weight_format"] == "nvfp4" else PTR_DTYPES
    args = common.fake_args(PARAMS, BFloat16, dtypes)
    return common.compile_host(
        host, args, arch=arch, params=PARAMS, block=(gemv.THREADS, 1, 1), cluster=(CLUSTER, 1, 1),
        grid=("ROW_BLOCKS", 1, 1), dyn_smem=0,
    )  # fmt: skip

"""Standalone GEMV (the unfused path, docs/numerics.md §2): y[M, N] = bf16(x[M, K] · Wᵀ), BF16 or NVFP4 W.

Tile 8 (M <= 8): one CTA of 128 threads per 16 rows, no cluster (weights.CtaGemv: warp w takes K quarter w).
Tiles 16, 32, 64: the token stream (stream_gemv.StreamGemv, run by the MmaRing schedule): clusters of 4 CTAs,
one per K quarter, each CTA 64 rows of its quarter, x arriving 8 tokens at a time; the grid rounds the row
blocks up to a multiple of 4 (a block past N reads the last block's rows and is never stored). Either way
the very code of the fused kernel, so y is bit-identical to the fused kernel's qkv values. PDL: releases its
dependents at entry, streams its weights, then waits for the producer of x. Row offsets are 32-bit:
N <= loader.abi.max_gemv_rows(K) (the loader checks it)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from flint_aot.kernels.compile import Kernel
from flint_aot.kernels.diagnostics import SERVING, Diagnostics
from flint_aot.kernels.fp4 import FP4_PRE_GEMV, FP4_PRE_QKV
from flint_aot.kernels.mma import ROWS, THREADS, WARPS
from flint_aot.kernels.schedules import GroupRun, MmaRing
from flint_aot.kernels.stream_gemv import GROUP, StreamConfig, StreamGemv
from flint_aot.kernels.weights import CtaGemv
from loader.abi import GRID_STREAM_GEMV, STREAM_CLUSTER_GEMV, hidden_refusal, spec_hidden


class GemvKernel(Kernel):
    """The standalone GEMV of one specialization: weight format, token tile and hidden size, set once."""

    kind, block = "gemv", (THREADS, 1, 1)

    def __init__(self, spec: dict, arch: str, diag: Diagnostics = SERVING):
        self.arch, self.diag = arch, diag
        self.fp4 = spec["weight_format"] == "nvfp4"
        self.tile = spec.get("max_m", 8)
        self.k = spec_hidden(spec)
        assert hidden_refusal("gemv", self.k) is None, hidden_refusal("gemv", self.k)
        if self.tile == 8:
            self.gemv = CtaGemv(self.fp4, FP4_PRE_GEMV, self.k)
        else:  # (x as plain rows, row blocks as owners, each stage refilled after a CTA barrier)
            self.stream = StreamGemv(StreamConfig(self.fp4, self.tile, FP4_PRE_QKV, self.k))
            self.schedule = MmaRing()
            self.cluster, self.grid = (STREAM_CLUSTER_GEMV, 1, 1), GRID_STREAM_GEMV
            self.dyn_smem = self.stream.dyn_smem
            self.min_ctas_per_sm = 3  # registers within 3 CTAs per SM

    @cute.kernel
    def kernel(self, x: cute.Pointer, weight: cute.Pointer, weight_scale: cute.Pointer,
               global_scale: cute.Pointer, y: cute.Pointer, m: Int32, n: Int32):  # fmt: skip
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.tile == 8):
            st = self.gemv.start(weight, weight_scale, global_scale, cta * ROWS, tid, m)
            self.store(y, self.gemv.sums(st, x, m, tid), cta, 0, tid, m, n)
        else:
            self.streamed(x, weight, weight_scale, global_scale, y, m, n, tid, cta)

    def streamed(self, x, weight, weight_scale, global_scale, y, m, n, tid, cta):
        """The token stream: this CTA is quarter q = rank of quad cta // 4; after each group's MMAs its
        warps' partial sums go to their row blocks' owners (rank w), which add and store them once their own
        MMAs are done."""
        sm = self.stream.alloc()
        self.arm(sm, tid)
        q = cute.arch.block_idx_in_cluster()
        quad = cta // STREAM_CLUSTER_GEMV
        rb = cutlass.min(quad * WARPS + tid // 32, n // ROWS - 1)  # this warp's row block (clamped)
        first = lambda: self.first(sm, x, q, m, tid)  # noqa: E731
        st = self.stream.start(weight, weight_scale, global_scale, rb * ROWS, q, tid, m,
                               issued=None if self.fp4 else first)  # fmt: skip
        if cutlass.const_expr(self.fp4):
            first()
        self.groups(st, sm, x, y, m, n, tid, q, quad)

    @cute.jit
    def arm(self, sm, tid):
        if tid == 0:
            self.stream.arm(sm)
        cute.arch.cluster_arrive_relaxed()  # (peers send to mbr once they have waited for this)

    @cute.jit
    def groups(self, st, sm, x, y, m, n, tid, q, quad):
        """Every group's MMAs (their partial sums sent to the owners without waiting), then the owner's sums
        and stores: loops at run time over the groups of m tokens."""
        groups = (m + (GROUP - 1)) // GROUP
        cute.arch.cluster_wait()  # the peers' mbarriers are initialised (before the first send)
        self.schedule.run(GroupRun(self.stream, sm, st, x, q, q, m, tid), groups)
        for i in range(groups):
            s = self.stream.total(st, sm.red, sm.mbr, i, tid)
            self.store(y, s, quad * WARPS + q, i, tid, m, n, False)

    @cute.jit
    def first(self, sm, x, q, m, tid):
        """Threads tid < 8 wait for x's producer themselves (the weights may still be in flight) and copy the
        first groups into the ring."""
        if tid < GROUP:
            cute.arch.griddepcontrol_wait()
            for i in cutlass.range_constexpr(self.stream.stages):
                if GROUP * i < m:
                    self.stream.fill(sm.xs, sm.mbx, x, q, i, m, tid)

    @cute.jit
    def store(self, y, s: Float32, rb, i, tid, m, n, inside: cutlass.Constexpr = True):
        """y[8 i + tid // 16, 16 rb + tid % 16] = bf16(s), for tokens < m (and, unless the row block is known
        to be inside N, row blocks inside N)."""
        tk = GROUP * i + tid // ROWS
        ok = tk < m
        if cutlass.const_expr(not inside):
            ok = ok and rb < n // ROWS
        if ok:
            yt = cute.make_tensor(y + (tk * n + rb * ROWS), cute.make_layout(ROWS))
            yt[tid % ROWS] = s.to(BFloat16)

    def ptr_types(self) -> dict:
        """Element type and assumed alignment (bytes) of the pointers that are not bf16 16-byte aligned."""
        t = {"weight_scale": (cutlass.Uint8, 4), "global_scale": (Float32, 4)}
        if self.fp4:
            t["weight"] = (cutlass.Uint8, 16)
        return t


KERNEL = GemvKernel

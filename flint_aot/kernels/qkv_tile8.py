"""The fused qkv kernel for M <= 8 (docs/kernels.md §2.1-§2.4, §3).

Grid: one CTA of 128 threads per 16 weight rows; the 8 CTAs of one head (128 rows) form a cluster (8,1,1) and
CTA rank r owns the head's dims 16 r .. 16 r + 15 over all K (warp w: K quarter w). Each CTA
1. releases its own PDL dependents, initialises its mbarriers, arrives on the cluster barrier, issues its
   whole weight slice (BF16: 64 KiB into registers; NVFP4: codes + scales, and 3/4 of the decode), and only
   then waits (griddepcontrol.wait) for the kernel before it: the weight stream overlaps that kernel;
2. gets the activations of all tokens into its shared memory (activations.py: the two-kernel design's
   multicast copy of xn, or the prologue design's input norm split over the cluster). With BF16 weights
   the threads that fetch them start as soon as the weight loads are issued, with NVFP4 after the wait (a
   waiting warp could not decode);
3. computes its 16 rows for all tokens (weights.CtaGemv: fragment math, K split, summation order) and rounds
   them to bf16;
4. runs the per-head epilogue over the cluster (epilogue.HeadEpilogue: send, then finish).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64

from flint_aot.kernels import trace
from flint_aot.kernels.activations import Tile8Copy, Tile8Norm
from flint_aot.kernels.diagnostics import SERVING, Diagnostics
from flint_aot.kernels.fp4 import FP4_PRE_QKV
from flint_aot.kernels.mma import ROWS, SharedX, smem_row
from flint_aot.kernels.qkv_base import QkvKernel, Thread
from flint_aot.kernels.weights import CtaGemv
from loader.abi import CLUSTER, TOKEN_GROUP

R = ROWS
GROUP = TOKEN_GROUP


@dataclass(frozen=True)
class Tile8Smem:
    ssq: object  # the 8 ranks' per-token partial sums of squares, [src rank][token]
    pv: object  # the RoPE partner's values, [row][token]
    mbar: object  # the epilogue exchange's mbarrier (q/k heads)
    xs: object  # x of all K per token, padded rows
    ssn: object  # prologue design: the 8 slices' sums of squares of the input norm
    mbx: object  # the activations' mbarrier


class Tile8Qkv(QkvKernel):
    def __init__(self, spec: dict, arch: str, diag: Diagnostics = SERVING):
        super().__init__(spec, arch, diag)
        self.gemv = CtaGemv(self.fp4, FP4_PRE_QKV, self.k, self.paired)
        self.xrow = smem_row(self.fp4, self.k)
        self.x = (Tile8Norm if self.prologue else Tile8Copy)(self.xrow)
        # bytes each CTA of a q/k head receives over DSMEM per group of 8 tokens: the 8 ranks' per-token sums
        # of squares, and (RoPE) the 16 x 8 values of its rotation partner (rank ^ 4), as fp32
        # (without q/k norm only the partner's values, or nothing)
        self.rx_bytes = (CLUSTER * GROUP * 4 if self.qk_norm else 0) + (R * GROUP * 4 if self.rope else 0)

    def body(self, a, t: Thread):
        s = self.shared(a, t)
        wn, wp = (w[0] for w in self.epi.norm_weights(a, t, [t.dim]))
        # the weight stream, issued before griddepcontrol.wait (which follows it)
        fetch = lambda: self.x.fetch(a, t, s)  # noqa: E731
        wst = self.gemv.start(a.weight, a.weight_scale, a.global_scale, t.cta * R, t.tid, a.m,
                              issued=None if self.fp4 else fetch, tr=t.tr)  # fmt: skip
        if cutlass.const_expr(self.fp4):
            fetch()
        t.tr.mark(trace.WAIT_RETURNED, zero=wst.zero)
        e = self.epi.inputs(a, t, 0)
        scale = self.epi.cache_scale(a, t)
        self.x.finish(a, t, s)
        t.tr.mark(trace.X_IN, wait=lambda: cute.arch.mbarrier_wait(s.mbx, 0))
        acc = self.gemv.sums(wst, SharedX(s.xs, self.xrow, s.mbx), a.m, t.tid)
        t.tr.mark(trace.GEMV_DONE, after=acc)
        hv = acc.to(BFloat16).to(Float32)  # qkv[token, head * 128 + dim], rounded once
        buf = (s.ssq, s.pv, s.mbar)
        self.epi.send(a, t, buf, hv, 0, scale, e[0])
        self.epi.finish(a, t, buf, hv, 0, scale, e, wn, wp)
        t.tr.mark(trace.STORED, after=hv)

    @cute.jit
    def shared(self, a, t: Thread) -> Tile8Smem:
        """Shared memory, and the mbarriers initialised before this CTA arrives on the cluster barrier (the
        wait comes before anyone targets a peer)."""
        ssq = cute.arch.alloc_smem(Float32, CLUSTER * GROUP, alignment=16)
        pv = cute.arch.alloc_smem(Float32, R * GROUP, alignment=16)
        mbar = cute.arch.alloc_smem(Int64, 1, alignment=8)
        xs = cute.arch.alloc_smem(BFloat16, GROUP * self.xrow, alignment=128)
        ssn = self.x.sums_buffer(ssq)
        mbx = cute.arch.alloc_smem(Int64, 1, alignment=8)
        if t.tid == 0:
            cute.arch.mbarrier_init(mbx, 1)
            if not t.is_v:
                cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_warp()  # orders the inits before the arrives for racecheck (same thread anyway)
        if t.tid == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbx, self.x.expect_bytes(a))
            if not t.is_v:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, self.rx_bytes)
        cute.arch.cluster_arrive_relaxed()
        return Tile8Smem(ssq, pv, mbar, xs, ssn, mbx)

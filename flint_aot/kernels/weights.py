"""A thread's weight slice, issued before griddepcontrol.wait and held in registers for the whole call (the
weight stream, docs/kernels.md §2.2), and the 8-token GEMV of one CTA built on it (`CtaGemv`).

`weights_then_wait` issues the slice (rows row0 + g and + 8 of one K quarter) and then waits for the
predecessor, guarded by a run-time zero that depends on every loaded register: ptxas can neither sink the
loads below the wait nor hoist the wait above them. It returns the state the MMAs take: `Bf16Weights` or
`Fp4Weights`, which run the same MMA sequence on any x (`partials`), so the fused kernel and the standalone
GEMV, which both call it, round the same sums.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flint_aot.kernels import trace
from flint_aot.kernels.device import lanes
from flint_aot.kernels.fp4 import FP4_PRE_GEMV, fp4_decode_rows, fp4_mma_partials, issue_fp4_loads
from flint_aot.kernels.mma import (
    ROWS,
    WARPS,
    issue_weight_loads,
    mma_partials,
    reduce_rows,
    runtime_zero,
    steps,
)


@dataclass(frozen=True)
class Bf16Weights:
    """BF16: the 16-byte loads of each k block, rows g and g + 8 (A[b] = (lo, hi), 4 registers each)."""

    A: list
    zero: object  # Int32, 0 at run time, depending on every weight register (the wait's guard)

    def complete(self, tid) -> Bf16Weights:
        """Every word ready for the MMAs (BF16: as loaded)."""
        return self

    def partials(self, x, tok, tid, m, kx=None, paired=False):
        """This warp's partial sums for 8 tokens of x (mma.mma_partials)."""
        return mma_partials(self.A, x, tok, tid, self.zero, kx)

    def tile_partials(self, x, tid):
        """The same MMAs on x in shared memory (the wgmma tiles): the accumulators start from a plain 0."""
        return mma_partials(self.A, x, 0, tid, Int32(0))

    def words(self):
        """A's registers by word i and row half h: words()[h][i], 4 registers (the loads of k block i)."""
        return [{i: self.A[i][h] for i in range(len(self.A))} for h in range(2)]

    def scaled(self, v):
        return v


@dataclass(frozen=True)
class Fp4Weights:
    """NVFP4: the code words and scale groups as loaded (step order, fp4.issue_fp4_loads), the words decoded
    so far (D[row][i], 4 bf16x2 registers each), and the global scale times 2^7."""

    codes: list
    scales: list
    D: list
    pre: int  # words decoded before the wait
    gs: object  # Float32
    zero: object

    def complete(self, tid) -> Fp4Weights:
        """The words not decoded before the wait, decoded now: D then holds all of them."""
        rest = fp4_decode_rows(self.codes, self.scales, range(self.pre, len(self.codes[0])), tid)
        return replace(self, D=[{**self.D[i], **rest[i]} for i in range(2)])

    def partials(self, x, tok, tid, m, kx=None, paired=False):
        """This warp's partial sums for 8 tokens of x (fp4.fp4_mma_partials; after complete)."""
        return fp4_mma_partials(self.D, x, tok, tid, m, kx, paired)

    def tile_partials(self, x, tid):
        """The same MMAs on x in shared memory (the wgmma tiles, always in the pair order)."""
        return fp4_mma_partials(self.D, x, 0, tid, None, paired=True)

    def words(self):
        return self.D

    def scaled(self, v):
        """A row sum times the global scale (x 2^7: the decoded weights are e2m1 * e4m3 * 2^-7)."""
        return v * self.gs

    def with_global_scale(self, gs) -> Fp4Weights:
        return replace(self, gs=gs)


def global_scale(gsc):
    """NVFP4: the weights' global scale times 2^7 (the decoded weights are e2m1 * e4m3 * 2^-7)."""
    return cute.make_tensor(gsc, cute.make_layout(1))[0] * Float32(128.0)


@cute.jit
def guarded_wait(zero: Int32):
    if zero == 0:  # always true at run time
        cute.arch.griddepcontrol_wait()


def weights_then_wait(fp4: bool, w, wsc, gsc, row0, tid, m, k: int, pre: int = FP4_PRE_GEMV, issued=None,
                      kq=None, tr=trace.OFF):  # fmt: skip
    """Issue this thread's whole weight slice (rows row0 + g, + 8 of hidden size k, K quarter kq, default the
    warp's; NVFP4: codes, scales and the decode of `pre` of the steps(k) words, all of them if fewer), then
    the guarded griddepcontrol.wait. BF16: issued(),
    if given, runs once the loads are issued, before any of them is waited for (the guard's chain starts from
    a clock read after it, so ptxas cannot hoist the waits above it). NVFP4 takes no issued(): a warp waiting
    there could not decode before the wait."""
    if fp4:
        assert issued is None, "NVFP4: a warp waiting in issued() could not decode before the wait"
        pre = min(pre, steps(k))
        codes, scw = issue_fp4_loads(w, wsc, row0, tid, k, kq)
        gs = global_scale(gsc)
        D = fp4_decode_rows(codes, scw, range(pre), tid)
        flat = scw[0][pre // 4 :] + scw[1][pre // 4 :] + codes[0][pre:] + codes[1][pre:]
        for row in D:
            for regs in row.values():
                flat.extend(regs)
        st = Fp4Weights(codes, scw, D, pre, gs, runtime_zero(flat, m))
    else:
        A = issue_weight_loads(w, row0, tid, k, kq)
        flat = []
        if issued is not None:
            issued()
            flat.append(Int32(cute.arch.clock64()))  # the guard's chain starts after issued()
        for lo, hi in A:
            flat.extend(lo)
            flat.extend(hi)
        st = Bf16Weights(A, runtime_zero(flat, m))
    tr.mark(trace.WEIGHTS_IN, zero=st.zero)
    guarded_wait(st.zero)
    return st


class CtaGemv:
    """The 8-token GEMV of one CTA (128 threads, 16 rows, warp w = K quarter w) for one weight format and
    hidden size k: `start` issues the weight slice and waits for the predecessor, `sums` computes the 16 rows
    for up to 8 tokens. paired: x in the NVFP4 MMA pair order (written so by the norm kernel,
    loader.abi.xn_pairs)."""

    def __init__(self, fp4: bool, pre: int, k: int, paired: bool = False):
        self.fp4, self.pre, self.k, self.paired = fp4, pre, k, paired

    def start(self, w, wsc, gsc, row0, tid, m, issued=None, tr=trace.OFF):
        return weights_then_wait(self.fp4, w, wsc, gsc, row0, tid, m, self.k, self.pre, issued, tr=tr)

    def sums(self, st, x, m, tid):
        """After start: thread tid gets the fp32 sum (times the global scale for NVFP4) of row tid % 16, token
        tid // 16 (syncs the CTA)."""
        st = st.complete(tid)
        _, _, g, _ = lanes(tid)
        d = st.partials(x, cutlass.min(g, m - 1), tid, m, paired=self.paired)
        red = cute.make_tensor(cute.arch.alloc_smem(Float32, WARPS * ROWS * 8, alignment=16),
                               cute.make_layout(WARPS * ROWS * 8))  # fmt: skip
        return st.scaled(reduce_rows(d, tid, red))

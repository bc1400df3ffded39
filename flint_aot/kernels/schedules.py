"""How a token-stream CTA runs its groups of 8 tokens (docs/kernels.md §2.5, §2.6): for each group, its MMAs,
the refill of its x stage, and the send of its partial sums to their owners. One schedule object per kind of
group loop, picked once by the kernel from its spec and architecture:

* `MmaRing`: mma.sync from ring stages of padded rows, each stage refilled after a CTA barrier with the
  group `stages` ahead (the fused kernel's 16-token tile, the standalone GEMV);
* `PrologueRing`: the prologue design, which normalises the next group into the other of its two stages
  itself while the MMAs of this one run;
* `WgmmaFours` (sm_90a): x as wgmma tiles; in each four of groups, the first by mma.sync as soon as its x
  lands, the other three in one wgmma pass;
* `TiledMmaRing` (sm_100a, which has no wgmma): the same tiles, every group by mma.sync, x by ldmatrix.

Every schedule runs the same MMA sequence on every group, so a token's sums do not depend on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from flint_aot.kernels import trace
from flint_aot.kernels.stream_gemv import GROUP, StreamGemv, StreamSmem


@dataclass(frozen=True)
class GroupRun:
    """What a schedule works on: this CTA's stream GEMV, its shared memory and weights, x's global pointer
    (what the refills copy), its K quarter q and cluster rank (where the sums go), m and the thread."""

    core: StreamGemv
    sm: StreamSmem
    st: object
    x: object
    q: object
    rank: object
    m: object
    tid: object
    tr: trace.Trace = trace.OFF
    normalise: Callable | None = None  # PrologueRing: normalise(i) writes group i's xn into its stage


class MmaRing:
    """Group after group by mma.sync, x from its ring stage once it landed; the stage refilled with the group
    `stages` ahead after a CTA barrier (StreamGemv.refill), where there is one; the sums sent without
    waiting. unroll: the loop's unroll pragma (1: one copy of its code)."""

    read_barriers = False

    def __init__(self, unroll: int = 0):
        self.unroll = unroll

    def prepare(self, g: GroupRun):
        pass

    @cute.jit
    def run(self, g: GroupRun, groups):
        for i in cutlass.range(groups, unroll=self.unroll):
            g.tr.at_group(i, 0, trace.X_IN, wait=lambda: cute.arch.mbarrier_wait(g.sm.mbx, 0))
            x = g.core.stage(g.sm.xs, g.sm.mbx, i)
            g.tr.mark(trace.GROUP_X_IN, plus=i)
            d = g.core.partials(g.st, x, i, g.m, g.tid)
            g.tr.mark(trace.GROUP_DONE, plus=i, after=d[0])
            if i + g.core.stages < groups:  # (never where the ring holds every group)
                g.core.refill(g.sm.xs, g.sm.mbx, g.x, g.q, i, g.m, g.tid)
            g.core.send_partials(g.sm, d, i, g.rank, g.tid)


class PrologueRing:
    """The prologue design's two stages: group i by mma.sync from its stage (normalised before the last CTA
    barrier), then group i + 1 normalised into the other stage, a CTA barrier, and group i's sums sent."""

    read_barriers = False

    def prepare(self, g: GroupRun):
        pass

    @cute.jit
    def run(self, g: GroupRun, groups):
        for i in range(groups):
            d = g.core.partials(g.st, g.core.stage(g.sm.xs, g.sm.mbx, i, wait=False), i, g.m, g.tid)
            g.tr.mark(trace.GROUP_DONE, plus=i, after=d[0])
            if i + 1 < groups:  # (the other stage: read by group i - 1's MMAs, which every warp ended
                g.normalise(i + 1)  # before the last barrier)
            cute.arch.sync_threads()
            g.core.send_partials(g.sm, d, i, g.rank, g.tid)


class TiledMmaRing:
    """x as wgmma tiles (a ring of 4 stages), every group by mma.sync with x by ldmatrix from its stage
    (sm_100a, which has no wgmma; on sm_90a the groups WgmmaFours leaves over). refill: a stage is refilled
    with the group 4 ahead once every warp has read it, on its "read" mbarrier (sm_100a's 64-token kernel)."""

    def __init__(self, refill: bool):
        self.refill = refill
        self.read_barriers = refill

    def prepare(self, g: GroupRun):
        pass

    def run(self, g: GroupRun, groups):
        self.groups(g, groups, 0)

    @cute.jit
    def groups(self, g: GroupRun, groups, start: cutlass.Constexpr):
        for i in cutlass.range(start, groups, unroll=1):
            if cutlass.const_expr(g.core.groups > g.core.stages):  # stages reused: their phases alternate
                stage = i % g.core.stages
                cute.arch.mbarrier_wait(g.sm.mbx + stage, (i // g.core.stages) % 2)
                g.tr.mark(trace.GROUP_X_IN, plus=i)
                d = g.core.ring_partials(g.st, g.sm.xs, stage, g.tid)
                g.tr.mark(trace.GROUP_DONE, plus=i, after=d[0])
                if cutlass.const_expr(self.refill):  # (compiled in on sm_90a, the branch alone would bring
                    if i + g.core.stages < groups:  # back the collective paths of WgmmaFours' docstring)
                        g.core.refill(g.sm.xs, g.sm.mbx, g.x, g.q, i, g.m, g.tid)
            else:  # (a ring of every group)
                cute.arch.mbarrier_wait(g.sm.mbx + i, 0)
                g.tr.at_group(i, 0, trace.X_IN)
                g.tr.mark(trace.GROUP_X_IN, plus=i)
                d = g.core.ring_partials(g.st, g.sm.xs, i, g.tid)
                g.tr.mark(trace.GROUP_DONE, plus=i, after=d[0])
            g.core.send_partials(g.sm, d, i, g.rank, g.tid)


class WgmmaFours:
    """x as wgmma tiles (a ring of 4 stages), on sm_90a: groups 4 h .. 4 h + 3 as one "four" (group 4 h by
    mma.sync, then the other three in one wgmma pass of N = 24), with 4 groups or more; a 64-token call
    with all 8 groups runs two fours, with 5-7 groups the first four and then groups 4.. by mma.sync;
    fewer than 4 groups run by mma.sync (at N = 8 or 16 a pass reuses A too little to pay)."""

    read_barriers = False  # (its refills follow CTA barriers; the groups it leaves over are never refilled)

    def __init__(self, fp4: bool):
        self.fp4 = fp4
        self.rest = TiledMmaRing(refill=False)

    @cute.jit
    def prepare(self, g: GroupRun):
        """NVFP4, once the weights are decoded: with 4 groups or more (a pass runs), A's parked words
        (StreamGemv.park), fenced for the wgmma's async proxy, and a CTA barrier. (BF16 parks in its first
        four: its weights arrive after the wait.)"""
        if cutlass.const_expr(self.fp4):
            if (g.m + (GROUP - 1)) // GROUP >= 4:
                g.core.park(g.st, g.sm.xs, g.tid)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()

    @cute.jit
    def run(self, g: GroupRun, groups):
        if groups >= 4:
            self.four(g, 0, groups)
            if cutlass.const_expr(g.core.groups > 4):
                if groups == g.core.groups:
                    self.four(g, 1, groups)
                else:
                    self.rest.groups(g, groups, 4)
        else:
            self.rest.groups(g, groups, 0)

    @cute.jit
    def four(self, g: GroupRun, h: cutlass.Constexpr, groups):
        """Groups 4 h .. 4 h + 3 in ring stages 0..3 (their fill h). In the 64-token kernel's first four each
        stage, once read, is refilled with the group 4 ahead, if there is one (stage 0 after group 0's MMAs,
        so that group 4's x arrives during the pass; stages 1-3 after the pass), each after a CTA barrier:
        refilled on read mbarriers instead, ptxas could no longer prove the warps converged and gave every
        later shuffle a collective path. BF16's park barrier is group 0's. The two fours are two copies of
        this code (h a constant: a loop over h at run time spilled)."""
        cute.arch.mbarrier_wait(g.sm.mbx, h)
        if cutlass.const_expr(h == 0):
            g.tr.mark(trace.X_IN)
        g.tr.mark(trace.GROUP_X_IN, plus=4 * h)
        d = g.core.ring_partials(g.st, g.sm.xs, 0, g.tid)
        g.tr.mark(trace.GROUP_DONE, plus=4 * h, after=d[0])
        if cutlass.const_expr(h == 0 and not self.fp4):  # BF16 parks A's words here: its weights arrive after
            # the wait, and group 0's MMAs meet them as they come (parked first, group 0 would wait for all)
            g.core.park(g.st, g.sm.xs, g.tid)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
        if cutlass.const_expr(h == 0 and g.core.groups > 4):
            if cutlass.const_expr(self.fp4):  # (BF16: the park's barrier above)
                cute.arch.sync_threads()
            if 4 < groups and g.tid < GROUP:
                g.core.fill(g.sm.xs, g.sm.mbx, g.x, g.q, 4, g.m, g.tid)
        g.core.send_partials(g.sm, d, 4 * h, g.rank, g.tid)
        for j in cutlass.range_constexpr(1, 4):
            cute.arch.mbarrier_wait(g.sm.mbx + j, h)
        for j in cutlass.range_constexpr(1, 4):
            g.tr.mark(trace.GROUP_X_IN, plus=4 * h + j)
        ds = g.core.wg_pass(g.st, g.sm.xs, GROUP * 3, 1)
        for j in cutlass.range_constexpr(1, 4):
            g.tr.mark(trace.GROUP_DONE, plus=4 * h + j, after=ds[j - 1][0])
        if cutlass.const_expr(h == 0 and g.core.groups > 4):
            cute.arch.sync_threads()
            for j in cutlass.range_constexpr(1, 4):
                if j + 4 < groups and g.tid < GROUP:
                    g.core.fill(g.sm.xs, g.sm.mbx, g.x, g.q, j + 4, g.m, g.tid)
        for j in cutlass.range_constexpr(1, 4):
            g.core.send_partials(g.sm, ds[j - 1], 4 * h + j, g.rank, g.tid)

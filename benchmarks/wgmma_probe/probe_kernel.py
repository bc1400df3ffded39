"""A research probe (a flint-aot plugin kernel, never part of Flint's bundle): the token stream's MMA work on
one CTA's weights, with the weights in registers as the stream holds them, done by `mma.sync` (today's
stream) or by `wgmma` with A from registers and x (the MMA's B, the tokens its N) from shared memory.

It answers two questions before a wgmma stream is built (docs/kernels.md §2.5, BENCHMARKS.md §2):
* bits: does a chain of `wgmma.m64nNk16` add exactly what a chain of `mma.sync.m16n8k16` adds, given the same
  A fragments, the same k permutation and the same order? (If so, a wgmma stream leaves every token's sum,
  and the 8-token kernels, as they are.)
* rate: how long do 64 tokens' MMAs take on an SM holding 1, 2 or 3 such CTAs, each way?
(Answers, measured on the H200, in BENCHMARKS.md §2, step 9.)

One CTA: 128 threads (one warpgroup), 64 weight rows x one K quarter (512 k) of w [64, 512] bf16, loaded into
registers exactly as the stream does (warp w: rows 16 w .. 16 w + 15; mma.py's block order and k
permutation); x [32, 512] bf16 staged once into shared memory (token n reads row n % 32, so that three CTAs
of every mode fit an SM); then `reps` times the 8 groups of 8 tokens, each group's fp32 sums stored to
out[cta, row, token]. The spec: `mode` and `ctas`, the register budget
(`.minnctapersm`: 168 registers for 3 CTAs per SM, 255 for 2). Modes:
* `mma`: mma.mma_partials' sequence per group (x rows padded, fragments by ld.shared);
* `wg8`, `wg16`, `wg32`: wgmma m64nNk16 over N = 8, 16, 32 tokens at a time, two accumulator chains (the
  block's MMA 0 and MMA 1, as mma.sync's acc[0] / acc[1]) added at the end, x staged in the canonical
  no-swizzle K-major layout with mma.py's k permutation applied (see stage_wg);
* `wg16s`, `wg32s`: the same two chains one after the other (chain 0's sums parked in shared memory, as a
  sender would ship them to their owner): half the accumulator registers;
* `h8q`, `h8h`, `h16q`, `h16h`, `h32h`: hybrid, N = 8, 16 or 32, the A fragments of the last 4 (q) or 8 (h)
  of the 16 blocks written once into shared memory by the threads that loaded them (the same k permutation),
  those wgmma reading A from there (16 or 32 KB a CTA): 32 or 64 registers freed.
ptxas serializes the wgmma (C7512, a wait after every one) when the registers do not suffice: wg16 and wg16s
need 176, wg32 and wg32s 192 (the accumulators halved change nothing), so at 168 all four run serialized.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot import Kernel
from flint_aot.kernels.device import lanes
from flint_aot.kernels.mma import SharedX, as_f32, as_i32, ld_act, ld_shared, ld_weight, mma_partials
from flint_aot.kernels.wgmma import wg_desc, wg_fence, wg_wait, wgmma_rs, wgmma_ss

KQ = 512  # k per CTA (one quarter)
NB = KQ // 32  # 32-wide blocks
TOK = 64  # tokens
TOKX = 32  # rows of x staged: token n reads row n % TOKX (3 CTAs of the hybrid modes fit an SM)
ROWS = 64
XR = KQ + 32  # mma mode: padded x row (elements), as the stream's ring
CORE = 128  # bytes of one core matrix (8 tokens x 16 B)
GROUP_BYTES = NB * 4 * CORE  # 8 tokens x 512 k in the canonical layout (8 KB)
MODES = {
    "mma": 8,
    "wg8": 8,
    "wg16": 16,
    "wg32": 32,
    "wg16s": 16,
    "wg32s": 32,
    "h8q": 8,
    "h8h": 8,
    "h16q": 16,
    "h16h": 16,
    "h32h": 32,
}
SMEM_BLOCKS = {
    "h8q": 4,
    "h8h": 8,
    "h16q": 4,
    "h16h": 8,
    "h32h": 8,
}  # hybrid modes: the last blocks' A fragments from shared memory


def ld_word(ptr):
    """4 bytes (2 bf16) of x."""
    return cute.arch.inline_ptx("ld.global.u32 {$w0}, [{$r0}];", write_only_types=[Int32],
                                read_only_args=[ptr])  # fmt: skip


def st_shared(ptr, v):
    cute.arch.inline_ptx("st.shared.v4.u32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};", read_only_args=[ptr, *v])


class WgmmaProbe(Kernel):
    block = (128, 1, 1)

    def __init__(self, spec: dict):
        if set(spec) != {"mode", "ctas"} or spec["mode"] not in MODES or spec["ctas"] not in (2, 3):
            raise ValueError(f"spec must be {{'mode': one of {sorted(MODES)}, 'ctas': 2 or 3}}, got {spec!r}")
        self.mode = spec["mode"]
        self.min_ctas_per_sm = spec["ctas"]  # the register budget: 168 (3 CTAs per SM) or 255 (2)
        self.n = MODES[self.mode]
        self.seq = self.mode.endswith("s")  # the two chains one after the other (chain 0 parked in smem)
        self.ns = SMEM_BLOCKS.get(self.mode, 0)
        self.a_off = TOKX // 8 * GROUP_BYTES + self.seq * 128 * 64  # A's blocks in shared memory (hybrid)
        self.dyn_smem = TOKX * XR * 2 if self.mode == "mma" else self.a_off + self.ns * ROWS * 64

    def ptr_types(self) -> dict:
        return {"out": (Float32, 16)}

    def stage_mma(self, xs, x, tid):
        for it in range(TOKX * (KQ // 8) // 128):
            idx = tid + it * 128
            n, c = idx // (KQ // 8), idx % (KQ // 8)
            st_shared(xs + (n * XR + c * 8), ld_act(x + (n * KQ + c * 8)))

    def stage_wg(self, xs, x, tid):
        """Token n, block b: its 16 words (2 k each) W[0..15] go to 4 core-matrix rows: chunk (j, c) of the
        block holds words 4 i + 2 j + c, i = 0..3, i.e. k = 32 b + 8 i + 4 j + 2 c + {0, 1}: the k that
        mma.sync MMA j of the block pairs with A's slots 2 i, 2 i + 1 (c = 0) and 2 i + 8, 2 i + 9 (c = 1).
        Chunk q = 4 b + 2 j + c of token n sits at (n // 8) * 8 KB + q * 128 + (n % 8) * 16 bytes."""
        xb = xs.toint()
        for it in range(TOKX * NB * 4 // 128):
            idx = tid + it * 128
            n, b, j, c = idx // (NB * 4), idx // 4 % NB, idx // 2 % 2, idx % 2
            src = x + (n * KQ + b * 32 + 4 * j + 2 * c)
            v = [ld_word(src + 8 * i) for i in range(4)]
            off = (n // 8) * GROUP_BYTES + (4 * b + 2 * j + c) * CORE + (n % 8) * 16
            st_shared(xb + off, v)
        return xb

    @cute.kernel
    def kernel(self, w: cute.Pointer, x: cute.Pointer, out: cute.Pointer, reps: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp, _, g, t = lanes(tid)
        wa = w + ((16 * warp + g) * KQ + t * 8)
        A = [(ld_weight(wa + b * 32), ld_weight(wa + (8 * KQ + b * 32))) for b in range(NB)]
        xs = cute.arch.get_dyn_smem(BFloat16, alignment=1024)
        ob = Int64(cta) * (ROWS * TOK) + (16 * warp + g) * TOK + 2 * t
        if cutlass.const_expr(self.mode == "mma"):
            self.stage_mma(xs, x, tid)
            cute.arch.sync_threads()
            for r in range(reps):
                for G in range(8):
                    self.group_mma(A, xs, out, ob, (G + r) % 8, g, tid)
        else:
            xb = self.stage_wg(xs, x, tid)
            abase = self.park_a(A, xb, warp, g, t)
            cute.arch.sync_threads()
            cute.arch.fence_proxy("async.shared", space="cta")  # generic stores -> the async proxy's reads
            # no-swizzle K-major descriptor: start >> 4, LBO (next core matrix in k) 128 B, SBO (next 8
            # tokens) one group, 8 KB
            dbase = wg_desc(xb, GROUP_BYTES)
            passes = TOK // self.n
            park = xb + TOKX // 8 * GROUP_BYTES + tid * 64  # wg16s / wg32s: chain 0's sums of this thread
            for r in range(reps):
                for P in cutlass.range(passes, unroll=1):
                    if cutlass.const_expr(self.seq):
                        self.pass_wg_seq(A, dbase, out, ob, (P + r) % passes, park)
                    else:
                        self.pass_wg(A, dbase, out, ob, (P + r) % passes, abase)

    def group_mma(self, A, xs, out, ob, gg, g, tid):
        """One group of 8 tokens: mma.mma_partials itself, x from the padded rows."""
        d = mma_partials(A, SharedX(xs, XR, None), (gg * 8 + g) % TOKX, tid, Int32(0), kx=0)
        self.store(out, ob + gg * 8, d)

    def park_a(self, A, xb, warp, g, t):
        """Hybrid modes: the A fragments of the last `ns` blocks into shared memory, in the canonical
        K-major layout with the same k permutation as x (chunk 4 b' + 2 j + c of row r holds the row's words
        4 i + 2 j + c of block b, i = 0..3): lane (g, t) holds words 4 t + u of rows 16 w + g (+ 8), which go
        to word slot t of chunk 4 b' + u. Row group r // 8 every ns * 512 B. Returns the descriptor base."""
        if cutlass.const_expr(self.ns == 0):
            return None
        sbo = self.ns * 4 * CORE
        for bb in range(self.ns):
            lo, hi = A[NB - self.ns + bb]
            for h, regs in enumerate((lo, hi)):
                r = 16 * warp + g + 8 * h
                for u in range(4):
                    off = self.a_off + (r // 8) * sbo + (4 * bb + u) * CORE + (r % 8) * 16 + t * 4
                    cute.arch.inline_ptx("st.shared.b32 [{$r0}], {$r1};", read_only_args=[xb + off, regs[u]])
        a0 = xb + self.a_off
        return wg_desc(a0, sbo)

    def pass_wg(self, A, dbase, out, ob, pp, abase=None):
        """Tokens n pp .. n pp + n - 1 by wgmma, the same two chains and block order (hybrid: the last ns
        blocks' A from shared memory)."""
        n, z, one = self.n, Float32(0.0), Int32(1)
        acc = wg_fence([z] * n)
        acc = [acc[: n // 2], acc[n // 2 :]]
        for b in range(NB):
            lo, hi = A[b]
            for j in range(2):
                desc = dbase + Int64((pp * n % TOKX // 8 * GROUP_BYTES + (4 * b + 2 * j) * CORE) >> 4)
                if b >= NB - self.ns:
                    da = abase + Int64(((4 * (b - NB + self.ns) + 2 * j) * CORE) >> 4)
                    acc[j] = wgmma_ss(n, acc[j], da, desc, one)
                else:
                    a = (lo[2 * j], hi[2 * j], lo[2 * j + 1], hi[2 * j + 1])
                    acc[j] = wgmma_rs(n, acc[j], a, desc, one)
        flat = wg_wait(acc[0] + acc[1])
        d = [flat[i] + flat[n // 2 + i] for i in range(n // 2)]
        for blk in range(n // 8):
            self.store(out, ob + (pp * n + blk * 8), d[4 * blk : 4 * blk + 4])

    def pass_wg_seq(self, A, dbase, out, ob, pp, park):
        """As pass_wg, but chain 0 runs to the end and parks its sums (as a sender would ship them to their
        owner) before chain 1 starts: n / 2 accumulator registers instead of n. Same sums, same order."""
        n, z, one = self.n, Float32(0.0), Int32(1)
        for j in range(2):
            acc = wg_fence([z] * (n // 2))
            for b in range(NB):
                lo, hi = A[b]
                desc = dbase + Int64((pp * n % TOKX // 8 * GROUP_BYTES + (4 * b + 2 * j) * CORE) >> 4)
                acc = wgmma_rs(n, acc, (lo[2 * j], hi[2 * j], lo[2 * j + 1], hi[2 * j + 1]), desc, one)
            acc = wg_wait(acc)
            if j == 0:
                for i in range(n // 8):
                    st_shared(park + 16 * i, [as_i32(v) for v in acc[4 * i : 4 * i + 4]])
            else:
                for blk in range(n // 8):
                    c0 = [as_f32(v) for v in ld_shared(park + 16 * blk)]
                    self.store(out, ob + (pp * n + blk * 8), [c0[i] + acc[4 * blk + i] for i in range(4)])

    def store(self, out, off, d):
        """d0, d1: row g, tokens off + 0, 1; d2, d3: row g + 8 (8 x TOK words further): two 8-byte stores."""
        for h in range(2):
            ptr = out + (off + h * 8 * TOK)
            cute.arch.inline_ptx("st.global.v2.f32 [{$r0}], {{$r1}, {$r2}};",
                                 read_only_args=[ptr, d[2 * h], d[2 * h + 1]])  # fmt: skip


KERNEL = WgmmaProbe

"""Input RMSNorm of hidden size K (docs/numerics.md §1, docs/kernels.md §1): `rms_norm`, `fused_add_rms_norm`.

One CTA of K / 8 threads per token row (256 at K = 2048); each thread owns 8 consecutive elements (one 16-byte
load per operand).
The kernel releases its PDL dependents at its very start, so the qkv GEMV behind it can start streaming its
weights at once, and waits (griddepcontrol.wait) before it reads x or the residual, so it may itself be
launched as a PDL dependent of whatever wrote them. The arithmetic is device.norm_*: the qkv kernel's
prologue variant rounds exactly the same way. xn is written in the layout its three strides give
(loader.abi.xn_strides): plain rows for the ops; for the two-kernel design, the layout of the shared memory
the qkv kernel copies it into (the 8-token kernels' padded rows, the token stream's ring), and for an NVFP4
qkv kernel each 8 elements in its MMA pair order (xn_pairs, loader.abi.xn_pairs).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flint_aot.kernels import device, trace
from flint_aot.kernels.compile import Kernel
from flint_aot.kernels.device import NORM_VEC, NORM_WARP_K
from flint_aot.kernels.diagnostics import SERVING, Diagnostics
from loader.abi import TOKEN_GROUP, spec_hidden


class NormKernel(Kernel):
    """The input norm of one specialization: residual on/off and the hidden size, set once (and, in a
    diagnostic build, a slow producer's spin or the timeline's trace points)."""

    kind = "norm"

    def __init__(self, spec: dict, arch: str, diag: Diagnostics = SERVING):
        self.arch, self.diag = arch, diag
        self.residual = bool(spec["residual"])
        self.k = spec_hidden(spec)
        self.block = (self.k // NORM_VEC, 1, 1)  # one thread per 8-element chunk
        self.warps = self.k // NORM_WARP_K
        self.quarter_chunks = self.k // 4 // NORM_VEC  # threads per K quarter of a row
        # > 0: busy-wait this many clock cycles before writing the outputs (a slow producer, used to prove
        # that a dependent kernel waits for it)
        self.spin = diag.norm_spin_cycles

    def entry_point(self):
        return self.kernel_traced if self.diag.timeline else self.kernel

    @cute.kernel
    def kernel(self, x: cute.Pointer, residual: cute.Pointer, residual_out: cute.Pointer, xn: cute.Pointer,
               weight: cute.Pointer, eps: Float32, xn_group: Int32, xn_row: Int32, xn_quarter: Int32,
               xn_pairs: Int32):  # fmt: skip
        self.body(x, residual, residual_out, xn, weight, eps, xn_group, xn_row, xn_quarter, xn_pairs, None)

    @cute.kernel
    def kernel_traced(self, x: cute.Pointer, residual: cute.Pointer, residual_out: cute.Pointer,
                      xn: cute.Pointer, weight: cute.Pointer, eps: Float32, xn_group: Int32, xn_row: Int32,
                      xn_quarter: Int32, xn_pairs: Int32, trace: cute.Pointer):  # fmt: skip
        """The timeline build's entry: a trace buffer of 8 words a row after the parameters."""
        self.body(x, residual, residual_out, xn, weight, eps, xn_group, xn_row, xn_quarter, xn_pairs, trace)

    @cute.jit
    def body(self, x, residual, residual_out, xn, weight, eps, xn_group, xn_row, xn_quarter, xn_pairs, buf):
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp, lane, _, _ = device.lanes(tid)
        cute.arch.griddepcontrol_launch_dependents()
        tr = trace.Trace(buf is not None, buf, row, trace.NORM_WORDS, tid, row)
        tr.mark(trace.NORM_START)
        tr.smid(trace.NORM_SMID)
        off = cute.assume(row * self.k + tid * NORM_VEC, divby=NORM_VEC)
        w = device.load_vec(weight + tid * NORM_VEC, NORM_VEC)  # a model constant: read before the wait
        cute.arch.griddepcontrol_wait()
        res = device.load_vec(residual + off, NORM_VEC) if cutlass.const_expr(self.residual) else None
        tr.mark(trace.NORM_WAITED)
        r, ss = device.norm_residual(device.load_vec(x + off, NORM_VEC), res)
        ss = cute.arch.warp_reduction_sum(ss)
        red = cute.make_tensor(cute.arch.alloc_smem(Float32, self.warps, alignment=16),
                               cute.make_layout(self.warps))  # fmt: skip
        if lane == 0:
            red[warp] = ss
        cute.arch.sync_threads()
        tr.mark(trace.NORM_REDUCED)
        y = device.norm_apply(r, device.norm_scale([red[i] for i in range(self.warps)], eps), w)
        if cutlass.const_expr(self.spin > 0):
            device.spin_cycles(self.spin)
        # (the layout of xn: loader.abi.xn_strides; a thread's 8 elements never straddle a quarter)
        xo = ((row // TOKEN_GROUP) * xn_group + (row % TOKEN_GROUP) * xn_row
              + (tid // self.quarter_chunks) * xn_quarter + (tid % self.quarter_chunks) * NORM_VEC)
        if xn_pairs == 2:  # the wgmma stream's 128-byte swizzled tiles (loader.abi.WG_STRIDES)
            self.store_wg(xn, y, row, tid, xn_group, xn_row, xn_quarter, False)
        elif xn_pairs == 3:  # the same tiles, BF16's k order
            self.store_wg(xn, y, row, tid, xn_group, xn_row, xn_quarter, True)
        elif xn_pairs != 0:  # (loader.abi.xn_pairs: the NVFP4 qkv kernel's MMA pair order)
            device.store_vec(xn + cute.assume(xo, divby=NORM_VEC), device.mma_pairs(y), NORM_VEC)
        else:
            device.store_vec(xn + cute.assume(xo, divby=NORM_VEC), y, NORM_VEC)
        if cutlass.const_expr(self.residual):
            device.store_vec(residual_out + off, r.to(cutlass.BFloat16), NORM_VEC)
        tr.mark(trace.NORM_STORED, after=y[0].to(Float32))

    def ptr_types(self) -> dict:
        return {"trace": (Int32, 4)} if self.diag.timeline else {}

    def store_wg(self, xn, y, row, tid, xn_group, xn_row, xn_quarter, bf16: bool):
        """xn in the wgmma stream's layout (loader.abi.WG_STRIDES). NVFP4: this thread's chunk (k0 = 512 q +
        128 c + 32 t + 8 u') is what lane t of a quad reads at MMA step i = 4 c + (u' ^ (t & 2)); BF16: k0 =
        512 q + 32 i + 8 t, lane t's at step i (k block i). Its MMA pair j (NVFP4's pair order, BF16's plain
        pairs) goes to word t of the step's logical 16-byte chunk 4 i + j of the token's row. The 4 threads of
        a step (NVFP4: lanes 4 t + (u ^ (t & 2)) of a 16-lane half; BF16: 4 consecutive lanes) swap words by
        3 butterfly shuffles (round r: lane ^ (4 r ^ (r & 2)), BF16 lane ^ r: the thread of t ^ r), so that
        thread t writes chunk 4 i + t whole, 16 bytes at
        (chunk // 8) KB + token * 128 + ((chunk % 8) ^ token) * 16 bytes: every 128-byte line is one token's
        (written as 4-byte pieces into lines shared by 8 tokens' CTAs, xn cost more than the wgmma gained:
        docs/kernels.md §2.6)."""
        tq, i = wg_step(tid % self.quarter_chunks, bf16)
        p = cute.make_rmem_tensor(cute.make_layout(NORM_VEC), cutlass.BFloat16)
        p.store(y if bf16 else device.mma_pairs(y))
        w = cute.recast_tensor(p, Int32)
        words = [w[j] for j in range(4)]
        out = list(words)
        for r in range(1, 4):
            give = words[3]
            for j in range(3):  # words[tq ^ r]
                give = cutlass.select_((tq ^ r) == j, words[j], give)
            got = cute.arch.shuffle_sync_bfly(give, wg_partner(r, bf16))
            for j in range(4):
                out[j] = cutlass.select_((tq ^ r) == j, got, out[j])
        c = 4 * i + tq
        n = row % TOKEN_GROUP
        block = (row // TOKEN_GROUP) * xn_group + (tid // self.quarter_chunks) * xn_quarter
        off = wg_offset(block, c, n, xn_row)
        o = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        for j in range(4):
            o[j] = out[j]
        dst = cute.recast_ptr(xn + cute.assume(off, divby=NORM_VEC), dtype=Int32)
        cute.autovec_copy(o, cute.make_tensor(dst, cute.make_layout(4)))


# The index arithmetic of store_wg, on Python or DSL integers (tests/test_gemv_layout.py runs it on ints)
def wg_step(cq, bf16: bool):
    """(t, i) of a norm thread's chunk cq (0..63) of a K quarter: it holds the 8 k that lane t of a quad
    reads at MMA step i (NVFP4: chunk 4 c + t of 32 k, word u, read at step 4 c + (u ^ (t & 2)); BF16: k
    block i)."""
    if bf16:
        tq = cq % 4
        i = cq // 4
    else:
        tq = (cq // 4) % 4
        i = (cq // 16) * 4 + ((cq % 4) ^ (tq & 2))
    return tq, i


def wg_partner(r: int, bf16: bool) -> int:
    """The lane xor of shuffle round r (1..3): the thread of the same step whose t is this one's t ^ r."""
    return r if bf16 else 4 * r ^ (r & 2)


def wg_offset(block, c, n, xn_row):
    """Element offset of logical 16-byte chunk c of token n's row, in the 8 KB of its group and quarter at
    `block`: atom c // 8, row n, chunk (c % 8) ^ n (the 128-byte swizzle)."""
    return block + (c // 8) * (TOKEN_GROUP * xn_row) + n * xn_row + ((c % 8) ^ n) * NORM_VEC


KERNEL = NormKernel

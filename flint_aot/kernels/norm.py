"""Input RMSNorm for K = 2048 (SPEC §3.1, §5): `rms_norm` and `fused_add_rms_norm`.

One CTA of 256 threads per token row; each thread owns 8 consecutive elements (one 16-byte load
per operand). The kernel releases its PDL dependents at its very start, so the qkv GEMV behind it
can start streaming its weights at once, and waits (griddepcontrol.wait) before it reads x or the
residual, so it may itself be launched as a PDL dependent of whatever wrote them.

Numerics: r = bf16(x + residual) (or x); s = rsqrt(mean(r²) + eps) with fp32 statistics over the
rounded r; xn = bf16(bf16(r·s)·w); residual_out = r.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from flint_aot.kernels import common

K = 2048
THREADS = 256
VEC = 8  # bf16 per thread = 16 bytes
WARPS = THREADS // 32
assert THREADS * VEC == K

PARAMS = (
    ("x", "ptr"),
    ("residual", "ptr"),
    ("residual_out", "ptr"),
    ("xn", "ptr"),
    ("weight", "ptr"),
    ("eps", "f32"),
)


def make_kernel(residual: bool, entry_prefix: str, spin: int = 0):
    """spin > 0 builds a debug kernel that busy-waits `spin` clock cycles before writing its outputs
    (a slow producer, used to prove that a dependent kernel waits for it)."""

    @cute.kernel
    def norm(
        x: cute.Pointer,
        res: cute.Pointer,
        res_out: cute.Pointer,
        xn: cute.Pointer,
        weight: cute.Pointer,
        eps: Float32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp = tid // 32  # plain arithmetic: cute.arch.warp_idx() is a full-warp shfl.sync, which
        lane = tid % 32  # deadlocks when called inside a lane-divergent branch
        cute.arch.griddepcontrol_launch_dependents()
        off = cute.assume(row * K + tid * VEC, divby=VEC)
        w = common.load_vec(weight + tid * VEC, VEC)  # not written by any predecessor
        cute.arch.griddepcontrol_wait()
        r = common.load_vec(x + off, VEC).to(Float32)
        if cutlass.const_expr(residual):
            r = (r + common.load_vec(res + off, VEC).to(Float32)).to(BFloat16).to(Float32)
        ss = (r * r).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        ss = cute.arch.warp_reduction_sum(ss)
        red = cute.make_tensor(cute.arch.alloc_smem(Float32, WARPS, alignment=16), cute.make_layout(WARPS))
        if lane == 0:
            red[warp] = ss
        cute.arch.sync_threads()
        total = red[0]
        for i in cutlass.range_constexpr(1, WARPS):
            total = total + red[i]
        s = cute.math.rsqrt(total * Float32(1.0 / K) + eps)
        y = ((r * s).to(BFloat16).to(Float32) * w.to(Float32)).to(BFloat16)
        if cutlass.const_expr(spin > 0):
            common.spin_cycles(spin)
        common.store_vec(xn + off, y, VEC)
        if cutlass.const_expr(residual):
            common.store_vec(res_out + off, r.to(BFloat16), VEC)

    norm.set_name_prefix(entry_prefix, remove_cutlass_symbol=True, keep_mangled_name=False)

    @cute.jit
    def host(
        x: cute.Pointer,
        res: cute.Pointer,
        res_out: cute.Pointer,
        xn: cute.Pointer,
        weight: cute.Pointer,
        eps: Float32,
        stream,
    ):
        norm(x, res, res_out, xn, weight, eps).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1], use_pdl=True, stream=stream
        )

    return host


def compile(spec: dict, arch: str, entry_prefix: str) -> common.Compiled:
    host = make_kernel(bool(spec["residual"]), entry_prefix, int(spec.get("debug_spin_cycles", 0)))
    args = common.fake_args(PARAMS, cutlass.BFloat16)
    return common.compile_host(
        host,
        args,
        arch=arch,
        params=PARAMS,
        block=(THREADS, 1, 1),
        cluster=(1, 1, 1),
        grid=("M", 1, 1),
        dyn_smem=0,
    )

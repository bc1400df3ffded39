"""What every fused qkv kernel shares (docs/kernels.md §2-§3): its specialization's configuration, its
parameter list and the thread's coordinates. The work of a kernel is its subclass's: `Tile8Qkv` (M <= 8,
qkv_tile8.py) or `StreamQkv` (tiles 16, 32, 64: the token stream, qkv_stream.py).

One parameter list serves every fused kernel (the ABI the manifest records by name): a two-kernel design's
kernel reads its activations from `x` (the loader passes xn there) and ignores residual, residual_out,
norm_weight, has_residual and eps.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from flint_aot.kernels import trace
from flint_aot.kernels.compile import Kernel
from flint_aot.kernels.diagnostics import SERVING, Diagnostics
from flint_aot.kernels.epilogue import HeadEpilogue
from flint_aot.kernels.mma import ROWS, THREADS
from loader.abi import CLUSTER, hidden_refusal, spec_hidden, xn_pairs

R = ROWS


@dataclass(frozen=True)
class Thread:
    """Who this thread is: its CTA, head (uniform over the cluster), rank in the cluster, and, after the
    quarters' sum of the 8-token kernel, its row r (within the row block), token tk and head dim."""

    tid: object
    cta: object
    head: object
    rank: object
    is_v: object
    r: object
    tk: object
    dim: object
    tr: trace.Trace


class QkvKernel(Kernel):
    """A fused qkv kernel of one specialization, for one architecture; its configuration is set here, once."""

    kind, block, cluster = "qkv", (THREADS, 1, 1), (CLUSTER, 1, 1)

    def __init__(self, spec: dict, arch: str, diag: Diagnostics = SERVING):
        assert spec["weight_format"] in ("bf16", "nvfp4"), spec
        self.arch, self.diag = arch, diag
        self.fp4 = spec["weight_format"] == "nvfp4"
        self.rope = bool(spec["rope"])
        self.nq, self.nkv = spec["heads"]
        self.fp8 = spec.get("kv_cache_dtype", "bf16") == "fp8_e4m3"
        self.prologue = spec.get("norm") == "prologue"
        self.tile = spec.get("max_m", 8)  # tokens per call this build serves
        self.k = spec_hidden(spec)
        why = hidden_refusal("qkv", self.k, spec.get("norm", "separate"))
        assert why is None, f"hidden {self.k}: {why}"
        self.qk_norm = bool(spec.get("qk_norm", True))
        # NVFP4, two-kernel design: the norm kernel writes xn in the MMA pair order (loader.abi.xn_pairs), so
        # no warp permutes its x fragments
        self.paired = bool(xn_pairs(spec))
        self.epi = HeadEpilogue(self.nq, self.nkv, self.rope, self.fp8, self.tile, self.qk_norm)

    @cute.kernel
    def kernel(
        self, x: cute.Pointer, residual: cute.Pointer, residual_out: cute.Pointer, norm_weight: cute.Pointer,
        weight: cute.Pointer, weight_scale: cute.Pointer, global_scale: cute.Pointer,
        q_norm_weight: cute.Pointer, k_norm_weight: cute.Pointer, cos_sin_cache: cute.Pointer,
        positions: cute.Pointer, slot_mapping: cute.Pointer, q: cute.Pointer, k_cache: cute.Pointer,
        v_cache: cute.Pointer, k_scale: cute.Pointer, v_scale: cute.Pointer,
        m: Int32, has_residual: Int32, num_slot_mapping: Int32, max_pos: Int32, block_size: Int32,
        num_cache_slots: Int64, stride_block: Int64, stride_slot: Int64, stride_head: Int64,
        eps: Float32, qk_eps: Float32,
    ):  # fmt: skip
        a = SimpleNamespace(**{k: v for k, v in locals().items() if k != "self"})  # the parameters, by name
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()
        # a timeline build's stamps of this CTA go into v_scale (a BF16-cache build never reads it)
        tr = trace.Trace(self.diag.timeline, v_scale, cta, trace.QKV_WORDS, tid, m)
        tr.mark(trace.START)
        tr.smid(trace.SMID)
        head = cta // CLUSTER  # uniform over the cluster
        rank = cute.arch.block_idx_in_cluster()
        is_v = head >= self.nq + self.nkv
        r = tid % R  # after the quarters' sum: this thread's row (within the row block) and token
        tk = tid // R
        self.body(a, Thread(tid, cta, head, rank, is_v, r, tk, rank * R + r, tr))

    def body(self, a, t: Thread):
        raise NotImplementedError

    def ptr_types(self) -> dict:
        """Element type and assumed alignment (bytes) of the pointers that are not bf16 16-byte aligned."""
        cache = (cutlass.Uint8, 1) if self.fp8 else (BFloat16, 2)
        return {
            "weight": (cutlass.Uint8 if self.fp4 else BFloat16, 16), "weight_scale": (cutlass.Uint8, 4),
            "global_scale": (Float32, 4), "cos_sin_cache": (Float32, 16), "positions": (Int64, 8),
            "slot_mapping": (Int64, 8), "k_cache": cache, "v_cache": cache, "k_scale": (Float32, 4),
            "v_scale": (Float32, 4),
        }  # fmt: skip

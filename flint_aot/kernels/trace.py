"""Named instrumentation points: where a timeline build (the config's `diagnostics: {timeline: true}`,
docs/config.md) stamps the global timer, read back by tools/timeline.py. In any other build a point compiles
to nothing, so the cubins are exactly those of the kernels without it.

A kernel makes one `Trace` per CTA and hands it to its parts; each point is one 32-bit word of that CTA's
row of a trace buffer, stored by the thread whose `who` is 0, with the low half of %globaltimer (ns) read
once the value the point depends on is known (a run-time zero: ptxas cannot move the read above it).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm

from flint_aot.kernels.device import f32_bits
from flint_aot.kernels.trace_layout import (  # noqa: F401  (the points, by name: trace.X_IN, ..)
    EXCHANGED,
    GEMV_DONE,
    GROUP_DONE,
    GROUP_X_IN,
    NORM_REDUCED,
    NORM_SMID,
    NORM_START,
    NORM_STORED,
    NORM_WAITED,
    NORM_WORDS,
    QKV_WORDS,
    SMID,
    START,
    STORED,
    WAIT_RETURNED,
    WEIGHTS_IN,
    X_IN,
)


def _globaltimer(dep):
    asm = "{ .reg .pred p; setp.eq.u32 p, $1, 0; @p mov.u32 $0, %globaltimer_lo; @!p mov.u32 $0, 1; }"
    v = llvm.inline_asm(Int32.mlir_type, [Int32(dep).ir_value()], asm, "=r,r", has_side_effects=True)
    return Int32(v)


def _smid():
    return Int32(llvm.inline_asm(Int32.mlir_type, [], "mov.u32 $0, %smid;", "=r", has_side_effects=True))


def _store(who, ptr, val):
    llvm.inline_asm(None, [Int32(who).ir_value(), ptr.to_llvm_ptr(), Int32(val).ir_value()],
                    "{ .reg .pred p; setp.eq.u32 p, $0, 0; @p st.global.u32 [$1], $2; }", "r,l,r",
                    has_side_effects=True)  # fmt: skip


class Trace:
    """The points of one CTA: word w of row `row` of `buf` (an Int32 view of it), stored by `who == 0`; m is
    a run-time value in [0, 2**31) (m >> 31 is the zero that orders a read after nothing in particular).
    `on` False: every method emits nothing."""

    def __init__(self, on: bool, buf=None, row=None, words: int = 0, who=None, m=None):
        self.on, self.buf, self.row, self.words, self.who, self.m = on, buf, row, words, who, m

    def _at(self, word, plus=None):
        off = self.row * self.words + word
        return cute.recast_ptr(self.buf, dtype=Int32) + (off if plus is None else off + plus)

    def mark(self, word, *, plus=None, zero=None, after=None, wait=None, per_warp=False):
        """Stamp word `word` (+ plus, a run-time index): after `wait()` if given, with the timer read once
        `zero` (an Int32 zero) or the fp32 value `after` is known; per_warp: by lane 0 of every warp (the
        warp that gets there stores last)."""
        if not self.on:
            return
        if wait is not None:
            wait()
        if zero is None:
            zero = self.m >> 31
            if after is not None:
                zero = f32_bits(after) & zero  # (m >> 31 is 0: the read waits for `after`)
        _store(self.who % 32 if per_warp else self.who, self._at(word, plus), _globaltimer(zero))

    def smid(self, word):
        if self.on:
            _store(self.who, self._at(word), _smid())

    @cute.jit
    def at_group(self, i, target, word, minus_one: cutlass.Constexpr = False, wait=None,
                 per_warp: cutlass.Constexpr = False):  # fmt: skip
        """mark(word) only in group i == target (minus_one: target - 1)."""
        if cutlass.const_expr(self.on):
            if cutlass.const_expr(minus_one):
                target = target - 1
            if i == target:
                self.mark(word, wait=wait, per_warp=per_warp)


OFF = Trace(False)

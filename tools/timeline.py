"""Per-CTA timeline of the fused op under CUDA-graph replay: where a layer's time goes (BENCHMARKS.md §2, and
docs/benchmarks-history.md §1 "What bounds it"). A diagnostic, never a serving build.

1. On the CPU machine, instrument a copy of the kernels and build a small bundle from it:

       python3 tools/timeline.py instrument /tmp/tl
       (cd /tmp/tl && python3 -m flint_aot.cli build configs/timeline.yaml -o build/timeline)
       cp -r /tmp/tl/build/timeline build/timeline

   Thread 0 of every qkv CTA then writes %globaltimer (ns) at T0 start, T1 its weights arrived, T2 its
   griddepcontrol.wait returned, T3 the activations are in shared memory (the token stream: its first
   group's x), T4 the GEMV is done, T5 the q/k epilogue exchange is done (the token stream, which exchanges
   nothing after its sums: its last group's partial sums are in), T6 its last store is issued (and %smid),
   and in the token stream the end of each group's MMAs (two-kernel design: and the moment its x stage was
   in); the norm kernel T0 start, T1 wait returned, T2 reduced, T3 stored. The qkv kernel
   writes into `v_scale`, which a BF16-cache build never reads; the norm kernel gets a trailing `trace`
   parameter. Both are filled by this tool (the loader refuses the norm kernel's extra parameter on its own).
2. On the GPU:

       PYTHONPATH=. python3 tools/timeline.py run build/timeline 32x4:bf16:1:separate 16x2:nvfp4:8:separate

   Per layer (medians over the middle layers of a graph of L layers with distinct weights): the span from the
   layer's first wait-return to its last store, the gap from that to the next layer's first wait-return,
   phase medians per CTA (with the cluster's skew of wait-returns, and x's arrival counted from the cluster's
   last wait-return), and the norm kernel's part of the gap; in the token stream also the cluster's skew
   at its last group (the 8 CTAs' ends of their last MMAs, max - min), the last group's sums in counted from
   the cluster's last MMAs (the DSMEM hop) and its epilogue (T6 - T5), and a further
   group's time split in two: from its x in to its MMAs done (the fragments and MMAs), and from the previous
   group's MMAs to its x in (the ring's barrier and refill, the sends, the wait for the stage).
"""

# ruff: noqa: E501  (PATCHES holds kernel source lines as data)
from __future__ import annotations

import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_HELPERS = '''

def _tl_time(dep):
    """%globaltimer_lo, read once dep (an Int32 that is 0 at run time) is known (timeline builds only)."""
    from cutlass._mlir.dialects import llvm as _llvm

    asm = "{ .reg .pred p; setp.eq.u32 p, $1, 0; @p mov.u32 $0, %globaltimer_lo; @!p mov.u32 $0, 1; }"
    return Int32(_llvm.inline_asm(Int32.mlir_type, [Int32(dep).ir_value()], asm, "=r,r", has_side_effects=True))


def _tl_smid():
    from cutlass._mlir.dialects import llvm as _llvm

    return Int32(_llvm.inline_asm(Int32.mlir_type, [], "mov.u32 $0, %smid;", "=r", has_side_effects=True))


def _tl_store(tid, ptr, val):
    """Thread 0 stores the u32 val at ptr."""
    from cutlass._mlir.dialects import llvm as _llvm

    _llvm.inline_asm(None, [Int32(tid).ir_value(), ptr.to_llvm_ptr(), Int32(val).ir_value()],
                     "{ .reg .pred p; setp.eq.u32 p, $0, 0; @p st.global.u32 [$1], $2; }", "r,l,r",
                     has_side_effects=True)
'''

# (file, anchor, replacement): each anchor must occur exactly once
# trace words per qkv CTA: T0..T6, %smid, then the token stream's groups' MMA ends (8 + i) and, in the
# two-kernel design, the moments their x was in (16 + i)
SLOTS = 32
_QKV_AT = f"v_scale + (cta * {SLOTS} + {{}})"
_T_AT = f"a.v_scale + (t.cta * {SLOTS} + {{}})"
_GROUP_END = f"                _tl_store(t.tid, {_T_AT.format('8 + i')}, _tl_time(core.runtime_zero([device.f32_bits(d[0])], a.m)))\n"
PATCHES = [
    ("flint_aot/kernels/gemv_core.py", "K = HIDDEN\n", "K = HIDDEN\nTRACE_CB = None  # timeline builds\n"),
    (
        "flint_aot/kernels/gemv_core.py",
        '    st["zero"] = runtime_zero(flat, m)\n',
        '    st["zero"] = runtime_zero(flat, m)\n    if TRACE_CB is not None:\n        TRACE_CB(st["zero"])\n',
    ),
    ("flint_aot/kernels/qkv.py", "R = core.ROWS\n", "R = core.ROWS\n" + _HELPERS),
    (
        "flint_aot/kernels/qkv.py",
        "        cute.arch.griddepcontrol_launch_dependents()\n        head = cta // CLUSTER",
        "        cute.arch.griddepcontrol_launch_dependents()\n        tz = m >> 31\n"
        f"        _tl_store(tid, {_QKV_AT.format(0)}, _tl_time(tz))\n"
        f"        _tl_store(tid, {_QKV_AT.format(7)}, _tl_smid())\n"
        f"        core.TRACE_CB = lambda z: _tl_store(tid, {_QKV_AT.format(1)}, _tl_time(z))\n"
        "        head = cta // CLUSTER",
    ),
    # the 8-token kernel: T2 wait returned, T3 activations in, T4 GEMV done, T6 epilogue issued
    (
        "flint_aot/kernels/qkv.py",
        "        if cutlass.const_expr(self.fp4):\n            self.activations(a, t, s)\n",
        "        if cutlass.const_expr(self.fp4):\n            self.activations(a, t, s)\n"
        f"        _tl_store(t.tid, {_T_AT.format(2)}, _tl_time(wst['zero']))\n",
    ),
    (
        "flint_aot/kernels/qkv.py",
        "        acc = self.gemv.sums(wst, core.SharedX(s.xs, self.xrow, s.mbx), a.m, t.tid)\n",
        "        cute.arch.mbarrier_wait(s.mbx, 0)\n"
        f"        _tl_store(t.tid, {_T_AT.format(3)}, _tl_time(a.m >> 31))\n"
        "        acc = self.gemv.sums(wst, core.SharedX(s.xs, self.xrow, s.mbx), a.m, t.tid)\n"
        f"        _tl_store(t.tid, {_T_AT.format(4)}, _tl_time(core.runtime_zero([device.f32_bits(acc)], a.m)))\n",
    ),
    (
        "flint_aot/kernels/qkv.py",
        "        self.epilogue_finish(a, t, buf, hv, 0, scale, e, wn, wp)\n",
        "        self.epilogue_finish(a, t, buf, hv, 0, scale, e, wn, wp)\n"
        f"        _tl_store(t.tid, {_T_AT.format(6)}, _tl_time(core.runtime_zero([device.f32_bits(hv)], a.m)))\n",
    ),
    # both: T5 the (last) q/k exchange done
    (
        "flint_aot/kernels/qkv.py",
        "            cute.arch.mbarrier_wait(buf[2], 0)\n",
        "            cute.arch.mbarrier_wait(buf[2], 0)\n"
        f"            _tl_store(t.tid, {_T_AT.format(5)}, _tl_time(a.m >> 31))\n",
    ),
    # the token stream: T2, T3 the first group's x in, each group's MMAs done (words 8 + i), T6
    (
        "flint_aot/kernels/qkv.py",
        "            self.stream_park(a, t, s, st)\n        scale = self.cache_scale(a, t)\n",
        "            self.stream_park(a, t, s, st)\n        scale = self.cache_scale(a, t)\n"
        f"        _tl_store(t.tid, {_T_AT.format(2)}, _tl_time(st['zero']))\n",
    ),
    (
        "flint_aot/kernels/qkv.py",
        "                d = self.core.partials(st, self.core.stage(s.xs, s.mbx, i), i, a.m, t.tid)\n",
        "                if i == 0:\n"
        "                    cute.arch.mbarrier_wait(s.mbx, 0)\n"
        f"                    _tl_store(t.tid, {_T_AT.format(3)}, _tl_time(a.m >> 31))\n"
        "                xi = self.core.stage(s.xs, s.mbx, i)\n"
        f"                _tl_store(t.tid, {_T_AT.format('16 + i')}, _tl_time(a.m >> 31))\n"
        "                d = self.core.partials(st, xi, i, a.m, t.tid)\n" + _GROUP_END,
    ),
    (
        "flint_aot/kernels/qkv.py",
        "                d = self.core.partials(st, self.core.stage(s.xs, s.mbx, i, wait=False), i, a.m, t.tid)\n",
        "                d = self.core.partials(st, self.core.stage(s.xs, s.mbx, i, wait=False), i, a.m, t.tid)\n"
        + _GROUP_END,
    ),
    # the wgmma stream (both formats, 32 and 64 tokens): group 4 h by mma.sync, then the pass of the other three (their
    # x in: after the pass's waits; their MMAs done: when the pass's sums are), and the mma.sync groups
    (
        "flint_aot/kernels/qkv.py",
        "        cute.arch.mbarrier_wait(s.mbx, h)\n        d = self.core.ring_partials(st, s.xs, 0, t.tid)\n",
        "        cute.arch.mbarrier_wait(s.mbx, h)\n"
        "        if cutlass.const_expr(h == 0):\n"
        f"            _tl_store(t.tid, {_T_AT.format(3)}, _tl_time(a.m >> 31))\n"
        f"        _tl_store(t.tid, {_T_AT.format('16 + 4 * h')}, _tl_time(a.m >> 31))\n"
        "        d = self.core.ring_partials(st, s.xs, 0, t.tid)\n"
        f"        _tl_store(t.tid, {_T_AT.format('8 + 4 * h')}, _tl_time(core.runtime_zero([device.f32_bits(d[0])], a.m)))\n",
    ),
    (
        "flint_aot/kernels/qkv.py",
        "        ds = self.core.wg_pass(st, s.xs, GROUP * 3, 1)\n",
        "".join(f"        _tl_store(t.tid, {_T_AT.format(f'16 + 4 * h + {j}')}, _tl_time(a.m >> 31))\n" for j in (1, 2, 3))
        + "        ds = self.core.wg_pass(st, s.xs, GROUP * 3, 1)\n"
        + "".join(f"        _tl_store(t.tid, {_T_AT.format(f'8 + 4 * h + {j}')}, "
                  f"_tl_time(core.runtime_zero([device.f32_bits(ds[{j - 1}][0])], a.m)))\n" for j in (1, 2, 3)),
    ),
    (
        "flint_aot/kernels/qkv.py",
        "                d = self.core.ring_partials(st, s.xs, stage, t.tid)\n",
        f"                _tl_store(t.tid, {_T_AT.format('16 + i')}, _tl_time(a.m >> 31))\n"
        "                d = self.core.ring_partials(st, s.xs, stage, t.tid)\n" + _GROUP_END,
    ),
    (
        "flint_aot/kernels/qkv.py",
        "                d = self.core.ring_partials(st, s.xs, i, t.tid)\n",
        "                if i == 0:\n"
        f"                    _tl_store(t.tid, {_T_AT.format(3)}, _tl_time(a.m >> 31))\n"
        f"                _tl_store(t.tid, {_T_AT.format('16 + i')}, _tl_time(a.m >> 31))\n"
        "                d = self.core.ring_partials(st, s.xs, i, t.tid)\n" + _GROUP_END,
    ),
    (  # the token stream's epilogue: T5 the CTA's last group's partial sums in, T6 its stores issued (lane 0
        # of the warp that takes the last group)
        "flint_aot/kernels/qkv.py",
        "            cute.arch.mbarrier_wait(s.mbr + i, 0)\n            rope = self.stream_rope(a, s, tok, lane)\n",
        "            cute.arch.mbarrier_wait(s.mbr + i, 0)\n"
        f"            if i == groups - 1:\n                _tl_store(t.tid % 32, {_T_AT.format(5)}, _tl_time(a.m >> 31))\n"
        "            rope = self.stream_rope(a, s, tok, lane)\n",
    ),
    (
        "flint_aot/kernels/qkv.py",
        "                            self.store_qk(a, t, tok, slot, ys[j], scale, dims[j])\n",
        "                            self.store_qk(a, t, tok, slot, ys[j], scale, dims[j])\n"
        f"            if i == groups - 1:\n                _tl_store(t.tid % 32, {_T_AT.format(6)}, _tl_time(a.m >> 31))\n",
    ),
    (
        "flint_aot/kernels/norm.py",
        "        xn_pairs: Int32,\n    ):",
        "        xn_pairs: Int32,\n        trace: cute.Pointer,\n    ):",
    ),
    (
        "flint_aot/kernels/norm.py",
        "        cute.arch.griddepcontrol_launch_dependents()\n",
        "        cute.arch.griddepcontrol_launch_dependents()\n        from flint_aot.kernels import gemv_core as _c\n"
        "        from flint_aot.kernels import qkv as _q\n\n        tz = row >> 31\n"
        "        _q._tl_store(tid, trace + (row * 8) * 2, _q._tl_time(tz))\n"
        "        _q._tl_store(tid, trace + (row * 8 + 7) * 2, _q._tl_smid())\n",
    ),
    (
        "flint_aot/kernels/norm.py",
        "        r, ss = device.norm_residual(",
        "        _q._tl_store(tid, trace + (row * 8 + 1) * 2, _q._tl_time(tz))\n        r, ss = device.norm_residual(",
    ),
    (
        "flint_aot/kernels/norm.py",
        "        y = device.norm_apply(",
        "        _q._tl_store(tid, trace + (row * 8 + 2) * 2, _q._tl_time(tz))\n        y = device.norm_apply(",
    ),
    (
        "flint_aot/kernels/norm.py",
        "            device.store_vec(residual_out + off, r.to(cutlass.BFloat16), NORM_VEC)\n",
        "            device.store_vec(residual_out + off, r.to(cutlass.BFloat16), NORM_VEC)\n"
        "        _q._tl_store(tid, trace + (row * 8 + 3) * 2,\n"
        "                     _q._tl_time(_c.runtime_zero([device.f32_bits(y[0].to(Float32))], tz)))\n",
    ),
]

CONFIG = """# tools/timeline.py: instrumented kernels (a diagnostic build, never for serving)
archs: [sm_90a]
norm:
  residual: [true, false]
qkv:
  weight_format: [bf16, nvfp4]
  rope: [true]
  heads: [[32, 4], [16, 8], [16, 2]]
  kv_cache_dtype: [bf16]
  norm: [separate]
"""


def instrument(dst: Path) -> None:
    if dst.exists():
        raise SystemExit(f"{dst} exists; give a new directory")
    dst.mkdir(parents=True)
    for d in ("flint_aot", "loader"):
        shutil.copytree(ROOT / d, dst / d, ignore=shutil.ignore_patterns("__pycache__"))
    (dst / "configs").mkdir()
    (dst / "configs" / "timeline.yaml").write_text(CONFIG)
    for rel, anchor, new in PATCHES:
        p = dst / rel
        s = p.read_text()
        if s.count(anchor) != 1:
            raise SystemExit(f"{rel}: anchor found {s.count(anchor)} times (the kernel changed; update PATCHES): "
                             f"{anchor.strip()[:60]!r}")  # fmt: skip
        p.write_text(s.replace(anchor, new))
    print(f"instrumented copy in {dst}; build it there: python3 -m flint_aot.cli build configs/timeline.yaml")


def run(bundle: str, specs: list[str]) -> None:
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_qkv import D, LayerChain

    import loader
    from loader import runtime

    cur = {"qkv": 0, "norm": 0}
    bind = runtime.Launcher.bind

    def traced_bind(self, names, symbols, consts, renames):  # the trace buffer: qkv's v_scale, norm's `trace`
        kind = self.entry.kind
        if kind == "qkv":
            consts, renames = {k: v for k, v in consts.items() if k != "v_scale"}, {**renames, "v_scale": "trace"}
        run, masks = bind(self, (*names, "trace"), symbols, consts, renames)
        return (lambda values, stream, pdl: run((*values, cur.get(kind, 0)), stream, pdl)), masks[: len(names)]

    runtime.Launcher.bind = traced_bind
    loader.load_bundle(bundle)
    torch.manual_seed(0)

    def one(spec):  # one graph per spec
        h, fmt, m, design = spec.split(":")
        nq, nkv = map(int, h.split("x"))
        m = int(m)
        chain = LayerChain(nq, nkv, fmt)
        layers, n = chain.layers, (nq + 2 * nkv) * D
        tq = torch.zeros(layers, n // 16, SLOTS, dtype=torch.int32, device="cuda")
        tn = torch.zeros(layers, 8, 8, dtype=torch.int32, device="cuda")

        def point(i):  # the trace buffers of layer i
            cur["qkv"], cur["norm"] = tq[i].data_ptr(), tn[i].data_ptr()

        fused = chain.fn(m, point)

        with loader.launch_options(design=design):
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fused()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
                fused()
        for _ in range(5):
            g.replay()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        per_layer = a.elapsed_time(b) * 1e3 / layers
        t = tq.cpu().numpy().astype(np.int64)
        base = t[:, :, 0].min()
        groups = -(-m // 8)
        gx = (t[:, :, 16 : 16 + groups] - base) % (1 << 32)
        t, sm, ge = (t[:, :, :7] - base) % (1 << 32), t[:, :, 7], (t[:, :, 8 : 8 + groups] - base) % (1 << 32)
        nt = (tn.cpu().numpy().astype(np.int64)[:, :m, :4] - base) % (1 << 32)
        qk = (nq + nkv) * 8  # CTAs of q/k heads (the exchange)
        rows = []
        for i in range(3, layers - 3):
            L, N = t[i], t[i + 1]
            W = L[:, 2].reshape(-1, 8)  # the wait-returns of each cluster (8 consecutive CTAs)
            row = {
                "span (first wait-return to last store)": L[:, 6].max() - L[:, 2].min(),
                "gap (last store to next first wait-return)": N[:, 2].min() - L[:, 6].max(),
                "CTA start to weights in": np.median(L[:, 1] - L[:, 0]),
                "share of CTAs with weights in before the first wait-return": np.mean(
                    L[:, 1] < L[:, 2].min()
                ),
                "wait-return spread (max - min)": L[:, 2].max() - L[:, 2].min(),
                "cluster wait-return skew (max - min within a cluster)": np.median(np.ptp(W, axis=1)),
                "activations in (T3 - T2)": np.median(L[:, 3] - L[:, 2]),
                "activations in after the cluster's last wait-return": np.median(
                    L[:, 3] - np.repeat(W.max(axis=1), 8)),
                "GEMV (T4 - T3)": np.median(L[:, 4] - L[:, 3]),
                "q/k exchange (T5 - T4)": np.median(L[:qk, 5] - L[:qk, 4]),
                "stores (T6 - T5)": np.median(L[:qk, 6] - L[:qk, 5]),
                "next layer's CTAs started before this layer's last store": np.mean(N[:, 0] < L[:, 6].max()),
            }
            if m > 8:  # the token stream: T4 = the last group's MMAs, and the time per further group
                G = ge[i]
                row["GEMV (T4 - T3)"] = np.median(G[:, -1] - L[:, 3])
                row["first group's MMAs (from T3)"] = np.median(G[:, 0] - L[:, 3])
                if groups > 1:
                    row["per further group (median over CTAs)"] = np.median((G[:, -1] - G[:, 0]) / (groups - 1))
                row["weights in to last group's MMAs"] = np.median(G[:, -1] - L[:, 1])
                if design == "separate" and groups > 1:  # a further group: x in -> its MMAs done, and the rest
                    X = gx[i]
                    row["per further group: its x in to its MMAs done"] = np.median(
                        (G[:, 1:] - X[:, 1:]).mean(axis=1))
                    row["per further group: previous MMAs done to its x in"] = np.median(
                        (X[:, 1:] - G[:, :-1]).mean(axis=1))
                # the stream has no q/k exchange: T5 is the CTA's last group's partial sums in (every CTA's)
                del row["q/k exchange (T5 - T4)"], row["stores (T6 - T5)"]
                last = G[:, -1].reshape(-1, 8)  # a cluster: 8 consecutive CTAs
                row["cluster skew of the last group's MMAs (max - min)"] = np.median(np.ptp(last, axis=1))
                row["last group's sums in (T5) after the cluster's last MMAs"] = np.median(
                    L[:, 5] - np.repeat(last.max(axis=1), 8))
                row["last group's epilogue (T6 - T5)"] = np.median(L[:, 6] - L[:, 5])
            if design == "separate":
                nn = nt[i + 1]  # the norm kernel between qkv layers i and i + 1
                row["norm: wait-return after the last qkv store"] = nn[:, 1].max() - L[:, 6].max()
                row["norm: wait-return to x in and reduced"] = np.median(nn[:, 2] - nn[:, 1])
                row["norm: reduced to stores issued"] = np.median(nn[:, 3] - nn[:, 2])
                row["norm: stores issued to next qkv wait-return"] = N[:, 2].min() - nn[:, 3].max()
            rows.append(row)
        per_sm = np.bincount(np.bincount(sm[layers // 2], minlength=132))
        print(f"\n{spec}: {per_layer:.2f} µs per layer (graph, {layers} layers; instrumented), "
              f"SMs with 0/1/2/3 CTAs of a layer: {per_sm.tolist()}")  # fmt: skip
        for k in rows[0]:
            v = statistics.median(float(r[k]) for r in rows)
            print(f"  {k}: {v:.2f}" if v <= 1 else f"  {k}: {v:.0f} ns")
        torch.cuda.empty_cache()

    for spec in specs:
        one(spec)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "instrument":
        instrument(Path(sys.argv[2]).resolve())
    elif len(sys.argv) >= 4 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit(__doc__)

"""Per-CTA timeline of the fused op under CUDA-graph replay: where a layer's time goes (BENCHMARKS.md §2).
A diagnostic, never a serving build.

1. On the CPU machine, build the instrumented bundle: the kernels with their named trace points compiled in
   (flint_aot/kernels/trace.py; the config's `diagnostics: {timeline: true}`):

       flint-aot build configs/timeline.yaml -o build/timeline

   Thread 0 of every qkv CTA then writes %globaltimer (ns) into its row of 32 words
   (flint_aot/kernels/trace_layout.py): START, WEIGHTS_IN (its weights arrived), WAIT_RETURNED
   (griddepcontrol.wait returned), X_IN (the activations are in shared memory; the token stream: its first
   group's x), GEMV_DONE (the 8-token kernel's GEMV), EXCHANGED (the 8-token kernel's q/k exchange; the
   token stream, which exchanges nothing after its sums: its last group's partial sums are in), STORED (its
   last store is issued), SMID, and in the token stream each group's MMAs done (GROUP_DONE + i) and, in
   the two-kernel design, the moment its x stage was in (GROUP_X_IN + i); the norm kernel NORM_START,
   NORM_WAITED, NORM_REDUCED, NORM_STORED. The qkv kernel writes into `v_scale`, which a BF16-cache build
   never reads; the norm kernel has a trailing `trace` parameter. Both are filled by this tool (the loader
   refuses the norm kernel's extra parameter on its own).
2. On the GPU:

       PYTHONPATH=. python3 tools/timeline.py run build/timeline 32x4:bf16:1:separate 16x2:nvfp4:8:separate

   Per layer (medians over the middle layers of a graph of L layers with distinct weights): the span from the
   layer's first wait-return to its last store, the gap from that to the next layer's first wait-return,
   phase medians per CTA (with the cluster's skew of wait-returns, and x's arrival counted from the cluster's
   last wait-return), and the norm kernel's part of the gap; in the token stream also the cluster's skew
   at its last group (the 8 CTAs' ends of their last MMAs, max - min), the last group's sums in counted from
   the cluster's last MMAs (the DSMEM hop) and its epilogue (STORED - EXCHANGED), and a further group's
   time split in two: from its x in to its MMAs done (the fragments and MMAs), and from the previous group's
   MMAs to its x in (the ring's barrier and refill, the sends, the wait for the stage).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flint_aot.kernels import trace_layout as P  # noqa: E402  (stdlib only: no DSL on the GPU machine)


def summarize(tq, tn, m: int, design: str, nq: int, nkv: int, layers: int) -> dict:
    """Medians over the middle layers (numpy arrays: tq [layers, CTAs, QKV_WORDS], tn [layers, norm rows,
    NORM_WORDS], the raw 32-bit timer words): name -> ns (or a share)."""
    import numpy as np

    t = tq.astype(np.int64)
    base = t[:, :, P.START].min()
    groups = -(-m // 8)
    wrap = lambda a: (a - base) % (1 << 32)  # noqa: E731  (%globaltimer_lo wraps every 4.3 s)
    gx = wrap(t[:, :, P.GROUP_X_IN : P.GROUP_X_IN + groups])
    ge = wrap(t[:, :, P.GROUP_DONE : P.GROUP_DONE + groups])
    t = wrap(t[:, :, : P.SMID])
    nt = wrap(tn.astype(np.int64)[:, :m, : P.NORM_STORED + 1])
    qk = (nq + nkv) * 8  # CTAs of q/k heads (the exchange)
    rows = []
    for i in range(3, layers - 3):
        L, N = t[i], t[i + 1]
        W = L[:, P.WAIT_RETURNED].reshape(-1, 8)  # the wait-returns of each cluster (8 consecutive CTAs)
        first_wait, last_store = L[:, P.WAIT_RETURNED].min(), L[:, P.STORED].max()
        row = {
            "span (first wait-return to last store)": last_store - first_wait,
            "gap (last store to next first wait-return)": N[:, P.WAIT_RETURNED].min() - last_store,
            "CTA start to weights in": np.median(L[:, P.WEIGHTS_IN] - L[:, P.START]),
            "share of CTAs with weights in before the first wait-return": np.mean(
                L[:, P.WEIGHTS_IN] < first_wait),
            "wait-return spread (max - min)": L[:, P.WAIT_RETURNED].max() - first_wait,
            "cluster wait-return skew (max - min within a cluster)": np.median(np.ptp(W, axis=1)),
            "activations in (X_IN - WAIT_RETURNED)": np.median(L[:, P.X_IN] - L[:, P.WAIT_RETURNED]),
            "activations in after the cluster's last wait-return": np.median(
                L[:, P.X_IN] - np.repeat(W.max(axis=1), 8)),
            "GEMV (GEMV_DONE - X_IN)": np.median(L[:, P.GEMV_DONE] - L[:, P.X_IN]),
            "q/k exchange (EXCHANGED - GEMV_DONE)": np.median(L[:qk, P.EXCHANGED] - L[:qk, P.GEMV_DONE]),
            "stores (STORED - EXCHANGED)": np.median(L[:qk, P.STORED] - L[:qk, P.EXCHANGED]),
            "next layer's CTAs started before this layer's last store": np.mean(N[:, P.START] < last_store),
        }
        if m > 8:  # the token stream: the last group's MMAs end the GEMV, and the time per further group
            G = ge[i]
            row["GEMV (GEMV_DONE - X_IN)"] = np.median(G[:, -1] - L[:, P.X_IN])
            row["first group's MMAs (from X_IN)"] = np.median(G[:, 0] - L[:, P.X_IN])
            if groups > 1:
                row["per further group (median over CTAs)"] = np.median((G[:, -1] - G[:, 0]) / (groups - 1))
            row["weights in to last group's MMAs"] = np.median(G[:, -1] - L[:, P.WEIGHTS_IN])
            if design == "separate" and groups > 1:  # a further group: x in -> its MMAs done, and the rest
                X = gx[i]
                row["per further group: its x in to its MMAs done"] = np.median(
                    (G[:, 1:] - X[:, 1:]).mean(axis=1))
                row["per further group: previous MMAs done to its x in"] = np.median(
                    (X[:, 1:] - G[:, :-1]).mean(axis=1))
            # the stream has no q/k exchange: EXCHANGED is the CTA's last group's partial sums in
            del row["q/k exchange (EXCHANGED - GEMV_DONE)"], row["stores (STORED - EXCHANGED)"]
            last = G[:, -1].reshape(-1, 8)  # a cluster: 8 consecutive CTAs
            row["cluster skew of the last group's MMAs (max - min)"] = np.median(np.ptp(last, axis=1))
            row["last group's sums in (EXCHANGED) after the cluster's last MMAs"] = np.median(
                L[:, P.EXCHANGED] - np.repeat(last.max(axis=1), 8))
            row["last group's epilogue (STORED - EXCHANGED)"] = np.median(L[:, P.STORED] - L[:, P.EXCHANGED])
        if design == "separate":
            nn = nt[i + 1]  # the norm kernel between qkv layers i and i + 1
            row["norm: wait-return after the last qkv store"] = nn[:, P.NORM_WAITED].max() - last_store
            row["norm: wait-return to x in and reduced"] = np.median(
                nn[:, P.NORM_REDUCED] - nn[:, P.NORM_WAITED])
            row["norm: reduced to stores issued"] = np.median(nn[:, P.NORM_STORED] - nn[:, P.NORM_REDUCED])
            row["norm: stores issued to next qkv wait-return"] = (N[:, P.WAIT_RETURNED].min()
                                                                  - nn[:, P.NORM_STORED].max())  # fmt: skip
        rows.append(row)
    return {k: statistics.median(float(r[k]) for r in rows) for k in rows[0]}


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
            consts = {k: v for k, v in consts.items() if k != "v_scale"}
            renames = {**renames, "v_scale": "trace"}
        run, masks = bind(self, (*names, "trace"), symbols, consts, renames)
        traced = lambda values, stream, pdl: run((*values, cur.get(kind, 0)), stream, pdl)  # noqa: E731
        return traced, masks[: len(names)]

    runtime.Launcher.bind = traced_bind
    b = loader.load_bundle(bundle)
    if not b.manifest.config.get("diagnostics", {}).get("timeline"):
        raise SystemExit(f"{bundle} has no trace points: flint-aot build configs/timeline.yaml -o {bundle}")
    torch.manual_seed(0)

    def one(spec):  # one graph per spec
        h, fmt, m, design = spec.split(":")
        nq, nkv = map(int, h.split("x"))
        m = int(m)
        chain = LayerChain(nq, nkv, fmt)
        layers, n = chain.layers, (nq + 2 * nkv) * D
        tq = torch.zeros(layers, n // 16, P.QKV_WORDS, dtype=torch.int32, device="cuda")
        tn = torch.zeros(layers, 64, P.NORM_WORDS, dtype=torch.int32, device="cuda")  # (a row per token)

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
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        e.record()
        e.synchronize()
        per_layer = a.elapsed_time(e) * 1e3 / layers
        t = tq.cpu().numpy()
        sm = t[layers // 2, :, P.SMID].astype(np.int64)
        per_sm = np.bincount(np.bincount(sm, minlength=132))
        print(f"\n{spec}: {per_layer:.2f} µs per layer (graph, {layers} layers; instrumented), "
              f"SMs with 0/1/2/3 CTAs of a layer: {per_sm.tolist()}")  # fmt: skip
        for k, v in summarize(t, tn.cpu().numpy(), m, design, nq, nkv, layers).items():
            print(f"  {k}: {v:.2f}" if v <= 1 else f"  {k}: {v:.0f} ns")
        torch.cuda.empty_cache()

    for spec in specs:
        one(spec)


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit(__doc__)

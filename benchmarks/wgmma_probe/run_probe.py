"""Run the wgmma probe (probe_kernel.py) on the GPU: bits and rate of the token stream's MMAs by mma.sync and
by wgmma. Build here, run there:
    flint-aot build benchmarks/wgmma_probe/probe.yaml -o build/probe
    PYTHONPATH=. python3 benchmarks/wgmma_probe/run_probe.py --bundle build/probe
Bits: every mode's out (64 rows x 64 tokens, fp32) against mma.sync's, element by element, and every element
against an fp64 reference (within 2^-14 of sum |w x| over its 512 products), on several inputs. Rate: 1, 2
or 3 CTAs per SM (3: the stream's occupancy; builds with the register budget of 3 or of 2 CTAs per SM), the
median over trials of (t(reps = R) - t(reps = 1)) / (R - 1), per group of 8 tokens.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import loader

MODES = ("mma", "wg8", "wg16", "wg32", "wg16s", "wg32s", "h8q", "h8h", "h16q", "h16h", "h32h")


def launch(mode, grid, w, x, out, reps, ctas=3):
    spec = {"mode": mode, "ctas": ctas}
    loader.launch_kernel("wgmma_probe", spec, (grid,), w=w, x=x, out=out, reps=reps)


def inputs(case, seed):
    """w [64, 512] and x [32, 512] bf16 (token n is x's row n % 32): "normal" (w ~ 0.05 N(0, 1), x ~
    N(0, 1)), "wide" (each element times 2^u, u uniform in [-30, 30]: products over 120 binades), "cancel"
    (x = +-1; token 0's products cancel in pairs up to a small random rest)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(64, 512, device="cuda", generator=g) * 0.05
    x = torch.randn(32, 512, device="cuda", generator=g)
    if case == "wide":
        w = w * torch.exp2(torch.randint(-30, 31, w.shape, device="cuda", generator=g).float())
        x = x * torch.exp2(torch.randint(-30, 31, x.shape, device="cuda", generator=g).float())
    elif case == "cancel":
        x = torch.sign(x)
        w[:, 1::2] = -w[:, 0::2] * x[0, 0::2] * x[0, 1::2] + 1e-3 * torch.randn(
            64, 256, device="cuda", generator=g
        )
    return w.bfloat16(), x.bfloat16()


def bits(cases):
    """Every mode's sums against mma.sync's, element by element, and against fp64."""
    rows = []
    for case, seed in cases:
        w, x = inputs(case, seed)
        xt = x.double().repeat(2, 1)  # the 64 tokens
        ref = w.double() @ xt.T  # [row, token]
        bound = (w.double().abs() @ xt.abs().T) * 2.0**-14  # 512 fp32 additions, generously
        outs = {}
        for m, c in [(m, c) for c in (3, 2) for m in MODES]:
            out = torch.full((2, 64, 64), float("nan"), device="cuda")
            launch(m, 2, w, x, out, 1, c)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all(), f"{m}: elements not written"
            assert torch.equal(out[0], out[1]), f"{m}: CTAs differ"
            outs[m, c] = out[0].view(torch.int32)
            ok = bool(((out[0].double() - ref).abs() <= bound).all())
            same = int((outs[m, c] == outs["mma", 3]).sum())
            rows.append((case, seed, m, c, same, ok))
    print("bits: sums equal to mma.sync's (of 4096), and every sum within 2^-14 sum|w x| of fp64 (ok)")
    for case, seed in cases:
        cells = [
            f"{m}/{c}: {same}{'' if ok else ' BAD'}"
            for cs, sd, m, c, same, ok in rows
            if (cs, sd) == (case, seed)
        ]
        print(f"  {case} seed {seed}: " + ", ".join(cells))


def rate(w, x, sms, ctas_per_sm, regs_of=3, reps=101, trials=7):
    res = {}
    grid = sms * ctas_per_sm
    out = torch.empty((grid, 64, 64), device="cuda")
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    for m in MODES:
        d = []
        for _ in range(trials):
            ev[0].record()
            launch(m, grid, w, x, out, 1, regs_of)
            ev[1].record()
            launch(m, grid, w, x, out, reps, regs_of)
            ev[2].record()
            torch.cuda.synchronize()
            d.append((ev[1].elapsed_time(ev[2]) - ev[0].elapsed_time(ev[1])) * 1e3 / (reps - 1))
        res[m] = statistics.median(d) / 8  # per group of 8 tokens
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default="build/probe")
    a = ap.parse_args()
    loader.load_bundle(a.bundle)
    bits([("normal", 7), ("normal", 8), ("normal", 9), ("wide", 7), ("wide", 8), ("cancel", 7)])
    w, x = inputs("normal", 7)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = {(c, 3): rate(w, x, sms, c) for c in (1, 2, 3)}
    rows[2, 2] = rate(w, x, sms, 2, regs_of=2)
    print(f"\nµs per group of 8 tokens (64 rows x 512 k per CTA, {sms} SMs), median of 7:")
    print("| CTAs per SM | registers | " + " | ".join(MODES) + " |")
    print("|---|---|" + "---|" * len(MODES))
    for (c, ro), r in rows.items():
        print(f"| {c} | {168 if ro == 3 else 255} | " + " | ".join(f"{r[m]:.3f}" for m in MODES) + " |")


if __name__ == "__main__":
    main()

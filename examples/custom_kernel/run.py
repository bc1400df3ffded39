"""The example kernel, served: SiLU-and-mul from a bundle built with flint_plus.yaml, launched through the
loader and checked against a float64 torch reference on the GPU.

    python examples/custom_kernel/run.py [--bundle build/flint_plus]

For M = 1, 16 and 64 tokens (I = 6144, Qwen3-1.7B's MLP; and I = 9728, whose rows end inside a CTA, when the
bundle has it): eagerly, replayed from a CUDA graph with new inputs, and through the custom op under
torch.compile. Every element within one bf16 rounding of the exact value (|out - ref| <= (2^-8 + 1e-5)|ref|:
the fp32 math costs ~1e-6 of it), and the rows past M of a NaN-filled buffer left unwritten. Exit status 1 on
any failure.
"""

from __future__ import annotations

import argparse
import sys

import torch
from silu_mul_op import silu_mul

import loader

BOUND = 2.0**-8 + 1e-5  # one bf16 rounding (unit roundoff 2^-8) of an fp32 value within 1e-5 of exact
FLOOR = 1e-37  # results the kernel's fp32 may flush to zero (|ref| below fp32's smallest normal)


def reference(x: torch.Tensor) -> torch.Tensor:
    g, u = x.double().chunk(2, dim=1)
    return g / (1 + torch.exp(-g)) * u


def check(x: torch.Tensor, buf: torch.Tensor) -> tuple[float, float, bool]:
    """(worst |err| / bound, worst relative error, pass) of buf[:M] against the reference, and buf[M:] still
    NaN (nothing written past the M rows)."""
    m = x.shape[0]
    ref, out = reference(x), buf[:m].double()
    bound = ref.abs() * BOUND + FLOOR
    err = (out - ref).abs()
    ratio = (err / bound).max().item()
    rel = (err / ref.abs().clamp(min=FLOOR)).max().item()
    ok = bool(torch.isfinite(out).all()) and ratio <= 1.0 and bool(buf[m:].isnan().all())
    return ratio, rel, ok


def inputs(m: int, i: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(m, 2 * i, device="cuda", generator=g) * 3).bfloat16()  # silu's curved part and tails


def poisoned(m: int, i: int) -> torch.Tensor:
    return torch.full((m + 2, i), float("nan"), dtype=torch.bfloat16, device="cuda")


def run(ms=(1, 16, 64), seed: int = 0) -> list[tuple]:
    """(I, M, mode, worst err / bound, worst relative error, pass) per case."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = loader.current_bundle()
    sizes = sorted({e.spec["intermediate"] for e in b.manifest.kernels if e.kind == "silu_mul"})
    if 6144 not in sizes:
        raise SystemExit(f"bundle {b.path} has no silu_mul kernel for I = 6144 (it has {sizes}); build "
                         "one: flint-aot build examples/custom_kernel/flint_plus.yaml -o "
                         "build/flint_plus")  # fmt: skip
    compiled = torch.compile(lambda x: torch.ops.flint_example.silu_mul(x), fullgraph=True)
    rows = []
    for i in sizes:
        for m in ms:
            x, buf = inputs(m, i, g), poisoned(m, i)
            silu_mul(x, out=buf[:m])  # eager
            torch.cuda.synchronize()
            rows.append((i, m, "eager", *check(x, buf)))

            x, buf = inputs(m, i, g), poisoned(m, i)  # a CUDA graph, replayed with new inputs
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(st), torch.cuda.graph(graph, stream=st):
                silu_mul(x, out=buf[:m])
            x.copy_(inputs(m, i, g))
            buf.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            rows.append((i, m, "CUDA graph", *check(x, buf)))

            x = inputs(m, i, g)  # the custom op in a torch.compile'd function (fullgraph: no graph break)
            out = compiled(x)
            torch.cuda.synchronize()
            rows.append((i, m, "torch.compile", *check(x, out)))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="build/flint_plus", help="bundle built from flint_plus.yaml")
    a = ap.parse_args(argv)
    loader.load_bundle(a.bundle)
    print(f"{loader.current_bundle()}; GPU: {torch.cuda.get_device_name()}")
    rows = run()
    print("\n| I | M | mode | max err / bound | max rel err | result |\n|---|---|---|---|---|---|")
    for i, m, mode, ratio, rel, ok in rows:
        print(f"| {i} | {m} | {mode} | {ratio:.3f} | {rel:.2e} | {'PASS' if ok else 'FAIL'} |")
    bad = sum(not r[-1] for r in rows)
    print(f"\n{len(rows) - bad} of {len(rows)} cases pass (|out - ref| <= (2^-8 + 1e-5) |ref|, no row past M "
          "written)")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Host cost of two loaders in one device call: the fast path and the full-check path (a plan built every
call) of flint_qkv_fused (M = 1, heads (32, 4), BF16, BF16 cache) for the loader package found in LOADER_DIR,
beside torch.add. Run it alternately for two checkouts' loaders, each in its own process, e.g. the loader of
a commit (copied to old_loader/loader, an untracked folder that travels with the working tree) against this
checkout's:

    mkdir -p old_loader && git archive <commit> loader | tar -x -C old_loader
    for i in 1 2 3; do for d in old_loader .; do
        PYTHONPATH=. python3 benchmarks/host_ab.py $d build/flint; done; done

Prints one line per process: best of 7 loops of 3000 fast calls and of 7 loops of 1000 full-check calls. The
benchmark code (benchmarks/bench_host.py) is this checkout's for both; a LOADER_DIR without a loader package
is an error, not a silent measurement of this checkout's loader."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])  # this loader, before the checkout's own (PYTHONPATH)

import torch  # noqa: E402
from bench_host import case, full_check, per_call  # noqa: E402  (benchmarks/ is the script's directory)

import loader  # noqa: E402


def main():
    here = Path(loader.__file__).resolve().parent
    if here != (Path(sys.argv[1]) / "loader").resolve():
        sys.exit(f"{sys.argv[1]}: no loader package there (imported {here}); put one in {sys.argv[1]}/loader")
    bundle = sys.argv[2] if len(sys.argv) > 2 else "build/flint"
    loader.load_bundle(bundle)
    c = case(1, 32, 4, "bf16", "bf16", torch.Generator(device="cuda").manual_seed(0))
    a = torch.randn(1, 2048, device="cuda").bfloat16()
    for _ in range(3):
        loader.flint_qkv_fused(**c)
    add, fast = per_call(lambda: torch.add(a, a), 3000), per_call(lambda: loader.flint_qkv_fused(**c), 3000)
    slow = per_call(lambda: full_check(c), 1000)
    print(f"{loader.__file__}: torch.add {add:.2f} µs, fast path {fast:.2f}, full-check path {slow:.2f} "
          f"({slow / fast:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()

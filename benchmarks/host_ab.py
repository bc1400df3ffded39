"""Host cost of two loaders in one device call: the fast path and the full-check path (a plan built every
call) of flint_qkv_fused (M = 1, heads (32, 4), BF16, BF16 cache) for the loader package found in LOADER_DIR,
beside torch.add. Run it alternately for two checkouts' loaders, each in its own process:

    git worktree add /tmp/prev <commit>
    for i in 1 2 3; do for d in /tmp/prev .; do PYTHONPATH=. python3 benchmarks/host_ab.py $d; done; done

Prints one line per process: best of 7 loops of 3000 fast calls and of 7 loops of 1000 full-check calls."""

import sys

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])  # this loader, before the checkout's own (PYTHONPATH)

import torch  # noqa: E402
from bench_host import case, full_check, per_call  # noqa: E402  (benchmarks/ is the script's directory)

import loader  # noqa: E402


def main():
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

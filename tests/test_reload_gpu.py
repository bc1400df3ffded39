"""Reloading the bundle while other threads serve, and a CUDA graph replayed across a reload (docs/api.md
§10). Each test runs its work in a child process (tests.helpers.run_child), so that a crash fails that test
with the child's output instead of ending the run. The children also run from the command line, the reload
test with other thread and reload counts (--max-m 2: fewer kernels, a short run, e.g. under
compute-sanitizer):

    PYTHONPATH=. python3 -m tests.test_reload_gpu reload build/flint --threads 4 --reloads 20
    PYTHONPATH=. compute-sanitizer --tool memcheck --report-api-errors no \
        python3 -m tests.test_reload_gpu reload build/flint --threads 2 --reloads 3 --max-m 2
    PYTHONPATH=. python3 -m tests.test_reload_gpu graph build/flint
"""

import argparse
import faulthandler
import shutil
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch

from tests.helpers import check, make_case, op_args, run_child, variants

pytestmark = pytest.mark.gpu
HEADS = (16, 8)  # the calls: BF16 weights, RoPE, BF16 cache, these head counts
NAN = float("nan")


def _case(seed: int, shape: int, max_m: int = 16) -> dict:
    """Fresh random inputs of `seed`; M (1..max_m) and the residual (with or without) follow from `shape`:
    0 .. 2 * max_m - 1 give every pair once."""
    return make_case(1 + shape % max_m, *HEADS, True, seed=seed, residual=shape // max_m % 2 == 0)


def _call_and_check(c: dict) -> None:
    import loader

    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    q, r = loader.flint_qkv_fused(**op_args(c))
    torch.cuda.current_stream().synchronize()
    check(c, q, r, kb, vb)


def _launchers_from(bundle) -> bool:
    """Whether this thread's launchers (of the current generation) were all built from `bundle`'s entries."""
    from loader import runtime

    ks = [v for v in runtime.thread_cache().values() if isinstance(v, runtime.Launcher)]
    return bool(ks) and all(any(k.entry is e for e in bundle.manifest.kernels) for k in ks)


# ----------------------------------------------------------------------------- reloads under load
def reload_under_load(bundle_path: str, threads: int, reloads: int, max_m: int = 16, interval: float = 0.05):
    """`threads` threads, each on its own stream, call flint_qkv_fused in a loop on fresh random inputs and
    check every result against the float64 reference, while this thread calls load_bundle `reloads` times,
    `interval` s apart, alternating between bundle_path and a copy of it in another directory. Every call
    must succeed and be right (a refusal would be a Python exception, counted: there must be none), every
    thread must call while the reloads go on, no cubin may be loaded again, and a call that starts after the
    last reload must run that bundle's kernels."""
    import loader
    from loader import plans, runtime

    tmp = Path(tempfile.mkdtemp(prefix="flint-reload-"))
    try:
        copy = shutil.copytree(bundle_path, tmp / "copy")
        b = loader.load_bundle(bundle_path)
        assert (True, HEADS) in variants(b), f"the bundle has no BF16 qkv kernel for heads {HEADS} with RoPE"
        for shape in range(2 * max_m):  # every kernel the threads will run, loaded before the reloads
            _call_and_check(_case(shape, shape, max_m))
        loads = runtime.module_loads()
        ready, done, final = threading.Barrier(threads + 1), threading.Event(), []
        calls, during, fresh = [0] * threads, [0] * threads, [False] * threads
        wrong, refused, died = [], [], []

        def serve(t: int):
            try:
                with torch.cuda.stream(torch.cuda.Stream()):
                    for it in range(1 << 62):
                        last = done.is_set()  # set: this call starts after the last load_bundle returned
                        # a new shape every 8 calls: most calls find their plan (fast path), some build one
                        c = _case(100_000 * (t + 1) + it, t + it // 8, max_m)
                        try:
                            _call_and_check(c)
                        except AssertionError as e:
                            wrong.append(f"thread {t} call {it} (M={c['x'].shape[0]}): {e}")
                        except Exception as e:  # noqa: BLE001 (a refusal: reported, and the test fails)
                            refused.append(f"thread {t} call {it}: {type(e).__name__}: {e}")
                        calls[t] += 1
                        if last:
                            fresh[t] = _launchers_from(final[0])
                            return
                        if it == 0:
                            ready.wait(timeout=600)  # the reloads start once every thread has served
                        else:
                            during[t] += 1
            except BaseException:  # noqa: BLE001 (reported below)
                died.append(f"thread {t}:\n{traceback.format_exc()}")
                ready.abort()

        workers = [threading.Thread(target=serve, args=(t,), name=f"serve-{t}") for t in range(threads)]
        for w in workers:
            w.start()
        builds, t0 = plans.builds, time.perf_counter()
        try:
            ready.wait(timeout=600)
            builds, t0 = plans.builds, time.perf_counter()
            for i in range(reloads):
                time.sleep(interval)
                loader.load_bundle(copy if i % 2 else bundle_path)
        except threading.BrokenBarrierError:
            pass  # a thread died before the reloads: reported below
        finally:
            span = time.perf_counter() - t0
            final.append(runtime.current_bundle())
            done.set()
            for w in workers:
                w.join(timeout=600)
        alive = [w.name for w in workers if w.is_alive()]
        print(f"{threads} threads, {reloads} reloads in {span:.2f} s: {sum(calls)} calls ({calls}), "
              f"{sum(during)} of them while reloading ({during}); {len(refused)} refused, {len(wrong)} "
              f"wrong; plans built during the reloads: {plans.builds - builds}; module loads {loads} before "
              f"the reloads, {runtime.module_loads()} after", flush=True)  # fmt: skip
        assert not died and not alive, (died, alive)
        assert not refused, "\n".join(refused[:20])
        assert not wrong, "\n".join(wrong[:20])
        assert all(during), f"a thread made no call while the bundle was reloading: {during}"
        assert all(fresh), f"a call after the last reload ran kernels of an earlier bundle: {fresh}"
        assert plans.builds > builds, "no thread rebuilt its plans: the reloads were not seen"
        assert runtime.module_loads() == loads, "a reload of the same cubins loaded them again"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_reload_under_load(gpu_bundle):
    run_child("-m", "tests.test_reload_gpu", "reload", str(gpu_bundle.path), "--threads=4", "--reloads=20")


# ----------------------------------------------------------------------------- CUDA graphs
def graph_survives_reload(bundle_path: str) -> None:
    """A CUDA graph of flint_qkv_fused captured with a bundle at a temporary path; then a copy of it at
    another path loaded, and the first deleted. The graph's replays, before and after, write the eager call's
    bits (q, residual_out, both caches, every byte; the outputs and the caches NaN-poisoned before each
    replay); the new bundle serves eager calls, loading no cubin again."""
    import loader
    from loader import runtime

    tmp = Path(tempfile.mkdtemp(prefix="flint-reload-"))
    try:
        orig = shutil.copytree(bundle_path, tmp / "orig")  # the 'original', deleted below
        copy = shutil.copytree(bundle_path, tmp / "copy")
        b = loader.load_bundle(orig)
        assert (True, HEADS) in variants(b), f"the bundle has no BF16 qkv kernel for heads {HEADS} with RoPE"
        c = make_case(5, *HEADS, True, seed=4242)
        kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
        q, r = loader.flint_qkv_fused(**op_args(c))
        torch.cuda.synchronize()
        check(c, q, r, kb, vb)
        eager = [t.clone() for t in (q, r, c["k_cache"], c["v_cache"])]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            gq, gr = loader.flint_qkv_fused(**op_args(c))

        def replay(when: str):
            c["k_cache"].copy_(kb)  # NaN: the replay must write the slots
            c["v_cache"].copy_(vb)
            gq.fill_(NAN)
            gr.fill_(NAN)
            graph.replay()
            torch.cuda.synchronize()
            for name, a, g in zip(("q", "residual_out", "k_cache", "v_cache"), eager,
                                  (gq, gr, c["k_cache"], c["v_cache"]), strict=True):  # fmt: skip
                assert torch.equal(a.view(torch.int16), g.view(torch.int16)), f"{when}: {name} differs"

        replay("replayed before the reload")
        loads = runtime.module_loads()
        loader.load_bundle(copy)
        shutil.rmtree(orig)
        replay("replayed after the reload")
        _call_and_check(make_case(5, *HEADS, True, seed=4343))
        replay("replayed after an eager call on the new bundle")
        assert runtime.module_loads() == loads, "the copy's cubins were loaded again"
        print(f"graph replayed after the reload, bit-identical; module loads {loads}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_graph_survives_reload(gpu_bundle):
    run_child("-m", "tests.test_reload_gpu", "graph", str(gpu_bundle.path))


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m tests.test_reload_gpu", description="the children of these tests"
    )
    ap.add_argument("what", choices=["reload", "graph"])
    ap.add_argument("bundle")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--reloads", type=int, default=20)
    ap.add_argument("--max-m", type=int, default=16, choices=range(1, 17), metavar="1..16")
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between reloads")
    a = ap.parse_args(argv)
    faulthandler.enable()  # a crash prints every thread's stack
    if a.what == "reload":
        reload_under_load(a.bundle, a.threads, a.reloads, a.max_m, a.interval)
    else:
        graph_survives_reload(a.bundle)
    print("child ok")


if __name__ == "__main__":
    main()

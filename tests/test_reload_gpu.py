"""Reloading the bundle while other threads serve, a reload between a call's fetching its kernels and
launching them, and a CUDA graph replayed across reloads (docs/api.md §10). The reloads go to a byte-identical
copy and to a copy whose every cubin has other bytes (tests.helpers.altered_copy: the same code, loaded as new
modules), as a rebuilt bundle would. Each test runs its work in a child process (tests.helpers.run_child), so
that a crash fails that test with the child's output instead of ending the run. The children also run from
the command line, the reload test with other thread and reload counts (--max-m 2: fewer kernels, a short run,
e.g. under compute-sanitizer):

    PYTHONPATH=. python3 -m tests.test_reload_gpu reload build/flint --threads 4 --reloads 20
    PYTHONPATH=. compute-sanitizer --tool memcheck --report-api-errors no \
        python3 -m tests.test_reload_gpu reload build/flint --threads 2 --reloads 3 --max-m 2
    PYTHONPATH=. python3 -m tests.test_reload_gpu midcall build/flint
    PYTHONPATH=. python3 -m tests.test_reload_gpu graph build/flint
"""

import argparse
import faulthandler
import math
import shutil
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch

from loader.abi import MAX_M
from tests.helpers import altered_copy, check, make_case, op_args, run_child, variants

pytestmark = pytest.mark.gpu
HEADS = (16, 8)  # the calls: BF16 weights, RoPE, BF16 cache, these head counts
NAN = float("nan")
MAX_RELOADS = 2000  # the reload test reloads until every thread saw what it must; this many is a failure


def _stride(max_m: int) -> int:
    """A step coprime with max_m: shapes 0, 1, 2, ... jump across the token tiles, and 2 * max_m of them
    give every (M, residual) pair once."""
    return next(s for s in range(23, 23 + max_m + 1) if math.gcd(s, max_m) == 1)


def _m_of(shape: int, max_m: int) -> int:
    return 1 + shape * _stride(max_m) % max_m


def _case(seed: int, shape: int, max_m: int = MAX_M) -> dict:
    """Fresh random inputs of `seed`; M (1..max_m) and the residual (with or without) follow from `shape`:
    0 .. 2 * max_m - 1 give every pair once, consecutive shapes M of other tiles."""
    return make_case(_m_of(shape, max_m), *HEADS, True, seed=seed, residual=shape // max_m % 2 == 0)


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


def _tiles(bundle) -> list[int]:
    """The token tiles of the bundle's qkv kernels for the calls (HEADS, BF16, RoPE) on this GPU."""
    from tests.helpers import device_arch

    arch = device_arch()
    return sorted({e.spec.get("max_m", 8) for e in bundle.manifest.kernels
                   if e.kind == "qkv" and e.arch == arch and tuple(e.spec["heads"]) == HEADS
                   and e.spec["weight_format"] == "bf16" and e.spec["rope"]})  # fmt: skip


def _tile_of(m: int, tiles: list[int]) -> int:
    return min(t for t in tiles if t >= m)


# ----------------------------------------------------------------------------- reloads under load
def reload_under_load(bundle_path: str, threads: int, reloads: int, max_m: int = MAX_M,
                      interval: float = 0.05):  # fmt: skip
    """`threads` threads, each on its own stream, call flint_qkv_fused in a loop on fresh random inputs (M
    up to max_m, so every token tile up to it) and check every result against the float64 reference, while
    this thread calls load_bundle, `interval` s apart, cycling through a byte-identical copy of bundle_path,
    a copy of it with other cubins (altered_copy) and bundle_path itself: `reloads` times, and on until
    every thread has seen its thread cache replaced (a new generation) and has run every token tile's
    kernel in calls made while the reloads went on. Every call must succeed and be right (a refusal would be
    a Python exception, counted: there must be none), no cubin may be loaded again (both contents were
    loaded before the reloads), and a call that starts after the last reload must run that bundle's
    kernels."""
    import loader
    from loader import runtime

    tmp = Path(tempfile.mkdtemp(prefix="flint-reload-"))
    try:
        same = shutil.copytree(bundle_path, tmp / "same")
        other = altered_copy(bundle_path, tmp / "other")
        paths = (same, other, bundle_path)
        b = loader.load_bundle(bundle_path)
        assert (True, HEADS) in variants(b), f"the bundle has no BF16 qkv kernel for heads {HEADS} with RoPE"
        tiles = _tiles(b)
        want = {_tile_of(m, tiles) for m in range(1, max_m + 1)}
        for path in (other, bundle_path):  # every kernel the threads will run, of both contents, loaded
            loader.load_bundle(path)
            for shape in range(2 * max_m):
                _call_and_check(_case(shape, shape, max_m))
        loads = runtime.module_loads()
        ready, done, final = threading.Barrier(threads + 1), threading.Event(), []
        reloading = threading.Event()
        calls, during, fresh = [0] * threads, [0] * threads, [False] * threads
        gens = [set() for _ in range(threads)]  # the generations each thread's calls ran in, while reloading
        ran = [set() for _ in range(threads)]  # the token tiles of those calls
        wrong, refused, died = [], [], []

        def serve(t: int):
            try:
                with torch.cuda.stream(torch.cuda.Stream()):
                    for it in range(1 << 62):
                        last = done.is_set()  # set: this call starts after the last load_bundle returned
                        started = reloading.is_set()
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
                        elif started:
                            during[t] += 1
                            gens[t].add(runtime._tls.generation)  # (the cache this call's plan came from)
                            ran[t].add(_tile_of(c["x"].shape[0], tiles))
            except BaseException:  # noqa: BLE001 (reported below)
                died.append(f"thread {t}:\n{traceback.format_exc()}")
                ready.abort()

        def seen() -> bool:
            return all(len(g) >= 2 for g in gens) and all(r == want for r in ran)

        workers = [threading.Thread(target=serve, args=(t,), name=f"serve-{t}") for t in range(threads)]
        for w in workers:
            w.start()
        n, t0 = 0, time.perf_counter()
        try:
            ready.wait(timeout=600)
            t0 = time.perf_counter()
            reloading.set()
            while (n < reloads or not seen()) and n < MAX_RELOADS and not died:
                time.sleep(interval)
                loader.load_bundle(paths[n % len(paths)])
                n += 1
        except threading.BrokenBarrierError:
            pass  # a thread died before the reloads: reported below
        finally:
            span = time.perf_counter() - t0
            final.append(runtime.current_bundle())
            done.set()
            for w in workers:
                w.join(timeout=600)
        alive = [w.name for w in workers if w.is_alive()]
        print(f"{threads} threads, {n} reloads in {span:.2f} s: {sum(calls)} calls ({calls}), {sum(during)} "
              f"of them while reloading ({during}), in {[len(g) for g in gens]} generations, tiles "
              f"{[sorted(r) for r in ran]}; {len(refused)} refused, {len(wrong)} wrong; module loads "
              f"{loads} before the reloads, {runtime.module_loads()} after", flush=True)  # fmt: skip
        assert not died and not alive, (died, alive)
        assert not refused, "\n".join(refused[:20])
        assert not wrong, "\n".join(wrong[:20])
        assert all(during), f"a thread made no call while the bundle was reloading: {during}"
        assert all(len(g) >= 2 for g in gens), (
            f"after {n} reloads a thread's calls still ran in one generation (its launchers and plans were "
            f"never dropped): {[len(g) for g in gens]}"
        )
        assert all(r == want for r in ran), f"tiles {sorted(want)} not all run while reloading: {ran}"
        assert all(fresh), f"a call after the last reload ran kernels of an earlier bundle: {fresh}"
        assert runtime.module_loads() == loads, "a reload of cubins already loaded loaded them again"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_reload_under_load(gpu_bundle):
    run_child("-m", "tests.test_reload_gpu", "reload", str(gpu_bundle.path), "--threads=4", "--reloads=20",
              f"--max-m={MAX_M}")  # fmt: skip


# ----------------------------------------------------------------------------- a reload inside a call
def reload_mid_call(bundle_path: str) -> None:
    """The race made deterministic: a call whose kernels were fetched (its cached plan, bound to this
    thread's launchers) and then, at its first launch, another thread reloads to a copy with other cubins
    before that launch goes out. The call finishes on the kernels it started with, every one of them the
    old bundle's (with the two-kernel design the qkv kernel, launched after the reload, too), and is right;
    the next call runs the new bundle's kernels, loaded as new modules, and is right. Both designs, at M of
    the 8-, 32- and 64-token tiles, the reloads alternating between the two bundles."""
    import loader
    from loader import runtime

    launched, hook = [], []
    real = runtime.Launcher.launch

    def launch(self, dims, stream, pdl):  # (patched before any launcher is bound: every launch comes here)
        if hook:
            hook.pop()()
        launched.append(self)
        return real(self, dims, stream, pdl)

    def of(bundle, ks) -> bool:  # every launcher of ks built from an entry of bundle's manifest
        return all(any(k.entry is e for e in bundle.manifest.kernels) for k in ks)

    runtime.Launcher.launch = launch
    tmp = Path(tempfile.mkdtemp(prefix="flint-reload-"))
    try:
        paths = [Path(bundle_path).resolve(), altered_copy(bundle_path, tmp / "other").resolve()]
        b = loader.load_bundle(paths[0])
        assert (True, HEADS) in variants(b), f"the bundle has no BF16 qkv kernel for heads {HEADS} with RoPE"
        n = 0
        for design in ("separate", "prologue"):
            for m in (5, 20, 40):
                what = f"{design} M={m}"
                with loader.launch_options(design=design):
                    old = runtime.current_bundle()
                    _call_and_check(make_case(m, *HEADS, True, seed=m))  # the plan, on the current bundle
                    c = make_case(m, *HEADS, True, seed=100 + m)  # same shape: the cached plan
                    target = paths[1 - paths.index(old.path)]
                    reloader = threading.Thread(target=loader.load_bundle, args=(target,))
                    hook.append(lambda r=reloader: (r.start(), r.join()))
                    launched[:] = []
                    _call_and_check(c)
                    new = runtime.current_bundle()
                    assert not hook and new.path == target and new is not old, f"{what}: no reload happened"
                    mid, launched[:] = list(launched), []
                    _call_and_check(make_case(m, *HEADS, True, seed=200 + m))
                    after = list(launched)
                n += 1
                assert len(mid) == (2 if design == "separate" else 1), (what, mid)
                assert of(old, mid), f"{what}: the call in flight launched the new bundle's kernels"
                assert len(after) == len(mid) and of(new, after), (
                    f"{what}: the call after the reload ran kernels of the earlier bundle"
                )
                assert {int(k.function) for k in after}.isdisjoint(int(k.function) for k in mid), (
                    f"{what}: the new bundle's cubins ran as the old bundle's modules"
                )
        print(f"{n} reloads inside calls; module loads {runtime.module_loads()}", flush=True)
    finally:
        runtime.Launcher.launch = real
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_reload_between_fetching_the_kernels_and_launching_them(gpu_bundle):
    run_child("-m", "tests.test_reload_gpu", "midcall", str(gpu_bundle.path))


# ----------------------------------------------------------------------------- CUDA graphs
def graph_survives_reload(bundle_path: str) -> None:
    """A CUDA graph of flint_qkv_fused captured with a bundle at a temporary path; then a byte-identical copy
    of it at another path loaded, and the first deleted; then a copy whose cubins differ (altered_copy). The
    graph's replays, before and after each reload, write the eager call's bits (q, residual_out, both caches,
    every byte; the outputs and the caches NaN-poisoned before each replay); each new bundle serves eager
    calls: the identical copy loading no cubin again, the other one loading its cubins as new modules."""
    import loader
    from loader import runtime

    tmp = Path(tempfile.mkdtemp(prefix="flint-reload-"))
    try:
        orig = shutil.copytree(bundle_path, tmp / "orig")  # the 'original', deleted below
        copy = shutil.copytree(bundle_path, tmp / "copy")
        other = altered_copy(bundle_path, tmp / "other")
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

        new = loader.load_bundle(other)
        replay("replayed after a reload to other cubins")
        _call_and_check(make_case(5, *HEADS, True, seed=4444))
        assert _launchers_from(new), "the eager call did not run the new bundle's kernels"
        assert runtime.module_loads() > loads, "the other cubins were not loaded: not other modules"
        replay("replayed after an eager call on the bundle of other cubins")
        print(f"graph replayed after the reloads, bit-identical; module loads {loads}, then "
              f"{runtime.module_loads()}", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_graph_survives_reload(gpu_bundle):
    run_child("-m", "tests.test_reload_gpu", "graph", str(gpu_bundle.path))


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m tests.test_reload_gpu", description="the children of these tests"
    )
    ap.add_argument("what", choices=["reload", "midcall", "graph"])
    ap.add_argument("bundle")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--reloads", type=int, default=20)
    ap.add_argument("--max-m", type=int, default=MAX_M, choices=range(1, MAX_M + 1), metavar=f"1..{MAX_M}")
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between reloads")
    a = ap.parse_args(argv)
    faulthandler.enable()  # a crash prints every thread's stack
    if a.what == "reload":
        reload_under_load(a.bundle, a.threads, a.reloads, a.max_m, a.interval)
    elif a.what == "midcall":
        reload_mid_call(a.bundle)
    else:
        graph_survives_reload(a.bundle)
    print("child ok")


if __name__ == "__main__":
    main()

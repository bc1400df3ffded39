"""Concurrency and devices: many threads making their first call at once load each cubin once and
all get right results; tensors on cuda:1 run on device 1; a rejected call or a failed load leaves the
context usable. The first-call and failed-load tests run in a fresh process each (tests.helpers.run_child):
loaded modules stay loaded for the life of a process (docs/api.md §10), so only a fresh one makes first
calls and loads a damaged cubin."""

import json
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from tests.helpers import check, device_arch, kv_of, make_case, op_args, run_child

pytestmark = pytest.mark.gpu


def _cubins(bundle, fmt, rope, heads, residual) -> set:
    """The cubins an eager BF16-cache fused call loads: the qkv kernel that normalizes in its prologue when
    the bundle has it (the loader's eager default), else the two-kernel design's qkv and norm kernels."""
    arch = device_arch()
    qkv = [e for e in bundle.manifest.kernels if e.kind == "qkv" and e.arch == arch
           and e.spec["weight_format"] == fmt and e.spec["rope"] == rope and tuple(e.spec["heads"]) == heads
           and kv_of(e.spec) == "bf16"]  # fmt: skip
    pro = [e for e in qkv if e.spec.get("norm", "separate") == "prologue"]
    if pro:
        return {pro[0].file}
    sep = [e for e in qkv if e.spec.get("norm", "separate") == "separate"]
    norm = next(e for e in bundle.manifest.kernels if e.kind == "norm" and e.arch == arch
                and e.spec["residual"] == residual)  # fmt: skip
    return {sep[0].file, norm.file}


def _in_child(func: str, bundle) -> None:
    """tests.test_concurrency_gpu.<func>(bundle path) in a fresh process."""
    code = (
        f"import sys; from tests.test_concurrency_gpu import {func}; {func}(sys.argv[1]); print('child ok')"
    )
    run_child("-c", code, str(bundle.path))


def test_many_threads_first_call(gpu_bundle):
    _in_child("many_threads_first_call", gpu_bundle)


def many_threads_first_call(bundle_path: str):
    import loader
    from loader import runtime

    bundle = loader.load_bundle(bundle_path)  # a fresh process: the calls below are first calls
    before = runtime.module_loads()
    cases = [make_case(1 + i % 8, 16, 8, i % 2 == 0, seed=600 + i, residual=i % 3 != 0,
                       fmt=("bf16", "nvfp4")[i % 4 // 2]) for i in range(16)]  # fmt: skip
    snap = [(c["k_cache"].clone(), c["v_cache"].clone()) for c in cases]
    torch.cuda.synchronize()
    start = threading.Barrier(len(cases))
    out, errors = [None] * len(cases), []

    def worker(i):
        try:
            start.wait()
            out[i] = loader.flint_qkv_fused(**op_args(cases[i]))
            torch.cuda.current_stream().synchronize()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors, errors
    # each distinct cubin (qkv {bf16, nvfp4} x rope {0, 1} for (16, 8), and the norm kernels they need)
    # loaded once
    want = set()
    for i in range(len(cases)):
        want |= _cubins(bundle, ("bf16", "nvfp4")[i % 4 // 2], i % 2 == 0, (16, 8), i % 3 != 0)
    assert runtime.module_loads() - before == len(want), sorted(want)
    for c, (kb, vb), (q, r) in zip(cases, snap, out, strict=True):
        check(c, q, r, kb, vb)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device(gpu_bundle):
    import loader

    c = make_case(3, 16, 2, True, seed=70)
    c = {k: (v.to("cuda:1") if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    q, r = loader.flint_qkv_fused(**op_args(c))
    torch.cuda.synchronize("cuda:1")
    assert q.device == torch.device("cuda:1")
    check(c, q, r, kb, vb)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_calls_keep_the_current_device(gpu_bundle):
    """A call on another device's tensors leaves the thread's current device as it was, as a torch op does
    (the loader pushes and pops the kernel's context), from the main thread and from a new thread with no
    context, with right results on both devices."""
    import loader

    seen, errors = {}, []

    def calls(tag):
        try:
            for dev, seed in (("cuda:1", 80), ("cuda:0", 81), ("cuda:1", 82), ("cuda:0", 83)):
                c = make_case(2, 16, 2, True, seed=seed, device=dev)
                kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
                before = torch.cuda.current_device()
                q, r = loader.flint_qkv_fused(**op_args(c))
                seen.setdefault(tag, []).append((dev, before, torch.cuda.current_device()))
                torch.cuda.synchronize(dev)
                check(c, q, r, kb, vb)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append((tag, repr(e)))

    torch.cuda.set_device(0)
    calls("main")
    t = threading.Thread(target=calls, args=("new thread",))
    t.start()
    t.join()
    assert not errors, errors
    for tag, rows in seen.items():
        assert all(before == after for _, before, after in rows), (tag, rows)
    assert torch.cuda.current_device() == 0


def test_failed_load_leaves_context_usable(gpu_bundle):
    _in_child("failed_load_leaves_context_usable", gpu_bundle)


def failed_load_leaves_context_usable(bundle_path: str):
    """A cubin that fails its check when it is first loaded (a fresh process: none is loaded yet): the call
    raises BundleError before any launch, other kernels of that bundle still serve, and so does the sound
    bundle afterwards."""
    import loader
    from loader.bundle import BundleError

    good = loader.load_bundle(bundle_path)
    bad = Path(tempfile.mkdtemp(prefix="flint-bad-")) / "bad"
    shutil.copytree(bundle_path, bad)
    m = json.loads((bad / "manifest.json").read_text())
    qkv_files = {e["file"] for e in m["kernels"] if e["kind"] == "qkv"}
    victim = next(f for f in _cubins(good, "bf16", True, (16, 2), True) if f in qkv_files)
    p = bad / victim
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the sha256 check refuses it before the driver sees it
    p.write_bytes(bytes(data))
    try:
        loader.load_bundle(bad)
        c = make_case(2, 16, 2, True, seed=71)
        with pytest.raises(BundleError, match="sha256"):
            loader.flint_qkv_fused(**op_args(c))
        assert c["k_cache"].isnan().all()
        c["cos_sin_cache"] = None  # another kernel of the same bundle still works
        kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
        q, r = loader.flint_qkv_fused(**op_args(c))
        torch.cuda.synchronize()
        check(c, q, r, kb, vb)
    finally:
        loader.load_bundle(bundle_path)
        shutil.rmtree(bad.parent)
    c = make_case(2, 16, 2, True, seed=72)
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    q, r = loader.flint_qkv_fused(**op_args(c))
    torch.cuda.synchronize()
    check(c, q, r, kb, vb)

"""Concurrency and devices (issue 6): many threads making their first call at once load each cubin once and
all get right results; tensors on cuda:1 run on device 1; a rejected call or a failed load leaves the
context usable."""

import json
import shutil
import threading

import pytest
import torch

from tests.conftest import needs_gpu
from tests.test_qkv_gpu import check, make_case, op_args

pytestmark = needs_gpu


def test_many_threads_first_call(gpu_bundle):
    import loader
    from loader import runtime

    loader.load_bundle(gpu_bundle.path)  # drops the loaded modules: the next calls are first calls
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
    # norm_res0, norm_res1, qkv {bf16, nvfp4} x rope {0, 1} for (16, 8): 6 distinct cubins, each loaded once
    assert runtime.module_loads() - before == 6
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


def test_failed_load_leaves_context_usable(gpu_bundle, tmp_path):
    import loader
    from loader.bundle import BundleError

    bad = tmp_path / "bad"
    shutil.copytree(gpu_bundle.path, bad)
    m = json.loads((bad / "manifest.json").read_text())
    victim = next(e for e in m["kernels"] if e["kind"] == "qkv" and e["arch"] == "sm_90a" and
                  e["spec"] == {"weight_format": "bf16", "rope": True, "heads": [16, 2]})  # fmt: skip
    p = bad / victim["file"]
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
        loader.load_bundle(gpu_bundle.path)
    c = make_case(2, 16, 2, True, seed=72)
    kb, vb = c["k_cache"].clone(), c["v_cache"].clone()
    q, r = loader.flint_qkv_fused(**op_args(c))
    torch.cuda.synchronize()
    check(c, q, r, kb, vb)

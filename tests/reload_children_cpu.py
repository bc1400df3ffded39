"""tests/test_reload_gpu.py's children run on the CPU (tests/test_reload_cpu.py starts this in a process of
its own: it replaces torch.cuda's streams, graphs and device queries for the whole process).

The children run unchanged against a bundle of fake cubins and a fake flint_qkv_fused that goes through the
loader's real runtime: per-thread plans in runtime.thread_cache(), launchers from runtime.launcher (the
module table on a stubbed driver, as tests/test_reload_cpu.py's), each plan's launches bound when the plan is
built (as Launcher.bind does), the results computed by the float64 reference; a "CUDA graph" records the
captured call's launches and results and replays them. Heads (4, 1) instead of the children's (16, 8): the
same paths, less CPU work. A planted fault may be named:

    python -m tests.reload_children_cpu reload|midcall|graph [none|lazy_launchers|no_generation_bump]

lazy_launchers: the fused op fetches its qkv launcher when it launches it, not with its plan (a call in
flight would switch bundles); no_generation_bump: load_bundle leaves the generation as it was (no thread
drops its launchers and plans). Prints 'harness ok' when the child passed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

import torch

import loader
import loader.bundle
from loader import abi, runtime
from loader.manifest import KernelEntry, Manifest, Param
from loader.reference import qk_norm_rope_ref, rms_norm_ref
from tests import helpers
from tests import test_reload_cpu as cpu
from tests import test_reload_gpu as gpu

HEADS = gpu.HEADS = (4, 1)  # (the children read it at call time)
_capturing: list = []


class _Stream:
    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass


class _Graph:
    def __init__(self):
        self.work = []

    def replay(self):
        for w in self.work:
            w()


@contextlib.contextmanager
def _graph(g, stream=None):
    _capturing.append(g)
    try:
        yield
    finally:
        _capturing.pop()


def _fake_cuda() -> None:
    runtime.cu = cpu._Driver()
    runtime.Launcher.launch = lambda self, dims, stream, pdl: None  # (the driver's launch: nothing to run)
    loader.bundle.check_cubin = lambda e, data: [] if hashlib.sha256(data).hexdigest() == e.sha256 else ["x"]
    torch.cuda.get_device_capability = lambda dev=None: (9, 0)
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda dev=None: None
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda dev=None: _Stream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.CUDAGraph = _Graph
    torch.cuda.graph = _graph
    gpu.make_case = functools.partial(helpers.make_case, device="cpu")


def _bundle(root: Path) -> Path:
    """Fake cubins: the norm kernels, and the qkv kernels of HEADS (BF16, RoPE) of every tile and design."""
    root.mkdir()
    entries = []

    def add(kind, spec, name):
        data = f"\x7fELF fake {name}".encode() * 40
        (root / f"{name}.sm_90a.cubin").write_bytes(data)
        params = (Param("x", "ptr", 16), Param("m", "i32"))
        entries.append(KernelEntry(kind, name, spec, "sm_90a", f"{name}.sm_90a.cubin", len(data),
                                   hashlib.sha256(data).hexdigest(), f"flint_{name}_0", (256, 1, 1),
                                   (1, 1, 1), 0, ("M", 1, 1), params, "k"))  # fmt: skip

    for r in (True, False):
        add("norm", abi.norm_spec(r), f"norm_res{int(r)}")
    for design in abi.NORM_MODES:
        for t in abi.M_TILES:
            add("qkv", abi.qkv_spec("bf16", True, *HEADS, "bf16", design, t), f"qkv_{design}_{t}")
    (root / "manifest.json").write_text(Manifest("flint-aot test", "4.8.1", {}, entries).dumps())
    return root


def _fake_op(fault: str):
    """flint_qkv_fused for CPU tensors of HEADS: a plan per (M, design, residual) in the thread's cache, its
    launchers fetched and their launches bound when it is built; the design the loader's (prologue eagerly,
    separate under capture) unless launch_options says."""

    def qkv(x, residual, norm_weight, eps, weight, weight_scale, global_scale, q_norm_weight, k_norm_weight,
            qk_eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads,
            **scales):  # fmt: skip
        m, has_res = x.shape[0], residual is not None
        design = runtime._options.get().design or ("separate" if _capturing else "prologue")
        tile = abi.m_tiles(m)[0]

        def qkv_launcher():
            spec = abi.qkv_spec("bf16", True, num_q_heads, num_kv_heads, "bf16", design, tile)
            return runtime.launcher(0, "qkv", (tile, design), lambda: spec)

        cache = runtime.thread_cache()
        plan = cache.get(("fake", m, design, has_res))
        if plan is None:
            ks = []
            if design == "separate":
                ks = [runtime.launcher(0, "norm", has_res, lambda: abi.norm_spec(has_res))]
            plan = cache[("fake", m, design, has_res)] = [k.launch for k in [*ks, qkv_launcher()]]
        q = torch.empty(m, num_q_heads * helpers.D, dtype=torch.bfloat16)
        r = x if residual is None else torch.empty_like(x)

        def work():
            for i, launch in enumerate(plan):
                if fault == "lazy_launchers" and i == len(plan) - 1:
                    launch = qkv_launcher().launch
                launch(None, 0, True)
            xn, res = rms_norm_ref(x, residual, norm_weight, eps)
            y = (xn.double() @ weight.double().T).bfloat16()
            qq, kk, vv = qk_norm_rope_ref(y, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions,
                                          num_q_heads, num_kv_heads)  # fmt: skip
            q.copy_(qq.reshape(m, -1))
            if residual is not None:
                r.copy_(res)
            bs = k_cache.shape[1]
            for t, s in enumerate(slot_mapping.tolist()[:m]):
                if 0 <= s < k_cache.shape[0] * bs:
                    k_cache[s // bs, s % bs] = kk[t]
                    v_cache[s // bs, s % bs] = vv[t]

        if _capturing:
            _capturing[-1].work.append(work)
        else:
            work()
        return q, r

    return qkv


def main(argv: list[str]) -> None:
    what, fault = argv[0], (argv[1] if len(argv) > 1 else "none")
    _fake_cuda()
    loader.flint_qkv_fused = _fake_op(fault)
    if fault == "no_generation_bump":
        real = runtime.load_bundle

        def load_bundle(path=None):
            g = runtime._generation
            b = real(path)
            runtime._generation = g
            return b

        runtime.load_bundle = loader.load_bundle = load_bundle
    gpu.MAX_RELOADS = 1000  # (20 s at most, on a failure)
    tmp = Path(tempfile.mkdtemp(prefix="flint-reload-cpu-"))
    try:
        root = _bundle(tmp / "bundle")
        if what == "reload":
            gpu.reload_under_load(str(root), threads=2, reloads=5, max_m=33, interval=0.02)
        elif what == "midcall":
            gpu.reload_mid_call(str(root))
        else:
            gpu.graph_survives_reload(str(root))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("harness ok", what, fault)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Property-based fuzzing (hypothesis) of the five serve-time ops on the GPU: flint_qkv_fused,
qk_norm_rope_cache, gemv, rms_norm, fused_add_rms_norm. tests/fuzz_harness.py says what an example draws
(M, the hidden size K and the q/k norm setting mostly from those the bundle has, head counts in and out of
the bundle, shapes, strides, dtypes, devices, slots, positions, eps values, NVFP4 scales, FP8 caches and
scales, checked mode, PDL on or off) and what is checked (a rejection raises
TypeError / ValueError / LookupError and writes nothing; an accepted call gives the float64 reference's result
and writes only the mapped cache slots; guard bands around every tensor stay bit-identical; the device
synchronizes cleanly after every example).

    PYTHONPATH=. python -m pytest tests/test_fuzz_gpu.py                          # 50 examples per op
    FLINT_FUZZ_EXAMPLES=2000 PYTHONPATH=. python -m pytest tests/test_fuzz_gpu.py  # the long run
    FLINT_AOT_BUNDLE=build/axes PYTHONPATH=. python -m pytest tests/test_fuzz_gpu.py  # configs/axes.yaml's
    ... --hypothesis-seed=N        # a reproducible run

The axes are the bundle's: its hidden sizes per kind and q/k norm settings (build/flint: 2048 and q/k norm
on only; build/axes: 1024 and 1536, q/k norm on and off), each example sometimes drawing one it lacks (a
LookupError when every argument check passes).

A failing example is printed (the drawn dict) with a @reproduce_failure blob, and saved in the example
database ($FLINT_FUZZ_DB, default build/hypothesis: kept between runs on a machine where build/ persists),
which replays it first next time. The end of the session prints the examples per op and their outcomes.
"""

import os

import pytest
import torch

from tests.conftest import ROOT

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from hypothesis.database import DirectoryBasedExampleDatabase
except ImportError:  # the long run asks for it explicitly: then its absence is an error
    if os.environ.get("FLINT_FUZZ_EXAMPLES"):
        raise
    pytest.skip("needs hypothesis (pip install hypothesis)", allow_module_level=True)

from tests.fuzz_harness import OPS, SPECS, Env, FuzzConfig, Kernels, run_example  # noqa: E402
from tests.helpers import device_arch  # noqa: E402

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("FLINT_FUZZ_EXAMPLES", "50"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=False,
    print_blob=True,
    database=DirectoryBasedExampleDatabase(
        os.environ.get("FLINT_FUZZ_DB") or str(ROOT / "build" / "hypothesis")
    ),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module")
def fuzz(gpu_bundle):
    """One environment for every example of the module: the bundle's kernels for this GPU, the devices, and
    the cached weights (one per format and row count, reused by every example)."""
    import loader

    loader.load_bundle(gpu_bundle.path)
    kernels = Kernels.from_bundle(gpu_bundle, device_arch())
    assert kernels.entries, f"the bundle has no kernels for this GPU ({device_arch()})"
    two = torch.cuda.device_count() >= 2
    home = torch.empty(0, device="cuda:0").device
    other = torch.empty(0, device="cuda:1").device if two else None
    limit = min(gpu_bundle.max_tokens("norm"), gpu_bundle.max_tokens("qk_norm_rope_cache"))
    cfg = FuzzConfig(kernels, foreign=("cpu", "other") if two else ("cpu",), homes=(0, 1) if two else (0,),
                     max_tokens=limit)  # fmt: skip
    return cfg, Env(loader, kernels, home, other=other)


@pytest.mark.parametrize("op", OPS)
@FUZZ
@given(data=st.data())
def test_fuzz(fuzz, op, data):
    cfg, env = fuzz
    spec = data.draw(SPECS[op](cfg), label="example")
    run_example(env, spec)

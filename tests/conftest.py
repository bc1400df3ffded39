import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HAS_DSL = importlib.util.find_spec("cutlass") is not None


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


HAS_GPU = _has_gpu()

# The markers (declared in pyproject.toml, registered again below for a run from elsewhere): a test or module
# marked `gpu` is skipped without a CUDA GPU, one marked `dsl` without nvidia-cutlass-dsl
# (pytest_collection_modifyitems). `pytestmark = pytest.mark.gpu`; the aliases are for older modules.
MARKERS = {
    "gpu": ("needs a CUDA GPU and a built bundle", HAS_GPU, "needs a CUDA GPU"),
    "dsl": (
        "needs nvidia-cutlass-dsl (compiles kernels)",
        HAS_DSL,
        "needs nvidia-cutlass-dsl (build machine)",
    ),
}
needs_gpu = pytest.mark.gpu
needs_dsl = pytest.mark.dsl


def pytest_configure(config):
    declared = {line.split(":")[0].strip() for line in config.getini("markers")}
    for name, (doc, _, _) in MARKERS.items():
        if name not in declared:
            config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name, (_, available, reason) in MARKERS.items():
            if not available and item.get_closest_marker(name) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
    # The GPU fuzz runs last: an example that broke the device context would fail every GPU test after it.
    fuzz = [item for item in items if item.path.name == "test_fuzz_gpu.py"]
    if fuzz:
        items[:] = [item for item in items if item.path.name != "test_fuzz_gpu.py"] + fuzz


def pytest_terminal_summary(terminalreporter):
    """The fuzz tests' example counts per op (tests/fuzz_harness.py), when any ran."""
    harness = sys.modules.get("tests.fuzz_harness")
    if harness is not None and harness.COUNTS:
        terminalreporter.write_sep("=", "fuzz examples per op")
        for line in harness.count_table():
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def gpu_bundle():
    """The bundle the GPU tests run against: $FLINT_AOT_BUNDLE, else build/flint (built on the CPU machine
    with `flint-aot build configs/flint.yaml`). A GPU machine without one is an error, not a skip."""
    import loader

    path = os.environ.get("FLINT_AOT_BUNDLE") or str(ROOT / "build" / "flint")
    return loader.load_bundle(path)


@pytest.fixture
def no_local_constants(monkeypatch):
    """Hypothesis mixes constants of every local module loaded (in a full run: every test module) into its
    integer draws, which skews the strategies' small draws (fh._rare, M, the head counts) by which modules the
    run imports: without them, the examples drawn are those of the strategies alone, in any run."""
    from hypothesis.internal.conjecture import providers

    monkeypatch.setattr(providers, "_get_local_constants", providers.Constants)
    providers.CONSTANTS_CACHE.cache.clear()
    yield
    providers.CONSTANTS_CACHE.cache.clear()

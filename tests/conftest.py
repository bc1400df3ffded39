import importlib.util
import os
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
needs_dsl = pytest.mark.skipif(not HAS_DSL, reason="needs nvidia-cutlass-dsl (build machine)")
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


@pytest.fixture(scope="session")
def gpu_bundle():
    """The bundle the GPU tests run against: $FLINT_AOT_BUNDLE, else build/flint (built on the CPU machine
    with `flint-aot build configs/flint.yaml`). A GPU machine without one is an error, not a skip."""
    import loader

    path = os.environ.get("FLINT_AOT_BUNDLE") or str(ROOT / "build" / "flint")
    return loader.load_bundle(path)

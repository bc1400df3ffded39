"""The compiled schedules the design depends on, read from the SASS (nvdisasm from the
nvidia-cuda-nvdisasm wheel): weights issued before griddepcontrol.wait (ACQBULK), activations after it,
no local memory, at most 168 registers (3 CTAs of 128 threads per SM: one wave)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import needs_dsl

pytestmark = needs_dsl


def _nvdisasm():
    try:
        import nvidia.cu13  # noqa: F401  (namespace package of the wheel)

        for base in nvidia.cu13.__path__:
            p = Path(base) / "bin" / "nvdisasm"
            if p.exists():
                return str(p)
    except ImportError:
        pass
    return shutil.which("nvdisasm")


def _sass(cubin: bytes, tmp_path) -> list[str]:
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    f = tmp_path / "k.cubin"
    f.write_bytes(cubin)
    out = subprocess.run([tool, "-c", str(f)], capture_output=True, text=True, check=True).stdout
    return [ln.split(";")[0].strip() for ln in out.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]


def _split(sass):
    waits = [i for i, ln in enumerate(sass) if "ACQBULK" in ln]
    assert len(waits) == 1, f"expected one griddepcontrol.wait (ACQBULK), got {len(waits)}"
    return sass[: waits[0]], sass[waits[0] + 1 :]


def _regs(cubin):
    from loader.elf import read_cubin

    (k,) = read_cubin(cubin).kernels.values()
    return k.registers


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("kind", ["qkv", "gemv"])
def test_gemv_schedules(tmp_path, fmt, kind):
    from flint_aot.kernels import gemv_op, qkv

    if kind == "qkv":
        c = qkv.compile({"weight_format": fmt, "rope": True, "heads": [16, 2]}, "sm_90a", "flint_t")
    else:
        c = gemv_op.compile({"weight_format": fmt}, "sm_90a", "flint_t")
    sass = _sass(c.cubin, tmp_path)
    before, after = _split(sass)
    weights = [ln for ln in sass if re.search(r"\bLDG\..*CONSTANT", ln)]
    assert all(ln in before for ln in weights) and not any("CONSTANT" in ln for ln in after)
    assert len(weights) == (32 if fmt == "bf16" else 16)  # 16 B each (BF16); 8 x 16 B codes + 8 x 4 B scales
    x_loads = [ln for ln in sass if re.search(r"\bLDG\.E\.128\b", ln) and "CONSTANT" not in ln]
    if kind == "qkv":  # x read once per cluster: multicast bulk copies, issued after the wait
        bulk = [ln for ln in sass if "UBLKCP" in ln and "MULTICAST" in ln]
        assert bulk and all(ln in after for ln in bulk) and not x_loads
        assert sum(bool(re.search(r"\bLDS\.128\b", ln)) for ln in after) == 16
    else:
        assert len(x_loads) == 16 and all(ln in after for ln in x_loads), "x must be read after the wait"
    assert not any(re.search(r"\bLDG\.E\.64\b", ln) for ln in before), "positions / slots after the wait"
    if fmt == "nvfp4":
        assert sum("HMUL2" in ln for ln in before) == 64  # half of the e2m1 decode before the wait
    assert not any(re.search(r"\b(STL|LDL)\b", ln) for ln in sass), "local memory (spills)"
    assert _regs(c.cubin) <= 168


def test_norm_schedule(tmp_path):
    from flint_aot.kernels import norm

    c = norm.compile({"residual": True}, "sm_90a", "flint_t")
    sass = _sass(c.cubin, tmp_path)
    before, after = _split(sass)
    assert any("PREEXIT" in ln for ln in before), "launch_dependents must come first"
    assert sum(bool(re.search(r"\bLDG\.E\.128\b", ln)) for ln in after) == 2  # x and the residual
    assert sum(bool(re.search(r"\bLDG\b", ln)) for ln in before) == 1  # the norm weight only

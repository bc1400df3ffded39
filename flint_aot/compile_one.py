"""Compile one specialization; run as its own process by the builder (a DSL crash kills only it).

    python -m flint_aot.compile_one KIND SPEC_JSON ARCH ENTRY_PREFIX OUT_DIR

Writes OUT_DIR/kernel.cubin, OUT_DIR/kernel.ptx and OUT_DIR/meta.json. Started by the builder in its own
session; dies with the builder (PR_SET_PDEATHSIG), so a killed build leaves no compile running.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time

_PR_SET_PDEATHSIG = 1


def _die_with_builder() -> None:
    """SIGKILL this process when the builder thread that started it ends (also by SIGKILL)."""
    parent = os.environ.get("FLINT_AOT_BUILDER_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the builder was already gone before prctl
        os._exit(1)


def main(argv: list[str]) -> int:
    kind, spec_json, arch, prefix, out = argv
    _die_with_builder()
    # Never let the DSL guess the target from a (missing) GPU: the arch is always explicit.
    os.environ["CUTE_DSL_ARCH"] = arch
    from flint_aot.kernels import kernel_class

    cls = kernel_class(kind)
    t0 = time.perf_counter()
    c = cls(json.loads(spec_json)).compile(arch, prefix)
    secs = time.perf_counter() - t0
    with open(os.path.join(out, "kernel.cubin"), "wb") as f:
        f.write(c.cubin)
    with open(os.path.join(out, "kernel.ptx"), "w", encoding="utf-8") as f:
        f.write(c.ptx)
    meta = {
        "entry": c.entry,
        "params": [list(p) for p in c.params],
        "block": list(c.block),
        "cluster": list(c.cluster),
        "grid": list(c.grid),
        "dyn_smem": c.dyn_smem,
        "dyn_smem_per_m": c.dyn_smem_per_m,
        "compile_seconds": round(secs, 3),
    }
    with open(os.path.join(out, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Compile one specialization; run as its own process by the builder (a DSL crash kills only it).

    python -m flint_aot.compile_one KIND SPEC_JSON ARCH ENTRY_PREFIX OUT_DIR DIAGNOSTICS_JSON [PLUGIN_JSON]

DIAGNOSTICS_JSON is the config's diagnostics section ({} for a serving build; built-in kinds only).
PLUGIN_JSON ({"module": ..., "class": ...}) names a plugin kind's kernel class, imported with
$FLINT_AOT_PLUGIN_PATH appended to sys.path; its grid rule is the caller's (loader.abi.CALLER_GRID).
Writes OUT_DIR/kernel.cubin, OUT_DIR/kernel.ptx and OUT_DIR/meta.json. Started by the builder in its own
session; dies with the builder (PR_SET_PDEATHSIG), so a killed build leaves no compile running.
"""

from __future__ import annotations

import ctypes
import errno
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


def _write(path: str, data) -> None:
    """Write a file whole; a failed write (a full disk, a file size limit) exits naming the OS error and the
    file, not as the truncated cubin it would leave for the builder to read."""
    try:
        with open(path, "wb" if isinstance(data, bytes) else "w", **({} if isinstance(data, bytes) else
                                                                    {"encoding": "utf-8"})) as f:  # fmt: skip
            f.write(data)
    except OSError as e:
        _refused(e, path)


def _refused(e: OSError, path: str) -> None:
    """Exit naming the OS error and the file (one line: the builder shows it under the specialization)."""
    what = errno.errorcode.get(e.errno, e.errno)
    sys.stderr.write(f"cannot write {path}: {e.strerror or e} ({what}); free space there or raise the file "
                     "size limit (ulimit -f), then build again\n")  # fmt: skip
    sys.exit(3)


def main(argv: list[str]) -> int:
    kind, spec_json, arch, prefix, out, diag_json, *plugin = argv
    _die_with_builder()
    # Never let the DSL guess the target from a (missing) GPU: the arch is always explicit.
    os.environ["CUTE_DSL_ARCH"] = arch
    grid = None
    if plugin:
        import importlib

        from loader.abi import CALLER_GRID

        p, grid = json.loads(plugin[0]), CALLER_GRID
        sys.path.append(os.environ.get("FLINT_AOT_PLUGIN_PATH", "."))
        make = getattr(importlib.import_module(p["module"]), p["class"])
    else:
        from flint_aot.kernels import kernel_class
        from flint_aot.kernels.diagnostics import Diagnostics

        cls, diag = kernel_class(kind), Diagnostics.from_config(json.loads(diag_json))
        make = lambda spec: cls(spec, arch, diag)  # noqa: E731
    t0 = time.perf_counter()
    try:
        c = make(json.loads(spec_json)).compile(arch, prefix, grid)
    except OSError as e:  # a file the compile writes (the DSL's cubin in TMPDIR) could not be written
        _refused(e, e.filename or "a file in " + out)
    secs = time.perf_counter() - t0
    _write(os.path.join(out, "kernel.cubin"), c.cubin)
    _write(os.path.join(out, "kernel.ptx"), c.ptx)
    meta = {
        "entry": c.entry,
        "params": [list(p) for p in c.params],
        "block": list(c.block),
        "cluster": list(c.cluster),
        "cluster_policy": c.cluster_policy,
        "grid": list(c.grid),
        "dyn_smem": c.dyn_smem,
        "compile_seconds": round(secs, 3),
    }
    _write(os.path.join(out, "meta.json"), json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Plugin kernels (docs/plugins.md): the checks that need a plugin's module imported, run before anything
compiles, and the record of what the bundle was built from.

`check(config, config_path)` runs `python -m flint_aot.plugins` once per build that has plugins: a process of
its own, as every compile is, so that the builder never imports the DSL (the modules import it) and a module
that crashes the interpreter fails the check, not the build tool. That process imports each plugin's module
exactly as its compiles will (the config file's folder appended to the import path), checks that the class
derives from flint_aot.Kernel, constructs it with every spec of the matrix, reads each one's kernel
parameters (the flat ABI the manifest records), and hashes the module's sources. Any failure is one line
naming the config file, the key and the fix.

What is hashed (a plugin kernel's cache key and the manifest's `source_sha256`): every `*.py` file under the
directory of the module's top-level package (`silu_mul.kernel` -> all of `silu_mul/`, subfolders included), or
the module's file alone when it is a top-level module, each with its path relative to that directory's parent
(so the key does not depend on where the checkout lies).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from flint_aot.config import ConfigError, expand
from loader.manifest import cluster_policy_problem

PATH_ENV = "FLINT_AOT_PLUGIN_PATH"  # the folder appended to sys.path of the check and compile processes
RESERVED = ("stream", "smem", "pdl")  # loader.launch_kernel's own keywords: no kernel parameter may use them
CHECK_TIMEOUT_S = 300
_MARK = "flint-aot-plugins: "  # the result's line on stdout (a module may print, the DSL may too)


def search_path(config_path) -> str:
    return str(Path(config_path).absolute().parent)


def check(config: dict, config_path, stop=None) -> dict[str, dict] | None:
    """{kind: record} of the config's plugins (module, class, source_sha256, files, version), or a one-line
    ConfigError. Starts one process; nothing is compiled or written. None when `stop` (a builder.Stop) is
    requested meanwhile: the process is killed."""
    specs = {}
    for s in expand(config):
        if s.plugin and s.spec not in specs.setdefault(s.kind, []):
            specs[s.kind].append(s.spec)
    job = {"source": str(config_path), "plugins": {k: dict(config["plugins"][k], specs=v)
                                                   for k, v in specs.items()}}  # fmt: skip
    env = dict(os.environ, **{PATH_ENV: search_path(config_path), "FLINT_AOT_BUILDER_PID": str(os.getpid())})
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env.setdefault("CUTE_DSL_ARCH", config["archs"][0])  # (the DSL never asks a GPU)
    p = subprocess.Popen([sys.executable, "-m", "flint_aot.plugins", json.dumps(job)], env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         errors="replace", start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + CHECK_TIMEOUT_S
    while True:
        try:
            stdout, stderr = p.communicate(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if (stop is not None and stop.requested) or time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
                if stop is not None and stop.requested:
                    return None
                raise ConfigError(f"{config_path}: plugins: importing the plugin modules took over "
                                  f"{CHECK_TIMEOUT_S} s; make importing them cheap (no work at import "
                                  "time)") from None  # fmt: skip
    r = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    found = [ln[len(_MARK) :] for ln in r.stdout.splitlines() if ln.startswith(_MARK)]
    if not found:
        how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit status {r.returncode}"
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        raise ConfigError(f"{config_path}: plugins: checking the plugin modules failed ({how}): {tail}; "
                          "run `python -c 'import MODULE'` with the config's folder on PYTHONPATH to see "
                          "why")  # fmt: skip
    out = json.loads(found[-1])
    if "error" in out:
        raise ConfigError(out["error"])
    return out["records"]


# ----------------------------------------------------------------------------- the checking process
def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def sources(module) -> tuple[str, list[str]]:
    """(sha256, relative file names) of what a plugin's cache key covers (the module docstring says what)."""
    top = sys.modules[module.__name__.split(".")[0]]
    if hasattr(top, "__path__"):
        files = [(Path(d), p) for d in top.__path__ for p in Path(d).rglob("*.py")]
        files = [(f"{top.__name__}/{p.relative_to(d).as_posix()}", p) for d, p in files]
    else:
        files = [(Path(top.__file__).name, Path(top.__file__))]
    h = hashlib.sha256()
    for name, p in sorted(files):
        h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest(), sorted(name for name, _ in files)


def version_of(module_name: str) -> str | None:
    """The version of the installed distribution that provides the module's top-level package, if any."""
    dists = metadata.packages_distributions().get(module_name.split(".")[0], [])
    return f"{dists[0]} {metadata.version(dists[0])}" if dists else None


def _check_one(src: str, kind: str, p: dict) -> dict:
    from flint_aot.kernels.compile import Kernel, kernel_params

    where, attr = f"{src}: plugins.{kind}", p.get("class", "KERNEL")
    try:
        mod = importlib.import_module(p["module"])
    except ImportError as e:
        raise ConfigError(f"{where}.module: cannot import {p['module']!r} ({_one_line(e)}); install it, or "
                          "put it in the config file's folder (searched last)") from None  # fmt: skip
    except Exception as e:  # noqa: BLE001 - any failure of the module's own code
        raise ConfigError(f"{where}.module: importing {p['module']!r} raised {_one_line(e)}; fix the "
                          "module") from None  # fmt: skip
    cls = getattr(mod, attr, None)
    if cls is None:
        if "class" in p:
            raise ConfigError(f"{where}.class: module {p['module']!r} has no {attr}; name its kernel class")
        raise ConfigError(f"{where}: module {p['module']!r} has no KERNEL; name its kernel class with "
                          f"plugins.{kind}.class, or define KERNEL = <the class> in the module")  # fmt: skip
    if not (isinstance(cls, type) and issubclass(cls, Kernel)) or cls is Kernel:
        raise ConfigError(f"{where}.class: {p['module']}.{attr} is {cls!r}, not a subclass of "
                          "flint_aot.Kernel; derive the kernel class from flint_aot.Kernel "
                          "(docs/plugins.md)")  # fmt: skip
    name = cls.__name__
    for spec in p["specs"]:
        try:
            k = cls(dict(spec))
        except Exception as e:  # noqa: BLE001 - the constructor's refusal, whatever its type
            raise ConfigError(f"{where}.spec: {name} rejects the spec {spec} ({_one_line(e)}); give the axes "
                              f"and values {name}.__init__ accepts") from None  # fmt: skip
        try:
            params = kernel_params(k.kernel, k.ptr_types())
        except (AttributeError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}.class: {name}'s kernel has no flat parameter list ({_one_line(e)}); "
                              "see docs/plugins.md §2") from None  # fmt: skip
        taken = [n for n, _, _ in params if n in RESERVED]
        if taken:
            raise ConfigError(f"{where}.class: {name}'s kernel has a parameter named {taken[0]!r}, a keyword "
                              "of loader.launch_kernel; rename the parameter")  # fmt: skip
        dims = (*k.block, *k.cluster)
        if len(dims) != 6 or not all(type(d) is int and d > 0 for d in dims) or not (
                type(k.dyn_smem) is int and k.dyn_smem >= 0):  # fmt: skip
            raise ConfigError(f"{where}.class: {name} (spec {spec}) needs block and cluster of three "
                              "positive ints and dyn_smem an int >= 0 (docs/plugins.md §2)")  # fmt: skip
        bad = cluster_policy_problem(k.cluster_policy, k.cluster)
        if bad:
            raise ConfigError(f"{where}.class: {name}: {bad} (docs/plugins.md §2)")
    sha, files = sources(mod)
    return {"module": p["module"], "class": name, "source_sha256": sha, "files": files,
            "version": version_of(p["module"])}  # fmt: skip


def main(argv: list[str]) -> int:
    from flint_aot.compile_one import _die_with_builder

    _die_with_builder()
    job = json.loads(argv[0])
    sys.path.append(os.environ[PATH_ENV])
    try:
        out = {"records": {k: _check_one(job["source"], k, p) for k, p in job["plugins"].items()}}
    except ConfigError as e:
        out = {"error": str(e)}
    print(_MARK + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

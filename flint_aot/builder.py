"""Build a bundle: compile every specialization (each in its own process, in parallel), reuse cached
cubins, and replace the output directory atomically with the new bundle, manifest written last."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from flint_aot import __version__, kernels
from flint_aot.config import Specialization, expand, load_config
from loader.bundle import check_cubin
from loader.manifest import MANIFEST_NAME, KernelEntry, Manifest, Param, sha256_bytes

_ROOT = Path(__file__).resolve().parent.parent
COMPILE_TIMEOUT_S = 900


class BuildError(RuntimeError):
    pass


@dataclass
class Row:
    spec: Specialization
    status: str  # "compiled" | "cached"
    entry: KernelEntry
    seconds: float
    cubin: bytes = field(repr=False, default=b"")


@dataclass
class BuildResult:
    out: Path
    rows: list[Row] = field(default_factory=list)
    skipped: list[Specialization] = field(default_factory=list)  # kinds with no kernel in this version

    @property
    def compiled(self) -> int:
        return sum(r.status == "compiled" for r in self.rows)


def dsl_version() -> str:
    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        raise BuildError(
            "nvidia-cutlass-dsl is not installed: the build compiles with it (`pip install -e .`)"
        ) from None


def default_cache_dir() -> Path:
    env = os.environ.get("FLINT_AOT_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flint-aot"


def build_key(s: Specialization, src: str, dsl: str) -> str:
    blob = json.dumps(
        {"kind": s.kind, "name": s.name, "spec": s.spec, "arch": s.arch, "src": src, "dsl": dsl},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _entry(s: Specialization, key: str, cubin: bytes, meta: dict) -> KernelEntry:
    from loader.elf import read_cubin

    info = read_cubin(cubin).kernels.get(meta["entry"])
    return KernelEntry(
        kind=s.kind,
        name=s.name,
        spec=s.spec,
        arch=s.arch,
        file=f"{s.name}.{s.arch}.cubin",
        size=len(cubin),
        sha256=sha256_bytes(cubin),
        entry=meta["entry"],
        block=tuple(meta["block"]),
        cluster=tuple(meta["cluster"]),
        dyn_smem=int(meta["dyn_smem"]),
        grid=tuple(meta["grid"]),
        params=tuple(Param(n, t) for n, t in meta["params"]),
        build_key=key,
        registers=(info.registers or 0) if info else 0,
    )


# ----------------------------------------------------------------------------- cache
def _cache_get(cache: Path, key: str) -> tuple[bytes, dict] | None:
    d = cache / key
    try:
        meta = json.loads((d / "meta.json").read_text())
        cubin = (d / "kernel.cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if sha256_bytes(cubin) != meta.get("sha256"):
        return None  # damaged entry: recompile
    return cubin, meta


def _cache_put(cache: Path, key: str, cubin: bytes, meta: dict) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}.", dir=cache))
    try:
        (tmp / "kernel.cubin").write_bytes(cubin)
        (tmp / "meta.json").write_text(json.dumps(dict(meta, sha256=sha256_bytes(cubin)), sort_keys=True))
        try:
            os.rename(tmp, cache / key)
        except OSError:
            pass  # another build stored the same key meanwhile: same bytes
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- compile
def _compile(s: Specialization) -> tuple[bytes, dict]:
    with tempfile.TemporaryDirectory(prefix="flint-aot-compile-") as d:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
        cmd = [
            sys.executable, "-m", "flint_aot.compile_one",
            s.kind, json.dumps(s.spec), s.arch, kernels.entry_prefix(s.name), d,
        ]  # fmt: skip
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise BuildError(f"{s.label}: compile timed out after {COMPILE_TIMEOUT_S} s") from None
        if p.returncode != 0:
            how = f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit status {p.returncode}"
            tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:])
            raise BuildError(f"{s.label}: compile failed ({how})\n{tail}")
        cubin = Path(d, "kernel.cubin").read_bytes()
        meta = json.loads(Path(d, "meta.json").read_text())
    return cubin, meta


# ----------------------------------------------------------------------------- install
def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync_dir(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _install(staging: Path, out: Path) -> None:
    if not out.exists():
        os.rename(staging, out)
    elif _exchange(staging, out):
        shutil.rmtree(staging)  # now holds the previous bundle
    else:
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(staging, out)
        shutil.rmtree(old)
    _fsync_dir(out.parent)


def _check_output_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST_NAME).exists())):
        raise BuildError(
            f"{out} exists and is not a flint-aot bundle; refusing to replace it (choose another -o)"
        )


def _clean_stale_staging(out: Path) -> None:
    """Staging folders left by killed builds: .NAME.tmp-PID-* whose PID is gone."""
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            pid = int(p.name.rsplit(".tmp-", 1)[1].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, PermissionError, IndexError):
            pass


# ----------------------------------------------------------------------------- build
def build(
    config_path: str | os.PathLike,
    out: str | os.PathLike,
    jobs: int = 1,
    cache_dir: str | os.PathLike | None = None,
    progress=None,
) -> BuildResult:
    """progress: optional callable(label, status) called once per specialization as it finishes."""
    config = load_config(config_path)
    out = Path(out).absolute()
    _check_output_dir(out)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    specs = expand(config)
    todo = [s for s in specs if kernels.implemented(s.kind, s.spec)]
    result = BuildResult(out=out, skipped=[s for s in specs if not kernels.implemented(s.kind, s.spec)])
    if not todo:
        raise BuildError(f"{config_path}: none of the requested kernels is implemented in this version")
    src, dsl = kernels.source_hash(), dsl_version()

    rows: dict[str, Row] = {}
    pending = []
    for s in todo:
        key = build_key(s, src, dsl)
        hit = _cache_get(cache, key)
        if hit is not None and not check_cubin(_entry(s, key, *hit), hit[0]):
            rows[s.label] = Row(s, "cached", _entry(s, key, *hit), 0.0, hit[0])
            if progress:
                progress(s.label, "cached")
        else:
            pending.append((s, key))

    errors = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futs = {pool.submit(_timed_compile, s): (s, key) for s, key in pending}
        for fut in as_completed(futs):
            s, key = futs[fut]
            try:
                (cubin, meta), secs = fut.result()
                e = _entry(s, key, cubin, meta)
                problems = check_cubin(e, cubin)
                if problems:
                    raise BuildError(f"{s.label}: cubin does not match its metadata: {'; '.join(problems)}")
                _cache_put(cache, key, cubin, meta)
                rows[s.label] = Row(s, "compiled", e, secs, cubin)
                if progress:
                    progress(s.label, "compiled")
            except Exception as exc:  # noqa: BLE001 - every failure is reported, with its specialization
                errors.append(str(exc) if isinstance(exc, BuildError) else f"{s.label}: {exc!r}")
                if progress:
                    progress(s.label, "FAILED")
    if errors:
        raise BuildError(
            f"{len(errors)} of {len(todo)} specializations failed; the previous bundle "
            "(if any) is untouched:\n" + "\n".join(errors)
        )

    result.rows = [rows[s.label] for s in todo]
    manifest = Manifest(
        generator=f"flint-aot {__version__}",
        dsl_version=dsl,
        config=config,
        kernels=[r.entry for r in result.rows],
    )
    _write_bundle(out, manifest, {r.entry.file: r.cubin for r in result.rows})
    return result


def _timed_compile(s: Specialization):
    t0 = time.perf_counter()
    r = _compile(s)
    return r, time.perf_counter() - t0


def _write_bundle(out: Path, manifest: Manifest, files: dict[str, bytes]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_staging(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        for name, data in sorted(files.items()):
            with open(staging / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        with open(staging / MANIFEST_NAME, "w", encoding="utf-8") as f:  # last: marks the bundle complete
            f.write(manifest.dumps())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(staging, 0o755)
        _fsync_dir(staging)
        _install(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)

"""Build a bundle: compile every specialization (each in its own process, in parallel), reuse cached
cubins, and replace the output directory atomically with the new bundle, manifest written last.

Two steps: `prepare` checks everything that can be checked without compiling (the config, the output and
cache paths, which specializations the cache already holds) and `execute` compiles the rest and installs
the bundle. `build` does both. A `Stop` (set from a signal handler) cancels a build at any point before the
bundle is swapped into place: queued compiles never start, running ones are killed with their process
groups, the cache keeps what finished and the previous bundle stays as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from flint_aot import __version__, kernels, plugins
from flint_aot.config import Specialization, expand, load_config
from loader.elf import CubinError, check_cubin
from loader.manifest import MANIFEST_NAME, KernelEntry, Manifest, Param, sha256_bytes

_ROOT = Path(__file__).resolve().parent.parent
COMPILE_TIMEOUT_S = 900
KILL_GRACE_S = 0.5  # after SIGTERM to a compile's process group, before SIGKILL


class BuildError(RuntimeError):
    pass


class BuildInterrupted(BuildError):
    """The build was stopped (a signal); nothing was installed. `signum` is the signal's number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


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

    @property
    def compiled(self) -> int:
        return sum(r.status == "compiled" for r in self.rows)


@dataclass
class Plan:
    """What a build will do, decided before anything is compiled (see `prepare`)."""

    config_path: Path
    config: dict
    out: Path
    cache: Path
    todo: list[Specialization]  # every specialization to put in the bundle, in bundle order
    cached: dict[str, Row]  # label -> row, for those the cache already holds
    pending: list[tuple[Specialization, str]]  # (spec, cache key) still to compile
    dsl: str
    plugins: dict = field(default_factory=dict)  # kind -> what the manifest records of a plugin (its sources)


class Stop:
    """A cancellation request, safe to make from a signal handler (`request` only stores the signal number
    and wakes the build's event queue; `queue.SimpleQueue.put` is reentrant)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._queues: list[queue.SimpleQueue] = []

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def request(self, signum: int = signal.SIGINT) -> None:
        if self.signum is None:
            self.signum = signum
        for q in list(self._queues):
            q.put(None)

    def _attach(self, q: queue.SimpleQueue) -> None:
        self._queues.append(q)

    @contextlib.contextmanager
    def on_signals(self, *signums: int):
        """Turn the given signals into a stop request while the block runs (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, lambda n, _frame: self.request(n)) for s in signums}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


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


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask; a container's CPU set), the default for -j."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def key_source(s: Specialization, src: str, records: dict) -> str:
    """What a specialization's cache key says of its sources: flint-aot's kernel sources (src), and for a
    plugin kind also its module, class and the hash of its module's sources (flint_aot.plugins)."""
    if not s.plugin:
        return src
    return hashlib.sha256(json.dumps({"flint": src, "plugin": s.plugin, **records[s.kind]},
                                     sort_keys=True).encode()).hexdigest()  # fmt: skip


def build_key(s: Specialization, src: str, dsl: str) -> str:
    what = {"kind": s.kind, "name": s.name, "spec": s.spec, "arch": s.arch, "src": src, "dsl": dsl}
    if s.diagnostics:  # (a diagnostic build's cubins are other cubins)
        what["diagnostics"] = dict(s.diagnostics)
    blob = json.dumps(what, sort_keys=True)
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
        cluster_policy=str(meta.get("cluster_policy", "")),
        dyn_smem=int(meta["dyn_smem"]),
        grid=tuple(meta["grid"]),
        params=tuple(Param(*p) for p in meta["params"]),
        build_key=key,
        registers=(info.registers or 0) if info else 0,
    )


# ----------------------------------------------------------------------------- stale leftovers
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _sweep(folder: Path, prefix: str) -> None:
    """Remove folder/PREFIX<pid>-* left by builds that were killed (their pid no longer exists)."""
    try:
        items = list(folder.glob(f"{prefix}*"))
    except OSError:
        return
    for p in items:
        try:
            pid = int(p.name[len(prefix) :].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------- cache
def _cache_get(cache: Path, key: str) -> tuple[bytes, dict] | None:
    d = cache / key
    try:
        meta = json.loads((d / "meta.json").read_text())
        cubin = (d / "kernel.cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or sha256_bytes(cubin) != meta.get("sha256"):
        return None  # damaged entry: recompile
    return cubin, meta


def _cache_put(cache: Path, key: str, cubin: bytes, meta: dict) -> None:
    """Store atomically: written into .tmp-PID-*, then renamed to its key (a reader sees all or nothing)."""
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-", dir=cache))
    try:
        f = tmp / "kernel.cubin"
        try:
            f.write_bytes(cubin)
            f = tmp / "meta.json"
            f.write_text(json.dumps(dict(meta, sha256=sha256_bytes(cubin)), sort_keys=True))
        except OSError as e:
            raise BuildError(f"cache {f}: cannot write ({e.strerror}); free space there or choose another "
                             "--cache-dir") from None  # fmt: skip
        try:
            os.rename(tmp, cache / key)
        except OSError:
            pass  # another build stored the same key meanwhile: same bytes
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- paths, checked up front
def _nearest_existing(p: Path) -> Path:
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def _mount_points() -> set[str]:
    """Every mount point of this process's mount namespace (bind mounts included, which os.path.ismount
    misses when they stay on one file system)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            fields = [line.split(" ")[4] for line in f if line.count(" ") >= 4]
    except OSError:
        return set()
    unescape = lambda m: chr(int(m.group(1), 8))  # noqa: E731 - mountinfo writes space as \040 etc.
    return {re.sub(r"\\([0-7]{3})", unescape, f) for f in fields}


def is_mount_point(p: Path) -> bool:
    try:
        return os.path.ismount(p) or os.path.realpath(p) in _mount_points()
    except OSError:
        return False


def _writable(d: Path) -> str | None:
    """Why files cannot be created in the existing directory d, or None."""
    if os.access(d, os.W_OK | os.X_OK):
        return None
    with contextlib.suppress(OSError):
        if os.statvfs(d).f_flag & os.ST_RDONLY:
            return "is on a read-only file system"
    return "is not writable by this user"


def check_writable_dir(p: Path, what: str, fix: str) -> None:
    """p is a directory, or can be created as one, that this process can write into; else a one-line
    BuildError naming p and the fix."""
    base = _nearest_existing(p)
    if not base.is_dir():
        where = "is a file" if base == p else f"lies under {base}, which is a file"
        raise BuildError(f"{what} {p} {where}, not a directory; {fix}")
    why = _writable(base)
    if why:
        raise BuildError(f"{what} {p}: {base} {why}; {fix}")


def check_output_path(out: Path) -> None:
    """Everything installing the bundle needs, checked before compiling: out is absent, empty or a bundle;
    out's parent can be written (the staging folder goes beside out); out can be renamed (a mount point
    cannot: the atomic swap renames the bundle directory) and its old contents removed."""
    fix = "choose another -o"
    if not os.path.lexists(out):
        check_writable_dir(out, "output", fix)
        return
    if not out.is_dir():
        raise BuildError(f"output {out} is a file, not a bundle directory; {fix}")
    try:
        entries = list(out.iterdir())
    except OSError as e:
        raise BuildError(f"output {out}: cannot list it ({e.strerror}); {fix}") from None
    if entries and not (out / MANIFEST_NAME).exists():
        raise BuildError(f"{out} exists and is not a flint-aot bundle; refusing to replace it ({fix})")
    if is_mount_point(out):
        raise BuildError(
            f"output {out} is a mount point: the build replaces a bundle by renaming its directory, which "
            f"a mount point cannot be; use a directory inside it (-o {out / 'flint'})"
        )
    for d in (out.parent, out):
        why = _writable(d)
        if why:
            raise BuildError(f"output {out}: {d} {why}; {fix}")


def check_cache_dir(cache: Path) -> None:
    check_writable_dir(cache, "cache directory", "choose another with --cache-dir or $FLINT_AOT_CACHE")


# ----------------------------------------------------------------------------- compile
def _compile_command(s: Specialization, work: Path) -> list[str]:
    plugin = [json.dumps({"module": s.plugin[0], "class": s.plugin[1]})] if s.plugin else []
    return [
        sys.executable, "-m", "flint_aot.compile_one", s.kind, json.dumps(s.spec), s.arch,
        kernels.entry_prefix(s.name), str(work), json.dumps(dict(s.diagnostics)), *plugin,
    ]  # fmt: skip


class _Compiler:
    """Runs compile processes, each in its own session (so a terminal's Ctrl-C reaches only the builder,
    which decides) and its own work folder under the cache's .work-PID-* (TMPDIR of the compile: the DSL's
    scratch files land there too, and are removed with it)."""

    def __init__(self, work_root: Path, stop: Stop, plugin_path: str = ""):
        self.work_root = work_root
        self.stop = stop
        self.plugin_path = plugin_path  # the config's folder: plugin modules are imported from it too
        self.lock = threading.Lock()
        self.running: set[subprocess.Popen] = set()
        self.closed = False  # set when the build ends early for any reason: start nothing more

    @property
    def _stopped(self) -> bool:
        return self.closed or self.stop.requested

    def compile(self, s: Specialization) -> tuple[bytes, dict, float] | None:
        """(cubin, meta, seconds), or None when stopped before or during the compile."""
        if self._stopped:
            return None
        t0 = time.perf_counter()
        work = Path(tempfile.mkdtemp(prefix=f"{s.name}.{s.arch}.", dir=self.work_root)).resolve()
        try:
            env = dict(os.environ, TMPDIR=str(work), FLINT_AOT_BUILDER_PID=str(os.getpid()))
            env[plugins.PATH_ENV] = self.plugin_path
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
            with self.lock:
                if self._stopped:
                    return None
                # (cwd: `python -m` puts the working directory first on sys.path, so a build started in
                # another checkout would compile that checkout's kernels; the work folder holds no package)
                p = subprocess.Popen(
                    _compile_command(s, work), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True, cwd=work,
                )  # fmt: skip
                self.running.add(p)
            try:
                stdout, stderr = p.communicate(timeout=COMPILE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._signal(p, signal.SIGKILL)
                p.communicate()
                raise BuildError(f"{s.label}: compile timed out after {COMPILE_TIMEOUT_S} s") from None
            finally:
                with self.lock:
                    self.running.discard(p)
            if self._stopped:
                return None
            if p.returncode != 0:
                how = (
                    f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit status {p.returncode}"
                )
                tail = "\n".join((stderr or stdout).strip().splitlines()[-15:])
                raise BuildError(f"{s.label}: compile failed ({how})\n{tail}")
            cubin = (work / "kernel.cubin").read_bytes()
            meta = json.loads((work / "meta.json").read_text())
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return cubin, meta, time.perf_counter() - t0

    @staticmethod
    def _signal(p: subprocess.Popen, sig: int) -> None:
        if p.poll() is None:  # not reaped yet: its pid is still its process group's id
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)

    def kill_all(self) -> None:
        """Start nothing more; SIGTERM every running compile's process group, SIGKILL what is left after
        KILL_GRACE_S."""
        with self.lock:
            self.closed = True
            procs = list(self.running)
        for p in procs:
            self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_S
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        for p in procs:
            self._signal(p, signal.SIGKILL)


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


# ----------------------------------------------------------------------------- build
def prepare(
    config_path: str | os.PathLike,
    out: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    stop: Stop | None = None,
) -> Plan:
    """Validate the config and the output and cache paths, check the plugins' modules (a subprocess), and look
    up the cache. Compiles nothing, writes nothing; every error here is a one-line BuildError/ConfigError;
    BuildInterrupted when `stop` is requested during the plugins' check."""
    config = load_config(config_path)
    out = Path(out).absolute()
    if out.is_symlink():
        out = out.resolve()  # replace the bundle the link points to, keep the link
    check_output_path(out)
    cache = Path(cache_dir).absolute() if cache_dir else default_cache_dir().absolute()
    check_cache_dir(cache)
    todo = expand(config)
    src, dsl = kernels.source_hash(), dsl_version()
    records = plugins.check(config, config_path, stop) if "plugins" in config else {}  # (a subprocess)
    if records is None:
        name = signal.Signals(stop.signum).name
        raise BuildInterrupted(stop.signum, f"interrupted ({name}) while checking the plugin modules: "
                               f"nothing compiled; {out} untouched")  # fmt: skip
    cached: dict[str, Row] = {}
    pending = []
    for s in todo:
        key = build_key(s, key_source(s, src, records), dsl)
        hit = _cache_get(cache, key)
        entry = None
        if hit is not None:
            try:
                entry = _entry(s, key, *hit)
            except (CubinError, KeyError, TypeError, ValueError):
                entry = None  # damaged entry: recompile
        if entry is not None and not check_cubin(entry, hit[0]):
            cached[s.label] = Row(s, "cached", entry, 0.0, hit[0])
        else:
            pending.append((s, key))
    return Plan(Path(config_path), config, out, cache, todo, cached, pending, dsl, records)


def execute(plan: Plan, jobs: int = 1, progress=None, stop: Stop | None = None) -> BuildResult:
    """Compile plan.pending (jobs at a time), store each in the cache as it finishes, then install the
    bundle. progress: optional callable(label, status, seconds) per compile as it finishes ("compiled" or
    "FAILED"). Raises BuildInterrupted when stop is requested before the bundle is installed."""
    stop = stop or Stop()
    rows = dict(plan.cached)
    if stop.requested:
        raise _interrupted(plan, stop, rows)
    errors = []
    _sweep(plan.cache, ".work-")  # what builds killed by SIGKILL left
    _sweep(plan.cache, ".tmp-")
    if plan.pending:
        plan.cache.mkdir(parents=True, exist_ok=True)
        work_root = Path(tempfile.mkdtemp(prefix=f".work-{os.getpid()}-", dir=plan.cache))
        compiler = _Compiler(work_root, stop, plugins.search_path(plan.config_path))
        events: queue.SimpleQueue = queue.SimpleQueue()
        stop._attach(events)
        pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="flint-aot-compile")
        finished = False
        try:
            for s, key in plan.pending:
                fut = pool.submit(compiler.compile, s)
                fut.add_done_callback(lambda f, s=s, key=key: events.put((s, key, f)))
            left = len(plan.pending)
            while left and not stop.requested:
                try:
                    item = events.get(timeout=0.25)
                except queue.Empty:
                    continue
                if item is None or stop.requested:
                    continue
                left -= 1
                s, key, fut = item
                err = _finish(plan, s, key, fut, rows)
                if err:
                    errors.append(err)
                if progress and (err or s.label in rows):
                    progress(s.label, "FAILED" if err else "compiled", 0.0 if err else rows[s.label].seconds)
            finished = not stop.requested
        finally:
            if not finished:  # stopped, or an exception on the way out: drop the queue, kill what runs
                pool.shutdown(wait=False, cancel_futures=True)
                compiler.kill_all()
            pool.shutdown(wait=True)
            shutil.rmtree(work_root, ignore_errors=True)
        if stop.requested:
            raise _interrupted(plan, stop, rows)
    if errors:
        raise BuildError(
            f"{len(errors)} of {len(plan.todo)} specializations failed; the previous bundle "
            "(if any) is untouched:\n" + "\n".join(errors)
        )

    result = BuildResult(out=plan.out, rows=[rows[s.label] for s in plan.todo])
    manifest = Manifest(
        generator=f"flint-aot {__version__}",
        dsl_version=plan.dsl,
        config=plan.config,
        kernels=[r.entry for r in result.rows],
        plugins=plan.plugins,
    )
    if not _write_bundle(plan.out, manifest, {r.entry.file: r.cubin for r in result.rows}, stop):
        raise _interrupted(plan, stop, rows)
    return result


def _finish(plan: Plan, s: Specialization, key: str, fut: Future, rows: dict[str, Row]) -> str | None:
    """Check and cache one finished compile; returns an error message, or None."""
    try:
        r = fut.result()
        if r is None:
            return None  # stopped
        cubin, meta, secs = r
        e = _entry(s, key, cubin, meta)
        problems = check_cubin(e, cubin)
        if problems:
            raise BuildError(f"{s.label}: cubin does not match its metadata: {'; '.join(problems)}")
        _cache_put(plan.cache, key, cubin, meta)
        rows[s.label] = Row(s, "compiled", e, secs, cubin)
        return None
    except Exception as exc:  # noqa: BLE001 - every failure is reported, with its specialization
        return str(exc) if isinstance(exc, BuildError) else f"{s.label}: {exc!r}"


def _interrupted(plan: Plan, stop: Stop, rows: dict[str, Row]) -> BuildInterrupted:
    compiled = sum(r.status == "compiled" for r in rows.values())
    kept = (
        f"previous bundle at {plan.out} untouched"
        if (plan.out / MANIFEST_NAME).exists()
        else f"nothing written to {plan.out}"
    )
    try:
        name = signal.Signals(stop.signum).name
    except ValueError:
        name = f"signal {stop.signum}"
    return BuildInterrupted(
        stop.signum,
        f"interrupted ({name}): {len(rows)} of {len(plan.todo)} specializations compiled and cached "
        f"({compiled} this run, in {plan.cache}); {kept}",
    )


def build(
    config_path: str | os.PathLike,
    out: str | os.PathLike,
    jobs: int = 1,
    cache_dir: str | os.PathLike | None = None,
    progress=None,
    stop: Stop | None = None,
) -> BuildResult:
    """prepare + execute (see both)."""
    return execute(prepare(config_path, out, cache_dir), jobs=jobs, progress=progress, stop=stop)


def _write_bundle(out: Path, manifest: Manifest, files: dict[str, bytes], stop: Stop) -> bool:
    """Stage the bundle beside out and swap it into place; False (nothing installed) if stopped first."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _sweep(out.parent, f".{out.name}.tmp-")
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise BuildError(f"output {out}: cannot write beside it ({e.strerror}); choose another -o") from None
    name = ""
    try:
        for name, data in [*sorted(files.items()), (MANIFEST_NAME, manifest.dumps().encode())]:
            with open(staging / name, "wb") as f:  # the manifest last: it marks the bundle complete
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        name = ""
        os.chmod(staging, 0o755)
        _fsync_dir(staging)
        if stop.requested:  # the last moment to stop: after this the new bundle is in place
            return False
        _install(staging, out)
        return True
    except OSError as e:
        hint = (
            " (a mount point cannot be renamed: use a directory inside it)" if e.errno == errno.EBUSY else ""
        )
        what = f"cannot write {name} ({e.strerror}): free space there or" if name else (
            f"cannot install the bundle ({e.strerror}){hint};")  # fmt: skip
        raise BuildError(f"output {out}: {what} choose another -o") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)

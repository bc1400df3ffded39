"""The `flint-aot` command line: build, list, verify, pack, doctor."""

from __future__ import annotations

import contextlib
import signal
import sys

import click

from flint_aot import __version__
from loader.abi import MAX_M

DEFAULT_BUNDLE = "build/flint"


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


@click.group()
@click.version_option(__version__, prog_name="flint-aot")
def main():
    """Ahead-of-time builder of Flint's fused decode qkv kernels."""


def _progress_reporter(total: int, stack: contextlib.ExitStack):
    """On a terminal, click's progress bar; otherwise (CI logs, `| tee`) one line per finished compile."""
    if sys.stderr.isatty():
        bar = stack.enter_context(
            click.progressbar(length=total, label="compiling", file=sys.stderr, show_pos=True)
        )
        return lambda label, status, seconds: bar.update(1)
    done = [0]

    def line(label, status, seconds):
        done[0] += 1
        click.echo(f"[{done[0]}/{total}] {status} {label} ({seconds:.1f} s)", err=True)

    return line


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("-o", "--out", default=DEFAULT_BUNDLE, show_default=True, help="Bundle directory to (re)place.")
@click.option(
    "-j", "--jobs", default=None, type=click.IntRange(1, 256),
    help="Parallel compiles  [default: the number of usable CPU cores]",
)  # fmt: skip
@click.option(
    "--cache-dir", default=None,
    help="Compile cache [default: $FLINT_AOT_CACHE, else $XDG_CACHE_HOME/flint-aot, else "
    "~/.cache/flint-aot].",
)  # fmt: skip
def build(config, out, jobs, cache_dir):
    """Compile every specialization of CONFIG into a bundle (cubins + manifest.json).

    SIGINT (Ctrl-C) or SIGTERM stops the build within a second or two: queued compiles are dropped, running
    ones killed, what finished stays in the cache, the bundle in place is untouched; exit status 130 / 143.
    """
    from flint_aot.builder import BuildError, BuildInterrupted, Stop, execute, prepare, usable_cores
    from flint_aot.config import ConfigError

    stop = Stop()
    with stop.on_signals(signal.SIGINT, signal.SIGTERM), contextlib.ExitStack() as stack:
        try:
            plan = prepare(config, out, cache_dir, stop)
            jobs = jobs or usable_cores()
            progress = None
            if plan.pending:
                if not sys.stderr.isatty():
                    click.echo(
                        f"compiling {len(plan.pending)} of {len(plan.todo)} specializations "
                        f"({len(plan.cached)} cached), {jobs} at a time",
                        err=True,
                    )
                progress = _progress_reporter(len(plan.pending), stack)
            res = execute(plan, jobs=jobs, progress=progress, stop=stop)
        except BuildInterrupted as e:
            stack.close()  # end the progress bar's line first
            click.echo(str(e), err=True)
            sys.exit(128 + e.signum)
        except (BuildError, ConfigError) as e:
            stack.close()
            raise click.ClickException(str(e)) from None
    rows = [
        [r.spec.name, r.spec.arch, r.status, r.entry.registers, r.entry.size, f"{r.seconds:.1f}"]
        for r in res.rows
    ]
    click.echo(_table(["kernel", "arch", "status", "regs", "bytes", "seconds"], rows))
    click.echo(
        f"bundle {res.out}: {len(res.rows)} cubins ({res.compiled} compiled, "
        f"{len(res.rows) - res.compiled} cached)"
    )


BUNDLE_ARG = click.argument(
    "bundle", default=DEFAULT_BUNDLE, required=False, type=click.Path(file_okay=False)
)


def _open(bundle):
    from loader.bundle import Bundle, BundleError
    from loader.manifest import ManifestError

    try:
        return Bundle.open(bundle)
    except (BundleError, ManifestError) as e:
        raise click.ClickException(str(e)) from None


@main.command("list")
@BUNDLE_ARG
def list_(bundle):
    """Show what BUNDLE (default build/flint) holds."""
    b = _open(bundle)
    m = b.manifest
    click.echo(
        f"{b.path}: {m.generator}, nvidia-cutlass-dsl {m.dsl_version}, schema {m.schema_version}, "
        f"archs {', '.join(m.archs())}"
    )
    rows = [
        [k.name, k.arch, k.entry, "x".join(map(str, k.block)), "x".join(map(str, k.cluster)),
         k.registers, k.size, k.sha256[:12]]
        for k in m.kernels
    ]  # fmt: skip
    click.echo(_table(["kernel", "arch", "entry", "block", "cluster", "regs", "bytes", "sha256"], rows))
    for kind, p in sorted(m.plugins.items()):
        click.echo(f"plugin {kind}: {p.get('module')}.{p.get('class')}, sources sha256 "
                   f"{str(p.get('source_sha256'))[:12]} ({', '.join(p.get('files', []))}), "
                   f"version {p.get('version') or '-'}")  # fmt: skip


def _against_config(b) -> dict[str, list[str]]:
    """The manifest's entries against the variant list its own recorded config expands to."""
    from flint_aot.config import ConfigError, expand, validate
    from loader.manifest import MANIFEST_NAME

    try:
        config = validate(b.manifest.config, f"{b.path / MANIFEST_NAME}: config")
        expected = {s.label: s for s in expand(config)}
    except ConfigError as e:
        return {"config": [f"the manifest's recorded config is not valid for flint-aot {__version__}: {e}"]}
    have = {f"{e.name}@{e.arch}": e for e in b.manifest.kernels}
    out: dict[str, list[str]] = {}
    for label in expected.keys() - have.keys():
        out[label] = ["the manifest's config lists this variant but the manifest has no entry for it"]
    for label in have.keys() - expected.keys():
        out[label] = ["not a variant of the manifest's config"]
    for label in have.keys() & expected.keys():
        e, s = have[label], expected[label]
        if (e.kind, e.spec) != (s.kind, s.spec):
            out[label] = [f"kind/spec {e.kind} {e.spec} != the config's {s.kind} {s.spec}"]
    for kind, p in b.manifest.config.get("plugins", {}).items():  # what each plugin was built from
        rec = b.manifest.plugins.get(kind, {})
        if rec.get("module") != p.get("module") or not rec.get("source_sha256"):
            out[f"plugin {kind}"] = ["the manifest does not record the plugin's module and source hash"]
    return out


@main.command()
@BUNDLE_ARG
def verify(bundle):
    """Check BUNDLE (default build/flint) both ways: every manifest entry against its cubin (sha256, ELF
    entry, parameters, block size), every file against the manifest, and the manifest against the variants
    its recorded config expands to. Exit status 1 on any problem."""
    from flint_aot.verify import verify as verify_bundle

    b = _open(bundle)
    results = verify_bundle(b)
    for label, problems in sorted(_against_config(b).items()):
        results.setdefault(label, []).extend(problems)
    bad = 0
    for label, problems in results.items():
        click.echo(
            f"{'ok  ' if not problems else 'FAIL'} {label}" + (": " + "; ".join(problems) if problems else "")
        )
        bad += bool(problems)
    if bad:
        raise click.ClickException(f"{bad} of {len(results)} entries of {b.path} failed; rebuild the bundle")
    n = len(b.manifest.kernels)
    click.echo(f"{n} cubin{'s' * (n != 1)} verified")


@main.command()
@BUNDLE_ARG
@click.option("-o", "--out", default="dist", show_default=True, help="Folder for the wheel.")
def pack(bundle, out):
    """Turn BUNDLE (default build/flint) plus the loader into one wheel: the flint-aot-loader distribution
    with the bundle inside (needs only torch and cuda-bindings to install; byte-reproducible)."""
    from flint_aot.pack import PackError
    from flint_aot.pack import pack as do_pack
    from loader.bundle import BundleError
    from loader.manifest import ManifestError

    try:
        whl = do_pack(bundle, out)
    except (PackError, BundleError, ManifestError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{whl}  (pip install it; `import loader` then finds the bundle by itself)")


@main.command()
@BUNDLE_ARG
@click.option("-m", "tokens", multiple=True, type=click.IntRange(1, MAX_M),
              help="Tokens per call (M; repeatable). Default: 1, 8, 9, 32 and 64.")  # fmt: skip
def doctor(bundle, tokens):
    """Run every variant of BUNDLE (default build/flint) on this GPU against the torch reference, at each M
    that runs it (by default the 8-token kernels at M = 1 and 8, the 16-, 32- and 64-token ones at M = 9, 32
    and 64); exit 1 if any fails."""
    from loader.doctor import MS, report, run  # the same code as `python -m loader.doctor`

    try:
        results = run(bundle, ms=tokens or MS, prog="flint-aot doctor")
    except Exception as e:
        raise click.ClickException(f"{type(e).__name__}: {e}") from None
    click.echo(report(results))
    if not all(r.ok for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()

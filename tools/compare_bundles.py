"""Compare two bundles cubin by cubin: the check that a refactor of the kernels left them as they were.

    python3 tools/compare_bundles.py OLD NEW [--allow 'qkv_*_m64@sm_90a' ...]

Every (specialization, arch) of either manifest is matched by name: its cubin's bytes (read from the files,
not taken from the manifests) and its launch record (entry symbol, block, cluster and its policy, dynamic
shared memory, grid rule, parameters) must be the same. `--allow` names, by shell pattern on `name@arch`,
the cubins meant to change; they are listed apart. The exit status is 0 when nothing else differs, nothing
is missing on either side, and every --allow pattern matched a cubin that did change (a pattern that
matched nothing means the change did not happen where it was expected).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import sys
from pathlib import Path

# what a launch of the cubin depends on besides its bytes (manifest entry fields; absent fields: defaults)
LAUNCH_FIELDS = {"entry": "", "block": None, "cluster": None, "cluster_policy": "", "dyn_smem": 0,
                 "grid": None, "params": None}  # fmt: skip


def entries(bundle: Path) -> dict[str, dict]:
    """name@arch -> manifest entry, with the sha256 of the cubin file as it is on disk."""
    m = json.loads((bundle / "manifest.json").read_text())
    out = {}
    for e in m["kernels"]:
        e = dict(e)
        e["file_sha256"] = hashlib.sha256((bundle / e["file"]).read_bytes()).hexdigest()
        out[f"{e['name']}@{e['arch']}"] = e
    return out


def compare(old: Path, new: Path, allow: list[str]) -> tuple[list[str], bool]:
    """(report lines, ok)."""
    a, b = entries(old), entries(new)
    allowed = lambda key: any(fnmatch.fnmatchcase(key, p) for p in allow)  # noqa: E731
    same, changed, unexpected, lines = 0, [], [], []
    for key in sorted(a.keys() | b.keys()):
        if key not in a or key not in b:
            unexpected.append(f"{key}: only in {old if key in a else new}")
            continue
        ea, eb = a[key], b[key]
        launch = [f for f, d in LAUNCH_FIELDS.items() if ea.get(f, d) != eb.get(f, d)]
        if launch:
            unexpected.append(f"{key}: launch record differs in {', '.join(launch)}")
        if ea["file_sha256"] == eb["file_sha256"]:
            same += 1
        elif allowed(key):
            changed.append(f"{key}: {ea['size']} -> {eb['size']} bytes, {ea.get('registers', '?')} -> "
                           f"{eb.get('registers', '?')} registers (allowed)")  # fmt: skip
        else:
            unexpected.append(f"{key}: cubin differs ({ea['size']} -> {eb['size']} bytes)")
    unused = [p for p in allow if not any(fnmatch.fnmatchcase(c.split(":")[0], p) for c in changed)]
    lines.append(f"{len(a.keys() | b.keys())} cubins: {same} byte-identical, {len(changed)} changed as "
                 f"allowed, {len(unexpected)} unexpected differences")  # fmt: skip
    lines += [f"  changed: {c}" for c in changed]
    lines += [f"  UNEXPECTED: {u}" for u in unexpected]
    lines += [f"  UNUSED --allow {p!r}: no cubin it names changed" for p in unused]
    return lines, not unexpected and not unused


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--allow", action="append", default=[], metavar="PATTERN",
                    help="name@arch pattern of cubins meant to change (repeatable)")  # fmt: skip
    args = ap.parse_args(argv)
    lines, ok = compare(args.old, args.new, args.allow)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

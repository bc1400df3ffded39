"""Compare two bundles cubin by cubin: the check that a refactor of the kernels left them as they were.

    python3 tools/compare_bundles.py OLD NEW [--allow 'qkv_*_m64@sm_90a' ...] [--sass]

Every (specialization, arch) of either manifest is matched by name: its cubin's bytes (read from the files,
not taken from the manifests) and its launch record (entry symbol, block, cluster and its policy, dynamic
shared memory, grid rule, parameters) must be the same. `--allow` names, by shell pattern on `name@arch`,
the cubins meant to change; they are listed apart. The exit status is 0 when nothing else differs, nothing
is missing on either side, and every --allow pattern matched a cubin that did change (a pattern that
matched nothing means the change did not happen where it was expected). `--sass` disassembles each cubin that
changed (nvdisasm, from the nvidia-cuda-nvdisasm wheel) and prints, per opcode, how many instructions it has
on each side where the counts differ: what a change removed or added, beside register and address renaming.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import hashlib
import json
import re
import shutil
import subprocess
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


def nvdisasm() -> str | None:
    try:
        import nvidia.cu13  # noqa: F401  (namespace package of the wheel)

        for base in nvidia.cu13.__path__:
            if (Path(base) / "bin" / "nvdisasm").exists():
                return str(Path(base) / "bin" / "nvdisasm")
    except ImportError:
        pass
    return shutil.which("nvdisasm")


def opcodes(cubin: Path, tool: str) -> collections.Counter:
    """How many instructions of each opcode (with its modifiers) the cubin's SASS has."""
    out = subprocess.run([tool, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter()
    for ln in out.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", ln)
        if m:
            ops[m.group(1)] += 1
    return ops


def sass_diff(old: Path, new: Path, keys: list[str]) -> list[str]:
    tool = nvdisasm()
    if tool is None:
        return ["  (--sass: nvdisasm not found; pip install nvidia-cuda-nvdisasm)"]
    a, b = entries(old), entries(new)
    lines = []
    for key in keys:
        oa, ob = opcodes(old / a[key]["file"], tool), opcodes(new / b[key]["file"], tool)
        diff = [f"{op} {oa[op]} -> {ob[op]}" for op in sorted(oa.keys() | ob.keys()) if oa[op] != ob[op]]
        lines.append(f"  sass {key}: {sum(oa.values())} -> {sum(ob.values())} instructions; "
                     + ("; ".join(diff) or "the same opcodes"))  # fmt: skip
    return lines


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
    ap.add_argument("--sass", action="store_true", help="the opcode counts of every changed cubin")
    args = ap.parse_args(argv)
    lines, ok = compare(args.old, args.new, args.allow)
    if args.sass:
        changed = [ln.split()[1].rstrip(":") for ln in lines if ln.startswith("  changed: ")]
        lines += sass_diff(args.old, args.new, changed)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

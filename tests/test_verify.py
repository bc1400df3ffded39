"""`flint-aot verify` checks a bundle both ways and never crashes: a manifest entry removed (its cubin now an
orphan, its variant still in the recorded config), a stray cubin, wrong-type manifest fields, and every kind
of malformed cubin (truncated, not an ELF, bad section table, bad symbol table, bad .nv.info records) are
each a FAIL line naming the entry, exit status 1, no traceback. loader.elf raises CubinError and nothing else
for random damage to real cubins."""

import json
import random
import shutil
import struct

import pytest
from click.testing import CliRunner

from flint_aot.cli import main
from loader.bundle import Bundle, BundleError
from loader.elf import CubinError, read_cubin
from loader.manifest import ManifestError
from tests.conftest import needs_dsl

pytestmark = needs_dsl

CONFIG = "archs: [sm_90a]\nnorm:\n  residual: [true, false]\n"
VICTIM = "norm_res1.sm_90a.cubin"


@pytest.fixture(scope="module")
def sound(tmp_path_factory):
    from flint_aot.builder import build

    d = tmp_path_factory.mktemp("verify")
    (d / "c.yaml").write_text(CONFIG)
    # a cache shared by the modules that only need a sound bundle (the same norm cubins)
    build(d / "c.yaml", d / "bundle", jobs=2, cache_dir=tmp_path_factory.getbasetemp() / "shared-cache")
    return d / "bundle"


@pytest.fixture
def bundle(sound, tmp_path):
    """A private copy of the sound bundle, to damage."""
    return shutil.copytree(sound, tmp_path / "b")


def _verify(path):
    r = CliRunner().invoke(main, ["verify", str(path)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # no traceback
    return r


def _failed(path, *labels) -> str:
    r = _verify(path)
    assert r.exit_code == 1, r.output
    fails = {ln.split()[1].rstrip(":") for ln in r.output.splitlines() if ln.startswith("FAIL ")}
    assert fails == set(labels), r.output
    assert "Traceback" not in r.output
    return r.output


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path, m):
    (path / "manifest.json").write_text(json.dumps(m))


def test_sound_bundle_verifies(bundle):
    r = _verify(bundle)
    assert r.exit_code == 0 and "2 cubins verified" in r.output, r.output
    assert r.output.count("ok  ") == 2


def test_an_altered_copy_verifies_with_other_bytes_and_the_same_kernels(sound, tmp_path):
    """tests.helpers.altered_copy (the GPU reload tests' bundle of changed cubins): every cubin's bytes and
    sha256 differ from the original's, the copy verifies, and each cubin reads as the same kernels
    (entry, parameters, block, registers) at the same SM."""
    from tests.helpers import altered_copy

    copy = altered_copy(sound, tmp_path / "altered")
    r = _verify(copy)
    assert r.exit_code == 0 and "2 cubins verified" in r.output, r.output
    a, b = Bundle.open(sound).manifest.kernels, Bundle.open(copy).manifest.kernels
    assert [e.name for e in a] == [e.name for e in b]
    for e, f in zip(a, b, strict=True):
        old, new = (sound / e.file).read_bytes(), (copy / f.file).read_bytes()
        assert new != old and new.startswith(old) and e.sha256 != f.sha256 and f.size == len(new)
        assert read_cubin(new) == read_cubin(old)


def test_removed_entry_is_found_both_ways(bundle):
    m = _manifest(bundle)
    m["kernels"] = [k for k in m["kernels"] if k["file"] != VICTIM]
    _write_manifest(bundle, m)
    out = _failed(bundle, "norm_res1@sm_90a", VICTIM)
    assert "config lists this variant" in out and "not in the manifest" in out


def test_stray_cubin_is_reported(bundle):
    shutil.copy(bundle / VICTIM, bundle / "extra.sm_90a.cubin")
    out = _failed(bundle, "extra.sm_90a.cubin")
    assert "ok   norm_res1@sm_90a" in out


def test_entry_not_in_the_recorded_config(bundle):
    m = _manifest(bundle)
    m["config"]["norm"]["residual"] = [False]
    _write_manifest(bundle, m)
    assert "not a variant of the manifest's config" in _failed(bundle, "norm_res1@sm_90a")


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("block", "big", "bad block dims 'big'"),
        ("block", [256, 1], "bad block dims"),
        ("cluster", [1, "1", 1], "bad cluster dims"),
        ("size", "4k", "size: expected a non-negative integer"),
        ("dyn_smem", -1, "dyn_smem: expected a non-negative integer"),
        ("registers", 1.5, "registers: expected a non-negative integer"),
        ("grid", ["M", "Q", 1], "bad grid rule"),
        ("grid", 7, "grid: expected a list"),
        ("spec", "abc", "spec: expected an object"),
        ("params", [1], "params: expected a list of objects"),
        ("file", 3, "file: expected a string"),
        ("sha256", None, "sha256: expected a string"),
    ],
)
def test_wrong_type_manifest_field(bundle, field, value, needle):
    m = _manifest(bundle)
    m["kernels"][0][field] = value
    _write_manifest(bundle, m)
    with pytest.raises(ManifestError, match="kernels\\[0\\]"):
        Bundle.open(bundle)
    for cmd in ("verify", "list"):
        r = CliRunner().invoke(main, [cmd, str(bundle)])
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (cmd, r.output, r.exception)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: ") and needle in lines[0], r.output


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda m: m.update(kernels={"a": 1}), "kernels: expected a list"),
        (lambda m: m.update(config=[1]), "config: expected an object"),
        (lambda m: m["kernels"][0].pop("entry"), "missing field 'entry'"),
        (lambda m: m["kernels"].__setitem__(0, "x"), "kernels[0]: expected an object"),
    ],
)
def test_malformed_manifest_structure(bundle, mutate, needle):
    m = _manifest(bundle)
    mutate(m)
    _write_manifest(bundle, m)
    r = CliRunner().invoke(main, ["verify", str(bundle)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit) and needle in r.output, r.output


def test_bundle_path_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "f")])
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit), r.output


def test_unreadable_manifest(bundle):
    (bundle / "manifest.json").write_bytes(b'{"schema_version": 1, "x": "\xff"}')
    with pytest.raises(ManifestError, match="not UTF-8"):
        Bundle.open(bundle)
    (bundle / "manifest.json").unlink()
    (bundle / "manifest.json").mkdir()
    with pytest.raises(ManifestError, match="cannot read"):
        Bundle.open(bundle)


# ----------------------------------------------------------------------------- malformed cubins
def _sections(b: bytes) -> dict[str, dict]:
    """name -> section header fields (and its table position) of a sound cubin."""
    shoff = struct.unpack_from("<Q", b, 0x28)[0]
    shnum, shstrndx = struct.unpack_from("<HH", b, 0x3C)
    hdrs = []
    for i in range(shnum):
        name, typ, _f, _a, off, size, link, _i, _al, _e = struct.unpack_from("<IIQQQQIIQQ", b, shoff + 64 * i)
        hdrs.append(dict(index=i, hdr=shoff + 64 * i, name=name, type=typ, offset=off, size=size, link=link))
    strtab = hdrs[shstrndx]
    for h in hdrs:
        end = b.index(b"\0", strtab["offset"] + h["name"])
        h["str"] = b[strtab["offset"] + h["name"] : end].decode()
    return {h["str"]: h for h in hdrs}


def _entry_symbol_index(b: bytes, secs) -> int:
    st = secs[".symtab"]
    for k in range(st["size"] // 24):
        _name, info, other = struct.unpack_from("<IBB", b, st["offset"] + 24 * k)
        if info & 0xF == 2 and other & 0x10:
            return k
    raise AssertionError("no entry symbol")


def _put(b: bytearray, off: int, fmt: str, *v):
    struct.pack_into(fmt, b, off, *v)


def _truncated(b):
    return b[: len(b) // 2]


def _not_elf(b):
    return b"\x00" * 4 + b[4:]


def _shoff_past_end(b):
    b = bytearray(b)
    _put(b, 0x28, "<Q", len(b) + 64)
    return b


def _shstrndx_out_of_range(b):
    b = bytearray(b)
    _put(b, 0x3E, "<H", 0xFFF0)
    return b


def _section_past_end(b):
    b, secs = bytearray(b), _sections(b)
    _put(b, secs[".symtab"]["hdr"] + 0x20, "<Q", len(b))  # sh_size
    return b


def _symbol_name_past_strtab(b):
    b, secs = bytearray(b), _sections(b)
    k = _entry_symbol_index(b, secs)
    _put(b, secs[".symtab"]["offset"] + 24 * k, "<I", secs[".strtab"]["size"] + 100)
    return b


def _symtab_link_out_of_range(b):
    b, secs = bytearray(b), _sections(b)
    _put(b, secs[".symtab"]["hdr"] + 0x28, "<I", 0xFFFF)  # sh_link
    return b


def _symtab_link_to_itself(b):
    b, secs = bytearray(b), _sections(b)
    _put(b, secs[".symtab"]["hdr"] + 0x28, "<I", secs[".symtab"]["index"])
    return b


def _nv_info_record(b, fn):
    b, secs = bytearray(b), _sections(b)
    s = next(h for n, h in secs.items() if n.startswith(".nv.info.flint_"))
    fn(b, s)
    return b


def _nv_info_record_past_end(b):
    def f(b, s):  # the first record's payload length runs past the section
        _put(b, s["offset"], "<BBH", 4, 0x17, 0xFFFF)

    return _nv_info_record(b, f)


def _nv_info_unknown_format(b):
    return _nv_info_record(b, lambda b, s: _put(b, s["offset"], "<B", 9))


def _nv_info_duplicate_parameter(b):
    def f(b, s):  # every KPARAM_INFO record says ordinal 0
        i, end = s["offset"], s["offset"] + s["size"]
        while i < end:
            fmt, attr, val = struct.unpack_from("<BBH", b, i)
            if fmt == 4 and attr == 0x17:
                _put(b, i + 4 + 4, "<H", 0)
            i += 4 + (val if fmt == 4 else 0)

    return _nv_info_record(b, f)


CORRUPTIONS = {
    "truncated": (_truncated, "truncated ELF|past the end"),
    "not an ELF": (_not_elf, "not a 64-bit little-endian ELF"),
    "section table past the end": (_shoff_past_end, "section table .* runs past the end"),
    "section names index out of range": (_shstrndx_out_of_range, "bad ELF section table"),
    "section past the end": (_section_past_end, "past the end of the file"),
    "symbol name past the string table": (
        _symbol_name_past_strtab,
        "name offset .* past the end of its string",
    ),
    "symtab sh_link out of range": (_symtab_link_out_of_range, ".symtab links to section 65535"),
    "symtab sh_link to a non-string table": (_symtab_link_to_itself, "string table .* has type 2"),
    ".nv.info record past the end": (_nv_info_record_past_end, "runs past the section end"),
    ".nv.info unknown record format": (_nv_info_unknown_format, "unknown record format 9"),
    ".nv.info duplicate parameter": (_nv_info_duplicate_parameter, "parameter 0 described twice"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_malformed_cubin(bundle, kind):
    corrupt, message = CORRUPTIONS[kind]
    f = bundle / VICTIM
    f.write_bytes(bytes(corrupt(f.read_bytes())))
    with pytest.raises(CubinError, match=message):
        read_cubin(f.read_bytes())
    out = _failed(bundle, "norm_res1@sm_90a")
    line = next(ln for ln in out.splitlines() if ln.startswith("FAIL norm_res1@sm_90a"))
    assert "not a readable cubin" in line, line
    b = Bundle.open(bundle)  # the loader refuses it with its BundleError, not a crash
    with pytest.raises(BundleError, match="corrupt"):
        b.read(next(e for e in b.manifest.kernels if e.file == VICTIM))


def test_fuzzed_cubins_raise_only_cuberror(sound):
    """Random byte changes (anywhere, and concentrated on the headers, section table and symbol table)
    and truncations of real cubins: read_cubin returns or raises CubinError, nothing else."""
    rng = random.Random(20261130)
    parsed = rejected = 0
    for f in sorted(sound.glob("*.cubin")):
        data = f.read_bytes()
        secs = _sections(data)
        shoff = struct.unpack_from("<Q", data, 0x28)[0]
        hot = [(0, 64), (shoff, len(data))] + [
            (secs[n]["offset"], secs[n]["offset"] + secs[n]["size"])
            for n in (".symtab", ".strtab", ".shstrtab", ".nv.info")
            if n in secs
        ]
        hot += [(h["offset"], h["offset"] + h["size"]) for n, h in secs.items() if n.startswith(".nv.info.")]
        for _ in range(1500):
            b = bytearray(data)
            if rng.random() < 0.15:
                b = b[: rng.randrange(len(b))]
            else:
                for _ in range(rng.randint(1, 6)):
                    lo, hi = rng.choice(hot) if rng.random() < 0.8 else (0, len(b))
                    pos = rng.randrange(lo, hi)
                    if rng.random() < 0.5:
                        b[pos] = rng.randrange(256)
                    else:
                        b[pos] ^= 1 << rng.randrange(8)
            try:
                read_cubin(bytes(b))
                parsed += 1
            except CubinError:
                rejected += 1
    assert parsed and rejected  # both outcomes exercised

"""Read what a launcher needs from a CUDA cubin (an ELF file), with the standard library only.

Used by the loader to check a cubin against its manifest entry before loading it, and by
`flint-aot verify`. Reads: entry kernels (FUNC, GLOBAL, STO_CUDA_ENTRY), each kernel's parameter
list (EIATTR_KPARAM_INFO: ordinal, offset, size), required block size (EIATTR_REQNTID), register
count (EIATTR_REGCOUNT) and the ELF's SM number.

Any malformed input (truncated, not an ELF, a section, string, symbol or .nv.info record that points
outside the file or its section) raises CubinError, never another exception: every offset is checked
before it is used.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from loader.manifest import ARCH_CC, sha256_bytes

_STO_CUDA_ENTRY = 0x10
_EIATTR_KPARAM_INFO = 0x17
_EIATTR_REQNTID = 0x10
_EIATTR_REGCOUNT = 0x2F
# .nv.info record formats: no value, byte value, half-word value (all in the 4-byte header), sized payload
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4
_SHT_SYMTAB, _SHT_STRTAB, _SHT_NOBITS = 2, 3, 8
_SYM_SIZE = 24
_SHDR_SIZE = 64


class CubinError(ValueError):
    pass


@dataclass
class KernelInfo:
    name: str
    params: list[tuple[int, int]] = field(default_factory=list)  # (offset, size) by ordinal
    reqntid: tuple[int, ...] | None = None
    registers: int | None = None


@dataclass
class CubinInfo:
    sm: int  # e.g. 90 or 100
    kernels: dict[str, KernelInfo]


@dataclass(frozen=True)
class _Section:
    index: int
    name_off: int
    type: int
    offset: int
    size: int
    link: int


def _u(fmt: str, b: bytes, off: int, what: str = "ELF header"):
    if off < 0 or off + struct.calcsize(fmt) > len(b):
        raise CubinError(f"truncated ELF ({what} at byte {off} past the end)")
    return struct.unpack_from(fmt, b, off)


def _cstr(b: bytes, sec: _Section, off: int, what: str) -> str:
    """The NUL-terminated string at off inside the string-table section sec."""
    if off >= sec.size:
        raise CubinError(f"{what} name offset {off} past the end of its string table ({sec.size} bytes)")
    start = sec.offset + off
    end = b.find(b"\0", start, sec.offset + sec.size)
    if end < 0:
        raise CubinError(f"{what} name at string table offset {off} is not NUL-terminated")
    return b[start:end].decode("utf-8", "replace")


def _nv_records(data: bytes, where: str):
    """(attribute, 16-bit value, payload or None) of each .nv.info record."""
    i = 0
    while i < len(data):
        if i + 4 > len(data):
            raise CubinError(f"{where}: truncated record header at byte {i}")
        fmt, attr, val = struct.unpack_from("<BBH", data, i)
        i += 4
        if fmt == _EIFMT_SVAL:
            if i + val > len(data):
                raise CubinError(f"{where}: record 0x{attr:02x} of {val} bytes runs past the section end")
            yield attr, val, data[i : i + val]
            i += val
        elif fmt in (_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL):
            yield attr, val, None
        else:
            raise CubinError(f"{where}: unknown record format {fmt} at byte {i - 4}")


def _sections(b: bytes) -> tuple[list[_Section], int]:
    (shoff,) = _u("<Q", b, 0x28)
    shentsize, shnum, shstrndx = _u("<HHH", b, 0x3A)
    if shentsize != _SHDR_SIZE or shnum == 0 or shstrndx >= shnum:
        raise CubinError(
            f"bad ELF section table (entry size {shentsize}, {shnum} sections, names {shstrndx})"
        )
    if shoff + shnum * _SHDR_SIZE > len(b):
        raise CubinError(
            f"ELF section table (at byte {shoff}, {shnum} entries) runs past the end of the file"
        )
    secs = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size, link, _info, _align, _ent = struct.unpack_from(
            "<IIQQQQIIQQ", b, shoff + i * _SHDR_SIZE
        )
        if typ != _SHT_NOBITS and off + size > len(b):  # SHT_NOBITS occupies no file bytes
            raise CubinError(f"ELF section {i} (bytes {off}..{off + size}) past the end of the file")
        secs.append(_Section(i, name, typ, off, size, link))
    return secs, shstrndx


def _in_file(s: _Section, what: str, typ: int | None = None) -> _Section:
    if s.type == _SHT_NOBITS:
        raise CubinError(f"{what} (section {s.index}) holds no file bytes")
    if typ is not None and s.type != typ:
        raise CubinError(f"{what} (section {s.index}) has type {s.type}, expected {typ}")
    return s


def read_cubin(b: bytes) -> CubinInfo:
    """Parse a cubin; CubinError (naming the problem) for anything malformed."""
    try:
        return _read_cubin(bytes(b))
    except (struct.error, IndexError, KeyError, OverflowError, UnicodeError) as e:  # a check missed above
        raise CubinError(f"malformed ELF ({type(e).__name__}: {e})") from None


def _read_cubin(b: bytes) -> CubinInfo:
    if len(b) < 64 or b[:4] != b"\x7fELF" or b[4] != 2 or b[5] != 1:
        raise CubinError("not a 64-bit little-endian ELF cubin")
    (e_flags,) = _u("<I", b, 0x30)
    secs, shstrndx = _sections(b)
    shstr = _in_file(secs[shstrndx], "section name table", _SHT_STRTAB)
    by_name: dict[str, _Section] = {}
    for s in secs:
        by_name.setdefault(_cstr(b, shstr, s.name_off, f"section {s.index}"), s)

    symtab = by_name.get(".symtab")
    if symtab is None:
        raise CubinError("no .symtab")
    _in_file(symtab, ".symtab", _SHT_SYMTAB)
    if symtab.size % _SYM_SIZE:
        raise CubinError(f".symtab size {symtab.size} is not a multiple of {_SYM_SIZE}")
    if not 0 < symtab.link < len(secs):
        raise CubinError(f".symtab links to section {symtab.link}; the file has {len(secs)} sections")
    strtab = _in_file(secs[symtab.link], ".symtab's string table", _SHT_STRTAB)
    syms = []
    for k in range(symtab.size // _SYM_SIZE):
        st_name, st_info, st_other, _shndx, _value, _size = struct.unpack_from(
            "<IBBHQQ", b, symtab.offset + _SYM_SIZE * k
        )
        syms.append((_cstr(b, strtab, st_name, f"symbol {k}"), st_info, st_other))

    kernels: dict[str, KernelInfo] = {}
    index_of: dict[int, KernelInfo] = {}
    for idx, (nm, info, other) in enumerate(syms):
        if info & 0xF == 2 and info >> 4 == 1 and other & _STO_CUDA_ENTRY:
            kernels[nm] = index_of[idx] = KernelInfo(nm)
    for nm, k in kernels.items():
        s = by_name.get(".nv.info." + nm)
        if s is None:
            continue
        where = f".nv.info.{nm}"
        _in_file(s, where)
        params: dict[int, tuple[int, int]] = {}
        for attr, _val, payload in _nv_records(b[s.offset : s.offset + s.size], where):
            if attr == _EIATTR_KPARAM_INFO:
                if payload is None or len(payload) < 12:
                    raise CubinError(f"{where}: short EIATTR_KPARAM_INFO record")
                _idx, ordinal, offset, flags = struct.unpack_from("<IHHI", payload)
                if ordinal in params:
                    raise CubinError(f"{where}: parameter {ordinal} described twice")
                params[ordinal] = (offset, (flags >> 18) & 0x3FFF)
            elif attr == _EIATTR_REQNTID:
                if payload is None or len(payload) not in (4, 8, 12):
                    raise CubinError(f"{where}: EIATTR_REQNTID record is not 1 to 3 32-bit dims")
                k.reqntid = struct.unpack(f"<{len(payload) // 4}I", payload)
        if sorted(params) != list(range(len(params))):
            raise CubinError(f"{where}: parameter ordinals {sorted(params)} are not 0..{len(params) - 1}")
        k.params = [params[i] for i in range(len(params))]
    g = by_name.get(".nv.info")
    if g is not None:
        _in_file(g, ".nv.info")
        for attr, _val, payload in _nv_records(b[g.offset : g.offset + g.size], ".nv.info"):
            if attr == _EIATTR_REGCOUNT and payload is not None:
                if len(payload) != 8:
                    raise CubinError(".nv.info: EIATTR_REGCOUNT record is not (symbol, count)")
                symidx, v = struct.unpack("<II", payload)
                if symidx in index_of:
                    index_of[symidx].registers = v
    # ELF ABI version 8 and later (sm_100+) keep the SM number in bits 8..15 of e_flags, older ones in 0..7.
    sm = (e_flags >> 8) & 0xFF if b[8] >= 8 else e_flags & 0xFF
    return CubinInfo(sm=sm, kernels=kernels)


def check_cubin(entry, data: bytes) -> list[str]:
    """Problems found comparing a cubin's bytes with its manifest entry (empty list: consistent)."""
    problems = []
    if len(data) != entry.size:
        problems.append(f"size {len(data)} != manifest {entry.size}")
    digest = sha256_bytes(data)
    if digest != entry.sha256:
        problems.append(f"sha256 {digest[:16]}… != manifest {entry.sha256[:16]}…")
    try:
        info = read_cubin(data)
    except CubinError as e:
        return problems + [f"not a readable cubin ({e})"]
    cc = ARCH_CC.get(entry.arch)
    if cc is not None and info.sm != cc[0] * 10 + cc[1]:
        problems.append(f"ELF is for sm_{info.sm}, manifest says {entry.arch}")
    k = info.kernels.get(entry.entry)
    if k is None:
        problems.append(f"entry symbol {entry.entry} not in cubin (has {sorted(info.kernels)})")
        return problems
    if k.params != entry.param_offsets():
        problems.append(f"parameter layout {k.params} != manifest {entry.param_offsets()}")
    if k.reqntid is not None and tuple(k.reqntid) + (1,) * (3 - len(k.reqntid)) != tuple(entry.block):
        problems.append(f"required block {k.reqntid} != manifest {entry.block}")
    return problems

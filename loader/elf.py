"""Read what a launcher needs from a CUDA cubin (an ELF file), with the standard library only.

Used by the loader to check a cubin against its manifest entry before loading it, and by
`flint-aot verify`. Reads: entry kernels (FUNC, GLOBAL, STO_CUDA_ENTRY), each kernel's parameter
list (EIATTR_KPARAM_INFO: ordinal, offset, size), required block size (EIATTR_REQNTID), register
count (EIATTR_REGCOUNT) and the ELF's SM number.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

_STO_CUDA_ENTRY = 0x10
_EIATTR_KPARAM_INFO = 0x17
_EIATTR_REQNTID = 0x10
_EIATTR_REGCOUNT = 0x2F
_EIFMT_SVAL = 0x04


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


def _u(fmt: str, b: bytes, off: int):
    try:
        return struct.unpack_from(fmt, b, off)
    except struct.error:
        raise CubinError("truncated ELF") from None


def _nv_records(data: bytes):
    i = 0
    while i + 4 <= len(data):
        fmt, attr, val = struct.unpack_from("<BBH", data, i)
        i += 4
        payload = None
        if fmt == _EIFMT_SVAL:
            payload = data[i : i + val]
            i += val
        yield attr, val, payload


def read_cubin(b: bytes) -> CubinInfo:
    if len(b) < 64 or b[:4] != b"\x7fELF" or b[4] != 2:
        raise CubinError("not a 64-bit ELF cubin")
    (e_flags,) = _u("<I", b, 0x30)
    (shoff,) = _u("<Q", b, 0x28)
    shentsize, shnum, shstrndx = _u("<HHH", b, 0x3A)
    if shentsize != 64 or shstrndx >= shnum:
        raise CubinError("bad ELF section table")
    secs = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size, link, _info, _align, _ent = _u("<IIQQQQIIQQ", b, shoff + i * 64)
        if off + size > len(b) and typ != 8:  # SHT_NOBITS occupies no file bytes
            raise CubinError("ELF section past end of file")
        secs.append((name, typ, off, size, link))

    def cstr(off: int) -> str:
        end = b.find(b"\0", off)
        if end < 0:
            raise CubinError("unterminated string")
        return b[off:end].decode("utf-8", "replace")

    shstr_off = secs[shstrndx][2]
    by_name = {cstr(shstr_off + s[0]): s for s in secs}
    symtab = by_name.get(".symtab")
    if symtab is None:
        raise CubinError("no .symtab")
    strtab_off = secs[symtab[4]][2]
    syms = []
    for k in range(symtab[3] // 24):
        st_name, st_info, st_other, _shndx, _value, _size = _u("<IBBHQQ", b, symtab[2] + 24 * k)
        syms.append((cstr(strtab_off + st_name), st_info, st_other))
    kernels: dict[str, KernelInfo] = {}
    index_of: dict[int, KernelInfo] = {}
    for idx, (nm, info, other) in enumerate(syms):
        if info & 0xF == 2 and info >> 4 == 1 and other & _STO_CUDA_ENTRY:
            kernels[nm] = index_of[idx] = KernelInfo(nm)
    for nm, k in kernels.items():
        s = by_name.get(".nv.info." + nm)
        if s is None:
            continue
        params = {}
        for attr, _val, payload in _nv_records(b[s[2] : s[2] + s[3]]):
            if attr == _EIATTR_KPARAM_INFO and payload is not None and len(payload) >= 12:
                _idx, ordinal, offset, flags = struct.unpack_from("<IHHI", payload)
                params[ordinal] = (offset, (flags >> 18) & 0x3FFF)
            elif attr == _EIATTR_REQNTID and payload is not None:
                k.reqntid = struct.unpack_from(f"<{len(payload) // 4}I", payload)
        k.params = [params[i] for i in sorted(params)]
    g = by_name.get(".nv.info")
    if g is not None:
        for attr, _val, payload in _nv_records(b[g[2] : g[2] + g[3]]):
            if attr == _EIATTR_REGCOUNT and payload is not None and len(payload) == 8:
                symidx, v = struct.unpack("<II", payload)
                if symidx in index_of:
                    index_of[symidx].registers = v
    # ELF ABI version 8 and later (sm_100+) keep the SM number in bits 8..15 of e_flags, older ones in 0..7.
    sm = (e_flags >> 8) & 0xFF if b[8] >= 8 else e_flags & 0xFF
    return CubinInfo(sm=sm, kernels=kernels)

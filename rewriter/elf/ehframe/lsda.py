"""C++ LSDAs (.gcc_except_table): the landing pads of each function's call-site table."""
from __future__ import annotations

import struct

from .encoding import DW_EH_PE_indirect, DW_EH_PE_omit, MASK64, _Bases, _Malformed, _ptr, _U32, _uleb
from .fde import Fde, _offset, _read_u64, view


def landing_pads(data, fdes: list[Fde], path: str | None = None) -> dict[int, list[int]]:
    """For every FDE with an LSDA: fde.start -> sorted list of distinct
    landing-pad addresses (link-time) from the LSDA call-site table (LPStart
    defaults to the function start; lp==0 means no landing pad).  `data` is the
    whole ELF file (or an ElfView of it); every message names `path`."""
    elf = view(data, path)
    d = elf.data
    n = len(d)
    bases = _Bases.of(elf)
    out: dict[int, list[int]] = {}
    for f in fdes:
        if f.lsda is None:
            continue
        p = _offset(elf, f.lsda)
        try:
            if p is None:
                raise _Malformed("LSDA is not in the file")
            delta = f.lsda - p
            bases.func = f.start
            lpenc = d[p]
            p += 1
            lpstart = f.start
            if lpenc != DW_EH_PE_omit:
                lpstart, p = _ptr(d, p, lpenc, p + delta, bases)
                if lpstart and lpenc & DW_EH_PE_indirect:
                    lpstart = _read_u64(elf, lpstart) or 0
            ttenc = d[p]
            p += 1
            if ttenc != DW_EH_PE_omit:
                _, p = _uleb(d, p)       # offset of the type table: not needed
            csenc = d[p]
            p += 1
            cslen, p = _uleb(d, p)
            csend = p + cslen
            if csend > n:
                raise _Malformed("call-site table runs past the end of the file")
            pads = set()
            if csenc == 0x01:            # uleb128: gcc
                while p < csend:
                    _, p = _uleb(d, p)
                    _, p = _uleb(d, p)
                    lp, p = _uleb(d, p)
                    _, p = _uleb(d, p)
                    if lp:
                        pads.add((lpstart + lp) & MASK64)
            elif csenc == 0x03:          # udata4: clang
                while p < csend:
                    lp = _U32(d, p + 8)[0]
                    _, p = _uleb(d, p + 12)
                    if lp:
                        pads.add((lpstart + lp) & MASK64)
            else:
                while p < csend:
                    _, p = _ptr(d, p, csenc, p + delta, bases)
                    _, p = _ptr(d, p, csenc, p + delta, bases)
                    lp, p = _ptr(d, p, csenc, p + delta, bases)
                    _, p = _uleb(d, p)
                    if lp:
                        pads.add((lpstart + lp) & MASK64)
            if p != csend:
                raise _Malformed("call-site entry runs past the call-site table")
        except _Malformed as e:
            raise elf.error(f"{e}: malformed LSDA at {f.lsda:#x} (function at {f.start:#x})") from None
        except (struct.error, IndexError, ValueError):
            raise elf.error(f"truncated LSDA: malformed LSDA at {f.lsda:#x} (function at {f.start:#x})") from None
        out[f.start] = sorted(pads)
    return out

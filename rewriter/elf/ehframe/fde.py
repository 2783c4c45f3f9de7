"""CIEs and FDEs: finding .eh_frame and reading every FDE's range, LSDA and
signal-frame flag (the header fields only; the CFA programs are cfa.py's)."""
from __future__ import annotations

import struct
from dataclasses import dataclass

from ..view import PT_GNU_EH_FRAME, SHT_NOBITS, ElfView
from .encoding import (DW_EH_PE_indirect, DW_EH_PE_omit, MASK64, PCREL_SDATA4, _Bases, _Malformed, _ptr, _raw, _S32,
                       _S32_U32, _sleb, _U32, _U64, _uleb)


@dataclass(frozen=True)
class Fde:
    start: int          # link-time virtual address of the first instruction covered
    end: int            # exclusive
    lsda: int | None    # link-time address of the LSDA, or None
    signal_frame: bool = False   # its CIE says 'S': a signal return trampoline (glibc's __restore_rt)


def view(data, path: str | None) -> ElfView:
    """The ELF view of `data` (already one: as it is)."""
    return data if isinstance(data, ElfView) else ElfView(data, path)


# --- where .eh_frame is --------------------------------------------------------
def _locate_eh_frame(elf: ElfView) -> tuple[int, int, int] | None:
    """(link-time address, file offset, end file offset) of .eh_frame."""
    sec = elf.section(".eh_frame")
    if sec is not None and sec.type != SHT_NOBITS:       # in the file: the view checked
        return sec.addr, sec.offset, sec.offset + sec.size
    if elf.segment(PT_GNU_EH_FRAME) is None:
        return None
    return _locate_via_hdr(elf)


def _locate_via_hdr(elf: ElfView) -> tuple[int, int, int] | None:
    """Find .eh_frame through .eh_frame_hdr's eh_frame_ptr.  Its end is
    bounded by the binary-search table (the last FDE it lists), else by the
    zero terminator / the end of the PT_LOAD data."""
    d = elf.data
    seg = elf.segment(PT_GNU_EH_FRAME)
    hva, hoff, hsize = seg.vaddr, seg.offset, seg.filesz
    hdr_bases = _Bases(data=hva)
    try:
        if hsize < 4 or hoff + 4 > len(d):
            raise _Malformed("truncated .eh_frame_hdr")
        version, ptr_enc, count_enc, table_enc = d[hoff], d[hoff + 1], d[hoff + 2], d[hoff + 3]
        if version != 1:
            raise _Malformed(f"unknown .eh_frame_hdr version {version}")
        if ptr_enc == DW_EH_PE_omit:
            return None
        p = hoff + 4
        eh_va, p = _ptr(d, p, ptr_enc, hva + p - hoff, hdr_bases)
        if ptr_enc & DW_EH_PE_indirect:
            eh_va = _read_u64(elf, eh_va) or 0
        eh_off = _offset(elf, eh_va)
        if eh_off is None:
            raise _Malformed(f"eh_frame_ptr {eh_va:#x} is not in the file")
        end = elf.segment_end(eh_va) or len(d)
        if count_enc != DW_EH_PE_omit and table_enc != DW_EH_PE_omit:
            count, p = _ptr(d, p, count_enc, hva + p - hoff, hdr_bases)
            last = -1
            if 0 < count <= len(d):
                if table_enc == 0x3B:                      # datarel sdata4: the usual
                    if p + 8 * count > len(d):
                        raise _Malformed("truncated .eh_frame_hdr table")
                    vals = struct.unpack_from(f"<{2 * count}i", d, p)
                    last = max(vals[1::2]) + hva
                else:
                    for _ in range(count):
                        _, p = _ptr(d, p, table_enc, hva + p - hoff, hdr_bases)
                        fde, p = _ptr(d, p, table_enc, hva + p - hoff, hdr_bases)
                        last = max(last, fde)
            if last >= eh_va:
                lo = _offset(elf, last)
                if lo is not None and lo + 4 <= len(d):
                    length = _U32(d, lo)[0]
                    rec_end = lo + 4 + length if length != 0xFFFFFFFF else lo + 12 + _U64(d, lo + 4)[0]
                    end = min(end, rec_end) if rec_end > eh_off else end
        return eh_va, eh_off, end
    except (_Malformed, struct.error, IndexError, ValueError) as e:
        why = str(e) if isinstance(e, _Malformed) else "truncated record"
        raise elf.error(f"{why}: malformed .eh_frame_hdr at {hva:#x}") from None


def _offset(elf: ElfView, va: int) -> int | None:
    """File offset of link-time address `va`: in a PT_LOAD segment's file bytes, else
    in a section's (a file whose segments do not cover it)."""
    off = elf.offset(va)
    if off is not None:
        return off
    for s in elf.sections:
        if s.addr and s.type != SHT_NOBITS and s.addr <= va < s.addr + s.size:
            return s.offset + va - s.addr
    return None


def _read_u64(elf: ElfView, va: int) -> int | None:
    """The 8 bytes at link-time address `va` (a DW_EH_PE_indirect pointer), None if not in the file."""
    o = _offset(elf, va)
    if o is None or o + 8 > len(elf.data):
        return None
    return _U64(elf.data, o)[0]


# --- CIEs --------------------------------------------------------------------
def _parse_cie(d, p: int, end: int, delta: int, bases: _Bases) -> tuple[int, int, bool, bool]:
    """Parse the CIE at file offset p; returns (FDE pointer encoding, LSDA
    encoding, whether FDEs carry augmentation data, whether it is a signal frame)."""
    if p < 0 or p + 4 > end:
        raise _Malformed("CIE pointer out of range")
    length = _U32(d, p)[0]
    body = p + 4
    if length == 0xFFFFFFFF:
        length = _U64(d, p + 4)[0]
        body = p + 12
    nxt = body + length
    if length < 5 or nxt > end:
        raise _Malformed("CIE length runs past the section")
    if _U32(d, body)[0] != 0:
        raise _Malformed("CIE pointer does not point at a CIE")
    version = d[body + 4]
    if version not in (1, 3):
        raise _Malformed(f"unknown CIE version {version}")
    q = body + 5
    z = d.find(b"\0", q, nxt)
    if z < 0:
        raise _Malformed("unterminated CIE augmentation string")
    aug = d[q:z]
    q = z + 1
    if aug.startswith(b"eh"):            # ancient gcc: an 8-byte EH data pointer
        q += 8
        aug = aug[2:]
    _, q = _uleb(d, q)                   # code alignment factor
    _, q = _sleb(d, q)                   # data alignment factor
    if version == 1:
        q += 1                           # return address register
    else:
        _, q = _uleb(d, q)
    fenc, lenc, has_z = 0x00, DW_EH_PE_omit, False
    if aug[:1] == b"z":
        has_z = True
        auglen, q = _uleb(d, q)
        aend = q + auglen
        if aend > nxt:
            raise _Malformed("CIE augmentation data runs past the CIE")
        for c in aug[1:]:
            if c == 0x52:                # 'R': FDE pointer encoding
                fenc = d[q]
                q += 1
            elif c == 0x4C:              # 'L': LSDA pointer encoding
                lenc = d[q]
                q += 1
            elif c == 0x50:              # 'P': personality encoding + pointer (skipped)
                penc = d[q]
                q += 1
                if penc != DW_EH_PE_omit:
                    _, q = _ptr(d, q, penc & 0x7F, q + delta, bases)
            elif c in (0x53, 0x42, 0x47):  # 'S' signal frame, 'B' (AArch64 BTI), 'G' (MTE)
                pass
            else:                        # like libgcc: an unknown letter may hide 'R' or 'L'
                raise _Malformed(f"unknown CIE augmentation {aug.decode('latin-1')!r}")
            if q > aend:
                raise _Malformed("CIE augmentation data runs past its length")
        if (fenc & 0x0F) not in (0, 1, 2, 3, 4, 9, 10, 11, 12):
            raise _Malformed(f"unknown FDE pointer encoding {fenc:#x}")
    elif aug:
        raise _Malformed(f"unknown CIE augmentation {aug.decode('latin-1')!r}")
    if q > nxt:
        raise _Malformed("CIE runs past its length")
    return fenc, lenc, has_z, has_z and b"S" in aug


# --- FDEs --------------------------------------------------------------------
def read_fdes(data, path: str | None = None) -> list[Fde]:
    """All FDEs of the image's .eh_frame (found by section header name, or, if
    the file has no section headers, via PT_GNU_EH_FRAME/.eh_frame_hdr's
    eh_frame_ptr), sorted by start, zero-length FDEs dropped.  `data` is the
    whole ELF file (or an ElfView of it); every message names `path`."""
    elf = view(data, path)
    loc = _locate_eh_frame(elf)
    if loc is None:
        return []
    d = elf.data
    base, off0, end = loc
    delta = base - off0                  # file offset -> link-time address
    bases = _Bases.of(elf)
    cies: dict[int, tuple[int, int, bool, bool]] = {}
    out: list[Fde] = []
    append = out.append
    U32, S32_U32, uleb = _U32, _S32_U32, _uleb
    p = off0
    rec = p
    try:
        while p < end:
            rec = p
            if p + 4 > end:
                raise _Malformed("truncated record")
            length = U32(d, p)[0]
            if length == 0:
                break                    # zero terminator
            body = p + 4
            if length == 0xFFFFFFFF:
                length = _U64(d, body)[0]
                body = p + 12
            nxt = body + length
            if nxt > end or length < 4:
                raise _Malformed("record length runs past the section")
            cie_id = U32(d, body)[0]
            if cie_id == 0:              # a CIE: parsed when an FDE first needs it
                p = nxt
                continue
            cie_off = body - cie_id
            cie = cies.get(cie_off)
            if cie is None:
                if cie_off < off0:
                    raise _Malformed("CIE pointer out of range")
                cie = cies[cie_off] = _parse_cie(d, cie_off, end, delta, bases)
            fenc, lenc, has_z, sig = cie
            q = body + 4
            if fenc == PCREL_SDATA4:
                raw, rng = S32_U32(d, q)
                start = (raw + q + delta) & MASK64 if raw else 0
                q += 8
            else:
                start, q = _ptr(d, q, fenc, q + delta, bases)
                rng, q = _raw(d, q, fenc & 0x07)     # the length: unsigned
                rng &= MASK64
            lsda = None
            if has_z:
                _, q = uleb(d, q)        # augmentation data length
                if lenc != DW_EH_PE_omit:
                    if lenc == PCREL_SDATA4:
                        raw = _S32(d, q)[0]
                        q += 4
                        if raw:
                            lsda = (raw + q - 4 + delta) & MASK64
                    else:
                        v, q = _ptr(d, q, lenc, q + delta, bases)
                        if v and lenc & DW_EH_PE_indirect:
                            v = _read_u64(elf, v)
                        lsda = v or None
            if q > nxt:
                raise _Malformed("FDE runs past its length")
            if rng and start:
                append(Fde(start, start + rng, lsda, sig))
            p = nxt
    except _Malformed as e:
        raise elf.error(f"{e}: malformed .eh_frame at {rec + delta:#x}") from None
    except (struct.error, IndexError, ValueError):
        raise elf.error(f"truncated record: malformed .eh_frame at {rec + delta:#x}") from None
    out.sort(key=lambda f: (f.start, f.end))
    return out

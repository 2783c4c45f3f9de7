"""Writing unwind tables for new code: an .eh_frame of our own (one CIE, one
FDE per piece of code, the call frame programs from the arch's unwind module)
and an .eh_frame_hdr whose binary-search table lists the image's FDEs, the
linked runtime's and ours, so PT_GNU_EH_FRAME pointed at it lets an unwinder
(libgcc's _Unwind_Find_FDE through dl_iterate_phdr, which only ever searches
that table) find all of them.  The image's .eh_frame is not moved or copied:
its FDEs stay where they are, the new table only points at them."""
from __future__ import annotations

import struct

from .encoding import PCREL_SDATA4

DATAREL_SDATA4 = 0x3B      # the hdr table's encoding (ld's)
UDATA4 = 0x03


def uleb(v: int) -> bytes:
    """DWARF's unsigned LEB128."""
    assert v >= 0, v
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def sleb(v: int) -> bytes:
    """DWARF's signed LEB128."""
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        if (v == 0 and not b & 0x40) or (v == -1 and b & 0x40):
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def _read_uleb(d: bytes, p: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        b = d[p]
        p += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, p


def _pad(rec: bytearray) -> bytes:
    """A record padded with DW_CFA_nop to a multiple of 8, its length word first."""
    body = bytes(rec)
    body += b"\0" * (-(len(body) + 4) % 8)
    return struct.pack("<I", len(body)) + body


def eh_frame(addr: int, pieces: list[tuple[int, int, bytes]], arch_unwind) -> tuple[bytes, list[tuple[int, int]]]:
    """An .eh_frame at `addr` for pieces (start, size, call frame program): its
    bytes and the (start, FDE address) of each piece, for the hdr's table."""
    u = arch_unwind
    cie = bytearray(struct.pack("<I", 0) + b"\x01zR\0" + uleb(u.CODE_ALIGN) + sleb(u.DATA_ALIGN)
                    + bytes([u.RA_COLUMN]) + uleb(1) + bytes([PCREL_SDATA4]) + u.CIE_INSNS)
    out = bytearray(_pad(cie))
    index = []
    for start, size, program in pieces:
        at = addr + len(out)
        rec = bytearray(struct.pack("<I", at + 4 - addr))                 # CIE pointer: back to offset 0
        rec += struct.pack("<i", start - (at + 8))                        # pc_begin, pcrel
        rec += struct.pack("<I", size) + uleb(0) + program
        out += _pad(rec)
        index.append((start, at))
    out += b"\0" * 4                                                      # terminator
    return bytes(out), index


def eh_frame_hdr(addr: int, eh_frame_addr: int, table: list[tuple[int, int]]) -> bytes:
    """An .eh_frame_hdr at `addr`: eh_frame_ptr (for a linear search) and the
    sorted (initial location, FDE address) table."""
    table = sorted(set(table))
    out = bytearray([1, PCREL_SDATA4, UDATA4, DATAREL_SDATA4])
    out += struct.pack("<iI", eh_frame_addr - (addr + 4), len(table))
    for loc, fde in table:
        out += struct.pack("<ii", loc - addr, fde - addr)
    return bytes(out)


def read_hdr_table(read, hdr_addr: int, hdr_size: int) -> tuple[int, list[tuple[int, int]]] | None:
    """An image's .eh_frame_hdr (read(addr, n) -> bytes): (its eh_frame's address,
    the table as absolute (initial location, FDE address) pairs), or None when
    it has no table in the encodings ld writes."""
    d = read(hdr_addr, hdr_size)
    if len(d) < 12 or d[0] != 1 or d[1] != PCREL_SDATA4 or d[2] != UDATA4 or d[3] != DATAREL_SDATA4:
        return None
    eh = hdr_addr + 4 + struct.unpack_from("<i", d, 4)[0]
    count = struct.unpack_from("<I", d, 8)[0]
    if 12 + 8 * count > len(d):
        return None
    return eh, [(hdr_addr + a, hdr_addr + b) for a, b in struct.iter_unpack("<ii", d[12:12 + 8 * count])]


def read_fde_starts(data: bytes, addr: int) -> list[tuple[int, int]]:
    """(initial location, FDE address) of each FDE of an .eh_frame at `addr`
    whose CIEs use pcrel sdata4 pointers (gcc's and gas's, a linked runtime's)."""
    out, p, enc = [], 0, {}
    while p + 4 <= len(data):
        n = struct.unpack_from("<I", data, p)[0]
        if n == 0:
            break
        ident = struct.unpack_from("<I", data, p + 4)[0]
        if ident == 0:                                   # a CIE: its 'R' encoding
            q = p + 9
            aug = data[q:data.index(b"\0", q)].decode()
            q += len(aug) + 1
            _, q = _read_uleb(data, q)
            _, q = _read_uleb(data, q)                   # (sleb: only skipped)
            q += 1 if data[p + 8] == 1 else len(uleb(_read_uleb(data, q)[0]))
            r = None
            if aug.startswith("z"):
                _, q = _read_uleb(data, q)
                for c in aug[1:]:
                    if c == "R":
                        r = data[q]
                        q += 1
                    elif c == "L":
                        q += 1
                    elif c == "P":
                        q += 1 + {0x00: 8, 0x03: 4, 0x0B: 4, 0x04: 8, 0x0C: 8}.get(data[q] & 0x0F, 8)
                    else:
                        break
            enc[p] = r
        else:
            cie = p + 4 - ident
            if enc.get(cie) in (PCREL_SDATA4,):
                start = addr + p + 8 + struct.unpack_from("<i", data, p + 8)[0]
                size = struct.unpack_from("<I", data, p + 12)[0]
                if size:
                    out.append((start, addr + p))
        p += 4 + n
    return out

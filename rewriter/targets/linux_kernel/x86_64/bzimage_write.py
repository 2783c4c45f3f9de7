"""Write a bzImage: the rewritten vmlinux and its KASLR table put back in the original's place.

The decompressor (arch/x86/boot/compressed, "ZO") is linked around its payload:
mkpiggy.c's piggy.S puts the compressed kernel in .rodata..compressed, before
ZO's own code, and its length (``input_len``) and the decompressed length
(``output_len``) in ZO's .rodata as two .longs; header.S copies them into the
setup header (``payload_length``, and ``init_size`` from ``output_len``).  So
the new payload must fit in the original's bytes: it is compressed with the same
compressor at its best level, zero-filled up to the original length, and
``input_len`` and ``payload_length`` say its new length.

The decompressed payload keeps exactly ``output_len`` bytes, because
handle_relocations() (misc.c) reads the relocation table backwards from
``output + output_len``: the vmlinux, zeros, then the table at the very end.
The room for a longer table comes from the vmlinux's file layout: its PT_LOADs
sit at 2 MiB-aligned file offsets, megabytes of padding that parse_elf() does not
need (it memmove()s each PT_LOAD to ``output + p_paddr - LOAD_PHYSICAL_ADDR``).
Each PT_LOAD is put one page above where parse_elf() moves it, so every move goes
down and none overwrites a segment not yet moved, nor the table (above them all).

Everything else in the file is the original's bytes, except tools/build.c's
CRC-32 in the last 4 bytes, recomputed when the original had a valid one.
"""
from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib

from ....errors import KprewriteError
from . import bzimage
from .bzimage import BzImage, RelocTable

PT_LOAD = 1
EHDR, PHDR, SHDR = 64, 56, 64
HEADER_ROOM = 0x1000            # the ELF and program headers, before the first PT_LOAD
SHT_NOBITS = 8
SHF_ALLOC = 2


# --- the payload ELF, laid out for parse_elf() ---------------------------------------------------------

def compact_elf(elf: bytes, path: str) -> bytes:
    """The vmlinux with each PT_LOAD at HEADER_ROOM + (p_paddr - lowest p_paddr), then the
    non-loaded sections (.shstrtab, .kprewrite.meta) and the section headers."""
    phoff, shoff = struct.unpack_from("<QQ", elf, 0x20)
    phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHH", elf, 0x36)
    if phentsize != PHDR or (shnum and shentsize != SHDR):
        raise KprewriteError(f"{path}: unexpected ELF header sizes in the vmlinux")
    phdrs = [list(struct.unpack_from("<IIQQQQQQ", elf, phoff + i * PHDR)) for i in range(phnum)]
    loads = [p for p in phdrs if p[0] == PT_LOAD]
    base = min(p[4] for p in loads)
    room = (EHDR + phnum * PHDR + 0xFFF) & ~0xFFF
    # (old offset, old end, new offset) of each PT_LOAD's file bytes
    moves = [(p[2], p[2] + p[5], room + p[4] - base) for p in loads]
    _check_moves(loads, room, base, path)

    def new_offset(off: int, size: int) -> int | None:
        for o, e, n in moves:
            if o <= off and off + size <= e:
                return n + off - o
        return None

    end = max(n + e - o for o, e, n in moves)
    out = bytearray(end)
    for o, e, n in moves:
        out[n:n + e - o] = elf[o:e]
    for p in phdrs:
        if p[0] == PT_LOAD:
            p[2] = room + p[4] - base
        elif p[5]:
            n = new_offset(p[2], p[5])
            if n is None:
                raise KprewriteError(f"{path}: a program header (type {p[0]:#x}) covers bytes outside every PT_LOAD")
            p[2] = n
    shdrs = [list(struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * SHDR)) for i in range(shnum)]
    for i, s in enumerate(shdrs):
        _, typ, flags, addr, off, size = s[:6]
        if i == 0:
            continue
        if flags & SHF_ALLOC:
            seg = next((p for p in loads if p[3] <= addr and addr + (size if typ != SHT_NOBITS else 0) <= p[3] + p[6]),
                       None)
            if seg is None:
                raise KprewriteError(f"{path}: section {i} at {addr:#x} lies in no PT_LOAD")
            s[4] = room + seg[4] - base + addr - seg[3]
        elif typ == SHT_NOBITS or not size:
            s[4] = len(out)
        else:
            align = max(1, s[8])
            out += bytes(-len(out) % align)
            s[4] = len(out)
            out += elf[off:off + size]
    out += bytes(-len(out) % 8)
    new_shoff = len(out) if shnum else 0
    for s in shdrs:
        out += struct.pack("<IIQQQQIIQQ", *s)
    out[:EHDR] = elf[:EHDR]
    struct.pack_into("<QQ", out, 0x20, EHDR, new_shoff)
    for i, p in enumerate(phdrs):
        struct.pack_into("<IIQQQQQQ", out, EHDR + i * PHDR, *p)
    return bytes(out)


def _check_moves(loads, room: int, base: int, path: str) -> None:
    """parse_elf() moves the PT_LOADs in program-header order: no move may write over a
    segment still to be moved."""
    for i, p in enumerate(loads):
        dest = (p[4] - base, p[4] - base + p[5])
        for q in loads[i + 1:]:
            src = (room + q[4] - base, room + q[4] - base + q[5])
            if dest[0] < src[1] and src[0] < dest[1]:
                raise KprewriteError(f"{path}: the PT_LOAD at p_paddr {p[4]:#x} would overwrite the one at "
                                     f"{q[4]:#x} while the decompressor moves them")


def memory_end(elf: bytes) -> int:
    """Where parse_elf()'s moves end, from the start of its output."""
    phoff = struct.unpack_from("<Q", elf, 0x20)[0]
    phnum = struct.unpack_from("<H", elf, 0x38)[0]
    loads = [struct.unpack_from("<IIQQQQQQ", elf, phoff + i * PHDR) for i in range(phnum)]
    loads = [p for p in loads if p[0] == PT_LOAD]
    base = min(p[4] for p in loads)
    return max(p[4] - base + p[5] for p in loads)


# --- compressors, as the kernel's Makefile.lib runs them, at their best level ---------------------------

def _lz4(data: bytes, limit: int) -> bytes:
    """lz4 -l: the legacy frame, 8 MiB blocks compressed independently (LZ4HC), as the kernel's
    `lz4 -l -9`; while the stream is longer than `limit`, blocks recompressed in turn at LZ4HC's
    best level (optimal parsing, several times slower)."""
    import lz4.block

    def block(i: int, level: int) -> bytes:
        return lz4.block.compress(data[i:i + bzimage.LZ4_LEGACY_BLOCK], mode="high_compression",
                                  compression=level, store_size=False)
    starts = range(0, len(data), bzimage.LZ4_LEGACY_BLOCK)
    blocks = [block(i, 9) for i in starts]
    size = lambda: 4 + sum(4 + len(b) for b in blocks) + 4  # noqa: E731  (with size_append)
    for n, i in enumerate(starts):
        if size() <= limit:
            break
        blocks[n] = block(i, 12)
    return struct.pack("<I", bzimage.LZ4_LEGACY_MAGIC) + b"".join(struct.pack("<I", len(b)) + b for b in blocks)


def _zstd(data: bytes, limit: int) -> bytes:
    """zstd -22 --ultra (the kernel's), unless level 19 fits: several times faster."""
    import zstandard
    out = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(data)
    if len(out) + 4 > limit:
        out = zstandard.ZstdCompressor(level=22, write_content_size=True).compress(data)
    return out


# name -> data, room -> compressed stream, as scripts/Makefile.lib makes it, at its best level
COMPRESSORS = {
    "lz4": _lz4,
    "gzip": lambda d, _: gzip.compress(d, compresslevel=9, mtime=0),           # gzip -n -f -9
    "xz": lambda d, _: lzma.compress(d, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32,  # scripts/xz_wrap.sh
                                     filters=[{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 9,
                                                                        "dict_size": 32 << 20}]),
    "lzma": lambda d, _: lzma.compress(d, format=lzma.FORMAT_ALONE, preset=9),  # lzma -9
    "zstd": _zstd,
    "bzip2": lambda d, _: bz2.compress(d, 9),                                  # bzip2 -9
}


def compress(name: str, data: bytes, limit: int, path: str) -> bytes:
    """The payload stream: `data` compressed, then its length (the build's size_append),
    refused unless it fits in `limit` bytes."""
    c = COMPRESSORS.get(name)
    if c is None:
        raise KprewriteError(f"{path}: writing a bzImage with a {name} payload is not supported "
                             f"(supported: {', '.join(COMPRESSORS)})")
    stream = c(data, limit) + struct.pack("<I", len(data) & 0xFFFFFFFF)
    if len(stream) <= limit:
        return stream
    raise KprewriteError(f"{path}: the rewritten kernel compresses ({name}) to {len(stream)} bytes; the "
                         f"decompressor has room for {limit} (the original payload's length)")


# --- the bzImage ------------------------------------------------------------------------------------------

def crc32_ok(data: bytes) -> bool:
    """tools/build.c's CRC-32 (init ~0, no final inversion) of everything before the last 4 bytes."""
    return len(data) > 4 and (~zlib.crc32(data[:-4]) & 0xFFFFFFFF) == struct.unpack_from("<I", data, len(data) - 4)[0]


def input_len_offset(b: BzImage) -> int:
    """File offset of ZO's `input_len: .long`, followed by `output_len: .long`
    (mkpiggy.c), after the payload; refused unless it is there exactly once."""
    h = b.header
    pattern = struct.pack("<II", h.payload_length, len(b.payload))
    data = b.raw
    start = h.payload_start + h.payload_length
    at = data.find(pattern, start)
    if at < 0 or data.find(pattern, at + 1) >= 0:
        raise KprewriteError(f"{b.path}: the decompressor's input_len/output_len words ({h.payload_length}, "
                             f"{len(b.payload)}) are not found once after the payload")
    return at


def build(b: BzImage, elf: bytes, table: RelocTable | None, path: str) -> bytes:
    """The new bzImage: `elf` (the rewritten vmlinux) and `table`, in `b`'s place."""
    payload = compact_elf(elf, path)
    tail = table.to_bytes() if table is not None else b""
    olen = len(b.payload)
    if len(payload) + len(tail) > olen:
        raise KprewriteError(f"{path}: the rewritten vmlinux ({len(payload)} bytes) and its relocation table "
                             f"({len(tail)} bytes) exceed the decompressor's output_len ({olen} bytes)")
    if olen - len(tail) < memory_end(payload):
        raise KprewriteError(f"{path}: the relocation table ({len(tail)} bytes) would be overwritten when the "
                             "decompressor places the kernel")
    decompressed = payload + bytes(olen - len(payload) - len(tail)) + tail
    h = b.header
    at = input_len_offset(b)
    stream = compress(b.compressor, decompressed, h.payload_length, path)
    out = bytearray(b.raw)
    start = h.payload_start
    out[start:start + h.payload_length] = stream + bytes(h.payload_length - len(stream))
    struct.pack_into("<I", out, bzimage.OFF_PAYLOAD_LENGTH, len(stream))
    struct.pack_into("<I", out, at, len(stream))
    if crc32_ok(b.raw):
        struct.pack_into("<I", out, len(out) - 4, ~zlib.crc32(bytes(out[:-4])) & 0xFFFFFFFF)
    return bytes(out)

"""Read an x86 bzImage: the setup header, the compressed payload, the vmlinux inside.

A bzImage (``/boot/vmlinuz-*``) is the real-mode setup code and its header
(Documentation/arch/x86/boot.rst), then the protected-mode code: the kernel's
own decompressor, with the compressed kernel inside it.  Boot protocol 2.08 and
later say where that payload is (``payload_offset``, from the start of the
protected-mode code, and ``payload_length``).  The payload is compressed with one
of the kernel's compressors, recognised by its magic as lib/decompress.c does;
every compressor's output but gzip's is followed by 4 little-endian bytes, the
uncompressed size (the build's ``size_append``; gzip's own trailer ends the same
way).  On x86-64 the decompressed payload is the ELF vmlinux (``objcopy -R
.comment -S``) followed, with CONFIG_RELOCATABLE, by the relocation table of
arch/x86/tools/relocs that the decompressor's ``handle_relocations()`` reads
backwards from the end for KASLR::

    0, 64-bit addresses..., 0, inverse 32-bit addresses..., 0, 32-bit addresses...

Everything here is in memory: no temporary files.  Every failure is a one-line
KprewriteError naming the file.
"""
from __future__ import annotations

import bz2
import lzma
import shutil
import struct
import subprocess
import zlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from ....errors import KprewriteError, file_error

# Setup header offsets (boot.rst, "The real-mode kernel header").
OFF_SETUP_SECTS = 0x1F1
OFF_SYSSIZE = 0x1F4
OFF_BOOT_FLAG = 0x1FE
OFF_HEADER = 0x202
OFF_VERSION = 0x206
OFF_LOADFLAGS = 0x211
OFF_KERNEL_ALIGNMENT = 0x230
OFF_RELOCATABLE = 0x234
OFF_PAYLOAD_OFFSET = 0x248
OFF_PAYLOAD_LENGTH = 0x24C
OFF_PREF_ADDRESS = 0x258
OFF_INIT_SIZE = 0x260
HEADER_END = 0x268          # end of the 2.10+ header fields read here

MIN_VERSION = 0x0208        # first with payload_offset/payload_length
MAX_VERSION = 0x020F        # 2.15, the newest protocol (Linux 5.5 and later)

LZ4_LEGACY_MAGIC = 0x184C2102
LZ4_LEGACY_BLOCK = 8 << 20  # lz4 -l: every block decompresses to 8 MiB, the last to less
LZ4_BOUND = LZ4_LEGACY_BLOCK + LZ4_LEGACY_BLOCK // 255 + 16  # LZ4_COMPRESSBOUND(8 MiB)

# Magic numbers, as lib/decompress.c matches them (its first two bytes), here a
# little longer where the format has it, to say "unsupported" rather than misread.
MAGICS: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "gzip"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x5d\x00\x00", "lzma"),
    (b"\x02\x21\x4c\x18", "lz4"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"BZh", "bzip2"),
    (b"\x89LZO\x00\r\n\x1a\n", "lzo"),
)
COMPRESSORS = tuple(name for _, name in MAGICS)


def version_str(version: int) -> str:
    return f"{version >> 8}.{version & 0xFF:02d}"


@dataclass(frozen=True)
class SetupHeader:
    """The fields of the setup header that locate and size the kernel."""
    version: int
    setup_sects: int        # as stored (0 means 4)
    syssize: int            # protected-mode code size, in 16-byte paragraphs
    loadflags: int
    kernel_alignment: int
    relocatable_kernel: int
    payload_offset: int
    payload_length: int
    pref_address: int
    init_size: int

    @property
    def setup_size(self) -> int:
        """Bytes before the protected-mode code: the boot sector and the setup sectors."""
        return ((self.setup_sects or 4) + 1) * 512

    @property
    def payload_start(self) -> int:
        """File offset of the compressed payload."""
        return self.setup_size + self.payload_offset


@dataclass(frozen=True)
class RelocTable:
    """The x86 KASLR relocation table appended to the vmlinux (arch/x86/tools/relocs)."""
    relocs64: array = field(repr=False)      # addresses of 64-bit absolute values
    relocs32neg: array = field(repr=False)   # addresses of 32-bit values holding minus an address
    relocs32: array = field(repr=False)      # addresses of 32-bit (sign-extended) absolute values

    @property
    def count(self) -> int:
        return len(self.relocs64) + len(self.relocs32neg) + len(self.relocs32)

    def to_bytes(self) -> bytes:
        out = array("I", [0]) + self.relocs64 + array("I", [0]) + self.relocs32neg + array("I", [0]) + self.relocs32
        return out.tobytes()

    @classmethod
    def parse(cls, data: bytes) -> "RelocTable | None":
        """The table at the end of ``data``, read backwards as handle_relocations() does;
        None unless its three zero-terminated lists and zeros before them (a rewritten
        kernel's room to spare) take all of ``data``."""
        if len(data) < 12 or len(data) % 4:
            return None
        words = array("I")
        words.frombytes(data)
        # words == [0, r64..., 0, r32neg..., 0, r32...]: the last three zeros from the end.
        zeros = []
        i = len(words) - 1
        while i >= 0 and len(zeros) < 3:
            if words[i] == 0:
                zeros.append(i)
            i -= 1
        if len(zeros) != 3 or any(words[:zeros[2]]):
            return None
        z32, zneg, z64 = zeros
        return cls(relocs64=words[z64 + 1:zneg], relocs32neg=words[zneg + 1:z32], relocs32=words[z32 + 1:])


@dataclass(frozen=True)
class BzImage:
    path: str
    header: SetupHeader
    compressor: str
    payload: bytes = field(repr=False)   # decompressed: the ELF vmlinux, then the relocation table
    elf_size: int
    relocs: RelocTable | None
    raw: bytes = field(repr=False, default=b"")     # the whole file

    @property
    def vmlinux(self) -> bytes:
        """The ELF vmlinux alone (what ``qemu -kernel`` boots through its PVH note)."""
        return self.payload[:self.elf_size]

    @property
    def relocs_bytes(self) -> bytes:
        return self.payload[self.elf_size:]

    def describe(self) -> dict:
        h = self.header
        d = {
            "format": "bzImage",
            "boot_protocol": version_str(h.version),
            "setup_size": h.setup_size,
            "payload_offset": h.payload_start,
            "compressor": self.compressor,
            "compressed_size": h.payload_length,
            "decompressed_size": len(self.payload),
            "init_size": h.init_size,
            "elf_size": self.elf_size,
            "relocs_size": len(self.payload) - self.elf_size,
        }
        if self.relocs is not None:
            d["relocs"] = {"64": len(self.relocs.relocs64), "32neg": len(self.relocs.relocs32neg),
                           "32": len(self.relocs.relocs32)}
        return d

    def summary(self) -> str:
        """One line for humans."""
        d = self.describe()
        s = (f"{self.path}: bzImage, boot protocol {d['boot_protocol']}, {self.compressor} payload of "
             f"{d['compressed_size']} bytes -> {d['decompressed_size']} bytes: ELF vmlinux {d['elf_size']}")
        if self.relocs is not None:
            r = d["relocs"]
            s += (f" + relocation table {d['relocs_size']} ({r['64']} 64-bit, {r['32neg']} inverse 32-bit, "
                  f"{r['32']} 32-bit)")
        elif d["relocs_size"]:
            s += f" + {d['relocs_size']} bytes that are not a relocation table"
        return s


def is_bzimage(data: bytes) -> bool:
    """Whether ``data`` (the file, or at least its first 0x206 bytes) starts like a bzImage."""
    return (len(data) >= OFF_HEADER + 4 and data[OFF_HEADER:OFF_HEADER + 4] == b"HdrS"
            and data[OFF_BOOT_FLAG:OFF_BOOT_FLAG + 2] == b"\x55\xaa")


def parse_header(data: bytes, path: str = "<bzImage>") -> SetupHeader:
    if len(data) < OFF_VERSION + 2:
        raise KprewriteError(f"{path}: truncated bzImage ({len(data)} bytes, the setup header ends at 0x{HEADER_END:x})")
    if not is_bzimage(data):
        raise KprewriteError(f"{path}: not a bzImage (no \"HdrS\" setup header at 0x{OFF_HEADER:x})")
    version = struct.unpack_from("<H", data, OFF_VERSION)[0]
    if version < MIN_VERSION:
        raise KprewriteError(f"{path}: boot protocol {version_str(version)} in the setup header is older than "
                             f"{version_str(MIN_VERSION)}, which has no payload_offset/payload_length")
    if version > MAX_VERSION:
        raise KprewriteError(f"{path}: unknown boot protocol {version_str(version)} in the setup header "
                             f"(known: {version_str(MIN_VERSION)} to {version_str(MAX_VERSION)})")
    if len(data) < HEADER_END:
        raise KprewriteError(f"{path}: truncated bzImage ({len(data)} bytes, the setup header ends at 0x{HEADER_END:x})")
    u32 = lambda off: struct.unpack_from("<I", data, off)[0]
    return SetupHeader(
        version=version, setup_sects=data[OFF_SETUP_SECTS], syssize=u32(OFF_SYSSIZE),
        loadflags=data[OFF_LOADFLAGS], kernel_alignment=u32(OFF_KERNEL_ALIGNMENT),
        relocatable_kernel=data[OFF_RELOCATABLE], payload_offset=u32(OFF_PAYLOAD_OFFSET),
        payload_length=u32(OFF_PAYLOAD_LENGTH), pref_address=struct.unpack_from("<Q", data, OFF_PREF_ADDRESS)[0],
        init_size=u32(OFF_INIT_SIZE))


def detect_compressor(payload: bytes) -> str | None:
    for magic, name in MAGICS:
        if payload.startswith(magic):
            return name
    return None


# --- decompressors: each returns (output, input bytes consumed) or raises _Corrupt -----------------
#
# Bounded: each is given `limit`, the size the payload's trailer claims (itself at most
# MAX_DECOMPRESSED), and stops as soon as its output passes it (raising _TooBig), so a
# decompression bomb costs at most `limit` bytes of memory and the time to make them.

MAX_DECOMPRESSED = 512 << 20   # a decompressed kernel (vmlinux + relocs) larger than this is refused
_ZSTD_FEED = 1024              # zstd input fed per call: at most 1 KiB * 32768 (RLE blocks) of output past limit


class _Corrupt(Exception):
    pass


class _TooBig(Exception):
    pass


def _bounded(d, p: bytes, limit: int, what: str, errors) -> tuple[bytes, int]:
    """A zlib/lzma/bz2 decompressor object's output for p, at most limit bytes."""
    try:
        out = d.decompress(p, limit + 1)
    except errors as e:
        raise _Corrupt(str(e))
    if len(out) > limit:
        raise _TooBig()
    if not d.eof:
        raise _Corrupt(f"the {what} ends early")
    return out, len(p) - len(d.unused_data)


def _gzip(p: bytes, limit: int) -> tuple[bytes, int]:
    return _bounded(zlib.decompressobj(wbits=31), p, limit, "gzip stream", zlib.error)


def _lzma_family(fmt: int):
    def dec(p: bytes, limit: int) -> tuple[bytes, int]:
        return _bounded(lzma.LZMADecompressor(format=fmt), p, limit, "stream", lzma.LZMAError)
    return dec


def _bzip2(p: bytes, limit: int) -> tuple[bytes, int]:
    return _bounded(bz2.BZ2Decompressor(), p, limit, "bzip2 stream", (OSError, ValueError))


def _zstd(p: bytes, limit: int) -> tuple[bytes, int]:
    zstandard = _need("zstandard", "a zstd", "zstandard")
    d = zstandard.ZstdDecompressor().decompressobj()
    out = bytearray()
    pos = 0
    try:
        while pos < len(p) and not d.eof:       # fed in small pieces: its decompress() has no max_length
            out += d.decompress(p[pos:pos + _ZSTD_FEED])
            pos += _ZSTD_FEED
            if len(out) > limit:
                raise _TooBig()
    except zstandard.ZstdError as e:
        raise _Corrupt(str(e))
    if not d.eof:
        raise _Corrupt("the zstd frame ends early")
    return bytes(out), min(pos, len(p)) - len(d.unused_data)


def _lz4_legacy(p: bytes, limit: int) -> tuple[bytes, int]:
    """The LZ4 legacy frame (``lz4 -l``), as lib/decompress_unlz4.c reads it: the magic, then
    blocks, each a 4-byte little-endian compressed size and an LZ4 block of at most 8 MiB;
    another magic may start a new frame.  Ends where no whole block follows (the kernel's
    appended size, or the end)."""
    lz4_block = _need("lz4.block", "an LZ4", "lz4")
    out = bytearray()
    blocks = 0
    pos = 4
    while pos + 4 <= len(p):
        size = struct.unpack_from("<I", p, pos)[0]
        if size == LZ4_LEGACY_MAGIC:
            pos += 4
            continue
        if blocks and pos == len(p) - 4:
            break                               # the 4-byte uncompressed size after the last block
        if size > LZ4_BOUND:
            raise _Corrupt(f"LZ4 block at payload offset {pos} claims {size} bytes (at most {LZ4_BOUND})")
        if pos + 4 + size > len(p):
            raise _Corrupt(f"LZ4 block at payload offset {pos} needs {size} bytes, {len(p) - pos - 4} remain")
        try:
            out += lz4_block.decompress(p[pos + 4:pos + 4 + size], uncompressed_size=LZ4_LEGACY_BLOCK)
        except lz4_block.LZ4BlockError as e:
            raise _Corrupt(f"LZ4 block at payload offset {pos}: {e}")
        blocks += 1
        if len(out) > limit:
            raise _TooBig()
        pos += 4 + size
    if not blocks:
        raise _Corrupt("no LZ4 block")
    return bytes(out), pos


def _lzo(p: bytes, limit: int) -> tuple[bytes, int]:
    """lzop's file format, through the lzop program (LZO kernels are rare; no maintained
    Python binding ships wheels); its output read as it comes, and the program killed
    once it passes limit."""
    import threading
    lzop = shutil.which("lzop")
    if not lzop:
        raise _Missing("an LZO payload needs the lzop program (Debian package lzop)")
    proc = subprocess.Popen([lzop, "-d", "-c", "-q"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)

    def feed():
        try:
            proc.stdin.write(p[:-4])
        except OSError:                         # lzop stopped reading (an error, or killed)
            pass
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass
    errs = []
    threads = [threading.Thread(target=feed, daemon=True),
               threading.Thread(target=lambda: errs.append(proc.stderr.read()), daemon=True)]
    for t in threads:
        t.start()
    out = bytearray()
    too_big = False
    while True:
        chunk = proc.stdout.read1(1 << 20)
        if not chunk:
            break
        out += chunk
        if len(out) > limit:
            too_big = True
            proc.kill()
            break
    proc.stdout.close()
    code = proc.wait()
    for t in threads:
        t.join()
    proc.stderr.close()
    if too_big:
        raise _TooBig()
    if code != 0:
        msg = b"".join(errs).decode(errors="replace").strip().splitlines()
        raise _Corrupt(f"lzop: {msg[-1] if msg else 'exit ' + str(code)}")
    return bytes(out), len(p) - 4


class _Missing(Exception):
    pass


def _need(module: str, what: str, package: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise _Missing(f"{what} payload needs the Python package {package} (pip install {package})")


DECOMPRESSORS = {
    "gzip": _gzip,
    "xz": _lzma_family(lzma.FORMAT_XZ),
    "lzma": _lzma_family(lzma.FORMAT_ALONE),
    "lz4": _lz4_legacy,
    "zstd": _zstd,
    "bzip2": _bzip2,
    "lzo": _lzo,
}


def decompress_payload(payload: bytes, path: str = "<bzImage>") -> tuple[str, bytes]:
    """(compressor, decompressed bytes) of a kernel payload; checks the size it ends with,
    and decompresses no further than that size (at most MAX_DECOMPRESSED)."""
    name = detect_compressor(payload)
    if name is None:
        raise KprewriteError(f"{path}: unsupported payload compressor (magic {payload[:4].hex(' ')}; "
                             f"known: {', '.join(COMPRESSORS)})")
    if len(payload) < 8:
        raise KprewriteError(f"{path}: truncated {name} payload ({len(payload)} bytes)")
    expect = struct.unpack_from("<I", payload, len(payload) - 4)[0]
    if expect > MAX_DECOMPRESSED:
        raise KprewriteError(f"{path}: truncated or corrupt {name} payload: its trailer says it decompresses to {expect} bytes, more than "
                             f"the {MAX_DECOMPRESSED >> 20} MiB kprewrite reads (a decompression bomb, or not a kernel)")
    try:
        out, used = DECOMPRESSORS[name](payload, expect)
    except _Missing as e:
        raise KprewriteError(f"{path}: {e}")
    except _Corrupt as e:
        raise KprewriteError(f"{path}: truncated or corrupt {name} payload: {e}")
    except _TooBig:
        raise KprewriteError(f"{path}: truncated or corrupt {name} payload: it decompresses to more than {expect} "
                             f"bytes, its trailer says {expect} (a decompression bomb, or a wrong trailer)")
    if len(out) != expect:
        raise KprewriteError(f"{path}: truncated or corrupt {name} payload: it decompresses to {len(out)} bytes, "
                             f"its trailer says {expect}")
    return name, out


def elf_size(data: bytes, path: str = "<bzImage>") -> int:
    """End of the ELF file at the start of ``data``: its headers, sections and segments."""
    if data[:4] != b"\x7fELF":
        raise KprewriteError(f"{path}: the decompressed payload is not an ELF vmlinux (starts {data[:4].hex(' ')})")
    if data[4] != 2 or data[5] != 1:
        raise KprewriteError(f"{path}: the decompressed payload is not a 64-bit little-endian ELF "
                             "(only x86-64 kernels are supported)")
    if len(data) < 64:
        raise KprewriteError(f"{path}: the decompressed payload is a truncated ELF ({len(data)} bytes)")
    e_phoff, e_shoff = struct.unpack_from("<QQ", data, 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", data, 0x36)
    end = max(64, e_phoff + e_phnum * e_phentsize, e_shoff + e_shnum * e_shentsize)
    if end > len(data):
        raise KprewriteError(f"{path}: the decompressed ELF's headers run past its end ({end} > {len(data)} bytes)")
    for i in range(e_shnum):
        sh_type, = struct.unpack_from("<I", data, e_shoff + i * e_shentsize + 4)
        sh_offset, sh_size = struct.unpack_from("<QQ", data, e_shoff + i * e_shentsize + 0x18)
        if sh_type != 8:                     # SHT_NOBITS takes no file space
            end = max(end, sh_offset + sh_size)
    for i in range(e_phnum):
        p_offset, = struct.unpack_from("<Q", data, e_phoff + i * e_phentsize + 8)
        p_filesz, = struct.unpack_from("<Q", data, e_phoff + i * e_phentsize + 0x20)
        end = max(end, p_offset + p_filesz)
    if end > len(data):
        raise KprewriteError(f"{path}: the decompressed ELF is truncated (its contents end at {end}, "
                             f"the payload has {len(data)} bytes)")
    return end


def parse(data: bytes, path: str = "<bzImage>") -> BzImage:
    h = parse_header(data, path)
    start, length = h.payload_start, h.payload_length
    if length == 0:
        raise KprewriteError(f"{path}: the setup header gives an empty payload")
    if start + length > len(data):
        raise KprewriteError(f"{path}: truncated payload: the setup header puts {length} bytes at offset {start}, "
                             f"the file has {len(data)} bytes")
    name, out = decompress_payload(data[start:start + length], path)
    size = elf_size(out, path)
    relocs = RelocTable.parse(out[size:]) if size < len(out) else None
    return BzImage(path=path, header=h, compressor=name, payload=out, elf_size=size, relocs=relocs, raw=data)


def read(path: str | Path) -> BzImage:
    """Read and decompress the bzImage at ``path``."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise file_error(path, e) from None
    return parse(data, str(path))

"""Hostile input costs bounded time and memory (docs/limitations.md, "Bounds on hostile input").

A build farm rewriting uploaded binaries must not be stalled or exhausted by one: each crafted
input here is refused in one line naming the file, within SECONDS of wall time and under a peak
RSS measured on the CLI's own process (a fresh wrapper process per case, so that
RUSAGE_CHILDREN's ru_maxrss is this run's and its children's -- lzop's included -- alone):

- decompression bombs, real ones (256 MiB of zeros in a few hundred KiB or less), in every
  compressor a bzImage may use, whose trailer claims a small size or more than the 512 MiB
  bound;
- a gcc ELF whose headers claim tables of gigabytes (section, program header and symbol
  tables, a section's size);
- Debian's vmlinux with its kallsyms tables replaced by a crafted run of symbol counts whose
  name chains each run for megabytes (without the bounds: hours of search);
- a spec whose globs ask for more than a million probes on a crafted symbol table.
"""
from __future__ import annotations

import bz2
import json
import re
import lzma
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from conftest import TREE_ENV, cc, make_bzimage

from rewriter.probes.resolve import MAX_PROBES
from rewriter.targets.linux_kernel.x86_64 import bzimage

ARCHES = ["x86_64"]      # x86-64 only: crafted files and the host's gcc: nothing depends on the arch under test

SECONDS = 30                  # wall time for one refusal: a runaway takes minutes; most take < 2 s, but
                              # the suite runs one test per core and the machine may be shared
RSS_MIB = 200                 # peak RSS of a refusal, the interpreter and its imports (~100 MiB) included
BOMB = 256 << 20              # what each bomb decompresses to

_MEASURE = r"""
import json, resource, subprocess, sys, time
t = time.monotonic()
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps({"code": r.returncode, "stderr": r.stderr, "seconds": time.monotonic() - t,
                  "rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def measured(*args) -> dict:
    """`kprewrite args` in a fresh process: exit code, standard error, wall seconds, peak RSS (MiB)."""
    r = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, "-m", "rewriter", *map(str, args)],
                       capture_output=True, text=True, env=TREE_ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def refused(r: dict, path: Path, *expect: str, seconds: float = SECONDS, rss_mib: float = RSS_MIB) -> str:
    """One line naming `path`, with `expect` in it, in time and memory; the line."""
    lines = r["stderr"].strip().splitlines()
    assert r["code"] == 1 and len(lines) == 1, r["stderr"]
    line = lines[0]
    assert line.startswith(f"kprewrite: {path}: "), line
    for e in expect:
        assert e in line, line
    assert r["seconds"] < seconds, (r["seconds"], line)
    assert r["rss_mib"] < rss_mib, (r["rss_mib"], line)
    print(f"{path.name}: {r['seconds']:.2f} s, {r['rss_mib']:.0f} MiB: {line}")
    return line


# --- decompression bombs -------------------------------------------------------------------------

def _chunks():
    z = bytes(1 << 20)
    for _ in range(BOMB >> 20):
        yield z


def _stream(obj) -> bytes:
    return b"".join(obj.compress(c) for c in _chunks()) + obj.flush()


def _lz4(_) -> bytes:
    import lz4.block
    blk = lz4.block.compress(bytes(bzimage.LZ4_LEGACY_BLOCK), store_size=False)
    n = BOMB // bzimage.LZ4_LEGACY_BLOCK
    return struct.pack("<I", bzimage.LZ4_LEGACY_MAGIC) + (struct.pack("<I", len(blk)) + blk) * n


def _zstd(_) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    return _stream(zstandard.ZstdCompressor(level=3).compressobj())


def _lzo(_) -> bytes:
    if not shutil.which("lzop"):
        pytest.skip("lzop not installed (Debian package lzop)")
    p = subprocess.Popen(["lzop", "-1", "-c", "-q"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    import threading
    out = []
    t = threading.Thread(target=lambda: out.append(p.stdout.read()))
    t.start()
    for c in _chunks():
        p.stdin.write(c)
    p.stdin.close()
    t.join()
    assert p.wait() == 0
    return out[0]


STREAMS = {     # each compressor's stream of BOMB zero bytes, without the kernel's size trailer
    "gzip": lambda _: _stream(zlib.compressobj(9, zlib.DEFLATED, 31))[:-4],
    "xz": lambda _: _stream(lzma.LZMACompressor(lzma.FORMAT_XZ, check=lzma.CHECK_CRC32, preset=0)),
    "lzma": lambda _: _stream(lzma.LZMACompressor(lzma.FORMAT_ALONE, preset=0)),
    "lz4": _lz4,
    "zstd": _zstd,
    "bzip2": lambda _: _stream(bz2.BZ2Compressor(9)),
    "lzo": _lzo,
}


@pytest.fixture(scope="module")
def bombs():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = STREAMS[name](None)
            assert len(cache[name]) < BOMB // 200      # a bomb: a ratio above 200 (LZ4 stops at 255)
        return cache[name]
    return get


@pytest.mark.parametrize("name", bzimage.COMPRESSORS)
def test_bomb_past_its_trailer(name, bombs, tmp_path):
    """The trailer claims 1 MiB; the stream holds 256 MiB: refused once past 1 MiB."""
    path = tmp_path / f"bzImage.{name}"
    path.write_bytes(make_bzimage(bombs(name) + struct.pack("<I", 1 << 20)))
    refused(measured("list", path), path, f"truncated or corrupt {name} payload: it decompresses to more than "
                                          f"{1 << 20} bytes, its trailer says {1 << 20}")


@pytest.mark.parametrize("name", bzimage.COMPRESSORS)
def test_bomb_claiming_past_the_bound(name, bombs, tmp_path):
    """The trailer claims 4 GiB - 1: refused before decompressing anything."""
    path = tmp_path / f"bzImage.{name}"
    path.write_bytes(make_bzimage(bombs(name) + struct.pack("<I", 0xFFFFFFFF)))
    refused(measured("list", path), path, f"its trailer says it decompresses to {0xFFFFFFFF} bytes, more than "
                                          f"the 512 MiB kprewrite reads")


def test_bomb_within_the_bound(bombs, tmp_path):
    """A trailer that tells the truth, 256 MiB, below the bound: decompressed (the memory a bomb
    can cost is the bound), then refused as no ELF."""
    path = tmp_path / "bzImage.gzip"
    path.write_bytes(make_bzimage(bombs("gzip") + struct.pack("<I", BOMB)))
    refused(measured("list", path), path, "the decompressed payload is not an ELF vmlinux",
            seconds=3 * SECONDS, rss_mib=RSS_MIB + 2 * (BOMB >> 20))


# --- ELF tables claiming gigabytes ---------------------------------------------------------------

PROGRAM = "int work(int x) { return x * 3; }\nint main(int c, char **v) { return work(c); }\n"


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    return cc(tmp_path_factory.mktemp("hostile"), "prog", PROGRAM, "-O2")


def _shdr(data: bytes, name: str) -> int:
    """File offset of the section header of `name`."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    str_off, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        h = shoff + i * shentsize
        n, = struct.unpack_from("<I", data, h)
        if data[str_off + n:data.index(b"\0", str_off + n)] == name.encode():
            return h
    raise KeyError(name)


def _claim_shnum(d: bytearray):
    struct.pack_into("<H", d, 0x3C, 0xFFFF)                  # e_shnum: 65535 headers of...
    struct.pack_into("<H", d, 0x3A, 0xFFFF)                  # ... 65535 bytes each: 4 GiB


def _claim_phnum(d: bytearray):
    struct.pack_into("<H", d, 0x38, 0xFFFF)
    struct.pack_into("<H", d, 0x36, 0xFFFF)


def _claim_shoff(d: bytearray):
    struct.pack_into("<Q", d, 0x28, (1 << 63) - 1)


def _claim_symtab(d: bytearray):
    struct.pack_into("<Q", d, _shdr(d, ".symtab") + 0x20, 1 << 40)     # 1 TiB of symbols


def _claim_dynsym(d: bytearray):
    struct.pack_into("<Q", d, _shdr(d, ".dynsym") + 0x20, (1 << 64) - 24)


def _claim_text(d: bytearray):
    struct.pack_into("<Q", d, _shdr(d, ".text") + 0x20, 1 << 32)


def _claim_strtab(d: bytearray):
    struct.pack_into("<Q", d, _shdr(d, ".strtab") + 0x20, 1 << 36)


CLAIMS = {"shnum": _claim_shnum, "phnum": _claim_phnum, "shoff": _claim_shoff, "symtab": _claim_symtab,
          "dynsym": _claim_dynsym, "text": _claim_text, "strtab": _claim_strtab}


@pytest.mark.parametrize("cmd", ["check", "blacklist"])
@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_elf_tables_claiming_gigabytes(claim, cmd, prog, tmp_path):
    d = bytearray(prog.read_bytes())
    CLAIMS[claim](d)
    path = tmp_path / f"prog.{claim}"
    path.write_bytes(d)
    spec = tmp_path / "probes.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "*"\n')
    args = ["check", path, "--spec", spec] if cmd == "check" else ["blacklist", path]
    refused(measured(*args), path)


# --- a kallsyms search that would run for hours ----------------------------------------------------

@pytest.mark.kernel
def test_kallsyms_crafted_name_chains(debian_kernel, tmp_path):
    """Debian's vmlinux, .rodata up to its kallsyms token table (3 MiB on 6.1) made of 8-byte
    groups 07 74 10 00 00 00 00 00: every group reads as a kallsyms_num_syms of 1,078,279 whose
    names (length 7, type 't') chain on to the token table, 300,000 names each: 30 billion names
    to parse without the bounds."""
    from rewriter.targets.linux_kernel import kallsyms
    from rewriter.targets.linux_kernel.elfview import ElfView
    data = bytearray(debian_kernel.vmlinux.read_bytes())
    elf = ElfView(bytes(data))
    tables = kallsyms.read_kallsyms(bytes(data), "vmlinux", elf).tables
    table = elf.offset_of(tables.token_table)
    ro = elf.section(".rodata")
    start = table - (table - ro.offset) // 8 * 8
    group = b"\x07\x74\x10\x00\x00\x00\x00\x00"
    assert table - start > 2 * struct.unpack("<I", group[:4])[0] + (64 << 10), (table - start)
    data[start:table] = group * ((table - start) // 8)
    path = tmp_path / "vmlinux"
    path.write_bytes(data)
    spec = tmp_path / "probes.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "do_sys_openat2"\n')
    refused(measured("check", path, "--spec", spec), path, "kallsyms names parsed in candidate tables",
            "--system-map", rss_mib=RSS_MIB + 3 * (len(data) >> 20))


# --- globs asking for millions of probes --------------------------------------------------------

@pytest.fixture(scope="module")
def many_functions(tmp_path_factory):
    """A program whose .symtab holds 50,000 functions (crafted: each a `ret`)."""
    d = tmp_path_factory.mktemp("many")
    src = d / "many.s"
    n = 50_000
    src.write_text(".text\n" + "".join(f".globl f{i}\n.type f{i},@function\nf{i}:\n\tret\n.size f{i},1\n"
                                       for i in range(n))
                   + ".globl main\n.type main,@function\nmain:\n\txor %eax,%eax\n\tret\n.size main,3\n")
    subprocess.run(["gcc", str(src), "-o", str(d / "many")], check=True, capture_output=True)
    return d / "many"


def test_globs_asking_for_millions_of_probes(many_functions, tmp_path):
    """21 tables of `*` (and kretprobes of `f*`) on the 50,000 functions (and gcc's few): 2.1 million
    probes, refused at the 20th table, before any probe is resolved further."""
    spec = tmp_path / "probes.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "*"\n' * 21 + '[[kretprobe]]\nsymbol_name = "f*"\n' * 21)
    r = measured("check", many_functions, "--spec", spec)
    line = r["stderr"].strip()
    assert re.match(rf"kprewrite: {spec.name}: \[\[kprobe\]\] #20: symbol_name '\*' matches 500\d\d functions "
                    r"of many, which makes 100\d\d\d\d probes", line), line
    assert f"more than the {MAX_PROBES} kprewrite places in one output" in line, line
    assert r["code"] == 1 and "\n" not in line
    assert r["seconds"] < SECONDS and r["rss_mib"] < RSS_MIB, r
    print(f"globs: {r['seconds']:.2f} s, {r['rss_mib']:.0f} MiB: {line}")

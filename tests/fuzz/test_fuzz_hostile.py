"""Fuzzing hostile input (docs/limitations.md, "Bounds on hostile input"): bzImages whose
payload is a decompression bomb or a mutated real stream, in every compressor, with a
trailer that claims anything; and specs whose globs ask for more probes than kprewrite
places.  Each case must hold the bad-input contract of the harness (one line naming the
file, no hang: the harness's alarm is 20 s of CPU time)."""
from __future__ import annotations

import bz2
import gzip
import lzma
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from conftest import make_bzimage
from harness import count, fuzz_settings, run_case

from rewriter.targets.linux_kernel.x86_64 import bzimage

BOMB = 64 << 20          # the bombs' real size: zeros, far past every claim the cases make but the largest


def _lz4(data: bytes) -> bytes:
    import lz4.block
    out = [struct.pack("<I", bzimage.LZ4_LEGACY_MAGIC)]
    for i in range(0, len(data), bzimage.LZ4_LEGACY_BLOCK):
        blk = lz4.block.compress(data[i:i + bzimage.LZ4_LEGACY_BLOCK], store_size=False)
        out += [struct.pack("<I", len(blk)), blk]
    return b"".join(out)


def _zstd(data: bytes) -> bytes:
    import zstandard
    return zstandard.ZstdCompressor(level=3).compress(data)


def _lzo(data: bytes) -> bytes | None:
    if not shutil.which("lzop"):
        return None
    return subprocess.run(["lzop", "-1", "-c", "-q"], input=data, capture_output=True, check=True).stdout


COMPRESS = {     # the stream alone; the case appends its trailer (the kernel's size_append)
    "gzip": lambda d: gzip.compress(d, 6, mtime=0)[:-4],
    "xz": lambda d: lzma.compress(d, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32),
    "lzma": lambda d: lzma.compress(d, format=lzma.FORMAT_ALONE, preset=1),
    "lz4": _lz4,
    "zstd": _zstd,
    "bzip2": lambda d: bz2.compress(d, 9),
    "lzo": _lzo,
}


@pytest.fixture(scope="module")
def streams():
    """compressor -> {"bomb": BOMB zeros, "elf": /bin/true}, each compressed (no trailer)."""
    true = Path(shutil.which("true") or "/bin/true").read_bytes()
    out = {}
    for name, c in COMPRESS.items():
        bomb, elf = c(b"\0" * BOMB), c(true)
        if bomb is not None:
            out[name] = {"bomb": (bomb, BOMB), "elf": (elf, len(true))}
    return out


CLAIMS = [0, 1, 64, 4096, 1 << 20, (1 << 20) + 1, BOMB - 1, BOMB, BOMB + 1, bzimage.MAX_DECOMPRESSED,
          bzimage.MAX_DECOMPRESSED + 1, 0x7FFFFFFF, 0xFFFFFFFF]


@fuzz_settings(300)
@given(name=st.sampled_from(sorted(COMPRESS)), which=st.sampled_from(["bomb", "bomb", "elf"]),
       claim=st.one_of(st.sampled_from(CLAIMS + ["true"]), st.integers(0, 0xFFFFFFFF)),
       edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.binary(min_size=1, max_size=8)), max_size=3),
       cut=st.one_of(st.none(), st.integers(0, 1 << 20)),
       cmd=st.sampled_from(["check", "list", "instrument"]),
       data=st.data())
def test_fuzz_bzimage_bomb(name, which, claim, edits, cut, cmd, data, streams, tmp_path_factory):
    if name not in streams:
        pytest.skip(f"no {name} compressor here")
    stream, size = streams[name][which]
    b = bytearray(stream)
    for pos, blob in edits:                      # past the magic, so that the compressor is still chosen
        pos = 12 + pos % max(1, len(b) - 12)
        b[pos:pos + len(blob)] = blob
    if cut is not None:
        del b[max(12, cut % (len(b) + 1)):]
    b += struct.pack("<I", size if claim == "true" else claim)
    d = tmp_path_factory.mktemp("bomb", numbered=True)
    img = d / f"bzImage.{name}"
    img.write_bytes(make_bzimage(bytes(b)))
    spec = d / "probes.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "*"\n')
    out = d / "out"
    args = {"check": ["check", img, "--spec", spec], "list": ["list", img],
            "instrument": ["instrument", img, "--spec", spec, "-o", out]}[cmd]
    count("bzimage")
    run_case(args, [img, spec], d, out)
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


NFUNC = 300
PROGRAM = "\n".join(f"__attribute__((noinline)) int f{i}(int x) {{ return x * {i} + 1; }}" for i in range(NFUNC)) + \
    "\nint main(int argc, char **argv) { return f1(argc); }\n"
LOW_BOUND = 1000


@pytest.fixture(scope="module")
def many_functions(tmp_path_factory):
    """A gcc program with 300 functions, each under 3 more names in its .symtab."""
    d = tmp_path_factory.mktemp("many")
    src = d / "many.c"
    aliases = "\n".join(f"int a{i}_{j}(int) __attribute__((alias(\"f{i}\")));" for i in range(NFUNC) for j in range(3))
    src.write_text(PROGRAM + aliases + "\n")
    subprocess.run(["gcc", "-O1", str(src), "-o", str(d / "many")], check=True, capture_output=True)
    return d / "many"


@fuzz_settings(100)
@given(tables=st.lists(st.tuples(st.sampled_from(["kprobe", "kretprobe"]),
                                 st.sampled_from(["*", "f*", "a*", "f1*", "[af]*", "*_*", "?*", "f2?"])),
                       min_size=1, max_size=600))
def test_fuzz_glob_probe_count(tables, many_functions, tmp_path_factory):
    """Specs whose globs ask for up to 180,000 probes, against the bound lowered to 1,000
    (the real one is a million: the same code path, at a cost a fuzzer can pay).  Past the
    bound, `check` must refuse in one line naming the spec."""
    from rewriter.probes import resolve
    d = tmp_path_factory.mktemp("globs", numbered=True)
    spec = d / "probes.toml"
    spec.write_text("".join(f'[[{k}]]\nsymbol_name = "{g}"\n' for k, g in tables))
    count("globs")
    saved, resolve.MAX_PROBES = resolve.MAX_PROBES, LOW_BOUND
    try:
        r = run_case(["check", many_functions, "--spec", spec], [many_functions, spec], d)
    finally:
        resolve.MAX_PROBES = saved
    if len(tables) * NFUNC <= LOW_BOUND:
        assert f"more than the {LOW_BOUND}" not in r.err
    if all(g in ("*", "?*", "[af]*") for _, g in tables) and len(tables) * NFUNC > LOW_BOUND:
        assert r.code == 1 and f"more than the {LOW_BOUND} kprewrite places" in r.err, r.err
    for p in d.iterdir():
        p.unlink()
    d.rmdir()

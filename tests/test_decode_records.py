"""x86-64 decode_function() from Capstone's raw cs_insn records (cs.records(), read with
the binding's own struct layout) gives what the disasm_lite() sweep gives, for every
function of a real image, and for code given as any buffer.  Fast: one small compile."""
from __future__ import annotations

import subprocess

import pytest

from conftest import cc

from rewriter.arch.x86_64 import cs, decode
from rewriter.elf.image import Image

ARCHES = ["x86_64"]      # x86-64 only: x86-64's decode_function() on Capstone's x86 records

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
__attribute__((noinline)) int pick(int x) {
    switch (x) { case 0: return 11; case 1: return 23; case 2: return 37; case 3: return 41;
                 case 4: return 53; case 5: return 67; case 6: return 71; default: return -1; }
}
__attribute__((noinline)) long mix(const char *s, long n) {
    long h = 0;
    for (long i = 0; i < n; i++) { h = h * 31 + s[i]; if (h & 1) h ^= pick(s[i] & 7); }
    return h < 0 ? -h : h;
}
int main(int argc, char **argv) {
    char buf[64]; snprintf(buf, sizeof buf, "%s", argc > 1 ? argv[1] : "x");
    printf("%ld\n", mix(buf, (long)strlen(buf)));
    return 0;
}
"""


def _images(tmp_path):
    libc = subprocess.run(["gcc", "-print-file-name=libc.so.6"], capture_output=True, text=True).stdout.strip()
    return [Image(str(cc(tmp_path, "prog", PROGRAM, "-O2"))), Image(libc)]


@pytest.mark.skipif(cs.LAYOUT is None, reason="this Capstone binding has no cs_insn layout to read")
def test_records_decode_as_disasm_lite(tmp_path):
    long = 0
    for image in _images(tmp_path):
        for f in image.functions:
            code = image.read(f.start, f.end - f.start)
            lite = decode._decode_lite(code, f.start)
            assert decode.decode_function(code, f.start) == lite, hex(f.start)
            long += len(code) > decode.SHORT
    assert long > 100                   # the records path ran, not only disasm_lite()
    # Code past the first byte that does not decode: the same end, the same boundaries.
    code = bytes.fromhex("4889e5") * 50 + b"\x06" + bytes.fromhex("c3") * 10
    got = decode.decode_function(code, 0x1000)
    assert got == decode._decode_lite(code, 0x1000) and got.undecodable == 0x1000 + 150


def test_any_buffer_and_no_layout(tmp_path, monkeypatch):
    """A bytearray or memoryview decodes as bytes do (the binding's cs_disasm() takes
    bytes only); without a layout to read, decode_function() is the disasm_lite() sweep."""
    image = _images(tmp_path)[1]        # libc: functions longer than SHORT
    f = max(image.functions, key=lambda f: f.end - f.start)
    code = image.read(f.start, f.end - f.start)
    assert len(code) > decode.SHORT
    want = decode.decode_function(code, f.start)
    assert want.branches and want.exits
    for buf in (bytearray(code), memoryview(code)):
        assert decode.decode_function(buf, f.start) == want
    monkeypatch.setattr(cs, "LAYOUT", None)
    assert decode.decode_function(code, f.start) == want


@pytest.mark.skipif(cs.LAYOUT is None, reason="this Capstone binding has no cs_insn layout to read")
def test_records_in_chunks():
    """A function of more instructions than one cs_disasm() run decodes (decode.CHUNK) gives
    what one sweep gives: the boundaries, branches and exits on from each run's end, and
    the end where decoding stops, whether that falls inside a run or right at its end."""
    n = decode.CHUNK
    jcc = bytes.fromhex("7402")                 # je .+4: a branch and an exit, 2 bytes
    body = (bytes.fromhex("4889e5") + jcc) * n  # mov %rsp,%rbp; je: 2n instructions
    for code in (body, body + b"\x06" + b"\xc3" * 9,                      # runs past CHUNK, then stops
                 bytes.fromhex("4889e5") * n + b"\x06" + b"\xc3" * 9,     # stops right at a run's end
                 bytes.fromhex("4889e5") * n,                            # ends right at a run's end
                 bytes.fromhex("4889e5") * (3 * n - 1) + jcc):
        got = decode.decode_function(code, 0x400000)
        assert got == decode._decode_lite(code, 0x400000)
        assert len(got.boundaries) >= n
    assert len(decode.decode_function(body, 0).branches) == n

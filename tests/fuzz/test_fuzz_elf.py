"""Fuzzing the ELF reader: mutated copies of small real ELFs compiled by gcc
(PIE, non-PIE, static, static-PIE, shared object, C++ with exceptions) through
`check`, `instrument`, `blacklist` and `list`.  The mutations are structured:
each picks a region of the file (the ELF header, the program or section header
table, .eh_frame, .eh_frame_hdr, .gcc_except_table (LSDA), .dynamic, .symtab,
.dynsym, the string tables, relocations, .text, or anywhere) and writes an
interesting value of 1, 2, 4 or 8 bytes there, random bytes, or truncates."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from hypothesis import given, strategies as st

from harness import count, fuzz_settings, run_case

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int counter;
__attribute__((noinline)) int work(int x) { counter++; return x * x * 3 + x / 7 + 1; }
__attribute__((noinline)) int pick(int x) {
  switch (x) { case 0: return 3; case 1: return 9; case 2: return 11; case 3: return 1; case 4: return 6; case 5: return 2; default: return x; }
}
static int (*fp)(int) = work;
int main(int argc, char **argv) { printf("%d\n", fp(argc) + pick(argc) + (int)strlen(argv[0])); return 0; }
"""
TINY_START = r"""
__attribute__((noinline)) int work(int x) { return x * x * 3 + x / 7 + 1; }
__attribute__((noinline)) int pick(int x) {
  switch (x) { case 0: return 3; case 1: return 9; case 2: return 11; case 3: return 1; case 4: return 6; case 5: return 2; default: return x; }
}
int main(void) { return work(3) + pick(2); }
void _start(void) { int r = main(); __asm__ volatile("mov %0, %%edi; mov $60, %%eax; syscall" :: "r"(r) : "rdi", "rax"); }
"""
LIBRARY = r"""
int lib_counter;
int lib_work(int x) { lib_counter++; return x * 5 + 1; }
int lib_other(int x) { return lib_work(x) * 2; }
"""
CXX = r"""
#include <stdexcept>
#include <cstdio>
__attribute__((noinline)) int thrower(int x) { if (x > 1) throw std::runtime_error("x"); return x; }
__attribute__((noinline)) int work(int x) { try { return thrower(x); } catch (std::exception &e) { std::puts(e.what()); return -1; } }
int main(int argc, char **) { return work(argc + 1) + 1; }
"""
BASES = {
    "pie": (PROGRAM, "c", ["-O2"]),
    "nopie": (PROGRAM, "c", ["-O2", "-no-pie"]),
    "static": (TINY_START, "c", ["-O2", "-static", "-nostdlib", "-fno-pie", "-no-pie"]),
    "staticpie": (TINY_START, "c", ["-O2", "-static-pie", "-nostdlib", "-fPIE"]),
    "lib.so": (LIBRARY, "c", ["-O2", "-shared", "-fPIC"]),
    "cxx": (CXX, "c++", ["-O2"]),
}
SPECS = {
    "glob": '[[kprobe]]\nsymbol_name = "*"\n[[kretprobe]]\nsymbol_name = "*"\n',
    "one": '[[kprobe]]\nsymbol_name = "work"\noffset = 0\nfetch = "a=%di:s32 s=+0(%si):string"\n'
           '[[kretprobe]]\nsymbol_name = "work"\nfetch = "r=$retval:u32"\n',
    "events": 'events = ["p:g/e work x=%di:u32 c=@counter:s32", "r work $retval"]\n',
}
REGIONS = [".eh_frame", ".eh_frame_hdr", ".gcc_except_table", ".dynamic", ".symtab", ".dynsym", ".strtab",
           ".dynstr", ".rela.dyn", ".rela.plt", ".text", ".init_array", ".gnu.hash", ".note.gnu.build-id",
           ".shstrtab", ".data", ".got"]
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 0x10, 0x20, 0x3f, 0x40, 0x7f, 0x80, 0xff, 0x100, 0x1000, 0x7fff, 0x8000,
               0xffff, 0x10000, 0x7fffffff, 0x80000000, 0xfffffffe, 0xffffffff, 1 << 32, (1 << 63) - 1, 1 << 63,
               (1 << 64) - 1, (1 << 64) - 8]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """name -> (bytes, regions): regions are name -> (file offset, size)."""
    d = tmp_path_factory.mktemp("fuzz_bases")
    out = {}
    for name, (src, lang, flags) in BASES.items():
        s = d / f"{name.replace('.', '_')}.{'cc' if lang == 'c++' else 'c'}"
        s.write_text(src)
        r = subprocess.run(["g++" if lang == "c++" else "gcc", str(s), *flags, "-o", str(d / name)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        data = (d / name).read_bytes()
        regions = {"ehdr": (0, 64), "file": (0, len(data))}
        with open(d / name, "rb") as f:
            e = ELFFile(f)
            regions["phdrs"] = (e["e_phoff"], e["e_phnum"] * e["e_phentsize"])
            regions["shdrs"] = (e["e_shoff"], e["e_shnum"] * e["e_shentsize"])
            for sec in e.iter_sections():
                if sec.name in REGIONS and sec["sh_type"] != "SHT_NOBITS" and sec["sh_size"]:
                    regions[sec.name] = (sec["sh_offset"], sec["sh_size"])
        out[name] = (data, regions)
    return out


@st.composite
def mutation(draw, size_hint):
    kind = draw(st.sampled_from(["value", "value", "value", "bytes", "truncate", "insert"]))
    region = draw(st.sampled_from(["ehdr", "phdrs", "shdrs", "file"] + REGIONS))
    if kind == "truncate":
        return ("truncate", draw(st.integers(0, size_hint)))
    pos = draw(st.integers(0, 1 << 20))
    if kind == "value":
        width = draw(st.sampled_from([1, 2, 4, 8]))
        v = draw(st.one_of(st.sampled_from(INTERESTING), st.integers(0, (1 << 64) - 1),
                           st.integers(-64, 64).map(lambda x: ("delta", x))))
        return ("value", region, pos, width, v)
    return (kind, region, pos, draw(st.binary(min_size=1, max_size=16)))


def mutate(data: bytes, regions: dict, muts) -> bytes:
    b = bytearray(data)
    for m in muts:
        if m[0] == "truncate":
            del b[m[1] % (len(b) + 1):]
            continue
        off, size = regions.get(m[1], regions["file"])
        if size == 0 or not b:
            continue
        kind, pos = m[0], off + m[2] % size
        if kind == "value":
            width, v = m[3], m[4]
            pos -= pos % width if m[1] in ("ehdr", "phdrs", "shdrs", ".dynamic", ".symtab", ".dynsym") else 0
            if pos + width > len(b):
                continue
            if isinstance(v, tuple):
                v = int.from_bytes(b[pos:pos + width], "little") + v[1]
            b[pos:pos + width] = (v % (1 << (8 * width))).to_bytes(width, "little")
        elif kind == "bytes":
            if pos < len(b):
                b[pos:pos + len(m[3])] = m[3]
        else:
            b[pos:pos] = m[3]
    return bytes(b)


# KPREWRITE_FUZZ_COMMANDS=instrument,check: only these commands (a long run aimed at one stage).
COMMANDS = (os.environ.get("KPREWRITE_FUZZ_COMMANDS", "").split(",") if os.environ.get("KPREWRITE_FUZZ_COMMANDS")
            else ["check", "check", "check", "instrument", "instrument", "blacklist", "list"])
CASE = st.tuples(st.sampled_from(sorted(BASES)), st.sampled_from(sorted(SPECS)),
                 st.sampled_from(COMMANDS),
                 st.lists(mutation(1 << 16), min_size=1, max_size=4))


@fuzz_settings(900)
@given(case=CASE)
def test_fuzz_elf(case, bases, tmp_path_factory):
    base, spec_name, cmd, muts = case
    data, regions = bases[base]
    d = tmp_path_factory.mktemp("case", numbered=True)
    elf = d / base
    elf.write_bytes(mutate(data, regions, muts))
    spec = d / "probes.toml"
    spec.write_text(SPECS[spec_name])
    out = d / "out"
    args = {"check": ["check", elf, "--spec", spec],
            "instrument": ["instrument", elf, "--spec", spec, "-o", out],
            "blacklist": ["blacklist", elf], "list": ["list", elf]}[cmd]
    count("elf")
    run_case(args, [elf, spec], d, out)
    for p in d.iterdir():
        p.unlink()
    d.rmdir()

"""Unit tests of `kprewrite diff`'s attribution (rewriter/changes.py) without the
rewrite pipeline: a real gcc program is "rewritten" by hand with the ELF writer
(a jump at one probe's region, an int3 at another's, a return site, a direct call
retargeted, two new segments and a .kprewrite.meta naming them), then diffed.
Every changed byte must be attributed to the probe the metadata says wrote it, and
a byte nothing explains, a changed original section or segment must be reported.
tests/test_diff.py runs the same command on real rewrites.  A second or two."""
from __future__ import annotations

import json
import struct

import capstone
import pytest

from conftest import cc
from rewriter import changes
from rewriter.elf.write import NewSection
from rewriter.elf.image import Image
from rewriter.targets.linux_user import writer as W

ARCHES = ["x86_64"]      # x86-64 only: hand-written x86-64 patches (jmp rel32, int3) read back with x86 Capstone

PROG = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) long leaf(long x) { return x * 3 + 1; }
__attribute__((noinline)) long work(long x) { long s = 0; for (long i = 0; i < x; i++) s += leaf(i) ^ i; return s; }
int main(int argc, char **argv) { printf("%ld\n", work(argc > 1 ? atol(argv[1]) : 10)); return 0; }
"""


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    d = tmp_path_factory.mktemp("changes")
    return cc(d, "prog", PROG, "-O2", "-fPIE", "-pie", "-fcf-protection=none"), d


def _call_to(image, func, target):
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    f = image.function_named(func)
    return next(i.address for i in md.disasm(image.read(f.start, f.end - f.start), f.start)
                if i.mnemonic == "call" and i.op_str == hex(target))


def _ret_of(image, func):
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    f = image.function_named(func)
    return [i.address for i in md.disasm(image.read(f.start, f.end - f.start), f.start) if i.mnemonic == "ret"][-1]


def _rewrite(image, d, name, extra_patches=(), meta_edit=None, out_edit=None):
    """`image` with: work's entry jumped to a detour (region 5 bytes, kretprobe r_work, also
    riding p_work2), leaf's entry an int3 (p_leaf), work's last ret an int3 return hook,
    main's call of work retargeted to the detour; and the metadata saying so."""
    lay = W.plan_layout(image)
    detour = lay.after_phdrs
    rx = bytes(lay.phdr_size) + b"\xcc" * 0x100
    rw_vaddr = W.page_up(lay.rx_vaddr + len(rx))
    work, leaf = image.function_named("work").start, image.function_named("leaf").start
    call = _call_to(image, "main", work)
    ret = _ret_of(image, "work")
    patches = [(work, b"\xe9" + struct.pack("<i", detour - (work + 5))),
               (leaf, b"\xcc"), (ret, b"\xcc"),
               (call + 1, struct.pack("<i", detour - (call + 5))), *extra_patches]
    meta = {"probes": [
        {"symbol": "work", "offset": 0, "region": [work, work + 5], "kind": "r", "name": "r_work",
         "detour": detour, "int3_exits": [ret]},
        {"symbol": "work", "offset": 0, "region": [work, work + 5], "kind": "k", "name": "p_work2",
         "detour": detour, "shared_with": work},
        {"symbol": "leaf", "offset": 0, "region": [leaf, leaf + 5], "kind": "k", "name": "p_leaf",
         "int3": "boost"}],
        "branches": [[call + 1, 4, work]]}
    if meta_edit:
        meta_edit(meta)
    sections = [NewSection(".kprewrite.text", 1, 6, lay.rx_vaddr + lay.phdr_size, rx[lay.phdr_size:]),
                NewSection(".kprewrite.data", 1, 3, rw_vaddr, b"d" * 16),
                NewSection(".kprewrite.meta", 1, 0, 0, json.dumps(meta).encode(), align=1)]
    out = bytearray(W.write_image(image, lay, patches, rx, rw_vaddr, b"d" * 16, 16, sections, None, []))
    if out_edit:
        out_edit(out)
    path = d / name
    path.write_bytes(out)
    return path, dict(work=work, leaf=leaf, call=call, ret=ret, detour=detour)


def _by(doc, what):
    return [c for c in doc["changes"] if c["what"] == what]


def test_every_change_attributed(prog):
    """Each patched range to its probe(s) (a rider named with its head), the int3's one
    byte, the int3 return hook, the retargeted call to the probe at its target, the ELF
    header's fields; the moved PT_PHDR and what was added listed."""
    path, d = prog
    image = Image(str(path))
    out, a = _rewrite(image, d, "ok")
    doc = changes.diff(str(path), str(out))
    assert doc["unattributed"] == [] and doc["problems"] == [], doc
    (k,) = _by(doc, "kretprobe")
    assert (k["address"], k["probes"], k["size"]) == (hex(a["work"]), ["r_work", "p_work2"], 5)
    orig, new = path.read_bytes(), out.read_bytes()
    off = image.offset_of(a["work"])
    assert k["changed"] == sum(orig[i] != new[i] for i in range(off, off + 5))
    (p,) = _by(doc, "kprobe")
    assert (p["address"], p["probes"], p["size"], p["changed"]) == (hex(a["leaf"]), ["p_leaf"], 1, 1)
    assert p["detail"] == "leaf+0x0: int3 (boost)"
    (x,) = _by(doc, "int3_exit")
    assert (x["address"], x["probes"], x["changed"]) == (hex(a["ret"]), ["r_work"], 1)
    (b,) = _by(doc, "branch")
    assert (b["address"], b["probes"]) == (hex(a["call"] + 1), ["r_work", "p_work2"])
    assert b["detail"] == f"direct branch to {a['work']:#x}: enters its detour"
    header = {c["detail"].split(":")[0] for c in _by(doc, "elf_header")}
    assert header == {"e_phoff", "e_phnum", "e_shoff", "e_shnum"}     # e_entry, e_shstrndx kept
    assert doc["moved"] == [{"segment": "PHDR", "from": "0x40", "to": hex(W.plan_layout(image).rx_vaddr)}]
    # (the writer called without unwind tables: a PT_NULL where their segment would be)
    assert [(s["type"], s["flags"]) for s in doc["added_segments"]] == [("LOAD", "R-X"), ("LOAD", "RW-"), ("NULL", "---")]
    assert [s["name"] for s in doc["added_sections"]] == [".kprewrite.text", ".kprewrite.data", ".kprewrite.meta"]
    lines = changes.diff_lines(doc)
    assert any(line.startswith(f"changed  {a['leaf']:#x}      1 bytes  kprobe  leaf+0x0: int3 (boost)  [p_leaf]")
               for line in lines), lines


def test_unexplained_bytes_reported(prog):
    """A byte past an int3 (only its first byte is the probe's), a byte past a region, a
    retargeted call the metadata does not list: each unattributed, with its function."""
    path, d = prog
    image = Image(str(path))
    leaf, work = image.function_named("leaf").start, image.function_named("work").start
    out, a = _rewrite(image, d, "bad", extra_patches=[(leaf + 1, b"\xcc"), (work + 5, b"\xcc")],
                      meta_edit=lambda m: m.pop("branches"))
    doc = changes.diff(str(path), str(out))
    un = {u["symbol"]: u for u in doc["unattributed"]}
    assert set(un) == {"leaf+0x1", "work+0x5", f"main+{a['call'] + 1 - image.function_named('main').start:#x}"}, un
    assert un["leaf+0x1"]["size"] == 1 and un["leaf+0x1"]["offset"] == hex(image.offset_of(leaf + 1))
    errs = changes.diff_errors(doc, "bad")
    assert len(errs) == 3 and all("not attributed to any probe site or known rewrite" in e for e in errs)


def test_changed_original_headers_reported(prog):
    """An original section or segment header changed in the output: a problem each."""
    path, d = prog
    image = Image(str(path))

    def flip(out):
        shoff = struct.unpack_from("<Q", out, 40)[0]
        text = next(i for i, s in enumerate(changes._shdrs(bytes(out))) if s[0] == ".text")
        struct.pack_into("<Q", out, shoff + text * 64 + 8, 7)              # sh_flags
        phoff = struct.unpack_from("<Q", out, 32)[0]
        load = next(i for i, p in enumerate(changes._phdrs(bytes(out))) if p[0] == 1 and p[1] & 1)
        struct.pack_into("<I", out, phoff + load * 56 + 4, 7)              # p_flags RWX
    out, _ = _rewrite(image, d, "hdr", out_edit=flip)
    doc = changes.diff(str(path), str(out))
    details = sorted(p["detail"] for p in doc["problems"])
    assert len(details) == 2
    assert details[0].startswith("LOAD segment at ") and details[0].endswith("of the original is missing or changed")
    assert details[1].startswith("section [") and "] .text of the original is missing or changed" in details[1]


def test_changed_runs_cross_blocks():
    """Runs of changed bytes are found across the 64 KiB comparison blocks, merged."""
    n = 3 * changes.BLOCK
    a = bytes(n)
    b = bytearray(a)
    b[changes.BLOCK - 2:changes.BLOCK + 3] = b"\xff" * 5
    b[7] = 1
    b[n - 1] = 1
    assert changes._changed_runs(a, bytes(b) + b"tail") == [(7, 8), (changes.BLOCK - 2, changes.BLOCK + 3),
                                                              (n - 1, n)]
    assert changes._changed_runs(a, a) == []

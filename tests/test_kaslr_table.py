"""Unit tests of the rewritten kernel's KASLR relocation table
(rewriter/targets/linux_kernel/x86_64/kaslr.py), on a tiny kernel-like ELF (its text
at 0xffffffff81000000 with a gap for new code, a per-CPU segment linked at 0, data)
assembled and linked by the real binutils, with a hand-made original table as
arch/x86/tools/relocs would list it and a hand-made linked blob: entries of patched
bytes dropped, entries of copied instructions moved to the copies, zeroed words
dropped, each blob relocation by relocs.c's rules, the runtime's bias added, and
every refusal.  No kernel, no boot: a second."""
from __future__ import annotations

import subprocess
from array import array
from types import SimpleNamespace

import pytest

from rewriter import link
from rewriter.arch import get_arch
from rewriter.errors import KprewriteError
from rewriter.elf.image import Image
from rewriter.emit.layout import Layout
from rewriter.link.ld import Blob, LinkReloc
from rewriter.planner import Plan, Site, make_breakpoint
from rewriter.targets.linux_kernel.x86_64 import kaslr
from rewriter.targets.linux_kernel.x86_64.bzimage import RelocTable

ARCHES = ["x86_64"]      # x86-64 only: the x86-64 kernel's KASLR relocation table

ARCH = get_arch("x86_64")
TEXT = 0xFFFFFFFF81000000
GAP = TEXT + 0x1000              # free space in the text segment: the new code goes there

ASM = """
.intel_syntax noprefix
.text
.globl f
.type f, @function
f:
  mov rax, offset g
  mov rcx, qword ptr [rip + wordv]
  add rax, 1
  jmp g
.size f, .-f
.globl h
.type h, @function
h:
  mov rdx, offset f
  ret
.size h, .-h
.globl k
.type k, @function
k:
  jmp qword ptr [8*rax + tbl]
.size k, .-k
.globl g
.type g, @function
g:
  mov eax, dword ptr gs:[pcpu_var]
  ret
.size g, .-g
.p2align 12
gap: .space 0x1000
.section .data..percpu,"aw"
.globl pcpu_var
pcpu_var: .space 0x100
.data
wordv: .quad g
wordz: .quad f
tbl: .quad g
"""
LDS = """
PHDRS { text PT_LOAD FLAGS(5); percpu PT_LOAD FLAGS(6); data PT_LOAD FLAGS(6); }
SECTIONS {
  . = 0xffffffff81000000;
  .text : { *(.text) } :text
  . = ALIGN(0x1000);
  __per_cpu_load = .;
  .data..percpu 0 : AT(__per_cpu_load - 0xffffffff80000000) { *(.data..percpu) } :percpu
  . = __per_cpu_load + SIZEOF(.data..percpu);
  . = ALIGN(0x1000);
  .data : { *(.data) } :data
}
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    d = tmp_path_factory.mktemp("kaslr")
    (d / "k.s").write_text(ASM)
    (d / "k.ld").write_text(LDS)
    subprocess.run(["as", "-o", str(d / "k.o"), str(d / "k.s")], check=True)
    subprocess.run(["ld", "-T", str(d / "k.ld"), "-z", "max-page-size=0x1000", "-o", str(d / "k"), str(d / "k.o")],
                   check=True)
    image = Image(str(d / "k"))
    sym = {f.name: f.start for f in image.functions}
    data = next(s for s in image.segments if s.type == 1 and s.vaddr > TEXT + 0x1000).vaddr
    sym.update(wordv=data, wordz=data + 8, tbl=data + 16)
    return image, sym


def _original(sym) -> RelocTable:
    """The table relocs would list: the 64-bit words of .data; the 32-bit immediates of
    `mov $f/$g` and the jump table's displacement (not the %gs offset: per-CPU)."""
    return RelocTable(array("I", [sym[w] & 0xFFFFFFFF for w in ("wordv", "wordz", "tbl")]),
                      array("I"),
                      array("I", [(sym[s] + 3) & 0xFFFFFFFF for s in ("f", "h", "k")]))


def _layout(xol=None):
    """The layout's result (layout.Layout): the gap's start, its end, where slots went."""
    return Layout(GAP, {}, GAP + 0x400, SimpleNamespace(end=GAP + 0x1000), xol=xol or {})


def _blob(relocations=()) -> Blob:
    return Blob(GAP + 0x400, b"", GAP + 0x800, b"", 0, {"kp_rt": GAP + 0x800}, [], list(relocations))


def _table(image, sym, relocations=(), sites=(), patches=(), zeroed=(), rx=b"", xol=None):
    image.container = SimpleNamespace(relocs=_original(sym))
    return kaslr.relocation_table(image, ARCH, _layout(xol), rx, list(patches), _blob(relocations),
                                  Plan(sites=list(sites)), list(zeroed))


def _set(lst) -> set[int]:
    return {kaslr.HIGH | v for v in lst}


def _bias() -> int:
    return GAP + 0x800 + link.asm_offsets(ARCH, "linux_kernel")["RT_BIAS"]


def test_unchanged_image_keeps_its_table(kernel):
    """Nothing rewritten: the original entries, plus the runtime's load bias (64-bit)."""
    image, sym = kernel
    t = _table(image, sym)
    assert _set(t.relocs64) == {sym["wordv"], sym["wordz"], sym["tbl"], _bias()}
    assert _set(t.relocs32) == {sym["f"] + 3, sym["h"] + 3, sym["k"] + 3} and len(t.relocs32neg) == 0
    assert list(t.relocs64) == sorted(t.relocs64) and list(t.relocs32) == sorted(t.relocs32)


def test_patched_dropped_zeroed_dropped(kernel):
    """An entry under bytes the rewrite patched (a jump over `mov $f,%rdx`) is dropped, as
    is a 64-bit word the rewrite zeroed (an __mcount_loc entry)."""
    image, sym = kernel
    t = _table(image, sym, patches=[(sym["h"], b"\xe9\0\0\0\0\xcc\xcc")], zeroed=[sym["wordz"]])
    assert sym["h"] + 3 not in _set(t.relocs32) and sym["f"] + 3 in _set(t.relocs32)
    assert _set(t.relocs64) == {sym["wordv"], sym["tbl"], _bias()}
    # A patch of one byte before the field (a breakpoint) leaves it.
    t = _table(image, sym, patches=[(sym["h"], b"\xcc")])
    assert sym["h"] + 3 in _set(t.relocs32)


def test_copied_instruction_moves_its_entry(kernel):
    """A boosted breakpoint site's copy of `mov $g,%rax` in its slot holds the same absolute
    address: its entry is added at the copy's field (the original's stays: its bytes
    after the int3 are intact)."""
    image, sym = kernel
    site = make_breakpoint(image, ARCH, Site(sym["f"], []))
    assert site.xol.mode == "boost"
    site.index = 0
    slot = GAP + 0x10
    placed = {0: ARCH.kprobe_xol.place_slot(site.xol, 0, False, slot)}
    rx = bytearray(0x400)
    code = ARCH.kprobe_xol.slot_code(site.xol, 0, False, slot, 0)
    rx[0x10:0x10 + len(code)] = code
    t = _table(image, sym, sites=[site], patches=[(sym["f"], b"\xcc")], rx=bytes(rx), xol=placed)
    assert _set(t.relocs32) == {sym["f"] + 3, sym["h"] + 3, sym["k"] + 3, slot + 3}
    # The slot not holding that copy: an internal error, never a wrong table.
    with pytest.raises(KprewriteError, match="out-of-line slot"):
        _table(image, sym, sites=[site], rx=bytes(0x400), xol=placed)


def test_emulated_absolute_operand_refused(kernel):
    """`jmp *tbl(,%rax,8)` is emulated from a descriptor linked at the image's addresses:
    with its displacement relocated by KASLR it cannot be."""
    image, sym = kernel
    site = make_breakpoint(image, ARCH, Site(sym["k"], []))
    assert site.xol.mode == "emulate" and not site.xol.rip
    with pytest.raises(KprewriteError, match="absolute operand that KASLR relocates"):
        _table(image, sym, sites=[site])


def test_blob_relocations_by_relocs_rules(kernel):
    """R_X86_64_64 / 32 / 32S against a kernel or blob address: relocated (64-bit, 32-bit
    lists); against a plain number or a per-CPU symbol: not; a PC-relative reference to a
    per-CPU symbol: the inverse list; to a kernel symbol: nothing (both move)."""
    image, sym = kernel
    at = GAP + 0x400
    rel = [LinkReloc(at, kaslr.R_X86_64_64, sym["g"], True, "g", 0),
           LinkReloc(at + 8, kaslr.R_X86_64_64, 0x1234, True, "NUMBER", 0),
           LinkReloc(at + 16, kaslr.R_X86_64_32S, sym["f"], True, "f", 0),
           LinkReloc(at + 20, kaslr.R_X86_64_32, GAP + 0x900, False, ".data", 0),
           LinkReloc(at + 24, kaslr.R_X86_64_PC32, 0x10, True, "pcpu_var", 0),
           LinkReloc(at + 28, kaslr.R_X86_64_PLT32, sym["g"], True, "g", 0),
           LinkReloc(at + 32, kaslr.R_X86_64_64, 0x10, True, "pcpu_var", 0),
           LinkReloc(at + 40, kaslr.R_X86_64_64, GAP + 0x900, False, ".data", 0)]
    t = _table(image, sym, relocations=rel)
    assert _set(t.relocs64) - _set(_original(sym).relocs64) == {at, at + 40, _bias()}
    assert _set(t.relocs32) - _set(_original(sym).relocs32) == {at + 16, at + 20}
    assert _set(t.relocs32neg) == {at + 24}


@pytest.mark.parametrize("reloc,match", [
    (LinkReloc(GAP + 0x400, kaslr.R_X86_64_PC64, 0x10, True, "pcpu_var", 0), "R_X86_64_PC64 against the per-CPU"),
    (LinkReloc(GAP + 0x400, 9, 0, True, "foo", 0), "relocation type 9 against foo"),
    (LinkReloc(0xFFFFFFFF90000000, kaslr.R_X86_64_64, TEXT, True, "_text", 0), "outside the kernel image"),
])
def test_blob_relocations_refused(kernel, reloc, match):
    image, sym = kernel
    with pytest.raises(KprewriteError, match=match):
        _table(image, sym, relocations=[reloc])


def test_entries_in_the_gap_refused(kernel):
    """An original entry inside the gap the new code fills: that gap is not free space."""
    image, sym = kernel
    image.container = SimpleNamespace(relocs=RelocTable(array("I", [(GAP + 0x20) & 0xFFFFFFFF]), array("I"),
                                                        array("I")))
    with pytest.raises(KprewriteError, match="entries in the text/rodata gap"):
        kaslr.relocation_table(image, ARCH, _layout(), b"", [], _blob(), Plan(), [])


def test_moved_field(kernel):
    """_moved(): a copied instruction keeps its absolute operand's bytes at the same place
    from its end; a re-encoded branch, or a copy that changed the field, is refused."""
    image, sym = kernel
    ins = make_breakpoint(image, ARCH, Site(sym["h"], [])).xol.insn
    assert kaslr._moved("k", ins, GAP, ins.code, sym["h"] + 3, False, 4) == GAP + 3
    with pytest.raises(KprewriteError, match="does not keep its operand bytes"):
        kaslr._moved("k", ins, GAP, ins.code[:3] + b"\0\0\0\0", sym["h"] + 3, False, 4)
    with pytest.raises(KprewriteError, match="is not RIP-relative"):
        kaslr._moved("k", ins, GAP, ins.code, sym["h"] + 3, True, 4)
    jmp = make_breakpoint(image, ARCH, Site(sym["f"] + 18, [])).xol.insn
    assert jmp.info.emulate == "jmp rel"
    with pytest.raises(KprewriteError, match="re-encoded in its detour"):
        kaslr._moved("k", jmp, GAP, jmp.code, jmp.addr + 1, False, 1)

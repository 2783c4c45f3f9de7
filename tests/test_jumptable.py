"""Unit tests of the x86-64 indirect-jump reading (rewriter/arch/x86_64/jumptable.py):
a gcc -O2 switch's table is found in its PIC and absolute forms with exactly the
entries its bound allows, every one an instruction of the function; the bound
rules (cmp/ja N + 1, cmp/jae N, and M + 1) on hand-written tables; an unbounded
index or arithmetic leaves the jump unread.  Real gcc output, no rewrite: seconds."""
from __future__ import annotations

import subprocess

import capstone
import pytest

from conftest import CC, cc
from rewriter.analysis.functions import Analysis
from rewriter.arch import get_arch
from rewriter.arch.x86_64 import jumptable as jt
from rewriter.elf.image import Image

ARCHES = ["x86_64"]      # x86-64 only: x86-64 jump tables (rewriter/arch/x86_64/jumptable.py)

ARCH = get_arch("x86_64")

SWITCH = r"""
#include <stdio.h>
__attribute__((noinline)) int sw(int op, int x) {
    switch (op) {
    case 0: return x + 1;
    case 1: return x * 3;
    case 2: return x - 7;
    case 3: return x ^ 0x55;
    case 4: return x << 2;
    case 5: return x / 3;
    case 6: return -x;
    case 7: return x % 11;
    case 8: return x | 0x100;
    case 9: return x & 0xf0;
    default: return 0;
    }
}
int main(int argc, char **argv) { printf("%d\n", sw(argc, 5)); return 0; }
"""

TABLES = """
.intel_syntax noprefix
.text
.globl _start
_start: ud2
.macro CASES p
\\p\\()0: mov eax, 10
  ret
\\p\\()1: mov eax, 11
  ret
\\p\\()2: mov eax, 12
  ret
\\p\\()3: mov eax, 13
  ret
.endm
.globl ja_bound
.type ja_bound, @function
ja_bound:
  cmp edi, 3
  ja 9f
  mov eax, edi
  jmp qword ptr [8*rax + tab_ja]
9: xor eax, eax
  ret
  CASES a
.size ja_bound, .-ja_bound
.globl jae_bound
.type jae_bound, @function
jae_bound:
  cmp edi, 3
  jae 9f
  mov eax, edi
  jmp qword ptr [8*rax + tab_jae]
9: xor eax, eax
  ret
  CASES b
.size jae_bound, .-jae_bound
.globl and_bound
.type and_bound, @function
and_bound:
  and edi, 3
  jmp qword ptr [8*rdi + tab_and]
  CASES c
.size and_bound, .-and_bound
.globl computed
.type computed, @function
computed:
  lea rax, [rdi + 5]
  imul rax, rdx
  jmp rax
.size computed, .-computed
.section .rodata
tab_ja: .quad a0, a1, a2, a3
tab_jae: .quad b0, b1, b2, b3
tab_and: .quad c0, c1, c2, c3
"""


def _jumps(path, name):
    image = Image(str(path))
    an = Analysis(image, ARCH)
    f = next(f for f in image.functions if f.name == name)
    return image, an, f, jt.resolve(image, an, f)


def _insns(image, f):
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    return list(md.disasm(image.read(f.start, f.end - f.start), f.start))


@pytest.fixture(scope="module")
def progs(tmp_path_factory):
    d = tmp_path_factory.mktemp("jumptable")
    (d / "t.s").write_text(TABLES)
    r = subprocess.run([CC, "-nostdlib", "-static", "-no-pie", "-o", str(d / "tables"), str(d / "t.s")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return {"pie": cc(d, "pie", SWITCH, "-O2", "-fPIE", "-pie", "-fcf-protection=none"),
            "nopie": cc(d, "nopie", SWITCH, "-O2", "-fno-pie", "-no-pie", "-fcf-protection=none"),
            "tables": d / "tables"}


@pytest.mark.parametrize("kind", ["pie", "nopie"])
def test_gcc_switch_table_is_bounded(progs, kind):
    """gcc -O2's switch on 0..9: one jump table (PIC lea/movslq/add or absolute
    jmp *T(,%rax,8)) with cmp $9; ja: exactly 10 entries, each an instruction of
    sw, every case's body among them; the analysis takes them as jump targets."""
    image, an, f, jumps = _jumps(progs[kind], "sw")
    assert len(jumps) == 1, jumps
    j = jumps[0]
    assert j.kind == jt.TABLE, (j.kind, j.why)
    insns = _insns(image, f)
    bound = [i for i in insns if i.mnemonic == "cmp" and i.op_str.endswith(", 9") and i.address < j.addr]
    assert bound, [(i.mnemonic, i.op_str) for i in insns]
    assert len(j.targets) == 10
    starts = {i.address for i in insns}
    assert all(t in starts for t in j.targets), "an entry lands between instructions or outside sw"
    assert len(set(j.targets)) >= 8          # distinct case bodies (gcc may merge a few)
    assert all(t in an.targets for t in j.targets)
    if kind == "nopie":
        jmp = next(i for i in insns if i.address == j.addr)
        assert "8*" in jmp.op_str or "*8" in jmp.op_str, jmp.op_str
    assert an.unbounded_indirect_jump(f) is None


def test_bound_rules(progs):
    """cmp $3; ja: 4 entries; cmp $3; jae: 3 (the 4th is never read); and $3: 4."""
    image = Image(str(progs["tables"]))
    an = Analysis(image, ARCH)
    sym = {f.name: f for f in image.functions}
    for name, n in (("ja_bound", 4), ("jae_bound", 3), ("and_bound", 4)):
        f = sym[name]
        (j,) = jt.resolve(image, an, f)
        assert j.kind == jt.TABLE, (name, j.kind, j.why)
        assert len(j.targets) == n, (name, j.targets)
        # The entries in table order: the `mov eax, 1x` cases, in order.
        movs = [i for i in _insns(image, f) if i.mnemonic == "mov" and i.op_str.startswith("eax, 0x")]
        assert j.targets == [m.address for m in movs][:n], name


def test_unbounded_jumps(progs):
    """Arithmetic on an argument: the target is unknown; the function keeps the
    kernel's refusal."""
    image = Image(str(progs["tables"]))
    an = Analysis(image, ARCH)
    f = next(f for f in image.functions if f.name == "computed")
    (j,) = jt.resolve(image, an, f)
    assert j.kind == jt.UNBOUNDED and j.targets == [] and j.why
    assert an.unbounded_indirect_jump(f) is not None

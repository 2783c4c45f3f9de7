"""ORC entries for a module's new code, in the module's own .orc_unwind_ip/.orc_unwind
(docs/kernel.md, "Stacks through probes in a module").

The kernel's ORC unwinder finds a module address's entry in the module's own tables
(orc_module_find(): __orc_find() over the .orc_unwind_ip/.orc_unwind objtool wrote and
unwind_module_init() sorted at load): the nearest entry at or below the address.  Code
ld -r adds after the module's would get whatever entry precedes it (a section's
terminator: the unwind stops there).  So each piece of our code gets the entries objtool
would have written for it, as assembler lines (ENTRY_MACRO_S, from
runtime/arch/x86_64/linux_module/kp_module_orc.S: one PC32 relocation in .orc_unwind_ip and
six bytes in .orc_unwind per entry, as objtool emits them; ld -r appends them to the module's):

- the runtime and handlers (C, compiled with frame pointers: the kernel recipe's flags):
  one frame-pointer entry at the start of their code (the kernel's orc_fp_entry: CFA =
  %rbp + 16, the caller's %rbp at CFA - 16), a terminator at its end (c_begin_s(), c_end_s());
- each detour, the kretprobe trampoline and each breakpoint slot: an entry at every
  instruction that moves the stack pointer (annotate(): the CFA tracked through pushes,
  pops and %rsp arithmetic); a region's copy takes the probed function's own entry at each
  copied instruction (module_entries()); where a detour calls the dispatch over a full
  struct pt_regs (an optimized probe's, the trampoline's), an ORC_TYPE_REGS entry, so the
  unwinder goes on from regs->ip and regs->sp (the probed function at the hit; the caller a
  kretprobe returned to) as from a trap's pt_regs;
- a terminator at the end of the detours' section, and one byte before the trampoline (a
  return address there is a kretprobe's, whose real one is in its instance: the unwind
  stops, as the kernel's stops at a trampoline it does not know).

The entry's layout is the kernel's (arch/x86/include/asm/orc_types.h): 6.1's type:2 and
end:1 (ORC_TYPE_CALL 0, ORC_TYPE_REGS 1), from 6.4 type:3 and signal:1 (ORC_TYPE_CALL 2,
ORC_TYPE_REGS 3), chosen by the module's vermagic.  A zero entry is a terminator in both.
"""
from __future__ import annotations

import bisect
import re
import struct

from .relocatable import R_X86_64_PC32, SHN_LORESERVE, symbols

ORC_REG_UNDEFINED, ORC_REG_PREV_SP, ORC_REG_BP, ORC_REG_SP = 0, 1, 4, 5
CALL, REGS = "call", "regs"
TYPES = {"6.1": {CALL: 0, REGS: 1}, "6.4": {CALL: 2, REGS: 3}}
UNDEFINED = (0, 0, 0)                   # (sp_offset, bp_offset, the bit fields' 16 bits)

def _parts() -> dict[str, str]:
    from ..parts import module_parts
    return module_parts("arch/x86_64/linux_module/kp_module_orc.S")


# The assembly that does not change (runtime/arch/x86_64/linux_module/kp_module_orc.S): KP_ORC, the
# macro of one entry as objtool emits it, and the line opening C_SECTION.
PARTS = _parts()
ENTRY_MACRO_S = PARTS["entry_macro"]
# The runtime's and handlers' code, renamed by the writer: the section c_code opens.
C_SECTION = re.search(r"\.section\s+([^\s,]+)", PARTS["c_code"]).group(1)


def orc_format(mod) -> str | None:
    """The layout of the module's ORC entries ("6.1", "6.4"), None when it has no ORC tables
    (a kernel built without CONFIG_UNWINDER_ORC) or nothing tells.  Read from the entries
    themselves first: a function's first instruction has the call type with CFA = %rsp + 8,
    whose type bits are 0 in 6.1's layout and 2 from 6.4's (where UNDEFINED and END_OF_STACK
    became types), so a distribution kernel that took objtool's layout into another release
    is read right; else from the release in the module's vermagic."""
    from collections import Counter
    from ..symvers import release
    ip, orc = mod.section_named(".orc_unwind_ip"), mod.section_named(".orc_unwind")
    if ip is None or orc is None:
        return None
    raw = mod.data[orc.offset:orc.offset + orc.size - orc.size % 6]
    votes = Counter((bits >> 8) & 7 for sp_offset, _, bits in struct.iter_unpack("<hhH", raw)
                    if bits & 0xF == ORC_REG_SP and sp_offset == 8)
    if votes:
        typ = votes.most_common(1)[0][0]
        if typ in (TYPES["6.1"][CALL], TYPES["6.4"][CALL]):
            return "6.1" if typ == TYPES["6.1"][CALL] else "6.4"
    m = re.match(r"(\d+)\.(\d+)", release(mod) or "")
    if m is None:
        return None
    return "6.4" if (int(m.group(1)), int(m.group(2))) >= (6, 4) else "6.1"


def entry(fmt: str, sp_reg: int, sp_offset: int, bp_reg: int = ORC_REG_UNDEFINED, bp_offset: int = 0,
          typ: str = CALL) -> tuple[int, int, int]:
    """An entry: (sp_offset, bp_offset, sp_reg | bp_reg << 4 | type << 8)."""
    return sp_offset, bp_offset, sp_reg | bp_reg << 4 | TYPES[fmt][typ] << 8


def fp_entry(fmt: str) -> tuple[int, int, int]:
    """orc_fp_entry: the frame pointer's rule."""
    return entry(fmt, ORC_REG_BP, 16, ORC_REG_PREV_SP, -16)


def adjust(e: tuple[int, int, int], extra: int) -> tuple[int, int, int]:
    """Entry e with `extra` more bytes pushed below the stack pointer it describes: a CFA
    relative to %rsp moves, one relative to %rbp (or none: the end of the stack) does not;
    any other rule cannot follow."""
    sp_offset, bp_offset, bits = e
    if not extra or e == UNDEFINED or bits & 0xF in (ORC_REG_BP, ORC_REG_UNDEFINED):
        return e
    if bits & 0xF != ORC_REG_SP:
        return UNDEFINED
    return sp_offset + extra, bp_offset, bits


def module_entries(mod, relocs: dict) -> dict[str, list[tuple[int, tuple[int, int, int]]]] | None:
    """The module's own entries: section name -> [(offset, entry)] sorted (each .orc_unwind_ip
    slot's R_X86_64_PC32 names the section and offset, as objtool writes them; relocs: the
    .ko's relocations as optprobe.relocations() reads them once for the writer); None when
    .orc_unwind_ip has no relocations to read them by (then the module gets no entries of
    ours either, rather than a terminator for every copied instruction)."""
    data, secs = mod.data, mod.sections
    orc = mod.section_named(".orc_unwind")
    rela = relocs.get(".orc_unwind_ip")
    if not rela:
        return None
    _, syms = symbols(data, secs)
    out: dict[str, list] = {}
    for off, (sym, typ, addend) in rela.items():
        shndx, value = syms[sym][3], syms[sym][4]
        if typ != R_X86_64_PC32 or not 0 < shndx < SHN_LORESERVE or off % 4:
            continue
        k = off // 4
        if 6 * k + 6 > orc.size:
            continue
        e = struct.unpack_from("<hhH", data, orc.offset + 6 * k)
        out.setdefault(secs[shndx].name, []).append((value + addend, e))
    for v in out.values():
        v.sort()
    return out


def entry_at(table: dict, sec: str, off: int) -> tuple[int, int, int]:
    """The entry __orc_find() gives (sec, off): the nearest at or below it in its section."""
    rows = table.get(sec, [])
    i = bisect.bisect_right(rows, (off, (1 << 16, 1 << 16, 1 << 16))) - 1
    return rows[i][1] if i >= 0 else UNDEFINED


class Entries:
    """Assembler lines of entries, each at a label of its own (.Lkp_orc_<n>)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.n = 0

    def at(self, e: tuple[int, int, int], where: str | None = None) -> str:
        """An entry at `where` (an expression), else at a new label here."""
        out = ""
        if where is None:
            where = f".Lkp_orc_{self.n}"
            self.n += 1
            out = f"{where}:\n"
        return out + f"\tKP_ORC {where}, {e[0]}, {e[1]}, {e[2]:#x}\n"

    def copy(self, code: bytes, base: tuple[int, int, int]) -> str:
        """Entries at each instruction of a copy (its bytes decoded), the original's entry
        `base` moved by what the copy pushed before it (a call emulated: the return address
        pushed, then a jump).  Lines to put right before the copy's bytes."""
        from ....arch.x86_64 import cs
        label = f".Lkp_orc_{self.n}"
        self.n += 1
        out, extra = [f"{label}:\n"], 0
        for ci in cs.DETAIL.disasm(code, 0):
            out.append(self.at(adjust(base, extra), f"{label} + {ci.address}" if ci.address else label))
            if ci.mnemonic.startswith("push"):
                extra += 8
            elif ci.mnemonic.startswith("pop"):
                extra -= 8
        return "".join(out)

    def annotate(self, asm: str, of_cfa, start: int = 0, regs_calls: tuple[str, ...] = (), on_call=None) -> str:
        """asm (one of the writer's templates), one statement a line, with an entry at its
        start and after each statement that moves %rsp: of_cfa(offset) for the CFA at %rsp +
        offset (offset from `start`, the CFA's distance at the first instruction).  Before a
        call to one of regs_calls (made over a full struct pt_regs at %rsp): an ORC_TYPE_REGS
        entry, kept until the stack next moves (and on_call() called)."""
        off, out, first = start, [], True
        for line in asm.splitlines():
            code = re.sub(r"/\*.*?\*/", "", line).strip()
            if not code:
                out.append(line)
                continue
            for st in (s.strip() for s in code.split(";")):
                m = re.match(r"^([\w.]+:)\s*(.*)$", st)
                label, insn = (m.group(1), m.group(2)) if m and not st.startswith(".") else (None, st)
                if label:
                    out.append(label)
                if not insn:
                    continue
                if insn.startswith(".") and not insn.startswith((".byte", ".long", ".quad", ".short")):
                    out.append("\t" + insn)         # a directive: its section, its symbol
                    continue
                if first:
                    out.append(self.at(of_cfa(off)).rstrip("\n"))
                    first = False
                call = re.match(r"^call\s+(\w+)", insn)
                if call and call.group(1).startswith(regs_calls) and regs_calls:
                    out.append(self.at(entry(self.fmt, ORC_REG_SP, 0, typ=REGS)).rstrip("\n"))
                    if on_call:
                        on_call()
                out.append("\t" + insn)
                moved = _moves(insn)
                if moved:
                    off += moved
                    out.append(self.at(of_cfa(off)).rstrip("\n"))
        return "\n".join(out) + "\n"


def _moves(insn: str) -> int:
    """How far an instruction moves the stack pointer down (pushes, pops, %rsp arithmetic)."""
    m = insn.split(None, 1)
    op, args = m[0], (m[1] if len(m) > 1 else "").replace(" ", "")
    if op.startswith("push"):
        return 8
    if op.startswith("pop"):
        return -8
    n = re.fullmatch(r"\$(-?(?:0x[0-9a-f]+|\d+)),%rsp", args)
    if op in ("sub", "subq") and n:
        return int(n.group(1), 0)
    if op in ("add", "addq") and n:
        return -int(n.group(1), 0)
    n = re.fullmatch(r"(-?(?:0x[0-9a-f]+|\d+))\(%rsp\),%rsp", args)
    if op in ("lea", "leaq") and n:
        return -int(n.group(1), 0)
    if args.split(",")[-1] == "%rsp" and op not in ("cmp", "test"):
        raise ValueError(f"ORC annotation: {insn!r} moves %rsp in a way not followed")
    return 0


def c_begin_s(fmt: str) -> str:
    """The object linked before the runtime's and handlers' code: the frame-pointer entry at its start."""
    return ENTRY_MACRO_S + PARTS["c_code"] + Entries(fmt).at(fp_entry(fmt))


def c_end_s(fmt: str) -> str:
    """The object linked after it: a terminator at its end."""
    return ENTRY_MACRO_S + PARTS["c_code"] + Entries(fmt).at(UNDEFINED)

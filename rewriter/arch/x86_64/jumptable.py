"""Indirect jumps read, where the kernel refuses: opt.c's can_optimize() gives up
on a whole function when insn_is_indirect_jump() finds one jump through a
register or memory, because a jump table might land in the region and a
run-time patcher cannot afford to find the table.  A static rewriter can: a
bounded backward slice from each indirect jump, over straight-line code only
(no known jump target and no unconditional jump between the slice's start and
the jump), recognises what the compiler emits.

* a jump table: the PIC form `lea T(%rip),%B; movslq (%B,%I,4),%R; add %B,%R;
  jmp *%R` and the absolute form `jmp *T(,%I,8)`, with the index bounded by
  `cmp $N,%I; ja` (N + 1 entries), `jae` (N), `movzbl` (256) or `and $M` (M + 1).
  Its entries, read from the image, are known jump targets; an entry outside the
  code means the slice misread the table, and the jump stays unbounded;
* a jump to a stored code pointer: a 64-bit load, `jmp *m64` (the GOT, a function
  pointer in a struct, CPython's computed-goto table), or a register the function
  was called with.  In a position-independent image every code address stored
  in memory is a relocation's (R_X86_64_RELATIVE or a symbol), and every one the
  code computes is a RIP-relative `lea` (decode.code_refs): those are already
  known jump targets, so such a jump (mostly a tail call) lands on none but them.
  An image linked at a fixed address below 4 GiB stores code addresses with no
  relocation, as 32- or 64-bit constants in its data and code: every 4-byte
  window of its loaded bytes whose value is an instruction boundary is taken
  for one (fixed_code_pointers(), a superset), and then the same argument holds;
* a jump to a RIP-relative `lea`: its one target.

Anything else (the slice reaches a join point, an index reloaded from the stack,
arithmetic) is unbounded, and the kernel's refusal stays."""
from __future__ import annotations

from dataclasses import dataclass, field

import capstone
from capstone import x86_const as X

from . import cs
from ... import safety

_cs = cs.DETAIL
SLICE = 24            # instructions walked back from a jump
FACT_RUN = 8          # instructions _Fn.fact() reads at once
MAX_ENTRIES = 4096

TABLE, POINTER, COMPUTED, UNBOUNDED = "jump table", "stored code pointer", "computed address", "unbounded"


@dataclass
class IndirectJump:
    addr: int
    kind: str                     # TABLE, POINTER, COMPUTED or UNBOUNDED
    targets: list[int] = field(default_factory=list)
    why: str = ""                 # for UNBOUNDED: what the slice could not read
    retry: tuple | None = None    # a PIC table whose base the slice lost: (load index, %index, %base)
    via_pointer: bool = False     # some path reaches it with a stored code pointer (a POINTER reading)


_PARENT: dict[str, str] = {}
for _r in ("ax", "bx", "cx", "dx"):
    for n in (f"r{_r}", f"e{_r}", _r, f"{_r[0]}l", f"{_r[0]}h"):
        _PARENT[n] = f"r{_r}"
for _r in ("si", "di", "bp", "sp"):
    for n in (f"r{_r}", f"e{_r}", _r, f"{_r}l"):
        _PARENT[n] = f"r{_r}"
for _i in range(8, 16):
    for n in (f"r{_i}", f"r{_i}d", f"r{_i}w", f"r{_i}b"):
        _PARENT[n] = f"r{_i}"


_PARENT_OF: dict[int, str | None] = {}       # Capstone's register id -> _PARENT's name


def _reg(ci, r) -> str | None:
    if not r:
        return None
    p = _PARENT_OF.get(r, _reg)
    if p is _reg:
        p = _PARENT_OF[r] = _PARENT.get(ci.reg_name(r))
    return p


# What a call leaves undefined (the System V ABI's caller-saved registers).
_CALL_CLOBBERS = frozenset(["rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11"])


def _info(ci) -> tuple:
    """(its groups, whether it is a call, the _PARENT names of the registers it writes)
    of a decoded instruction, read from Capstone once: the slices and _reg_const ask
    again and again."""
    d = ci.__dict__
    got = d.get("_kp_info")
    if got is None:
        groups = ci.groups
        got = d["_kp_info"] = (groups, capstone.CS_GRP_CALL in groups,
                               frozenset([_reg(ci, r) for r in ci.regs_access()[1]]))
    return got


_UNCOND = ("jmp", "ret", "notrack jmp", "bnd jmp", "repz ret", "bnd ret", "ud2", "hlt")


def _uncond(ci) -> bool:
    return ci.mnemonic.startswith(_UNCOND)


class _Insns:
    """A function's instructions decoded with details, as a list indexed like the
    analysis' boundaries, each decoded when first read: a backward slice reads a
    few dozen of a function's thousands (_reg_const reads them all, in one pass)."""

    def __init__(self, code: bytes, start: int, bounds):
        self.code, self.start, self.bounds = code, start, bounds
        self.got: dict[int, object] = {}
        self.full = None

    def __len__(self):
        return len(self.bounds)

    def __getitem__(self, k: int):
        if self.full is not None:
            return self.full[k]
        if k < 0:
            k += len(self.bounds)
        ci = self.got.get(k)
        if ci is None:
            if not 0 <= k < len(self.bounds):
                raise IndexError(k)
            off = self.bounds[k]
            ci = self.got[k] = next(_cs.disasm(self.code[off:off + 16], self.start + off, 1))
        return ci

    def all(self) -> list:
        if self.full is None:
            self.full = list(_cs.disasm(self.code, self.start))
        return self.full


def _record_offsets() -> tuple | None:
    """cs.LAYOUT and cs.DETAIL_LAYOUT as the flat tuple _Whole._read_records() unpacks
    (it runs for every few instructions a slice walks: _Fn.fact())."""
    if cs.DETAIL_LAYOUT is None:
        return None
    rec, o_size, o_mn, n_mn = cs.LAYOUT[:4]
    size, o = cs.DETAIL_LAYOUT
    return (rec, o_size, o_mn, n_mn, size, o["address"] // 8, o["regs_write"], o["regs_write_count"], o["groups"],
            o["groups_count"], o["op_count"], o["ops"], o["op_size"], o["op_type"], o["op_value"], o["op_opsize"],
            o["op_access"], o["mem_base"], o["mem_index"], o["mem_disp"])


_RECORD = _record_offsets()
# What _read_records() derives of a mnemonic's bytes ((unconditional, lea, the
# mnemonic)) and of a tuple of written register ids (their _PARENT names), for
# every function.
_MNEMS: dict[bytes, tuple] = {}
_WRITTEN: dict[tuple, frozenset] = {}


class _Whole:
    """Every instruction of a function (_reg_const() reads them all, where a
    backward slice reads a few dozen), as the facts _cfg() and _reg_const() read:
    its address, whether it is a call or a jump (Capstone's groups), its first
    operand's immediate (None: not one), whether it is an unconditional jump
    (_uncond()), the registers it writes (_info()), and the value of a RIP-relative
    lea into a 64-bit register (_rip_lea(); None otherwise), and its mnemonic
    (_Fn.fact() reads a few instructions so too).  Read from
    Capstone's raw records (cs.detail_records()) where the binding allows: a
    CsInsn of each costs four times as much (libpython's largest jump-table
    functions, 5,000 instructions each, are read so)."""

    def __init__(self, code: bytes, start: int):
        self.addr, self.call, self.jump, self.imm, self.uncond, self.written, self.lea, self.mnem = \
            ([] for _ in range(8))
        if cs.DETAIL_LAYOUT is None:
            for ci in _cs.disasm(code, start):
                self._add_insn(ci)
        else:
            self._read_records(code, start)

    def __len__(self):
        return len(self.addr)

    def _add_insn(self, ci) -> None:
        groups, call, written = _info(ci)
        ops = ci.operands
        self.addr.append(ci.address)
        self.call.append(call)
        self.jump.append(capstone.CS_GRP_JUMP in groups)
        self.imm.append(ops[0].imm if ops and ops[0].type == X.X86_OP_IMM else None)
        self.uncond.append(_uncond(ci))
        self.written.append(written)
        self.lea.append(_rip_lea(ci) if ops and ops[0].size == 8 else None)
        self.mnem.append(ci.mnemonic)

    def _read_records(self, code: bytes, start: int) -> None:
        n, recs, det = cs.detail_records(code, start)
        (rec, o_size, o_mn, n_mn, size, o_addr, o_w, o_wc, o_g, o_gc, o_opc, o_ops, o_sz, o_type, o_val, o_opsz,
         o_acc, o_base, o_index, o_disp) = _RECORD
        self.addr = addrs = memoryview(recs).cast("Q")[o_addr::rec // 8].tolist()
        sizes = memoryview(recs).cast("H")[o_size // 2::rec // 2]
        h, w, q = memoryview(det).cast("H"), memoryview(det).cast("I"), memoryview(det).cast("q")
        reg_op, imm_op, write, rip = X.X86_OP_REG, X.X86_OP_IMM, capstone.CS_AC_WRITE, X.X86_REG_RIP
        grp_call, grp_jump = capstone.CS_GRP_CALL, capstone.CS_GRP_JUMP
        mnems, parents = _MNEMS, _WRITTEN
        call, jump, imm, uncond, written, lea = self.call, self.jump, self.imm, self.uncond, self.written, self.lea
        mnem = self.mnem
        index = recs.index
        for i in range(n):
            r, b = i * rec, i * size
            mb = recs[r + o_mn:index(0, r + o_mn, r + o_mn + n_mn)]
            got = mnems.get(mb)
            if got is None:
                m = mb.decode("ascii")
                got = mnems[mb] = (m.startswith(_UNCOND), m == "lea", m)
            groups = det[b + o_g:b + o_g + det[b + o_gc]]
            call.append(grp_call in groups)
            jump.append(grp_jump in groups)
            uncond.append(got[0])
            mnem.append(got[2])
            # cs_regs_access()'s writes: the implicit ones, and each register operand written
            regs = tuple(h[(b + o_w) // 2:(b + o_w) // 2 + det[b + o_wc]])
            opc = det[b + o_opc]
            for k in range(opc):
                ob = b + o_ops + k * o_sz
                if w[(ob + o_type) // 4] == reg_op and det[ob + o_acc] & write:
                    regs += (w[(ob + o_val) // 4],)
            names = parents.get(regs)
            if names is None:
                names = parents[regs] = frozenset([_reg(_cs, r) for r in regs])
            written.append(names)
            ob = b + o_ops
            imm.append(q[(ob + o_val) // 8] if opc and w[(ob + o_type) // 4] == imm_op else None)
            v = None
            if got[1] and opc > 1 and det[ob + o_opsz] == 8:
                ob += o_sz
                if w[(ob + o_base) // 4] == rip and not w[(ob + o_index) // 4]:
                    v = addrs[i] + sizes[i] + q[(ob + o_disp) // 8]
            lea.append(v)


class _Fn:
    def __init__(self, image, an, func):
        self.image, self.an, self.func = image, an, func
        bounds = an.decoded(func).boundaries
        self.insns = _Insns(image.read(func.start, func.end - func.start), func.start, bounds)
        self.index = {func.start + b: k for k, b in enumerate(bounds)}
        self.join = None
        self.cfg = None                       # _reg_const's edges that no register changes
        self.writes: dict[str, list] = {}     # register -> whether each instruction writes it
        self.whole = None                     # _reg_const's _Whole of the function
        self.facts: dict[int, tuple] = {}     # index -> (mnemonic, is a call, registers written, unconditional)

    def fact(self, k: int) -> tuple:
        """(mnemonic, whether it is a call, the _PARENT names of the registers it
        writes, whether it is an unconditional jump) of insns[k]: what a backward
        slice asks of most instructions it walks, read with the FACT_RUN
        instructions before k (the way a slice goes) from Capstone's raw records
        (_Whole), not from a CsInsn of each (insns[k]: the one whose operands a
        slice reads)."""
        got = self.facts.get(k)
        if got is not None:
            return got
        whole = self.whole
        if whole is None and cs.DETAIL_LAYOUT is not None:
            ins = self.insns
            lo = max(0, k - FACT_RUN + 1)
            while lo < k and lo in self.facts:
                lo += 1
            off, end = ins.bounds[lo], ins.bounds[k + 1] if k + 1 < len(ins.bounds) else len(ins.code)
            run = _Whole(ins.code[off:end], ins.start + off)
            # The same instructions as insns[] decodes one by one (each is its own bytes),
            # unless Capstone stopped early: then a CsInsn of k.
            if len(run) >= k - lo + 1 and run.addr[k - lo] == ins.start + ins.bounds[k]:
                facts = self.facts
                for i in range(k - lo + 1):
                    facts[lo + i] = (run.mnem[i], run.call[i], run.written[i], run.uncond[i])
                return facts[k]
        elif whole is not None and k < len(whole):
            got = self.facts[k] = (whole.mnem[k], whole.call[k], whole.written[k], whole.uncond[k])
            return got
        ci = self.insns[k]
        _, call, written = _info(ci)
        got = self.facts[k] = (ci.mnemonic, call, written, _uncond(ci))
        return got

    def changes(self, k: int, reg: str) -> bool:
        """insns[k] may change %reg: it writes it, or it is a call and %reg a register
        a call clobbers."""
        _, call, written, _ = self.fact(k)
        return (call and reg in _CALL_CLOBBERS) or reg in written

    def back(self, k: int, first: bool = False):
        """Indices before k on straight-line code (k itself first if `first`): stops
        where another path may join (a known jump target, the instruction after
        an unconditional jump), leaving that index in self.join.  Yields -1 when
        the walk reaches the function's entry."""
        self.join = None
        j = k
        if first:
            yield j
        for _ in range(SLICE):
            if j == 0:
                yield -1
                return
            if self.insns.start + self.insns.bounds[j] in self.an.targets or self.fact(j - 1)[3]:
                self.join = j
                return
            j -= 1
            yield j

    def preds(self, j: int) -> list[tuple[int, bool]] | None:
        """Every instruction that may run just before insns[j], a join point, as
        (index, taken): the direct branches to it (taken) and the fall-through;
        None if something else names it (a symbol, a relocation, a landing pad,
        a branch from another function)."""
        a = self.insns.start + self.insns.bounds[j]
        if a in self.an.entered:
            return None
        srcs = self.an.branch_sources.get(a, [])
        if any(s not in self.index for s in srcs):
            return None
        out = [(self.index[s], True) for s in srcs]
        if j > 0 and not self.fact(j - 1)[3]:
            out.append((j - 1, False))
        return out


def _pointers_known(fn) -> bool:
    """Every code address the image can store is a known jump target: the
    relocations of a position-independent image, or fixed_code_pointers()."""
    return fn.image.is_pic or getattr(fn.an, "fixed_pointers_scanned", False)


# Sections whose bytes are never code addresses (encoded PC-relative, or not loaded
# as data the program reads): a window there would only add false targets.
_NOT_POINTERS = (".eh_frame", ".eh_frame_hdr", ".gcc_except_table", ".note", ".rela", ".gnu.hash",
                 ".dynsym", ".dynstr", ".hash", ".gnu.version", ".interp")


def fixed_code_pointers(image, an):
    """An image linked at a fixed address stores a code address as its value:
    a 64-bit pointer in data (R_X86_64_64 resolved by ld), a 32-bit one, or an
    immediate in code (`mov $label,%eax`, `movq $label,m`, R_X86_64_32S).  With
    the code below 4 GiB each one's low four bytes are a little-endian window
    of the loaded bytes, at any offset (packed structs, immediates at any
    position in an instruction), whose value is an instruction boundary.  Every
    such window is yielded: a superset of the stored code addresses (a window
    that only looks like one adds a jump target, which refuses at most a
    region), so that a jump through a stored pointer lands on none but known
    targets, as in a position-independent image.  Sets an.fixed_pointers_scanned;
    yields nothing (the kernel's rule stays) for code above 4 GiB."""
    import re
    if image.is_pic or not image.exec_ranges:
        return
    lo, hi = image.exec_ranges[0][0], image.exec_ranges[-1][1]
    if hi > 1 << 32:
        return
    # Bytes 2 and 3 of a value in [lo, hi): one alternative per top byte.
    alts = []
    for b3 in range(lo >> 24, ((hi - 1) >> 24) + 1):
        b2lo = (lo >> 16) & 0xFF if b3 == lo >> 24 else 0
        b2hi = ((hi - 1) >> 16) & 0xFF if b3 == (hi - 1) >> 24 else 0xFF
        alts.append(b"[" + re.escape(bytes([b2lo])) + b"-" + re.escape(bytes([b2hi])) + b"]"
                    + re.escape(bytes([b3])))
    pat = re.compile(b"(?=..(?:" + b"|".join(alts) + b"))", re.DOTALL)
    an.fixed_pointers = []
    skip = [(s.offset, s.offset + s.size) for s in image.sections
            if s.name.startswith(_NOT_POINTERS) and s.type != 8]        # SHT_NOBITS holds no bytes
    seen = set()
    for seg in image.segments:
        if seg.type != 1 or not seg.filesz:                     # PT_LOAD
            continue
        blob = image.data[seg.offset:seg.offset + seg.filesz]
        for m in pat.finditer(blob):
            off = seg.offset + m.start()
            if any(a <= off < b for a, b in skip):
                continue
            v = int.from_bytes(blob[m.start():m.start() + 4], "little")
            if v in seen or not image.is_code(v):
                continue
            f = image.function_at(v)
            if f is None or not an.is_boundary(f, v):
                continue
            seen.add(v)
            an.fixed_pointers.append(v)
            yield v, f"code address stored at {seg.vaddr + m.start():#x} (an image without relocations)"
    an.fixed_pointers_scanned = True


def prepare(image, an) -> None:
    """What resolve() reads of the image alone, read once before the analysis'
    workers fork (each would read it again): the PLT slots of the NORETURN functions."""
    an.memo("noreturn slots", 0, lambda: _noreturn_slots(image))


def resolve(image, an, func) -> list[IndirectJump]:
    """Every indirect jump of func, classified (see the module docstring)."""
    d = an.decoded(func)
    if not d.indirect_jumps:
        return []
    fn = _Fn(image, an, func)
    jumps = [_classify(fn, a) for a in d.indirect_jumps]
    if any(j.retry is not None for j in jumps):
        jumps = _retry_hoisted_bases(fn, jumps)
    return jumps


def _classify(fn: _Fn, addr: int) -> IndirectJump:
    k = fn.index.get(addr)
    if k is None:
        return IndirectJump(addr, UNBOUNDED, why="not an instruction boundary")
    ci = fn.insns[k]
    if ci.mnemonic == "ljmp" or not ci.operands:
        return IndirectJump(addr, UNBOUNDED, why="far jump")
    op = ci.operands[0]
    if op.type == X.X86_OP_MEM:
        return _through_memory(fn, k, ci, op)
    if op.type != X.X86_OP_REG:
        return IndirectJump(addr, UNBOUNDED, why="operand")
    return _register(fn, k, addr, _reg(ci, op.reg))


def _through_memory(fn, k, ci, op) -> IndirectJump:
    """jmp *m64 / mov m64,%reg: a stored code pointer, or an absolute jump table."""
    m = op.mem
    jaddr = ci.address
    if m.segment:
        return IndirectJump(jaddr, UNBOUNDED, why="segment-relative pointer")
    if m.index and not m.base and op.size == 8 and m.scale == 8:
        got = _table(fn, k, _reg(ci, m.index), m.disp & 0xFFFFFFFFFFFFFFFF, 8)
        if got is not None:
            return IndirectJump(jaddr, TABLE, got)
    if _pointers_known(fn) and op.size == 8:
        return IndirectJump(jaddr, POINTER)
    if m.base == X.X86_REG_RIP and op.size == 8:
        slot = ci.address + ci.size + m.disp
        sec = fn.image.section_containing(slot)
        if sec is not None and sec.name in (".got", ".got.plt"):
            return IndirectJump(jaddr, POINTER)
    return IndirectJump(jaddr, UNBOUNDED, why="a pointer loaded from memory in an image without relocations")


def _register(fn: _Fn, k: int, addr: int, reg: str | None) -> IndirectJump:
    """jmp *%reg: the definitions of %reg reaching the jump, over every path
    (through join points whose predecessors are all direct branches of the function)."""
    work, seen, found = [(k, reg, False)], set(), []
    while work:
        start, r, first = work.pop()
        if (start, r, first) in seen:
            continue
        seen.add((start, r, first))
        if len(seen) > 32:
            return IndirectJump(addr, UNBOUNDED, why="too many paths to the jump")
        got = _definition(fn, start, r, first, addr)
        if got is None:
            preds = fn.preds(fn.join) if fn.join is not None else None
            if preds is None:
                return IndirectJump(addr, UNBOUNDED, why=f"%{r} comes from a path not followed")
            work.extend((p, r, True) for p, _ in preds)
            continue
        if isinstance(got, tuple):          # a copy on the way: follow the source
            work.append(got)
            continue
        if isinstance(got, list):           # a conditional move: follow both
            work.extend(got)
            continue
        if got.kind == UNBOUNDED:
            return got
        found.append(got)
    kinds = {j.kind for j in found}
    kind = TABLE if TABLE in kinds else COMPUTED if COMPUTED in kinds else POINTER
    return IndirectJump(addr, kind, sorted({t for j in found for t in j.targets}),
                        via_pointer=POINTER in kinds or any(j.via_pointer for j in found))


def _definition(fn: _Fn, start: int, reg: str, first: bool, addr: int):
    """The definition of %reg seen walking back from start: an IndirectJump, a
    (index, register, True) to follow a copy from, or None at a join point."""
    for j in fn.back(start, first):
        if j < 0:
            # A value the function was called with: a code pointer someone stored or computed.
            if _pointers_known(fn):
                return IndirectJump(addr, POINTER)
            return IndirectJump(addr, UNBOUNDED, why=f"%{reg} comes from the caller")
        if not fn.changes(j, reg):
            continue
        ci = fn.insns[j]
        m, ops = ci.mnemonic, ci.operands
        if _info(ci)[1]:
            # A function's return value: a code pointer it loaded or computed.
            if _pointers_known(fn) and reg == "rax":
                return IndirectJump(addr, POINTER)
            return IndirectJump(addr, UNBOUNDED, why=f"%{reg} set by the call at {ci.address:#x}")
        if m.startswith("cmov") and len(ops) == 2 and ops[0].type == X.X86_OP_REG \
                and ops[1].type == X.X86_OP_REG and ops[0].size == 8 and j > 0:
            # Either value: the source's, or the register's own from before.
            return [(j - 1, _reg(ci, ops[1].reg), True), (j - 1, reg, True)] \
                if fn.insns[j].address not in fn.an.targets else \
                IndirectJump(addr, UNBOUNDED, why=f"%{reg} set by `{m}` at a join point")
        if m == "mov" and len(ops) == 2 and ops[0].type == X.X86_OP_REG and ops[0].size == 8:
            if ops[1].type == X.X86_OP_REG:
                if j == 0:
                    return IndirectJump(addr, POINTER) if _pointers_known(fn) else \
                        IndirectJump(addr, UNBOUNDED, why=f"%{reg} comes from the caller")
                return (j - 1, _reg(ci, ops[1].reg), True) if fn.insns[j].address not in fn.an.targets \
                    else _follow_copy(fn, j, _reg(ci, ops[1].reg), addr)
            if ops[1].type == X.X86_OP_MEM:
                r = _through_memory(fn, j, ci, ops[1])
                r.addr = addr
                return r
            if ops[1].type == X.X86_OP_IMM:
                return _computed(fn, addr, ops[1].imm & 0xFFFFFFFFFFFFFFFF)
        if m == "mov" and len(ops) == 2 and ops[0].type == X.X86_OP_REG and ops[0].size == 4 \
                and ops[1].type == X.X86_OP_IMM:
            # `mov $label,%r32` (zero-extended): a fixed-address image's code address.
            return _computed(fn, addr, ops[1].imm & 0xFFFFFFFF)
        if m == "lea" and ops[1].mem.base == X.X86_REG_RIP and not ops[1].mem.index:
            return _computed(fn, addr, ci.address + ci.size + ops[1].mem.disp)
        if m == "add" and len(ops) == 2 and ops[0].type == X.X86_OP_REG and ops[1].type == X.X86_OP_REG \
                and ops[0].size == 8:
            return _pic_table(fn, j, addr, reg, _reg(ci, ops[1].reg))
        return IndirectJump(addr, UNBOUNDED, why=f"%{reg} computed by `{m} {ci.op_str}` at {ci.address:#x}")
    return None


def _follow_copy(fn: _Fn, j: int, src: str, addr: int):
    """A copy that is itself at a join point: the source's value before it, on every path."""
    preds = fn.preds(j)
    if preds is None:
        return IndirectJump(addr, UNBOUNDED, why=f"%{src} comes from a path not followed")
    if len(preds) != 1:
        return IndirectJump(addr, UNBOUNDED, why=f"%{src} comes from several paths")
    return (preds[0][0], src, True)


def _computed(fn: _Fn, addr: int, target: int) -> IndirectJump:
    if not fn.image.is_code(target):
        return IndirectJump(addr, UNBOUNDED, why=f"computed target {target:#x} is not code")
    return IndirectJump(addr, COMPUTED, [target])


def _pic_table(fn: _Fn, k_add: int, addr: int, reg: str, base: str) -> IndirectJump:
    """add %B,%R after movslq (%B,%I,4),%R, with %B = lea T(%rip)."""
    load = None
    for j in fn.back(k_add):
        if j < 0:
            break
        if fn.changes(j, base) and load is None:
            break              # the base changes between the load and the add
        if fn.changes(j, reg):
            ci = fn.insns[j]
            ops = ci.operands
            if ci.mnemonic == "movsxd" and ops[1].type == X.X86_OP_MEM and ops[1].size == 4:
                mm = ops[1].mem
                if _reg(ci, mm.base) == base and mm.index and mm.scale == 4 and mm.disp == 0 and not mm.segment:
                    load = (j, _reg(ci, mm.index))
            break
    if load is None:
        return IndirectJump(addr, UNBOUNDED, why=f"the sum into %{reg} is not a jump table's")
    k_load, index = load
    table = _lea_value(fn, k_load, base)
    if table is None:
        return IndirectJump(addr, UNBOUNDED, why=f"the jump table's base %{base} is not a RIP-relative lea",
                            retry=(k_load, index, base))
    got = _table(fn, k_load, index, table, 4, relative=True)
    if got is None:
        return IndirectJump(addr, UNBOUNDED, why=f"the index %{index} of the jump table at {table:#x} is not bounded")
    return IndirectJump(addr, TABLE, got)


def _lea_value(fn: _Fn, k: int, base: str) -> int | None:
    """The value of %base at instruction k: the RIP-relative lea that defines it
    on every path (join points followed back to their direct branches: a table
    base the compiler hoisted out of a loop), else None."""
    work, seen, values = [(k, False)], set(), set()
    while work:
        item = work.pop()
        if item in seen:
            continue
        seen.add(item)
        if len(seen) > 32:
            return None
        for j in fn.back(*item):
            if j < 0:
                return None
            if fn.changes(j, base):
                v = _rip_lea(fn.insns[j])
                if v is None:
                    return None
                values.add(v)
                break
        else:
            if fn.join is None:
                return None
            preds = fn.preds(fn.join)
            if preds is None:
                return None
            work.extend((p, True) for p, _ in preds)
    return values.pop() if len(values) == 1 else None


_ANY = "any"


def _reg_const(fn: _Fn, reg: str, jumps: list, hypotheses: dict) -> list:
    """The value of %reg before each instruction, forward over the whole
    function: a RIP-relative lea's value where every path from the entry sets
    it with that one lea, else _ANY (None: unreached).  For a table base the
    compiler keeps in a callee-saved register across a loop whose join points
    a backward walk cannot enumerate.  Edges: the fall-through, direct
    branches, and each indirect jump's targets as `jumps` (resolve()'s first
    pass) read them: a table's entries, for a stored code pointer every stored
    or computed code address of the function, for an unbounded jump every join
    point.  hypotheses: jumps being read (by address), with the edges assumed
    for them.  The entry and landing pads start unknown."""
    if fn.whole is None:
        fn.whole = _Whole(fn.insns.code, fn.insns.start)
    ins = fn.whole
    n = len(ins)
    writes = fn.writes.get(reg)
    if writes is None:
        clobbered = reg in _CALL_CLOBBERS
        writes = fn.writes[reg] = [(call and clobbered) or reg in w for call, w in zip(ins.call, ins.written)]
    if fn.cfg is None:
        fn.cfg = _cfg(fn, ins)
    base, joins, stored, pads, indirect = fn.cfg
    succ = list(base)
    by_addr = {j.addr: j for j in jumps}
    for i in indirect:
        j = by_addr.get(ins.addr[i])
        if ins.addr[i] in hypotheses:
            succ[i] = base[i] + [fn.index[t] for t in hypotheses[ins.addr[i]] if t in fn.index]
        elif j is not None and j.kind in (TABLE, COMPUTED):
            succ[i] = base[i] + [fn.index[t] for t in j.targets if t in fn.index]
        elif j is not None and j.kind == POINTER:
            succ[i] = base[i] + sorted(stored)
        else:
            succ[i] = base[i] + sorted(joins | stored)

    def meet(a, b):
        return b if a is None else a if b is None or a == b else _ANY

    state: list = [None] * n
    state[0] = _ANY
    for i in pads:
        state[i] = _ANY
    work = [0] + pads
    while work:
        i = work.pop()
        v = state[i]
        if writes[i]:
            v = ins.lea[i]
            v = _ANY if v is None else v
        for t in succ[i]:
            m = meet(state[t], v)
            if m != state[t]:
                state[t] = m
                work.append(t)
    return state


def _cfg(fn: _Fn, ins: _Whole) -> tuple:
    """_reg_const's edges but the indirect jumps': (successors of each instruction,
    join points, stored-address entries, landing pads, the indirect jumps)."""
    n = len(ins)
    succ: list[list[int]] = [[] for _ in range(n)]
    joins, stored, pads, indirect = set(), set(), [], []
    entered, targets, index = fn.an.entered, fn.an.targets, fn.index
    for i, (addr, call, jump, imm, uncond) in enumerate(zip(ins.addr, ins.call, ins.jump, ins.imm, ins.uncond)):
        if jump and imm is not None:
            t = index.get(imm)
            if t is not None:
                succ[i].append(t)
                joins.add(t)
        elif jump:
            indirect.append(i)
        if i + 1 < n:
            if uncond or (call and imm is not None and _noreturn_call(fn, imm)):
                joins.add(i + 1)
            else:
                succ[i].append(i + 1)
        if addr in entered and i:
            if targets.get(addr, "").startswith("C++ landing pad"):
                pads.append(i)
            else:
                stored.add(i)
    return succ, joins, stored, pads, indirect


# C library functions that never return to their caller (the C standard's and
# glibc's contracts): code after a call to one is reached only by a jump.
NORETURN = frozenset(["abort", "exit", "_exit", "_Exit", "quick_exit", "__stack_chk_fail", "__chk_fail",
                      "__fortify_fail", "__assert_fail", "__assert_perror_fail", "pthread_exit", "longjmp",
                      "siglongjmp", "_longjmp", "__longjmp_chk", "__cxa_throw", "__cxa_rethrow",
                      "_Unwind_Resume", "__cxa_bad_cast", "__cxa_throw_bad_array_new_length"])
_PLT = (".plt", ".plt.sec", ".plt.got")


def _noreturn_call(fn: _Fn, target: int) -> bool:
    """A direct call to `target` calls a NORETURN function: its symbol, or a PLT
    stub whose `jmp *slot(%rip)` goes through a slot relocated against one."""
    return fn.an.memo("noreturn", target, lambda: _noreturn_at(fn.image, fn.an, target))


def _noreturn_at(image, an, target: int) -> bool:
    if any(target in image.symbols.get(name, ()) for name in NORETURN):
        return True
    sec = image.section_containing(target)
    if sec is None or sec.name not in _PLT:
        return False
    slots = an.memo("noreturn slots", 0, lambda: _noreturn_slots(image))
    for ci in _cs.disasm(image.read(target, 16), target, 2):
        if ci.mnemonic.endswith("jmp") and ci.operands and ci.operands[0].type == X.X86_OP_MEM \
                and ci.operands[0].mem.base == X.X86_REG_RIP:
            return ci.address + ci.size + ci.operands[0].mem.disp in slots
    return False


def _noreturn_slots(image) -> set[int]:
    """The addresses relocated against a NORETURN function: read without LIEF where the
    image's dynamic tables allow (image.symbol_relocations())."""
    return {addr for addr, _, name in image.symbol_relocations() if name in NORETURN}


def _retry_hoisted_bases(fn: _Fn, jumps: list) -> list:
    """PIC jump tables whose base register was set before a loop (_reg_const):
    the base's value at each table load gives the table and its entries, which
    become the jump's edges; repeated until the readings no longer change (a
    reading can only lose values as edges are added, so the last one holds on
    every path).  A jump whose base or index stays unknown keeps its refusal,
    with edges to every join point."""
    pending = {j.addr: j for j in jumps if j.retry is not None}
    mine: dict[int, list[int]] = {a: [] for a in pending}
    for _ in range(8):
        edges = {a: t for a, t in mine.items() if a in pending}
        read: dict[int, list[int]] = {}
        for a, j in list(pending.items()):
            k_load, index, base = j.retry
            table = _reg_const(fn, base, jumps, edges)[k_load]
            got = _table(fn, k_load, index, table, 4, relative=True) if isinstance(table, int) else None
            if got is None:
                del pending[a]            # stays unbounded: edges everywhere from now on
                break
            read[a] = got
        else:
            if read == mine:
                return [IndirectJump(j.addr, TABLE, read[j.addr]) if j.addr in read else j for j in jumps]
            mine = read
    return jumps


def _rip_lea(ci) -> int | None:
    if ci.mnemonic == "lea" and ci.operands[1].mem.base == X.X86_REG_RIP and not ci.operands[1].mem.index:
        return ci.address + ci.size + ci.operands[1].mem.disp
    return None


def _bound(fn: _Fn, k: int, index: str) -> int | None:
    """How many values the index register can hold at instruction k, on every
    path to it (join points followed back to their direct branches): a `cmp $N`
    followed by `ja` (N + 1) or `jae` (N), a zero extension from a byte (256),
    an `and $M` (M + 1).  None if some path does not bound it."""
    # A 64-bit index compared in 32 bits: the compiler wrote it with a 32-bit
    # operation, which zero-extends (the code it emits relies on that too).
    work, seen, worst = [(k, False, False, index, 4, None)], set(), 0
    while work:
        item = work.pop()
        if item in seen:
            continue
        seen.add(item)
        if len(seen) > 32:
            return None
        got = _bound_path(fn, *item)
        if got is None:
            if safety.enabled("jump_table_bounds"):
                return None
            continue
        if isinstance(got, list):
            work.extend(got)
            continue
        worst = max(worst, got)
    return worst


def _bound_path(fn: _Fn, start: int, first: bool, taken: bool, index: str, width: int, limit: int | None):
    """One straight-line stretch of _bound(): a bound, None, or the states to go on
    from.  `taken`: the stretch ends with a conditional jump taken toward the table,
    so a `cmp` just before it bounds the index by `jbe`/`jb` instead."""
    def lim(n):
        return n if limit is None else min(n, limit)

    def flags_reader(j):
        k2 = j + 1            # the jcc reading the cmp's flags (movs and leas may sit between)
        while fn.fact(k2)[0] in ("mov", "lea", "movzx", "movsx", "movsxd", "movabs") and k2 < start:
            k2 += 1
        nxt = fn.fact(k2)[0]
        if taken and k2 == start:
            nxt = {"jbe": "ja", "jb": "jae"}.get(nxt, "")
        return nxt
    # `cmp $N,%sil; ja` bounds the low byte only: it bounds the index once the
    # rest is known zero (a zero extension from a byte, a wider bound <= 256).
    narrow = None
    for j in fn.back(start, first):
        if j < 0:
            return limit
        if not isinstance(index, tuple) and fn.fact(j)[0] != "cmp" and not fn.changes(j, index):
            continue          # (what the checks below conclude, without a CsInsn)
        ci = fn.insns[j]
        ops = ci.operands
        if isinstance(index, tuple):
            # The index was loaded from memory: a cmp of the same memory, with no
            # store and no change of its address registers in between.
            if ci.mnemonic == "cmp" and len(ops) == 2 and ops[0].type == X.X86_OP_MEM \
                    and _memkey(ci, ops[0]) == index and ops[1].type == X.X86_OP_IMM and ops[0].size >= width:
                pass
            elif _stores(ci) or any(r and fn.changes(j, r) for r in index[1:3]):
                return limit
            else:
                continue
        if ci.mnemonic == "cmp" and len(ops) == 2 and (
                (ops[0].type == X.X86_OP_REG and _reg(ci, ops[0].reg) == index)
                or (ops[0].type == X.X86_OP_MEM and _memkey(ci, ops[0]) == index)) \
                and ops[1].type == X.X86_OP_IMM and ops[0].size >= width:
            nxt = flags_reader(j)
            if nxt not in ("ja", "jae"):
                continue          # a cmp for another branch (je...): the index is unchanged
            b = ops[1].imm + 1 if nxt == "ja" else ops[1].imm
            if narrow is not None and 0 <= b <= 256:
                b = min(b, narrow)
            return lim(b)
        if ci.mnemonic == "cmp" and len(ops) == 2 and ops[0].type == X.X86_OP_REG and ops[0].size == 1 \
                and not isinstance(index, tuple) and _reg(ci, ops[0].reg) == index \
                and ci.reg_name(ops[0].reg) not in ("ah", "bh", "ch", "dh") \
                and ops[1].type == X.X86_OP_IMM and 0 <= ops[1].imm < 255:
            nxt = flags_reader(j)
            if nxt in ("ja", "jae"):
                b = ops[1].imm + 1 if nxt == "ja" else ops[1].imm
                narrow = b if narrow is None else min(narrow, b)
            continue
        if not fn.changes(j, index):
            continue
        m = ci.mnemonic
        if m == "mov" and ops[0].type == X.X86_OP_REG and ops[1].type == X.X86_OP_REG \
                and ops[0].size == ops[1].size >= 4:
            index, width = _reg(ci, ops[1].reg), min(width, ops[0].size)
            continue
        if m == "movzx" and ops[1].size in (1, 2):
            limit = lim(1 << (8 * ops[1].size))
            if narrow is not None and ops[1].size == 1:
                return lim(narrow)
            if ops[1].type != X.X86_OP_REG:
                return limit
            index, width = _reg(ci, ops[1].reg), ops[1].size
            continue
        if m == "and" and ops[1].type == X.X86_OP_IMM and 0 <= ops[1].imm < MAX_ENTRIES and ops[0].size >= 4:
            return lim(ops[1].imm + 1)
        if m == "mov" and ops[0].type == X.X86_OP_REG and ops[0].size == 4 and ops[1].type == X.X86_OP_MEM \
                and not ops[1].mem.segment:
            index, width = _lea_folded(fn, j, _memkey(ci, ops[1])), 4
            continue
        return limit
    if fn.join is None:
        return limit
    preds = fn.preds(fn.join)
    if preds is None:
        return limit
    return [(p, True, tk, index, width, limit) for p, tk in preds]


def _memkey(ci, op) -> tuple:
    """A memory operand as (kind, base, index, scale, disp, size); RIP-relative made absolute."""
    m = op.mem
    if m.base == X.X86_REG_RIP:
        return ("mem", None, _reg(ci, m.index), m.scale, ci.address + ci.size + m.disp, op.size)
    return ("mem", _reg(ci, m.base), _reg(ci, m.index), m.scale, m.disp, op.size)


def _lea_folded(fn: _Fn, k: int, key: tuple) -> tuple:
    """A memory operand at instruction k whose index register was set by
    `lea d(%r),%index` on the way, written with %r and the displacement folded
    in (the `cmpl $N,16(%rdx,%rax,4)` ... `lea 4(%rax),%rsi; mov (%rdx,%rsi,4)`
    of an array element checked, then loaded), so the cmp of the same element is
    recognised."""
    kind, base, idx, scale, disp, size = key
    if idx is None:
        return key
    passed = []
    for j in fn.back(k):
        if j < 0:
            break
        if fn.changes(j, idx):
            ci = fn.insns[j]
            ops = ci.operands
            if ci.mnemonic == "lea" and ops[0].size == 8 and not ops[1].mem.index and not ops[1].mem.segment \
                    and ops[1].mem.base not in (0, X.X86_REG_RIP):
                r = _reg(ci, ops[1].mem.base)
                if r != idx and not any(fn.changes(p, r) for p in passed):
                    return (kind, base, r, scale, disp + ops[1].mem.disp * scale, size)
            break
        passed.append(j)
    return key


def _stores(ci) -> bool:
    """May the instruction write memory?"""
    if ci.mnemonic in ("movsx", "movsxd", "movzx") and ci.operands[0].type == X.X86_OP_REG:
        return False                   # (Capstone marks movsxd's source operand written)
    if _info(ci)[1] or ci.mnemonic.startswith(("push", "stos", "movs", "rep", "lock")):
        return True
    return any(op.type == X.X86_OP_MEM and op.access & capstone.CS_AC_WRITE for op in ci.operands)


def _table(fn: _Fn, k: int, index: str | None, table: int, size: int, relative: bool = False) -> list[int] | None:
    """The entries of the table at `table` indexed by %index at instruction k,
    each a code address; None if the index is not bounded or an entry is not code."""
    if index is None:
        return None
    n = _bound(fn, k, index)
    if n is None or not 0 < n <= MAX_ENTRIES:
        return None
    sec = fn.image.section_containing(table)
    if sec is None or table + n * size > sec.addr + sec.size or sec.type == 8:    # SHT_NOBITS
        return None
    raw = fn.image.read(table, n * size)
    out = []
    for i in range(n):
        v = int.from_bytes(raw[i * size:(i + 1) * size], "little", signed=relative)
        t = table + v if relative else v
        if not fn.image.is_code(t):
            return None
        out.append(t)
    return out

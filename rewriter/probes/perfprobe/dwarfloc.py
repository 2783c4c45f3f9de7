"""Where a variable is at an address: its DWARF location expression evaluated there
(tools/perf/util/probe-finder.c's convert_variable_location(), with dwarf-aux.c's
helpers): a register, the frame base or a register plus an offset, a static address, a
constant, a location list's entry covering the address, the pieces of a composite
location.  The frame base DW_OP_call_frame_cfa is the CFA rule of .eh_frame at the
address (rewriter/elf/ehframe/cfa.py), or in a kernel of its debug file's .debug_frame.
"""
from __future__ import annotations

from dataclasses import dataclass

from elftools.dwarf.dwarf_expr import DWARFExprParser
from elftools.dwarf.locationlists import (
    BaseAddressEntry,
    LocationEntry,
    LocationExpr,
    LocationParser,
)

from .. import fetch as F
from .debugframe import DebugFrame
from .dwarfaux import _attr


class Unavailable(Exception):
    """A variable has no location that a fetch arg can read at the address (the reason)."""


@dataclass
class Loc:
    """Where a value is at an address: `reg` (a fetch register name), `mem` (at the
    address `base` + `off`, base the fetch.Value of an address, None for a static
    address), `imm` (a constant), or `pieces` (DW_OP_piece, DW_OP_bit_piece: the value's
    bits in several places, `pieces` [(bit offset, bit size, Loc or the reason that part is
    not available)]: a small struct passed in two registers).  A `reg` may hold only
    `width` bits of the value, from bit `shift` (a member of a struct in a register;
    width 0: the whole register)."""
    kind: str
    reg: str | None = None
    base: F.Value | None = None
    off: int = 0
    imm: int = 0
    pieces: list | None = None
    shift: int = 0
    width: int = 0
    bitfield: bool = False        # a `reg` part read as its bits (bW@S/64) whatever its offset

    def fetch(self) -> F.Value:
        """The fetch arg that reads the value itself (for a part of a register, the
        whole register: the part is read with a bN@S/64 type)."""
        if self.kind == "pieces":
            raise Unavailable("split into pieces (DW_OP_piece)")
        if self.kind == "reg":
            return F.reg(self.reg)
        if self.kind == "imm":
            return F.imm(self.imm)
        if self.base is None:
            return F.addr(self.off)
        return F.deref(self.off, self.base)

    def value(self) -> str:
        """fetch() as a kprobe_events line writes it."""
        return self.fetch().text()


def cu_base(dwarf, cu) -> int:
    """A unit's base address (its DW_AT_low_pc)."""
    top = cu.get_top_DIE()
    a = top.attributes.get("DW_AT_low_pc")
    return addr_value(dwarf, cu, a) if a is not None else 0


def addr_value(dwarf, cu, a) -> int:
    """An address attribute's value (DW_FORM_addrx: from .debug_addr)."""
    if a.form in ("DW_FORM_addrx", "DW_FORM_addrx1", "DW_FORM_addrx2", "DW_FORM_addrx3",
                  "DW_FORM_addrx4", "DW_FORM_GNU_addr_index"):
        return dwarf.get_addr(cu, a.value)
    return a.value


class Locations:
    """The location expressions of one debug file, evaluated at addresses.  regs: the
    DWARF register numbers fetch args read; reg_names: others, named in errors."""

    def __init__(self, dwarf, data: bytes, regs: dict[int, str], reg_names: dict[int, str],
                 image_has_eh_frame: bool):
        self.dwarf, self._data, self.regs, self.reg_names = dwarf, data, regs, reg_names
        self.image_has_eh_frame = image_has_eh_frame
        self.loc = LocationParser(dwarf.location_lists())
        self.expr = DWARFExprParser(dwarf.structs)
        self._cfa = None

    def cfa(self, addr: int):
        """The CFA rule at addr: .eh_frame's, or a kernel's .debug_frame."""
        if self._cfa is None:
            if self.image_has_eh_frame or self.dwarf.debug_frame_sec is None:
                from ...elf.ehframe.cfa import CfaRules
                self._cfa = CfaRules(self._data)
            else:                      # a kernel: no .eh_frame, the debug file's .debug_frame
                self._cfa = DebugFrame(self.dwarf)
        return self._cfa.at(addr)

    def location(self, var_die, inst, addr: int) -> Loc:
        """Where the variable is at addr; Unavailable if nowhere a fetch arg can read."""
        at = var_die.attributes
        if "DW_AT_const_value" in at:
            v = at["DW_AT_const_value"].value
            if isinstance(v, int):
                return Loc("imm", imm=v)
            raise Unavailable("a constant that is not an integer")
        a = at.get("DW_AT_location")
        if a is None:
            raise Unavailable("optimized out")
        expr = self._expr_at(a, var_die, addr)
        if expr is None:
            raise Unavailable("optimized out")
        return self._eval(expr, inst, addr, var_die.cu)

    def _expr_at(self, a, die, addr):
        try:
            parsed = self.loc.parse_from_attribute(a, die.cu["version"], die)
        except ValueError:
            return None
        if isinstance(parsed, LocationExpr):
            return parsed.loc_expr
        base = cu_base(self.dwarf, die.cu)
        for e in parsed:
            if isinstance(e, BaseAddressEntry):
                base = e.base_address
            elif isinstance(e, LocationEntry):
                lo, hi = (e.begin_offset, e.end_offset) if e.is_absolute else \
                    (base + e.begin_offset, base + e.end_offset)
                if lo <= addr < hi:
                    return e.loc_expr
        return None

    def _reg(self, n: int) -> str:
        r = self.regs.get(n)
        if r is None:
            name = self.reg_names.get(n)
            if name is not None:     # perf 6.1: "Mapping for the register number 17 missing"
                raise Unavailable(f"in %{name} (DWARF register {n}), a floating-point or vector register, "
                                  f"which fetch args cannot read")
            raise Unavailable(f"in DWARF register {n}, which fetch args cannot read")
        return r

    def _frame_base(self, inst, addr: int) -> tuple[str, int]:
        fb = _attr(inst.frame, "DW_AT_frame_base") if inst is not None else None
        if fb is None:
            raise Unavailable("relative to a frame base the function does not have")
        expr = self._expr_at(fb, inst.frame, addr)
        if expr is None:
            raise Unavailable("its frame base is not known at this address")
        ops = self.expr.parse_expr(expr)
        if len(ops) == 1 and ops[0].op_name == "DW_OP_call_frame_cfa":
            rule = self.cfa(addr)
            if rule is None:
                raise Unavailable("the CFA is not known at this address (no .eh_frame rule)")
            return self._reg(rule[0]), rule[1]
        if len(ops) == 1 and ops[0].op_name.startswith("DW_OP_breg"):
            return self._reg(_regno(ops[0])), ops[0].args[-1]
        raise Unavailable(f"its frame base is {_show(ops)}")

    def _eval(self, expr, inst, addr, cu) -> Loc:
        """convert_variable_location(): one DWARF expression to a Loc; a composite
        location (DW_OP_piece) to a `pieces` Loc of each piece's, whose members
        compile.py reads one by one (perf 6.1 refuses these: "Structure on a register
        is not supported yet")."""
        ops = self.expr.parse_expr(expr)
        names = [o.op_name for o in ops]
        if "DW_OP_piece" not in names and "DW_OP_bit_piece" not in names:
            return self._eval_ops(ops, inst, addr, cu)
        pieces, cur, bit = [], [], 0
        for o in ops:
            if o.op_name not in ("DW_OP_piece", "DW_OP_bit_piece"):
                cur.append(o)
                continue
            # DW_OP_piece N: N bytes; DW_OP_bit_piece N, O: N bits, from bit O of the location
            nbits, at = (8 * o.args[0], 0) if o.op_name == "DW_OP_piece" else (o.args[0], o.args[1])
            if not cur:
                part = "optimized out"          # an empty piece: that part has no location
            else:
                try:
                    part = _bits_of(self._eval_ops(cur, inst, addr, cu), at, nbits)
                except Unavailable as e:
                    part = str(e)
            pieces.append((bit, nbits, part))
            bit, cur = bit + nbits, []
        if cur:
            raise Unavailable(f"computed ({_show(ops)}), which fetch args cannot express")
        return Loc("pieces", pieces=pieces)

    def _eval_ops(self, ops, inst, addr, cu) -> Loc:
        """One simple location (no pieces) to a Loc."""
        names = [o.op_name for o in ops]
        if any("entry_value" in n for n in names):
            raise Unavailable("optimized out: only its value at the function's entry is known (DW_OP_entry_value)")
        if any("implicit_pointer" in n for n in names):
            raise Unavailable("optimized out: an implicit pointer")
        if any("tls_address" in n for n in names):
            raise Unavailable("thread-local")
        stack = names[-1] == "DW_OP_stack_value"
        core = ops[:-1] if stack else ops
        if len(core) != 1:
            raise Unavailable(f"computed ({_show(ops)}), which fetch args cannot express")
        op = core[0]
        n = op.op_name
        if stack:
            if n.startswith("DW_OP_lit"):
                return Loc("imm", imm=int(n[9:]))
            if n.startswith("DW_OP_const"):
                return Loc("imm", imm=op.args[0])
            if n.startswith("DW_OP_breg") and op.args[-1] == 0:
                return Loc("reg", reg=self._reg(_regno(op)))
            raise Unavailable(f"computed ({_show(ops)}), which fetch args cannot express")
        if n.startswith("DW_OP_reg"):
            return Loc("reg", reg=self._reg(_regno(op)))
        if n.startswith("DW_OP_breg"):
            return Loc("mem", base=F.reg(self._reg(_regno(op))), off=op.args[-1])
        if n == "DW_OP_fbreg":
            reg, k = self._frame_base(inst, addr)
            return Loc("mem", base=F.reg(reg), off=k + op.args[0])
        if n == "DW_OP_addr":
            return Loc("mem", base=None, off=op.args[0])
        if n in ("DW_OP_addrx", "DW_OP_GNU_addr_index"):
            return Loc("mem", base=None, off=self.dwarf.get_addr(cu, op.args[0]))
        raise Unavailable(f"at {_show(ops)}, which fetch args cannot express")


def _bits_of(loc: Loc, at: int, nbits: int) -> Loc:
    """The nbits bits from bit `at` of a simple location: DW_OP_bit_piece's offset (a
    register's bits from the least significant, memory's from its first byte)."""
    if at == 0 and nbits % 8 == 0:
        return loc
    if loc.kind == "reg":
        return Loc("reg", reg=loc.reg, shift=loc.shift + at, width=nbits, bitfield=nbits % 8 != 0)
    if loc.kind == "imm":
        return Loc("imm", imm=(loc.imm >> at) & ((1 << nbits) - 1))
    if loc.kind == "mem":
        return Loc("mem", base=loc.base, off=loc.off + at // 8, shift=at % 8, width=nbits, bitfield=True)
    raise Unavailable(f"bits {at}..{at + nbits - 1} of a location fetch args cannot split")


def _regno(op) -> int:
    n = op.op_name
    if n in ("DW_OP_regx", "DW_OP_bregx"):
        return op.args[0]
    return int(n[9:] if n.startswith("DW_OP_reg") else n[10:])


def _show(ops) -> str:
    return "; ".join(o.op_name + (" " + " ".join(str(a) for a in o.args) if o.args else "") for o in ops)

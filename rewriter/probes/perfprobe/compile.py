"""From a parsed perf probe definition to probe records: where (addresses, from the
debug information) and what (each variable's location at that address, as a fetch
arg with a type).

Mirrors tools/perf/util/probe-finder.c: find_probe_point_by_func() /
find_probe_point_by_line() for the addresses, and convert_variable() /
convert_variable_fields() / convert_variable_type() for the arguments.  The result
is what events.parse_line() makes of a `p`/`r` line, as data (Compiled: the event,
the probe point, each argument's fetch.Fetch), so the trace events, handlers and
reports are the ones kprobe_events lines get; Compiled.line is that line, for the
user to read (`check`).
"""
from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass

from .. import fetch as F
from . import dwarf as D
from .syntax import Arg, Point, ProbeDef

MAX_ARGSTR_LEN = 63          # fetch.MAX_ARGSTR_LEN: what the kernel accepts for one argument


class ProbeError(Exception):
    """One line: what could not be compiled, and where."""


@dataclass
class Site:
    addr: int
    inst: D.Instance


@dataclass
class Compiled:
    """One probe of a definition: what a kprobe_events line holds, as data."""
    is_return: bool
    group: str
    event: str
    symbol: str | None              # the probe point: SYMBOL+offset, or addr
    offset: int
    addr: int | None
    args: list[tuple[str, F.Fetch | str]]      # NAME and its body (a raw fetch arg: as written)

    @property
    def where(self) -> str:
        if self.symbol is None:
            return f"{self.addr:#x}"
        return f"{self.symbol}+{self.offset:#x}" if self.offset else self.symbol

    def words(self) -> list[tuple[str, int]]:
        """Its words as the equivalent kprobe_events line writes them, with their columns:
        the head, the probe point, then NAME=BODY each."""
        out, col = [], 0
        for w in [f"{'r' if self.is_return else 'p'}:{self.group}/{self.event}", self.where,
                  *(f"{n}={b if isinstance(b, str) else b.text}" for n, b in self.args)]:
            out.append((w, col))
            col += len(w) + 1
        return out

    @property
    def line(self) -> str:
        """The equivalent kprobe_events line (what `check` shows)."""
        return " ".join(w for w, _ in self.words())


def _file_match(path: str | None, want: str) -> bool:
    """strtailcmp(): SRC names the file by a tail of its path."""
    if path is None:
        return False
    want = os.path.normpath(want)
    return path == want or path.endswith("/" + want.lstrip("/")) or os.path.basename(path) == want


def _function_at(image, addr: int):
    """(name, start, unique) of the function symbol at addr: the image's, or for an
    image whose symbols are read later (a kernel's kallsyms) its debug file's."""
    dbg = getattr(image, "_kp_debug_info", None)
    if isinstance(dbg, D.DebugInfo) and dbg.by_address:
        return dbg.symbol_at(addr)
    f = image.function_at(addr)
    if f is None:
        return None
    return f.name, f.start, len(set(image.symbols.get(f.name, []))) == 1


def where(image, addr: int) -> str:
    f = _function_at(image, addr)
    return f"{f[0]}+{addr - f[1]:#x}" if f is not None else f"{addr:#x}"


def sites(dbg: D.DebugInfo, image, p: Point, reads_vars: bool = True) -> list[Site]:
    """The addresses a probe point names (several for a line with several blocks
    or a function inlined in several places), in address order.  reads_vars: the
    probe reads variables, so a function probe in unoptimized code goes after the
    prologue (as perf does; without variables perf probes the entry itself)."""
    out: dict[int, D.Instance] = {}
    if p.function is not None:
        insts = dbg.instances(p.function, p.file)
        if p.file is not None:
            insts = [i for i in insts if _file_match(i.decl_file, p.file)]
        if not insts:
            at = f" in {p.file}" if p.file else ""
            raise ProbeError(f"function '{p.function}'{at} not found in the debug information of {image.label}")
        if p.retprobe or p.offset:
            outs = [i for i in insts if not i.inlined]
            if not outs:
                raise ProbeError(f"'{p.function}' is only inlined: it has no entry for "
                                 f"{'%return' if p.retprobe else '+OFFS'}")
            insts = outs
        for inst in insts:
            if p.retprobe:
                out[inst.entry] = inst
            elif p.offset:
                a = inst.entry + p.offset
                if not inst.contains(a):
                    raise ProbeError(f"offset {p.offset:#x} is outside '{p.function}' "
                                     f"({inst.ranges[0][1] - inst.ranges[0][0]:#x} bytes)")
                out[a] = inst
            elif p.lazy is not None:
                for r in dbg.lines(inst.cu):
                    if r.file == inst.decl_file and inst.contains(r.addr) and _lazy_match(dbg, r, p.lazy):
                        out.setdefault(r.addr, inst)
            elif p.line:
                want = inst.decl_line + p.line
                for r in dbg.lines(inst.cu):
                    if r.line == want and r.file == inst.decl_file and inst.contains(r.addr):
                        out.setdefault(r.addr, inst)
            else:
                out[_after_prologue(dbg, inst) if reads_vars else inst.entry] = inst
        if not out and p.lazy is not None:
            raise ProbeError(f"no line of '{p.function}' with code matches ';{p.lazy}'")
        if not out:
            raise ProbeError(f"line {p.line} of '{p.function}' (line {insts[0].decl_line + p.line} of "
                             f"{os.path.basename(insts[0].decl_file or '?')}) has no code")
    else:
        try:
            rows = list(dbg.line_rows(p.file))
        except D.NoDebugInfo as e:
            raise ProbeError(str(e)) from None
        for cu, r in rows:
            if not _file_match(r.file, p.file):
                continue
            if (r.line == p.line) if p.lazy is None else _lazy_match(dbg, r, p.lazy):
                inst = dbg.innermost(r.addr)
                if inst is not None:
                    out.setdefault(r.addr, inst)
        if not out and p.lazy is not None:
            raise ProbeError(f"no line of '{p.file}' with code matches ';{p.lazy}' in {image.label}")
        if not out:
            raise ProbeError(f"line {p.line} of '{p.file}' has no code in {image.label}")
    return [Site(a, out[a]) for a in sorted(out)]


def _lazy_match(dbg: D.DebugInfo, row: D.LineRow, pattern: str) -> bool:
    """strlazymatch(): the source line against a glob, blanks ignored in both."""
    text = dbg.source_line(row.file, row.line)
    if text is None:
        if dbg.source_line(row.file, 1) is None:
            raise ProbeError(f"';{pattern}' is matched against the source, and {row.file} cannot be read")
        return False
    strip = str.maketrans("", "", " \t")
    return fnmatch.fnmatchcase(text.translate(strip), pattern.translate(strip))


def _after_prologue(dbg: D.DebugInfo, inst: D.Instance) -> int:
    """A function's probe address: its entry, or in code compiled without
    optimization the end of its prologue (the line table's second row in the
    function, which is where the body starts even when it is on the same line),
    where the parameters are in their stack slots, as perf and gdb choose."""
    if inst.inlined or inst.optimized:
        return inst.entry
    rows = sorted((r for r in dbg.statement_rows(inst.cu) if inst.contains(r.addr)), key=lambda r: r.addr)
    if not rows or rows[0].addr != inst.entry:
        return inst.entry
    return next((r.addr for r in rows[1:] if r.addr > inst.entry), inst.entry)


# --- arguments ---------------------------------------------------------------------------------------

_SCALAR_TYPES = {1: "8", 2: "16", 4: "32", 8: "64"}
_AGGREGATES = ("DW_TAG_structure_type", "DW_TAG_union_type", "DW_TAG_class_type")


def _char_like(t) -> bool:
    t = D.strip(t)
    return t is not None and t.tag == "DW_TAG_base_type" and D.byte_size(t) == 1 and \
        D.encoding(t) in ("DW_ATE_signed_char", "DW_ATE_unsigned_char", "DW_ATE_signed", "DW_ATE_unsigned",
                          "DW_ATE_UTF")


def _default_type(t, label: str) -> str:
    """convert_variable_type(): the fetch type of a scalar's DWARF type: signed
    integers as sN, others (unsigned, pointers, enums, bool) as xN."""
    s = D.strip(t)
    if s is None:
        raise ProbeError(f"{label} has no type (void)")
    if s.tag in ("DW_TAG_pointer_type", "DW_TAG_reference_type", "DW_TAG_rvalue_reference_type"):
        return "x64"
    if s.tag in ("DW_TAG_base_type", "DW_TAG_enumeration_type"):
        enc = D.encoding(s)
        size = D.byte_size(s)
        if enc == "DW_ATE_float" and size in (4, 8):
            # fetch args have no floating-point type: its IEEE 754 bits, as perf reads it
            # (convert_variable_type(): not signed, so xN); one in an xmm register is refused
            # where its location is read (dwarf.py)
            return f"x{8 * size}"
        if enc == "DW_ATE_float" or enc == "DW_ATE_complex_float":
            raise ProbeError(f"{label} is a {size}-byte {'complex ' if 'complex' in enc else ''}floating-point "
                             f"value, wider than a fetch arg (perf reads its first 8 bytes)")
        if size not in _SCALAR_TYPES:
            raise ProbeError(f"{label} is {size} bytes, wider than a fetch arg")
        sign = "s" if enc in ("DW_ATE_signed", "DW_ATE_signed_char") else "x"
        if enc == "DW_ATE_boolean":
            sign = "u"
        return sign + _SCALAR_TYPES[size]
    kind = {"DW_TAG_structure_type": "a struct", "DW_TAG_union_type": "a union", "DW_TAG_class_type": "a class",
            "DW_TAG_array_type": "an array"}.get(s.tag, s.tag[7:])
    raise ProbeError(f"{label} is {kind} ({D.type_name(t)}): name a member (->, ., [N]) or cast it")


def _part(loc: D.Loc, off: int, size: int, what: str, label: str) -> D.Loc:
    """The `size` bytes at byte `off` of a value that is not in memory as a whole: one
    piece of a composite location (DW_OP_piece), or a part of a register (read with a
    bN@S/64 type) or of a constant."""
    return _part_bits(loc, 8 * off, 8 * size, what, label)


def _piece_kind(loc: D.Loc) -> str:
    return "DW_OP_bit_piece" if any(b % 8 or n % 8 for b, n, _ in loc.pieces) else "DW_OP_piece"


def _part_bits(loc: D.Loc, bit: int, nbits: int, what: str, label: str, bitfield: bool = False) -> D.Loc:
    """The `nbits` bits from bit `bit` of a value not in memory as a whole (_part()); a
    bitfield's bits (bitfield): a register's are read as bW@S/64, memory's from the byte
    that holds its first bit (the caller's container)."""
    if loc.kind == "pieces":
        for pbit, pbits, p in loc.pieces:
            if pbit <= bit and bit + nbits <= pbit + pbits:
                if isinstance(p, str):
                    raise ProbeError(f"{label}: {what} is not available here ({p}: its piece of the "
                                     f"variable's location, {_piece_kind(loc)})")
                if (bit, nbits) == (pbit, pbits) and p.kind == "mem" and not bitfield and not p.bitfield:
                    return p
                return _part_bits(p, bit - pbit, nbits, what, label, bitfield)
        sizes = ", ".join(str(n // 8) if _piece_kind(loc) == "DW_OP_piece" else f"{n}b" for _, n, _ in loc.pieces)
        raise ProbeError(f"{label}: {what} is not within one piece of the variable's location "
                         f"({_piece_kind(loc)} {sizes})")
    if loc.kind == "mem":
        b = loc.shift + bit
        if (b % 8 or nbits % 8) and not (bitfield or loc.bitfield):
            raise ProbeError(f"{label}: {what} is not whole bytes of memory")
        if not (bitfield or loc.bitfield):
            return D.Loc("mem", base=loc.base, off=loc.off + b // 8)
        return D.Loc("mem", base=loc.base, off=loc.off + b // 8, shift=b % 8, width=nbits, bitfield=True)
    if loc.kind == "imm":
        return D.Loc("imm", imm=(loc.imm >> bit) & ((1 << nbits) - 1))
    width = loc.width or 64
    if bit + nbits > width:
        raise ProbeError(f"{label}: {what} is past the end of the register %{loc.reg} that holds it")
    return D.Loc("reg", reg=loc.reg, shift=loc.shift + bit, width=nbits, bitfield=bitfield or loc.bitfield)


def _fields(loc: D.Loc, t, arg: Arg, label: str) -> tuple[D.Loc, object, object]:
    """convert_variable_fields(): walk ->, . and [N]; (location, type, member DIE of the last field)."""
    last_member = None
    shown = arg.var
    for f in arg.fields:
        s = D.strip(t)
        if loc.kind == "pieces" and s is not None and s.tag == "DW_TAG_pointer_type":
            loc = _part(loc, 0, D.byte_size(s), shown, label)     # a pointer in pieces: its one piece
        if f.index is not None:
            shown += f"[{f.index}]"
            if s is not None and s.tag == "DW_TAG_array_type":
                elem = D.target(s)
                size = D.byte_size(elem)
                n = D.array_count(s)
                if n is not None and f.index >= n:
                    raise ProbeError(f"{label}: index {f.index} is past the end of {shown[:shown.rfind('[')]} "
                                     f"({D.type_name(t)})")
                if size is None:
                    raise ProbeError(f"{label}: {shown[:shown.rfind('[')]} has elements of unknown size")
                loc, t = _part(loc, f.index * size, size, shown, label), elem
            elif s is not None and s.tag == "DW_TAG_pointer_type":
                elem = D.target(s)
                size = D.byte_size(elem)
                if size is None:
                    raise ProbeError(f"{label}: {shown} points to a type of unknown size")
                loc, t = D.Loc("mem", base=loc.fetch(), off=f.index * size), elem
            else:
                raise ProbeError(f"{label}: {shown[:shown.rfind('[')]} is not an array or a pointer")
            last_member = None
            continue
        sep = "->" if f.ref else "."
        if f.ref:
            if s is None or s.tag != "DW_TAG_pointer_type":
                raise ProbeError(f"{label}: {shown} is not a pointer; use '.{f.name}'")
            rec = D.strip(D.target(s))
            if rec is None or rec.tag not in _AGGREGATES:
                raise ProbeError(f"{label}: {shown} does not point to a struct or union")
            base, off = loc.fetch(), 0
        else:
            if s is not None and s.tag == "DW_TAG_pointer_type":
                raise ProbeError(f"{label}: {shown} is a pointer; use '->{f.name}'")
            rec = s
            if rec is None or rec.tag not in _AGGREGATES:
                raise ProbeError(f"{label}: {shown} is not a struct or union")
            base, off = loc.base, loc.off
        found = D.member(rec, f.name)
        if found is None:
            raise ProbeError(f"{label}: {D.type_name(rec)} has no member '{f.name}'")
        m, moff = found
        shown += sep + f.name
        mt = D._origin_type(m)
        if not f.ref and loc.kind != "mem":
            # a struct in registers (DW_OP_piece, DW_OP_bit_piece, or a small one in one register)
            if "DW_AT_bit_size" in m.attributes:
                bit, width = _member_bits(m, mt)
                loc, t, last_member = _part_bits(loc, bit, width, shown, label, bitfield=True), mt, None
                continue
            size = D.byte_size(mt)
            if size is None:
                raise ProbeError(f"{label}: {shown} has a type of unknown size")
            loc, t, last_member = _part(loc, moff, size, shown, label), mt, m
            continue
        loc, t, last_member = D.Loc("mem", base=base, off=off + moff), mt, m
    return loc, t, last_member


def _member_bits(m, t) -> tuple[int, int]:
    """(bit offset from the struct's start, width) of a bitfield member."""
    width = m.attributes["DW_AT_bit_size"].value
    if "DW_AT_data_bit_offset" in m.attributes:
        return m.attributes["DW_AT_data_bit_offset"].value, width
    csize = D.byte_size(t) or 4          # DWARF 2/3: from the container's most significant bit
    bo = m.attributes["DW_AT_bit_offset"].value if "DW_AT_bit_offset" in m.attributes else csize * 8 - width
    return D._member_offset(m) * 8 + csize * 8 - bo - width, width


def _show_part(p: D.Loc) -> str:
    if p.kind == "reg" and (p.shift or p.bitfield):
        return f"bits {p.shift}..{p.shift + p.width - 1} of %{p.reg}"
    if p.kind == "mem" and p.bitfield:
        return f"bits {p.shift}..{p.shift + p.width - 1} at {D.Loc('mem', base=p.base, off=p.off).value()}"
    return p.value()


def _bitfield(m, t, loc: D.Loc) -> tuple[D.Loc, str] | None:
    """A bitfield member as the container it is read from and a bN@O/C type."""
    if m is None or "DW_AT_bit_size" not in m.attributes:
        return None
    width = m.attributes["DW_AT_bit_size"].value
    csize = D.byte_size(t) or 4
    if "DW_AT_data_bit_offset" in m.attributes:       # DWARF 4/5: bits from the struct's start
        bit = m.attributes["DW_AT_data_bit_offset"].value
    elif "DW_AT_bit_offset" in m.attributes:          # DWARF 2/3: from the container's most significant bit
        moff = D._member_offset(m)
        bit = moff * 8 + csize * 8 - m.attributes["DW_AT_bit_offset"].value - width
        loc = D.Loc("mem", base=loc.base, off=loc.off - moff)
    else:
        return None
    start = (bit // (csize * 8)) * csize
    shift = bit - start * 8
    if shift + width > csize * 8:
        raise ProbeError(f"a bitfield of {width} bits at bit {bit} straddles its {csize}-byte container")
    return D.Loc("mem", base=loc.base, off=loc.off + start), f"b{width}@{shift}/{csize * 8}"


def _arg_name(arg: Arg) -> str:
    """perf's argument names: the last member's name (parse_perf_probe_arg()), else the
    variable and its type (convert_variable(): 'filename:string' is filename_string)."""
    if arg.name:
        return arg.name
    if arg.var == "$retval":
        return "retval"
    base = next((f.name for f in reversed(arg.fields) if f.name), None)
    if base is not None:
        return base
    base = arg.var
    if arg.type is not None:
        base += "_" + re.sub(r"[^A-Za-z0-9_]", "_", arg.type)
    return base


def _string(loc: D.Loc, t, label: str, user: bool) -> F.Fetch:
    s = D.strip(t)
    kind = "ustring" if user else "string"
    if s is not None and s.tag == "DW_TAG_pointer_type" and (D.target(s) is None or _char_like(D.target(s))):
        return F.Fetch(F.deref(0, loc.fetch()), kind)
    if s is not None and s.tag == "DW_TAG_array_type" and _char_like(D.target(s)):
        if loc.kind != "mem":
            raise ProbeError(f"{label} is not in memory here")
        return F.Fetch(loc.fetch(), kind)
    raise ProbeError(f"{label} is {D.type_name(t)}, not a char pointer or array: it cannot be read as a string")


def compile_var(dbg: D.DebugInfo, image, site: Site, arg: Arg, var: D.Var | None, gvar=None) -> F.Fetch:
    """One argument's FETCHARG:TYPE."""
    at = where(image, site.addr)
    die = var.die if var is not None else gvar
    label = f"'{arg.var}'"
    try:
        loc = dbg.location(die, site.inst, site.addr)
    except D.Unavailable as e:
        raise ProbeError(f"{label} is not available at {at} ({e})") from None
    t = D._origin_type(die)
    flabel = f"'{arg.text.split(':')[0]}' at {at}"
    loc, t, m = _fields(loc, t, arg, flabel)
    if loc.kind == "pieces":
        size = D.byte_size(t)
        s = D.strip(t)
        if size is None or s is None or s.tag in _AGGREGATES or s.tag == "DW_TAG_array_type":
            kind = _piece_kind(loc)
            k = 8 if kind == "DW_OP_piece" else 1
            where_ = ", ".join(f"{o // k}..{(o + n) // k - 1}: " + (p if isinstance(p, str) else _show_part(p))
                               for o, n, p in loc.pieces)
            raise ProbeError(f"{flabel} is {D.type_name(t)}, split into pieces ({kind}; "
                             f"{'bytes' if k == 8 else 'bits'} {where_}): name a member (.F, [N])")
        loc = _part(loc, 0, size, f"'{arg.var}'", flabel)
    if loc.kind == "mem" and loc.bitfield:
        # a bitfield of a struct whose piece is in memory: the bytes that hold it
        csize = next((c for c in (1, 2, 4, 8) if loc.shift + loc.width <= 8 * c), None)
        if csize is None:
            raise ProbeError(f"{flabel} is {loc.width} bits from bit {loc.shift} of memory: wider than a fetch arg")
        if arg.type is not None:
            raise ProbeError(f"{flabel} is a bitfield: it takes its own bN@O/C type, not ':{arg.type}'")
        return F.Fetch(D.Loc("mem", base=loc.base, off=loc.off).fetch(), f"b{loc.width}@{loc.shift}/{8 * csize}")
    if loc.kind == "reg" and (loc.shift or loc.bitfield):
        # a member in the upper bits of a register, or a bitfield: those bits, unsigned
        # (fetch args have no signed bitfield)
        if arg.type is not None and not re.fullmatch(r"b\d+@\d+/\d+", arg.type):
            raise ProbeError(f"{flabel} is in bits {loc.shift}..{loc.shift + loc.width - 1} of %{loc.reg}: "
                             f"it can be read only as those bits (b{loc.width}@{loc.shift}/64), not as "
                             f"'{arg.type}'")
        _default_type(t, flabel) if arg.type is None else None    # a float or a struct: refused as elsewhere
        body = F.Fetch(F.reg(loc.reg), arg.type or f"b{loc.width}@{loc.shift}/64")
        if len(body.text) > MAX_ARGSTR_LEN:
            raise ProbeError(f"{flabel}: the fetch arg '{body.text}' is longer than {MAX_ARGSTR_LEN} characters")
        return body
    body = None
    if arg.type in ("string", "ustring"):
        body = _string(loc, t, flabel, arg.type == "ustring")
    elif arg.type is not None:
        body = F.Fetch(loc.fetch(), arg.type)
    else:
        bf = _bitfield(m, t, loc)
        if bf is not None:
            body = F.Fetch(bf[0].fetch(), bf[1])
        else:
            s = D.strip(t)
            if s is not None and s.tag == "DW_TAG_array_type" and _char_like(D.target(s)):
                body = _string(loc, t, flabel, False)
            else:
                body = F.Fetch(loc.fetch(), _default_type(t, flabel))
    if len(body.text) > MAX_ARGSTR_LEN:
        raise ProbeError(f"{flabel}: the fetch arg '{body.text}' is longer than {MAX_ARGSTR_LEN} characters")
    return body


def _scalar(t) -> bool:
    s = D.strip(t)
    if s is None:
        return False
    if s.tag in ("DW_TAG_pointer_type",):
        return True
    if s.tag in ("DW_TAG_base_type", "DW_TAG_enumeration_type"):
        return D.encoding(s) != "DW_ATE_complex_float" and D.byte_size(s) in _SCALAR_TYPES and \
            (D.encoding(s) != "DW_ATE_float" or D.byte_size(s) in (4, 8))
    return False


def compile_args(dbg: D.DebugInfo, image, site: Site, d: ProbeDef) -> list[tuple[str, F.Fetch | str]]:
    """Every argument of one site: (NAME, its fetch.Fetch, or a raw fetch arg as written)."""
    out: list[tuple[str, F.Fetch | str]] = []
    used: set[str] = set()

    def add(name: str, body: F.Fetch | str):
        n, i = name, 1
        while n in used:
            n, i = f"{name}_{i}", i + 1
        used.add(n)
        out.append((n, body))

    scope = None
    for arg in d.args:
        if arg.raw:
            add(arg.name or f"arg{len(out) + 1}", arg.var)
            continue
        if arg.var == "$retval":
            ftype = arg.type
            rt = D._origin_type(site.inst.die)
            if D.encoding(rt) in ("DW_ATE_float", "DW_ATE_complex_float"):
                # $retval is the integer return register: for a double it is not the value
                # (perf 6.1 reads it anyway)
                raise ProbeError(f"'$retval' at {site.inst.name}%return: the return value is floating-point "
                                 f"({D.type_name(rt)}), returned in a floating-point register, which fetch args "
                                 f"cannot read")
            if ftype is None:
                ftype = _default_type(rt, f"the return value of '{site.inst.name}'") if _scalar(rt) else "x64"
            body = F.Fetch(F.deref(0, F.RETVAL) if ftype in ("string", "ustring") else F.RETVAL, ftype)
            add(_arg_name(arg), body)
            continue
        if scope is None:
            scope = dbg.scope(site.inst, site.addr)
        if arg.var in ("$vars", "$params"):
            for v in scope:
                if arg.var == "$params" and not v.param:
                    continue
                if not _scalar(v.type):
                    continue
                try:
                    body = compile_var(dbg, image, site, Arg(v.name, arg.column, None, v.name), v)
                except ProbeError:
                    continue          # perf's $vars: what is not available here is left out
                add(v.name, body)
            continue
        var = next((v for v in scope if v.name == arg.var), None)
        gvar = dbg.global_var(arg.var) if var is None else None
        if var is None and gvar is None:
            raise ProbeError(f"no variable '{arg.var}' at {where(image, site.addr)} "
                             f"(in '{site.inst.name}': {', '.join(v.name for v in scope) or 'none'})")
        add(_arg_name(arg), compile_var(dbg, image, site, arg, var, gvar))
    return out


# --- event names and lines ----------------------------------------------------------------------------

def _sanitize(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", s)


def default_group(image) -> str:
    """perf's group for a probe in an executable: probe_<file name>."""
    return _sanitize("probe_" + os.path.basename(image.path))[:64]


def default_event(d: ProbeDef, inst: D.Instance) -> str:
    """perf's event names: FUNC, FUNC_L<RLN>, FUNC_<OFFS>, FUNC__return; for SRC:ALN
    the function the line is in."""
    p = d.point
    if p.function is None:
        return _sanitize(inst.name)
    if p.retprobe:
        return _sanitize(p.function + "__return")
    if p.line:
        return _sanitize(f"{p.function}_L{p.line}")
    if p.offset:
        return _sanitize(f"{p.function}_{p.offset}")
    return _sanitize(p.function)


def location(image, addr: int) -> tuple[str | None, int, int | None]:
    """The probe address as a kprobe_events line names it: (SYMBOL, offset, None) when
    the function's symbol is unique, else (None, 0, the address)."""
    f = _function_at(image, addr)
    if f is not None and f[2]:
        return f[0], addr - f[1], None
    return None, 0, addr


def compile_def(dbg: D.DebugInfo, image, d: ProbeDef, taken: set[tuple[str, str]]) -> list[Compiled]:
    """Every probe of one definition; `taken` collects the event names used."""
    out = []
    group = d.group or dbg.group or default_group(image)
    reads_vars = any(not a.raw and a.var != "$retval" for a in d.args)
    for i, site in enumerate(sites(dbg, image, d.point, reads_vars)):
        base = d.event or default_event(d, site.inst)
        ev, n = base, 1
        while (group, ev) in taken:
            ev, n = f"{base}_{n}", n + 1
        taken.add((group, ev))
        args = compile_args(dbg, image, site, d)
        at = location(image, site.addr)
        if d.point.retprobe:
            f = _function_at(image, site.addr)
            if f is not None and f[1] == site.addr:
                # By name only if the name is unique (two files' static FUNC): else by address,
                # which is this unit's own function.
                at = (f[0], 0, None) if f[2] else (None, 0, site.addr)
        out.append(Compiled(d.point.retprobe, group, ev, *at, args))
    return out

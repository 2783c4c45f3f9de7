"""perf probe definitions in a kernel image, from its own BTF (.BTF): parameters by
name at a function's entry, members through pointers, `$retval` typed.

Mirrors the kernel's BTF-based probe event arguments (kernel/trace/trace_probe.c's
parse_btf_arg() and parse_btf_field(), Linux 6.x): BTF FUNC -> FUNC_PROTO gives each
parameter's name and type, the calling convention its register at the entry (the
architecture's fetchregs.ARG_REGS), and a struct's BTF members their offsets.  BTF has
no locals and no line table, so only FUNC and FUNC%return are probe points here.  The
result is the same probe records (compile.Compiled) compile.py makes from DWARF.
"""
from __future__ import annotations

from ...errors import KprewriteError
from ...targets.linux_kernel import btf as B
from .. import fetch as F
from .compile import Compiled, ProbeError, _arg_name, default_event
from .syntax import Arg, ProbeDef

# perf's group for kernel probes (PERFPROBE_GROUP)
KERNEL_GROUP = "probe"


class Types:
    """The image's BTF, indexed by function name."""

    def __init__(self, types: list, label: str):
        self.t = types
        self.label = label
        self.funcs = {t.name: i for i, t in enumerate(types) if t is not None and t.kind == B.FUNC}

    def strip(self, tid: int) -> int:
        while tid and self.t[tid].kind in B.QUALIFIERS:
            tid = self.t[tid].size_or_type
        return tid

    def name(self, tid: int) -> str:
        """The type as C names it (for errors)."""
        quals = []
        while tid and self.t[tid].kind in B.QUALIFIERS and self.t[tid].kind != B.TYPEDEF:
            quals.append({B.CONST: "const", B.VOLATILE: "volatile", B.RESTRICT: "restrict"}.get(self.t[tid].kind, ""))
            tid = self.t[tid].size_or_type
        if tid == 0:
            return "void"
        t = self.t[tid]
        if t.kind == B.PTR:
            return self.name(t.size_or_type) + " *"
        if t.kind in (B.STRUCT, B.UNION, B.ENUM, B.ENUM64, B.FWD):
            kw = {B.STRUCT: "struct ", B.UNION: "union ", B.FWD: "struct "}.get(t.kind, "enum ")
            return " ".join(q for q in quals if q) + (" " if any(quals) else "") + kw + (t.name or "(anon)")
        if t.kind == B.ARRAY:
            return f"{self.name(t.array[0])}[{t.array[1]}]"
        return " ".join([*(q for q in quals if q), t.name or "?"])

    def size(self, tid: int) -> int | None:
        tid = self.strip(tid)
        if tid == 0:
            return None
        t = self.t[tid]
        if t.kind in (B.INT, B.ENUM, B.ENUM64, B.STRUCT, B.UNION, B.FLOAT):
            return t.size_or_type
        if t.kind == B.PTR:
            return 8
        if t.kind == B.ARRAY:
            e = self.size(t.array[0])
            return None if e is None else e * t.array[1]
        return None

    def member(self, tid: int, name: str) -> tuple[int, int, int] | None:
        """(member type, bit offset, bitfield size) of a member, anonymous members searched."""
        for mname, mtype, bit_off, bits in self.t[tid].members:
            if mname == name:
                return mtype, bit_off, bits
            m = self.strip(mtype)
            if not mname and m and self.t[m].kind in (B.STRUCT, B.UNION):
                r = self.member(m, name)
                if r is not None:
                    return r[0], bit_off + r[1], r[2]
        return None


class Loc:
    """Where a value is at the probe: a register, or memory at another location's value + off."""

    def __init__(self, reg: str | None = None, base: Loc | None = None, off: int = 0):
        self.reg, self.base, self.off = reg, base, off

    def fetch(self) -> F.Value:
        """The fetch arg reading this location."""
        if self.reg is not None:
            return F.reg(self.reg[1:])
        return F.deref(self.off, self.base.fetch())

    def value(self) -> str:
        return self.fetch().text()



def _default_type(ty: Types, tid: int, label: str) -> str:
    """convert_variable_type() on BTF: signed integers sN, unsigned, pointers and enums xN,
    bool u8."""
    s = ty.strip(tid)
    if s == 0:
        raise ProbeError(f"{label} has no type (void)")
    t = ty.t[s]
    if t.kind == B.PTR:
        return "x64"
    if t.kind in (B.INT, B.ENUM, B.ENUM64):
        size = t.size_or_type
        if size not in (1, 2, 4, 8):
            raise ProbeError(f"{label} is {size} bytes, wider than a fetch arg")
        if t.kind == B.INT and t.encoding & 4:
            return "u8"
        sign = "s" if t.kind == B.INT and t.encoding & 1 else "x"
        return f"{sign}{size * 8}"
    if t.kind == B.FLOAT:
        raise ProbeError(f"{label} is floating-point, which fetch args cannot read")
    kind = {B.STRUCT: "a struct", B.UNION: "a union", B.ARRAY: "an array"}.get(t.kind, "not a number")
    raise ProbeError(f"{label} is {kind} ({ty.name(tid)}): name a member (->, ., [N]) or cast it")


def _char(ty: Types, tid: int) -> bool:
    s = ty.strip(tid)
    return s == 0 or (ty.t[s].kind == B.INT and ty.t[s].size_or_type == 1)


def _string(ty: Types, loc: Loc, tid: int, kind: str, label: str) -> F.Fetch:
    s = ty.strip(tid)
    t = ty.t[s] if s else None
    if t is not None and t.kind == B.PTR and _char(ty, t.size_or_type):
        return F.Fetch(F.deref(0, loc.fetch()), kind)
    if t is not None and t.kind == B.ARRAY and _char(ty, t.array[0]) and loc.reg is None:
        return F.Fetch(loc.fetch(), kind)
    raise ProbeError(f"{label} is {ty.name(tid)}, not a char pointer or array: it cannot be read as a {kind}")


def _fields(ty: Types, loc: Loc, tid: int, arg: Arg, label: str) -> tuple[Loc, int, int, int]:
    """parse_btf_field(): walk ->, . and [N]; (location, type, bit offset in the last
    member's container, bitfield size)."""
    shown, bit, bits = arg.var, 0, 0
    for f in arg.fields:
        s = ty.strip(tid)
        t = ty.t[s] if s else None
        if f.index is not None:
            shown += f"[{f.index}]"
            if t is not None and t.kind == B.ARRAY and loc.reg is None:
                if f.index >= t.array[1]:
                    raise ProbeError(f"{label}: index {f.index} is past the end of {shown[:shown.rfind('[')]} "
                                     f"({ty.name(tid)})")
                size = ty.size(t.array[0])
                loc, tid = Loc(base=loc.base, off=loc.off + f.index * size), t.array[0]
            elif t is not None and t.kind == B.PTR and ty.size(t.size_or_type):
                loc, tid = Loc(base=loc, off=f.index * ty.size(t.size_or_type)), t.size_or_type
            else:
                raise ProbeError(f"{label}: {shown[:shown.rfind('[')]} is not an array in memory or a pointer")
            bit = bits = 0
            continue
        if f.ref:
            if t is None or t.kind != B.PTR:
                hint = f"; use '.{f.name}'" if t is not None and t.kind in (B.STRUCT, B.UNION) else ""
                raise ProbeError(f"{label}: {shown} is not a pointer ({ty.name(tid)}){hint}")
            rec = ty.strip(t.size_or_type)
            if not rec or ty.t[rec].kind not in (B.STRUCT, B.UNION):
                raise ProbeError(f"{label}: {shown} does not point to a struct or union "
                                 f"({ty.name(tid)})")
            base, off = loc, 0
        else:
            if t is not None and t.kind == B.PTR:
                raise ProbeError(f"{label}: {shown} is a pointer; use '->{f.name}'")
            rec = s
            if t is None or t.kind not in (B.STRUCT, B.UNION):
                raise ProbeError(f"{label}: {shown} is not a struct or union")
            if loc.reg is not None:
                raise ProbeError(f"{label}: {shown} is not in memory here (in a register)")
            base, off = loc.base, loc.off
        found = ty.member(rec, f.name)
        if found is None:
            raise ProbeError(f"{label}: {ty.name(rec)} has no member '{f.name}'")
        mtype, bit_off, bits = found
        shown += ("->" if f.ref else ".") + f.name
        if bits:
            loc, bit = Loc(base=base, off=off), bit_off
        else:
            loc, bit = Loc(base=base, off=off + bit_off // 8), 0
        tid = mtype
    return loc, tid, bit, bits


def _bitfield(ty: Types, loc: Loc, tid: int, bit: int, bits: int) -> F.Fetch:
    """A bitfield as its container (the member type's size) and a bN@O/C type."""
    csize = ty.size(tid) or 4
    start = (bit // (csize * 8)) * csize
    shift = bit - start * 8
    if shift + bits > csize * 8:
        raise ProbeError(f"a bitfield of {bits} bits at bit {bit} straddles its {csize}-byte container")
    return F.Fetch(Loc(base=loc.base, off=loc.off + start).fetch(), f"b{bits}@{shift}/{csize * 8}")


def _param_loc(ty: Types, proto, index: int, fetch_regs, func: str) -> Loc:
    """The parameter's register at the entry: the integer and pointer arguments take
    ARG_REGS in order (an aggregate or float passed earlier moves the others: refused)."""
    regs = getattr(fetch_regs, "ARG_REGS", None)
    if regs is None:
        raise ProbeError("parameters by name are not supported on this architecture (no argument registers)")
    for i, (pname, ptype) in enumerate(proto.params[:index + 1]):
        s = ty.strip(ptype)
        if not s or ty.t[s].kind not in (B.INT, B.PTR, B.ENUM, B.ENUM64) or (ty.size(ptype) or 9) > 8:
            who = "it" if i == index else f"parameter '{pname or i + 1}' before it"
            raise ProbeError(f"'{proto.params[index][0]}' of '{func}': {who} is {ty.name(ptype)}, "
                             f"not passed in an integer register")
    if index >= len(regs):
        raise ProbeError(f"'{proto.params[index][0]}' of '{func}' is parameter {index + 1}: "
                         f"only the first {len(regs)} are in registers")
    return Loc(reg="%" + regs[index])


def _compile_arg(ty: Types, proto, func: str, arg: Arg, fetch_regs) -> list[tuple[str, F.Fetch | str]]:
    if arg.raw:
        return [(arg.name or "", arg.var)]      # named arg<N> where it lands (compile_args())
    if arg.var == "$retval":
        ftype = arg.type
        if ftype in ("string", "ustring"):
            return [(_arg_name(arg), F.Fetch(F.deref(0, F.RETVAL), ftype))]
        if ftype is None:
            s = ty.strip(proto.size_or_type)
            ftype = _default_type(ty, proto.size_or_type, f"the return value of '{func}'") \
                if s and ty.t[s].kind in (B.INT, B.ENUM, B.ENUM64) else "x64"
        return [(_arg_name(arg), F.Fetch(F.RETVAL, ftype))]
    names = [n for n, _ in proto.params]
    if arg.var in ("$params", "$vars"):
        out = []
        for i, (n, t) in enumerate(proto.params):
            try:
                out.append((n, F.Fetch(_param_loc(ty, proto, i, fetch_regs, func).fetch(),
                                       _default_type(ty, t, n))))
            except ProbeError:
                continue          # perf's $params: what cannot be read is left out
        return out
    if arg.var not in names:
        raise ProbeError(f"no parameter '{arg.var}' in '{func}' (BTF has its parameters only: "
                         f"{', '.join(n for n in names if n) or 'none'})")
    i = names.index(arg.var)
    label = f"'{arg.text}'"
    loc = _param_loc(ty, proto, i, fetch_regs, func)
    loc, tid, bit, bits = _fields(ty, loc, proto.params[i][1], arg, label)
    if arg.type in ("string", "ustring"):
        return [(_arg_name(arg), _string(ty, loc, tid, arg.type, label))]
    if bits and arg.type is None:
        return [(_arg_name(arg), _bitfield(ty, loc, tid, bit, bits))]
    if bits:
        raise ProbeError(f"{label} is a bitfield: it takes its own bN@O/C type, not ':{arg.type}'")
    if arg.type is None:
        s = ty.strip(tid)
        if s and ty.t[s].kind == B.ARRAY and _char(ty, ty.t[s].array[0]) and loc.reg is None:
            return [(_arg_name(arg), _string(ty, loc, tid, "string", label))]
    ftype = arg.type or _default_type(ty, tid, label)
    return [(_arg_name(arg), F.Fetch(loc.fetch(), ftype))]


def compile_def(ty: Types, image, d: ProbeDef, taken: set[tuple[str, str]], fetch_regs) -> list[Compiled]:
    """The probe of one definition, from BTF.  It names the function by its symbol (its
    address is resolved with the `events` lines', from the kernel's symbols, which are
    read after this)."""
    p = d.point
    if p.function is None or p.file is not None or p.line or p.lazy is not None or p.offset:
        what = "a source line" if (p.line or p.lazy is not None or p.function is None) else \
            "@SRC" if p.file is not None else "+OFFS"
        raise ProbeError(f"{what}: a kernel's BTF has no line table or locations; only FUNC and "
                         f"FUNC%return (the parameters at the entry) can be probed by name")
    func = p.function
    fid = ty.funcs.get(func)
    if fid is None:
        raise ProbeError(f"function '{func}' not found in the BTF of {image.label}")
    proto = ty.t[ty.t[fid].size_or_type]
    seen: dict[str, F.Fetch | str] = {}
    for a in d.args:
        for name, body in _compile_arg(ty, proto, func, a, fetch_regs):
            name = name or f"arg{len(seen) + 1}"
            n, i = name, 1
            while n in seen:            # as compile_args(): a name used twice gets _1, _2
                n, i = f"{name}_{i}", i + 1
            seen[n] = body
    group = d.group or KERNEL_GROUP
    base = d.event or default_event(d, None)
    ev, n = base, 1
    while (group, ev) in taken:
        ev, n = f"{base}_{n}", n + 1
    taken.add((group, ev))
    return [Compiled(p.retprobe, group, ev, func, 0, None, list(seen.items()))]


def vars_lines(ty: Types, fetch_regs, p) -> list[str]:
    """perf probe -V from BTF: the function's parameters at its entry and their fetch args
    (at %return: the return value's type)."""
    if p.function is None or p.file is not None or p.line or p.lazy is not None or p.offset:
        raise KprewriteError(f"{ty.label}: a kernel's BTF has no line table or locations; "
                             f"name a function (FUNC or FUNC%return)")
    fid = ty.funcs.get(p.function)
    if fid is None:
        raise KprewriteError(f"function '{p.function}' not found in the BTF of {ty.label}")
    proto = ty.t[ty.t[fid].size_or_type]
    out = [f"@<{p.function}+0>" + (" (return)" if p.retprobe else "")]
    if p.retprobe:
        return out + [f"\t{ty.name(proto.size_or_type)}\t$retval"]
    for i, (n, t) in enumerate(proto.params):
        try:
            what = f"{_param_loc(ty, proto, i, fetch_regs, p.function).value()}:{_default_type(ty, t, n)}"
        except ProbeError as e:
            what = f"({e})"
        out.append(f"\tparam\t{ty.name(t)}\t{n}\t{what}")
    return out

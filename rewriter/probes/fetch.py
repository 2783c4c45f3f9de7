"""FETCHARGS of kprobe_events: parse, check and compile to fetch programs.

Mirrors kernel/trace/trace_probe.c: traceprobe_parse_probe_arg() splits
`NAME=BODY:TYPE[N]`, parse_probe_arg() turns the body into an array of
`struct fetch_insn` (stage 1: a value from a register, the stack, $comm, an
immediate...; stage 2: dereferences; stage 3: a store of the typed value,
then a bitfield modifier and an array loop).  The same instruction arrays are
emitted as C data at rewrite time and interpreted on each hit by
runtime/kp_fetch.c, so nothing is parsed when a probe fires.

Errors carry the column of the offending character, like the kernel's
`error_log` caret (`__trace_probe_log_err(offset, ...)`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# Kernel limits (trace_probe.h).
MAX_TRACE_ARGS = 128
MAX_ARG_NAME_LEN = 32
MAX_ARGSTR_LEN = 63
MAX_ARRAY_LEN = 64
FETCH_INSN_MAX = 16

# Error texts: the kernel's ERRORS table (trace_probe.h), by code.
ERR = {
    "RETVAL_ON_PROBE": "$retval is not available on probe",
    "BAD_STACK_NUM": "Invalid stack number",
    "BAD_ARG_NUM": "Invalid argument number",
    "BAD_VAR": "Invalid $-variable specified",
    "NOFENTRY_ARGS": "$argN can be used only on function entry (offset 0)",
    "BAD_REG_NAME": "Invalid register name",
    "BAD_MEM_ADDR": "Invalid memory address",
    "BAD_IMM": "Invalid immediate value",
    "IMMSTR_NO_CLOSE": "String is not closed with '\"'",
    "FILE_ON_KPROBE": "File offset is not available with kprobe",
    "TOO_MANY_OPS": "Dereference is too much nested",
    "DEREF_NEED_BRACE": "Dereference needs a brace",
    "BAD_DEREF_OFFS": "Invalid dereference offset",
    "DEREF_OPEN_BRACE": "Dereference brace is not closed",
    "COMM_CANT_DEREF": "$comm can not be dereferenced",
    "BAD_FETCH_ARG": "Invalid fetch argument",
    "ARRAY_NO_CLOSE": "Array is not closed",
    "BAD_ARRAY_SUFFIX": "Array has wrong suffix",
    "BAD_ARRAY_NUM": "Invalid array size",
    "ARRAY_TOO_BIG": "Array number is too big",
    "BAD_TYPE": "Unknown type is specified",
    "BAD_STRING": "String accepts only memory argument",
    "BAD_ARRAY": "Array accepts only memory argument",
    "BAD_SYMSTRING": "Symbol String doesn't accept data/userdata",
    "BAD_BITFIELD": "Invalid bitfield",
    "ARG_NAME_TOO_LONG": "Argument name is too long",
    "NO_ARG_NAME": "Argument name is not specified",
    "BAD_ARG_NAME": "Argument name must follow the same rules as C identifiers",
    "USED_ARG_NAME": "This argument name is already used",
    "ARG_TOO_LONG": "Argument expression is too long",
    "NO_ARG_BODY": "No argument expression",
    "NEED_STRING_TYPE": "$comm and immediate-string only accepts string type",
    "TOO_MANY_ARGS": "Too many arguments are specified",
    "NO_SYMBOL": "Symbol not found in the image",
}


class FetchError(Exception):
    """A parse error at `column` (0-based, in the text that was parsed)."""

    def __init__(self, column: int, code: str, detail: str = ""):
        self.column, self.code = column, code
        self.message = ERR[code] + (f" ({detail})" if detail else "")
        super().__init__(self.message)


# --- registers: the arch's fetch_regs (names and pt_regs offsets, $stackN bound, default type) ---

def _regs(flags: ParseFlags):
    """The arch's FETCHARGS facts: the image's arch, else the machine we run on."""
    if flags.regs is not None:
        return flags.regs
    from ..arch import get_arch, host_machine
    return get_arch(host_machine()).fetch_regs

# --- fetch types: probe_fetch_types[] ----------------------------------------------------------

@dataclass(frozen=True)
class FetchType:
    name: str
    size: int
    kind: str            # u s x char symbol string ustring symstr


TYPES = {t.name: t for t in [
    FetchType("u8", 1, "u"), FetchType("u16", 2, "u"), FetchType("u32", 4, "u"), FetchType("u64", 8, "u"),
    FetchType("s8", 1, "s"), FetchType("s16", 2, "s"), FetchType("s32", 4, "s"), FetchType("s64", 8, "s"),
    FetchType("x8", 1, "x"), FetchType("x16", 2, "x"), FetchType("x32", 4, "x"), FetchType("x64", 8, "x"),
    FetchType("char", 1, "char"), FetchType("symbol", 8, "symbol"),
    FetchType("string", 8, "string"), FetchType("ustring", 8, "ustring"), FetchType("symstr", 8, "symstr"),
]}
STRING_KINDS = ("string", "ustring")

# --- fetch instructions: enum fetch_op (the numbers are the runtime's, kp_trace.h) --------------

OPS = {
    "END": 0, "REG": 1, "STACK": 2, "STACKP": 3, "RETVAL": 4, "COMM": 5, "ARG": 6, "IMM": 7,
    "IMM_LINK": 8, "DATA": 9, "DEREF": 10, "UDEREF": 11, "ST_RAW": 12, "ST_MEM": 13, "ST_UMEM": 14,
    "ST_STRING": 15, "ST_USTRING": 16, "MOD_BF": 17, "LP_ARRAY": 18,
}
# The stage-1 ops that read pt_regs (process_fetch_insn()'s regs argument).
REGS_OPS = frozenset({"REG", "STACK", "STACKP", "RETVAL", "ARG"})
KINDS = {"u": 0, "s": 1, "x": 2, "char": 3, "symbol": 4, "string": 5, "ustring": 5, "symstr": 6, "bitfield": 0}


@dataclass
class Insn:
    """struct fetch_insn."""
    op: str
    size: int = 0
    param: int = 0
    imm: int = 0
    lshift: int = 0
    rshift: int = 0
    data: bytes | None = None
    symbol: str | None = None       # @SYM: resolved into imm at compile time
    column: int = 0                 # where @SYM was written, for errors


@dataclass
class ProbeArg:
    """struct probe_arg: one NAME=FETCHARG:TYPE."""
    name: str
    comm: str                       # the argument text as written (after NAME=)
    type: FetchType
    count: int                      # array length, 0 for a scalar
    code: list[Insn]
    column: int                     # where the argument starts
    bitfield: bool = False


@dataclass
class ParseFlags:
    is_return: bool = False
    fentry: bool = False            # the probe is on a function entry: $argN allowed
    regs: object = None             # the arch's fetch_regs (None: the machine we run on)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def is_good_name(name: str) -> bool:
    return bool(_IDENT.match(name))


def kstrtoul(s: str) -> int | None:
    """kstrtoul(s, 0): decimal, 0x hex or 0 octal; no sign."""
    m = re.fullmatch(r"0[xX]([0-9a-fA-F]+)|0([0-7]*)|([1-9][0-9]*)", s)
    if not m:
        return None
    if m.group(1) is not None:
        v = int(m.group(1), 16)
    elif m.group(2) is not None:
        v = int(m.group(2) or "0", 8)
    else:
        v = int(m.group(3))
    return v if v < 1 << 64 else None


def kstrtol(s: str) -> int | None:
    neg = s.startswith("-")
    v = kstrtoul(s[1:] if neg else s)
    if v is None or v >= 1 << 63 and not (neg and v == 1 << 63):
        return None
    return -v if neg else v


def split_args(text: str, base: int = 0) -> list[tuple[str, int]]:
    """argv_split(): whitespace-separated words with their columns."""
    return [(m.group(0), base + m.start()) for m in re.finditer(r"\S+", text)]


# --- parse_probe_arg() ---------------------------------------------------------------------------

def _parse_vars(arg: str, code: list[Insn], flags: ParseFlags, offs: int) -> None:
    if arg == "retval":
        if not flags.is_return:
            raise FetchError(offs, "RETVAL_ON_PROBE")
        code.append(Insn("RETVAL"))
    elif arg.startswith("stack"):
        rest = arg[5:]
        if rest == "":
            code.append(Insn("STACKP"))
        elif rest[0].isdigit():
            n = kstrtoul(rest) if rest.isdigit() else None
            if n is None or not rest.isdigit():
                raise FetchError(offs, "BAD_VAR")
            if n > _regs(flags).PARAM_MAX_STACK:
                raise FetchError(offs, "BAD_STACK_NUM")
            code.append(Insn("STACK", param=n))
        else:
            raise FetchError(offs, "BAD_VAR")
    elif arg == "comm":
        code.append(Insn("COMM"))
    elif arg.startswith("arg") and arg[3:].isdigit():
        if not flags.fentry:
            raise FetchError(offs, "NOFENTRY_ARGS")
        n = int(arg[3:])
        if n == 0 or n > _regs(flags).PARAM_MAX_STACK:
            raise FetchError(offs, "BAD_ARG_NUM")
        code.append(Insn("ARG", param=n - 1))
    else:
        raise FetchError(offs, "BAD_VAR")


def _str_to_immediate(s: str) -> int | None:
    if s[:1].isdigit():
        return kstrtoul(s)
    if s[:1] == "-":
        v = kstrtol(s)
        return None if v is None else v & (1 << 64) - 1
    if s[:1] == "+":
        v = kstrtol(s[1:])
        return None if v is None else v & (1 << 64) - 1
    return None


def _parse_arg(arg: str, code: list[Insn], flags: ParseFlags, offs: int) -> None:
    """Appends the instructions for `arg` (written at column `offs`) to `code`."""
    if len(code) >= FETCH_INSN_MAX - 2:
        raise FetchError(offs, "TOO_MANY_OPS")
    c = arg[:1]
    if c == "$":
        _parse_vars(arg[1:], code, flags, offs)
    elif c == "%":
        regs = _regs(flags)
        if arg[1:] not in regs.REG_OFFSET:
            raise FetchError(offs, "BAD_REG_NAME", regs.REGS_HINT)
        code.append(Insn("REG", param=regs.REG_OFFSET[arg[1:]]))
    elif c == "@":
        if arg[1:2].isdigit():
            v = kstrtoul(arg[1:])
            if v is None:
                raise FetchError(offs, "BAD_MEM_ADDR")
            code.append(Insn("IMM_LINK", imm=v))
        elif arg[1:2] == "+":
            raise FetchError(offs, "FILE_ON_KPROBE")
        else:
            sym = arg[1:]
            m = re.search(r"[+-]", sym)
            off = 0
            if m:
                o = kstrtol(sym[m.start():].lstrip("+") if sym[m.start()] == "+" else sym[m.start():])
                if o is None or not sym[:m.start()]:
                    raise FetchError(offs, "BAD_MEM_ADDR")
                sym, off = sym[:m.start()], o
            if not sym:
                raise FetchError(offs, "BAD_MEM_ADDR")
            code.append(Insn("IMM_LINK", imm=off, symbol=sym, column=offs + 1))
        code.append(Insn("DEREF", imm=0))
    elif c in ("+", "-"):
        op = "DEREF"
        a = arg
        if a[1:2] == "u":
            op = "UDEREF"
            a = a[0] + a[2:]
        if a[0] == "+":
            a = a[1:]
        lp = a.find("(")
        if lp < 0:
            raise FetchError(offs, "DEREF_NEED_BRACE")
        off = kstrtol(a[:lp])
        if off is None:
            raise FetchError(offs, "BAD_DEREF_OFFS")
        inner_col = offs + (len(arg) - len(a)) + lp + 1
        inner = a[lp + 1:]
        rp = inner.rfind(")")
        if rp < 0:
            raise FetchError(inner_col + len(inner), "DEREF_OPEN_BRACE")
        if inner[rp + 1:]:
            raise FetchError(inner_col + rp + 1, "BAD_FETCH_ARG", "text after the closing brace")
        inner = inner[:rp]
        if not inner:
            raise FetchError(inner_col, "NO_ARG_BODY")
        _parse_arg(inner, code, flags, inner_col)
        if code[-1].op in ("COMM", "DATA"):
            raise FetchError(inner_col, "COMM_CANT_DEREF")
        if len(code) >= FETCH_INSN_MAX - 2:
            raise FetchError(offs, "TOO_MANY_OPS")
        code.append(Insn(op, imm=off))
    elif c == "\\":
        if arg[1:2] == '"':
            s = arg[2:]
            if not s.endswith('"') or not s:
                raise FetchError(offs + len(arg), "IMMSTR_NO_CLOSE")
            code.append(Insn("DATA", data=s[:-1].encode()))
        else:
            v = _str_to_immediate(arg[1:])
            if v is None:
                raise FetchError(offs + 1, "BAD_IMM")
            code.append(Insn("IMM", imm=v))
    else:
        raise FetchError(offs, "BAD_FETCH_ARG")


def simple_strtoul(s: str) -> tuple[int, str]:
    """simple_strtoul(s, &tail, 0): the longest number at the start of s (0x hex, 0 octal,
    else decimal; 0 and all of s when there is none) and the rest."""
    if len(s) > 2 and s[0] == "0" and s[1] in "xX" and s[2] in "0123456789abcdefABCDEF":
        digits, base, start = "0123456789abcdefABCDEF", 16, 2
    elif s[:1] == "0":
        digits, base, start = "01234567", 8, 0
    else:
        digits, base, start = "0123456789", 10, 0
    end = start
    while end < len(s) and s[end] in digits:
        end += 1
    return (int(s[start:end], base) if end > start else 0), s[end:]


def _bitfield(t: str, tcol: int) -> tuple[int, int, int] | None:
    """b<bit-width>@<bit-offset>/<container-size> -> (width, offset, container bytes),
    read as __parse_bitfield_probe_arg() reads it (simple_strtoul: `b04@010/32` is 4 bits
    at offset 8; `b08@...` stops at the 8)."""
    cont = t.split("/", 1)[1] if "/" in t else None
    if cont is None or kstrtoul(cont) not in (8, 16, 32, 64):
        raise FetchError(tcol, "BAD_TYPE")
    bw, tail = simple_strtoul(t[1:])
    if bw == 0 or not tail.startswith("@"):
        raise FetchError(tcol, "BAD_BITFIELD")
    bo, rest = simple_strtoul(tail[1:])
    if rest == tail[1:] or not rest.startswith("/"):
        raise FetchError(tcol, "BAD_BITFIELD")
    bs = kstrtoul(cont)
    if bw + bo > bs:
        raise FetchError(tcol, "BAD_BITFIELD")
    return bw, bo, bs // 8


def _parse_type(body: str, col: int, flags: ParseFlags):
    """BODY[:TYPE[N]] -> (arg, type text or None, type column, fetch type, array count, bitfield)."""
    arg, t, count, tcol = body, None, 0, col
    colon = body.find(":")
    if colon >= 0:
        arg, t = body[:colon], body[colon + 1:]
        tcol = col + colon + 1
        lb = t.find("[")
        if lb >= 0:
            tail = t[lb + 1:]
            rb = tail.find("]")
            if rb < 0:
                raise FetchError(tcol + len(t), "ARRAY_NO_CLOSE")
            if tail[rb + 1:]:
                raise FetchError(tcol + lb + 1 + rb + 1, "BAD_ARRAY_SUFFIX")
            n = kstrtoul(tail[:rb])
            if not n:
                raise FetchError(tcol + lb + 1, "BAD_ARRAY_NUM")
            if n > MAX_ARRAY_LEN:
                raise FetchError(tcol + lb + 1, "ARRAY_TOO_BIG")
            count, t = n, t[:lb]
    bf = None
    if arg == "$comm" or arg.startswith('\\"'):
        if count or (t is not None and t != "string"):
            raise FetchError(tcol if t is not None else col, "NEED_STRING_TYPE")
        ftype = TYPES["string"]
    elif t is not None and t.startswith("b"):
        bf = _bitfield(t, tcol)
        ftype = TYPES[f"u{bf[2] * 8}"]
    else:
        ftype = TYPES.get(t if t is not None else _regs(flags).DEFAULT_TYPE)
        if ftype is None:
            raise FetchError(tcol, "BAD_TYPE")
    return arg, t, tcol, ftype, count, bf


def _store(code: list[Insn], ftype: FetchType, count: int, bf, typed: bool, tcol: int, col: int) -> None:
    """Stage 3 and after: the store of the typed value, the bitfield modifier, the array loop."""
    last = code[-1]
    if ftype.kind in STRING_KINDS:
        if last.op not in ("DEREF", "UDEREF", "IMM", "IMM_LINK", "COMM", "DATA"):
            raise FetchError(tcol if typed else col, "BAD_STRING")
        user = ftype.kind == "ustring" or last.op == "UDEREF"
        if count and last.op not in ("DEREF", "UDEREF"):
            raise FetchError(tcol, "BAD_STRING", "a string array needs a dereference: +0(...):string[N]")
        if last.op in ("IMM", "IMM_LINK", "COMM", "DATA") or count:
            code.append(Insn("ST_USTRING" if user else "ST_STRING"))
        else:
            last.op = "ST_USTRING" if user else "ST_STRING"
    elif ftype.kind == "symstr" and last.op in ("COMM", "DATA", "UDEREF"):
        raise FetchError(tcol, "BAD_SYMSTRING")
    elif last.op in ("DEREF", "UDEREF"):
        last.op, last.size = ("ST_MEM" if last.op == "DEREF" else "ST_UMEM"), ftype.size
    else:
        code.append(Insn("ST_RAW", size=ftype.size))
    store = code[-1]
    if bf:
        bw, bo, bs = bf
        code.append(Insn("MOD_BF", size=bs, lshift=bs * 8 - (bw + bo), rshift=bs * 8 - bw))
    if count:
        if store.op not in ("ST_MEM", "ST_UMEM", "ST_STRING", "ST_USTRING"):
            raise FetchError(tcol, "BAD_ARRAY" if ftype.kind not in STRING_KINDS else "BAD_STRING")
        code.append(Insn("LP_ARRAY", param=count))
    if len(code) >= FETCH_INSN_MAX:
        raise FetchError(col, "TOO_MANY_OPS")
    code.append(Insn("END"))


def parse_arg_body(body: str, col: int, flags: ParseFlags) -> tuple[FetchType, int, list[Insn], bool]:
    """traceprobe_parse_probe_arg_body(): BODY[:TYPE[N]] -> (type, count, code, is_bitfield)."""
    if len(body) > MAX_ARGSTR_LEN:
        raise FetchError(col, "ARG_TOO_LONG")
    if not body:
        raise FetchError(col, "NO_ARG_BODY")
    arg, t, tcol, ftype, count, bf = _parse_type(body, col, flags)
    code: list[Insn] = []
    _parse_arg(arg, code, flags, col)
    _store(code, ftype, count, bf, t is not None, tcol, col)
    return ftype, count, code, bf is not None


RESERVED_NAMES = {"common_type", "common_flags", "common_preempt_count", "common_pid", "common_tgid",
                  "__probe_ip", "__probe_ret_ip", "__probe_func"}


def _check_name(name: str, col: int, out: list[ProbeArg]) -> None:
    if not is_good_name(name):
        raise FetchError(col, "BAD_ARG_NAME")
    if name in RESERVED_NAMES or any(a.name == name for a in out):
        raise FetchError(col, "USED_ARG_NAME")


def _split_name(arg: str, col: int, i: int) -> tuple[str, str, int]:
    """NAME=BODY -> (name, body, body column); NAME defaults to arg<i + 1>."""
    eq = arg.find("=")
    if eq < 0:
        return f"arg{i + 1}", arg, col
    if eq > MAX_ARG_NAME_LEN:
        raise FetchError(col, "ARG_NAME_TOO_LONG")
    if eq == 0:
        raise FetchError(col, "NO_ARG_NAME")
    return arg[:eq], arg[eq + 1:], col + eq + 1


def parse_arg(arg: str, col: int, flags: ParseFlags, out: list[ProbeArg]) -> ProbeArg:
    """One FETCHARG written at `col`, after the args `out` (its name must differ)."""
    if len(out) >= MAX_TRACE_ARGS:
        raise FetchError(col, "TOO_MANY_ARGS")
    name, body, bcol = _split_name(arg, col, len(out))
    _check_name(name, col, out)
    ftype, count, code, bf = parse_arg_body(body, bcol, flags)
    return ProbeArg(name, body, ftype, count, code, col, bf)


def parse_args(words: list[tuple[str, int]], flags: ParseFlags) -> list[ProbeArg]:
    """Every FETCHARG of one probe; words are (text, column) from split_args()."""
    out: list[ProbeArg] = []
    for arg, col in words:
        out.append(parse_arg(arg, col, flags, out))
    return out


# --- fetch args as data: what perf probe definitions compile to ------------------------------------

@dataclass(frozen=True)
class Value:
    """Where a fetch arg's value is (stage 1 and 2 as data rather than text): `reg` (a
    register by its FETCHARGS name), `imm` (a constant), `addr` (@ADDR: the memory at a
    link-time address), `retval`, or `deref` (memory at `off` from `inner`'s value)."""
    kind: str
    reg: str | None = None
    imm: int = 0                    # imm: the constant; addr: the address; deref: the offset
    inner: Value | None = None

    def text(self) -> str:
        """As a kprobe_events line writes it."""
        if self.kind == "reg":
            return f"%{self.reg}"
        if self.kind == "imm":
            return f"\\{self.imm}"
        if self.kind == "addr":
            return f"@{self.imm & (1 << 64) - 1:#x}"
        if self.kind == "retval":
            return "$retval"
        return f"{self.imm:+d}({self.inner.text()})"

    def lower(self, code: list[Insn], flags: ParseFlags, col: int) -> None:
        """Appends its instructions to `code`, as _parse_arg() does for text(); `col`:
        where text() would be written (for errors)."""
        if self.kind == "reg":
            regs = _regs(flags)
            if self.reg not in regs.REG_OFFSET:
                raise FetchError(col, "BAD_REG_NAME", regs.REGS_HINT)
            code.append(Insn("REG", param=regs.REG_OFFSET[self.reg]))
        elif self.kind == "imm":
            if not -(1 << 63) <= self.imm < 1 << 64:
                raise FetchError(col + 1, "BAD_IMM")
            code.append(Insn("IMM", imm=self.imm & (1 << 64) - 1))
        elif self.kind == "addr":
            code += [Insn("IMM_LINK", imm=self.imm & (1 << 64) - 1), Insn("DEREF", imm=0)]
        elif self.kind == "retval":
            if not flags.is_return:
                raise FetchError(col, "RETVAL_ON_PROBE")
            code.append(Insn("RETVAL"))
        else:
            if not -(1 << 63) <= self.imm < 1 << 63:
                raise FetchError(col, "BAD_DEREF_OFFS")
            self.inner.lower(code, flags, col + len(f"{self.imm:+d}") + 1)
            if len(code) >= FETCH_INSN_MAX - 2:
                raise FetchError(col, "TOO_MANY_OPS")
            code.append(Insn("DEREF", imm=self.imm))


def reg(name: str) -> Value:
    return Value("reg", reg=name)


def imm(v: int) -> Value:
    return Value("imm", imm=v)


def addr(a: int) -> Value:
    return Value("addr", imm=a)


def deref(off: int, inner: Value) -> Value:
    return Value("deref", imm=off, inner=inner)


RETVAL = Value("retval")


@dataclass(frozen=True)
class Fetch:
    """A fetch arg's body as data: a Value and its type, by its kprobe_events name
    (u32, string, b4@2/32, u8[4]...)."""
    value: Value
    type: str

    @property
    def text(self) -> str:
        return f"{self.value.text()}:{self.type}"


def build_arg(name: str, body: Fetch, col: int, flags: ParseFlags, out: list[ProbeArg]) -> ProbeArg:
    """The ProbeArg that parse_arg() makes of `NAME=` + body.text at `col`, made from the
    data: the same instructions and the same errors (their columns in that text)."""
    if len(out) >= MAX_TRACE_ARGS:
        raise FetchError(col, "TOO_MANY_ARGS")
    text = body.text
    if len(name) > MAX_ARG_NAME_LEN:
        raise FetchError(col, "ARG_NAME_TOO_LONG")
    _check_name(name, col, out)
    bcol = col + len(name) + 1
    if len(text) > MAX_ARGSTR_LEN:
        raise FetchError(bcol, "ARG_TOO_LONG")
    if text.find(":") != len(body.value.text()):        # a ':' in the value: never made so
        raise FetchError(bcol, "BAD_FETCH_ARG")
    _, _, tcol, ftype, count, bf = _parse_type(text, bcol, flags)
    code: list[Insn] = []
    body.value.lower(code, flags, bcol)
    _store(code, ftype, count, bf, True, tcol, bcol)
    return ProbeArg(name, text, ftype, count, code, col, bf is not None)


# --- resolution and C emission ------------------------------------------------------------------

def data_symbols(image) -> dict[str, list[tuple[int, int]]]:
    """Every named symbol with an address: name -> [(value, size)] (functions and objects):
    the ELF's .symtab and .dynsym, then the symbols the image's target reads from it
    beyond them (a kernel's kallsyms or System.map: data and per-CPU symbols too;
    size 0, and a name several symbols share listed twice, so it is not unique)."""
    cached = getattr(image, "_kp_all_symbols", None)
    if cached is not None:
        return cached
    out: dict[str, list[tuple[int, int]]] = {}
    for s in image.elf_symbols():           # read without LIEF (Image's own tables)
        if s.name and s.shndx != 0 and s.value:
            lst = out.setdefault(s.name, [])
            if all(v != s.value for v, _ in lst):
                lst.append((s.value, s.size))
    target = getattr(image, "target", None)     # what targets.load() detected (an Image made directly: none)
    for name, addr in ((target.link_symbols(image) if target is not None else None) or {}).items():
        if name not in out:
            out[name] = [(addr, 0)] if addr is not None else [(0, 0), (1, 0)]
    image._kp_all_symbols = out
    return out


def resolve_symbols(args: list[ProbeArg], image) -> None:
    """@SYM[+|-offs]: the symbol's link-time address, like traceprobe_update_arg()."""
    syms = data_symbols(image)
    for a in args:
        for insn in a.code:
            if insn.symbol is not None:
                vals = syms.get(insn.symbol)
                if not vals:
                    raise FetchError(insn.column, "NO_SYMBOL", f"'{insn.symbol}' not in {image.label}")
                if len(vals) > 1:
                    raise FetchError(insn.column, "NO_SYMBOL", f"'{insn.symbol}' is not unique")
                insn.imm = (vals[0][0] + insn.imm) & (1 << 64) - 1


def symbol_table(image) -> list[tuple[int, int, str]]:
    """Sorted (address, size, name) of sized functions and objects, for symbol/symstr
    types and return addresses (the kernel's kallsyms)."""
    seen: dict[int, tuple[int, int, str]] = {}
    for f in image.functions:
        seen[f.start] = (f.start, f.end - f.start, f.name)
    for name, vals in sorted(data_symbols(image).items()):
        for v, size in vals:
            if size and v not in seen:
                seen[v] = (v, size, name)
    return sorted(seen.values())


def _c_bytes(b: bytes) -> str:
    from ..emit.cstring import c_string
    return c_string(b.decode("latin-1")) if all(0x20 <= c < 0x7F for c in b) else \
        '"' + "".join(f"\\{c:03o}" for c in b) + '"'


def args_c(prefix: str, args: list[ProbeArg]) -> tuple[list[str], str]:
    """C definitions for one event's args; returns (lines, name of the kp_probe_arg array)."""
    from ..emit.cstring import c_string
    out = []
    for j, a in enumerate(args):
        insns = []
        for n in a.code:
            data = _c_bytes(n.data) if n.data is not None else "0"
            insns.append(f"{{ {OPS[n.op]}, {n.size}, {n.lshift}, {n.rshift}, {n.param}U, "
                         f"(long){n.imm & (1 << 64) - 1:#x}UL, {data} }}")
        out.append(f"static const struct kp_fetch_insn {prefix}_{j}[] = {{ {', '.join(insns)} }};")
    arr = f"{prefix}_args"
    if args:
        items = []
        for j, a in enumerate(args):
            kind = "bitfield" if a.bitfield else a.type.kind
            items.append(f"{{ {c_string(a.name)}, {prefix}_{j}, {KINDS[kind]}, {a.type.size}, {a.count} }}")
        out.append(f"static const struct kp_probe_arg {arr}[] = {{ {', '.join(items)} }};")
    else:
        arr = "0"
    return out, arr

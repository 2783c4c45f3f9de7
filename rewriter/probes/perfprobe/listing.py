"""`probe-vars` and `probe-lines`: what perf probe -V and -L show, from the image's DWARF."""
from __future__ import annotations

from ...errors import KprewriteError
from . import compile as C
from . import dwarf as D
from .syntax import Arg, ProbeSyntaxError, parse_point


def _point(text: str):
    try:
        return parse_point(text, 0)
    except ProbeSyntaxError as e:
        raise KprewriteError(f"'{text}': column {e.column + 1}: {e.message}") from None


def _sites(dbg, image, text):
    p = _point(text)
    try:
        return p, C.sites(dbg, image, p)
    except C.ProbeError as e:
        raise KprewriteError(str(e)) from None


def vars_lines(image, arch, text: str) -> list[str]:
    """perf probe -V: at each address of the point, every variable in scope and the
    fetch arg it compiles to there (or why it is not available)."""
    from . import debug_info
    from .btfprobe import Types, vars_lines as btf_vars_lines
    dbg = debug_info(image, arch)
    if isinstance(dbg, Types):
        return btf_vars_lines(dbg, arch.fetch_regs, _point(text))
    p, sites = _sites(dbg, image, text)
    out = []
    for s in sites:
        out.append(f"@<{C.where(image, s.addr)}> {s.addr:#x} in {s.inst.name}"
                   + (" (inlined)" if s.inst.inlined else ""))
        if p.retprobe:
            out.append(f"\t{D.type_name(D._origin_type(s.inst.die))}\t$retval")
            continue
        for v in dbg.scope(s.inst, s.addr):
            kind = "param" if v.param else "local"
            try:
                what = C.compile_var(dbg, image, s, Arg(v.name, 0, None, v.name), v)
            except C.ProbeError as e:
                msg = str(e)
                what = "(" + (msg.split(" (", 1)[1][:-1] if " is not available at " in msg and " (" in msg
                              else msg) + ")"
            out.append(f"\t{kind}\t{D.type_name(v.type)}\t{v.name}\t{what}")
    return out


def lines_lines(image, arch, text: str) -> list[str]:
    """perf probe -L: a function's source with the line numbers (relative to the
    function's declaration) that have code and can be probed as FUNC:RLN, those perf
    lists (_probeable_lines())."""
    from . import debug_info
    from .btfprobe import Types
    dbg = debug_info(image, arch)
    if isinstance(dbg, Types):
        raise KprewriteError(f"{image.label}: a kernel's BTF has no line table: probe-lines needs DWARF")
    p = _point(text)
    if p.function is None:
        raise KprewriteError(f"'{text}': name a function (FUNC or FUNC@SRC)")
    insts = [i for i in dbg.instances(p.function, p.file) if p.file is None or C._file_match(i.decl_file, p.file)]
    if not insts:
        raise KprewriteError(f"function '{p.function}' not found in the debug information of {image.label}")
    inst = next((i for i in insts if not i.inlined), insts[0])
    code: dict[int, list[int]] = {}
    for i in insts:
        if i.decl_file != inst.decl_file:
            continue
        for line, addr in _probeable_lines(dbg, i, inst.decl_file):
            code.setdefault(line, []).append(addr)
    if not code:
        raise KprewriteError(f"'{p.function}' has no line information")
    first, last = inst.decl_line, max(code)
    out = [f"<{p.function}@{inst.decl_file}:0>"]
    try:
        with open(inst.decl_file, encoding="utf-8", errors="replace") as f:
            src = f.read().split("\n")
    except OSError:
        src = None
    for n in range(first, last + 1):
        rel = n - first
        if src is not None and n - 1 < len(src):
            text_line = src[n - 1].rstrip()
            out.append(f"{rel:>7}  {text_line}" if n in code else f"         {text_line}")
        elif n in code:
            out.append(f"{rel:>7}  (line {n}: {', '.join(hex(a) for a in sorted(set(code[n])))})")
    return out


def _probeable_lines(dbg, i, path: str) -> list[tuple[int, int]]:
    """(line, address) of an instance's lines as perf -L finds them: die_walk_lines() on
    the instance (its statement rows outside the functions inlined into it, its
    declaration's line at its entry, the call lines of what is inlined into it), each
    kept only if the line is the one of its address (line_range_walk_cb()'s reverse
    check, cu_find_lineinfo(): at a function's entry its declaration's line, elsewhere
    the first statement row at the address): a line sharing its address with another is
    not probed as that line ("This line is sharing the address with other lines")."""
    first_at: dict[int, tuple] = {}
    for r in dbg.statement_rows(i.cu):
        first_at.setdefault(r.addr, (r.file, r.line))
    for o in dbg.cu_instances(i.cu):
        if not o.inlined:
            first_at[o.entry] = (o.decl_file, o.decl_line)
    inner = [o for o in dbg.cu_instances(i.cu) if o.inlined and o is not i and _nested(o, i)]
    cands = [(r.line, r.addr) for r in dbg.statement_rows(i.cu)
             if r.file == path and i.contains(r.addr) and not any(o.contains(r.addr) for o in inner)]
    cands.append((i.decl_line, i.entry))
    for o in inner:
        call = dbg.call_site(o)
        if call is not None and call[0] == path and not any(x is not o and x.contains(o.entry) and _nested(o, x)
                                                             for x in inner):
            cands.append((call[1], o.entry))
    return [(ln, a) for ln, a in cands if first_at.get(a) == (path, ln)]


def _nested(o, i) -> bool:
    """Whether instance o lies within instance i (an inlined site in its code)."""
    return o.frame is i.frame and all(any(lo <= a and b <= hi for lo, hi in i.ranges) for a, b in o.ranges) and \
        sum(b - a for a, b in o.ranges) < sum(b - a for a, b in i.ranges)

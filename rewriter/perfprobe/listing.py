"""`probe-vars` and `probe-lines`: what perf probe -V and -L show, from the image's DWARF."""
from __future__ import annotations

from ..errors import KprewriteError
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
    function's declaration) that have code and can be probed as FUNC:RLN: the
    declaration's line at the entry, and each line that is the first statement row at
    one of its addresses (show_line_range()'s, through die_walk_lines())."""
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
        first_at: dict[int, int] = {}    # cu_getsrc_die(): the first statement row's line at an address
        for r in dbg.statement_rows(i.cu):
            first_at.setdefault(r.addr, r.line if r.file == inst.decl_file else -1)
        if not i.inlined:                # cu_find_lineinfo(): at the entry, the declaration's line
            first_at[i.entry] = i.decl_line
            code.setdefault(i.decl_line, []).append(i.entry)
        for r in dbg.lines(i.cu):
            # perf -L lists a line only where it is the line of its address (a line sharing
            # its address with an earlier one is not probed as that line: "This line is
            # sharing the address with other lines")
            if r.file == inst.decl_file and i.contains(r.addr) and first_at.get(r.addr) == r.line:
                code.setdefault(r.line, []).append(r.addr)
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

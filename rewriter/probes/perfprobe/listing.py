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
                what = C.compile_var(dbg, image, s, Arg(v.name, 0, None, v.name), v).text
            except C.ProbeError as e:
                msg = str(e)
                what = "(" + (msg.split(" (", 1)[1][:-1] if " is not available at " in msg and " (" in msg
                              else msg) + ")"
            out.append(f"\t{kind}\t{D.type_name(v.type)}\t{v.name}\t{what}")
    return out


def vars_doc(lines: list[str]) -> list[dict]:
    """`probe-vars --format json`: vars_lines() as records, one per address of the point:
    {"at": "FUNC+OFF", "address", "function", "inlined", "return", "vars": [{"kind"
    (param, local or retval), "type", "name", "fetch" (the fetch arg, or null), "unavailable"
    (why not, or null)}]}."""
    out: list[dict] = []
    for line in lines:
        if line.startswith("@<"):
            at, _, rest = line[2:].partition(">")     # @<WHERE> 0xADDR in FUNC[ (inlined)], @<FUNC+0>[ (return)]
            rest = rest.strip()
            addr, _, func = rest.partition(" in ") if rest.startswith("0x") else ("", "", "")
            out.append({"at": at, "address": addr or None,
                        "function": func.removesuffix(" (inlined)") if func else at.split("+")[0],
                        "inlined": func.endswith(" (inlined)"), "return": False, "vars": []})
            continue
        f = line.split("\t")[1:]
        if len(f) == 2:                  # \tTYPE\t$retval
            out[-1]["vars"].append({"kind": "retval", "type": f[0], "name": f[1], "fetch": None, "unavailable": None})
            out[-1]["return"] = True
            continue
        kind, ty, name, what = f
        bad = what.startswith("(") and what.endswith(")")
        out[-1]["vars"].append({"kind": kind, "type": ty, "name": name, "fetch": None if bad else what,
                                "unavailable": what[1:-1] if bad else None})
    return out


def lines_lines(image, arch, text: str) -> list[str]:
    """perf probe -L: a function's source with the line numbers (relative to the
    function's declaration) that have code and can be probed as FUNC:RLN, those perf
    lists (_probeable_lines())."""
    d = lines_doc(image, arch, text)
    out = [f"<{d['function']}@{d['file']}:0>"]
    for r in d["lines"]:
        if r["source"] is not None:
            out.append(f"{r['relative']:>7}  {r['source']}" if r["relative"] is not None else f"         {r['source']}")
        else:
            out.append(f"{r['relative']:>7}  (line {r['line']}: {', '.join(r['addresses'])})")
    return out


def lines_doc(image, arch, text: str) -> dict:
    """`probe-lines --format json`: {"function", "file", "lines": [{"line" (in the file),
    "relative" (RLN, or null for a line that cannot be probed), "source" (its text, or null
    when the file cannot be read), "addresses"}]}: every line from the declaration to the last
    with code (only those with code when the source cannot be read)."""
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
    try:
        with open(inst.decl_file, encoding="utf-8", errors="replace") as f:
            src = f.read().split("\n")
    except OSError:
        src = None
    rows = []
    for n in range(first, last + 1):
        addrs = [hex(a) for a in sorted(set(code.get(n, ())))]
        if src is not None and n - 1 < len(src):
            rows.append({"line": n, "relative": n - first if n in code else None, "source": src[n - 1].rstrip(),
                         "addresses": addrs})
        elif n in code:
            rows.append({"line": n, "relative": n - first, "source": None, "addresses": addrs})
    return {"function": p.function, "file": inst.decl_file, "lines": rows}


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

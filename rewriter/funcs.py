"""`funcs`: what a kprobe on each function's entry would be, as `perf probe -F`,
`bpftrace -l` and `uftrace -F` list what can be probed, with `check`'s decision
for it.  Each function is planned alone, as `check INPUT --kprobe FUNC` plans it
(a probe on a neighbour can change a decision: a jump that would evict it, a
region it would sit in), so the two agree for every function."""
from __future__ import annotations

import fnmatch
import os

from .errors import KprewriteError

FUNCS_FORMAT = "kprewrite-funcs-1"


def records(path: str, pattern: str = "*", *, optimize: bool = True, system_map: str | None = None) -> list[dict]:
    """One check record (report.check_records) per function whose name (or an alias)
    matches `pattern`, in address order."""
    from . import planner, report, targets
    from .analysis.functions import Analysis
    from .arch import get_arch
    from .probes.resolve import Probe
    from .probes.spec import KprobeSpec
    image = targets.load(path)
    arch = get_arch(image.machine)
    target = image.target
    target.load_symbols(image, system_map)
    rules = target.rules(image, arch)
    matched, seen = [], set()
    for f in sorted(image.functions, key=lambda f: (f.start, f.name)):
        if f.start not in seen and any(fnmatch.fnmatchcase(n, pattern) for n in [f.name, *f.aliases]):
            seen.add(f.start)
            matched.append(f)
    if not matched:
        raise KprewriteError(f"{os.path.basename(path)}: no function matches '{pattern}'")
    analysis = Analysis(image, arch, extra_sources=rules.jump_target_sources,
                        read_indirect_jumps=rules.read_indirect_jumps)
    out = []
    for f in matched:
        addr = arch.optprobe.adjust_kprobe_addr(image, f.start, 0)
        spec = KprobeSpec(table=f"--kprobe '{f.name}'", symbol_name=f.name, addr=None)
        p = Probe(spec, 0, addr, f, f.name, addr - f.start, False)
        plan = planner.plan(image, analysis, arch, [p], rules, optimize, "funcs")
        out += report.check_records(plan)
    return out


def doc(path: str, pattern: str = "*", **kw) -> dict:
    """`funcs --format json`."""
    return {"format": FUNCS_FORMAT, "input": os.path.basename(path), "functions": records(path, pattern, **kw)}


def lines(path: str, pattern: str = "*", **kw) -> list[str]:
    """`funcs`' text: `check`'s line for each function."""
    from .report import check_line
    return [check_line(r) for r in records(path, pattern, **kw)]

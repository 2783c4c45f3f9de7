"""Stage 2: resolve probes.  Turns the spec's [[kprobe]] and [[kretprobe]]
tables into one probe list: symbol_name (+offset) through the image's symbols,
addr, or a glob over function symbols; kprobe_lookup_name() and
arch_adjust_kprobe_addr()'s part.  A kretprobe resolves to its entry half, rp->kp
(EntryProbe), which is planned and aggregated with the kprobes."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from ..errors import KprewriteError
from ..elf.image import Function, Image
from .spec import KprobeSpec, KretprobeSpec, Spec
from .spec import where as spec_where

# At most this many probes (kprobes and kretprobes) in one output: far above every function of a
# kernel probed twice (a distribution kernel has about 120,000), it refuses a spec whose globs would
# expand to millions of probes on a crafted symbol table before any of them is planned.
MAX_PROBES = 1_000_000


def event_symbol(symbol: str) -> str:
    """A symbol as trace_kprobe's default event name spells it: anything but
    [A-Za-z0-9_] becomes '_' (the runtime does the same with names it derives at boot)."""
    if symbol.isascii():         # str.isalnum() is [A-Za-z0-9] there
        return _NOT_WORD.sub("_", symbol)
    return "".join(c if c.isalnum() or c == "_" else "_" for c in symbol)


_NOT_WORD = re.compile(r"[^A-Za-z0-9_]")


@dataclass
class Probe:
    """One kprobe to place: what the spec asked for, resolved."""
    spec: KprobeSpec
    index: int               # position in the output's probe table
    addr: int
    func: Function | None
    symbol: str              # symbol the address is reported against
    offset: int              # addr - symbol
    from_glob: bool
    slot: int = -1           # index in kp_probes[] (kp_kretprobes[] for an EntryProbe): set by the planner

    @property
    def label(self) -> str:
        return f"{self.symbol}+{self.offset:#x}"

    @property
    def event_name(self) -> str:
        # The kernel's default kprobe event name: p_SYMBOL_OFFSET.
        if self.spec.name:
            return self.spec.name
        # The kernel names events from what the user wrote, before arch_adjust_kprobe_addr()
        # (e.g. x86-64's step over an ENDBR).
        if self.spec.addr is not None and not self.spec.symbol_name:
            return f"p_0x{self.spec.addr + self.spec.offset:x}"
        return f"p_{event_symbol(self.symbol)}_{self.spec.offset}"


@dataclass
class EntryProbe(Probe):
    """The entry half of a kretprobe: rp->kp, whose pre_handler is pre_handler_kretprobe()."""
    kret: KretprobeSpec | None = None
    kind: str = "r"
    group: object = None     # its planner.Group (the function's return sites)
    ret_clean: bool = False  # its return handler never reads regs (planner.forms.choose_forms)

    @property
    def event_name(self) -> str:
        # trace_kprobe's default name for a return probe: r_SYMBOL_OFFSET.
        if self.kret.name:
            return self.kret.name
        if self.kret.addr is not None and not self.kret.symbol_name:
            return f"r_0x{self.kret.addr + self.kret.offset:x}"
        return f"r_{event_symbol(self.symbol)}_{self.kret.offset}"


def is_entry(p: Probe) -> bool:
    """A kretprobe's rp->kp rather than a kprobe of the spec."""
    return isinstance(p, EntryProbe)


def _entry_spec(k: KretprobeSpec) -> KprobeSpec:
    """rp->kp as a kprobe table: where the kretprobe is, no handlers of its own."""
    return KprobeSpec(k.table, k.symbol_name, k.addr, k.offset, None, None, k.disabled, k.name, None, k.is_glob)


def resolve(image: Image, spec: Spec, arch) -> tuple[list[Probe], list[str]]:
    """Every kprobe, then every kretprobe's rp->kp, numbered in that order; and
    the error lines (all of them, so every failing probe is named)."""
    probes: list[Probe] = []
    errors: list[str] = []
    globs: dict[str, list[Function]] = {}
    _count(image, spec, globs)
    for kp in spec.kprobes:
        for args in _resolve_one(image, spec, arch, kp, errors, globs):
            probes.append(Probe(kp, len(probes), *args))
    for k in spec.kretprobes:
        kp = _entry_spec(k)
        for args in _resolve_one(image, spec, arch, kp, errors, globs):
            probes.append(EntryProbe(kp, len(probes), *args, kret=k))
    # A [[function_graph]] table is a kprobe and a kretprobe of one label: its error once.
    return probes, list(dict.fromkeys(errors))


def _glob(image: Image, pattern: str, globs: dict[str, list[Function]]) -> list[Function]:
    """The functions a glob matches (one per address), cached in `globs`."""
    matched = globs.get(pattern)
    if matched is None:
        matched = []
        seen = set()
        for f in image.functions:
            names = [f.name] + f.aliases
            if any(fnmatch.fnmatchcase(n, pattern) for n in names) and f.start not in seen:
                seen.add(f.start)
                matched.append(f)
        globs[pattern] = matched
    return matched


def _count(image: Image, spec: Spec, globs: dict[str, list[Function]]) -> None:
    """Refuse, before any probe is made, a spec asking for more than MAX_PROBES probes."""
    total = 0
    for kp in list(spec.kprobes) + list(spec.kretprobes):
        if not kp.is_glob:
            total += 1
            continue
        n = len(_glob(image, kp.symbol_name, globs))
        total += n
        if total > MAX_PROBES:
            where = spec_where(spec.name, kp.table)
            raise KprewriteError(f"{where}: symbol_name '{kp.symbol_name}' matches {n} functions of "
                                 f"{image.label}, which makes {total} probes, more than the "
                                 f"{MAX_PROBES} kprewrite places in one output")


def _resolve_one(image: Image, spec: Spec, arch, kp: KprobeSpec, errors: list[str],
                 globs: dict[str, list[Function]] | None = None):
    """(addr, function, symbol, offset, from_glob) of each probe one table asks for
    (a glob's matches cached in `globs`)."""
    where = spec_where(spec.name, kp.table)
    if kp.is_glob:
        matched = _glob(image, kp.symbol_name, {} if globs is None else globs)
        if not matched:
            errors.append(f"{where}: symbol_name '{kp.symbol_name}' matches no function in {image.label}")
        for f in matched:
            addr = arch.optprobe.adjust_kprobe_addr(image, f.start, kp.offset)
            yield addr, f, f.name, addr - f.start, True
        return
    if kp.symbol_name is not None:
        addrs = image.symbols.get(kp.symbol_name)
        if not addrs:
            errors.append(f"{where}: symbol '{kp.symbol_name}' not found in {image.label}")
            return
        if len(set(addrs)) > 1:
            errors.append(f"{where}: symbol '{kp.symbol_name}' is ambiguous in {image.label} "
                          f"({', '.join(hex(a) for a in sorted(set(addrs)))}); use addr")
            return
        base = addrs[0]
        addr = arch.optprobe.adjust_kprobe_addr(image, base, kp.offset)
        yield addr, image.function_at(addr), kp.symbol_name, addr - base, False
        return
    addr = kp.addr + kp.offset
    func = image.function_at(addr)
    if func is not None and addr == func.start:
        addr = arch.optprobe.adjust_kprobe_addr(image, func.start, 0)
    if not image.is_code(addr):
        errors.append(f"{where}: addr {addr:#x} is not in an executable section of {image.label}")
        return
    sym, off = (func.name, addr - func.start) if func else (f"{addr:#x}", 0)
    yield addr, func, sym, off, False

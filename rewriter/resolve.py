"""Stage 2: resolve probes.  Turns the spec's tables into probe addresses:
symbol_name (+offset) through .symtab/.dynsym, addr, or a glob over function
symbols; kprobe_lookup_name() and arch_adjust_kprobe_addr()'s part."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from .errors import KprewriteError
from .image import Function, Image
from .spec import KprobeSpec, Spec


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

    @property
    def label(self) -> str:
        return f"{self.symbol}+{self.offset:#x}"

    @property
    def event_name(self) -> str:
        # The kernel's default kprobe event name: p_SYMBOL_OFFSET.
        if self.spec.name:
            return self.spec.name
        # The kernel names events from what the user wrote, before the ENDBR adjustment.
        if self.spec.addr is not None and not self.spec.symbol_name:
            return f"p_0x{self.spec.addr + self.spec.offset:x}"
        sym = "".join(c if c.isalnum() or c == "_" else "_" for c in self.symbol)
        return f"p_{sym}_{self.spec.offset}"


def _where(spec_path, table) -> str:
    return f"{spec_path.name}: {table}"


def resolve(image: Image, spec: Spec, arch) -> tuple[list[Probe], list[str]]:
    """Returns the probes and the error lines (all of them, so every failing probe is named)."""
    probes: list[Probe] = []
    errors: list[str] = []
    for kp in spec.kprobes:
        where = _where(spec.path, kp.table)
        if kp.is_glob:
            matched = []
            seen = set()
            for f in image.functions:
                names = [f.name] + f.aliases
                if any(fnmatch.fnmatchcase(n, kp.symbol_name) for n in names) and f.start not in seen:
                    seen.add(f.start)
                    matched.append(f)
            if not matched:
                errors.append(f"{where}: symbol_name '{kp.symbol_name}' matches no function in {image.label}")
            for f in matched:
                addr = arch.optprobe.adjust_kprobe_addr(image, f.start, kp.offset)
                probes.append(Probe(kp, len(probes), addr, f, f.name, addr - f.start, True))
            continue
        if kp.symbol_name is not None:
            addrs = image.symbols.get(kp.symbol_name)
            if not addrs:
                errors.append(f"{where}: symbol '{kp.symbol_name}' not found in {image.label}")
                continue
            if len(set(addrs)) > 1:
                errors.append(f"{where}: symbol '{kp.symbol_name}' is ambiguous in {image.label} "
                              f"({', '.join(hex(a) for a in sorted(set(addrs)))}); use addr")
                continue
            base = addrs[0]
            addr = arch.optprobe.adjust_kprobe_addr(image, base, kp.offset)
            func = image.function_at(addr)
            probes.append(Probe(kp, len(probes), addr, func, kp.symbol_name, addr - base, False))
        else:
            addr = kp.addr + kp.offset
            func = image.function_at(addr)
            if func is not None and addr in (func.start,) :
                addr = arch.optprobe.adjust_kprobe_addr(image, func.start, 0)
            if not image.is_code(addr):
                errors.append(f"{where}: addr {addr:#x} is not in an executable section of {image.label}")
                continue
            sym, off = (func.name, addr - func.start) if func else (f"{addr:#x}", 0)
            probes.append(Probe(kp, len(probes), addr, func, sym, off, False))
    return probes, errors

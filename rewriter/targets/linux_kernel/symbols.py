"""A kernel image's symbols: function bounds (.symtab, System.map or kallsyms), the
symbols the runtime and handlers link against, the tables' reader, and addresses as
the generated C writes them (KASLR moves them).  Also which architecture's part of
the target (x86_64/, ...) an image takes: its arch name's folder here."""
from __future__ import annotations

import os
import pkgutil
from importlib import import_module

from ...errors import KprewriteError
from .elfview import ElfView
from .kallsyms import functions as kallsyms_functions, read_kallsyms
from .sysmap import read_system_map

KERNEL_HALF = 1 << 63
PT_LOAD = 1


def arch_of(image):
    """The architecture's part of the kernel target (this folder's <arch>/, named as the
    image's back end in rewriter/arch/)."""
    return arch_named(image.machine)


def arch_folders() -> list[str]:
    """The architectures whose part of the kernel target is here (its subfolders)."""
    return sorted(m.name for m in pkgutil.iter_modules([os.path.dirname(__file__)]) if m.ispkg)


def arch_named(machine: str):
    try:
        return import_module(f".{machine}", __package__)
    except ModuleNotFoundError:
        raise KprewriteError(f"kernel images of architecture {machine} are not supported") from None


def load_symbols(image, system_map: str | None = None) -> None:
    """Function symbols and bounds: .symtab as for any ELF, else System.map, else kallsyms."""
    if system_map is None and any(f.source == "symtab" for f in image.functions):
        return
    if system_map is not None:
        syms = read_system_map(system_map).require_symbols().symbols
        source = "System.map"
    else:
        syms = read_kallsyms(image.data, image.path).symbols
        source = "kallsyms"
    image.kernel_symbols = syms
    image.kernel_symbols_source = source
    image._link_symbols = None          # link_symbols() is made from these
    image.set_functions([(f.start, f.end, f.name) for f in kallsyms_functions(syms, ElfView(image.data, image.path))],
                        source)


def kernel(image):
    """The image's tables' reader (sites.KernelImage of its architecture), made once."""
    k = getattr(image, "_kernel_tables", None)
    if k is None:
        syms = getattr(image, "kernel_symbols", None)
        if syms is None:     # .symtab: the function symbols and the linker's table bounds
            syms = {n: a[0] for n, a in image.symbols.items()}
            syms.update({n: a for n, a in image.all_symbols().items() if n not in syms})
        k = image._kernel_tables = arch_of(image).sites.KernelImage(image.data, syms, image.path)
    return k


def symbol_at(image, addr: int) -> str:
    f = image.function_at(addr)
    if f is None:
        return f"{addr:#x}"
    return f.name if f.start == addr else f"{f.name}+{addr - f.start:#x}"


def symbol(image, name: str) -> int:
    syms = getattr(image, "kernel_symbols", None)
    if syms is not None:
        for s in syms:
            if s.name == name:
                return s.addr
    else:
        a = image.all_symbols().get(name)
        if a is not None:
            return a
    raise KprewriteError(f"{image.path}: no symbol {name}, so the text/rodata gap cannot be found")


def link_symbols(image) -> dict[str, int | None]:
    """What the runtime and handlers may call or read in the image: name -> address
    (kallsyms, System.map or .symtab), None for a name that several symbols share
    (static functions of different files), unless one of them is global.  Made once per
    image (the thread key, the tables, the link and the BTF header all ask)."""
    cached = getattr(image, "_link_symbols", None)
    if cached is not None:
        return cached
    syms = getattr(image, "kernel_symbols", None)
    if syms is None:
        out = dict(image.all_symbols())
    else:
        out: dict[str, int | None] = {}
        is_global: dict[str, bool] = {}
        for s in syms:
            g = s.type.isupper()
            if s.name not in out or (g and not is_global[s.name]):
                out[s.name], is_global[s.name] = s.addr, g
            elif g == is_global[s.name] and out[s.name] != s.addr:
                out[s.name] = None
    image._link_symbols = out
    return out


def table_base(image) -> int:
    """The link address the records' 32-bit offsets count from: _text (the runtime adds
    the running _text, so KASLR needs no relocation for them)."""
    return symbol(image, "_text")


def derived_symbol(image, addr: int) -> str | None:
    """The name the running kernel's kallsyms_lookup() gives for addr (the first of the
    symbols there, in kallsyms order), or None when the image's kallsyms are not what
    the symbols came from (a .symtab or System.map could order aliases differently)."""
    first = getattr(image, "_kallsyms_first", None)
    if first is None:
        first = image._kallsyms_first = {}
        if getattr(image, "kernel_symbols_source", None) == "kallsyms":
            for sym in image.kernel_symbols:
                first.setdefault(sym.addr, sym.name)
    return first.get(addr)


def kernel_range(image) -> tuple[int, int]:
    """[lowest, highest) address of the kernel-half PT_LOADs: what moves with KASLR."""
    loads = [s for s in image.segments if s.type == PT_LOAD and s.vaddr >= KERNEL_HALF]
    return min(s.vaddr for s in loads), max(s.vaddr + s.memsz for s in loads)


def address_c(image, addr: int) -> str:
    """An address of the kernel as a C constant expression the linker relocates
    (`_text` + offset: an absolute relocation in data, which the architecture's KASLR
    table lists); anything else as a number."""
    lo, hi = kernel_range(image)
    if lo <= addr < hi:
        return f"((unsigned long)_text + {addr - lo:#x}UL)"
    return f"{addr:#x}UL"

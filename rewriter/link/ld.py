"""The link itself: the `ld` script and the linked blob (the runtime, the handlers
and the probe table at the address the new segments will have), read back.

What remains after the link are the arch's base-relative entries (its r_relative),
applied here at link-time addresses; the runtime adds the load bias to them at
start-up (PIE, shared)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


from ..elf.view import SHF_ALLOC, SHN_ABS, SHN_UNDEF, SHT_NOBITS, SHT_RELA, ElfView, relas
from ..errors import KprewriteError
from .objects import machine, undefined_symbols
from .runtime import PLATFORM, pie
from .toolchain import linker, run

LINKER_SCRIPT = """
SECTIONS
{{
  . = {text:#x};
  .text : {{ *(.text .text.*) *(.kprobes.text) }}
  .rodata : {{ *(.rodata .rodata.*) }}
  .eh_frame : {{ KEEP(*(.eh_frame)) }}
  .rela.dyn : {{ __kp_rela_start = .; *(.rela.dyn) *(.rela.*) __kp_rela_end = .; }}
  {data}
  __kp_data_start = .;
  {relro}
  .data : {{ *(.data .data.*) *(.data.rel.ro .data.rel.ro.*) *(.got) *(.got.plt) }}
  .bss : {{ *(.bss .bss.*) *(COMMON) }}
  __kp_data_end = .;
  . = ALIGN(0x1000);
  .dynamic : {{ *(.dynamic) }}
  /DISCARD/ : {{ *(.note.*) *(.comment) *(.eh_frame*) *(_kprobe_blacklist) *(.interp) }}
}}
"""
# The blob's data constant once the runtime runs (the probe sites, their probe lists,
# the handler tables; .data..ro_after_init as the kernel names it), first in the data
# and padded to a page: a PIE blob's kp_relocate() makes it read-only once relocated; in
# a kernel, mark_rodata_ro()'s own set_memory_ro() does (linux_kernel/platform.c).
RELRO = ("  .data.rel.ro : {{ __kp_ro_start = .; *(.data..ro_after_init) *(.data.rel.ro .data.rel.ro.*) "
         ". = ALIGN(0x1000); __kp_ro_end = .; }}")
# Symbols the linker script defines.
SCRIPT_SYMBOLS = frozenset({"__kp_rela_start", "__kp_rela_end", "__kp_data_start", "__kp_data_end",
                            "__kp_ro_start", "__kp_ro_end"})


@dataclass
class Blob:
    """The linked runtime + handlers: code (with rodata and relocations) and data."""
    text_addr: int
    text: bytes           # [text_addr, text_addr + len(text)): RX
    data_addr: int
    data: bytes           # file-backed part of the RW segment
    data_memsz: int       # including .bss
    symbols: dict[str, int]
    sections: list[tuple[str, int, int, int, int]]   # (name, type, flags, addr, size)
    # A blob linked where it runs (not PIE): its link-time relocations (ld --emit-relocs)
    # into loaded sections, for a target that moves the image at boot (KASLR).
    relocations: list["LinkReloc"] = field(default_factory=list)


@dataclass(frozen=True)
class LinkReloc:
    """One relocation the linker applied: at `offset` (final address), of ELF type
    `type`, against a symbol of value `value` (`absolute`: defined by address, as
    the image's own symbols are, rather than in one of the blob's sections)."""
    offset: int
    type: int
    value: int
    absolute: bool
    symbol: str
    addend: int


def _arch_of(objs: list[Path]) -> str:
    """The arch the objects were compiled for (their e_machine's back end)."""
    from ..arch import MACHINES
    m = machine(objs[0])
    if m not in MACHINES:
        raise KprewriteError(f"link: {objs[0].name}: no back end for ELF machine {m}")
    return MACHINES[m]


def link(workdir: Path, objs: list[Path], text_addr: int, platform: str = PLATFORM,
         externs: dict[str, int | None] | None = None, origin: dict[Path, str] | None = None,
         image_name: str = "the image", data_addr: int | None = None, arch=None) -> Blob:
    """Link at text_addr, with the linker of `arch` (default: the objects').  A PIE
    platform's blob is self-contained; any other resolves what it leaves undefined
    from `externs` (the image's symbols: name -> address, None when the name is
    ambiguous), each missing one an error naming the symbol and the file that uses
    it (`origin`: object -> name).  data_addr: where the data starts (default: the
    page after the code)."""
    ld = linker(arch or _arch_of(objs))
    script = workdir / "kp.ld"
    text = LINKER_SCRIPT.format(text=text_addr, data=". = ALIGN(0x1000);" if data_addr is None else f". = {data_addr:#x};",
                                relro=RELRO.format())
    out = workdir / "blob.elf"
    if pie(platform):
        script.write_text(text)
        run([ld, "-pie", "--no-dynamic-linker", "-z", "norelro", "-z", "noexecstack", "--hash-style=gnu",
             "--build-id=none", "-nostdlib", "-T", str(script), "-o", str(out), *map(str, objs)], "link")
        return _at(read_blob(out.read_bytes(), out), text_addr)
    externs, origin = externs or {}, origin or {}
    errors, assigns = [], []
    for name, obj in sorted(undefined_symbols(objs, SCRIPT_SYMBOLS).items()):
        where = origin.get(obj, obj.name)
        if name not in externs:
            errors.append(f"{where}: {name} is not a symbol of {image_name}")
        elif externs[name] is None:
            errors.append(f"{where}: {name} names several symbols of {image_name} (a static function or "
                          "variable of several files)")
        else:
            assigns.append(f"{name} = {externs[name]:#x};")
    if errors:
        raise KprewriteError(*errors)
    script.write_text("\n".join(assigns) + "\n" + text)
    # -q (--emit-relocs): the relocations stay in the output, for a target whose image
    # is relocated at boot (a kernel's KASLR table needs every absolute address).
    run([ld, "-static", "-q", "-z", "noexecstack", "--build-id=none", "-nostdlib", "-T", str(script),
         "-o", str(out), *map(str, objs)], "link")
    return _at(read_blob(out.read_bytes(), out), text_addr)


def _at(blob: Blob, text_addr: int) -> Blob:
    """The blob, if ld put its code where the layout said: a section aligned past the
    layout's alignment moves `.text` up, and every address the layout gave out
    (detours' calls into the runtime) would then be wrong without an error."""
    if blob.text_addr != text_addr:
        raise KprewriteError(f"link: the code was linked at {blob.text_addr:#x}, not at {text_addr:#x} where the "
                             "layout placed it (a runtime or handler section aligned to more than the layout allows)")
    return blob


def read_blob(raw: bytes, path: Path) -> Blob:
    """The linked ELF as a Blob: code and data by address, its symbols, the arch's
    base-relative relocations applied at link-time addresses (anything else refused).
    Read with elfview (not pyelftools, whose import and first parse cost a cold
    rewrite 0.1 s, in the thread that links beside the main one: pipeline.build)."""
    e = ElfView(raw, str(path))
    syms = {s.name: s.value for s in e.symbols() if s.name and s.shndx != SHN_UNDEF}
    secs = [(s.name, s.type, s.flags, s.addr, s.size, s.offset) for s in e.sections]

    def vaddr_bytes(lo, hi):
        buf = bytearray(hi - lo)
        for name, typ, flags, addr, size, off in secs:
            if flags & SHF_ALLOC and typ != SHT_NOBITS and addr < hi and addr + size > lo:
                a, b = max(lo, addr), min(hi, addr + size)
                buf[a - lo:b - lo] = raw[off + a - addr:off + b - addr]
        return buf

    text_addr = min(addr for name, typ, flags, addr, size, off in secs if name == ".text")
    text_end = syms["__kp_rela_end"]
    data_lo, data_hi = syms["__kp_data_start"], syms["__kp_data_end"]
    text = vaddr_bytes(text_addr, text_end)
    data_file_hi = max([addr + size for name, typ, flags, addr, size, off in secs
                        if flags & SHF_ALLOC and typ != SHT_NOBITS and data_lo <= addr < data_hi] + [data_lo])
    data = vaddr_bytes(data_lo, data_file_hi)
    # Apply the arch's base-relative relocations at link-time addresses; refuse anything else.
    rela = e.section(".rela.dyn")
    if rela is not None:
        from ..arch import MACHINES, get_arch
        r_relative = get_arch(MACHINES[e.e_machine]).r_relative
        for off, _, typ, addend in relas(raw, rela.offset, rela.size):
            if typ != r_relative:
                raise KprewriteError(f"link: handler code needs dynamic relocation type {typ} at {off:#x}; "
                                     "handlers must be position-independent and self-contained")
            val = addend & (2**64 - 1)
            if data_lo <= off < data_file_hi:
                data[off - data_lo:off - data_lo + 8] = val.to_bytes(8, "little")
            elif text_addr <= off < text_end:
                text[off - text_addr:off - text_addr + 8] = val.to_bytes(8, "little")
            else:
                raise KprewriteError(f"link: relocation at {off:#x} outside the linked sections")
    sections = [(n, t, f, a, s) for n, t, f, a, s, o in secs if f & SHF_ALLOC and s and n not in (".dynamic",)]
    return Blob(text_addr, bytes(text), data_lo, bytes(data), data_hi - data_lo, syms, sections, _emitted_relocs(e))


def _emitted_relocs(e) -> list[LinkReloc]:
    """The relocations ld -q kept (SHT_RELA sections of a static link) that apply to
    loaded sections (e: the blob's elfview.ElfView)."""
    out = []
    secs = e.sections
    symbols = None
    for sec in secs:
        if sec.type != SHT_RELA or sec.name == ".rela.dyn" or not sec.info or sec.info >= len(secs):
            continue
        target = secs[sec.info]
        if not target.flags & SHF_ALLOC or target.type == SHT_NOBITS:
            continue
        if symbols is None:
            symbols = list(e.symbols_of(secs[sec.link])) if sec.link < len(secs) else []
        for off, sym, typ, addend in relas(e.data, sec.offset, sec.size):
            if sym >= len(symbols):
                raise e.error(f"link: a relocation at {off:#x} names symbol #{sym}, not in the symbol table")
            s = symbols[sym]
            out.append(LinkReloc(off, typ, s.value, s.shndx == SHN_ABS, s.name, addend))
    return sorted(out, key=lambda r: r.offset)

"""Stage 1: load the image.

Reads an ELF file's headers, sections, segments, symbols and dynamic entries
through elfview.ElfView, and keeps its raw bytes.  LIEF (image.binary: its
relocations, and the symbols of an image whose tables ElfView does not read as
LIEF would) is imported and parses the file only when first asked: importing it
is a third of a rewrite's start-up.  A container the
ELF travels in (a kernel's bzImage) is the target's to open: targets.load()
unwraps it and hands the ELF bytes here.  Function bounds come from symbol sizes (.symtab, then
.dynsym), else from .eh_frame FDEs, the way the kernel's kallsyms gives
can_optimize() a function's size.
"""
from __future__ import annotations

import bisect
import io
import os
import struct
from dataclasses import dataclass, field

from . import ehframe
from ..arch import MACHINES, get_arch
from .view import (PF_R, PF_W, PF_X, PT_DYNAMIC, PT_INTERP, PT_LOAD, PT_NOTE, PT_PHDR, SHF_ALLOC, SHF_EXECINSTR,  # noqa: F401
                   SHF_WRITE, SHT_DYNSYM, SHT_SYMTAB, ElfView, Section, Segment, relas)
from ..errors import KprewriteError, file_error

STT_NOTYPE, STT_OBJECT, STT_FUNC, STT_GNU_IFUNC = 0, 1, 2, 10
SHT_DYNAMIC = 6
DT_SYMTAB, DT_SYMENT = 6, 11
DT_RELRSZ, DT_RELR = 35, 36

DF_1_PIE = 0x08000000
EM_NAMES = {3: "EM_386", 40: "EM_ARM", 62: "EM_X86_64", 183: "EM_AARCH64", 243: "EM_RISCV"}


def text(name) -> str:
    """A name as LIEF gives it: str, or bytes when it is not UTF-8 (a damaged string table)."""
    return name if isinstance(name, str) else bytes(name).decode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class _Sym:
    name: str
    value: int
    size: int
    type: int             # STT_*
    shndx: int


def _own_tables(elf: ElfView):
    """(.symtab's symbols, .dynsym's, the dynamic entries as {tag: value}) read by
    ElfView, as LIEF reads them; None when the image is not plain enough to be sure
    of that (no section headers, a table without its section or a section without its
    table, odd entry sizes, anything unreadable): then LIEF reads them."""
    try:
        secs = elf.sections
        if not secs:
            return None
        symtabs = [s for s in secs if s.type == SHT_SYMTAB]
        dynsyms = [s for s in secs if s.type == SHT_DYNSYM]
        if len(symtabs) > 1 or len(dynsyms) > 1 or any(s.entsize != 24 or s.size % 24 for s in symtabs + dynsyms):
            return None
        dyn_seg = elf.segment(PT_DYNAMIC)
        if dyn_seg is None and any(s.type == SHT_DYNAMIC for s in secs):
            return None
        entries = elf.dynamic()
        if dyn_seg is not None and dyn_seg.offset + dyn_seg.filesz > len(elf.data):
            return None
        dynamic = {}
        for tag, val in entries:
            dynamic[tag] = val
        if dyn_seg is not None:     # LIEF keeps the DT_NULL that ends the table as an entry
            end = dyn_seg.offset + 16 * len(entries)
            if end + 16 <= dyn_seg.offset + dyn_seg.filesz and elf.data[end:end + 8] == bytes(8):
                dynamic[0] = int.from_bytes(elf.data[end + 8:end + 16], "little")
        if (DT_SYMTAB in dynamic) != bool(dynsyms):
            return None
        if dynsyms and (dynsyms[0].addr != dynamic[DT_SYMTAB] or dynamic.get(DT_SYMENT, 24) != 24):
            return None
        tables = []
        for t in (symtabs, dynsyms):
            tables.append([_Sym(s.name, s.value, s.size, s.type, s.shndx) for s in elf.symbols_of(t[0])] if t else [])
        return tables[0], tables[1], dynamic
    except Exception:       # malformed: LIEF's reading (and its errors) as before
        return None


@dataclass
class Function:
    name: str             # symbol name, or sub_<hex> for an FDE without a symbol
    start: int
    end: int              # exclusive
    source: str           # "symtab", "dynsym" or "eh_frame"
    aliases: list[str] = field(default_factory=list)


class Image:
    """A loaded ELF image: raw bytes plus what the pipeline needs to know of it."""

    _last_span = (0, 0, 0)          # read()'s segment before: (lo, hi, file offset of lo)

    def __init__(self, path: str, data: bytes | None = None, container=None):
        """The ELF file at `path`; `data`: its bytes when already read or unwrapped from
        `container` (what the target's unwrap() found it in; see targets.load())."""
        self.path = path
        self.label = os.path.basename(path)
        if data is None:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise file_error(path, e) from None
        self.data = data
        # A container the image travels in (a kernel's bzImage): its ELF is what we read.
        self.container = container
        self.target = None            # the target module, once targets.load() detected it
        self.elf = ElfView(self.data, path)
        self._check_header()
        self.segments = self.elf.segments
        self._check_loads()
        self._binary = None
        own = self._own = _own_tables(self.elf)
        if own is None:            # LIEF reads what ElfView does not read as it would
            binary = self.binary
            symtabs = ([_Sym(text(s.name), s.value, s.size, int(s.type), s.shndx) for s in syms]
                       for syms in (binary.symtab_symbols, binary.dynamic_symbols))
            self._symtab, self._dynsym = symtabs
            dynamic = {int(e.tag): e.value for e in binary.dynamic_entries} if binary.dynamic_entries else {}
        else:
            self._symtab, self._dynsym, dynamic = own
        self.is_pic = self.e_type == 3
        self.sections = self.elf.sections
        self.has_interp = any(s.type == PT_INTERP for s in self.segments)
        self.dynamic = dynamic
        flags_1 = self.dynamic.get(0x6FFFFFFB, 0)
        # A program runs from e_entry; a shared object starts from its init functions when a
        # dynamic loader loads it.  A shared object with a PT_INTERP and no DF_1_PIE (glibc's
        # libc.so.6, which prints its version when run) is both: started either way.
        self.is_executable = self.e_type == 2 or self.has_interp or bool(flags_1 & DF_1_PIE)
        self.is_shared = self.e_type == 3 and not flags_1 & DF_1_PIE
        self.kind = ("shared object" if self.is_shared else
                     ("PIE" if self.has_interp else "static-PIE") if self.is_pic else
                     ("executable" if self.has_interp else "static executable"))
        self.exec_ranges = sorted((s.addr, s.addr + s.size) for s in self.sections if s.executable and s.size)
        if not self.exec_ranges:
            self.exec_ranges = sorted((s.vaddr, s.vaddr + s.filesz) for s in self.segments
                                      if s.type == PT_LOAD and s.flags & PF_X)
        self._load_symbols()
        self.fdes = ehframe.read_fdes(self.elf)
        self.cfa = ehframe.CfaRules(self.data)        # decoded when first asked
        self._load_functions()

    @property
    def binary(self):
        """The image parsed by LIEF, on first use."""
        if self._binary is None:
            import lief
            lief.logging.disable()
            binary = lief.ELF.parse(io.BytesIO(self.data) if self.container else self.path)
            if binary is None:
                raise KprewriteError(f"{self.path}: not a valid ELF file")
            self._binary = binary
        return self._binary

    # -- validation (the view checks the tables' bounds) --------------------------
    def _check_header(self):
        elf, p = self.elf, self.path
        self.e_type = elf.e_type
        machine = elf.e_machine
        if machine not in MACHINES:
            known = ", ".join(f"{a.replace('_', '-')} ({EM_NAMES.get(m, m)})" for m, a in sorted(MACHINES.items()))
            raise KprewriteError(f"{p}: ELF machine is {EM_NAMES.get(machine, machine)}; kprewrite supports {known}")
        if self.e_type == 1:    # a module target would have unwrapped a .ko (.gnu.linkonce.this_module)
            raise KprewriteError(f"{p}: a relocatable object that is not a readable kernel module (no "
                                 ".gnu.linkonce.this_module section in its section headers: truncated, or not a .ko)")
        if self.e_type not in (2, 3):
            raise KprewriteError(f"{p}: ELF type {self.e_type} is neither an executable nor a shared object")
        if elf.phnum == 0:
            raise KprewriteError(f"{p}: truncated ELF file (program headers end at {elf.phoff:#x}, "
                                 f"file is {len(self.data):#x} bytes)")
        self.machine = MACHINES[machine]

    def _check_loads(self):
        if not self.elf.loads:
            raise KprewriteError(f"{self.path}: no PT_LOAD segment: nothing is loaded from this ELF file")

    # -- symbols and functions ---------------------------------------------
    def _load_symbols(self):
        self.symbols: dict[str, list[int]] = {}    # name -> addresses
        self.func_syms: list[tuple[int, int, str, str]] = []   # (start, size, name, source)
        self.code_symbols: list[int] = []
        for source, syms in (("symtab", self._symtab), ("dynsym", self._dynsym)):
            for s in syms:
                name = s.name
                if not name or s.shndx == 0 or s.value == 0 and s.type != STT_FUNC:
                    continue
                t = s.type
                if t in (STT_FUNC, STT_GNU_IFUNC):
                    if s.value and self.is_code(s.value):
                        self.func_syms.append((s.value, s.size, name, source))
                        self.symbols.setdefault(name, [])
                        if s.value not in self.symbols[name]:
                            self.symbols[name].append(s.value)
                elif t in (STT_NOTYPE, STT_OBJECT):
                    if self.is_code(s.value):
                        self.code_symbols.append(s.value)
                        if t == STT_NOTYPE:
                            self.symbols.setdefault(name, []).append(s.value)

    def _load_functions(self):
        by_start: dict[int, Function] = {}
        for start, size, name, source in self.func_syms:
            f = by_start.get(start)
            if f is None:
                if size == 0:
                    continue
                by_start[start] = Function(name, start, start + size, source)
            elif name != f.name and name not in f.aliases:
                f.aliases.append(name)
        funcs = sorted(by_start.values(), key=lambda f: f.start)
        starts = [f.start for f in funcs]
        # FDEs cover what symbols don't: stripped binaries, local functions.
        for fde in self.fdes:
            i = bisect.bisect_right(starts, fde.start) - 1
            if i >= 0 and funcs[i].start <= fde.start < funcs[i].end:
                continue
            j = bisect.bisect_left(starts, fde.start)
            if j < len(funcs) and funcs[j].start < fde.end:
                continue
            if not self.is_code(fde.start):
                continue
            f = Function(f"sub_{fde.start:x}", fde.start, fde.end, "eh_frame")
            funcs.insert(j, f)
            starts.insert(j, fde.start)
        # Sized symbols with no sized twin: a zero-size symbol at an FDE start names it.
        named = {f.start: f for f in funcs if f.source == "eh_frame"}
        for start, size, name, source in self.func_syms:
            if size == 0 and start in named:
                f = named[start]
                if f.name.startswith("sub_"):
                    f.name, f.source = name, source
                elif name not in f.aliases and name != f.name:
                    f.aliases.append(name)
                self.symbols.setdefault(name, [])
        self.functions = funcs
        self._starts = starts

    def set_functions(self, funcs: list[tuple[int, int, str]], source: str) -> None:
        """Functions from another symbol source (a kernel's kallsyms or System.map):
        (start, end, name), several names at one start being aliases."""
        by_start: dict[int, Function] = {}
        self.symbols = {}
        for start, end, name in sorted(funcs):
            f = by_start.get(start)
            if f is None:
                by_start[start] = Function(name, start, end, source)
            elif name != f.name and name not in f.aliases:
                f.aliases.append(name)
            self.symbols.setdefault(name, [])
            if start not in self.symbols[name]:
                self.symbols[name].append(start)
        self.functions = sorted(by_start.values(), key=lambda f: f.start)
        self._starts = [f.start for f in self.functions]
        self.code_symbols = []

    def all_symbols(self) -> dict[str, int]:
        """Every named, defined symbol of .symtab and .dynsym: name -> its first address."""
        out: dict[str, int] = {}
        for syms in (self._symtab, self._dynsym):
            for s in syms:
                if s.name and s.shndx != 0:
                    out.setdefault(s.name, s.value)
        return out

    def elf_symbols(self):
        """Every symbol of .symtab, then of .dynsym (name, value, size, type, shndx)."""
        return (s for syms in (self._symtab, self._dynsym) for s in syms)

    def symbol_names(self) -> set[str]:
        """Every symbol name of .symtab and .dynsym, defined or not (an import names
        what the image calls)."""
        return {s.name for s in self.elf_symbols() if s.name}

    # -- queries -----------------------------------------------------------
    def is_code(self, addr: int) -> bool:
        for lo, hi in self.exec_ranges:
            if lo <= addr < hi:
                return True
        return False

    def function_at(self, addr: int) -> Function | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and self.functions[i].start <= addr < self.functions[i].end:
            return self.functions[i]
        return None

    def function_span(self, addr: int) -> tuple[Function | None, int]:
        """function_at(addr), and where its answer next may change: it is the same for
        every address from addr up to that one (a sweep over sorted addresses asks once
        per function, not once per address)."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and self.functions[i].start <= addr < self.functions[i].end:
            f = self.functions[i]
            return f, f.end if i + 1 == len(self._starts) else min(f.end, self._starts[i + 1])
        return None, addr + 1

    def function_named(self, name: str) -> Function | None:
        for a in self.symbols.get(name, []):
            f = self.function_at(a)
            if f is not None and f.start == a:
                return f
        return None

    def section_named(self, name: str) -> Section | None:
        for s in self.sections:
            if s.name == name:
                return s
        return None

    def offset_of(self, addr: int) -> int:
        return self.elf.offset_of(addr)

    def read(self, addr: int, size: int) -> bytes:
        """The bytes from addr on, at most `size` (fewer at the end of the file).  The
        load segment of the read before is tried first: a rewrite of libpython reads
        130,000 times, most in sweeps over sorted addresses of one segment."""
        lo, hi, off = self._last_span
        if not lo <= addr < hi:
            for span in self.elf.load_spans:
                if span[0] <= addr < span[1]:
                    lo, hi, off = self._last_span = span
                    break
            else:
                off = self.offset_of(addr)
                return self.data[off:off + size]
        off += addr - lo
        return self.data[off:off + size]

    def section_containing(self, addr: int) -> Section | None:
        for s in self.sections:
            if s.flags & SHF_ALLOC and s.addr <= addr < s.addr + s.size:
                return s
        return None

    def symbol_relocations(self) -> list[tuple[int, int, str]]:
        """(r_offset, type (the ELF r_type: r_info's low 32 bits), symbol name, "" for none)
        of every relocation: the DT_RELA and DT_JMPREL tables' entries, read here with
        .dynsym's names where the image allows; else LIEF's list of the image's relocations
        (an image whose tables LIEF reads, see _own_tables, or whose tables are not RELA)."""
        out = self._own_symbol_relocations()
        if out is not None:
            return out
        # LIEF tags its type with the arch in the bits above 27: the ELF r_type is below.
        return [(r.address, int(r.type) & 0x7FFFFFF, r.symbol.name if r.has_symbol else "")
                for r in self.binary.relocations]

    def _own_symbol_relocations(self) -> list[tuple[int, int, str]] | None:
        if self._own is None or self.dynamic.get(20, 7) != 7:       # DT_PLTREL: DT_RELA
            return None
        syms = self._dynsym
        out = []
        for tag_at, tag_sz in ((7, 8), (23, 2)):          # DT_RELA/DT_RELASZ, DT_JMPREL/DT_PLTRELSZ
            at, size = self.dynamic.get(tag_at), self.dynamic.get(tag_sz)
            if not at or not size:
                continue
            off = self.elf.offset(at, size)
            if off is None:
                return None
            for r_offset, i, typ, _ in relas(self.data, off, size):
                if i >= len(syms):
                    return None
                out.append((r_offset, typ, syms[i].name))
        return out

    def relative_relocations(self) -> list[tuple[int, int, int]]:
        """(file offset of the Elf64_Rela, r_offset, addend) of every base-relative
        relocation (the arch's r_relative), read once: the analysis, the blacklist, the
        return probes' exits and the ftrace sites each ask (libpython: 40,000)."""
        got = self.__dict__.get("_relative_relocations")
        if got is None:
            got = self._relative_relocations = self._read_relative_relocations()
        return got

    def _read_relative_relocations(self) -> list[tuple[int, int, int]]:
        r_relative = get_arch(self.machine).r_relative
        out = self._relr_relocations()
        for tag_rela, tag_sz in ((7, 8),):
            rela, size = self.dynamic.get(tag_rela), self.dynamic.get(tag_sz)
            if not rela or not size:
                continue
            off = self.offset_of(rela)
            if off + size > len(self.data):     # a damaged DT_RELASZ: ld.so would read past the file too
                raise KprewriteError(f"{self.path}: malformed dynamic section: DT_RELA at {rela:#x} with DT_RELASZ "
                                     f"{size:#x} runs past the end of the file ({len(self.data):#x} bytes)")
            for i, (r_offset, _, typ, addend) in enumerate(relas(self.data, off, size)):
                if typ == r_relative:
                    out.append((off + i * 24, r_offset, addend))
        return out

    def relr_offsets(self) -> list[int]:
        """The addresses DT_RELR relocates (ld -z pack-relative-relocs: glibc 2.36's own
        libc): an even entry is an address, an odd one a bitmap of the 63 words after
        the last address (bit i + 1: the word at i * 8), which then moves 63 words on."""
        got = self.__dict__.get("_relr_offsets")
        if got is not None:
            return got
        relr, size = self.dynamic.get(DT_RELR), self.dynamic.get(DT_RELRSZ)
        out: list[int] = []
        if relr and size:
            off = self.elf.offset(relr, size)
            if off is None:
                raise KprewriteError(f"{self.path}: malformed dynamic section: DT_RELR at {relr:#x} with DT_RELRSZ "
                                     f"{size:#x} runs past the end of the file ({len(self.data):#x} bytes)")
            where = 0
            for (e,) in struct.iter_unpack("<Q", self.data[off:off + size // 8 * 8]):
                if not e & 1:
                    out.append(e)
                    where = e + 8
                    continue
                bits, at = e >> 1, where
                while bits:
                    if bits & 1:
                        out.append(at)
                    bits >>= 1
                    at += 8
                where += 63 * 8
        self._relr_offsets = out
        return out

    def _relr_relocations(self) -> list[tuple[int, int, int]]:
        """relative_relocations()' entries of DT_RELR: (file offset of the relocated word,
        its address, the word: a packed relocation's addend is what the word holds)."""
        out = []
        for addr in self.relr_offsets():
            off = self.elf.offset(addr, 8)
            if off is None:             # in .bss: nothing to read (ld.so would fault on it too)
                continue
            out.append((off, addr, int.from_bytes(self.data[off:off + 8], "little", signed=True)))
        return out

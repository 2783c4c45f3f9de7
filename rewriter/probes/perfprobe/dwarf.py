"""Debug information for probe points by name: functions, lines, variables and
their locations, read from DWARF 4 and 5 with pyelftools.

What tools/perf/util/probe-finder.c does with libdw, ahead of time: find the
instances of a function (its out-of-line copy and its inlined sites), the addresses
of a source line, the variables in scope at an address.  Where each variable is
there is dwarfloc.py's (convert_variable_location()); the DIE and type helpers are
dwarfaux.py's (dwarf-aux.c), the debug file's finding debugfile.py's.

The debug information is the image's own `.debug_*` sections (compressed or
not: pyelftools decompresses SHF_COMPRESSED and .zdebug sections), or a separate
file found as perf and gdb find it: by build-id under /usr/lib/debug/.build-id/,
or by .gnu_debuglink next to the image, in its .debug/ folder or under
/usr/lib/debug.  KPREWRITE_DEBUG_FILE_DIRECTORY (colon-separated, gdb's
`set debug-file-directory`) names other roots instead of /usr/lib/debug: a -dbgsym
package extracted with dpkg-deb -x rather than installed.  A target may name more
files under those roots (a kernel: boot/vmlinux-RELEASE, where Debian's
linux-image-*-dbg puts it, as perf's vmlinux_path does); KPREWRITE_DEBUG_FILE names
the file itself.  A separate file whose build-id differs from the image's is not
used (gdb and perf check it too).

A kernel's DWARF is large (Debian's 6.1 vmlinux: 164 MB of .debug_info in 2,172
compilation units), too large to index whole with pyelftools.  There DebugInfo
reads it by address (`by_address`): a function's symbol gives its address (the
debug file's .symtab), .debug_aranges the compilation unit that holds it, and only
that unit's DIEs and line program are read; a source file named as SRC:ALN is the
unit whose DW_AT_name it is (an index of the units' names, cached).  Copies of a
function inlined into other units are therefore not found there, nor globals
defined in other units.
"""
from __future__ import annotations

import bisect
import io
import json
import os
import struct
from dataclasses import dataclass

from elftools.dwarf.ranges import BaseAddressEntry as RangeBase, RangeEntry
from elftools.elf.elffile import ELFFile

# The debug file's finding, the DIE and type helpers, the locations and .debug_frame are
# modules of their own (perf's probe-finder.c beside dwarf-aux.c); their names stay
# reachable here.
from .debugfile import (DEBUG_DIR_ENV, DEBUG_FILE_ENV, DEBUG_ROOT, NoDebugInfo, build_id,  # noqa: F401
                        debug_roots, find_debug_file)
from .dwarfaux import (_attr, _origin_type, array_count, byte_size, die_name, encoding, member,  # noqa: F401
                       strip, target, type_name)
from .dwarfloc import Loc, Locations, Unavailable, addr_value, cu_base  # noqa: F401


@dataclass
class Instance:
    """One copy of a function's code: its out-of-line body or an inlined site."""
    name: str
    die: object
    cu: object
    ranges: list[tuple[int, int]]
    entry: int
    decl_file: str | None
    decl_line: int
    frame: object                 # the concrete DW_TAG_subprogram, whose DW_AT_frame_base applies
    inlined: bool
    optimized: bool               # the CU was compiled with optimization (no prologue skip)

    def contains(self, addr: int) -> bool:
        return any(lo <= addr < hi for lo, hi in self.ranges)


@dataclass
class Var:
    name: str
    die: object
    type: object                  # the DW_AT_type DIE, or None
    param: bool


@dataclass
class LineRow:
    addr: int
    file: str
    line: int


class DebugInfo:
    """The DWARF of one image (or of its separate debug file).  by_address: read it
    one compilation unit at a time, found by address (a kernel's; see the module's
    docstring); names: more debug file names under the debug roots (the target's)."""

    def __init__(self, path: str, data: bytes, regs: dict[int, str], reg_names: dict[int, str] | None = None,
                 *, names=(), by_address: bool = False, group: str | None = None):
        # regs: DWARF register numbers fetch args read; reg_names: others, named in errors
        self.path, self.regs, self.reg_names = path, regs, reg_names or {}
        self._data = data
        self.by_address = by_address
        self.group = group            # the default event group (a kernel's: perf's "probe")
        elf = ELFFile(io.BytesIO(data))
        self.source = path
        self.image_has_eh_frame = elf.get_section_by_name(".eh_frame") is not None
        if not elf.has_dwarf_info() or elf.get_section_by_name(".debug_info") is None and \
                elf.get_section_by_name(".zdebug_info") is None:
            found = find_debug_file(path, elf, names)
            if found is None:
                raise NoDebugInfo(f"{os.path.basename(path)} has no DWARF debug information "
                                  f"(.debug_info), and no separate debug file was found "
                                  f"(build-id or .gnu_debuglink under {':'.join(debug_roots())}); compile with -g")
            elf, self.source = found
        self.elf = elf
        # A linked file's .rela.debug_* (ld --emit-relocs, a kernel's) are already applied
        self.dwarf = elf.get_dwarf_info(relocate_dwarf_sections=elf["e_type"] == "ET_REL")
        self.locations = Locations(self.dwarf, data, regs, self.reg_names, self.image_has_eh_frame)
        self._instances: dict[str, list[Instance]] | None = None
        self._all: list[Instance] = []
        self._globals: dict[str, object] = {}
        self._lines: dict[int, list[LineRow]] = {}
        self._raw_lines: dict[int, list[LineRow]] = {}
        self._sources: dict[str, list[str] | None] = {}
        self._loaded: dict[int, object] = {}       # by_address: the units read, by offset
        self._aranges = None
        self._symtab = None
        self._cu_names = None
        self.cus = [] if by_address else list(self.dwarf.iter_CUs())

    def cfa(self, addr: int):
        """The CFA rule at addr (the frame base of DW_OP_call_frame_cfa)."""
        return self.locations.cfa(addr)

    # --- by address: symbols, .debug_aranges, units read one at a time -----------------------------

    def symbols(self) -> tuple[dict[str, list[int]], list[tuple[int, int, str]]]:
        """The debug file's function symbols: name -> addresses, and (start, size, name) sorted."""
        if self._symtab is None:
            self._symtab = _func_symbols(self.elf)
        return self._symtab

    def symbol_at(self, addr: int) -> tuple[str, int, bool] | None:
        """(function symbol, its start, whether its name is unique) covering addr."""
        by_name, spans = self.symbols()
        i = bisect.bisect_right(spans, (addr, 1 << 64, "")) - 1
        if i < 0:
            return None
        start = spans[i][0]
        j = i
        while j > 0 and spans[j - 1][0] == start:
            j -= 1
        cands = [(n, sz) for st, sz, n in spans[j:i + 1] if addr < start + max(sz, 1)]
        if not cands:
            return None
        name = min(cands, key=lambda c: (len(by_name.get(c[0], ())) != 1, c[0]))[0]
        return name, start, len(by_name.get(name, ())) == 1

    def _load_cu(self, cu) -> None:
        if cu.cu_offset in self._loaded:
            return
        self._loaded[cu.cu_offset] = cu
        self.cus.append(cu)
        if self._instances is None:
            self._instances = {}
        self._walk(cu.get_top_DIE(), cu, None, self._optimized(cu))

    def _load_at(self, addr: int) -> bool:
        """Read the unit whose code holds addr (.debug_aranges); False if none does."""
        if self._aranges is None:
            self._aranges = self.dwarf.get_aranges() or False
        off = self._aranges.cu_offset_at_addr(addr) if self._aranges else None
        if off is None:
            return False
        self._load_cu(self.dwarf.get_CU_at(off))
        return True

    def units_named(self, src: str) -> list:
        """The units whose own source file (DW_AT_name) SRC names, read (by_address)."""
        names = self._unit_names()
        offs = [o for n, os_ in names.items() if _tail_match(n, src) for o in os_]
        for o in offs:
            self._load_cu(self.dwarf.get_CU_at(o))
        return [self._loaded[o] for o in offs]

    def _unit_names(self) -> dict[str, list[int]]:
        """DW_AT_name -> unit offsets, made once per debug file (some 20 s for a kernel's
        2,000 units) and kept in kprewrite's cache."""
        if self._cu_names is not None:
            return self._cu_names
        from ... import cache
        st = os.stat(self.source)
        k = cache.key(b"perfprobe-unit-names-1", os.path.abspath(self.source).encode(),
                      str((st.st_size, st.st_mtime_ns)).encode(), (build_id(self.elf) or "").encode())
        raw = cache.get("perfprobe-units", k)
        if raw is not None:
            try:
                self._cu_names = json.loads(raw)
                return self._cu_names
            except ValueError:
                pass
        out: dict[str, list[int]] = {}
        for cu in self.dwarf.iter_CUs():
            a = cu.get_top_DIE().attributes.get("DW_AT_name")
            if a is not None:
                n = a.value.decode("utf-8", "replace") if isinstance(a.value, bytes) else str(a.value)
                out.setdefault(os.path.normpath(n), []).append(cu.cu_offset)
        cache.put("perfprobe-units", k, json.dumps(out, sort_keys=True).encode())
        self._cu_names = out
        return out

    # --- functions ---------------------------------------------------------------------------------

    def ranges(self, die) -> list[tuple[int, int]]:
        at = die.attributes
        cu = die.cu
        if "DW_AT_low_pc" in at and "DW_AT_high_pc" in at:
            lo = addr_value(self.dwarf, cu, at["DW_AT_low_pc"])
            hi = at["DW_AT_high_pc"]
            hv = addr_value(self.dwarf, cu, hi) if hi.form.startswith("DW_FORM_addr") else lo + hi.value
            return [(lo, hv)] if hv > lo else []
        if "DW_AT_ranges" in at:
            rl = self.dwarf.range_lists()
            if rl is None:
                return []
            base, out = cu_base(self.dwarf, cu), []
            for e in rl.get_range_list_at_offset(at["DW_AT_ranges"].value, cu=cu):
                if isinstance(e, RangeBase):
                    base = e.base_address
                elif isinstance(e, RangeEntry):
                    lo, hi = (e.begin_offset, e.end_offset) if e.is_absolute else \
                        (base + e.begin_offset, base + e.end_offset)
                    if hi > lo:
                        out.append((lo, hi))
            return sorted(out)
        return []

    def _file_name(self, cu, index: int) -> str | None:
        lp = self.dwarf.line_program_for_CU(cu)
        if lp is None:
            return None
        files, dirs = lp["file_entry"], lp["include_directory"]
        v5 = lp.header["version"] >= 5
        i = index if v5 else index - 1
        if not 0 <= i < len(files):
            return None
        fe = files[i]
        name = fe.name.decode("utf-8", "replace") if isinstance(fe.name, bytes) else fe.name
        di = fe.dir_index if v5 else fe.dir_index - 1
        if di >= 0 and di < len(dirs) and not os.path.isabs(name):
            d = dirs[di]
            d = d.decode("utf-8", "replace") if isinstance(d, bytes) else d
            name = os.path.join(d, name)
        if not os.path.isabs(name):
            comp = cu.get_top_DIE().attributes.get("DW_AT_comp_dir")
            if comp is not None:
                c = comp.value.decode("utf-8", "replace") if isinstance(comp.value, bytes) else comp.value
                name = os.path.join(c, name)
        return os.path.normpath(name)

    def _optimized(self, cu) -> bool:
        """Whether the CU was compiled with optimization: gcc records its switches in
        DW_AT_producer; without them, a CU using location lists or entry values is."""
        prod = cu.get_top_DIE().attributes.get("DW_AT_producer")
        if prod is not None:
            p = prod.value.decode("utf-8", "replace") if isinstance(prod.value, bytes) else str(prod.value)
            opts = [w for w in p.split() if w.startswith("-O")]
            if opts:
                return opts[-1] not in ("-O0",)
            if " -g" in p or "GNU" in p:
                return False
        return True

    def _index(self) -> None:
        if self._instances is not None:
            return
        self._instances = {}
        if self.by_address:
            return                     # units are read as addresses name them (_load_at)
        for cu in self.cus:
            top = cu.get_top_DIE()
            opt = self._optimized(cu)
            self._walk(top, cu, None, opt)

    def _walk(self, die, cu, frame, opt) -> None:
        for child in die.iter_children():
            tag = child.tag
            if tag == "DW_TAG_subprogram":
                rng = self.ranges(child)
                if rng:
                    self._add(child, cu, rng, child, False, opt)
                    self._walk(child, cu, child, opt)
                elif die.tag in ("DW_TAG_compile_unit", "DW_TAG_partial_unit", "DW_TAG_namespace",
                                 "DW_TAG_structure_type", "DW_TAG_class_type"):
                    self._walk(child, cu, frame, opt)
            elif tag == "DW_TAG_inlined_subroutine" and frame is not None:
                rng = self.ranges(child)
                if rng:
                    self._add(child, cu, rng, frame, True, opt)
                self._walk(child, cu, frame, opt)
            elif tag == "DW_TAG_lexical_block" and frame is not None:
                self._walk(child, cu, frame, opt)
            elif tag == "DW_TAG_namespace":
                self._walk(child, cu, frame, opt)
            elif tag == "DW_TAG_variable" and frame is None:
                name = die_name(child)
                if name and "DW_AT_location" in child.attributes and name not in self._globals:
                    self._globals[name] = child

    def _add(self, die, cu, rng, frame, inlined, opt) -> None:
        name = die_name(die)
        if not name:
            return
        entry = rng[0][0]
        ep = die.attributes.get("DW_AT_entry_pc")
        if ep is not None:
            entry = addr_value(self.dwarf, cu, ep) if ep.form.startswith("DW_FORM_addr") else cu_base(self.dwarf, cu) + ep.value
        elif "DW_AT_low_pc" in die.attributes:
            entry = addr_value(self.dwarf, cu, die.attributes["DW_AT_low_pc"])
        f = _attr(die, "DW_AT_decl_file")
        origin = die
        if "DW_AT_abstract_origin" in die.attributes:
            origin = die.get_DIE_from_attribute("DW_AT_abstract_origin")
        fcu = origin.cu if f is not None and "DW_AT_decl_file" not in die.attributes else cu
        decl_file = self._file_name(fcu, f.value) if f is not None else None
        ln = _attr(die, "DW_AT_decl_line")
        inst = Instance(name, die, cu, rng, entry, decl_file, ln.value if ln is not None else 0,
                        frame, inlined, opt)
        self._instances.setdefault(name, []).append(inst)
        self._all.append(inst)

    def instances(self, name: str, src: str | None = None) -> list[Instance]:
        """The function's instances; by_address, those of the units holding its symbols
        (and its clones', NAME.part.N, NAME.isra.N), or with no symbol, of SRC's unit."""
        self._index()
        if self.by_address:
            by_name, _ = self.symbols()
            addrs = [a for n, v in by_name.items() if n == name or n.startswith(name + ".") for a in v]
            for a in addrs:
                self._load_at(a)
            if not addrs and src is not None:
                self.units_named(src)
        return sorted(self._instances.get(name, []), key=lambda i: i.entry)

    def cu_instances(self, cu) -> list[Instance]:
        """Every instance (out-of-line and inlined) of the unit's functions."""
        self._index()
        return [x for x in self._all if x.cu.cu_offset == cu.cu_offset]

    def call_site(self, inst: Instance) -> tuple[str, int] | None:
        """(file, line) an inlined instance was called from (DW_AT_call_file/_line)."""
        at = inst.die.attributes
        if "DW_AT_call_file" not in at or "DW_AT_call_line" not in at:
            return None
        f = self._file_name(inst.cu, at["DW_AT_call_file"].value)
        return (f, at["DW_AT_call_line"].value) if f is not None else None

    def function_names(self) -> list[str]:
        self._index()
        return sorted(self._instances)

    def innermost(self, addr: int) -> Instance | None:
        """The innermost instance (an inlined site rather than its caller) at addr."""
        self._index()
        if self.by_address:
            self._load_at(addr)
        best = None
        for inst in self._all:
            if inst.contains(addr):
                if best is None or _size(inst) < _size(best):
                    best = inst
        return best

    # --- lines ---------------------------------------------------------------------------------------

    def lines(self, cu) -> list[LineRow]:
        """The line table's statement rows that start a line: the first row of each
        run of rows of one line, as debuggers set a breakpoint on a line."""
        rows = self._lines.get(cu.cu_offset)
        if rows is not None:
            return rows
        rows, raw = [], []
        lp = self.dwarf.line_program_for_CU(cu)
        names: dict[int, str | None] = {}
        prev = None
        for e in (lp.get_entries() if lp is not None else []):
            st = e.state
            if st is None:
                continue
            if st.end_sequence:
                prev = None
                continue
            key = (st.file, st.line)
            if st.is_stmt and st.line:
                if st.file not in names:
                    names[st.file] = self._file_name(cu, st.file)
                if names[st.file] is not None:
                    row = LineRow(st.address, names[st.file], st.line)
                    raw.append(row)
                    if key != prev:
                        rows.append(row)
            prev = key
        self._lines[cu.cu_offset] = rows
        self._raw_lines[cu.cu_offset] = raw
        return rows

    def statement_rows(self, cu) -> list[LineRow]:
        """Every statement row of the line table (a line's later rows too)."""
        self.lines(cu)
        return self._raw_lines[cu.cu_offset]

    def source_line(self, path: str, line: int) -> str | None:
        """Line `line` of a source file, as the line table names it (None if unreadable)."""
        if path not in self._sources:
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    self._sources[path] = f.read().split("\n")
            except OSError:
                self._sources[path] = None
        text = self._sources[path]
        return text[line - 1] if text is not None and 0 < line <= len(text) else None

    def line_rows(self, src: str):
        """The line rows of the units that may hold lines of SRC (by_address: SRC's own
        unit, a header's lines are in every unit that includes it)."""
        cus = self.cus
        if self.by_address:
            cus = self.units_named(src)
            if not cus:
                raise NoDebugInfo(f"no compilation unit of {os.path.basename(self.source)} is '{src}': in a "
                                  f"kernel, SRC:ALN names a unit's own source file (a .c file); a header's "
                                  f"lines are probed as FUNC@SRC:RLN or FUNC:RLN")
        for cu in cus:
            for r in self.lines(cu):
                yield cu, r

    # --- variables --------------------------------------------------------------------------------

    def scope(self, inst: Instance, addr: int) -> list[Var]:
        """Parameters and locals of inst visible at addr, outermost first (an inner
        block's variable shadows an outer one of the same name)."""
        out: list[Var] = []

        def walk(die, top):
            for c in die.iter_children():
                if c.tag in ("DW_TAG_formal_parameter", "DW_TAG_variable"):
                    name = die_name(c)
                    if name:
                        out.append(Var(name, c, _origin_type(c), c.tag == "DW_TAG_formal_parameter" and top))
                elif c.tag == "DW_TAG_lexical_block":
                    rng = self.ranges(c)
                    if not rng or any(lo <= addr < hi for lo, hi in rng):
                        walk(c, False)
        walk(inst.die, True)
        seen: dict[str, Var] = {}
        for v in out:
            seen.pop(v.name, None)
            seen[v.name] = v
        return list(seen.values())

    def global_var(self, name: str):
        self._index()
        return self._globals.get(name)

    def location(self, var_die, inst: Instance | None, addr: int) -> Loc:
        """Where the variable is at addr (dwarfloc.Locations); Unavailable if nowhere a
        fetch arg can read."""
        return self.locations.location(var_die, inst, addr)


def _tail_match(path: str, want: str) -> bool:
    """strtailcmp(): SRC names a file by a tail of its path."""
    want = os.path.normpath(want)
    return path == want or path.endswith("/" + want.lstrip("/")) or want.endswith("/" + path.lstrip("/")) \
        or os.path.basename(path) == want


def _func_symbols(elf):
    """The function symbols of an ELF's .symtab, read with struct (a kernel's 150,000
    symbols: pyelftools' symbol objects take seconds): name -> addresses, and the
    (start, size, name) list sorted by start."""
    sec = elf.get_section_by_name(".symtab")
    if sec is None or elf.elfclass != 64 or not elf.little_endian:
        by_name: dict[str, list[int]] = {}
        spans = []
        if sec is not None:
            for sym in sec.iter_symbols():
                if sym["st_info"]["type"] == "STT_FUNC" and sym["st_shndx"] != "SHN_UNDEF" and sym.name:
                    by_name.setdefault(sym.name, []).append(sym["st_value"])
                    spans.append((sym["st_value"], sym["st_size"], sym.name))
        return by_name, sorted(spans)
    strtab = elf.get_section(sec["sh_link"]).data()
    data = sec.data()
    by_name, spans = {}, []
    for name_off, info, _other, shndx, value, size in struct.iter_unpack("<IBBHQQ", data):
        if info & 0xF != 2 or shndx == 0 or not name_off:      # STT_FUNC, defined
            continue
        end = strtab.index(b"\0", name_off)
        name = strtab[name_off:end].decode("utf-8", "replace")
        v = by_name.setdefault(name, [])
        if value not in v:
            v.append(value)
        spans.append((value, size, name))
    return by_name, sorted(spans)


def _size(inst: Instance) -> int:
    return sum(hi - lo for lo, hi in inst.ranges)

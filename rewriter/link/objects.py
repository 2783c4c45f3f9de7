"""What relocatable objects hold, read before linking: executable sections
(handlers' vector use), sized functions with their relocations (handler_abi),
and the symbols left for the image to provide."""
from __future__ import annotations

from pathlib import Path

# ELF constants of the objects read here (elf.view reads them; pyelftools is for DWARF and CFI).
_SHT_PROGBITS, _SHT_RELA, _SHF_EXECINSTR = 1, 4, 4
_STT_FUNC, _STB_GLOBAL, _STB_WEAK = 2, 1, 2
_SHN_UNDEF, _SHN_LORESERVE = 0, 0xFF00


def _view(obj: Path):
    from ..elf.view import ElfView
    return ElfView(Path(obj).read_bytes(), str(obj))


def executable_sections(obj: Path) -> list[bytes]:
    """The bytes of each executable section of a relocatable object."""
    try:
        e = _view(obj)
        return [e.section_bytes(s) for s in e.sections if s.type == _SHT_PROGBITS and s.flags & _SHF_EXECINSTR]
    except Exception:
        return []


def object_functions(objs: list[Path]) -> dict[str, tuple[int, bytes, dict[int, str]]]:
    """name -> (section offset, bytes, {section offset of a relocated field: the
    symbol it names}) of every sized function defined in the relocatable objects,
    each object read once: handler code is read before linking (handler_abi)."""
    from ..elf.view import relas
    out: dict[str, tuple[int, bytes, dict[int, str]]] = {}
    for obj in objs:
        e = _view(obj)
        st = e.section(".symtab")
        if st is None:
            continue
        table = list(e.symbols_of(st))
        # Symbols in a section of the object (not undefined, absolute or common).
        syms = [s for s in table if _SHN_UNDEF < s.shndx < _SHN_LORESERVE and s.name]
        # An alias (e.g. kp_handler_NAME) may carry no size: take its function's.
        sizes: dict[tuple[int, int], int] = {}
        for s in syms:
            if s.type == _STT_FUNC:
                key = (s.shndx, s.value)
                sizes[key] = max(sizes.get(key, 0), s.size)
        data: dict[int, bytes] = {}
        relocs: dict[int, dict[int, str]] = {}
        for sec in e.sections:
            if sec.type == _SHT_RELA and sec.info:
                named = relocs.setdefault(sec.info, {})
                for r_offset, sym, _type, _addend in relas(e.data, sec.offset, sec.size):
                    named[r_offset] = table[sym].name if sym < len(table) else ""
        for s in syms:
            size = s.size or sizes.get((s.shndx, s.value), 0)
            if not size or s.name in out:
                continue
            if s.shndx not in data:
                data[s.shndx] = e.section_bytes(e.sections[s.shndx])
            lo, hi = s.value, s.value + size
            out[s.name] = lo, data[s.shndx][lo:hi], \
                {o: n for o, n in relocs.get(s.shndx, {}).items() if lo <= o < hi}
    return out


def undefined_symbols(objs: list[Path], defined_elsewhere=frozenset()) -> dict[str, Path]:
    """name -> the first object that references it, for every global symbol no
    object defines (nor `defined_elsewhere`: the linker script's): what the image
    must provide."""
    defined, wanted = set(defined_elsewhere), {}
    for obj in objs:
        for sym in _view(obj).symbols():
            if not sym.name or sym.bind not in (_STB_GLOBAL, _STB_WEAK):
                continue
            if sym.shndx != _SHN_UNDEF:
                defined.add(sym.name)
            elif sym.bind == _STB_GLOBAL:
                wanted.setdefault(sym.name, obj)
    return {n: o for n, o in wanted.items() if n not in defined}


def object_defines(obj: Path, name: str) -> bool:
    """Whether a relocatable object defines the global or weak symbol `name`."""
    return any(s.name == name and s.shndx != _SHN_UNDEF and s.bind in (_STB_GLOBAL, _STB_WEAK)
               for s in _view(obj).symbols())


def machine(obj: Path) -> int:
    """An ELF object's e_machine (little-endian objects: those kprewrite builds)."""
    with open(obj, "rb") as f:
        return int.from_bytes(f.read(20)[18:20], "little")

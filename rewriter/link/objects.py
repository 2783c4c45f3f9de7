"""What relocatable objects hold, read before linking: executable sections
(handlers' vector use), sized functions with their relocations (handler_abi),
and the symbols left for the image to provide."""
from __future__ import annotations

from pathlib import Path



def executable_sections(obj: Path) -> list[bytes]:
    """The bytes of each executable section of a relocatable object."""
    try:
        with open(obj, "rb") as f:
            from elftools.elf.elffile import ELFFile   # imported when an object is read
            e = ELFFile(f)
            return [sec.data() for sec in e.iter_sections()
                    if sec["sh_type"] == "SHT_PROGBITS" and sec["sh_flags"] & 4]
    except Exception:
        return []


def object_functions(objs: list[Path]) -> dict[str, tuple[int, bytes, dict[int, str]]]:
    """name -> (section offset, bytes, {section offset of a relocated field: the
    symbol it names}) of every sized function defined in the relocatable objects,
    each object read once: handler code is read before linking (handler_abi)."""
    out: dict[str, tuple[int, bytes, dict[int, str]]] = {}
    for obj in objs:
        with open(obj, "rb") as f:
            from elftools.elf.elffile import ELFFile   # imported when an object is read
            e = ELFFile(f)
            st = e.get_section_by_name(".symtab")
            if st is None:
                continue
            syms = [s for s in st.iter_symbols() if isinstance(s["st_shndx"], int) and s.name]
            # An alias (e.g. kp_handler_NAME) may carry no size: take its function's.
            sizes: dict[tuple[int, int], int] = {}
            for s in syms:
                if s["st_info"]["type"] == "STT_FUNC":
                    key = (s["st_shndx"], s["st_value"])
                    sizes[key] = max(sizes.get(key, 0), s["st_size"])
            data: dict[int, bytes] = {}
            relocs: dict[int, dict[int, str]] = {}
            for sec in e.iter_sections():
                if sec["sh_type"] == "SHT_RELA" and sec["sh_info"]:
                    named = relocs.setdefault(sec["sh_info"], {})
                    for r in sec.iter_relocations():
                        named[r["r_offset"]] = st.get_symbol(r["r_info_sym"]).name
            for s in syms:
                size = s["st_size"] or sizes.get((s["st_shndx"], s["st_value"]), 0)
                if not size or s.name in out:
                    continue
                if s["st_shndx"] not in data:
                    data[s["st_shndx"]] = e.get_section(s["st_shndx"]).data()
                lo, hi = s["st_value"], s["st_value"] + size
                out[s.name] = lo, data[s["st_shndx"]][lo:hi], \
                    {o: n for o, n in relocs.get(s["st_shndx"], {}).items() if lo <= o < hi}
    return out


def undefined_symbols(objs: list[Path], defined_elsewhere=frozenset()) -> dict[str, Path]:
    """name -> the first object that references it, for every global symbol no
    object defines (nor `defined_elsewhere`: the linker script's): what the image
    must provide."""
    defined, wanted = set(defined_elsewhere), {}
    for obj in objs:
        with open(obj, "rb") as f:
            from elftools.elf.elffile import ELFFile   # imported when an object is read
            st = ELFFile(f).get_section_by_name(".symtab")
            for sym in st.iter_symbols() if st else []:
                if not sym.name or sym["st_info"]["bind"] not in ("STB_GLOBAL", "STB_WEAK"):
                    continue
                if sym["st_shndx"] != "SHN_UNDEF":
                    defined.add(sym.name)
                elif sym["st_info"]["bind"] == "STB_GLOBAL":
                    wanted.setdefault(sym.name, obj)
    return {n: o for n, o in wanted.items() if n not in defined}


def machine(obj: Path) -> int:
    """An ELF object's e_machine (little-endian objects: those kprewrite builds)."""
    with open(obj, "rb") as f:
        return int.from_bytes(f.read(20)[18:20], "little")

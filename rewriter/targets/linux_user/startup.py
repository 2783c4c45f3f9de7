"""How a rewritten user image starts the runtime: an executable's new entry
point calls kp_user_start() before the program's own; a shared object's first
DT_INIT_ARRAY slot (else DT_INIT) and DT_FINI_ARRAY slot (else DT_FINI) are
chained through stubs that call kp_user_lib_init()/kp_user_lib_fini()."""
from __future__ import annotations

import struct

from ...arch import get_arch
from ...errors import KprewriteError

STUB_ROOM = 64
DT_INIT, DT_FINI, DT_INIT_ARRAY, DT_FINI_ARRAY = 12, 13, 25, 26
DT_RELA, DT_RELASZ = 7, 8


def reserve_stubs(image, pos: int) -> tuple[dict[str, int], int]:
    """Room for the stubs at `pos`: one for executables, init and fini for shared objects."""
    stubs = {}
    for name in (["entry"] if image.is_executable else ["init", "fini"]):
        stubs[name] = pos
        pos += STUB_ROOM
    return stubs, pos


def slot_hook(image, tag_array: int, tag_single: int):
    """Where to hook a shared object's init (or fini): the first DT_*_ARRAY
    slot's base-relative relocation addend, else DT_INIT/DT_FINI itself.
    Returns (file offset of the 8 bytes to rewrite, the function it held)."""
    arr = image.dynamic.get(tag_array)
    if arr:
        found = _relative_at(image, arr)
        if found is not None:
            return found
    single = image.dynamic.get(tag_single)
    if single:
        dyn = image.section_named(".dynamic")
        if dyn is not None:
            for i in range(_dynamic_entries(image, dyn)):
                o = dyn.offset + i * 16
                if int.from_bytes(image.data[o:o + 8], "little") == tag_single:
                    return o + 8, single
    return None


def _relative_at(image, addr: int):
    """(file offset of the addend, the addend) of the first base-relative relocation
    of addr, as a scan of image.relative_relocations() finds it: the table searched
    for the address's bytes instead (libpython's holds some 40,000 entries)."""
    rela, size = image.dynamic.get(DT_RELA), image.dynamic.get(DT_RELASZ)
    if not rela or not size:
        return None
    data = image.data
    off = image.offset_of(rela)
    if off + size > len(data):
        image.relative_relocations()            # its error: a damaged DT_RELASZ
    end = off + size // 24 * 24
    r_relative = get_arch(image.machine).r_relative
    needle = addr.to_bytes(8, "little")
    p = data.find(needle, off, end)
    while p != -1:
        if (p - off) % 24 == 0 and int.from_bytes(data[p + 8:p + 12], "little") == r_relative:
            return p + 16, int.from_bytes(data[p + 16:p + 24], "little", signed=True)
        p = data.find(needle, p + 1, end)
    return None


def diff_expected(image, meta: dict) -> list[tuple[int, int, str]]:
    """What `kprewrite diff` may find changed besides the probe sites: a shared
    object's init/fini hooks (the 8 bytes slot_hook() rewrites).  An executable's
    new entry point is in the ELF header, which diff explains itself."""
    if image.is_executable:
        return []
    out = []
    for name, arr, single in (("init", DT_INIT_ARRAY, DT_INIT), ("fini", DT_FINI_ARRAY, DT_FINI)):
        hook = slot_hook(image, arr, single)
        if hook is not None:
            off, old = hook
            how = ("the relative relocation addend of DT_{0}_ARRAY[0]" if image.dynamic.get(arr) and off != _dynamic_value_offset(image, single)
                   else "DT_{0}").format(name.upper())
            out.append((off, 8, f"{how}: chained through the runtime's {name} stub (was {old:#x})"))
    return out


def _dynamic_entries(image, dyn) -> int:
    """How many Elf64_Dyn entries .dynamic holds in the file (a damaged sh_size, or a
    section made SHT_NOBITS, may claim far more than the file has)."""
    return max(0, min(dyn.size, len(image.data) - dyn.offset)) // 16


def _dynamic_value_offset(image, tag: int) -> int | None:
    dyn = image.section_named(".dynamic")
    if dyn is None:
        return None
    for i in range(_dynamic_entries(image, dyn)):
        o = dyn.offset + i * 16
        if int.from_bytes(image.data[o:o + 8], "little") == tag:
            return o + 8
    return None


def emit_stubs(image, arch, stubs: dict[str, int], sym: dict[str, int], put) -> tuple[int | None, list]:
    """The stubs' code (put(addr, code, room)); returns (new entry point or None,
    file patches [(offset, bytes)])."""
    em = arch.emit
    if image.is_executable:
        orig = int.from_bytes(image.data[24:32], "little")
        if not image.is_code(orig):       # a damaged e_entry: the stub's jmp could not reach it
            raise KprewriteError(f"{image.path}: entry point {orig:#x} (e_entry) is not in the image's code")
        put(stubs["entry"], em.entry_stub(stubs["entry"], sym["kp_user_start"], orig), STUB_ROOM)
        return stubs["entry"], []
    file_patches = []
    for name, arr, single, fn in (("init", DT_INIT_ARRAY, DT_INIT, "kp_user_lib_init"),
                                  ("fini", DT_FINI_ARRAY, DT_FINI, "kp_user_lib_fini")):
        hook = slot_hook(image, arr, single)
        if hook is None:
            if name == "init":
                raise KprewriteError(f"{image.path}: shared object has neither DT_INIT_ARRAY nor DT_INIT to start the runtime from")
            continue
        off, old = hook
        if not image.is_code(old):
            raise KprewriteError(f"{image.path}: the {name} function {old:#x} the runtime would chain to is not in the image's code")
        put(stubs[name], em.chain_stub(stubs[name], sym[fn], old), STUB_ROOM)
        file_patches.append((off, struct.pack("<Q", stubs[name])))
    return None, file_patches

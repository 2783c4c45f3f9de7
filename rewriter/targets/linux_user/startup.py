"""How a rewritten user image starts the runtime.

- An executable's new entry point calls kp_user_start() before the program's own.
- A shared object's first DT_INIT_ARRAY slot (else DT_INIT) and DT_FINI_ARRAY slot
  (else DT_FINI) are chained through stubs that call kp_user_lib_init() and
  kp_user_lib_fini().  The slot is rewritten where the dynamic loader reads it: the
  addend of its R_*_RELATIVE relocation, or the word itself when DT_RELR relocates
  it (ld -z pack-relative-relocs, as glibc 2.36 links its libc).  A shared object
  with neither DT_FINI_ARRAY nor DT_FINI (glibc's libc.so.6) gets a DT_FINI of ours
  in a spare DT_NULL entry of its dynamic table: the dynamic loader's _dl_fini runs
  it at exit, as it runs every object's.
- Code of a shared object can run before its init functions: the IFUNC resolvers
  that the dynamic loader calls while it relocates the object (R_*_IRELATIVE), and
  in libc, __libc_early_init.  So each IRELATIVE relocation's resolver is chained
  through a stub that calls kp_user_lib_early() first (once): it relocates the
  runtime, reads the environment and installs the SIGTRAP handler before any of
  the object's code runs.
- A shared object that can also run as a program (a PT_INTERP without DF_1_PIE:
  libc.so.6 prints its version) gets both; the runtime starts once.
- The dynamic loader itself (ld-linux*.so.2) is refused: see check_supported().
"""
from __future__ import annotations

import struct

from ...arch import get_arch
from ...errors import KprewriteError

STUB_ROOM = 64
DT_NULL, DT_INIT, DT_FINI, DT_INIT_ARRAY, DT_FINI_ARRAY = 0, 12, 13, 25, 26
DT_RELA, DT_RELASZ, DT_JMPREL, DT_PLTRELSZ = 7, 8, 23, 2
# Defined by the dynamic loader alone (glibc's ld.so: the state of every link map).
LOADER_SYMBOLS = ("_rtld_global", "_rtld_global_ro")


def check_supported(image) -> None:
    """The dynamic loader cannot hold the runtime: nothing starts or stops it there."""
    if image.is_shared and not image.has_interp and any(
            s.name in LOADER_SYMBOLS and s.shndx for s in image._dynsym):
        raise KprewriteError(
            f"{image.path}: the dynamic loader cannot be rewritten: the kernel enters it before anything it loads, "
            f"and it has no init or fini function (DT_INIT*, DT_FINI*) that would start the runtime and write its "
            f"profile at exit; rewrite the programs and libraries it loads instead")


def reserve_stubs(image, pos: int) -> tuple[dict[str, int], int]:
    """Room for the stubs at `pos`: the entry for executables; init, fini and one per
    IFUNC resolver (irel0, irel1, ...) for shared objects."""
    check_supported(image)
    names = []
    if image.is_executable:
        names.append("entry")
    if image.is_shared:
        names += ["init", "fini"] + [f"irel{i}" for i in range(len(irelative_addends(image)))]
    stubs = {}
    for name in names:
        stubs[name] = pos
        pos += STUB_ROOM
    return stubs, pos


def irelative_addends(image) -> list[tuple[int, int]]:
    """(file offset of the addend, the resolver) of each IRELATIVE relocation of the
    DT_RELA and DT_JMPREL tables (RELA: x86-64 and AArch64 have no other form)."""
    if image.dynamic.get(20, DT_RELA) != DT_RELA:        # DT_PLTREL
        return []
    r_irelative = get_arch(image.machine).r_irelative
    out = []
    for tag_at, tag_sz in ((DT_RELA, DT_RELASZ), (DT_JMPREL, DT_PLTRELSZ)):
        at, size = image.dynamic.get(tag_at), image.dynamic.get(tag_sz)
        if not at or not size:
            continue
        off = image.elf.offset(at, size)
        if off is None:
            continue
        for p in range(off, off + size // 24 * 24, 24):
            if int.from_bytes(image.data[p + 8:p + 12], "little") == r_irelative:
                out.append((p + 16, int.from_bytes(image.data[p + 16:p + 24], "little", signed=True)))
    return out


def slot_hook(image, tag_array: int, tag_single: int):
    """Where to hook a shared object's init (or fini): the first DT_*_ARRAY
    slot as relocated (its R_*_RELATIVE addend, or the word DT_RELR relocates),
    else DT_INIT/DT_FINI itself.  Returns (file offset of the 8 bytes to rewrite,
    the function it held)."""
    arr = image.dynamic.get(tag_array)
    if arr:
        found = _relative_at(image, arr)
        if found is not None:
            return found
    single = image.dynamic.get(tag_single)
    if single:
        off = _dynamic_value_offset(image, tag_single)
        if off is not None:
            return off, single
    return None


def _relative_at(image, addr: int):
    """(file offset of the addend, the addend) of the first base-relative relocation
    of addr, as a scan of image.relative_relocations() finds it: the table searched
    for the address's bytes instead (libpython's holds some 40,000 entries); then
    DT_RELR's, whose addend is the relocated word."""
    rela, size = image.dynamic.get(DT_RELA), image.dynamic.get(DT_RELASZ)
    if rela and size:
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
    if addr in image.relr_offsets():
        off = image.elf.offset(addr, 8)
        if off is not None:
            return off, int.from_bytes(image.data[off:off + 8], "little", signed=True)
    return None


def _spare_dynamic_entry(image) -> int | None:
    """File offset of the dynamic table's DT_NULL that ends it, when another DT_NULL
    follows it (GNU ld leaves a few): a new entry goes there, the next one ends the table."""
    dyn = image.section_named(".dynamic")
    if dyn is None:
        return None
    n = _dynamic_entries(image, dyn)
    for i in range(n):
        o = dyn.offset + i * 16
        if int.from_bytes(image.data[o:o + 8], "little") == DT_NULL:
            nxt = o + 16
            if i + 1 < n and image.data[nxt:nxt + 16] == bytes(16):
                return o
            return None
    return None


def _hooks(image):
    """[(name, file offset, old value or None for a DT_FINI of ours, how)] of a shared
    object's init and fini hooks, and its resolver chains."""
    out = []
    for name, arr, single in (("init", DT_INIT_ARRAY, DT_INIT), ("fini", DT_FINI_ARRAY, DT_FINI)):
        hook = slot_hook(image, arr, single)
        if hook is None:
            if name == "init":
                if image.is_executable:     # runs as a program only; loaded, no start-up
                    continue
                raise KprewriteError(f"{image.path}: shared object has neither DT_INIT_ARRAY nor DT_INIT to start the runtime from")
            spare = _spare_dynamic_entry(image)
            if spare is None:
                raise KprewriteError(f"{image.path}: shared object has neither DT_FINI_ARRAY nor DT_FINI, and its dynamic "
                                     f"table no spare entry for a DT_FINI that would write the profile at exit")
            out.append((name, spare, None, "DT_FINI added in the dynamic table's spare DT_NULL entry: the runtime's fini stub"))
            continue
        off, old = hook
        in_array = image.dynamic.get(arr) and off != _dynamic_value_offset(image, single)
        how = (f"the relocated DT_{name.upper()}_ARRAY[0]" if in_array else f"DT_{name.upper()}")
        out.append((name, off, old, f"{how}: chained through the runtime's {name} stub (was {old:#x})"))
    for i, (off, resolver) in enumerate(irelative_addends(image)):
        out.append((f"irel{i}", off, resolver, f"the IRELATIVE relocation's resolver: chained through the runtime's "
                                               f"early start-up stub (was {resolver:#x})"))
    return out


def diff_expected(image, meta: dict) -> list[tuple[int, int, str]]:
    """What `kprewrite diff` may find changed besides the probe sites: a shared
    object's init/fini hooks (the 8 bytes slot_hook() rewrites, or the 16 of a DT_FINI
    entry of ours) and its IFUNC resolvers' addends.  An executable's new entry point
    is in the ELF header, which diff explains itself."""
    names = {13: "rt_sigaction", 14: "rt_sigprocmask", 0: "syscall(2)'s (rt_sigaction or rt_sigprocmask)"}
    calls = [(image.offset_of(a), get_arch(image.machine).JUMP_SIZE,
              f"{names.get(nr, nr)} system call at {a:#x}: a jump to the runtime's stub (kp_signal_syscall: "
              f"SIGTRAP kept unblocked and its handler the runtime's, for breakpoint probes)")
             for a, _, nr in meta.get("signal_syscalls") or []]
    if not image.is_shared:
        return calls
    return [(off, 8 if old is not None else 16, how) for _, off, old, how in _hooks(image)] + calls


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


def emit_stubs(image, arch, stubs: dict[str, int], sym: dict[str, int], put, plan=None) -> tuple[int | None, list]:
    """The stubs' code (put(addr, code, room)); returns (new entry point or None,
    file patches [(offset, bytes)])."""
    em = arch.emit
    entry = None
    signal_patches = []
    for i, sc in enumerate(plan.signal_syscalls if plan is not None else ()):
        at = stubs[f"sigcall{i}"]
        code = em.signal_syscall_stub(at, sc, sym["kp_signal_syscall"])
        put(at, code, len(code))
        signal_patches.append((image.offset_of(sc.addr), em.jump_patch(sc.addr, arch.JUMP_SIZE, at)))
    if image.is_executable:
        orig = int.from_bytes(image.data[24:32], "little")
        if not image.is_code(orig):       # a damaged e_entry: the stub's jmp could not reach it
            raise KprewriteError(f"{image.path}: entry point {orig:#x} (e_entry) is not in the image's code")
        put(stubs["entry"], em.entry_stub(stubs["entry"], sym["kp_user_start"], orig), STUB_ROOM)
        entry = stubs["entry"]
    if not image.is_shared:
        return entry, signal_patches
    file_patches = []
    fns = {"init": "kp_user_lib_init", "fini": "kp_user_lib_fini"}
    for name, off, old, _ in _hooks(image):
        at = stubs[name]
        if old is None:                   # a DT_FINI of ours
            put(at, em.call_stub(at, sym["kp_user_lib_fini"]), STUB_ROOM)
            file_patches.append((off, struct.pack("<qQ", DT_FINI, at)))
            continue
        if not image.is_code(old):
            what = "IFUNC resolver" if name.startswith("irel") else f"{name} function"
            raise KprewriteError(f"{image.path}: the {what} {old:#x} the runtime would chain to is not in the image's code")
        put(at, em.chain_stub(at, sym[fns.get(name, "kp_user_lib_early")], old), STUB_ROOM)
        file_patches.append((off, struct.pack("<Q", at)))
    return entry, file_patches + signal_patches

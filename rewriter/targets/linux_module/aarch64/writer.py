"""Writing a rewritten arm64 module: its probes' detours and the handlers linked into the .ko
itself (`ld -r`), for the module loader to relocate (apply_relocate_add()), as x86_64/writer.py
does for x86-64 (its docstring says the shared design; ../ko.py has the shared steps).

What is written, for each jump-optimized kprobe and kretprobe (the only kinds an arm64 module takes
yet: the kernel's own arm64 kprobes are breakpoints, BRK, taken through break hooks a module cannot
register (rules.py); a post_handler after a branch is refused too, by the planner, and trace events
by refusals()):

- the probed instruction becomes a `B` to the site's detour: a R_AARCH64_JUMP26 relocation added
  against kp_detour_<i> (the loader places each section where it will, so the branch out of the
  module's text is a relocation; one out of a B's reach goes through a module PLT entry, which
  module_frob_arch_sections() counts from the relocations of the executable sections, ours
  included), and the relocation the instruction had, if any, made R_AARCH64_NONE;
- the detour (runtime/arch/aarch64/linux_module/kp_module_detours.S, in .text.kprewrite) builds a
  struct pt_regs (pc the probe's address), calls the site's dispatch with interrupts masked, restores
  the registers, then runs the displaced instruction's copy, calls the post_handlers the same way
  (pc the address after the instruction; kp_module_post.c), and branches back after it.  The copy
  (copy()) carries the original's relocation (a call of a kernel function, adrp/add/ldr of the
  module's data: the same symbol, type and addend, applied at the copy's place); a branch the
  assembler had resolved inside its section becomes a relocation against that section (b, bl; b.cond,
  cbz, tbz over a `B` back: the condition reaches its target through a JUMP26), adr an adrp/add pair;
  anything else PC-relative without a relocation (ldr literal) is refused, naming the check;
- a probe on a function's entry is taken past its two ftrace NOPs (the instruction at entry + 8,
  as the arm64 kernel image's: ftrace_init_nop() rewrites the first NOP at load);
- a kretprobe is the kernel's kind: at its entry's detour (before the function's paciasp signs x30)
  x30 is swapped for kp_kret_trampoline and an instance claimed, found again at return by sp;
- the dispatch and init/exit are the shared runtime's (runtime/platform/linux_module/
  kp_module_runtime.c, on the macros runtime_c() generates), struct module's init and exit
  redirected to kp_module_init and kp_module_exit as on x86-64.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ....planner.model import FTRACE, OPTIMIZED
from ....probes.spec import where
from ....arch.aarch64 import insn as I
from ..parts import module_parts
from ..ko import (PLACEHOLDER, SECTIONS, placeholder_namer as _placeholder, _append_relas, _c_string, _define, _run, _sites, _versions, handler_externs,
                  kretprobes_c, module_name, relocations)
from ..ko import write as _write
from .relocatable import (LDST_SHIFT, NAMES, R_AARCH64_ABS64, R_AARCH64_ADD_ABS_LO12_NC, R_AARCH64_ADR_PREL_PG_HI21,
                          R_AARCH64_ADR_PREL_PG_HI21_NC, R_AARCH64_CALL26, R_AARCH64_JUMP26, R_AARCH64_NONE,
                          RELA, SHT_RELA, THIS_MODULE, read_sections, relas, symbols)

# The detours' templates: macros, opt_head, opt_post, opt_tail, opt_post_pc, opt_end, kret_trampoline.
DETOURS = module_parts("arch/aarch64/linux_module/kp_module_detours.S")
# The relocations a copy carries as they are: the place moves, the symbol and addend do not, and each
# is right at any place (a call or tail call through a PLT entry if out of reach; adrp's page delta,
# the low 12 bits of an address).
CARRIED = (R_AARCH64_CALL26, R_AARCH64_JUMP26, R_AARCH64_ADR_PREL_PG_HI21, R_AARCH64_ADR_PREL_PG_HI21_NC,
           R_AARCH64_ADD_ABS_LO12_NC, *LDST_SHIFT)
B_WORD, BL_WORD, ADRP_WORD, ADD_WORD = 0x14000000, 0x94000000, 0x90000000, 0x91000000


class CopyRefused(Exception):
    """(check, address, why): the copy cannot be written for the module."""


@dataclass(frozen=True)
class Field:
    """Where a relocation of ours points, read by _redirect(): the original relocation of
    (section, carry) carried, or `type` against the section `section` with `addend`."""
    section: str
    carry: int | None = None
    addend: int = 0
    type: int = R_AARCH64_JUMP26


BACK = "back"                           # copy()'s item: the `B` back after the region


def copy(mod, relocs, insn) -> list:
    """The displaced instruction's copy: a list of (word, relocation type or None, Field or None),
    or BACK for a branch to the detour's way back.  CopyRefused when it cannot be written."""
    section, off = mod.place(insn.addr)
    sec = section.name
    w = int.from_bytes(insn.code, "little")
    r = relocs.get(sec, {}).get(off)
    if r is not None:
        typ = r[1]
        if typ not in CARRIED:
            raise CopyRefused("module_relocation", insn.addr, f"{NAMES.get(typ, f'relocation type {typ}')} at "
                                                              f"{sec}+{off:#x} cannot be carried to a detour")
        # The .ko's own word (its field as the assembler left it for the relocation), not the view's.
        orig = int.from_bytes(mod.data[section.offset + off:section.offset + off + 4], "little")
        return [(orig, typ, Field(sec, carry=off))]
    info = I.classify(w, insn.addr)
    if info.kind not in I.PC_RELATIVE:
        return [(w, None, None)]
    placed = mod.place(info.target)
    lo, hi = mod.stand_in
    if placed is None or lo <= info.target < hi:
        raise CopyRefused("module_relocation", insn.addr, f"the {info.kind}'s target {info.target:#x} is not in "
                                                          "the module, and it has no relocation to carry")
    tsec, toff = placed[0].name, placed[1]
    if info.kind == I.B:
        return [(B_WORD, R_AARCH64_JUMP26, Field(tsec, addend=toff))]
    if info.kind == I.BL:
        return [(BL_WORD, R_AARCH64_CALL26, Field(tsec, addend=toff, type=R_AARCH64_CALL26))]
    if info.kind in (I.BCOND, I.CBZ, I.TBZ):
        # The condition over the way back: taken, it skips to a `B` to its target.
        field = 0x3FFF if info.kind == I.TBZ else 0x7FFFF
        return [((w & ~(field << 5)) | (2 << 5), None, None), BACK,
                (B_WORD, R_AARCH64_JUMP26, Field(tsec, addend=toff))]
    if info.kind == I.ADR:
        rd = w & 31
        return [(ADRP_WORD | rd, R_AARCH64_ADR_PREL_PG_HI21, Field(tsec, addend=toff, type=R_AARCH64_ADR_PREL_PG_HI21)),
                (ADD_WORD | rd | rd << 5, R_AARCH64_ADD_ABS_LO12_NC,
                 Field(tsec, addend=toff, type=R_AARCH64_ADD_ABS_LO12_NC))]
    raise CopyRefused("module_relocation", insn.addr, f"{info.kind} without a relocation cannot be copied to a "
                                                      "module's detour (its literal would not move)")


def _copy_s(i: int, items: list, ph) -> str:
    out = []
    for item in items:
        if item == BACK:
            out.append(f"\tb kp_back_{i}\n")
            continue
        word, typ, field = item
        if typ is not None:
            out.append(f"\t.reloc ., {NAMES[typ]}, {ph(field)}\n")
        out.append(f"\t.inst {word:#010x}\n")
    return "".join(out)


def _taken(site):
    """(where the `B` goes, the displaced instructions) of a site: a function's entry past its ftrace
    NOPs (the planner's Site.jump_at), else the site itself."""
    if site.decision == FTRACE:
        return site.jump_at, site.dcr[1:]
    return site.addr, site.dcr


def opt_detour(i: int, site, mod, relocs, placeholders: dict, post: bool) -> str:
    """Site i's detour: DETOURS' opt_head, the displaced instruction's copy, with post_handlers
    (post) their call (opt_post), opt_tail."""
    ph = _placeholder(placeholders)
    at, dcr = _taken(site)
    sec, off = mod.place(site.addr)
    end_sec, end = mod.place(dcr[-1].addr)
    after = Field(end_sec.name, addend=end + 4)
    parts = [DETOURS["opt_head"], _copy_s(i, [c for insn in dcr for c in copy(mod, relocs, insn)], ph),
             DETOURS["opt_post"] if post else "",
             DETOURS["opt_tail"].replace("{back}", ph(after))
             .replace("{site}", ph(Field(sec.name, addend=off, type=R_AARCH64_ABS64))),
             DETOURS["opt_post_pc"].replace("{post_pc}", ph(Field(after.section, addend=after.addend,
                                                                     type=R_AARCH64_ABS64))) if post else "",
             DETOURS["opt_end"]]
    return "".join(parts).replace("{i}", str(i)).replace("{n}", str(i))


def _posts(plan) -> list[tuple[int, list[int]]]:
    """The sites with post_handlers: (the site's number in _sites(), its kprobes with one)."""
    out = []
    for n, (site, ks, _) in enumerate(_sites(plan)):
        with_post = [i for i in ks if plan.kprobes[i][1].spec.post_handler]
        if with_post:
            out.append((n, with_post))
    return out


def runtime_c(plan, handler_symbols: dict[str, str], module: str, debugfs: bool) -> str:
    """The module's kp_module.c: the probes' facts as the macros kp_module_runtime.c reads (its first
    comment names them): each site's dispatch runs its kprobes' pre_handlers and its kretprobes'
    entries (x30 swapped for kp_kret_trampoline)."""
    out = ["/* A module's probes, for kp_module_runtime.c (generated by kprewrite: aarch64/writer.py's "
           "runtime_c()). */", f'#define KP_MODULE_NAME "{module}"']
    if debugfs:
        out.append("#define KP_MODULE_CRCS 1")
    kps = [p for _, p in plan.kprobes]
    krs = [ep for _, ep, _ in plan.kretprobes]
    out += [f"#define KP_NK {len(kps)}", f"#define KP_NK_SLOTS {max(len(kps), 1)}",
            f"#define KP_NR {len(krs)}", f"#define KP_NR_SLOTS {max(len(krs), 1)}"]
    out.append(_define("KP_EXTERNS", handler_externs(handler_symbols, kps, krs, [])))
    out.append(_define("KP_PROBES", [f"KP_PROBE({_c_string(p.symbol)}, {p.offset}, KPROBE_FLAG_OPTIMIZED, "
                                     f"{_c_string(p.event_name)}, {p.index})" for _, p in plan.kprobes]))
    out += kretprobes_c(krs, ["KPROBE_FLAG_OPTIMIZED"] * len(krs), handler_symbols, {})
    dispatches = []
    for n, (site, ks, rs) in enumerate(_sites(plan)):
        body = []
        for i in ks:
            pre = handler_symbols.get(kps[i].spec.pre_handler) if kps[i].spec.pre_handler else None
            body.append(f"KP_KPROBE({i}, {f'KP_RUN_OPTIMIZED({pre})' if pre else ''})")
        body += [f"KP_KRET_AT({j})" for j in rs]
        missed = " ".join([f"KP_MISSED_K({i})" for i in ks] + [f"KP_MISSED_R({j})" for j in rs])
        dispatches.append(f"KP_DISPATCH({n}, {missed}, {' '.join(body)}, )")
    out.append(_define("KP_SITES", dispatches))
    out.append('#include "kp_module_runtime.c"')
    posts = _posts(plan)
    if posts:
        out.append(_define("KP_POSTS", [
            f"KP_POST_FUNC({n}, {' '.join(f'KP_POST_CALL({i}, {handler_symbols[kps[i].spec.post_handler]})' for i in ks)})"
            for n, ks in posts]))
        out.append('#include "kp_module_post.c"')
    return "\n".join(out) + "\n"


def refusals(image, plan, traces, spec_name: str) -> list[str]:
    """targets.base.Target.refusals(): one line per probe an arm64 module cannot take yet, asked by
    `check` and `instrument` alike (the planner's own checks first: a post_handler after a branch,
    `post_handler`): a module without an exit, a site no jump may go
    (no breakpoint probes), a region shared between sites, a displaced instruction whose copy cannot be
    written (copy(); the rules refuse it first), a trace event."""
    from ....arch.aarch64 import bti
    lines = []
    if "cleanup_module" not in image.symbols:
        lines.append(f"{image.path}: the module has no exit (cleanup_module): it could not be unloaded")
    note = image.container.section_named(".note.gnu.property")
    if note is not None and bti.note_features(image.container.data[note.offset:note.offset + note.size]) \
            & bti.FEATURE_1_BTI:
        # A kernel built with CONFIG_ARM64_BTI_KERNEL guards module text: a module PLT entry's `br x16`
        # to a detour, the loader's call of our init, would need landing pads our code has not.
        lines.append(f"{image.path}: landing_pad at .note.gnu.property: a BTI-guarded module is not written yet "
                     "(its new code has no BTI landing pads)")
    relocs = None
    for site in plan.sites:
        heads = []
        for p in site.probes:
            what = getattr(p, "kret", None) or p.spec
            heads.append(f"{where(spec_name, what.table)} ({p.label})")
        if site.decision not in (OPTIMIZED, FTRACE) or (site.decision == FTRACE and not site.jump_at):
            lines += [f"{h}: jump at {site.addr:#x}: only jump-optimized probes are written for arm64 modules yet "
                      f"(this one: {site.decision}; breakpoint probes are not)" for h in heads]
            continue
        if site.head is not None or site.riders or site.slot or site.evicted:
            lines += [f"{h}: region at {site.addr:#x}: a region shared between sites is not written for arm64 "
                      "modules yet" for h in heads]
            continue
        relocs = relocs if relocs is not None else relocations(image.container)
        try:
            for insn in _taken(site)[1]:
                copy(image.container, relocs, insn)
        except CopyRefused as e:
            check, addr, why = e.args
            lines += [f"{h}: {check} at {addr:#x}: {why}" for h in heads]
    for key, ev in sorted(traces.items(), key=lambda kv: str(kv[0])):
        lines.append(f"{spec_name}: event {ev.name}: trace events are not written for arm64 modules yet")
    return lines


# The module's back half (targets.base.Target's lay_out, tables, link, emit, write), as x86_64/writer.py's.


@dataclass
class ModuleLayout:
    """The loader's layout (none before insmod) and what the later steps share: the probed sites in
    address order (one detour each), the module's relocations read once."""
    mod: object
    name: str
    debugfs: bool
    calls: None                         # no event calls (trace events are refused)
    sites: list
    relocs: dict

    def detour(self, site) -> int:
        return 0


@dataclass
class ModuleTables:
    c: str
    asm: str
    placeholders: dict


@dataclass
class ModuleBlob:
    path: Path
    data: bytes
    placeholders: dict


def lay_out(s, code) -> ModuleLayout:
    mod = s.image.container
    return ModuleLayout(mod, module_name(mod), mod.symvers is not None, None, _sites(s.plan), relocations(mod))


def tables(s, code, lay: ModuleLayout) -> ModuleTables:
    placeholders: dict = {}
    src = runtime_c(s.plan, s.handler_symbols, lay.name, lay.debugfs)
    posts = {n for n, _ in _posts(s.plan)}
    detours = "".join(opt_detour(i, site, lay.mod, lay.relocs, placeholders, i in posts)
                      for i, (site, _, _) in enumerate(lay.sites))
    asm = DETOURS["macros"] + "".join(f"\t.weak {n}\n" for n in placeholders) + detours
    if s.plan.kretprobes:
        # The trampoline, and what runs on a kretprobe's way back kept from the kernel's own kprobes
        # (NOKPROBE_SYMBOL(): the module's _kprobe_blacklist, as on x86-64).
        asm += DETOURS["kret_trampoline"] + SECTIONS["nokprobe"] + "".join(
            SECTIONS["nokprobe_entry"].replace("{func}", f) for f in ("kp_kret_return", "kp_kret_trampoline"))
    return ModuleTables(src, asm, placeholders)


def link(s, lay: ModuleLayout, table: ModuleTables, runtime: list, objs: list, workdir: Path, cc: str):
    """The generated sources compiled, linked with the handlers into one object whose hidden symbols
    are made local, then `ld -r` with the module and the __versions entries of the kernel symbols it
    added (x86_64/writer.py's link(), without ORC entries or trace events)."""
    from ....link.blob import Linked
    from ....link.toolchain import linker, _tool
    from ....link.runtime import _includes, cflags
    src, asm = workdir / "kp_module.c", workdir / "kp_detours.S"
    src.write_text(table.c)
    asm.write_text(table.asm)
    obj_c, obj_s = workdir / "kp_module.o", workdir / "kp_detours.o"
    flags = [*cflags(s.arch, "linux_module"), *_includes(s.arch, "linux_module")]
    _run([cc, *flags, "-c", str(src), "-o", str(obj_c)], "the module's runtime")
    _run([cc, "-c", str(asm), "-o", str(obj_s)], "the module's detours")
    rt = workdir / "kp_runtime.o"
    _run([linker(s.arch), "-r", "-o", str(rt), str(obj_c), str(obj_s), *map(str, objs)], "ld -r (the runtime)")
    _run([_tool(s.arch, "objcopy"), "--localize-hidden", str(rt)], "objcopy --localize-hidden")
    orig = workdir / "orig.ko"
    orig.write_bytes(lay.mod.data)
    versions = _versions(lay.mod, rt, workdir, cc)
    linked = workdir / "linked.ko"
    _run([linker(s.arch), "-r", "-o", str(linked), str(orig), str(rt), *([str(versions)] if versions else [])],
         "ld -r")
    return Linked(ModuleBlob(linked, linked.read_bytes(), table.placeholders))


def unlinked(s, code, lay):
    return None


def emit(s, code, lay: ModuleLayout, blob: ModuleBlob, unlinked) -> tuple[bytearray, list]:
    """The linked module with its relocations pointed at our code (_redirect())."""
    sites = []
    for i, (site, _, _) in enumerate(lay.sites):
        at = _taken(site)[0]
        sec, off = lay.mod.place(at)
        sites.append((i, sec.name, off))
    return _redirect(bytearray(blob.data), str(blob.path), sites, blob.placeholders), []


def write(image, arch, layout, rx: bytearray, patches, blob: ModuleBlob, metadata: bytes, plan, early=None) -> bytes:
    from ....link.toolchain import _tool
    return _write(image, arch, layout, rx, patches, blob, metadata, plan, early, objcopy=_tool(arch, "objcopy"))


def _redirect(data: bytearray, path: str, sites, placeholders: dict) -> bytearray:
    """In the linked module: the copies' placeholder relocations pointed where their Field says (a
    carried relocation read from the module's section at the same offset: `ld -r` put the module's
    sections first); at each site a `B` whose JUMP26 relocation is added against its detour, the
    relocation its instruction had made R_AARCH64_NONE; struct module's init and exit to ours."""
    secs = read_sections(bytes(data), path)
    symtab, syms = symbols(bytes(data), secs)
    strtab = secs[symtab.link]

    def sym_name(i):
        n = syms[i][0]
        return data[strtab.offset + n:data.index(b"\0", strtab.offset + n)].decode()
    index = {}
    for i in range(len(syms)):
        index.setdefault(sym_name(i), i)
    by_name = {sc.name: sc for sc in secs}

    def relas_of(sec_name):
        r = next((sc for sc in secs if sc.type == SHT_RELA and secs[sc.info].name == sec_name), None)
        return [] if r is None else list(relas(data, r))

    def set_rela(at, off, sym, typ, addend):
        RELA.pack_into(data, at, off, (sym << 32) | typ, addend)

    def section_symbol(name):
        shndx = by_name[name].index
        found = next((i for i, (_, info, _, sh, _, _) in enumerate(syms) if info & 0xF == 3 and sh == shndx), None)
        if found is None:
            from ....errors import KprewriteError
            raise KprewriteError(f"{path}: no section symbol for {name}")
        return found
    table: dict[str, dict] = {}

    def rela_at(sec_name, off):
        if sec_name not in table:
            table[sec_name] = {o2: (s2, t2, a2) for _, o2, s2, t2, a2 in relas_of(sec_name)}
        return table[sec_name].get(off)
    from ....errors import KprewriteError
    for at, r_off, sym, _, _ in relas_of(".text.kprewrite"):
        fl = placeholders.get(sym_name(sym))
        if fl is None:
            continue
        if fl.carry is not None:
            orig = rela_at(fl.section, fl.carry)
            if orig is None:
                raise KprewriteError(f"{path}: {fl.section}+{fl.carry:#x} has no relocation to carry")
            set_rela(at, r_off, orig[0], orig[1], orig[2] + fl.addend)
        else:
            set_rela(at, r_off, section_symbol(fl.section), fl.type, fl.addend)
    extra: dict[str, list] = {}
    for i, sec, off in sites:
        toff = by_name[sec].offset + off
        data[toff:toff + 4] = B_WORD.to_bytes(4, "little")
        for at, r_off, _, _, _ in relas_of(sec):
            if r_off == off:
                set_rela(at, r_off, 0, R_AARCH64_NONE, 0)
        extra.setdefault(sec, []).append((off, index[f"kp_detour_{i}"], R_AARCH64_JUMP26, 0))
    for at, r_off, sym, typ, addend in relas_of(THIS_MODULE):
        n = sym_name(sym)
        if n in ("init_module", "cleanup_module"):
            set_rela(at, r_off, index["kp_module_init" if n == "init_module" else "kp_module_exit"], typ, addend)
    return _append_relas(data, path, secs, extra)


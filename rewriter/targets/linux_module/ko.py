"""What a rewritten module's writer does whatever the CPU (each architecture's writer.py uses
these): the probed sites in order, the generated C's macros, the kernel symbols' CRCs added to
__versions, the module's name, the extra relocations of a section, the .kprewrite.meta section."""
from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

from ...errors import KprewriteError
from ...emit.meta import META_SECTION
from .relocatable import RELA, SHT_RELA, read_sections, relas, symbols
from .parts import module_parts

# The module's __versions entries (versions, version) and _kprobe_blacklist's (nokprobe, nokprobe_entry).
SECTIONS = module_parts("platform/linux_module/kp_module_sections.S")
PLACEHOLDER = "kp_ph_"


def _c_string(s: str) -> str:
    return json.dumps(s)


def _sites(plan) -> list:
    """The probed sites in address order, each once (its kprobes and kretprobes share one detour,
    as an aggregator kprobe does): (site, [kprobe indices], [kretprobe indices])."""
    by = {}
    for i, (site, _) in enumerate(plan.kprobes):
        by.setdefault(site.addr, (site, [], []))[1].append(i)
    for j, (site, _, _) in enumerate(plan.kretprobes):
        by.setdefault(site.addr, (site, [], []))[2].append(j)
    return [by[a] for a in sorted(by)]


def _define(name: str, items: list[str]) -> str:
    """A macro of a list, one item a line."""
    return f"#define {name}" + "".join(f" \\\n\t{x}" for x in items)


def write(image, arch, layout, rx: bytearray, patches, blob, metadata: bytes, plan, early=None,
          objcopy: str = "objcopy") -> bytes:
    """targets.base.Target.write() for a module: the redirected module (rx) with the
    .kprewrite.meta section `list` reads, the placeholders' names gone (objcopy: one that
    reads the module's architecture)."""
    workdir = blob.path.parent
    meta = workdir / "meta.json"
    meta.write_bytes(metadata)
    out = workdir / "out.ko"
    blob.path.write_bytes(rx)
    strip = []
    if blob.placeholders:               # no relocation names them any more
        names = workdir / "kp_placeholders.txt"
        names.write_text("".join(f"{n}\n" for n in blob.placeholders))
        strip = [f"--strip-symbols={names}"]
    _run([objcopy, *strip, "--add-section", f"{META_SECTION}={meta}", "--set-section-flags",
          f"{META_SECTION}=readonly", str(blob.path), str(out)], "objcopy")
    return out.read_bytes()


def _names(path: Path) -> tuple[set[str], set[str]]:
    """(undefined, defined global) symbol names of an ELF relocatable object."""
    data = path.read_bytes()
    secs = read_sections(data, str(path))
    symtab, syms = symbols(data, secs)
    if symtab is None:
        return set(), set()
    strtab = secs[symtab.link]
    undef, defined = set(), set()
    for name, info, _, shndx, _, _ in syms[1:]:
        if not name:
            continue
        n = data[strtab.offset + name:data.index(b"\0", strtab.offset + name)].decode()
        if shndx == 0:
            undef.add(n)
        elif info >> 4 != 0:            # not STB_LOCAL
            defined.add(n)
    return undef, defined


def _imported(mod) -> set[str] | None:
    """The names in the module's __versions (None: a module built without CONFIG_MODVERSIONS)."""
    v = mod.section_named("__versions")
    if v is None:
        return None
    raw = mod.data[v.offset:v.offset + v.size]
    return {raw[i + 8:i + 64].split(b"\0")[0].decode() for i in range(0, len(raw) - 63, 64)}


def _versions(mod, rt: Path, workdir: Path, cc: str) -> Path | None:
    """An object whose __versions entries (struct modversion_info: the CRC, the name in 56
    bytes) are those of the kernel symbols our code calls that the module did not, from the
    kernel's Module.symvers; ld -r appends them to the module's own table."""
    have = _imported(mod)
    if have is None:
        return None
    undef, _ = _names(rt)
    orig = workdir / "orig.ko"
    _, defined = _names(orig)
    new = sorted(n for n in undef - defined - have if not n.startswith(PLACEHOLDER))   # placeholders go
    if not new:
        return None
    if mod.symvers is None:
        from . import symvers
        rel = symvers.release(mod)
        raise KprewriteError(f"{mod.path}: the module's runtime calls kernel symbols the module does not "
                             f"import ({', '.join(new)}): their CRCs (__versions) come from the kernel's "
                             f"Module.symvers: give it with --system-map FILE (not found at /lib/modules/"
                             f"{rel or '<release>'}/build/Module.symvers)")
    missing = [n for n in new if n not in mod.symvers]
    if missing:
        raise KprewriteError(f"{mod.symvers_path}: no CRC for {', '.join(missing)} (the module's runtime calls "
                             f"them; this kernel does not export them to modules)")
    asm = workdir / "kp_versions.S"
    lines = [SECTIONS["versions"]]
    for n in new:
        if len(n) > 55:
            raise KprewriteError(f"{mod.path}: kernel symbol {n} is longer than __versions takes (55 bytes)")
        lines.append(SECTIONS["version"].replace("{crc}", f"{mod.symvers[n]:#x}").replace("{name}", n)
                     .replace("{pad}", str(56 - len(n))))
    asm.write_text("".join(lines))
    obj = workdir / "kp_versions.o"
    _run([cc, "-c", str(asm), "-o", str(obj)], "the module's __versions")
    return obj


def module_name(mod) -> str:
    """The module's name as the kernel gives it (its .modinfo `name=`, as modpost writes it),
    else the file's."""
    info = mod.section_named(".modinfo")
    if info is not None:
        for entry in mod.data[info.offset:info.offset + info.size].split(b"\0"):
            if entry.startswith(b"name=") and entry[5:].replace(b"_", b"").replace(b"-", b"").isalnum():
                return entry[5:].decode()
    return Path(mod.path).name.split(".")[0]


def _run(cmd, what):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise KprewriteError(f"{what} failed: {(r.stderr or r.stdout).strip().splitlines()[:3]}")


def _append_relas(data: bytearray, path: str, secs, extra: dict) -> bytearray:
    """Each section's relocation section with the entries of extra[section] added: its
    table copied to the end of the file with them (a relocatable object's sections may
    lie anywhere), its header pointed there."""
    shoff, shentsize = struct.unpack_from("<Q", data, 0x28)[0], struct.unpack_from("<H", data, 0x3A)[0]
    for name in sorted(extra):
        r = next((sc for sc in secs if sc.type == SHT_RELA and secs[sc.info].name == name), None)
        if r is None:
            raise KprewriteError(f"{path}: {name} has no relocation section for the probes' jumps")
        table = bytes(data[r.offset:r.offset + r.size]) + b"".join(
            RELA.pack(off, (sym << 32) | typ, addend) for off, sym, typ, addend in extra[name])
        data += bytes(-len(data) % 8)
        struct.pack_into("<QQ", data, shoff + r.index * shentsize + 24, len(data), len(table))
        data += table
    return data


def relocations(mod) -> dict[str, dict[int, tuple[int, int, int]]]:
    """section name -> {offset: (symbol index, type, addend)} of the .ko's own relocations,
    read once (kept in mod.relocs for the rules' checks and the writer)."""
    if mod.relocs is not None:
        return mod.relocs
    secs = read_sections(mod.data, mod.path)
    out = mod.relocs = {}
    for r in secs:
        if r.type != SHT_RELA or not r.info:
            continue
        t = out.setdefault(secs[r.info].name, {})
        for _, off, sym, typ, addend in relas(mod.data, r):
            t[off] = (sym, typ, addend)
    return out


def placeholder_namer(placeholders: dict):
    """ph(field) -> a new undefined symbol standing for `field` in generated assembly; the
    field is kept in `placeholders` under that name, for the writer to resolve after linking."""
    def ph(field) -> str:
        name = f"{PLACEHOLDER}{len(placeholders)}"
        placeholders[name] = field
        return name
    return ph


def handler_externs(handler_symbols: dict[str, str], kps: list, krs: list, externs: list[str]) -> list[str]:
    """`externs` and a KP_EXTERN_PRE/POST/KRET line for each handler the kprobes (kps) and
    kretprobes' entries (krs) name, once each, in spec order (runtime/platform/linux_module's
    macros declare them)."""
    out, declared = list(externs), set()

    def declare(h, kind):
        if h and handler_symbols[h] not in declared:
            declared.add(handler_symbols[h])
            out.append(f"KP_EXTERN_{kind}({handler_symbols[h]})")
    for p in kps:
        declare(p.spec.pre_handler, "PRE")
        declare(p.spec.post_handler, "POST")
    for ep in krs:
        declare(ep.kret.handler, "KRET")
        declare(ep.kret.entry_handler, "KRET")
    return out


def kretprobes_c(krs: list, flags: list[str], handler_symbols: dict[str, str], traces: dict) -> list[str]:
    """The kretprobes' macros of a module's kp_module.c (kp_module_runtime.c's KP_KRETPROBES,
    KP_POOLS, KP_STRIDES, KP_POOL_NAMES, KP_KRET_LIST): krs the plan's kretprobes, flags each one's
    struct kprobe flags; traces: the trace events whose return handlers run in place of the user's."""
    from ...probes.events import trace_key
    out = []
    # kretprobes: a pool of maxactive instances each, of stride bytes (the instance, then data_size).
    strides = [(32 + ep.kret.data_size + 7) // 8 * 8 for ep in krs]
    out.append(_define("KP_KRETPROBES", [
        f"KP_KRETPROBE({_c_string(ep.symbol)}, {ep.offset}, {flag}, {_c_string(ep.event_name)}, {ep.index}, "
        f"{ep.kret.maxactive or 16}, {ep.kret.data_size})" for ep, flag in zip(krs, flags)]))
    out.append(_define("KP_POOLS", [f"KP_POOL({j}, {(ep.kret.maxactive or 16) * st})"
                                    for j, (ep, st) in enumerate(zip(krs, strides))]))
    out.append(f"#define KP_STRIDES {', '.join(map(str, strides)) or '0'}")
    out.append(f"#define KP_POOL_NAMES {', '.join(f'kp_pool_{j}' for j in range(len(krs))) or '0'}")
    kret = []
    for j, ep in enumerate(krs):
        h = handler_symbols.get(ep.kret.handler) if ep.kret.handler else None
        if trace_key(ep) in traces:         # the event's return handler, which calls the user's
            h = f"kp_trace_ret_{trace_key(ep)}"
        eh = handler_symbols.get(ep.kret.entry_handler) if ep.kret.entry_handler else None
        kret.append(f"X({j}, {f'KP_KRET_ENTRY_HANDLER({eh})' if eh else ''}, {f'KP_KRET_HANDLER({h})' if h else ''})")
    out.append(_define("KP_KRET_LIST(X)", kret))
    return out

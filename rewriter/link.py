"""Stage 6: link handlers and runtime.

Compiles the runtime, the user's handlers (C sources or relocatable objects) and
the generated probe table freestanding, and links them with `ld -pie` at the
address the new segments will have, so every reference is resolved at rewrite
time.  What remains are the arch's base-relative entries (its r_relative), applied
here at link-time addresses; the runtime adds the load bias to them at start-up
(PIE, shared).
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from elftools.elf.elffile import ELFFile

from . import cache
from .errors import KprewriteError
from .resources import runtime_dir

RUNTIME_DIR = runtime_dir()

CFLAGS = ["-O2", "-fPIC", "-ffreestanding", "-fno-stack-protector", "-fno-asynchronous-unwind-tables",
          "-fno-unwind-tables", "-mgeneral-regs-only", "-fvisibility=hidden", "-fno-common",
          "-fcf-protection=none", "-fno-tree-loop-distribute-patterns", "-fno-plt",
          "-std=gnu11", "-w", "-fno-ident"]

PLATFORM = "linux_user"
# In link order ({arch}: runtime/arch/<arch>/, {platform}: runtime/platform/<platform>/),
# then the arch's .S files.  The order decides where each function lands: changing
# it changes every output.
RUNTIME_SOURCES = ["kp_core.c", "kp_lib.c", "kp_printk.c", "{platform}/platform.c"]
# INT3 fallback probes (issue 3).
RUNTIME_SOURCES += ["{arch}/kp_int3.c", "{platform}/kp_signal.c", "{platform}/kp_sighook.c"]
# kretprobes (issue 4).
RUNTIME_SOURCES += ["kp_kretprobe.c", "{platform}/clock_cpus.c"]
# kprobe_events, fetch args, trace lines (issue 5).
RUNTIME_SOURCES += ["kp_fetch.c", "kp_trace.c", "{platform}/profile_signal.c"]
# Compiled to assembly for their "->NAME value" lines, never linked (asm_offsets()).
ASM_OFFSETS_SOURCES = ["kp_asm_offsets.c", "{arch}/kp_asm_offsets.c"]

# A kernel image (runtime/platform/linux_kernel): no signals, no GOT hooks; kretprobes
# the kernel's way, instances per task (kp_kretprobe_task.c, for kp_kretprobe.c);
# breakpoint sites through a hook on the kernel's kprobe_int3_handler().  Compiled as kernel code is: kernel code model, no red
# zone (interrupts push below %rsp), not position-independent (linked where it
# runs), and the image's return-thunk and retpoline conventions.
KERNEL_RUNTIME_SOURCES = ["kp_core.c", "kp_lib.c", "kp_printk.c", "{platform}/platform.c",
                          "{platform}/kp_kretprobe_task.c", "kp_fetch.c", "kp_trace.c",
                          "{arch}/kp_int3.c", "{platform}/kp_int3_hook.c", "{platform}/kp_debugfs.c"]
# kprobe_events into the ftrace ring buffer, symbols from kallsyms (issue 11).
KERNEL_RUNTIME_SOURCES += ["{platform}/kp_trace_buffer.c"]
KERNEL_CFLAGS = [f for f in CFLAGS if f not in ("-fPIC", "-fno-plt")] + [
    "-D__KERNEL__", "-fno-pic", "-fno-pie", "-mcmodel=kernel", "-mno-red-zone", "-mpreferred-stack-boundary=3",
    "-mfunction-return=thunk-extern",
    "-mindirect-branch=thunk-extern", "-mindirect-branch-register"]


@dataclass(frozen=True)
class Platform:
    """How the runtime is built and linked for a runtime/platform/<name> folder."""
    sources: tuple[str, ...]          # C sources in link order
    cflags: tuple[str, ...]
    asm_exclude: frozenset = frozenset()   # the arch's .S files it has no use for
    pie: bool = True                  # linked -pie (relocated at run time) or where it runs


PLATFORMS = {
    "linux_user": Platform(tuple(RUNTIME_SOURCES), tuple(CFLAGS)),
    "linux_kernel": Platform(tuple(KERNEL_RUNTIME_SOURCES), tuple(KERNEL_CFLAGS), frozenset({"sigreturn.S"}), pie=False),
}


def _platform(name: str) -> Platform:
    p = PLATFORMS.get(name)
    if p is None:
        raise KprewriteError(f"no runtime platform '{name}' (runtime/platform/{name}: known: {', '.join(PLATFORMS)})")
    return p
CACHE_FORMAT = "1"      # bump when what a cache entry holds changes

LINKER_SCRIPT = """
SECTIONS
{{
  . = {text:#x};
  .text : {{ *(.text .text.*) *(.kprobes.text) }}
  .rodata : {{ *(.rodata .rodata.*) }}
  .rela.dyn : {{ __kp_rela_start = .; *(.rela.dyn) *(.rela.*) __kp_rela_end = .; }}
  {data}
  __kp_data_start = .;
  .data : {{ *(.data .data.*) *(.data.rel.ro .data.rel.ro.*) *(.got) *(.got.plt) }}
  .bss : {{ *(.bss .bss.*) *(COMMON) }}
  __kp_data_end = .;
  . = ALIGN(0x1000);
  .dynamic : {{ *(.dynamic) }}
  /DISCARD/ : {{ *(.note.*) *(.comment) *(.eh_frame*) *(_kprobe_blacklist) *(.interp) }}
}}
"""


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


def _run(cmd, what: str, cwd=None):
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if r.returncode != 0:
        lines = [l for l in (r.stderr + r.stdout).splitlines() if "error" in l or "undefined" in l]
        raise KprewriteError(*(f"{what}: {l.strip()}" for l in (lines or (r.stderr + r.stdout).splitlines()[:5] or ["failed"])))
    return r


def compiler() -> str:
    cc = os.environ.get("CC", "gcc")
    if not shutil.which(cc):
        raise KprewriteError(f"no C compiler: '{cc}' not found (set CC)")
    return cc


def c_string(s: str | None) -> str:
    if s is None:
        return "0"
    out = []
    for ch in s.encode():
        if ch in (0x22, 0x5C):
            out.append("\\" + chr(ch))
        elif 0x20 <= ch < 0x7F:
            out.append(chr(ch))
        else:
            out.append(f"\\{ch:03o}")
    return '"' + "".join(out) + '"'


_DEF_RE_CACHE: dict[Path, str] = {}


def defines_function(cc: str, src: Path, name: str) -> bool:
    """Whether a C source defines function `name` (static or not): after the
    preprocessor, `name (...) {` with no `;` between the parameters and the brace."""
    text = _DEF_RE_CACHE.get(src)
    if text is None:
        r = _run([cc, "-E", "-P", f"-I{RUNTIME_DIR / 'include'}", str(src)], f"{src.name}")
        text = _DEF_RE_CACHE[src] = r.stdout
    return re.search(r"\b" + re.escape(name) + r"\s*\([^;{}]*\)\s*(__attribute__\s*\(\(.*?\)\)\s*)*\{", text, re.S) is not None


def object_defines(obj: Path, name: str) -> bool:
    with open(obj, "rb") as f:
        e = ELFFile(f)
        st = e.get_section_by_name(".symtab")
        for s in st.iter_symbols() if st else []:
            if s.name == name and s["st_shndx"] != "SHN_UNDEF" and s["st_info"]["bind"] in ("STB_GLOBAL", "STB_WEAK"):
                return True
    return False


def resolve_handlers(cc: str, handlers: list[Path], names: set[str]) -> tuple[dict[str, str], dict[Path, list[str]], list[str]]:
    """Which handler file defines each handler name.  Returns (name -> link symbol,
    source -> names to export from it, missing names)."""
    link_sym: dict[str, str] = {}
    exports: dict[Path, list[str]] = {h: [] for h in handlers}
    missing = []
    for name in sorted(names):
        found = []
        for h in handlers:
            if h.suffix == ".o":
                if object_defines(h, name):
                    found.append(h)
            elif defines_function(cc, h, name):
                found.append(h)
        if not found:
            missing.append(name)
            continue
        h = found[0]
        if h.suffix == ".o":
            link_sym[name] = name
        else:
            link_sym[name] = f"kp_handler_{name}"
            exports[h].append(name)
    return link_sym, exports, missing


def _folders(arch, platform: str) -> dict[str, str]:
    """The runtime folders of an arch (its rewriter module, or its name) and a platform."""
    return {"arch": f"arch/{getattr(arch, 'name', arch)}", "platform": f"platform/{platform}"}


@functools.lru_cache(maxsize=None)
def _compiler_identity(cc: str) -> tuple[str, str]:
    """(identity, target): the resolved driver and what `cc -v` says (version,
    configuration, target), which the cache key includes."""
    path = shutil.which(cc) or cc
    r = subprocess.run([cc, "-v"], capture_output=True, text=True)
    target = re.search(r"^Target:\s*(\S+)", r.stderr, re.M)
    return f"{os.path.realpath(path)}\n{r.stderr}", target.group(1) if target else ""


def default_arch(cc: str | None = None) -> str:
    """The arch the compiler builds for (its target triple's first part): its runtime folder."""
    target = _compiler_identity(cc or compiler())[1]
    if not target:
        raise KprewriteError(f"{cc or compiler()} -v names no target: cannot tell which runtime/arch/ folder to build")
    return target.split("-")[0]


def _includes(arch=None, platform: str = PLATFORM) -> list[str]:
    """-I for the runtime and the code compiled against it: the handler API
    (include/), the core, and the arch's and platform's folders, where
    kp_arch.h and kp_platform.h are."""
    d = _folders(arch or default_arch(), platform)
    return [f"-I{RUNTIME_DIR / 'include'}", f"-I{RUNTIME_DIR}", f"-I{RUNTIME_DIR / d['arch']}",
            f"-I{RUNTIME_DIR / d['platform']}"]


def _runtime_files(arch, platform: str) -> tuple[list[str], list[str], list[str]]:
    """(C sources in link order, the arch's .S files, the asm-offsets sources), relative to RUNTIME_DIR."""
    d = _folders(arch, platform)
    plat = _platform(platform)
    c = [src.format(**d) for src in plat.sources]
    asm = [f"{d['arch']}/{p.name}" for p in sorted((RUNTIME_DIR / d["arch"]).glob("*.S"))
           if p.name not in plat.asm_exclude]
    offsets = [src.format(**d) for src in ASM_OFFSETS_SOURCES if (RUNTIME_DIR / src.format(**d)).exists()]
    return c, asm, offsets


@functools.lru_cache(maxsize=None)
def _runtime_key(cc: str, arch: str, platform: str) -> str:
    """What the compiled runtime depends on: every file of the runtime tree
    (sources and headers, by contents), the compiler, the flags, arch and platform."""
    h = hashlib.sha256()
    plat = _platform(platform)
    for part in (CACHE_FORMAT, arch, platform, *_compiler_identity(cc), *plat.cflags, *plat.sources,
                 *ASM_OFFSETS_SOURCES, *sorted(plat.asm_exclude)):
        h.update(part.encode() + b"\0")
    for f in sorted(p for p in RUNTIME_DIR.rglob("*") if p.is_file() and p.suffix in (".c", ".h", ".S")):
        h.update(str(f.relative_to(RUNTIME_DIR)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def _build_runtime(cc: str, arch: str, platform: str, out: Path) -> None:
    """Compile the runtime into `out`: asm-offsets.h and the objects."""
    inc = _includes(arch, platform)
    cflags = _platform(platform).cflags
    c_srcs, asm_srcs, offset_srcs = _runtime_files(arch, platform)
    lines = []
    for i, src in enumerate(offset_srcs):
        s = out / f"asm_offsets{i}.s"
        _run([cc, *cflags, *inc, "-S", str(RUNTIME_DIR / src), "-o", str(s)], f"runtime {src}")
        lines += re.findall(r'"->(\w+) [$#]?(-?\d+)"', s.read_text())
        s.unlink()
    (out / "include").mkdir()
    (out / "include" / "kp_asm_offsets.h").write_text(
        "/* Generated by rewriter/link.py from the runtime's kp_asm_offsets.c files. */\n"
        "#ifndef _KP_ASM_OFFSETS_H\n#define _KP_ASM_OFFSETS_H\n"
        + "".join(f"#define {name} {value}\n" for name, value in lines) + "#endif\n")
    for src in c_srcs:
        o = out / ("rt_" + src.replace("/", "_") + ".o")
        _run([cc, *cflags, *inc, "-c", str(RUNTIME_DIR / src), "-o", str(o)], f"runtime {src}")
    for src in asm_srcs:
        o = out / ("rt_" + Path(src).name + ".o")
        _run([cc, *inc, f"-I{out / 'include'}", "-c", str(RUNTIME_DIR / src), "-o", str(o)], f"runtime {Path(src).name}")


_BUILT: dict[str, Path] = {}


def _runtime_build(cc: str, arch=None, platform: str = PLATFORM) -> Path:
    """The folder holding the compiled runtime for (sources, compiler, flags,
    arch, platform): the cache's entry, built once (in a temporary folder
    renamed into place, so concurrent processes never see half an entry); or,
    if the cache cannot be written, a temporary folder built once for this process."""
    arch = getattr(arch, "name", arch) or default_arch(cc)
    key = _runtime_key(cc, arch, platform)
    if key in _BUILT:
        return _BUILT[key]
    entry = cache.cache_dir() / f"runtime-{arch}-{platform}-{key}"
    if entry.is_dir():
        try:
            os.utime(entry)     # used now: the last to be evicted (cache.prune)
        except OSError:
            pass
    else:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        except OSError:
            entry = Path(tempfile.mkdtemp(prefix="kprewrite-runtime-"))
            atexit.register(shutil.rmtree, entry, ignore_errors=True)
            _build_runtime(cc, arch, platform, entry)
            _BUILT[key] = entry
            return entry
        try:
            _build_runtime(cc, arch, platform, tmp)
            os.rename(tmp, entry)
            cache.prune(entry.parent.glob(f"runtime-{arch}-{platform}-*"))
        except OSError:
            if not entry.is_dir():      # not another process's entry: a failed rename
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _BUILT[key] = entry
    return entry


@functools.lru_cache(maxsize=None)
def asm_offsets(arch=None, platform: str = PLATFORM) -> dict[str, int]:
    """NAME -> value of the runtime's kp_asm_offsets.c files (struct layouts and
    constants the emitted code uses), read from the compiled runtime's
    kp_asm_offsets.h (the kernel's asm-offsets)."""
    header = _runtime_build(compiler(), arch, platform) / "include" / "kp_asm_offsets.h"
    return {name: int(value) for name, value in re.findall(r"^#define (\w+) (-?\d+)$", header.read_text(), re.M)}


def compile_runtime(cc: str, workdir: Path | None = None, arch=None, platform: str = PLATFORM) -> list[Path]:
    """The runtime's objects in link order, compiled once per (sources,
    compiler, flags, arch, platform) and cached (_runtime_build(); workdir is
    not needed)."""
    out = _runtime_build(cc, arch, platform)
    c_srcs, asm_srcs, _ = _runtime_files(getattr(arch, "name", arch) or default_arch(cc), platform)
    return [out / ("rt_" + src.replace("/", "_") + ".o") for src in c_srcs] + \
        [out / ("rt_" + Path(src).name + ".o") for src in asm_srcs]


def runtime_sources() -> list[Path]:
    """Every file the compiled runtime depends on (what _runtime_key() hashes)."""
    return sorted(p for p in RUNTIME_DIR.rglob("*") if p.is_file() and p.suffix in (".c", ".h", ".S"))


def compile_handlers(cc: str, workdir: Path, handlers: list[Path], exports: dict[Path, list[str]],
                     platform: str = PLATFORM, headers: Path | None = None,
                     deps: list[Path] | None = None) -> list[Path]:
    """The handlers' objects; with `deps`, every file each C source read (gcc -MD:
    the source and the headers it includes, but not what kprewrite generated in
    `workdir`) is appended to it."""
    objs = []
    first = [f"-I{headers}"] if headers is not None and headers.is_dir() else []
    for i, h in enumerate(handlers):
        if h.suffix == ".o":
            objs.append(h)
            continue
        # Include the user's file and export its handlers under our own names:
        # kernel sample handlers are static, and an alias keeps them reachable.
        wrapper = workdir / f"handler{i}.c"
        lines = [f'#include "{h}"']
        for name in exports.get(h, []):
            lines.append(f'extern __typeof__({name}) kp_handler_{name} __attribute__((alias("{name}"), used));')
        wrapper.write_text("\n".join(lines) + "\n")
        o = workdir / f"handler{i}.o"
        d = workdir / f"handler{i}.d"
        _run([cc, *_platform(platform).cflags, *first, *_includes(platform=platform), f"-I{h.parent}", "-c", str(wrapper),
              "-o", str(o), *(["-MD", "-MF", str(d)] if deps is not None else [])], h.name)
        if deps is not None:
            scratch = workdir.resolve()
            deps += [p for p in read_depfile(d) if scratch not in p.parents]
        objs.append(o)
    return objs


def read_depfile(path: Path) -> list[Path]:
    """The prerequisites of a make-style depfile gcc wrote (-MD), resolved."""
    text = path.read_text().replace("\\\n", " ")
    _, _, rest = text.partition(": ")
    words, cur, i = [], "", 0
    while i < len(rest):
        ch = rest[i]
        if ch == "\\" and i + 1 < len(rest) and rest[i + 1] in " #":
            cur += rest[i + 1]
            i += 2
            continue
        if ch.isspace():
            if cur:
                words.append(cur)
            cur = ""
        elif ch == "$" and rest[i + 1:i + 2] == "$":
            cur += "$"
            i += 1
        else:
            cur += ch
        i += 1
    if cur:
        words.append(cur)
    return [Path(w).resolve() for w in words]


def compile_table(cc: str, workdir: Path, table_c: str, platform: str = PLATFORM) -> Path:
    table = workdir / "kp_table.c"
    table.write_text(table_c)
    o = workdir / "kp_table.o"
    _run([cc, *_platform(platform).cflags, *_includes(platform=platform), "-c", str(table), "-o", str(o)],
         "probe table")
    return o


def executable_sections(obj: Path) -> list[bytes]:
    """The bytes of each executable section of a relocatable object."""
    try:
        with open(obj, "rb") as f:
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


# Symbols the linker script defines.
SCRIPT_SYMBOLS = frozenset({"__kp_rela_start", "__kp_rela_end", "__kp_data_start", "__kp_data_end"})


def undefined_symbols(objs: list[Path]) -> dict[str, Path]:
    """name -> the first object that references it, for every global symbol no
    object defines (and the linker script does not): what the image must provide."""
    defined, wanted = set(SCRIPT_SYMBOLS), {}
    for obj in objs:
        with open(obj, "rb") as f:
            st = ELFFile(f).get_section_by_name(".symtab")
            for sym in st.iter_symbols() if st else []:
                if not sym.name or sym["st_info"]["bind"] not in ("STB_GLOBAL", "STB_WEAK"):
                    continue
                if sym["st_shndx"] != "SHN_UNDEF":
                    defined.add(sym.name)
                elif sym["st_info"]["bind"] == "STB_GLOBAL":
                    wanted.setdefault(sym.name, obj)
    return {n: o for n, o in wanted.items() if n not in defined}


def link(workdir: Path, objs: list[Path], text_addr: int, platform: str = PLATFORM,
         externs: dict[str, int | None] | None = None, origin: dict[Path, str] | None = None,
         image_name: str = "the image", data_addr: int | None = None) -> Blob:
    """Link at text_addr.  A PIE platform's blob is self-contained; any other
    resolves what it leaves undefined from `externs` (the image's symbols:
    name -> address, None when the name is ambiguous), each missing one an
    error naming the symbol and the file that uses it (`origin`: object -> name).
    data_addr: where the data starts (default: the page after the code)."""
    script = workdir / "kp.ld"
    text = LINKER_SCRIPT.format(text=text_addr, data=". = ALIGN(0x1000);" if data_addr is None else f". = {data_addr:#x};")
    out = workdir / "blob.elf"
    if _platform(platform).pie:
        script.write_text(text)
        _run(["ld", "-pie", "--no-dynamic-linker", "-z", "norelro", "-z", "noexecstack", "--hash-style=gnu",
              "--build-id=none", "-nostdlib", "-T", str(script), "-o", str(out), *map(str, objs)], "link")
        return read_blob(out.read_bytes(), out)
    externs, origin = externs or {}, origin or {}
    errors, assigns = [], []
    for name, obj in sorted(undefined_symbols(objs).items()):
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
    _run(["ld", "-static", "-q", "-z", "noexecstack", "--build-id=none", "-nostdlib", "-T", str(script),
          "-o", str(out), *map(str, objs)], "link")
    return read_blob(out.read_bytes(), out)


def read_blob(raw: bytes, path: Path) -> Blob:
    import io
    e = ELFFile(io.BytesIO(raw))
    syms = {}
    for s in e.get_section_by_name(".symtab").iter_symbols():
        if s.name and s["st_shndx"] != "SHN_UNDEF":
            syms[s.name] = s["st_value"]
    secs = [(s.name, s["sh_type"], s["sh_flags"], s["sh_addr"], s["sh_size"], s["sh_offset"]) for s in e.iter_sections()]

    def vaddr_bytes(lo, hi):
        buf = bytearray(hi - lo)
        for name, typ, flags, addr, size, off in secs:
            if flags & 2 and typ != "SHT_NOBITS" and addr < hi and addr + size > lo:
                a, b = max(lo, addr), min(hi, addr + size)
                buf[a - lo:b - lo] = raw[off + a - addr:off + b - addr]
        return buf

    text_addr = min(addr for name, typ, flags, addr, size, off in secs if name == ".text")
    text_end = syms["__kp_rela_end"]
    data_lo, data_hi = syms["__kp_data_start"], syms["__kp_data_end"]
    text = vaddr_bytes(text_addr, text_end)
    data_file_hi = max([addr + size for name, typ, flags, addr, size, off in secs
                        if flags & 2 and typ != "SHT_NOBITS" and data_lo <= addr < data_hi] + [data_lo])
    data = vaddr_bytes(data_lo, data_file_hi)
    # Apply the arch's base-relative relocations at link-time addresses; refuse anything else.
    rela = e.get_section_by_name(".rela.dyn")
    if rela is not None:
        from .arch import MACHINES, get_arch
        r_relative = get_arch(MACHINES[int.from_bytes(raw[18:20], "little")]).r_relative
        for r in rela.iter_relocations():
            typ = r["r_info_type"]
            if typ != r_relative:
                raise KprewriteError(f"link: handler code needs dynamic relocation type {typ} at {r['r_offset']:#x}; "
                                     "handlers must be position-independent and self-contained")
            off, val = r["r_offset"], r["r_addend"] & (2**64 - 1)
            if data_lo <= off < data_file_hi:
                data[off - data_lo:off - data_lo + 8] = val.to_bytes(8, "little")
            elif text_addr <= off < text_end:
                text[off - text_addr:off - text_addr + 8] = val.to_bytes(8, "little")
            else:
                raise KprewriteError(f"link: relocation at {off:#x} outside the linked sections")
    sections = [(n, t, f, a, s) for n, t, f, a, s, o in secs if f & 2 and s and n not in (".dynamic",)]
    return Blob(text_addr, bytes(text), data_lo, bytes(data), data_hi - data_lo, syms, sections, _emitted_relocs(e))


def _emitted_relocs(e) -> list[LinkReloc]:
    """The relocations ld -q kept (SHT_RELA sections of a static link) that apply to
    loaded sections."""
    out = []
    symtab = e.get_section_by_name(".symtab")
    for sec in e.iter_sections():
        if sec["sh_type"] != "SHT_RELA" or sec.name == ".rela.dyn" or not sec["sh_info"]:
            continue
        target = e.get_section(sec["sh_info"])
        if not target["sh_flags"] & 2 or target["sh_type"] == "SHT_NOBITS":
            continue
        for r in sec.iter_relocations():
            s = symtab.get_symbol(r["r_info_sym"])
            out.append(LinkReloc(r["r_offset"], r["r_info_type"], s["st_value"], s["st_shndx"] == "SHN_ABS",
                                 s.name, r["r_addend"]))
    return sorted(out, key=lambda r: r.offset)

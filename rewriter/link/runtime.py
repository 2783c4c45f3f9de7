"""The compiled runtime: runtime/ built for (arch, platform) from the platform's
recipe (rewriter/targets/<platform>/recipe.py: sources in link order, flags, the
arch's folders it uses) and the arch's flags (rewriter/arch/<arch>/toolchain.py),
cached per contents of the runtime tree, compiler, flags, arch and platform (and the
recipe's variant, when a target asks for one: VARIANTS, its extra flags); its
kp_asm_offsets.h (the kernel's asm-offsets) for the emitted code.  A recipe may name its
.S files (ASM_SOURCES; else every .S of the arch's folders) and go without asm-offsets
(ASM_OFFSETS = False)."""
from __future__ import annotations

import atexit
import functools
import hashlib
import os
import re
import shutil
import tempfile
from importlib import import_module
from pathlib import Path

from .. import cache
from ..errors import KprewriteError
from .resources import runtime_dir
from .toolchain import arch_name, arch_toolchain, compiler, compiler_identity, default_arch, run

RUNTIME_DIR = runtime_dir()

PLATFORM = "linux_user"
# Compiled to assembly for their "->NAME value" lines, never linked (asm_offsets()).
ASM_OFFSETS_SOURCES = ["kp_asm_offsets.c", "{arch}/kp_asm_offsets.c"]
CACHE_FORMAT = "1"      # bump when what a cache entry holds changes


def recipe(platform: str):
    """rewriter/targets/<platform>/recipe.py: how the runtime/platform/<platform> runtime is built."""
    try:
        return import_module(f"rewriter.targets.{platform}.recipe")
    except ModuleNotFoundError:
        raise KprewriteError(f"no runtime platform '{platform}' (rewriter/targets/{platform}/recipe.py)") from None


def cflags(arch=None, platform: str = PLATFORM) -> tuple[str, ...]:
    """The C flags of the runtime, handlers and tables: the platform's, then the
    arch's for the platform's kind of code."""
    r = recipe(platform)
    return (*r.CFLAGS, *arch_toolchain(arch_name(arch) or default_arch()).CFLAGS[r.CODE])


def pie(platform: str) -> bool:
    """Whether the platform's blob is linked -pie (relocated at run time) or where it runs."""
    return recipe(platform).PIE


def _folders(arch, platform: str) -> dict[str, str]:
    """The runtime folders of an arch (its rewriter module, or its name) and a platform."""
    return {"arch": f"arch/{arch_name(arch)}", "platform": f"platform/{platform}"}


def _arch_folders(arch, platform: str) -> list[str]:
    """The arch's folders the platform uses (runtime/arch/<arch>/<folder>), those that exist."""
    d = _folders(arch, platform)["arch"]
    return [f"{d}/{f}" for f in recipe(platform).ARCH_FOLDERS if (RUNTIME_DIR / d / f).is_dir()]


def _includes(arch=None, platform: str = PLATFORM) -> list[str]:
    """-I for the runtime and the code compiled against it: the handler API
    (include/), the core, the arch's folder and those of its folders the platform
    uses, and the platform's folder (kp_arch.h, kp_platform.h...)."""
    arch = arch or default_arch()
    d = _folders(arch, platform)
    return [f"-I{RUNTIME_DIR / 'include'}", f"-I{RUNTIME_DIR}", f"-I{RUNTIME_DIR / d['arch']}",
            *(f"-I{RUNTIME_DIR / f}" for f in _arch_folders(arch, platform)),
            f"-I{RUNTIME_DIR / d['platform']}"]


class _Roles(dict):
    """An arch's RUNTIME_FILES for a recipe's {role} fields: a role the arch has no file
    for (AArch64 has no kernel #BP hook yet) is an error that says so."""
    def __init__(self, files: dict, arch: str, platform: str):
        super().__init__(files)
        self.where = (arch, platform)

    def __missing__(self, role: str):
        arch, platform = self.where
        raise KprewriteError(f"the {platform} runtime needs the {arch} runtime's {role} file, which it has "
                             f"not (RUNTIME_FILES in rewriter/arch/{arch}/toolchain.py)")


def _variant(platform: str, variant: str | None) -> dict:
    """A recipe's variant (its VARIANTS[variant]): extra C flags (a list), or a dict of "flags"
    and what it builds instead of the recipe's own "SOURCES", "ASM_SOURCES", "ASM_OFFSETS"
    (a part of the runtime on its own: the arm64 kernel's runtime placed at boot); {} for None."""
    if variant is None:
        return {}
    variants = getattr(recipe(platform), "VARIANTS", {})
    if variant not in variants:
        raise KprewriteError(f"the {platform} runtime has no variant '{variant}' (VARIANTS in "
                             f"rewriter/targets/{platform}/recipe.py)")
    v = variants[variant]
    return dict(v) if isinstance(v, dict) else {"flags": list(v)}


def _runtime_files(arch, platform: str, variant: str | None = None) -> tuple[list[str], list[str], list[str]]:
    """(C sources in link order, the arch's .S files, the asm-offsets sources), relative to RUNTIME_DIR."""
    d = _folders(arch, platform)
    r = recipe(platform)
    v = _variant(platform, variant)
    # The arch's own names for the files a recipe names by role ({breakpoint}...).
    name = arch_name(arch) or default_arch()
    fields = _Roles({**arch_toolchain(name).RUNTIME_FILES, **d}, name, platform)
    c = [src.format_map(fields) for src in v.get("SOURCES", r.SOURCES)]
    asm_sources = v.get("ASM_SOURCES", getattr(r, "ASM_SOURCES", None))
    if asm_sources is not None:
        asm = [src.format_map(fields) for src in asm_sources]
    else:
        asm = [f"{folder}/{p.name}" for folder in (d["arch"], *_arch_folders(arch, platform))
               for p in sorted((RUNTIME_DIR / folder).glob("*.S"))]
    offsets = [src.format(**d) for src in ASM_OFFSETS_SOURCES
               if v.get("ASM_OFFSETS", getattr(r, "ASM_OFFSETS", True)) and (RUNTIME_DIR / src.format(**d)).exists()]
    return c, asm, offsets


def variant_flags(platform: str, variant: str | None) -> tuple[str, ...]:
    """The extra C flags of a recipe's variant (its VARIANTS); none for None."""
    return tuple(_variant(platform, variant).get("flags", ()))


@functools.lru_cache(maxsize=None)
def _runtime_key(cc: str, arch: str, platform: str, variant: str | None = None) -> str:
    """What the compiled runtime depends on: every file of the runtime tree
    (sources and headers, by contents), the compiler, the flags, arch, platform and variant."""
    h = hashlib.sha256()
    c_srcs, asm_srcs, _ = _runtime_files(arch, platform, variant)
    extra = ("variant", variant, *variant_flags(platform, variant)) if variant is not None else ()
    for part in (CACHE_FORMAT, arch, platform, *compiler_identity(cc), *cflags(arch, platform), *extra, *c_srcs,
                 *ASM_OFFSETS_SOURCES, *asm_srcs):
        h.update(part.encode() + b"\0")
    for f in runtime_sources():
        h.update(str(f.relative_to(RUNTIME_DIR)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def runtime_key(cc: str, arch: str, platform: str, variant: str | None = None) -> str:
    """The runtime's cache key (its sources, headers, compiler, flags): what a cached
    link of code compiled against its headers depends on too."""
    return _runtime_key(cc, arch, platform, variant)


def _object(src: str) -> str:
    """The object file name of a runtime source."""
    return "rt_" + (Path(src).name if src.endswith(".S") else src.replace("/", "_")) + ".o"


def _build_runtime(cc: str, arch: str, platform: str, out: Path, variant: str | None = None) -> None:
    """Compile the runtime into `out`: asm-offsets.h and the objects."""
    inc = _includes(arch, platform)
    flags = (*cflags(arch, platform), *variant_flags(platform, variant))
    c_srcs, asm_srcs, offset_srcs = _runtime_files(arch, platform, variant)
    lines = []
    for i, src in enumerate(offset_srcs):
        s = out / f"asm_offsets{i}.s"
        run([cc, *flags, *inc, "-S", str(RUNTIME_DIR / src), "-o", str(s)], f"runtime {src}")
        lines += re.findall(r'"->(\w+) [$#]?(-?\d+)"', s.read_text())
        s.unlink()
    (out / "include").mkdir()
    (out / "include" / "kp_asm_offsets.h").write_text(
        "/* Generated by rewriter/link/runtime.py from the runtime's kp_asm_offsets.c files. */\n"
        "#ifndef _KP_ASM_OFFSETS_H\n#define _KP_ASM_OFFSETS_H\n"
        + "".join(f"#define {name} {value}\n" for name, value in lines) + "#endif\n")
    jobs = [([cc, *flags, *inc, "-c", str(RUNTIME_DIR / src), "-o", str(out / _object(src))], f"runtime {src}")
            for src in c_srcs]
    jobs += [([cc, *inc, f"-I{out / 'include'}", "-c", str(RUNTIME_DIR / src), "-o", str(out / _object(src))],
              f"runtime {Path(src).name}") for src in asm_srcs]
    from concurrent.futures import ThreadPoolExecutor
    # One gcc per CPU at a time (the objects do not depend on each other, and each is the
    # same bytes however many run at once); the first failure in source order is reported.
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        for f in [pool.submit(run, cmd, what) for cmd, what in jobs]:
            f.result()
    (out / MANIFEST).write_text(_manifest(out))


# The digest of every file a built runtime holds, written last: a cached entry whose
# files no longer match it (damaged on disk, cut short by a full one, edited) is built
# again rather than handed to the linker ("file format not recognized").
MANIFEST = "MANIFEST"


def _manifest(out: Path) -> str:
    return "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(out)}\n"
                   for p in sorted(out.rglob("*")) if p.is_file() and p.name != MANIFEST)


def _intact(entry: Path) -> bool:
    """The cached runtime's files are those its manifest lists, as they were built."""
    try:
        return (entry / MANIFEST).read_text() == _manifest(entry)
    except (OSError, UnicodeDecodeError):
        return False


_BUILT: dict[str, Path] = {}


def _runtime_build(cc: str, arch=None, platform: str = PLATFORM, variant: str | None = None) -> Path:
    """The folder holding the compiled runtime for (sources, compiler, flags,
    arch, platform): the cache's entry, built once (in a temporary folder
    renamed into place, so concurrent processes never see half an entry); or,
    if the cache cannot be written, a temporary folder built once for this process."""
    arch = arch_name(arch) or default_arch(cc)
    key = _runtime_key(cc, arch, platform, variant)
    if key in _BUILT:
        return _BUILT[key]
    kind = f"runtime-{arch}-{platform}" + (f"-{variant}" if variant else "")
    entry = cache.cache_dir() / f"{kind}-{key}"
    private = cache.trusted()   # else built in a temporary folder (below), as when it cannot be written
    if private and entry.is_dir() and not _intact(entry):
        # Damaged: set aside (another process may be reading it) and built again below.
        try:
            os.rename(entry, tempfile.mkdtemp(prefix=f".{entry.name}.damaged.", dir=entry.parent))
        except OSError:
            pass
        for old in entry.parent.glob(f".{entry.name}.damaged.*"):
            shutil.rmtree(old, ignore_errors=True)
    if private and entry.is_dir():
        try:
            os.utime(entry)     # used now: the last to be evicted (cache.prune)
        except OSError:
            pass
    else:
        try:
            if not private:
                raise OSError("the cache folder is not private")
            tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        except OSError:
            entry = Path(tempfile.mkdtemp(prefix="kprewrite-runtime-"))
            atexit.register(shutil.rmtree, entry, ignore_errors=True)
            _build_runtime(cc, arch, platform, entry, variant)
            _BUILT[key] = entry
            return entry
        try:
            _build_runtime(cc, arch, platform, tmp, variant)
            os.rename(tmp, entry)
            cache.prune(entry.parent.glob(f"{kind}-*"))
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
    header = _runtime_build(compiler(arch), arch, platform) / "include" / "kp_asm_offsets.h"
    return {name: int(value) for name, value in re.findall(r"^#define (\w+) (-?\d+)$", header.read_text(), re.M)}


def compile_runtime(cc: str, workdir: Path | None = None, arch=None, platform: str = PLATFORM,
                    variant: str | None = None) -> list[Path]:
    """The runtime's objects in link order, compiled once per (sources,
    compiler, flags, arch, platform, variant) and cached (_runtime_build(); workdir is
    not needed)."""
    out = _runtime_build(cc, arch, platform, variant)
    c_srcs, asm_srcs, _ = _runtime_files(arch_name(arch) or default_arch(cc), platform, variant)
    return [out / _object(src) for src in c_srcs + asm_srcs]


def runtime_sources() -> list[Path]:
    """Every file the compiled runtime depends on (what _runtime_key() hashes)."""
    return sorted(p for p in RUNTIME_DIR.rglob("*") if p.is_file() and p.suffix in (".c", ".h", ".S"))

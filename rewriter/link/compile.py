"""The user's handlers and the generated probe table as objects: which handler
file defines each name the spec uses, and their compilation for the image's
arch and platform (the runtime's flags and headers)."""
from __future__ import annotations

import re
from pathlib import Path


from .. import depfile
from .objects import object_defines
from .runtime import PLATFORM, RUNTIME_DIR, _includes, cflags
from .toolchain import default_arch, run

_DEF_RE_CACHE: dict[Path, str] = {}


def defines_function(cc: str, src: Path, name: str) -> bool:
    """Whether a C source defines function `name` (static or not): after the
    preprocessor, `name (...) {` with no `;` between the parameters and the brace."""
    text = _DEF_RE_CACHE.get(src)
    if text is None:
        r = run([cc, "-E", "-P", f"-I{RUNTIME_DIR / 'include'}", str(src)], f"{src.name}")
        text = _DEF_RE_CACHE[src] = r.stdout
    return re.search(r"\b" + re.escape(name) + r"\s*\([^;{}]*\)\s*(__attribute__\s*\(\(.*?\)\)\s*)*\{", text, re.S) is not None


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


def compile_handlers(cc: str, workdir: Path, handlers: list[Path], exports: dict[Path, list[str]],
                     platform: str = PLATFORM, headers: Path | None = None,
                     deps: list[Path] | None = None, arch=None) -> list[Path]:
    """The handlers' objects, for `arch` (default: the compiler's); with `deps`,
    every file each C source read (gcc -MD: the source and the headers it
    includes, but not what kprewrite generated in `workdir`) is appended to it."""
    arch = arch or default_arch(cc)
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
        run([cc, *cflags(arch, platform), *first, *_includes(arch, platform), f"-I{h.parent}", "-c", str(wrapper),
             "-o", str(o), *(["-MD", "-MF", str(d)] if deps is not None else [])], h.name)
        if deps is not None:
            scratch = workdir.resolve()
            deps += [p for p in depfile.read(d) if scratch not in p.parents]
        objs.append(o)
    return objs


def compile_table(cc: str, workdir: Path, table, platform: str = PLATFORM, arch=None) -> list[Path]:
    """The generated probe table's objects (table: tables.TableSource), for `arch`
    (default: the compiler's): its C, and its assembly when it has any."""
    arch = arch or default_arch(cc)
    src = workdir / "kp_table.c"
    src.write_text(table.c)
    objs = [workdir / "kp_table.o"]
    run([cc, *cflags(arch, platform), *_includes(arch, platform), "-c", str(src), "-o", str(objs[0])],
        "probe table")
    if table.asm:
        data = workdir / "kp_table_data.s"
        data.write_text(table.asm)
        objs.append(workdir / "kp_table_data.o")
        run([cc, *cflags(arch, platform), "-c", str(data), "-o", str(objs[1])], "probe table")
    return objs

"""The C compiler and linker for an image's arch: the GNU toolchain named by the
arch's target triple (rewriter/arch/<arch>/toolchain.py: TRIPLE-gcc, TRIPLE-ld)
when installed, else plain gcc and ld when the host is that arch; $CC overrides the compiler.  Handlers, tables and the runtime are compiled
for the image, never for the host."""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from importlib import import_module

from ..errors import KprewriteError


def run(cmd, what: str, cwd=None):
    """Run a tool; its error lines (or its first lines) as a KprewriteError naming `what`."""
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if r.returncode != 0:
        lines = [l for l in (r.stderr + r.stdout).splitlines() if "error" in l or "undefined" in l]
        raise KprewriteError(*(f"{what}: {l.strip()}" for l in (lines or (r.stderr + r.stdout).splitlines()[:5] or ["failed"])))
    return r


def arch_name(arch) -> str | None:
    """An arch back end (its module) or its name, as the name."""
    return getattr(arch, "name", arch)


def arch_toolchain(arch):
    """rewriter/arch/<arch>/toolchain.py: the arch's triple and flags."""
    name = arch_name(arch)
    try:
        return import_module(f"rewriter.arch.{name}.toolchain")
    except ModuleNotFoundError:
        raise KprewriteError(f"architecture {name} has no toolchain (rewriter/arch/{name}/toolchain.py)") from None


def _tool(arch, tool: str) -> str:
    """`tool` (gcc, ld) for arch: TRIPLE-tool when installed, else the host's when it is that arch."""
    from ..arch import host_machine
    name = arch_name(arch)
    triple = arch_toolchain(name).TRIPLE
    if shutil.which(f"{triple}-{tool}"):
        return f"{triple}-{tool}"
    if host_machine() == name and shutil.which(tool):
        return tool
    raise KprewriteError(f"no {tool} for {name}: neither {triple}-{tool} nor a {name} host's {tool} found")


def compiler(arch=None) -> str:
    """The C compiler: $CC if set; else for `arch` (an arch module or name) its
    toolchain's; with no arch, gcc."""
    cc = os.environ.get("CC")
    if cc is None:
        cc = "gcc" if arch is None else _tool(arch, "gcc")
    if not shutil.which(cc):
        raise KprewriteError(f"no C compiler: '{cc}' not found (set CC)")
    return cc


def linker(arch) -> str:
    """The linker for `arch`: its toolchain's ld (never a bare host ld for another arch)."""
    return _tool(arch, "ld")


@functools.lru_cache(maxsize=None)
def compiler_identity(cc: str) -> tuple[str, str]:
    """(identity, target): the resolved driver and what `cc -v` says (version,
    configuration, target), which the runtime cache key includes."""
    path = shutil.which(cc) or cc
    r = subprocess.run([cc, "-v"], capture_output=True, text=True)
    target = re.search(r"^Target:\s*(\S+)", r.stderr, re.M)
    return f"{os.path.realpath(path)}\n{r.stderr}", target.group(1) if target else ""


@functools.lru_cache(maxsize=None)
def tool_identity(tool: str) -> str:
    """A tool (ld) as a cache key names it: its resolved path, size and modification time."""
    path = os.path.realpath(shutil.which(tool) or tool)
    try:
        st = os.stat(path)
    except OSError:
        return path
    return f"{path} {st.st_size} {st.st_mtime_ns}"


def default_arch(cc: str | None = None) -> str:
    """The arch the compiler builds for (its target triple's first part): its runtime folder."""
    target = compiler_identity(cc or compiler())[1]
    if not target:
        raise KprewriteError(f"{cc or compiler()} -v names no target: cannot tell which runtime/arch/ folder to build")
    return target.split("-")[0]

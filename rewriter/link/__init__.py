"""Stage 6: link handlers and runtime.

Compiles the runtime, the user's handlers (C sources or relocatable objects) and
the generated probe table freestanding, for the image's arch, and links them with
its `ld` at the address the new segments will have, so every reference is resolved
at rewrite time.  This face hands on the stage's names to its callers; one job per
module:
  ld.py         the link itself (the `ld` script, the blob)
  toolchain.py  the compiler and linker of an arch (its target triple)
  runtime.py    the runtime built per (arch, platform) from the target's recipe and
                the arch's flags, cached; asm-offsets
  compile.py    which handler file defines each name; handlers and the probe table
                compiled
  objects.py    what relocatable objects hold (functions, sections, symbols)
  handlers.py   the user's handlers read for the planner (what their code touches)
  resources.py  where the runtime's sources are
"""
from ..emit.cstring import c_string
from ..depfile import read as read_depfile
from .compile import compile_handlers, compile_table, defines_function, resolve_handlers
from .ld import SCRIPT_SYMBOLS, Blob, LinkReloc, link, read_blob
from .objects import executable_sections, object_defines, object_functions, undefined_symbols
from .runtime import PLATFORM, RUNTIME_DIR, _includes, asm_offsets, cflags, compile_runtime, runtime_sources
from .toolchain import compiler, default_arch, linker

# The stage's names, wherever their module (handlers.py, pipeline.py, the arch back ends, tests).
__all__ = ["RUNTIME_DIR", "PLATFORM", "Blob", "LinkReloc", "SCRIPT_SYMBOLS", "asm_offsets", "c_string", "cflags",
           "compile_handlers", "compile_runtime", "compile_table", "compiler", "default_arch", "defines_function",
           "executable_sections", "link", "linker", "object_defines", "object_functions", "read_blob",
           "read_depfile", "resolve_handlers", "runtime_sources", "undefined_symbols", "_includes"]

"""Linux kernel modules (.ko): relocatable kernel objects (ET_REL) the module
loader lays out and relocates at insmod.  A third target beside linux_user/ and
linux_kernel/, reusing the kernel target's readers of the kernel's tables.  What depends
on the CPU is in one folder per architecture (x86_64/, aarch64/: relocatable, rules, writer),
chosen by the module's e_machine; a module of an architecture without a folder is
refused with one line.  What they share is here:

- relocatable.py: the module seen at addresses (its allocated sections laid out from the
  architecture's module area, its own relocations applied by <arch>/relocatable.py's
  apply()), as an ET_EXEC view the pipeline reads like any image; the ModuleObject keeps
  the .ko itself;
- the rules are the kernel's (linux_kernel/reserved.py on the view: the module's
  __mcount_loc or __patchable_function_entries, __ex_table, __jump_table, __bug_table,
  _kprobe_blacklist, .noinstr.text and the architecture's tables), plus the module's own:
  .init.text (freed after init) and the kernel's symbols the module refers to (stand-ins
  in the view); <arch>/rules.py's adjust() adds what its writer can and cannot write;
- <arch>/writer.py: the rewritten module through the back half's steps (lay_out, tables,
  link, emit, write: targets/base.py), linked with `ld -r` (x86_64/: kprobes and kretprobes
  at ftrace sites, optimized and breakpoint probes, trace events; aarch64/: jump-optimized
  kprobes and kretprobes; the rest is refused with one line, docs/limitations.md), on
  ko.py's shared steps (the sites in order, the kretprobes' macros, __versions, the
  module's name, the extra relocations, the .kprewrite.meta section);
- symvers.py: the kernel's Module.symvers, the CRCs of the kernel symbols the module's
  runtime adds to its imports (its __versions);
- kernel_btf.py: the kernel's BTF (beside Module.symvers, or /sys/kernel/btf/vmlinux), the
  layouts the module's trace events need to be the kernel's own event calls.
"""
from __future__ import annotations

from .. import base
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path

from ...analysis.rules import Rules
from ...errors import KprewriteError
from ..linux_kernel import reserved as _kernel_reserved

name = "linux_module"
RUNTIME_HANDLERS = frozenset()
TABLES_AT_BOOT = False
RUNTIME_KALLSYMS = True

# Sections the module loader frees after init or drops (CONFIG_MODULE_UNLOAD keeps
# .exit.text): a probe there could outlive the code.
INIT_SECTIONS = {".init.text": "in .init.text (freed after the module's init; kprobes: "
                 "within_module_init() probes are removed then)"}


def _arch(machine: str, path: str = "module"):
    """The module target's folder for an architecture (<machine>/: relocatable, rules,
    writer), or a one-line refusal when it has none yet."""
    name = f"{__name__}.{machine}"
    if find_spec(name) is None:
        have = sorted(p.name for p in Path(__file__).parent.iterdir() if (p / "__init__.py").is_file())
        raise KprewriteError(f"{path}: kernel modules for {machine} are not supported yet "
                             f"(rewriter/targets/linux_module/ has {', '.join(have)})")
    return import_module(name)


def _part(image, module: str):
    """The image's architecture's `module` of this target (x86_64/writer.py...)."""
    return import_module(f"{_arch(image.machine, image.path).__name__}.{module}")


# The section every module has (its struct module), as the module loader looks for it.
THIS_MODULE = ".gnu.linkonce.this_module"


def is_module(data: bytes) -> bool:
    """An ELF64 little-endian relocatable object with the section every module has."""
    from ...elf.view import ElfView
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1 or data[16:18] != b"\x01\x00":
        return False
    try:
        return ElfView(data, "module").section(THIS_MODULE) is not None
    except KprewriteError:
        return False


def detect(image) -> bool:
    """A module: an image unwrapped from a .ko (<arch>/relocatable.view())."""
    return getattr(getattr(image, "container", None), "KERNEL_MODULE", False)


def unwrap(data: bytes, path: str):
    """(the view's bytes, ModuleObject) when data is a kernel module, else None."""
    from ...arch import MACHINES
    if not is_module(data):
        return None
    e_machine = int.from_bytes(data[18:20], "little")
    machine = MACHINES.get(e_machine, f"e_machine {e_machine}")
    return _arch(machine, path).relocatable.view(data, path)


def load_symbols(image, system_map: str | None = None) -> None:
    """A module's functions are its .symtab's (a module keeps its symbol table: the
    loader's kallsyms for it is made from it).  `--system-map` names the kernel's
    Module.symvers for a module: the CRCs of the kernel symbols its runtime adds
    (symvers.py; else kbuild's /lib/modules/<release>/build/Module.symvers)."""
    from . import symvers
    image.container.symvers, image.container.symvers_path = symvers.load(image.container, system_map)


def rules(image, arch) -> Rules:
    """The kernel's rules read from the module's own tables (linux_kernel/reserved.py),
    plus its init sections."""
    from ...analysis.blacklist import BlacklistEntry, Index
    _tables(image)
    r = _kernel_reserved.rules(image, arch)
    extra = []
    for s in image.container.sections:
        why = INIT_SECTIONS.get(s.name)
        a = image.container.addr.get(s.index)
        if why and a is not None and s.size:
            extra += [BlacklistEntry(f.start, f.end, f.name, why)
                      for f in image.functions if a <= f.start < a + s.size]
    lo, hi = image.container.stand_in
    extra += [BlacklistEntry(f.start, f.end, f.name, "a kernel symbol the module refers to, not the module's "
                             "code (probe it in the kernel image)") for f in image.functions if lo <= f.start < hi]
    if extra:
        r.blacklist = Index(list(r.blacklist.entries) + extra)
    # What the module's architecture writes (<arch>/rules.py): its checks of a region's copy,
    # its breakpoint probes, its kretprobes.
    _part(image, "rules").adjust(image, arch, r)
    return r


def _tables(image) -> None:
    """The kernel readers' view of the module (linux_kernel.symbols.kernel() takes it from
    here): its functions as text symbols, as the module's kallsyms gives them (so the
    functions of .noinstr.text and .kprobes.text are listed one by one), its other symbols
    as bounds; not the kernel's stand-ins."""
    from ..linux_kernel.kallsyms import KSym
    from ..linux_kernel.symbols import arch_of
    lo, hi = image.container.stand_in
    syms = []
    for f in image.functions:
        if not lo <= f.start < hi:
            syms += [KSym(f.start, "t", n) for n in [f.name, *f.aliases]]
    named = {s.name for s in syms}
    syms += [KSym(a, "d", n) for n, a in image.all_symbols().items() if n not in named and not lo <= a < hi]
    image._kernel_tables = arch_of(image).sites.KernelImage(image.data, syms, image.path)


def runtime_probes(spec) -> None:
    """None yet (a module's runtime would start from the module's own init)."""


# `kprewrite diff` on a module (changes.py says so).
DIFF_REFUSAL = ("a kernel module is relinked (ld -r) when written, so its sections move; "
                "`kprewrite list` shows the rewritten module's probes")


# The back half's steps (targets/base.py; pipeline.build() asks them as of every target),
# answered by the module's architecture's writer: the loader's layout, the generated sources,
# `ld -r` with the module (ORC entries, __versions), the module's relocations pointed at
# our code, the .kprewrite.meta section.
def lay_out(s, code):
    return _part(s.image, "writer").lay_out(s, code)


def tables(s, code, lay):
    return _part(s.image, "writer").tables(s, code, lay)


def runtime_variant(s, lay) -> str | None:
    """The module runtime's event_calls variant when its events are the kernel's own event
    calls (the kernel's BTF read: recipe.py), else its recipe's flags alone."""
    return "event_calls" if lay.calls is not None else None


def link(s, lay, table, runtime: list, objs: list, workdir, cc: str):
    return _part(s.image, "writer").link(s, lay, table, runtime, objs, workdir, cc)


def unlinked(s, code, lay):
    return None


def emit(s, code, lay, blob, unlinked):
    return _part(s.image, "writer").emit(s, code, lay, blob, unlinked)


def write(image, arch, layout, rx, patches, blob, metadata: bytes, plan, early=None) -> bytes:
    return _part(image, "writer").write(image, arch, layout, rx, patches, blob, metadata, plan, early)


def refusals(image, plan, traces, spec_name: str) -> list[str]:
    return _part(image, "writer").refusals(image, plan, traces, spec_name)


def link_symbols(image) -> dict:
    """None beyond the module's .symtab (fetch.data_symbols() reads it): the kernel's are
    resolved by the module loader, not at rewrite time."""
    return {}


def notes(image, traces) -> list[str]:
    """One line when the module's events are trace_printk() lines for want of the kernel's
    BTF (kernel_btf.notes()); KprewriteError for a vmlinux that is there but unreadable."""
    from . import kernel_btf
    return kernel_btf.notes(image, traces)


base.declare(globals())

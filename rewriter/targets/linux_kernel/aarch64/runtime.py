"""The runtime of an arm64 Image, placed at boot: the generic runtime's C that an arm64 Image
has (the debugfs views, runtime/platform/linux_kernel/kp_debugfs.c, on kp_lib.c; the trace
events, kp_trace.c, kp_fetch.c, kp_line.c and kp_trace_buffer.c, built KP_PLACED_AT_BOOT, with
the events' fetch programs and handlers: Events), which does
not fit the text padding build.py places the detours in, linked here as one blob (at
LINK_BELOW under the Image's _text: an adrp reaches the Image from there, as from the module
region) and kept, with its relocations, in the boot-only data (.kp_initdata: freed with the init
memory).  At boot, kp_rt_load() (loader_c(), in the text padding, a jump probe of ours on
console_on_rootfs()'s entry: process context, after the initcalls, before free_initmem())
allocates module memory (module_alloc(): RW and NX; with RANDOMIZE_MODULE_REGION_FULL it may be
beyond a `B`'s reach of the Image), copies the blob, zeroes its bss, applies its relocations,
makes its code pages read-only then executable (set_memory_ro(), set_memory_x(): never W+X),
cleans the caches to the point of unification (caches_clean_inval_pou()), runs its init (which
registers the trace events and publishes their handlers: events_glue_c()), then
its debugfs entry (kp_kernel_debugfs(), as x86-64's boot hook on the same function calls it),
and publishes where it is in the kept data (kp_rt_placed; 0: not placed, or not placeable).

The blob's relocations (ld --emit-relocs, sorted by what they hold):
- an absolute address of the blob's own (R_AARCH64_ABS64 of a blob symbol): + where it runs
  minus where it was linked;
- an absolute address in the Image (a kernel symbol, or the detours' data): + the KASLR offset
  (the loader's adrp of _text minus its link address);
- `adrp` to a page of the Image (its data): re-encoded for the page where it runs;
- a call to a kernel function: to a veneer in the blob (`ldr x16, 1f; br x16; 1: .xword FN`),
  whose word is an absolute address in the Image (above); so no `bl` leaves the blob.
The low 12 bits (add, ldr, str :lo12:) stay right: the blob starts on a page, and KASLR moves
the Image by a multiple of 64 KiB.  Any other relocation against the Image is refused."""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ....errors import KprewriteError
from ....link.toolchain import run

PAGE = 0x1000
LINK_BELOW = 0x8000000        # where the blob is linked: 128 MiB below _text (arm64's MODULES_VADDR)
# What the blob holds of the generic runtime (runtime/): the kernel recipe's variant (its
# sources in link order, after the glue: glue_c()).
RUNTIME_VARIANT = "placed_at_boot"
# The blob's entries, called by the loader: its init (after the relocation) and the debugfs
# files' creation.
ENTRIES = ("kp_rt_init", "kp_kernel_debugfs")
# Where the blob is placed and the debugfs files made: console_on_rootfs()'s entry, as x86-64's
# debugfs boot hook (startup.py).  Not earlier: module_alloc() needs arm64's kaslr_init() (a
# subsys_initcall) to have set module_alloc_base.
LOAD_HOOK_FUNCTION = "console_on_rootfs"
R_ABS64 = 257
R_ADRP = (275, 276)           # R_AARCH64_ADR_PREL_PG_HI21(_NC)
R_LO12 = {277, 278, 284, 285, 286, 299}
R_PCREL_LOCAL = {261, 260, 273, 274, 279, 280, 282, 283}   # only within the blob


@dataclass
class Blob:
    """The blob, as linked (at base): its bytes as stored (code and rodata, code_len bytes, then
    data, which runs from text_size: the code pages' end), its size with the bss, its
    relocations (offsets where it runs), its entries' offsets."""
    data: bytes
    size: int
    text_size: int
    code_len: int
    base: int = 0
    rel_blob: list = field(default_factory=list)       # offsets of u64s: + where it runs - base
    rel_image: list = field(default_factory=list)      # offsets of u64s: + the KASLR offset
    adrp: list = field(default_factory=list)           # (offset of an adrp, its target as linked)
    entries: dict = field(default_factory=dict)

    def layout(self) -> tuple:
        """What the Image's loader is compiled with (the same for both links of the blob)."""
        return (len(self.data), self.size, self.text_size, self.code_len, len(self.rel_blob),
                len(self.rel_image), len(self.adrp), tuple(sorted(self.entries.items())), self.base)


@dataclass
class Events:
    """The trace events the blob writes (runtime/kp_trace.c, kp_trace_buffer.c built
    KP_PLACED_AT_BOOT): their C (events.trace_c(): the fetch programs and kp_trace_pre_<key> /
    kp_trace_ret_<key>, compiled as kp_rt_events.c), each event's slot of the Image's
    kp_rt_trace[] ((slot, key, is_return): build.py's dispatch calls the handler through it),
    and the kernel's facts from BTF: struct task_struct's comm, pid and cpu, the tracing
    structures (btf.py's trace layout, as x86-64's kp_kernel_trace[]) and where struct
    dyn_event_operations has its create (dyn_event_create(): kp_trace_buffer.c)."""
    c: str
    slots: list
    task: tuple                 # (comm, pid, cpu) offsets, -1 unknown
    trace: list
    dyn_create: int


def events_glue_c(ev: "Events | None") -> str:
    """The glue's part for the events: the kernel's facts, `current` (sp_el0), the line
    written whole (kp_trace.c's fallback: printk, as platform.c's), and kp_rt_events(), which
    kp_rt_init() calls: the output types and the trace_event_calls registered
    (kp_kernel_trace_init(), kp_kernel_trace_late(): process context, after the initcalls,
    tracefs up), then each event's handler published in the Image's kp_rt_trace[] (0 until
    then: a hit before it writes no event and counts in kp_rt_trace_early)."""
    if ev is None:
        return "static void kp_rt_events(void)\n{\n}\n"
    decl = "".join(f"int kp_trace_{'ret' if ret else 'pre'}_{key}(void *, struct pt_regs *);\n"
                   for _slot, key, ret in ev.slots)
    publish = "".join(f"\t__atomic_store_n(&kp_rt_trace[{slot}], (void *)kp_trace_{'ret' if ret else 'pre'}_{key}, "
                      "__ATOMIC_RELEASE);\n" for slot, key, ret in ev.slots)
    comm, pid, cpu = ev.task
    return f"""
const long kp_kernel_task_comm = {comm}, kp_kernel_task_pid = {pid}, kp_kernel_task_cpu = {cpu};
const long kp_kernel_trace[{len(ev.trace)}] = {{ {", ".join(map(str, ev.trace))} }};
const long kp_kernel_dyn_create = {ev.dyn_create};
char *kp_kernel_current(void)
{{
	char *t;

	asm("mrs %0, sp_el0" : "=r"(t));
	return t;
}}

void kp_platform_write(int fd, const char *buf, unsigned long len)
{{
	(void)fd;
	_printk("\\0016%.*s", (int)len, buf);
}}

void kp_kernel_trace_init(void);
void kp_kernel_trace_late(void);
{decl}/* The Image's (build.py's dispatch): each event's handler here, 0 until published. */
extern void *kp_rt_trace[];
extern unsigned long kp_rt_trace_early;

static void kp_rt_events(void)
{{
	unsigned long early;

	kp_kernel_trace_init();
	kp_kernel_trace_late();
{publish}	early = __atomic_load_n(&kp_rt_trace_early, __ATOMIC_RELAXED);
	if (early)
		_printk("\\0016kprewrite: %lu trace event hits before the runtime was placed: not written\\n", early);
}}
"""


def glue_c(probes, kretprobes, fops, text_link: int, events: "Events | None" = None) -> str:
    """What kp_debugfs.c reads, from the detours' own structures (build.py's dispatch_c():
    kp_kprobes[], kp_kretprobes[], the hit counters kp_hit_block, the disarm flag): the probe
    table built at boot (KP_PLATFORM_TABLES_AT_BOOT: kp_probes points at the detours'
    struct kprobe array), filled by kp_rt_init() with what a probe's first hit would write
    (its address where the kernel runs, symbol, offset), its event name, index and placement.
    probes, kretprobes: (link address, symbol or None, offset, event name, flags) each."""
    def row(p):
        addr, sym, off, name, flags = p
        return (f"\t{{ {addr:#x}UL, {_c_string(sym) if sym else '0'}, {_c_string(name)}, {off}, {flags} }},\n")
    n, k = len(probes), len(kretprobes)
    return f"""#include "kp_internal.h"

struct kp_rt_probe {{
	unsigned long addr;		/* as linked */
	const char *symbol, *name;
	unsigned int offset, flags;
}};
static const struct kp_rt_probe kp_rt_probes[{max(n + k, 1)}] = {{
{"".join(row(p) for p in [*probes, *kretprobes])}}};

/* The detours' data in the Image (build.py's dispatch_c()). */
extern struct kprobe kp_kprobes[];
extern struct kp_thread kp_hit_block;
extern int kp_disarmed;
extern char kp_rt_text[];	/* the Image's first byte where it runs */

struct kprobe *kp_probes;
const unsigned int kp_nprobes = {n};
const unsigned int kp_nkretprobes = {k};
volatile int kp_tables_built = 1;
struct kprobe kp_early_probes[1];
const unsigned int kp_nearly_probes = 0;
/* The breakpoint probes are listed as the kernel lists its own (no tag). */
struct kp_breakpoint_site kp_breakpoints[1];
const unsigned int kp_nbreakpoints = 0;
struct kp_runtime kp_rt;
const long kp_kernel_fops[4] = {{ {", ".join(str(v) for v in fops)} }};
/* kp_debugfs.c's kp_kernel_disarmed is the detours' kp_disarmed, through the pointer
 * kp_kernel_disarmed_at, which kp_debugfs.c defines (compile_blob()'s -D). */

{events_glue_c(events)}
_Static_assert(__builtin_offsetof(struct kp_thread, hits) == 32, "kp_hit_block: struct kp_thread");

static void kp_rt_fill(struct kprobe *p, const struct kp_rt_probe *r, unsigned int index, unsigned long kaslr)
{{
	if (!p->addr && r->addr)
		p->addr = (kprobe_opcode_t *)(r->addr + kaslr);
	if (!p->symbol_name)
		p->symbol_name = r->symbol;
	p->offset = r->offset;
	p->name = r->name;
	p->index = index;
	__atomic_fetch_or(&p->flags, r->flags, __ATOMIC_RELAXED);
}}

__attribute__((used)) void kp_rt_init(void)
{{
	unsigned long kaslr = (unsigned long)kp_rt_text - {text_link:#x}UL;
	unsigned int i;

	kp_kernel_disarmed_at = &kp_disarmed;
	kp_rt.bias = kaslr;	/* run - link: @SYM and @ADDR in fetch args (KP_FETCH_IMM_LINK) */
	for (i = 0; i < {n}; i++)
		kp_rt_fill(&kp_kprobes[i], &kp_rt_probes[i], i, kaslr);
	for (i = 0; i < {k}; i++)
		kp_rt_fill(&kp_kretprobes[i].kp, &kp_rt_probes[{n} + i], {n} + i, kaslr);
	kp_rt.threads = &kp_hit_block;
	kp_probes = kp_kprobes;
	kp_rt_events();
}}
"""


def _c_string(s: str) -> str:
    return '"' + "".join(c if c.isalnum() or c in "_.+-*?[]$ " else f"\\{ord(c):03o}" for c in s) + '"'


def veneers_asm(functions: list[str]) -> str:
    """A veneer per kernel function the blob calls or takes the address of, under its name:
    a `bl` in the blob stays in the blob, and the word it loads is relocated with the Image.  Each
    in a section of its own: the link keeps those the code it keeps calls (--gc-sections)."""
    out = []
    for f in functions:
        out.append(f"\t.section .text.kp_veneer.{f},\"ax\"\n"
                   f"\t.p2align 3\n\t.globl {f}\n\t.hidden {f}\n\t.type {f}, %function\n{f}:\n"
                   f"\tldr x16, 1f\n\tbr x16\n1:\t.xword kp_k_{f}\n")
    return "".join(out)


def compile_blob(cc: str, arch, workdir: Path, glue: str, events: "Events | None" = None) -> list[Path]:
    """The blob's objects: the glue, then the runtime's part placed at boot, built and cached by
    link/runtime.py (the kernel recipe's "placed_at_boot" variant: kp_debugfs.c and kp_lib.c,
    each function and object in a section of its own, the link keeping what the entries reach)."""
    from ....link.runtime import _includes, cflags, compile_runtime, variant_flags
    d = workdir / "kp_rt"
    d.mkdir(exist_ok=True)
    (d / "kp_rt_glue.c").write_text(glue)
    # The glue with the variant's flags: its pointer is the variant's kp_kernel_disarmed.
    flags = [*cflags(arch, "linux_kernel"), *_includes(arch, "linux_kernel"),
             *variant_flags("linux_kernel", RUNTIME_VARIANT)]
    run([cc, *flags, "-c", str(d / "kp_rt_glue.c"), "-o", str(d / "kp_rt_glue.o")], "runtime kp_rt_glue.c")
    objs = [d / "kp_rt_glue.o"]
    if events is not None:
        (d / "kp_rt_events.c").write_text(events.c)
        run([cc, *flags, "-c", str(d / "kp_rt_events.c"), "-o", str(d / "kp_rt_events.o")], "runtime kp_rt_events.c")
        objs.append(d / "kp_rt_events.o")
    return [*objs, *compile_runtime(cc, arch=arch, platform="linux_kernel", variant=RUNTIME_VARIANT)]


def undefined(cc: str, objs: list[Path]) -> list[str]:
    r = run([cc[:-3] + "nm" if cc.endswith("gcc") else "nm", *map(str, objs)], "nm")
    und, defined = set(), set()
    for line in r.stdout.splitlines():
        f = line.split()
        if len(f) >= 2 and f[-2] == "U":
            und.add(f[-1])
        elif len(f) == 3:
            defined.add(f[-1])
    return sorted(und - defined)


def link_blob(cc: str, objs: list[Path], workdir: Path, functions: dict[str, int], data: dict[str, int],
              path, base: int) -> Blob:
    """Link the blob at base (functions: kernel functions by name, reached through veneers;
    data: the Image's data symbols, at their link addresses) and sort its relocations."""
    from ....elf.view import SHN_ABS, SHT_NOBITS, SHT_RELA, ElfView, relas
    d = workdir / "kp_rt"
    (d / "kp_rt_veneers.S").write_text(veneers_asm(sorted(functions)))
    ven = d / "kp_rt_veneers.o"
    run([cc, "-c", str(d / "kp_rt_veneers.S"), "-o", str(ven)], "kp_rt_veneers.S")
    lds = d / "kp_rt.lds"
    lds.write_text(f"""SECTIONS {{
  . = {base:#x};
  .text : {{ *(.text .text.*) *(.rodata .rodata.* .srodata*) }}
  . = ALIGN(0x1000);
  .data : {{ *(.data .data.*) }}
  .bss : {{ *(.bss .bss.* COMMON) }}
  .kp_must_be_empty : {{ *(.iplt) *(.igot.plt) *(.got) *(.got.plt) *(.rela.dyn) }}
  /DISCARD/ : {{ *(.comment) *(.note*) *(.eh_frame*) *(.debug*) }}
}}
""")
    out = d / "kp_rt.elf"
    ld = cc[:-3] + "ld" if cc.endswith("gcc") else "ld"
    defs = {**{f"kp_k_{n}": a for n, a in functions.items()}, **data}
    run([ld, "-nostdlib", "--fix-cortex-a53-843419", "--emit-relocs", "--gc-sections", "--no-warn-rwx-segments",
         *(f"--undefined={e}" for e in ENTRIES), "-T", str(lds), "-o", str(out),
         *(f"--defsym={n}={a:#x}" for n, a in sorted(defs.items())), *map(str, [*objs, ven])], "link (runtime)")
    e = ElfView(out.read_bytes(), str(out))
    extra = e.section(".kp_must_be_empty")
    if extra is not None and extra.size:
        raise KprewriteError(f"{path}: the runtime's link made {extra.size} bytes of GOT, PLT or dynamic relocations")
    text, dat, bss = e.section(".text"), e.section(".data"), e.section(".bss")
    code = e.section_bytes(text)
    text_size = (len(code) + PAGE - 1) & ~(PAGE - 1)
    # Stored without the code's last page's zeros (the loader writes them).
    stored, size = bytes(code), text_size
    if dat is not None and dat.size and dat.type != SHT_NOBITS:
        if dat.addr - base != text_size:
            raise KprewriteError(f"{path}: the runtime's .data is not at the end of its code pages")
        stored += e.section_bytes(dat)
        size += dat.size
    if bss is not None and bss.size:
        size = max(size, bss.addr - base + bss.size)
    syms = list(e.symbols())
    blob = Blob(stored, (size + 15) & ~15, text_size, len(code), base)
    blob.entries = {s.name: s.value - base for s in syms if s.name in ENTRIES}
    for sec in e.sections:
        if sec.type != SHT_RELA or sec.info >= len(e.sections):
            continue
        target = e.sections[sec.info]
        for off, sym, typ, addend in relas(e.data, sec.offset, sec.size):
            s = syms[sym] if sym < len(syms) else None
            at = off - base             # r_offset: an address in a linked file
            in_image = s is not None and s.shndx == SHN_ABS and s.name != ""
            where = f"{path}: the runtime's {target.name}+{at - target.addr:#x}"
            if typ in R_LO12 or typ == 0:
                continue
            if typ == R_ABS64:
                (blob.rel_image if in_image else blob.rel_blob).append(at)
            elif typ in R_ADRP:
                if in_image:
                    blob.adrp.append((at, (s.value + addend) & ~(PAGE - 1)))
            elif typ in R_PCREL_LOCAL and not in_image:
                continue
            else:
                raise KprewriteError(f"{where}: relocation type {typ} against "
                                     f"{s.name if s else sym} cannot be applied where the runtime is placed")
    for at, _ in blob.adrp:
        word = struct.unpack_from("<I", code, at)[0]
        if word & 0x9F000000 != 0x90000000:
            raise KprewriteError(f"{path}: the runtime's {at:#x} is not an adrp (erratum 843419's fix moved it?)")
    missing = [n for n in ENTRIES if n not in blob.entries]
    if missing:
        raise KprewriteError(f"{path}: the runtime's link has no {', '.join(missing)}")
    blob.rel_blob.sort()
    blob.rel_image.sort()
    blob.adrp.sort()
    return blob


def holes_asm(layout: tuple) -> str:
    """The blob's bytes and relocation lists in the boot-only data: room the Image's link
    places, filled with the blob's second link (build.py's _fill_runtime())."""
    nbytes, _size, _text, _code, nrel, nimg, nadrp, _entries, _base = layout
    return "\t.section .kp_initdata,\"a\"\n" + "".join(
        f"\t.p2align {align}\n\t.globl {name}\n{name}:\n\t.space {max(n, 1) * unit}\n"
        for name, n, unit, align in (("kp_rt_blob", nbytes, 1, 4), ("kp_rt_rel_blob", nrel, 4, 2),
                                     ("kp_rt_rel_image", nimg, 4, 2), ("kp_rt_adrp_at", nadrp, 4, 2),
                                     ("kp_rt_adrp_to", nadrp, 8, 3)))


def loader_c(layout: tuple, text_link: int) -> str:
    """kp_rt_load(), the hook on LOAD_HOOK_FUNCTION's entry that places the blob and calls its
    entries (the pre_handler of a jump probe of our own, in the text padding).  The blob's bytes and
    relocations are holes in .kp_initdata here, filled after the link (build.py)."""
    nbytes, size, text_size, code_len, nrel, nimg, nadrp, entries, base = layout
    ent = dict(entries)
    return f"""
void *module_alloc(unsigned long size);
int set_memory_ro(unsigned long addr, int numpages);
int set_memory_x(unsigned long addr, int numpages);
void caches_clean_inval_pou(unsigned long start, unsigned long end);
extern char kp_rt_text[];
/* The holes of holes_asm(), filled after the link: not C definitions, whose zeros the
 * compiler would read as the values. */
extern const unsigned char kp_rt_blob[];
extern const unsigned int kp_rt_rel_blob[], kp_rt_rel_image[], kp_rt_adrp_at[];
extern const unsigned long kp_rt_adrp_to[];
/* Where the blob was placed (kept data): 0 before, or if it could not be. */
unsigned long kp_rt_placed;

/* console_on_rootfs(): after the initcalls (arm64's kaslr_init(), a subsys_initcall, sets
 * module_alloc_base: module_alloc() before it maps at 0), debugfs up, /init not started, the
 * init memory (the blob's bytes) not yet freed.  Process context, interrupts on as they were
 * before the detour (module_alloc() and set_memory_*() may sleep), masked again for the
 * detour's way out. */
__attribute__((used)) int kp_rt_load(struct kprobe *p, struct pt_regs *regs)
{{
	unsigned long kaslr = (unsigned long)kp_rt_text - {text_link:#x}UL, mem;
	unsigned int i, j;
	unsigned char *m;

	if (!(regs->pstate & 0x80))
		asm volatile("msr daifclr, #3" ::: "memory");
	m = module_alloc({size});
	if (!m) {{
		pr_err("kprewrite: no module memory for the runtime ({size} bytes): no debugfs files\\n");
		goto out;
	}}
	mem = (unsigned long)m;
	for (i = 0; i < {code_len}; i++)	/* the code, its last page's zeros, the data, the bss */
		m[i] = kp_rt_blob[i];
	for (; i < {text_size}; i++)
		m[i] = 0;
	for (j = {code_len}; j < {nbytes}; j++, i++)
		m[i] = kp_rt_blob[j];
	for (; i < {size}; i++)
		m[i] = 0;
	for (i = 0; i < {nrel}; i++)
		*(unsigned long *)(m + kp_rt_rel_blob[i]) += mem - {base:#x}UL;
	for (i = 0; i < {nimg}; i++)
		*(unsigned long *)(m + kp_rt_rel_image[i]) += kaslr;
	for (i = 0; i < {nadrp}; i++) {{
		unsigned int *insn = (unsigned int *)(m + kp_rt_adrp_at[i]);
		long pages = (long)(((kp_rt_adrp_to[i] + kaslr) >> 12) - ((mem + kp_rt_adrp_at[i]) >> 12));

		if (pages < -(1L << 20) || pages >= (1L << 20)) {{
			pr_err("kprewrite: the runtime's module memory is beyond an adrp of the kernel: not placed\\n");
			goto out;	/* left unplaced (module memory is not freed: rare, and never W+X) */
		}}
		*insn = (*insn & 0x9f00001fU) | ((unsigned int)(pages & 3) << 29) | ((unsigned int)((pages >> 2) & 0x7ffff) << 5);
	}}
	caches_clean_inval_pou(mem, mem + {text_size});
	set_memory_ro(mem, {text_size // PAGE});
	set_memory_x(mem, {text_size // PAGE});
	((void (*)(void))(mem + {ent["kp_rt_init"]:#x}))();
	__atomic_store_n(&kp_rt_placed, mem, __ATOMIC_RELEASE);
	pr_info("kprewrite: the runtime placed in module memory: %u KiB of code, %u KiB of data\\n", {text_size >> 10},
		{(size - text_size + 1023) >> 10});
	((int (*)(struct kprobe *, struct pt_regs *))(mem + {ent["kp_kernel_debugfs"]:#x}))(p, regs);
out:
	asm volatile("msr daifset, #3" ::: "memory");
	return 0;
}}
"""

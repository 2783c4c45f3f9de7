"""Keeping the runtime's SIGTRAP handler installed (breakpoint probes, Linux user
processes).

A program that later calls sigaction(SIGTRAP) or signal(SIGTRAP) would replace
the handler our breakpoints need, and one that blocks SIGTRAP (sigprocmask,
pthread_sigmask, or a handler's sa_mask) would be killed by the next trap (the
kernel forces a blocked synchronous signal to its default action).  So the
runtime takes over the program's own GOT slots of those functions at start-up:
sigaction/signal on SIGTRAP only record the program's handler, to which traps
that are not ours are delivered; masks lose the SIGTRAP bit.  This table covers
calls made by the rewritten object itself through its GOT (PLT or -fno-plt); the
runtime also hooks the other loaded objects' slots at start-up and after dlopen()
(kp_sighook.c), and on x86-64 a C library's own calls (a rewritten libc, a static
program's) go through the runtime by their system calls (arch/x86_64/sigcalls.py,
Rules.signal_syscalls).
"""
from __future__ import annotations

HOOKS = {"sigaction": 1, "__sigaction": 1, "signal": 2, "sysv_signal": 2, "__sysv_signal": 2,
         "bsd_signal": 2, "sigprocmask": 3, "pthread_sigmask": 4}
PT_GNU_RELRO = 0x6474E552


def got_slots(image, arch) -> list[tuple[int, int]]:
    """(GOT slot link-time address, hook kind) of the hooked functions."""
    return sorted({(addr, HOOKS[name]) for addr, typ, name in image.symbol_relocations()
                   if name in HOOKS and typ in arch.r_got_slot})


def table_c(image, arch, enabled: bool) -> str:
    slots = got_slots(image, arch) if enabled else []
    relro = [(s.vaddr, s.vaddr + s.memsz) for s in image.segments if s.type == PT_GNU_RELRO]
    lo, hi = relro[0] if relro else (0, 0)
    rows = "".join(f"  {{ {a:#x}UL, {k} }},\n" for a, k in slots) or "  { 0, 0 },\n"
    # A slot still holding its PLT stub (lazy binding) is resolved at start-up.
    plt = [(s.addr, s.addr + s.size) for s in image.sections if s.name in (".plt", ".plt.sec")]
    plo, phi = (min(a for a, _ in plt), max(b for _, b in plt)) if plt else (0, 0)
    return (f"struct kp_got_hook kp_got_hooks[] = {{\n{rows}}};\n"
            f"const unsigned int kp_ngot_hooks = {len(slots)};\n"
            f"const unsigned long kp_relro_start = {lo:#x}UL, kp_relro_end = {hi:#x}UL;\n"
            f"const unsigned long kp_plt_start = {plo:#x}UL, kp_plt_end = {phi:#x}UL;\n")

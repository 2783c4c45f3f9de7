"""Every safety rule proven by a program that breaks without it.

For each rule of rewriter/safety.py with a switch (but the kernel's own, proven by
boots in tests/kernel/test_kernel_safety_rules.py), a small program: rewritten
with the rule on it prints what the original prints; rewritten with the rule
switched off (KPREWRITE_UNSAFE_OFF=<rule>, honoured because conftest sets
KPREWRITE_TEST_SUITE) it crashes, hangs under a timeout or prints something
else, natively and under QEMU.  That proves at once that the rule matters and
that its program exercises it.  Each program and its two rewrites are built
once for the module.

The last tests keep the registry honest: every rule with a switch names a test
here (a kernel's rule: in the kernel module, with an OFF entry there) and is
consulted as safety.enabled("name") in the function its entry names; every
safety.enabled() call in rewriter/ names a registered rule; a rule with no
program says why; docs/safety.md's table lists every rule; and a normal run
refuses KPREWRITE_UNSAFE_OFF."""
from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ARCH, KPREWRITE, ROOT, TREE_ENV, attributed, cc, instrument, probe_spec, run, symbols, write_spec

from rewriter import safety
from test_kretprobe import FALLBACK

ARCHES = ["x86_64"]      # x86-64 only: x86-64 programs; AArch64's rules: test_aarch64_safety_rules.py

HANG = 15       # seconds a rule-off run may take before it counts as hung


# --- the programs ---------------------------------------------------------------------------------
# Each: C source (with the asm it needs), gcc flags, the spec, handlers (or None), the language.

# The driver both split-part programs share: drive() keeps its count in %rbx across calls to work.
SPLIT_DRIVER = r"""
/* The caller counts in %rbx (callee-saved: work must give it back). */
".globl drive\n.type drive,@function\ndrive:\n"
"  push %rbx\n"
"  push %r12\n"
"  push %rbp\n"
"  xor %r12d,%r12d\n"
"  mov $3,%ebx\n"
"2: mov %rbx,%rdi\n"
"  neg %rdi\n"
"  call work\n"
"  add %rax,%r12\n"
"  dec %rbx\n"
"  jnz 2b\n"
"  mov %r12,%rax\n"
"  pop %rbp\n"
"  pop %r12\n"
"  pop %rbx\n"
"  ret\n"
".size drive,.-drive\n");
#include <stdio.h>
long drive(void);
int main(void) { printf("drive=%ld\n", drive()); return 0; }
"""

COLD_PARTS = r"""
/* work pushes %rbx and jumps to work.cold with its frame live: the slot at
   work.cold's %rsp holds the caller's %rbx, not a return address. */
__asm__(
".text\n"
".globl work\n.type work,@function\nwork:\n"
"  push %rbx\n"
"  mov %rdi,%rbx\n"
"  test %rdi,%rdi\n"
"  js work.cold\n"
"1: lea 1(%rbx),%rax\n"
"  pop %rbx\n"
"  ret\n"
".size work,.-work\n"
".type work.cold,@function\nwork.cold:\n"
"  neg %rbx\n"
"  jmp 1b\n"
".size work.cold,.-work.cold\n"
""" + SPLIT_DRIVER

ENTRY_FRAME = r"""
/* COLD_PARTS with unwind information and no .cold name (a stripped library's
   hot/cold split): only workpart's FDE, CFA = %rsp+16 at its first byte, says it
   is entered mid-frame, the caller's %rbx where a return address would be. */
__asm__(
".text\n"
".globl work\n.type work,@function\nwork:\n"
"  .cfi_startproc\n"
"  push %rbx\n"
"  .cfi_def_cfa_offset 16\n"
"  .cfi_offset rbx,-16\n"
"  mov %rdi,%rbx\n"
"  test %rdi,%rdi\n"
"  js workpart\n"
"1: lea 1(%rbx),%rax\n"
"  pop %rbx\n"
"  .cfi_def_cfa_offset 8\n"
"  ret\n"
"  .cfi_endproc\n"
".size work,.-work\n"
".type workpart,@function\nworkpart:\n"
"  .cfi_startproc\n"
"  .cfi_def_cfa_offset 16\n"
"  .cfi_offset rbx,-16\n"
"  neg %rbx\n"
"  jmp 1b\n"
"  .cfi_endproc\n"
".size workpart,.-workpart\n"
""" + SPLIT_DRIVER

# tests/test_kretprobe.py's FALLBACK: cramped's ret follows a call by 4 bytes with the next
# function right after (no jump fits), and cramped reads its return-address slot.
TRAMPOLINE_UNSAFE = FALLBACK

RSP_CALL = r"""
/* The region at the probe ends with `call *16(%rsp)`: the detour pushes the
   return address before the emulated call reads its operand. */
__asm__(
".text\n"
".globl callsp\n.type callsp,@function\ncallsp:\n"
"  push %rdi\n"               /* 16(%rsp) at the call: the function */
"  push $0\n"                 /*  8(%rsp): a null pointer */
"  sub $8,%rsp\n"
"  mov %rsi,%rdi\n"           /* +7: the probe */
"  call *16(%rsp)\n"
"  add $24,%rsp\n"
"  ret\n"
".size callsp,.-callsp\n");
#include <stdio.h>
long callsp(long (*)(long), long);
__attribute__((noinline)) long twice(long x) { return 2 * x + 1; }
int main(void) { printf("callsp=%ld\n", callsp(twice, 20)); return 0; }
"""

RED_ZONE = r"""
/* A leaf keeping values in its red zone across the probe at +25: at its top (-8, -16(%rsp)),
   where a detour that did not move %rsp would save its registers, and at its bottom
   (-128, -120(%rsp)), where one that moved %rsp by only the red zone's 128 bytes would. */
__asm__(
".text\n"
".globl rz\n.type rz,@function\nrz:\n"
"  mov %rdi,-8(%rsp)\n"
"  mov %rsi,-16(%rsp)\n"
"  mov %rdx,-128(%rsp)\n"
"  mov %rcx,-120(%rsp)\n"
"  mov $1000,%eax\n"
"  add -8(%rsp),%rax\n"       /* +25: the probe */
"  add -16(%rsp),%rax\n"
"  add -128(%rsp),%rax\n"
"  add -120(%rsp),%rax\n"
"  ret\n"
".size rz,.-rz\n");
#include <stdio.h>
long rz(long, long, long, long);
int main(void) { printf("rz=%ld\n", rz(40, 2, 300, 4000)); return 0; }
"""

JUMP_INTO_REGION = r"""
/* The loop's backward branch lands at +2, inside a 5-byte jump at +0. */
__asm__(
".text\n"
".globl jir\n.type jir,@function\njir:\n"
"  xor %eax,%eax\n"
"1: add %edi,%eax\n"
"  dec %edi\n"
"  jnz 1b\n"
"  ret\n"
".size jir,.-jir\n");
#include <stdio.h>
int jir(int);
int main(void) { printf("jir=%d\n", jir(10)); return 0; }
"""

INDIRECT_JUMP = r"""
/* A computed jump (lea + add: no reading bounds it) to +2, inside a 5-byte jump at +0. */
__asm__(
".text\n"
".globl ij\n.type ij,@function\nij:\n"
"  xor %eax,%eax\n"
"  add %edi,%eax\n"           /* +2: the jump's target */
"  dec %edi\n"
"  jz 3f\n"
"  lea ij(%rip),%rcx\n"
"  add $2,%rcx\n"
"  jmp *%rcx\n"
"3: ret\n"
".size ij,.-ij\n");
#include <stdio.h>
int ij(int);
int main(void) { printf("ij=%d\n", ij(10)); return 0; }
"""

BOOSTABLE = r"""
/* A region ending with `loop`: its rel8 copied as is would jump relative to the detour. */
__asm__(
".text\n"
".globl lp\n.type lp,@function\nlp:\n"
"  mov %rdi,%rcx\n"
"  xor %eax,%eax\n"
"1: add %ecx,%eax\n"
"  add $1,%eax\n"             /* +7: the probe */
"  loop 1b\n"
"  ret\n"
".size lp,.-lp\n");
#include <stdio.h>
int lp(long);
int main(void) { printf("lp=%d\n", lp(10)); return 0; }
"""

JUMP_TABLE_BOUNDS = r"""
/* A jump table bounded on one path (cmp $3; ja) and not on the other (esi == 100):
   entries 4 and 5 are reached only by that path. */
__asm__(
".text\n"
".globl jtb\n.type jtb,@function\njtb:\n"
"  cmp $100,%esi\n"
"  je 2f\n"
"  cmp $3,%edi\n"
"  ja 9f\n"
"2: lea .Ljtb_table(%rip),%rdx\n"
"  movslq (%rdx,%rdi,4),%rax\n"
"  add %rdx,%rax\n"
"  jmp *%rax\n"
".Lc0: mov $10,%eax\n  ret\n"
".Lc1: mov $11,%eax\n  ret\n"
".Lc2: mov $12,%eax\n  ret\n"
".Lc3: mov $13,%eax\n  ret\n"
".Lc4: add $1,%edi\n"         /* .Lc4: the probe; its region covers .Lc5 */
".Lc5: lea 10(%rdi),%eax\n"
"  ret\n"
"9: mov $-1,%eax\n  ret\n"
".size jtb,.-jtb\n"
".section .rodata\n.p2align 2\n.Ljtb_table:\n"
"  .long .Lc0-.Ljtb_table, .Lc1-.Ljtb_table, .Lc2-.Ljtb_table, .Lc3-.Ljtb_table\n"
"  .long .Lc4-.Ljtb_table, .Lc5-.Ljtb_table\n"
".text\n");
#include <stdio.h>
int jtb(long, int);
int main(void)
{
    for (int i = 0; i < 6; i++)
        printf("jtb(%d)=%d,%d\n", i, jtb(i, 0), jtb(i, 100));
    return 0;
}
"""

RETURN_REGIONS = r"""
/* The branch to the ret lands inside a 5-byte return-hook jump covering
   `add; add; ret` (no padding after rr to borrow: rr_next follows at once). */
__asm__(
".text\n"
".globl rr\n.type rr,@function\nrr:\n"
"  mov %edi,%eax\n"
"  test %esi,%esi\n"
"  jz 1f\n"
"  add %esi,%eax\n"
"  add %edi,%eax\n"
"1: ret\n"
".size rr,.-rr\n"
".globl rr_next\n.type rr_next,@function\nrr_next:\n"
"  lea 1(%rdi),%eax\n"
"  ret\n"
".size rr_next,.-rr_next\n");
#include <stdio.h>
int rr(int, int), rr_next(int);
int main(void)
{
    int s = 0;
    for (int i = 0; i < 4; i++)
        s = s * 7 + rr(i, i & 1) + rr_next(i);
    printf("rr=%d\n", s);
    return 0;
}
"""

LSDA = r"""
#include <cstdio>
__attribute__((noinline)) void thrower(int x) { if (x & 1) throw x; }
__attribute__((noinline)) int work(int x)
{
    int r = 0;
    try {
        thrower(x);
        r = x;
    } catch (int e) {
        r = -e;
    }
    return r;
}
int main()
{
    int s = 0;
    for (int i = 0; i < 6; i++)
        s = s * 3 + work(i);
    std::printf("s=%d\n", s);
    return 0;
}
"""

DIRECTION_FLAG = r"""
#include <stdio.h>
/* Copies backwards with DF set; the probe at +13 (the mov after std) sees DF = 1. */
__asm__(
".text\n.globl back_copy\n.type back_copy,@function\nback_copy:\n"
"  mov %rdx,%rcx\n"
"  lea -1(%rdi,%rdx),%rdi\n"
"  std\n"
"  lea -1(%rsi,%rdx),%rsi\n"  /* +9: the probe */
"  rep movsb\n"
"  cld\n"
"  ret\n"
".size back_copy,.-back_copy\n");
void back_copy(char *d, const char *s, unsigned long n);
int main(void) {
    char buf[16] = "abcdefgh";
    back_copy(buf + 2, buf, 6);
    printf("%s\n", buf);
    return 0;
}
"""

# The handler fills a buffer as memset may (rep stosb; the ABI lets C code assume DF = 0)
# and reports what it wrote.
DF_HANDLER = r"""
#include <kprewrite/kprobes.h>
int h(struct kprobe *p, struct pt_regs *regs)
{
    struct { char lo[32]; char hi[32]; } b;
    void *d = b.hi;
    unsigned long n = sizeof b.hi;
    for (int i = 0; i < 32; i++)
        ((volatile char *)b.lo)[i] = 'a';
    __asm__ volatile("rep stosb" : "+D"(d), "+c"(n) : "a"('z') : "memory");
    pr_info("lo=%c hi=%c\n", ((volatile char *)b.lo)[31], ((volatile char *)b.hi)[31]);
    return 0;
}
"""

RETARGETING = r"""
#include <stdio.h>
long work(long a);
/* blob: bytes in .text that decode as `call work; ret` but are data (no FDE describes them). */
__asm__(
".text\n"
".globl blob\n.type blob,@function\nblob:\n"
"  .byte 0xe8\n  .long work - (blob + 5)\n  .byte 0xc3\n"
".size blob,.-blob\n");
extern const unsigned char blob[];
__attribute__((noinline)) long work(long a)
{
    long s = 0;
    for (long i = 0; i < a % 50; i++)
        s += (i * 7) ^ (s >> 2);
    return s;
}
int main(void)
{
    long s = 0;
    for (long i = 0; i < 10; i++)
        s += work(i);
    printf("%ld", s);
    for (int i = 0; i < 6; i++)
        printf(" %02x", blob[i]);
    printf("\n");
    return 0;
}
"""

CALLS = "  .rept 34\\n  call nop_fn\\n  .endr\\n  ret\\n"

# test_eviction.py's layout: runs of calls around (no other region or padding in reach), a
# probe at tgt with a jump target 3 bytes in, and the neighbour nb whose second
# instruction boundary starts the only region that can be evicted: it holds nb's ret.
EVICTION = r"""
__asm__(
".text\n"
".p2align 6\n"
".globl filler_a\n.type filler_a,@function\nfiller_a:\n@CALLS@.size filler_a,.-filler_a\n"
".globl nop_fn\n.type nop_fn,@function\nnop_fn:\n  ret\n.size nop_fn,.-nop_fn\n"
".globl tgt_in\n.type tgt_in,@function\ntgt_in:\n"
"  mov %edi,%eax\n  jmp 5f\n"
".size tgt_in,.-tgt_in\n"
".globl tgt\n.type tgt,@function\ntgt:\n"
"  lea 2(%rdi),%eax\n"
"5: add %eax,%eax\n  add $3,%eax\n  ret\n"
".size tgt,.-tgt\n"
".globl nb\n.type nb,@function\nnb:\n"
"  lea 2(%rdi),%eax\n"
"  add $3,%eax\n"
"  add $5,%eax\n"                 /* nb + 6: the region to evict, [nb + 6, nb + 16) */
"  xor $1,%eax\n"
"  ret\n"
"  nop\n  nop\n  nop\n  nop\n"
".size nb,.-nb\n"
".globl filler_b\n.type filler_b,@function\nfiller_b:\n@CALLS@.size filler_b,.-filler_b\n"
);
#include <stdio.h>
int tgt(int), tgt_in(int), nb(int);
int main(void)
{
    long t = 0;
    for (int i = 0; i < 3; i++)
        t = t * 7 + tgt(i) + 5 * tgt_in(i) + 11 * nb(i);
    printf("t=%ld\n", t);
    return 0;
}
""".replace("@CALLS@", CALLS)

NB_RETURNS = r"""
#include <kprewrite/kprobes.h>
int ret_nb(struct kretprobe_instance *ri, struct pt_regs *regs) { pr_info("nb returned\n"); return 0; }
"""

SHARED = r"""
/* A probe at +0 whose region [0, 6) takes the jz at +4, probed with a post_handler. */
__asm__(
".text\n"
".globl sh\n.type sh,@function\nsh:\n"
"  mov %edi,%eax\n"
"  test %eax,%eax\n"
"  jz 1f\n"                          /* +4: the rider, with a post_handler */
"  add $5,%eax\n"
"1: ret\n"
".size sh,.-sh\n");
#include <stdio.h>
int sh(int);
int main(void)
{
    int s = 0;
    for (int i = 0; i < 4; i++)
        s = s * 3 + sh(i & 1);
    printf("sh=%d\n", s);
    return 0;
}
"""

POST = r"""
#include <kprewrite/kprobes.h>
void post(struct kprobe *p, struct pt_regs *regs, unsigned long flags) { pr_info("post\n"); }
"""

CAN_PROBE = r"""
/* A ud2 the program's SIGILL handler knows by its address (as a kernel's BUG table). */
__asm__(
".text\n"
".globl trap\n.type trap,@function\ntrap:\n"
"  mov %edi,%eax\n"
".globl bug_at\nbug_at:\n"
"  ud2\n"                            /* +2: the probe */
".globl bug_fix\nbug_fix:\n"
"  add $1,%eax\n"
"  ret\n"
".size trap,.-trap\n");
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <ucontext.h>
#include <unistd.h>
extern char bug_at[], bug_fix[];
int trap(int);
static volatile int bugs;
static void on_ill(int sig, siginfo_t *si, void *uc_)
{
    ucontext_t *uc = uc_;
    if ((char *)uc->uc_mcontext.gregs[REG_RIP] != bug_at) {
        write(1, "unknown trap\n", 13);
        _exit(3);
    }
    bugs++;
    uc->uc_mcontext.gregs[REG_RIP] = (greg_t)bug_fix;
}
int main(void)
{
    struct sigaction sa = { .sa_sigaction = on_ill, .sa_flags = SA_SIGINFO };
    sigaction(SIGILL, &sa, 0);
    int s = 0;
    for (int i = 0; i < 3; i++)
        s += trap(i);
    printf("s=%d bugs=%d\n", s, bugs);
    return 0;
}
"""

CALL_IN_REGION = r"""
/* A 2-byte `call *%rax` at the probe: the region runs on past it. */
__asm__(
".text\n"
".globl cir\n.type cir,@function\ncir:\n"
"  push %rbx\n"
"  mov %edi,%ebx\n"
"  mov %rsi,%rax\n"
"  call *%rax\n"                     /* +6: the probe */
"  add %ebx,%eax\n"
"  add $7,%eax\n"
"  pop %rbx\n"
"  ret\n"
".size cir,.-cir\n");
#include <stdio.h>
int cir(int, int (*)(void));
__attribute__((noinline)) int ten(void) { return 10; }
int main(void) { printf("cir=%d\n", cir(5, ten)); return 0; }
"""

DECODE = r"""
/* A byte that is no instruction (0x06: push %es, invalid in 64-bit mode), jumped over, stops
   dec's decoding: the loop's branch back to +2, inside the probe's jump, lies after it. */
__asm__(
".text\n"
".globl dec\n.type dec,@function\ndec:\n"
"  xor %eax,%eax\n"                   /* +0: the probe */
"1: add %edi,%eax\n"
"  jmp 2f\n"
"  .byte 0x06\n"
"2: dec %edi\n"
"  jnz 1b\n"
"  ret\n"
".size dec,.-dec\n");
#include <stdio.h>
int dec(int);
int main(void) { printf("dec=%d\n", dec(10)); return 0; }
"""

FUNCTION_BOUNDS = r"""
/* fb's 4 bytes (`lea; ret`) are too few for the probe's 5-byte jump, and the code after
   fb's end is no padding: more code, which no symbol, FDE or relocation names; main
   reaches it at fb + 4 through a pointer computed at run time. */
__asm__(
".text\n"
".globl fb\n.type fb,@function\nfb:\n"
"  lea 1(%rdi),%eax\n"                /* +0: the probe */
"  ret\n"
".size fb,.-fb\n"
"  lea 100(%rdi),%eax\n"              /* +4: nameless code */
"  ret\n");
#include <stdio.h>
extern char fb[];
int main(void)
{
    long off = 4;
    __asm__("" : "+r"(off));          /* no `lea fb+4(%rip)` for the analysis to read */
    int (*f)(int) = (int (*)(int))fb, (*g)(int) = (int (*)(int))(fb + off);
    int s = 0;
    for (int i = 0; i < 3; i++)
        s = s * 7 + f(i) + g(i);
    printf("fb=%d\n", s);
    return 0;
}
"""

BLACKLIST = r"""
/* tiny is NOKPROBE_SYMBOL (the kernel's macro: its address in _kprobe_blacklist): it runs on
   a stack with no room below the return address (as a kernel's entry code before it switches
   stacks), where a detour's (or a signal frame's) first push faults in the guard page. */
__asm__(
".text\n"
".globl tiny\n.type tiny,@function\ntiny:\n"
"  lea 3(%rdi),%eax\n"                /* +0: the probe */
"  imul $5,%eax,%eax\n"
"  ret\n"
".size tiny,.-tiny\n"
/* on_stack(x, top): tiny(x) with %rsp = top */
".globl on_stack\n.type on_stack,@function\non_stack:\n"
"  push %rbx\n"
"  mov %rsp,%rbx\n"
"  mov %rsi,%rsp\n"
"  call tiny\n"
"  mov %rbx,%rsp\n"
"  pop %rbx\n"
"  ret\n"
".size on_stack,.-on_stack\n");
#include <stdio.h>
#include <sys/mman.h>
int tiny(int), on_stack(long, char *);
#define NOKPROBE_SYMBOL(fname) \
    static unsigned long __attribute__((used, section("_kprobe_blacklist"))) _kbl_addr_##fname = (unsigned long)fname
NOKPROBE_SYMBOL(tiny);
int main(void)
{
    char *m = mmap(0, 8192, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED || mprotect(m, 4096, PROT_NONE))
        return 2;
    int s = 0;
    for (int i = 0; i < 3; i++)
        s = s * 7 + on_stack(i, m + 4096 + 8);      /* tiny's %rsp: the guard page's end */
    printf("tiny=%d\n", s);
    return 0;
}
"""

PIE = ["-O2", "-fpie", "-pie"]

PROGRAMS = {
    # rule: (source, flags, spec text, handlers, lang); a glob where the rule refuses the probe (skipped, not an error).
    # "rule@variant": another program (or another link of it) proving the same rule.
    # maxactive keeps a handler-less kretprobe in the instance form (a light one hooks no return).
    "cold_parts": (COLD_PARTS, PIE, probe_spec("kretprobe", ["work.col?"], handlers=False, maxactive=20), None, "c"),
    "entry_frame": (ENTRY_FRAME, PIE, probe_spec("kretprobe", ["workpar?"], handlers=False, maxactive=20), None, "c"),
    "trampoline_unsafe": (TRAMPOLINE_UNSAFE, ["-O2"], probe_spec("kretprobe", ["cramped"], handlers=False,
                                                                   maxactive=20),
                          None, "c"),
    "rsp_relative_call": (RSP_CALL, PIE, probe_spec("kprobe", [("callsp", 7)], handlers=False), None, "c"),
    "red_zone": (RED_ZONE, PIE, probe_spec("kprobe", [("rz", 25)], handlers=False), None, "c"),
    "jump_into_region": (JUMP_INTO_REGION, PIE, probe_spec("kprobe", ["jir"], handlers=False), None, "c"),
    "indirect_jump": (INDIRECT_JUMP, PIE, probe_spec("kprobe", ["ij"], handlers=False), None, "c"),
    "boostable": (BOOSTABLE, PIE, probe_spec("kprobe", [("lp", 7)], handlers=False), None, "c"),
    "jump_table_bounds": (JUMP_TABLE_BOUNDS, PIE, None, None, "c"),          # the spec: _jtb_spec()
    "return_regions": (RETURN_REGIONS, PIE, probe_spec("kretprobe", ["rr"], handlers=False, maxactive=20), None, "c"),
    "lsda_landing_pads": (LSDA, ["-O2"], None, None, "c++"),                 # the spec: _lsda_spec()
    "retargeting": (RETARGETING, PIE, probe_spec("kprobe", ["work"], handlers=False), None, "c"),
    "eviction": (EVICTION, PIE, probe_spec("kprobe", ["tgt"])
                 + probe_spec("kretprobe", ["nb"], handlers=False, handler="ret_nb"), NB_RETURNS, "c"),
    "shared_regions": (SHARED, PIE, probe_spec("kprobe", ["sh"]) + probe_spec("kprobe", [("sh", 4)], handlers=False,
                                                                                post_handler="post"), POST, "c"),
    "can_probe": (CAN_PROBE, PIE, probe_spec("kprobe", [("tra?", 2)], handlers=False), None, "c"),
    "call_in_region": (CALL_IN_REGION, PIE, probe_spec("kprobe", [("cir", 6)], handlers=False), None, "c"),
    "decode": (DECODE, PIE, probe_spec("kprobe", ["dec"], handlers=False), None, "c"),
    "function_bounds": (FUNCTION_BOUNDS, PIE, probe_spec("kprobe", ["fb"], handlers=False), None, "c"),
    "blacklist": (BLACKLIST, PIE, probe_spec("kprobe", ["tin?"], handlers=False), None, "c"),
    # The same linked by gold and by lld: lld leaves _kprobe_blacklist's slot 0 in a PIE and only
    # the R_X86_64_RELATIVE relocation's addend holds tiny's address (GNU ld and gold fill both);
    # and by GNU ld with DT_RELR, whose relocations have no addend: only the slot holds it.
    **{f"blacklist@{ld}": (BLACKLIST, PIE + flags, probe_spec("kprobe", ["tin?"], handlers=False), None, "c")
       for ld, flags in (("gold", ["-fuse-ld=gold"]), ("lld", ["-fuse-ld=lld"]),
                         ("bfd-relr", ["-Wl,-z,pack-relative-relocs"]))},
    "direction_flag": (DIRECTION_FLAG, PIE, probe_spec("kprobe", [("back_copy", 9)], pre_handler="h"),
                       DF_HANDLER, "c"),
}


def _jtb_spec(prog: Path) -> str:
    """A probe at .Lc4: the 4th table entry, read from the table."""
    import struct
    from elftools.elf.elffile import ELFFile
    start = symbols(prog)["jtb"]
    with open(prog, "rb") as f:
        elf = ELFFile(f)
        ro = elf.get_section_by_name(".rodata")
        data, base = ro.data(), ro["sh_addr"]
    # The table: six rel32 entries whose targets all lie in jtb, the 5th is .Lc4.
    for off in range(0, len(data) - 23, 4):
        ents = struct.unpack_from("<6i", data, off)
        tgts = [base + off + e for e in ents]
        if all(start < t < start + 0x80 for t in tgts) and tgts == sorted(tgts):
            return probe_spec("kprobe", [("jtb", tgts[4] - start)], handlers=False)
    raise AssertionError("jtb's table not found")


def _lsda_spec(prog: Path) -> str:
    """A probe on work's instruction boundary whose 5-byte jump would cover its
    landing pad (the catch), the boundary nearest before the pad."""
    from rewriter.elf import ehframe
    from rewriter.elf.image import Image
    img = Image(str(prog))
    start = symbols(prog)["_Z4worki"]
    pads = ehframe.landing_pads(img.data, img.fdes).get(start)
    assert pads, "work has no landing pad"
    pad = pads[0]
    import capstone
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    code = img.read(start, pad - start)
    bounds = [i.address for i in md.disasm(code, start)]
    cand = [b for b in bounds if b < pad < b + 5]
    assert cand, f"no instruction boundary within 5 bytes before the landing pad at {pad:#x}"
    return probe_spec("kprobe", [("_Z4worki", cand[0] - start)], handlers=False)


def _off(prog: Path, spec: Path, out: Path, rule: str) -> Path:
    env = {**TREE_ENV, safety.OFF_VAR: rule}
    r = subprocess.run([*KPREWRITE, "instrument", prog, "--spec", spec, "-o", out], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stderr
    return out


def _check(prog: Path, spec: Path, rule: str | None) -> str:
    env = {**TREE_ENV, **({safety.OFF_VAR: rule} if rule else {})}
    r = subprocess.run([*KPREWRITE, "check", prog, "--spec", spec], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """built(rule) -> (original, rewrite with the rule on, rewrite with it off, check lines on, off)."""
    cache = {}

    def get(key):
        if key not in cache:
            rule, name = key.partition("@")[0], key.replace("@", "_")
            src, flags, spec_text, handlers, lang = PROGRAMS[key]
            tmp = tmp_path_factory.mktemp(name)
            prog = cc(tmp, name, src, *flags, lang=lang)
            if spec_text is None:
                spec_text = {"jump_table_bounds": _jtb_spec, "lsda_landing_pads": _lsda_spec}[rule](prog)
            spec = write_spec(tmp, spec_text, handlers)
            on = instrument(prog, spec, tmp / f"{name}.on")
            off = _off(prog, spec, tmp / f"{name}.off", rule)
            cache[key] = (prog, on, off, _check(prog, spec, None), _check(prog, spec, rule))
        return cache[key]
    return get


def _outcome(binary: Path, runner: str) -> tuple:
    """(exit status, standard output, standard error), or ("hung",)."""
    try:
        r = run(binary, runner=runner, timeout=HANG)
    except subprocess.TimeoutExpired:
        return ("hung",)
    return (r.returncode, r.stdout, r.stderr)


def _prove(built, rule: str, runner: str, handler_line: str | None = None, count: int = 0) -> str:
    """The original's output with the rule on (and handler_line exactly `count` times among
    the handlers' lines: as many as the program runs the probed instruction); with it off, a
    crash, a hang, other output or handler_line another number of times.  Returns the
    check lines with the rule on."""
    prog, on, off, check_on, check_off = built(rule)
    want = run(prog)
    assert want.returncode == 0, want.stderr
    got = _outcome(on, runner)
    assert got[:2] == (0, want.stdout), (check_on, got)
    assert handler_line is None or count > 0
    lines = got[2].splitlines().count(handler_line) if handler_line else 0
    assert lines == count, (handler_line, count, got[2])
    broken = _outcome(off, runner)
    assert broken[:2] != (0, want.stdout) or (handler_line and broken[2].splitlines().count(handler_line) != lines), \
        f"{rule} switched off, the program still runs right:\non:  {check_on}\noff: {check_off}"
    return check_on


def test_cold_parts(built, runner):
    _prove(built, "cold_parts", runner)


def test_entry_frame(built, runner):
    _prove(built, "entry_frame", runner)


def test_trampoline_unsafe(built, runner):
    _prove(built, "trampoline_unsafe", runner)


def test_rsp_relative_call(built, runner):
    _prove(built, "rsp_relative_call", runner)


def test_red_zone(built, runner):
    _prove(built, "red_zone", runner)


def test_jump_into_region(built, runner):
    _prove(built, "jump_into_region", runner)


def test_indirect_jump(built, runner):
    _prove(built, "indirect_jump", runner)


def test_boostable(built, runner):
    _prove(built, "boostable", runner)


def test_jump_table_bounds(built, runner):
    _prove(built, "jump_table_bounds", runner)


def test_return_regions(built, runner):
    _prove(built, "return_regions", runner)


def test_lsda_landing_pads(built, runner):
    _prove(built, "lsda_landing_pads", runner)


def test_retargeting(built, runner):
    _prove(built, "retargeting", runner)


def test_eviction(built, runner):
    _prove(built, "eviction", runner, handler_line="nb returned", count=3)          # nb(0), nb(1), nb(2)


def test_shared_regions(built, runner):
    # sh runs its jz at +4 once a call, 4 calls: 4 post lines (the jz taken for sh(0), not for sh(1)).
    _prove(built, "shared_regions", runner, handler_line="post", count=4)


def test_can_probe(built, runner):
    _prove(built, "can_probe", runner)


def test_call_in_region(built, runner):
    _prove(built, "call_in_region", runner)


def test_decode(built, runner):
    _prove(built, "decode", runner)


def test_function_bounds(built, runner):
    _prove(built, "function_bounds", runner)


@pytest.mark.parametrize("linker", ["bfd", "bfd-relr", "gold", "lld"])
def test_blacklist(built, runner, linker):
    """NOKPROBE_SYMBOL(tiny) read from each linker's PIE: from the slot (GNU ld, gold; GNU ld's
    DT_RELR, with no addend in a relocation) or from its R_X86_64_RELATIVE relocation only (lld
    writes 0 in the slot).  lld is installed by
    .ci/run; gold comes with Debian 12's binutils (later ones split it out)."""
    if linker == "gold" and not shutil.which("ld.gold"):
        pytest.skip("no ld.gold")
    check_on = _prove(built, "blacklist" if linker == "bfd" else f"blacklist@{linker}", runner)
    assert check_on.startswith("tiny+0x0  k  refused  blacklist at "), check_on


# A program that longjmps back to its setjmp 3 times (glibc's setjmp() is _setjmp, a tail jump to
# __sigsetjmp, which saves the return address it finds on the stack in the jmp_buf).
SETJMP = r"""
#include <setjmp.h>
#include <stdio.h>
static jmp_buf jb;
static int n;
__attribute__((noinline)) void bounce(int i) { longjmp(jb, i + 1); }
int main(void)
{
    volatile int s = 0;
    int r = setjmp(jb);
    s += r;
    if (n++ < 3)
        bounce(r);
    printf("s=%d n=%d\n", s, n);
    return 0;
}
"""


def test_kretprobe_blacklist_setjmp(tmp_path, runner):
    """The kretprobe blacklist's functions that return twice (linux_user.KRETPROBE_BLACKLIST, no
    switch: the registry's `kretprobe_blacklist`): a kretprobe on _setjmp is refused.  Placed, its
    return-address trampoline is what setjmp saves, and the longjmp back returns to it with no
    instance: SIGILL."""
    prog = cc(tmp_path, "sj", SETJMP, "-O2", "-static", skip_without_static=True)
    spec = write_spec(tmp_path, probe_spec("kretprobe", ["_setjm?"], handlers=False, maxactive=20))
    want = run(prog)
    assert (want.returncode, want.stdout) == (0, "s=6 n=4\n"), want
    check = _check(prog, spec, None)
    got = _outcome(instrument(prog, spec, tmp_path / "sj.on"), runner)
    assert got[:2] == (0, want.stdout), (check, got)
    assert check.startswith("_setjmp+0x0  r  refused  kretprobe_blacklist at "), check


def test_direction_flag(built, runner):
    # Under qemu-user, which delivers a signal with DF as the program left it (Linux
    # clears it), the int3 fallback runs its handler with DF = 1 unless the runtime's
    # SIGTRAP handler clears it first (kp_arch_signal_entry()).
    _prove(built, "direction_flag", runner, handler_line="lo=a hi=z", count=1)


# --- the registry -------------------------------------------------------------------------------

def _function(where: str):
    """The function a rule's `where` names ("<arch>." stands for the back end under test)."""
    module, _, name = where.partition(":")
    obj = importlib.import_module("rewriter." + module.replace("<arch>", f"arch.{ARCH}"))
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


KERNEL_MODULE = ROOT / "tests" / "kernel" / "test_kernel_safety_rules.py"


def _kernel_module():
    """(test functions, rules with an OFF entry) of the kernel rules' module, read without
    importing it (it needs the kernel's fixtures)."""
    tree = ast.parse(KERNEL_MODULE.read_text())
    tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    off = next(n.value for n in tree.body if isinstance(n, ast.Assign) and
               any(isinstance(t, ast.Name) and t.id == "OFF" for t in n.targets))
    return tests, {k.value for k in off.keys}


def _arch_module(arch: str):
    """(test functions, PROGRAMS keys) of tests/test_<arch>_safety_rules.py, read without
    importing it (it builds for its arch only)."""
    tree = ast.parse((ROOT / "tests" / f"test_{arch}_safety_rules.py").read_text())
    tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    programs = next(n.value for n in tree.body if isinstance(n, ast.Assign) and
                    any(isinstance(t, ast.Name) and t.id == "PROGRAMS" for t in n.targets))
    return tests, {k.value for k in programs.keys}


def test_every_switched_rule_has_its_program_and_test():
    """A rule added with a switch and no program here (or, for a kernel's rule, in
    tests/kernel/test_kernel_safety_rules.py; for a back end's own rule, in
    tests/test_<arch>_safety_rules.py) fails this; a rule with no switch says why
    it has no program."""
    tests = {n for n, v in globals().items() if n.startswith("test_") and callable(v)}
    kernel_tests, kernel_programs = _kernel_module()
    # A back end's own rules register from its folder (rewriter/arch/<arch>/safety_rules.py).
    assert not [r.name for r in safety.RULES.values() if r.arch]
    for r in safety.rules().values():
        assert r.origin in (safety.KERNEL, safety.OURS), r.name
        assert r.description and "\n" not in r.description, r.name
        _function(r.where)                      # the place it names exists
        if r.switch and r.arch:
            arch_tests, arch_programs = _arch_module(r.arch)
            assert r.where.startswith(f"arch.{r.arch}."), f"rule {r.name}: not in rewriter/arch/{r.arch}"
            assert r.test in arch_tests and r.name in arch_programs and r.breaks, \
                f"rule {r.name}: no test {r.test} or program in tests/test_{r.arch}_safety_rules.py"
            assert not r.unproven and not r.kernel, r.name
        elif r.switch and r.kernel:
            assert r.test in kernel_tests, f"rule {r.name}: no test {r.test} in {KERNEL_MODULE.name}"
            assert r.name in kernel_programs and r.breaks, f"rule {r.name}: no OFF entry in {KERNEL_MODULE.name}, " \
                                                           "or no word of what breaks"
            assert not r.unproven, r.name
        elif r.switch:
            assert r.test in tests, f"rule {r.name}: no test {r.test} in {__name__}"
            assert r.name in PROGRAMS and r.breaks, f"rule {r.name}: no program, or no word of what breaks"
            assert not r.unproven, r.name
        else:
            assert r.test is None and r.unproven, f"rule {r.name}: no switch, so no test: say why (unproven)"


def test_docs_table_lists_every_rule():
    """docs/safety.md's table has one row per registered rule, and no other."""
    import re
    rows = re.findall(r"^\| `(\w+)` \| (kernel|ours) \|", (ROOT / "docs" / "safety.md").read_text(), re.M)
    assert sorted(rows) == sorted((r.name, r.origin) for r in safety.rules().values())


def _enabled_calls():
    """(file, rule name) of every safety.enabled() call in rewriter/."""
    out = []
    for path in sorted((ROOT / "rewriter").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "enabled" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "safety":
                assert len(node.args) == 1 and isinstance(node.args[0], ast.Constant), \
                    f"{path}:{node.lineno}: safety.enabled() takes a rule's name as a string literal"
                out.append((path, node.args[0].value))
    return out


def test_every_check_names_a_registered_rule():
    """Each safety.enabled("x") in rewriter/ names a registered rule with a switch, and each
    switched rule is consulted in the function its entry names."""
    calls = _enabled_calls()
    for path, name in calls:
        assert name in safety.rules() and safety.rules()[name].switch, f"{path}: safety.enabled({name!r}): no such rule"
    import inspect
    for r in safety.rules().values():
        if r.switch:
            assert f'safety.enabled("{r.name}")' in inspect.getsource(_function(r.where)), \
                f"rule {r.name}: no safety.enabled() check in {r.where}"


def test_switch_refused_outside_the_suite(tmp_path):
    """KPREWRITE_UNSAFE_OFF without KPREWRITE_TEST_SUITE: a one-line error, a non-zero exit."""
    env = {k: v for k, v in TREE_ENV.items() if k != safety.SUITE_VAR}
    env[safety.OFF_VAR] = "cold_parts"
    spec = write_spec(tmp_path, probe_spec("kprobe", ["main"], handlers=False))
    r = subprocess.run([*KPREWRITE, "check", "/bin/true", "--spec", spec], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and r.stdout == "", r
    assert len(r.stderr.splitlines()) == 1 and safety.OFF_VAR in r.stderr, r.stderr
    # In-process too: the library refuses the same way.
    from rewriter.errors import KprewriteError
    old = {k: os.environ.get(k) for k in (safety.OFF_VAR, safety.SUITE_VAR)}
    try:
        os.environ.pop(safety.SUITE_VAR, None)
        os.environ[safety.OFF_VAR] = "cold_parts"
        with pytest.raises(KprewriteError):
            safety.enabled("cold_parts")
        os.environ[safety.SUITE_VAR] = "1"
        assert not safety.enabled("cold_parts") and safety.enabled("red_zone")
        os.environ[safety.OFF_VAR] = "no_such_rule"
        with pytest.raises(KprewriteError):
            safety.enabled("red_zone")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

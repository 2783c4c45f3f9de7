/*
 * The Linux signal ABI and the SIGTRAP plumbing shared by this platform's
 * files (kp_signal.c, kp_sighook.c, profile_signal.c).
 */
#ifndef _KP_SIGNAL_H
#define _KP_SIGNAL_H
#include "kp_internal.h"
#pragma GCC visibility push(hidden)

/* The siginfo head (the kernel's struct sigaction is the arch's: kp_uapi.h). */
struct kp_siginfo { int si_signo, si_errno, si_code; };
#define KP_SIGTRAP 5
#define KP_SIGBIT(n) (1UL << ((n) - 1))
#define KP_SIG_DFL ((void *)0)
#define KP_SIG_IGN ((void *)1)
/* KP_SA_* (sa_flags) are the arch's: kp_uapi.h. */

/* Install the SIGTRAP handler, only when there are breakpoint sites (kp_signal.c); with
 * the GOT hooks that keep it (kp_trap_install(), kp_sighook.c). */
void kp_trap_install(void);
void kp_trap_handler_install(void);
/* The program's view of SIGTRAP: what was installed before us, later what it asked for. */
extern struct kp_ksigaction kp_trap_chain;
/* Point the program's sigaction & co. at our hooks (kp_sighook.c). */
void kp_sighook_install(void);
/* The image's own rt_sigprocmask/rt_sigaction system calls (kp_signal.c). */
long kp_signal_syscall(long a0, long a1, long a2, long a3, long nr);
/* Whether a sigaction(SIGTRAP) is recorded here (not in a vfork() child: kp_signal.c). */
int kp_trap_record_here(void);
/* A SIGTRAP raised by the CPU: 1 if one of our breakpoints' (kp_breakpoint_signal.h, in
 * the arch's SIGTRAP file), its context updated to resume. */
int kp_breakpoint_sigtrap(void *ucontext);
/* At exit: whether the program replaced our SIGTRAP handler (said on stderr; the profile's line, or 0). */
const char *kp_trap_check(void);

#pragma GCC visibility pop

/* The restorer of the runtime's own handlers (SA_RESTORER): rt_sigreturn, in
 * the arch's sigreturn.S (hidden there; declared without the pragma as before
 * the headers were split, which keeps the compiled code as it was). */
void kp_arch_sigreturn(void);
#endif

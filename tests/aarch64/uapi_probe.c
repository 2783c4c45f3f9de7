/*
 * A freestanding AArch64 program (no libc) built against the runtime's
 * linux_user headers and linked with some of its objects (kp_signal.o,
 * kp_sighook.o, clock_cpus.o, kp_lib.o, sigreturn.o): it proves the arch's
 * uapi/ and linux_user/ facts by using them under qemu-aarch64, and the
 * kp_regs.h save/restore macros with the generated asm-offsets (regs.S).
 * tests/test_aarch64_runtime.py asserts on the lines it prints.
 */
#include "kp_signal.h"

#define NR_exit_group 94	/* not one the runtime uses */

/* What the runtime's objects take from a probe table (rewriter/emit/tables.py). */
struct kp_runtime kp_rt;
const unsigned int kp_nbreakpoints = 1;
struct kp_got_hook kp_got_hooks[1];
const unsigned int kp_ngot_hooks = 0;
const unsigned long kp_relro_start, kp_relro_end, kp_plt_start, kp_plt_end;

/* platform.c's (which needs the whole core). */
void kp_platform_close(int fd)
{
	kp_syscall3(__NR_close, fd, 0, 0);
}

static char buf[512];
static unsigned long len;

static void put(const char *s)
{
	while (*s)
		buf[len++] = *s++;
}

static void put_hex(unsigned long v)
{
	char d[17];
	int n = 0;
	put("0x");
	do {
		d[n++] = "0123456789abcdef"[v & 15];
		v >>= 4;
	} while (v);
	while (n)
		buf[len++] = d[--n];
}

static void put_dec(long v)
{
	char d[21];
	int n = 0;
	if (v < 0) {
		buf[len++] = '-';
		v = -v;
	}
	do {
		d[n++] = '0' + v % 10;
		v /= 10;
	} while (v);
	while (n)
		buf[len++] = d[--n];
}

static void line(void)
{
	buf[len++] = '\n';
	kp_syscall3(__NR_write, 1, buf, len);
	len = 0;
}

/* --- kp_regs.h: regs.S saves pt_regs, calls this, restores --- */
unsigned long regs_seen[36];
void regs_handler(struct pt_regs *regs)
{
	for (int i = 0; i < 31; i++)
		regs_seen[i] = regs->regs[i];
	regs_seen[31] = regs->sp;
	regs_seen[32] = regs->pc;
	regs_seen[33] = regs->pstate;
	regs_seen[34] = regs->orig_x0;
	regs_seen[35] = (unsigned long)(long)regs->syscallno;
	regs->regs[0] = 0xabc;
	regs->regs[19] = 0x1919;
	regs->regs[5] += 1;
	regs->pstate = (regs->pstate & ~KP_ARITH_FLAGS) | PSR_C_BIT;
}
void regs_roundtrip(unsigned long out[32]);
extern char regs_entry[];

static void test_regs(void)
{
	unsigned long out[32];
	regs_roundtrip(out);
	int saw = 1, back = 1;
	for (int i = 0; i < 29; i++)
		saw &= regs_seen[i] == 1000UL + i;
	saw &= regs_seen[29] == regs_seen[31];		/* x29 = sp at the call */
	saw &= regs_seen[32] == (unsigned long)regs_entry;
	saw &= (regs_seen[33] & KP_ARITH_FLAGS) == PSR_Z_BIT;
	saw &= regs_seen[34] == 0 && regs_seen[35] == ~0UL;
	for (int i = 1; i < 29; i++)
		if (i != 5 && i != 19)
			back &= out[i] == 1000UL + i;
	back &= out[0] == 0xabc && out[5] == 1006 && out[19] == 0x1919;
	back &= (out[31] & KP_ARITH_FLAGS) == PSR_C_BIT;
	put("regs: saved ");
	put_dec(saw);
	put(" restored ");
	put_dec(back);
	put(" size ");
	put_dec(sizeof(struct pt_regs));
	line();
}

/* --- the SIGTRAP path: kp_signal.c's handler calls this for si_code > 0 --- */
extern char probe_here[];
static unsigned long trap_pc, trap_x0, trap_insn, trap_nzcv;
static int trap_calls;

int kp_breakpoint_sigtrap(void *ucontext)
{
	struct kp_ucontext *uc = ucontext;
	trap_calls++;
	trap_pc = uc->uc_mcontext.pc;
	trap_x0 = uc->uc_mcontext.regs[0];
	trap_insn = *(unsigned int *)trap_pc;
	trap_nzcv = uc->uc_mcontext.pstate & KP_ARITH_FLAGS;
	if (trap_pc != (unsigned long)probe_here)
		return 0;
	/* As a simulated instruction would: x1 = 2 * x0 + 1, carry set, pc past the brk. */
	uc->uc_mcontext.regs[1] = trap_x0 * 2 + 1;
	uc->uc_mcontext.pstate = (uc->uc_mcontext.pstate & ~KP_ARITH_FLAGS) | PSR_C_BIT;
	uc->uc_mcontext.pc += BRK_INSN_SIZE;
	return 1;
}

static int forwarded_sig, forwarded_code;
static void program_handler(int sig, struct kp_siginfo *info, void *uc)
{
	(void)uc;
	forwarded_sig = sig;
	forwarded_code = info->si_code;
}

static void test_trap(int die)
{
	/* The program's own SIGTRAP handler, installed before the runtime's (as a
	 * C library would: SA_SIGINFO, our restorer standing in for its own). */
	struct kp_ksigaction prog = { (void *)program_handler, KP_SA_SIGINFO | KP_SA_RESTORER, kp_arch_sigreturn, 0 };
	if (!die)
		kp_syscall6(__NR_rt_sigaction, KP_SIGTRAP, (long)&prog, 0, 8, 0, 0);
	kp_trap_install();
	unsigned long x1, nzcv;
	__asm__ volatile("mov x0, #20\n\t"
			 "cmp x0, x0\n\t"		/* Z set, C set (no borrow) */
			 "msr nzcv, xzr\n\t"		/* all clear */
			 "movz x2, #0x4000, lsl #16\n\t"
			 "msr nzcv, x2\n\t"		/* Z only */
			 ".globl probe_here\n"
			 "probe_here: brk #0x004\n\t"
			 "mov %0, x1\n\t"
			 "mrs %1, nzcv"
			 : "=r"(x1), "=r"(nzcv) : : "x0", "x1", "x2", "cc", "memory");
	put("brk: calls ");
	put_dec(trap_calls);
	put(" pc-at-brk ");
	put_dec(trap_pc == (unsigned long)probe_here);
	put(" insn ");
	put_hex(trap_insn);
	put(" x0 ");
	put_dec(trap_x0);
	put(" nzcv ");
	put_hex(trap_nzcv);
	put(" -> x1 ");
	put_dec(x1);
	put(" nzcv ");
	put_hex(nzcv);
	line();
	long pid = kp_syscall3(__NR_getpid, 0, 0, 0), tid = kp_syscall3(__NR_gettid, 0, 0, 0);
	if (die)
		kp_trap_chain.handler = KP_SIG_DFL;
	kp_syscall3(__NR_tgkill, pid, tid, KP_SIGTRAP);
	put("forwarded: sig ");
	put_dec(forwarded_sig);
	put(" code ");
	put_dec(forwarded_code);
	line();
}

/* --- the platform's system calls --- */
static void test_platform(unsigned long *sp)
{
	long pid = kp_syscall3(__NR_getpid, 0, 0, 0), tid = kp_syscall3(__NR_gettid, 0, 0, 0);
	put("pid==tid ");
	put_dec(pid > 0 && pid == tid);
	line();

	/* The thread pointer: no C library here, so 0 until we set one. */
	unsigned long tp = 1;
	kp_arch_thread_pointer_sys(&tp);
	put("tp ");
	put_hex(tp);
	__asm__ volatile("msr tpidr_el0, %0" : : "r"(0x7f0012345000UL));
	kp_arch_thread_pointer_sys(&tp);
	put(" -> ");
	put_hex(tp);
	put(" ");
	put_hex(kp_arch_thread_pointer());
	line();

	/* AT_PAGESZ from the initial stack and from /proc/self/auxv (openat). */
	long argc = (long)sp[0];
	char **envp = (char **)(sp + 1 + argc + 1);
	while (*envp)
		envp++;
	unsigned long *auxv = (unsigned long *)(envp + 1), stack_pagesz = 0, file_pagesz = 0;
	for (; auxv[0]; auxv += 2)
		if (auxv[0] == 6)
			stack_pagesz = auxv[1];
	unsigned long av[128];
	long fd = kp_sys_open("/proc/self/auxv", 02000000, 0), got = 0, r;
	if (fd >= 0) {
		while ((r = kp_syscall3(__NR_read, fd, (char *)av + got, sizeof(av) - got)) > 0)
			got += r;
		kp_syscall3(__NR_close, fd, 0, 0);
	}
	for (long i = 0; i + 1 < got / 8 && av[i]; i += 2)
		if (av[i] == 6)
			file_pagesz = av[i + 1];
	put("auxv fd ");
	put_dec(fd >= 0);
	put(" pagesz ");
	put_dec(stack_pagesz);
	put(" ");
	put_dec(file_pagesz);
	line();

	put("ncpus ");
	put_dec(kp_platform_ncpus() >= 1);
	long long t0 = kp_platform_ktime(), t1 = kp_platform_ktime();
	put(" ktime ");
	put_dec(t0 > 0 && t1 >= t0);
	line();

	/* mmap, mprotect, and the fault-free copy (process_vm_readv, else the pipe). */
	long page = kp_syscall6(__NR_mmap, 0, 8192, 3, 0x22, -1, 0);
	((unsigned long *)page)[0] = 0x5a5a1234UL;
	long prot = kp_syscall3(__NR_mprotect, page + 4096, 4096, 0 /* PROT_NONE */);
	unsigned long v = 0, w = 0;
	int ok = kp_platform_copy_nofault(&v, page, 8, (int)tid);
	int bad = kp_platform_copy_nofault(&w, page + 4096, 8, (int)tid);
	put("mmap ");
	put_dec(page > 0);
	put(" mprotect ");
	put_dec(prot);
	put(" copy ");
	put_dec(ok);
	put(" ");
	put_hex(v);
	put(" unmapped ");
	put_dec(bad);
	line();

	unsigned int cpu = 99;
	put("cpu ");
	put_dec(kp_platform_cpu() < 4096);
	line();
	(void)cpu;
}

void c_main(unsigned long *sp)
{
	long argc = (long)sp[0];
	char **argv = (char **)(sp + 1);
	int die = argc > 1 && argv[1][0] == 'd';
	test_platform(sp);
	test_regs();
	test_trap(die);
	kp_syscall3(NR_exit_group, 0, 0, 0);
}

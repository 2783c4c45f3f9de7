/* The workload of benchmarks/kernel_probes.py, run by /init in the guest (gcc -static -O2).
 *
 *   syscall_loop -n N -r REPS [-w WARMUP] [-b FUNC[+OFF]] LABEL=SYSCALL ...
 *
 * For each of REPS rounds, for each LABEL=SYSCALL in turn: WARMUP calls (not timed, so QEMU's
 * translation cache and the kernel's caches are warm), then N calls of the system call made
 * with the `syscall` instruction itself (`svc #0` on arm64; no libc wrapper), timed with
 * clock_gettime(CLOCK_MONOTONIC); prints one line per loop:
 *
 *   RESULT LABEL ROUND NS_TOTAL N
 *
 * SYSCALL is one of getuid, geteuid, getgid, getegid, getpid, getppid, gettid, or cputime:
 * clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts), which the vDSO does not serve (the calling
 * task's own sum_exec_runtime: posix_cpu_clock_get(), task_sched_runtime()).
 *
 * -b FUNC[+OFF]: for the duration of the run, a kprobe of the running kernel at FUNC+OFF with an
 * empty handler and no event output: a perf kprobe event (the "kprobe" PMU, as `perf probe`
 * would make one, not through tracefs) with a BPF program attached that only returns 0, so
 * kprobe_perf_func() calls the program and returns before any perf record is made.  This is
 * as close to an empty pre_handler as the kernel offers without loading a module.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/bpf.h>
#include <linux/perf_event.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static struct timespec cputime_ts;
static const struct { const char *name; long nr, a1, a2; } SYSCALLS[] = {
	{"getuid", SYS_getuid}, {"geteuid", SYS_geteuid}, {"getgid", SYS_getgid},
	{"getegid", SYS_getegid}, {"getpid", SYS_getpid}, {"getppid", SYS_getppid},
	{"gettid", SYS_gettid},
	{"cputime", SYS_clock_gettime, CLOCK_THREAD_CPUTIME_ID, (long)&cputime_ts},
};

#if defined(__aarch64__)
/* benchmarks/kernel_arm64_probes.py: aarch64-linux-gnu-gcc -static, `svc #0`. */
static inline long raw_syscall2(long nr, long a1, long a2)
{
	register long x8 __asm__("x8") = nr;
	register long x0 __asm__("x0") = a1;
	register long x1 __asm__("x1") = a2;
	__asm__ volatile ("svc #0" : "+r"(x0) : "r"(x8), "r"(x1) : "memory");
	return x0;
}
#else
static inline long raw_syscall2(long nr, long a1, long a2)
{
	long ret;
	__asm__ volatile ("syscall" : "=a"(ret) : "a"(nr), "D"(a1), "S"(a2) : "rcx", "r11", "memory");
	return ret;
}
#endif

static long loop(int k, long n)
{
	long sum = 0, nr = SYSCALLS[k].nr, a1 = SYSCALLS[k].a1, a2 = SYSCALLS[k].a2;
	for (long i = 0; i < n; i++)
		sum += raw_syscall2(nr, a1, a2);
	return sum;
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + ts.tv_nsec;
}

static long lookup(const char *name)
{
	for (size_t i = 0; i < sizeof(SYSCALLS) / sizeof(SYSCALLS[0]); i++)
		if (!strcmp(SYSCALLS[i].name, name))
			return (long)i;
	fprintf(stderr, "syscall_loop: unknown system call %s\n", name);
	exit(2);
}

static void die(const char *what)
{
	printf("BPF-ERROR %s: %s\n", what, strerror(errno));
	fflush(stdout);
	exit(1);
}

/* A perf kprobe at func+off with a BPF program `r0 = 0; exit` attached; returns the perf fd. */
static int attach_bpf_kprobe(const char *spec)
{
	char func[128];
	unsigned long off = 0;
	const char *plus = strchr(spec, '+');
	size_t len = plus ? (size_t)(plus - spec) : strlen(spec);
	if (len >= sizeof(func))
		len = sizeof(func) - 1;
	memcpy(func, spec, len);
	func[len] = 0;
	if (plus)
		off = strtoul(plus + 1, NULL, 0);

	FILE *f = fopen("/sys/bus/event_source/devices/kprobe/type", "r");
	int type = -1;
	if (!f || fscanf(f, "%d", &type) != 1)
		die("/sys/bus/event_source/devices/kprobe/type");
	fclose(f);

	struct bpf_insn prog[2] = {
		{ .code = BPF_ALU64 | BPF_MOV | BPF_K, .dst_reg = BPF_REG_0, .imm = 0 },
		{ .code = BPF_JMP | BPF_EXIT },
	};
	static char log[4096];
	union bpf_attr attr;
	memset(&attr, 0, sizeof(attr));
	attr.prog_type = BPF_PROG_TYPE_KPROBE;
	attr.insn_cnt = 2;
	attr.insns = (uint64_t)(uintptr_t)prog;
	attr.license = (uint64_t)(uintptr_t)"GPL";
	attr.log_buf = (uint64_t)(uintptr_t)log;
	attr.log_size = sizeof(log);
	attr.log_level = 1;
	int prog_fd = syscall(SYS_bpf, BPF_PROG_LOAD, &attr, sizeof(attr));
	if (prog_fd < 0) {
		printf("BPF-LOG %s\n", log);
		die("BPF_PROG_LOAD");
	}

	struct perf_event_attr pa;
	memset(&pa, 0, sizeof(pa));
	pa.size = sizeof(pa);
	pa.type = type;
	pa.config = 0;				/* not a kretprobe */
	pa.kprobe_func = (uint64_t)(uintptr_t)func;
	pa.probe_offset = off;
	pa.sample_period = 1;
	pa.wakeup_events = 1;
	pa.disabled = 1;
	int pfd = syscall(SYS_perf_event_open, &pa, -1, 0, -1, PERF_FLAG_FD_CLOEXEC);
	if (pfd < 0)
		die("perf_event_open(kprobe PMU)");
	if (ioctl(pfd, PERF_EVENT_IOC_SET_BPF, prog_fd) < 0)
		die("PERF_EVENT_IOC_SET_BPF");
	if (ioctl(pfd, PERF_EVENT_IOC_ENABLE, 0) < 0)
		die("PERF_EVENT_IOC_ENABLE");
	return pfd;
}

int main(int argc, char **argv)
{
	long n = 1000000, reps = 1, warmup = 20000;
	const char *bpf = NULL;
	int opt;
	while ((opt = getopt(argc, argv, "n:r:w:b:")) != -1) {
		switch (opt) {
		case 'n': n = atol(optarg); break;
		case 'r': reps = atol(optarg); break;
		case 'w': warmup = atol(optarg); break;
		case 'b': bpf = optarg; break;
		default:
			fprintf(stderr, "usage: syscall_loop -n N -r REPS [-w WARMUP] [-b FUNC[+OFF]] LABEL=SYSCALL ...\n");
			return 2;
		}
	}
	int count = argc - optind;
	const char *labels[16];
	long nrs[16];
	if (count < 1 || count > 16)
		return 2;
	for (int i = 0; i < count; i++) {
		static char buf[16][64];
		snprintf(buf[i], sizeof(buf[i]), "%s", argv[optind + i]);
		char *eq = strchr(buf[i], '=');
		if (!eq)
			return 2;
		*eq = 0;
		labels[i] = buf[i];
		nrs[i] = lookup(eq + 1);
	}
	if (bpf) {
		attach_bpf_kprobe(bpf);
		/* The kprobe optimizer runs asynchronously (a delayed work, ~5 jiffies after a
		 * registration): wait for it, as for the tracefs probes. */
		sleep(1);
		FILE *f = fopen("/sys/kernel/debug/kprobes/list", "r");
		char line[256];
		while (f && fgets(line, sizeof(line), f))
			printf("BPF-KPROBE %s", line);
		if (f)
			fclose(f);
	}
	volatile long sink = 0;
	for (long r = 0; r < reps; r++) {
		for (int i = 0; i < count; i++) {
			sink += loop(nrs[i], warmup);
			uint64_t t0 = now_ns();
			sink += loop(nrs[i], n);
			uint64_t t1 = now_ns();
			printf("RESULT %s %ld %llu %ld\n", labels[i], r, (unsigned long long)(t1 - t0), n);
			fflush(stdout);
		}
	}
	(void)sink;
	return 0;
}

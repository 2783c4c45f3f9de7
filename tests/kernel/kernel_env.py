"""The kernel-image test and benchmark harness: a real Debian kernel, a busybox initramfs, QEMU.

- obtain_kernel(): the current Debian cloud kernel (``linux-image-<release>-cloud-amd64-unsigned``)
  via apt, extracted into a cache (``$KPREWRITE_KERNEL_CACHE``, else ~/.cache/kprewrite/kernel):
  vmlinuz, config, the System.map stub, and the vmlinux decompressed from the vmlinuz by
  rewriter.targets.linux_kernel.x86_64.bzimage (plus its KASLR relocation table).
- build_initramfs(): a gzip'd cpio (newc) of Debian's static busybox with a given /init and extra
  files, written in Python (deterministic: fixed inode numbers and times), cached by content.
- boot(): qemu-system-x86_64 on a kernel and initrd, the serial console captured; KVM when
  /dev/kvm works (``$KPREWRITE_QEMU_ACCEL=tcg|kvm`` forces one), else TCG.
- assert_*(): what the console must and must not show.

Run it as a script (``python3 tests/kernel/kernel_env.py``) to fetch the kernel and time one boot.
"""
from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rewriter.targets.linux_kernel.x86_64 import bzimage  # noqa: E402

META_PACKAGE = "linux-image-cloud-amd64"
BUSYBOX = Path("/bin/busybox")
QEMU_SYSTEM = "qemu-system-x86_64"

USERSPACE_MARKER = "KPREWRITE-USERSPACE-REACHED"
KMSG = re.compile(r"\[\s*\d+\.\d{6}\] [^\n]*\n")     # a kernel message, printk's time in front
DONE_MARKER = "KPREWRITE-INIT-DONE"
WX_PASSED = "x86/mm: Checked W+X mappings: passed"
POWER_DOWN = "reboot: Power down"
# no_timer_check: under TCG on a loaded host, the kernel's IO-APIC timer check can miss its
# ticks and panic ("IO-APIC + timer doesn't work!") before anything of ours runs.
DEFAULT_APPEND = "console=ttyS0 panic=-1 no_timer_check"
# Lines that mean the kernel went wrong somewhere (matched case-sensitively, anywhere in a line).
PROBLEMS = ("Oops", "BUG:", "WARNING:", "Call Trace", "Kernel panic", "general protection fault",
            "ftrace bug", "ftrace failed", "unable to handle", "segfault at", "invalid opcode")


class KernelEnvError(RuntimeError):
    """The harness cannot do its job (no apt, no qemu, no busybox): the message says what to install."""


def cache_dir() -> Path:
    d = os.environ.get("KPREWRITE_KERNEL_CACHE")
    p = Path(d) if d else Path.home() / ".cache" / "kprewrite" / "kernel"
    p.mkdir(parents=True, exist_ok=True)
    return p


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock between processes sharing the cache (two pytest runs, two worktrees)."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- the Debian kernel -----------------------------------------------------------------------------

@dataclass(frozen=True)
class DebianKernel:
    package: str            # linux-image-6.1.0-56-cloud-amd64-unsigned
    version: str            # the package's version, 6.1.192-2
    release: str            # uname -r: 6.1.0-56-cloud-amd64
    dir: Path
    vmlinuz: Path
    vmlinux: Path           # the ELF alone (boots through its PVH note)
    relocs: Path            # the KASLR relocation table that followed it in the payload
    config: Path
    system_map: Path        # Debian's stub: the real one is in the -dbg package
    meta: dict = field(default_factory=dict, compare=False)

    def config_value(self, name: str) -> str | None:
        for line in self.config.read_text().splitlines():
            if line.startswith(name + "="):
                return line.split("=", 1)[1]
        return None


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, **kw)
    except FileNotFoundError:
        raise KernelEnvError(f"{cmd[0]} not found (the kernel tests need Debian's apt)")


def current_package() -> tuple[str, str, str]:
    """(package, version, release) of the current Debian cloud kernel, as apt knows it now."""
    r = _run(["apt-cache", "depends", META_PACKAGE])
    m = re.search(r"Depends:\s*linux-image-(\S+-cloud-amd64)\b", r.stdout)
    if r.returncode != 0 or not m:
        raise KernelEnvError(f"apt does not know {META_PACKAGE} ({(r.stderr or r.stdout).strip() or 'no Depends'}); "
                             "run `apt-get update` (.ci/run does)")
    release = m.group(1)
    package = f"linux-image-{release}-unsigned"
    r = _run(["apt-cache", "policy", package])
    m = re.search(r"Candidate:\s*(\S+)", r.stdout)
    if r.returncode != 0 or not m or m.group(1) == "(none)":
        raise KernelEnvError(f"apt has no candidate for {package}; run `apt-get update` (.ci/run does)")
    return package, m.group(1), release


def _load(d: Path) -> DebianKernel:
    meta = json.loads((d / "meta.json").read_text())
    return DebianKernel(package=meta["package"], version=meta["version"], release=meta["release"], dir=d,
                        vmlinuz=d / meta["vmlinuz"], vmlinux=d / "vmlinux", relocs=d / "vmlinux.relocs",
                        config=d / meta["config"], system_map=d / meta["system_map"], meta=meta)


def obtain_kernel() -> DebianKernel:
    """The current Debian cloud kernel, downloaded and extracted once per version into the cache.
    Without apt (offline), the newest kernel already in the cache."""
    root = cache_dir()
    try:
        package, version, release = current_package()
    except KernelEnvError as e:
        cached = sorted(p.parent for p in root.glob("*/meta.json"))
        if cached:
            return _load(cached[-1])
        raise KernelEnvError(f"cannot obtain the Debian cloud kernel: {e}")
    final = root / f"{package}_{version}"
    with _locked(root / ".lock"):
        if (final / "meta.json").exists():
            return _load(final)
        work = Path(tempfile.mkdtemp(prefix=".dl-", dir=root))
        try:
            t0 = time.monotonic()
            r = _run(["apt-get", "download", "-q", f"{package}={version}"], cwd=work)
            debs = list(work.glob("*.deb"))
            if r.returncode != 0 or len(debs) != 1:
                raise KernelEnvError(f"apt-get download {package}={version} failed: "
                                     f"{(r.stderr or r.stdout).strip().splitlines()[-1:] or ['no .deb']}")
            t1 = time.monotonic()
            names = _extract_boot(debs[0], work, release)
            t2 = time.monotonic()
            img = bzimage.read(work / names["vmlinuz"])
            (work / "vmlinux").write_bytes(img.vmlinux)
            (work / "vmlinux.relocs").write_bytes(img.relocs_bytes)
            t3 = time.monotonic()
            debs[0].unlink()
            meta = {"package": package, "version": version, "release": release, "deb": debs[0].name,
                    **names, "bzimage": img.describe(), "download_seconds": round(t1 - t0, 2),
                    "extract_seconds": round(t2 - t1, 2), "decompress_seconds": round(t3 - t2, 2)}
            (work / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            work.rename(final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return _load(final)


def _extract_boot(deb: Path, dest: Path, release: str) -> dict:
    """boot/{vmlinuz,config,System.map}-<release> from the .deb (dpkg-deb --fsys-tarfile, streamed)."""
    want = {f"vmlinuz-{release}": "vmlinuz", f"config-{release}": "config", f"System.map-{release}": "system_map"}
    found = {}
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for m in tar:
                name = m.name.lstrip("./")
                if m.isfile() and name.startswith("boot/") and name[5:] in want:
                    (dest / name[5:]).write_bytes(tar.extractfile(m).read())
                    found[want[name[5:]]] = name[5:]
    finally:
        proc.stdout.close()
        err = proc.stderr.read().decode(errors="replace")
        proc.wait()
    missing = set(want.values()) - set(found)
    if missing:
        raise KernelEnvError(f"{deb.name} has no boot/{', boot/'.join(sorted(missing))}-{release} {err.strip()}")
    return found


# --- the initramfs ---------------------------------------------------------------------------------

# A pre_handler at the entry of __x64_sys_kill(const struct pt_regs *user) (nothing pushed
# yet): kill(KILL_PID, 0) returns 0 at once, as the kernel's override_function_with_return()
# does (a pre_handler changing the path).  KILL_PID is replaced by the test's pid.
KILL_OVERRIDE_C = r"""
static int kill_override(struct kprobe *p, struct pt_regs *regs)
{
	const struct pt_regs *user = (const struct pt_regs *)regs->di;
	if ((int)user->di != KILL_PID || user->si != 0)
		return 0;
	regs->ax = 0;
	regs->ip = *(unsigned long *)regs->sp;	/* the return address */
	regs->sp += 8;
	return 1;
}
"""


# /perfcount ID FILTER CMD...: a perf counter on the tracepoint-type event ID (an event's
# events/<system>/<EVENT>/id), with FILTER (none if empty) set by PERF_EVENT_IOC_SET_FILTER,
# counting in CMD (run as a child, inherited); prints "perf count=N" once CMD has exited.
PERFCOUNT_C = r"""
#include <errno.h>
#include <linux/perf_event.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	struct perf_event_attr a;
	memset(&a, 0, sizeof(a));
	a.type = PERF_TYPE_TRACEPOINT;
	a.size = sizeof(a);
	a.config = strtoull(argv[1], 0, 0);
	a.disabled = 1;
	a.inherit = 1;
	int fd = (int)syscall(SYS_perf_event_open, &a, 0, -1, -1, 0);
	if (fd < 0) {
		printf("perf open errno=%d\n", errno);
		return 1;
	}
	if (argv[2][0] && ioctl(fd, PERF_EVENT_IOC_SET_FILTER, argv[2])) {
		printf("perf filter errno=%d\n", errno);
		return 1;
	}
	ioctl(fd, PERF_EVENT_IOC_ENABLE, 0);
	pid_t pid = fork();
	if (pid == 0) {
		execvp(argv[3], argv + 3);
		_exit(127);
	}
	int status;
	waitpid(pid, &status, 0);
	ioctl(fd, PERF_EVENT_IOC_DISABLE, 0);
	unsigned long long n = 0;
	if (read(fd, &n, sizeof(n)) != sizeof(n))
		printf("perf read errno=%d\n", errno);
	printf("perf count=%llu\n", n);
	return 0;
}
"""


# perf and BPF on an event, as `perf record -e kprobes:EVENT` and a bpftrace-style program do:
#   perfbpf sample ID CMD...  samples every hit of CMD (PERF_SAMPLE_RAW): one line of hex per sample;
#   perfbpf bpf ID CMD...     a BPF_PROG_TYPE_KPROBE program attached to the event
#                             (PERF_EVENT_IOC_SET_BPF) counts every hit in an array map and sums
#                             its second argument (regs->si); prints both after CMD.
PERFBPF_C = r"""
#include <errno.h>
#include <linux/bpf.h>
#include <linux/perf_event.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define PAGES 8
#define REGS_SI 104	/* offsetof(struct pt_regs, si) on x86-64 */

static int perf_open(unsigned long long id, int pid, int cpu, int sample)
{
	struct perf_event_attr a;
	memset(&a, 0, sizeof(a));
	a.type = PERF_TYPE_TRACEPOINT;
	a.size = sizeof(a);
	a.config = id;
	if (sample) {
		a.sample_period = 1;
		a.sample_type = PERF_SAMPLE_RAW;
		a.wakeup_events = 1;
		a.disabled = 1;
		a.enable_on_exec = 1;
	}
	return (int)syscall(SYS_perf_event_open, &a, pid, cpu, -1, 0);
}

static long bpf(int cmd, union bpf_attr *a)
{
	return syscall(SYS_bpf, cmd, a, sizeof(*a));
}

#define I(c, d, s, o, i) ((struct bpf_insn){ .code = (c), .dst_reg = (d), .src_reg = (s), .off = (o), .imm = (i) })

static int run(char **argv, int *gate)
{
	pid_t pid = fork();
	if (pid == 0) {
		char c;
		if (gate) {
			close(gate[1]);
			if (read(gate[0], &c, 1) < 0)
				_exit(126);
		}
		execvp(argv[0], argv);
		_exit(127);
	}
	return pid;
}

static int sample(unsigned long long id, char **argv)
{
	int gate[2];
	if (pipe(gate))
		return 1;
	pid_t pid = run(argv, gate);
	close(gate[0]);
	int fd = perf_open(id, pid, -1, 1);
	if (fd < 0) {
		printf("perf open errno=%d\n", errno);
		return 1;
	}
	long page = sysconf(_SC_PAGESIZE);
	unsigned char *m = mmap(0, (PAGES + 1) * page, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (m == MAP_FAILED) {
		printf("perf mmap errno=%d\n", errno);
		return 1;
	}
	close(gate[1]);		/* the child execs: enable_on_exec */
	int status;
	waitpid(pid, &status, 0);
	struct perf_event_mmap_page *mp = (void *)m;
	uint64_t head = __atomic_load_n(&mp->data_head, __ATOMIC_ACQUIRE), tail = mp->data_tail;
	unsigned char *data = m + (mp->data_offset ? mp->data_offset : (uint64_t)page);
	uint64_t size = mp->data_size ? mp->data_size : (uint64_t)PAGES * page;
	unsigned samples = 0, lost = 0;
	while (tail < head) {
		unsigned char rec[4096];
		struct perf_event_header h;
		for (unsigned i = 0; i < sizeof(h); i++)
			((unsigned char *)&h)[i] = data[(tail + i) % size];
		for (unsigned i = 0; i < h.size && i < sizeof(rec); i++)
			rec[i] = data[(tail + i) % size];
		if (h.type == PERF_RECORD_SAMPLE) {
			uint32_t n;
			memcpy(&n, rec + sizeof(h), 4);
			printf("sample pid=%d raw=", pid);
			for (uint32_t i = 0; i < n && sizeof(h) + 4 + i < sizeof(rec); i++)
				printf("%02x", rec[sizeof(h) + 4 + i]);
			printf("\n");
			samples++;
		} else if (h.type == PERF_RECORD_LOST) {
			lost++;
		}
		if (!h.size)
			break;
		tail += h.size;
	}
	printf("perf samples=%u lost=%u\n", samples, lost);
	return 0;
}

static int count(unsigned long long id, char **argv)
{
	union bpf_attr a;
	memset(&a, 0, sizeof(a));
	a.map_type = BPF_MAP_TYPE_ARRAY;
	a.key_size = 4;
	a.value_size = 8;
	a.max_entries = 2;
	int map = (int)bpf(BPF_MAP_CREATE, &a);
	if (map < 0) {
		printf("bpf map errno=%d\n", errno);
		return 1;
	}
	/* key 0: hits; key 1: the sum of the second argument */
	struct bpf_insn prog[] = {
		I(BPF_ALU64 | BPF_MOV | BPF_X, 6, 1, 0, 0),		/* r6 = ctx (struct pt_regs *) */
		I(BPF_ST | BPF_MEM | BPF_W, 10, 0, -4, 0),		/* key = 0 */
		I(BPF_ALU64 | BPF_MOV | BPF_X, 2, 10, 0, 0),
		I(BPF_ALU64 | BPF_ADD | BPF_K, 2, 0, 0, -4),
		I(BPF_LD | BPF_DW | BPF_IMM, 1, BPF_PSEUDO_MAP_FD, 0, map), I(0, 0, 0, 0, 0),
		I(BPF_JMP | BPF_CALL, 0, 0, 0, BPF_FUNC_map_lookup_elem),
		I(BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 11, 0),		/* to the exit */
		I(BPF_ALU64 | BPF_MOV | BPF_K, 1, 0, 0, 1),
		I(BPF_STX | BPF_ATOMIC | BPF_DW, 0, 1, 0, BPF_ADD),	/* hits += 1 */
		I(BPF_ST | BPF_MEM | BPF_W, 10, 0, -4, 1),		/* key = 1 */
		I(BPF_ALU64 | BPF_MOV | BPF_X, 2, 10, 0, 0),
		I(BPF_ALU64 | BPF_ADD | BPF_K, 2, 0, 0, -4),
		I(BPF_LD | BPF_DW | BPF_IMM, 1, BPF_PSEUDO_MAP_FD, 0, map), I(0, 0, 0, 0, 0),
		I(BPF_JMP | BPF_CALL, 0, 0, 0, BPF_FUNC_map_lookup_elem),
		I(BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 2, 0),
		I(BPF_LDX | BPF_MEM | BPF_DW, 1, 6, REGS_SI, 0),	/* r1 = regs->si */
		I(BPF_STX | BPF_ATOMIC | BPF_DW, 0, 1, 0, BPF_ADD),	/* sum += r1 */
		I(BPF_ALU64 | BPF_MOV | BPF_K, 0, 0, 0, 1),
		I(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),
	};
	static char log[65536];
	memset(&a, 0, sizeof(a));
	a.prog_type = BPF_PROG_TYPE_KPROBE;
	a.insns = (uint64_t)(uintptr_t)prog;
	a.insn_cnt = sizeof(prog) / sizeof(prog[0]);
	a.license = (uint64_t)(uintptr_t)"GPL";
	a.log_buf = (uint64_t)(uintptr_t)log;
	a.log_size = sizeof(log);
	a.log_level = 1;
	int pfd = (int)bpf(BPF_PROG_LOAD, &a);
	if (pfd < 0) {
		printf("bpf load errno=%d\n%s\n", errno, log);
		return 1;
	}
	int fd = perf_open(id, -1, 0, 0);
	if (fd < 0) {
		printf("perf open errno=%d\n", errno);
		return 1;
	}
	if (ioctl(fd, PERF_EVENT_IOC_SET_BPF, pfd)) {
		printf("bpf attach errno=%d\n", errno);
		return 1;
	}
	ioctl(fd, PERF_EVENT_IOC_ENABLE, 0);
	int status;
	waitpid(run(argv, 0), &status, 0);
	unsigned long long v[2] = { 0, 0 };
	for (uint32_t k = 0; k < 2; k++) {
		memset(&a, 0, sizeof(a));
		a.map_fd = map;
		a.key = (uint64_t)(uintptr_t)&k;
		a.value = (uint64_t)(uintptr_t)&v[k];
		if (bpf(BPF_MAP_LOOKUP_ELEM, &a))
			printf("bpf lookup errno=%d\n", errno);
	}
	printf("bpf hits=%llu argsum=%llu\n", v[0], v[1]);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc < 4)
		return 2;
	unsigned long long id = strtoull(argv[2], 0, 0);
	return strcmp(argv[1], "sample") == 0 ? sample(id, argv + 3) : count(id, argv + 3);
}
"""


def perfbpf_program(d: Path) -> Path:
    """PERFBPF_C built static in folder d (for an initramfs)."""
    src, exe = d / "perfbpf.c", d / "perfbpf"
    src.write_text(PERFBPF_C)
    subprocess.run(["gcc", "-static", "-O2", "-o", exe, src], check=True)
    return exe


def perfcount_program(d: Path) -> Path:
    """PERFCOUNT_C built static in folder d (for an initramfs)."""
    src, exe = d / "perfcount.c", d / "perfcount"
    src.write_text(PERFCOUNT_C)
    subprocess.run(["gcc", "-static", "-O2", "-o", exe, src], check=True)
    return exe


def init_script(commands: str, marker: str = USERSPACE_MARKER) -> str:
    """An /init that mounts /proc, /sys, /dev, debugfs and tracefs, prints ``marker``, runs
    ``commands`` (busybox sh), prints DONE_MARKER and powers off once the console has it."""
    return ("#!/bin/busybox sh\n"
            "mount -t proc proc /proc\n"
            "mount -t sysfs sysfs /sys\n"
            "mount -t devtmpfs devtmpfs /dev 2>/dev/null\n"
            "mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null\n"
            "mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null\n"
            f"echo {marker}\n"
            f"{commands.rstrip()}\n"
            f"echo {DONE_MARKER}\n"
            # The tty drains to the serial port after echo returns; without a pause, the
            # kernel's own "reboot: Power down" (printk, written at once) can land inside
            # the marker's line under -smp 2.
            "sleep 0.3\n"
            "poweroff -f\n")


# The initramfs archive: the one `kprewrite boot` writes (rewriter/boot.py).
from rewriter.boot import newc as _newc  # noqa: E402


def _busybox_entries(busybox: Path = BUSYBOX, runner: tuple[str, ...] = ()) -> list[tuple[str, int, bytes, int]]:
    """busybox (the host's, or another architecture's run through `runner`, e.g. qemu-aarch64)
    and its applets' symlinks."""
    if not busybox.exists():
        raise KernelEnvError(f"{busybox} not found: install Debian's busybox-static")
    data = busybox.read_bytes()
    if b"/lib64/ld-linux" in data[:4096] or b"/lib/ld-linux" in data[:4096]:
        raise KernelEnvError(f"{busybox} is dynamically linked: install busybox-static instead of busybox")
    r = _run([*runner, str(busybox), "--list-full"])
    applets = sorted({l.strip() for l in r.stdout.splitlines() if l.strip()})
    dirs = ["bin", "sbin", "usr", "usr/bin", "usr/sbin", "dev", "proc", "sys", "tmp", "etc", "root", "run"]
    e = [(d, 0o40755, b"", 0) for d in dirs]
    e.append(("dev/console", 0o20600, b"", 5 << 8 | 1))
    e.append(("dev/null", 0o20666, b"", 1 << 8 | 3))
    e.append(("bin/busybox", 0o100755, data, 0))
    for a in applets:
        if a != "bin/busybox":
            e.append((a, 0o120777, b"/bin/busybox", 0))
    return e


def build_initramfs(init: str, extra: dict[str, bytes | str | Path] | None = None, *,
                    dest_dir: Path | None = None, busybox: Path = BUSYBOX, runner: tuple[str, ...] = ()) -> Path:
    """A gzip'd newc initramfs: busybox with its applets as symlinks, ``/init`` (the script text),
    and ``extra`` files (archive path -> contents, text or a file to copy; mode 0755, so scripts
    and programs run).  Cached by content in ``dest_dir`` (default: the kernel cache's initramfs/)."""
    entries = _busybox_entries(busybox, runner)
    names = {n for n, *_ in entries}
    files = {"init": init, **(extra or {})}
    for name, content in sorted(files.items()):
        name = name.lstrip("/")
        parts = name.split("/")
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d not in names:
                entries.append((d, 0o40755, b"", 0))
                names.add(d)
        if isinstance(content, Path):
            content = content.read_bytes()
        elif isinstance(content, str):
            content = content.encode()
        entries = [e for e in entries if e[0] != name]
        entries.append((name, 0o100755, content, 0))
        names.add(name)
    archive = _newc(entries)
    digest = hashlib.sha256(archive).hexdigest()[:20]
    dest_dir = dest_dir or cache_dir() / "initramfs"
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / f"initramfs-{digest}.cpio.gz"
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(gzip.compress(archive, compresslevel=6, mtime=0))
        tmp.rename(path)
    return path


# --- booting ----------------------------------------------------------------------------------------

def kvm_usable() -> bool:
    """Whether /dev/kvm opens and answers KVM_GET_API_VERSION (12)."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return fcntl.ioctl(fd, 0xAE00) == 12
    except OSError:
        return False
    finally:
        os.close(fd)


def default_accel() -> str:
    """TCG unless $KPREWRITE_QEMU_ACCEL says otherwise.  Not KVM by default: on this project's
    machines /dev/kvm opens and answers its API version, yet a guest never gets past SeaBIOS's
    "Booting from ROM" (the host's KVM lacks even SSE3 in CPUID), so only a boot would tell."""
    return os.environ.get("KPREWRITE_QEMU_ACCEL") or "tcg"


@dataclass
class BootResult:
    console: str
    returncode: int | None
    timed_out: bool
    seconds: float
    accel: str
    cmd: list[str]
    log: Path | None = None

    def __str__(self) -> str:
        return self.console

    def lines(self) -> list[str]:
        return self.console.splitlines()

    def lines_between(self, start: str, end: str) -> list[str]:
        """Console lines strictly between the first line ending with `start` and the next ending with `end`."""
        lines = self.lines()
        i = next(n for n, l in enumerate(lines) if l.endswith(start))
        j = next(n for n in range(i + 1, len(lines)) if lines[n].endswith(end))
        return lines[i + 1:j]

    def reached(self, marker: str = USERSPACE_MARKER) -> bool:
        # With two CPUs, a kernel message can land on the same console line as the
        # marker /init writes (seen under load): the marker starts or ends a line; or
        # inside it ("KPREWRITE-USERSP[    3.020073] LOOP-START\nACE-REACHED"): the
        # kernel's whole messages taken out, it is whole again.
        for text in (self.console, KMSG.sub("", self.console)):
            if any(l.strip().startswith(marker) or l.strip().endswith(marker) for l in text.splitlines()):
                return True
        return False

    @property
    def powered_off(self) -> bool:
        return (POWER_DOWN in self.console and self.returncode == 0 and not self.timed_out
                and "Kernel panic" not in self.console)

    def problems(self, allow: tuple[str, ...] = ()) -> list[str]:
        return [l for l in self.lines() if any(p in l for p in PROBLEMS) and not any(a in l for a in allow)]

    def between(self, start: str = USERSPACE_MARKER, end: str = DONE_MARKER) -> str:
        """The console lines after the line ``start`` and before the line ``end`` (what /init printed)."""
        out, inside = [], False
        for l in self.lines():
            if l.strip() == start:
                inside = True
            elif l.strip() == end and inside:
                break
            elif inside:
                out.append(l)
        return "\n".join(out)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines()[-n:])

    def explain(self, what: str) -> str:
        state = "timed out" if self.timed_out else f"qemu exit {self.returncode}"
        state += f", {self.seconds:.1f} s, {self.accel}"
        where = f" (full console: {self.log})" if self.log else ""
        return f"{what} [{state}]{where}\n--- console tail ---\n{self.tail()}"

    def profile(self) -> dict[str, tuple[int, int]]:
        """kprobe_profile's rows the runtime prints at power-off: event -> (hits, nmissed)."""
        lines = self.lines()
        i = next((n for n, l in enumerate(lines) if l.endswith("kprewrite: kprobe_profile at kernel_power_off:")), None)
        assert i is not None, self.explain("no kprobe_profile at power-off")
        rows = {}
        for l in lines[i + 1:]:
            m = re.fullmatch(r"\[ *[\d.]+\]   (\S+) +(\d+) +(\d+)", l)
            if not m:
                break
            rows[m.group(1)] = int(m.group(2)), int(m.group(3))
        return rows


OVMF = Path("/usr/share/OVMF")
LOADERS = ("qemu", "syslinux", "uefi")


def syslinux_disk(kernel: Path | str, initrd: Path | str, cmdline: str, dest: Path) -> Path:
    """A FAT disk image (no partition table) booted by SYSLINUX (Debian's syslinux, installed
    with its mtools-based installer, no mounting): the kernel, the initrd and a syslinux.cfg
    that boots them with ``cmdline``."""
    for tool, pkg in (("mformat", "mtools"), ("mcopy", "mtools"), ("syslinux", "syslinux")):
        if not shutil.which(tool):
            raise KernelEnvError(f"{tool} not found: install Debian's {pkg} (and syslinux-common)")
    size = Path(kernel).stat().st_size + Path(initrd).stat().st_size + (16 << 20)
    img = dest / "syslinux.img"
    with open(img, "wb") as f:
        f.truncate(max(64 << 20, size))
    cfg = dest / "syslinux.cfg"
    cfg.write_text(f"DEFAULT linux\nLABEL linux\n  KERNEL vmlinuz\n  INITRD initrd.gz\n  APPEND {cmdline}\n")
    for cmd in (["mformat", "-i", str(img), "-F", "::"], ["syslinux", "--install", str(img)],
                ["mcopy", "-i", str(img), str(kernel), "::vmlinuz"], ["mcopy", "-i", str(img), str(initrd), "::initrd.gz"],
                ["mcopy", "-i", str(img), str(cfg), "::syslinux.cfg"]):
        r = _run(cmd)
        if r.returncode != 0:
            raise KernelEnvError(f"{' '.join(cmd[:2])} failed: {(r.stderr or r.stdout).strip()}")
    return img


def _loader_args(loader: str, kernel, initrd, cmdline: str, work: Path) -> list[str]:
    """How QEMU gets the kernel: its own -kernel (SeaBIOS and QEMU's Linux boot ROM; PVH for an
    ELF), SYSLINUX from a disk image, or UEFI (OVMF starts a bzImage through its PE header and
    the kernel's EFI stub)."""
    direct = ["-kernel", str(kernel), "-initrd", str(initrd), "-append", cmdline]
    if loader == "qemu":
        return direct
    if loader == "syslinux":
        return ["-drive", f"file={syslinux_disk(kernel, initrd, cmdline, work)},format=raw,if=ide"]
    if loader == "uefi":
        code, vars_ = OVMF / "OVMF_CODE.fd", OVMF / "OVMF_VARS.fd"
        if not code.exists() or not vars_.exists():
            raise KernelEnvError(f"no {code}: install Debian's ovmf")
        shutil.copyfile(vars_, work / "OVMF_VARS.fd")     # the variable store is written
        return ["-drive", f"if=pflash,format=raw,readonly=on,file={code}",
                "-drive", f"if=pflash,format=raw,file={work / 'OVMF_VARS.fd'}", *direct]
    raise KernelEnvError(f"unknown boot loader {loader!r} (known: {', '.join(LOADERS)})")


def boot(kernel: Path | str, initrd: Path | str, *, smp: int = 2, memory: int = 512,
         append: str = DEFAULT_APPEND, extra_append: str = "", timeout: float = 90,
         accel: str | None = None, qemu_args: tuple[str, ...] = (), log: Path | None = None,
         loader: str = "qemu", qemu_system: str = QEMU_SYSTEM) -> BootResult:
    """Boot ``kernel`` (an ELF vmlinux through its PVH note, or a bzImage) with ``initrd`` in
    qemu-system-x86_64 and return the serial console.  -no-reboot: a reboot or a panic
    (panic=-1) ends QEMU like a power-off does; BootResult.powered_off tells them apart.
    loader: "qemu" (-kernel), "syslinux" (a disk image) or "uefi" (OVMF; bzImage only)."""
    qemu = shutil.which(qemu_system)
    if not qemu:
        raise KernelEnvError(f"{qemu_system} not found: install Debian's {'qemu-system-arm' if 'aarch64' in qemu_system else 'qemu-system-x86'}")
    accel = accel or default_accel()
    cmdline = " ".join(x for x in (append, extra_append) if x)
    with tempfile.TemporaryDirectory(prefix="kprewrite-boot-") as work:
        cmd = [qemu, "-accel", accel, "-m", str(memory), "-smp", str(smp), "-nographic", "-no-reboot",
               "-nic", "none", *_loader_args(loader, kernel, initrd, cmdline, Path(work)), *qemu_args]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        timed_out = False
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            out, _ = proc.communicate()
        seconds = time.monotonic() - t0
    console = out.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    if log is not None:
        log.write_text(console)
    return BootResult(console=console, returncode=None if timed_out else proc.returncode, timed_out=timed_out,
                      seconds=seconds, accel=accel, cmd=cmd, log=log)


# --- reading what /init printed ------------------------------------------------------------------------

def sections(text: str) -> dict[str, list[str]]:
    """Split /init's output into sections, each started by a line ``== name``: {name: lines}."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        if line.startswith("== "):
            cur = out.setdefault(line[3:].strip(), [])
        elif cur is not None:
            cur.append(line)
    return out


def parse_kallsyms(lines) -> dict[str, tuple[int, str]]:
    """{name: (address, type)} from /proc/kallsyms lines (the first of a duplicated name wins)."""
    syms: dict[str, tuple[int, str]] = {}
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and re.fullmatch(r"[0-9a-f]{8,16}", parts[0]):
            syms.setdefault(parts[2], (int(parts[0], 16), parts[1]))
    return syms


# --- assertions ---------------------------------------------------------------------------------------

def assert_reached_user_space(r: BootResult, marker: str = USERSPACE_MARKER) -> None:
    assert r.reached(marker), r.explain(f"the boot did not reach user space (no line {marker!r})")


def assert_clean_poweroff(r: BootResult) -> None:
    assert r.powered_off, r.explain(f"no clean power-off (no {POWER_DOWN!r}, or a panic, or QEMU failed)")


def assert_no_kernel_problems(r: BootResult, allow: tuple[str, ...] = ()) -> None:
    bad = r.problems(allow)
    assert not bad, r.explain("the kernel reported problems:\n  " + "\n  ".join(bad[:20]))


def assert_wx_passed(r: BootResult) -> None:
    assert WX_PASSED in r.console, r.explain(f"no {WX_PASSED!r} line (CONFIG_DEBUG_WX's check at boot)")


def assert_boot_ok(r: BootResult, marker: str = USERSPACE_MARKER, allow: tuple[str, ...] = ()) -> None:
    """Reached user space, /init finished, W+X check passed, no oops/BUG/WARNING, clean power-off."""
    assert_reached_user_space(r, marker)
    assert r.reached(DONE_MARKER), r.explain(f"/init did not finish (no line {DONE_MARKER!r})")
    assert_no_kernel_problems(r, allow)
    assert_wx_passed(r)
    assert_clean_poweroff(r)


if __name__ == "__main__":
    k = obtain_kernel()
    print(json.dumps({**k.meta, "dir": str(k.dir)}, indent=1))
    initrd = build_initramfs(init_script("cat /proc/version"))
    for accel in sys.argv[1:] or [default_accel()]:
        r = boot(k.vmlinux, initrd, accel=accel, timeout=60)
        print(f"{accel}: {r.seconds:.2f} s, user space {r.reached()}, powered off {r.powered_off}, "
              f"W+X passed {WX_PASSED in r.console}, problems {r.problems()}")

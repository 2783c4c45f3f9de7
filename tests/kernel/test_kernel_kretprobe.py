"""kretprobes in a kernel: Debian's vmlinux rewritten with return probes, booted once
under qemu-system-x86_64 -smp 2 with preempt=full, and every assertion read from that boot.

- the kernel's samples/kprobes/kretprobe_example.c handlers, unchanged, on kernel_clone
  (entry_handler, data_size, ri->data, maxactive = 20): each fork /init makes returns the
  child's pid, with the time it took;
- a task that sleeps inside a return-probed function (kernel_wait4(), waiting for a child)
  and is moved to the other CPU meanwhile: its instance is the task's, so the return handler
  runs on the other CPU with the entry's ri->data and the child's pid as return value; a
  second kretprobe on the same function fires first (newest instance) and sees the real
  return address; /proc/PID/stack of the sleeping task unwinds through kernel_wait4 to its
  caller (the return address is never replaced);
- entry/return pairs exact under two CPUs forking at once, and a kprobe on the same function
  counting the same calls;
- maxactive = 1 on hrtimer_nanosleep() with three tasks sleeping in it at once: exactly two
  nmissed, one return handler (its entry_handler reads regs: that entry builds struct pt_regs,
  while do_nanosleep()'s, inside it, takes the clean call and fires first);
- those functions' exits are hooked (the user-space design: `check` lists their return sites,
  each `jmp __x86_return_thunk` whose .return_sites entry now points at its copy in the detour,
  and the boot has no "missing return thunk" WARN); strncpy_from_user(), whose exits cannot
  take a jump (an exception-table entry), keeps the trampoline, and `check` names that check:
  its return handler sees the real return address, in getname_flags.part.0; getname_flags()
  has its exits hooked, and its tail call to getname_flags.part.0 swaps the slot for the
  trampoline: every call returns once, with the real return address;
- a tail call between two hooked functions (__x64_sys_read() to ksys_read()): both return
  handlers fire at ksys_read()'s exit, newest first, at the shared slot.
"""
from __future__ import annotations

import json
import re
import struct
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

from kernel_env import DONE_MARKER, assert_boot_ok, init_script

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rewriter.elf.image import Image  # noqa: E402
from rewriter.targets import linux_kernel  # noqa: E402
from rewriter.targets.linux_kernel.x86_64 import sites as ks  # noqa: E402

pytestmark = pytest.mark.kernel

FORKS = 3                   # /bin/true runs /init reports the pids of
PER_CPU = 15                # forks each of two pinned shells makes at once
SLEEPERS = 3                # tasks in hrtimer_nanosleep() at once, maxactive = 1
# A path /init opens: getname_flags() copies it with strncpy_from_user(), which returns its length.
FALLBACK_PATH = "/kp-trampoline-fallback-" + "x" * 13
# A file dd reads in one read(): __x64_sys_read() tail-calls ksys_read(), which returns its size.
READ_SIZE = 1357
READ_COUNT = 4093           # dd's bs: ksys_read()'s count

COMMANDS = f"""
echo LOOP-START > /dev/kmsg
for i in {' '.join(str(i) for i in range(FORKS))}; do /bin/true & echo "kp-clone-child=$!" > /dev/kmsg; wait; done
echo LOOP-END > /dev/kmsg
taskset 1 sh -c 'echo "kp-waiter=$$" > /dev/kmsg; /bin/waitchild; true'
taskset 1 sh -c 'for i in $(seq {PER_CPU}); do /bin/true; done' &
taskset 2 sh -c 'for i in $(seq {PER_CPU}); do /bin/true; done' &
wait
echo NSLEEP-START > /dev/kmsg
{' '.join(['sleep 2 &'] * SLEEPERS)} wait
echo NSLEEP-END > /dev/kmsg
cat {FALLBACK_PATH} 2> /dev/null
dd if=/kp-read-marker of=/dev/null bs={READ_COUNT} count=1 2> /dev/null
grep '  r  ' /sys/kernel/debug/kprewrite/list | while read -r l; do echo "kp-dbg-list: $l" > /dev/kmsg; done
grep '^  r_' /sys/kernel/debug/kprewrite/profile | while read -r l; do echo "kp-dbg-profile: $l" > /dev/kmsg; done
for f in /sys/kernel/debug/kprewrite/*; do echo "kp-dbg-mode: $(stat -c '%n %a' $f)" > /dev/kmsg; done
echo {DONE_MARKER}
sleep 1
"""
# The child /bin/waitchild: its parent (pinned to CPU 0) sleeps in kernel_wait4() until it
# ends; meanwhile it moves the parent to CPU 1 and reads the parent's kernel stack.
WAITCHILD = """#!/bin/sh
echo "kp-child=$$" > /dev/kmsg
sleep 0.5
taskset -p 2 $PPID > /dev/null
while read -r l; do echo "kp-stack: $l" > /dev/kmsg; done < /proc/$PPID/stack
"""

HANDLERS = r"""
#include <linux/kprobes.h>
#include <linux/ktime.h>
#include <linux/sched.h>	/* current, from the image's BTF */

static int this_cpu(void)
{
	int cpu;
	__asm__ volatile("movl %%gs:cpu_number, %0" : "=r"(cpu));
	return cpu;
}

struct wait_data {
	long long t0;
	int cpu, pid;
};

/* kernel_wait4(upid, stat_addr, options, ru): the caller sleeps in it until a child ends. */
static int wait_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	struct wait_data *d = (struct wait_data *)ri->data;
	d->t0 = ktime_get();
	d->cpu = this_cpu();
	d->pid = current->pid;
	pr_info("kp-wait-enter: pid=%d\n", d->pid);
	return 0;
}

static int wait_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	struct wait_data *d = (struct wait_data *)ri->data;
	pr_info("kp-wait-ret: pid=%d task=%d ret=%ld cpu=%d->%d slept=%lld\n", d->pid, current->pid,
		(long)regs_return_value(regs), d->cpu, this_cpu(), ktime_get() - d->t0);
	return 0;
}

/* The second kretprobe on kernel_wait4: its instance is the newest, so it fires first. */
static int wait_ret2(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("kp-wait-ret2: task=%d ret_addr=%lx ip=%lx\n", current->pid, (unsigned long)ri->ret_addr, regs->ip);
	return 0;
}

static int wait_seen(struct kprobe *p, struct pt_regs *regs)
{
	return 0;
}

/* hrtimer_nanosleep(ktime_t rqtp, mode, clockid): an entry_handler that reads regs, so
 * this entry builds struct pt_regs (the others take the clean call). */
static int nsleep_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	*(long *)ri->data = (long)regs->di;
	return 0;
}

/* do_nanosleep(), inside hrtimer_nanosleep(): a second frame of the same task, at another slot. */
static int dosleep_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("kp-dosleep-ret: pid=%d ret=%ld\n", current->pid, (long)regs_return_value(regs));
	return 0;
}

static int nsleep_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("kp-nsleep-ret: pid=%d ret=%ld ns=%ld\n", current->pid, (long)regs_return_value(regs),
		*(long *)ri->data);
	return 0;
}

/* strncpy_from_user(): its returns only the trampoline catches (an exception-table entry
 * keeps jumps out of the function); reported for /init's path, by its length. */
static int sfu_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	if (regs_return_value(regs) == FALLBACK_LEN)
		pr_info("kp-sfu-ret: task=%d ret=%ld ret_addr=%lx ip=%lx\n", current->pid,
			(long)regs_return_value(regs), (unsigned long)ri->ret_addr, regs->ip);
	return 0;
}

/* getname_flags(): its exits hooked, but without an audit context it tail-calls
 * getname_flags.part.0 (which calls strncpy_from_user()), and that path swaps the slot for
 * the trampoline (a tail call to a function whose returns are not hooked). */
static int getname_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("kp-getname-ret: task=%d ret=%lx ret_addr=%lx ip=%lx\n", current->pid,
		(unsigned long)regs_return_value(regs), (unsigned long)ri->ret_addr, regs->ip);
	return 0;
}

/* __x64_sys_read() tail-calls ksys_read(), both return-probed with hooked exits: the caller's
 * instance waits at the shared slot (a pending tail call) and fires at ksys_read()'s exit,
 * after ksys_read()'s own (newest first). */
static int kread_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	*(long *)ri->data = (long)regs->dx;	/* ksys_read(fd, buf, count) */
	return 0;
}

/* Never reads regs: ksys_read()'s exits take the clean return hook, which finds
 * __x64_sys_read()'s instance (whose handler reads regs) at the slot and hands over to
 * the full hook. */
static int kread_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	if (*(long *)ri->data == READ_COUNT)
		pr_info("kp-kread-ret: task=%d ret_addr=%lx\n", current->pid, (unsigned long)ri->ret_addr);
	return 0;
}

static int xread_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	if (regs_return_value(regs) == READ_SIZE)
		pr_info("kp-xread-ret: task=%d ret_addr=%lx ip=%lx sp=%lx\n", current->pid,
			(unsigned long)ri->ret_addr, regs->ip, regs->sp);
	return 0;
}
"""

SPEC = """handlers = ["{sample}", "handlers.c"]
[[kretprobe]]
symbol_name = "kernel_clone"
handler = "ret_handler"
entry_handler = "entry_handler"
data_size = 8
maxactive = 20
[[kretprobe]]
symbol_name = "kernel_wait4"
handler = "wait_ret"
entry_handler = "wait_entry"
data_size = 16
[[kretprobe]]
symbol_name = "kernel_wait4"
handler = "wait_ret2"
[[kprobe]]
symbol_name = "kernel_wait4"
pre_handler = "wait_seen"
[[kretprobe]]
symbol_name = "hrtimer_nanosleep"
handler = "nsleep_ret"
entry_handler = "nsleep_entry"
data_size = 8
maxactive = 1
[[kretprobe]]
symbol_name = "do_nanosleep"
handler = "dosleep_ret"
[[kretprobe]]
symbol_name = "strncpy_from_user"
handler = "sfu_ret"
[[kretprobe]]
symbol_name = "getname_flags"
handler = "getname_ret"
[[kretprobe]]
symbol_name = "__x64_sys_read"
handler = "xread_ret"
[[kretprobe]]
symbol_name = "ksys_read"
handler = "kread_ret"
entry_handler = "kread_entry"
data_size = 8
"""
# The functions whose exits are hooked, and the one that keeps the trampoline.
HOOKED = ("kernel_clone", "kernel_wait4", "hrtimer_nanosleep", "do_nanosleep", "getname_flags", "__x64_sys_read",
          "ksys_read")
FALLBACK = "strncpy_from_user"

@pytest.fixture(scope="module")
def kret(tmp_path_factory, debian_kernel):
    """The rewritten vmlinux, its `check` and `list`."""
    d = tmp_path_factory.mktemp("kretprobes")
    (d / "handlers.c").write_text(f"#define FALLBACK_LEN {len(FALLBACK_PATH)}\n#define READ_SIZE {READ_SIZE}\n"
                                 f"#define READ_COUNT {READ_COUNT}\n" + HANDLERS)
    spec = d / "probes.toml"
    spec.write_text(SPEC.format(sample=ROOT / "samples" / "kretprobe_example" / "handlers.c"))
    check = kprewrite("check", debian_kernel.vmlinux, "--spec", spec).stdout
    out = d / "vmlinux.kp"
    kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "-o", out)
    listing = kprewrite("list", out).stdout
    meta = json.loads(kprewrite("list", out, "--format", "json").stdout)
    image = Image(str(debian_kernel.vmlinux))
    linux_kernel.load_symbols(image)
    return {"check": check, "list": listing, "out": out, "image": image, "meta": meta}


@pytest.fixture(scope="module")
def kret_boot(kret, make_initramfs, boot_kernel):
    initrd = make_initramfs(init_script(COMMANDS), {"/bin/waitchild": WAITCHILD, "/kp-read-marker": "r" * READ_SIZE})
    # preempt=full: a task may be preempted anywhere outside our handlers, between an entry and
    # its exit hook, or between the exit hook and the return it guards.
    return boot_kernel("kretprobe-vmlinux-smp2", kret["out"], initrd, smp=2, timeout=240, extra_append="preempt=full")


def _kmsg(r, key: str) -> str:
    m = re.search(rf"\] {key}=(\d+)$", r.console, re.M)
    assert m, r.explain(f"/init did not report {key}")
    return m.group(1)


def test_check_and_list_show_hooked_exits(kret):
    """`check` lists each hooked function's return sites as for a user ELF (every one a
    `jmp __x86_return_thunk` at a .return_sites entry, a ret; getname_flags() also tail-calls),
    and for strncpy_from_user() the trampoline with the check that refused its exits and where;
    `list` shows them as `r` probes at their ftrace sites, next to the runtime's hooks
    (free_task: a dead task's instances given back)."""
    image = kret["image"]
    returns = {r.start for r in ks.return_sites(linux_kernel.symbols.kernel(image))}
    rows = {l.split("  ")[0] + "  " + l.split("  ")[1]: l for l in kret["check"].splitlines()}
    r_lines = [l for l in kret["check"].splitlines() if "  r  " in l]
    assert len(r_lines) == 9, kret["check"]
    for l in r_lines:
        fn = l.split("+")[0]
        if fn == FALLBACK:
            # Its entry, as written: a breakpoint (no ftrace site; the same check refuses a jump).
            assert re.fullmatch(r"strncpy_from_user\+0x0  r  int3  __ex_table at 0x[0-9a-f]+: strncpy_from_user has an "
                                r"exception table entry: its fixup may jump back into the function  \[boost\]  "
                                r"returns: trampoline  __ex_table at "
                                r"0x[0-9a-f]+: the exit at 0x[0-9a-f]+ cannot take a jump: strncpy_from_user has an "
                                r"exception table entry: its fixup may jump back into the function \(the return "
                                r"address is swapped at entry\)", l), l
            continue
        assert fn in HOOKED, l
        m = re.fullmatch(r"\w+\+0x0  r  ftrace  returns: (.*)", l)
        assert m and "trampoline  " not in l, l
        sites = m.group(1).split(", ")
        rets = [int(s.split()[0], 16) for s in sites if s.endswith(" ret")]
        f = next(f for f in image.functions if f.name == fn)
        # __x64_sys_read's one exit is its tail call to ksys_read.
        assert (rets or fn == "__x64_sys_read") and all(f.start < a < f.end and a in returns for a in rets), (l, rets)
        assert all(s.endswith(" ret") or re.fullmatch(r"0x[0-9a-f]+ tail->0x[0-9a-f]+ \((pending|trampoline)\)", s)
                   for s in sites), l
    assert "kernel_wait4+0x0  k" in rows, kret["check"]
    listing = kret["list"].splitlines()
    for fn in ("kernel_clone", "hrtimer_nanosleep", "do_nanosleep", "getname_flags"):
        assert any(re.fullmatch(rf"[0-9a-f]{{16}}  r  {fn}\+0x0 \[FTRACE\]", l) for l in listing), kret["list"]
    assert sum(bool(re.fullmatch(r"[0-9a-f]{16}  r  kernel_wait4\+0x0 \[FTRACE\]", l)) for l in listing) == 2
    assert any(re.fullmatch(r"[0-9a-f]{16}  k  free_task\+0x0 \[FTRACE\]", l) for l in listing), kret["list"]
    # An entry whose handlers never read regs takes the clean call (the slot passed, no struct
    # pt_regs): do_nanosleep's, which has no entry_handler; hrtimer_nanosleep's entry_handler
    # reads regs.
    calls = {(p["symbol"], p["kind"]): p.get("call") for p in kret["meta"]["probes"]}
    assert calls[("do_nanosleep", "r")] == "clean", calls
    assert calls[("hrtimer_nanosleep", "r")] == "pt_regs", calls
    # Each hooked ret has a return site (its own detour) in the metadata; the fallback none.
    ways = {p["symbol"]: (p["returns"], p["return_sites"]) for p in kret["meta"]["probes"] if p["kind"] == "r"}
    assert ways[FALLBACK] == ("trampoline", []), ways[FALLBACK]
    assert all(ways[fn][0] == "optimized" and ways[fn][1] for fn in HOOKED), ways


def test_return_sites_point_at_the_copies(kret):
    """Each hooked `jmp __x86_return_thunk`'s .return_sites entry (an s32 relative to itself)
    points at a `jmp __x86_return_thunk` in our code (the copy apply_returns() patches at
    boot); the site itself now jumps to the detour holding that copy."""
    image, out = kret["image"], Image(str(kret["out"]))
    k = linux_kernel.symbols.kernel(image)
    entries = ks.return_site_entries(k)
    thunk = linux_kernel.symbols.symbol(image, "__x86_return_thunk")
    lay = linux_kernel.plan_layout(image)
    n = 0
    for p in kret["meta"]["probes"]:
        for rs in p.get("return_sites") or ():
            start, exit_addr = int(rs["address"], 16), int(rs["exit"], 16)
            if exit_addr not in entries:
                continue
            entry = entries[exit_addr]
            copy = entry + struct.unpack("<i", out.read(entry, 4))[0]
            code = out.read(copy, 5)
            assert lay.rx_vaddr <= copy < lay.end and code[0] == 0xE9, (hex(exit_addr), hex(copy))
            assert copy + 5 + struct.unpack("<i", code[1:])[0] == thunk, hex(exit_addr)
            jmp = out.read(start, 5)
            detour = start + 5 + struct.unpack("<i", jmp[1:])[0]
            assert jmp[0] == 0xE9 and detour < copy < detour + 64, (hex(start), hex(detour), hex(copy))
            n += 1
    assert n >= 6, n


def test_boots_with_kretprobes(kret_boot):
    """No WARN (apply_returns() found a return thunk at every .return_sites entry, our copies
    included), W+X check passed, clean power-off; fully preemptible."""
    assert_boot_ok(kret_boot)
    assert "Dynamic Preempt: full" in kret_boot.console, kret_boot.explain("not booted with preempt=full")


def test_debugfs_views_list_the_kretprobes(kret_boot, kret):
    """/sys/kernel/debug/kprewrite/list shows each kretprobe as `r` at its address, as `list`
    does from the file; the profile's rows read from /init name them with their counts."""
    r = kret_boot
    # Written to /dev/kmsg one line at a time: the handlers' own messages cannot split them.
    dbg = [l.split("kp-dbg-list: ", 1)[1].split() for l in r.lines() if "] kp-dbg-list: " in l]
    listed = [l.split() for l in kret["list"].splitlines() if "  r  " in l]
    assert len(dbg) == 9 and sorted(d[:3] for d in dbg) == sorted(l[:3] for l in listed), (dbg, listed)
    rows = {x[0]: x[1:] for x in (l.split("kp-dbg-profile: ", 1)[1].split() for l in r.lines()
                                  if "] kp-dbg-profile: " in l)}
    assert {"r_kernel_clone_0", "r_kernel_wait4_0", "r_hrtimer_nanosleep_0", "r_do_nanosleep_0"} <= set(rows), rows
    assert rows["r_hrtimer_nanosleep_0"][1] == str(SLEEPERS - 1), rows
    # The kernel's own modes (kernel/kprobes.c, tracefs' kprobe_profile): list 0400, enabled 0600,
    # profile 0440.
    modes = dict(l.split("kp-dbg-mode: ", 1)[1].split() for l in r.lines() if "] kp-dbg-mode: " in l)
    assert modes == {"/sys/kernel/debug/kprewrite/list": "400", "/sys/kernel/debug/kprewrite/enabled": "600",
                     "/sys/kernel/debug/kprewrite/profile": "440"}, modes


def test_kretprobe_example_on_kernel_clone(kret_boot):
    """The kernel sample's handlers: each fork /init reports returns the child's pid, with a
    time taken from the entry's ri->data; kernel threads are skipped by the entry_handler
    (their calls count as hits, run no return handler); nothing missed."""
    r = kret_boot
    loop = r.lines_between("LOOP-START", "LOOP-END")
    children = [re.search(r"kp-clone-child=(\d+)$", l).group(1) for l in loop if "kp-clone-child=" in l]
    assert len(children) == FORKS, r.explain("/init did not report its children")
    returned = {}
    for l in r.lines():
        m = re.search(r"\] kernel_clone returned (\d+) and took (\d+) ns to execute$", l)
        if m:
            returned[m.group(1)] = int(m.group(2))
    for pid in children:
        assert pid in returned, r.explain(f"no 'kernel_clone returned {pid}' line")
        assert 0 < returned[pid] < 10**10, r.explain(f"kernel_clone for {pid} took {returned[pid]} ns")
    hits, missed = r.profile()["r_kernel_clone_0"]
    assert missed == 0 and hits > len(returned) >= FORKS + 2 * PER_CPU, (hits, missed, len(returned))


def test_task_sleeping_inside_returns_on_the_other_cpu(kret_boot, kret):
    """kernel_wait4() entered on CPU 0 by a shell pinned there, which sleeps until its child
    ends; the child moves it to CPU 1: the return handler runs there, for the same task, with
    the child's pid as return value and the entry's ri->data.  The newer instance (the second
    kretprobe on the function) fires first and sees the real return address, the caller's."""
    r = kret_boot
    waiter, child = _kmsg(r, "kp-waiter"), _kmsg(r, "kp-child")
    lines = r.lines()
    i = next((n for n, l in enumerate(lines) if re.search(rf"kp-wait-ret: pid={waiter} task={waiter} ret={child} ", l)),
             None)
    assert i is not None, r.explain(f"no return of kernel_wait4 for {waiter} with {child}")
    m = re.search(r"cpu=(\d+)->(\d+) slept=(\d+)$", lines[i])
    assert m and (m.group(1), m.group(2)) == ("0", "1"), r.explain(f"not moved from CPU 0 to 1: {lines[i]}")
    assert int(m.group(3)) > 400_000_000, lines[i]
    m2 = re.search(rf"kp-wait-ret2: task={waiter} ret_addr=(\S+) ip=(\S+)$", lines[i - 1])
    assert m2, r.explain(f"the second kretprobe's handler did not fire just before: {lines[i - 1]}")
    # A vmlinux booted through its PVH note runs at its link address (no KASLR).
    caller = kret["image"].function_at(int(m2.group(1), 16))
    assert m2.group(1) == m2.group(2) and caller is not None and caller.name in (
        "__do_sys_wait4", "__x64_sys_wait4", "__se_sys_wait4"), (lines[i - 1], caller)
    stack = [l.split("kp-stack: ", 1)[1] for l in lines if "] kp-stack: " in l]
    print(f"\n/proc/{waiter}/stack while it sleeps in kernel_wait4 (its return address untouched): {stack}")
    # Its exits are hooked, so its return address is the caller's own: the ORC unwinder walks
    # through kernel_wait4 to its caller and on to the system call entry.
    names = [l.split()[-1].split("+")[0] for l in stack]
    assert "do_wait" in names and "kernel_wait4" in names and "do_syscall_64" in names and \
        names.index("kernel_wait4") + 1 < len(names) and names[names.index("kernel_wait4") + 1] in (
            "__do_sys_wait4", "__x64_sys_wait4", "__se_sys_wait4"), \
        r.explain(f"/proc/{waiter}/stack of the sleeping task: {stack}")


def test_entry_return_pairs_on_two_cpus(kret_boot):
    """Every kernel_wait4() entry has exactly one return, for the same task (two shells fork on
    both CPUs at once); the kprobe on the same function counts the same calls; nothing missed."""
    r = kret_boot
    enters, rets = Counter(), Counter()
    lines = r.lines()
    for l in lines:
        m = re.search(r"\] kp-wait-enter: pid=(\d+)$", l)
        if m:
            enters[m.group(1)] += 1
        m = re.search(r"\] kp-wait-ret: pid=(\d+) task=(\d+) ", l)
        if m:
            assert m.group(1) == m.group(2), l
            rets[m.group(1)] += 1
    # /init's last wait4 is for `poweroff -f`: it never returns.
    pending = enters - rets
    assert pending == Counter({"1": 1}) and not rets - enters and sum(rets.values()) >= 2 * PER_CPU, (enters, rets)
    prof = r.profile()
    ret2 = sum(1 for l in lines if "] kp-wait-ret2: " in l)
    # Both kretprobes' rows are named r_kernel_wait4_0 (profile() keeps one per name).
    waits = [(int(m.group(1)), int(m.group(2))) for m in re.finditer(r"\]   r_kernel_wait4_0 +(\d+) +(\d+)$",
                                                                       r.console, re.M)]
    n = sum(rets.values())
    assert len(waits) == 2 and all(v == (n + 1, 0) for v in waits), (n, prof)
    assert prof["p_kernel_wait4_0"] == (n + 1, 0) and ret2 == n, (n, ret2, prof)


def test_maxactive_one_with_three_sleepers(kret_boot):
    """maxactive = 1 on hrtimer_nanosleep(), three tasks sleeping in it at once: the first call
    takes the only instance, the two others count in nmissed and run no handler (as the
    kernel's kretprobe does); every sleep outside that window has its return handler."""
    r = kret_boot
    window = r.lines_between("NSLEEP-START", "NSLEEP-END")
    rets = [l for l in window if "kp-nsleep-ret: " in l]
    assert len(rets) == 1 and rets[0].endswith(" ret=0 ns=2000000000"), r.explain(f"{rets}")
    hits, missed = r.profile()["r_hrtimer_nanosleep_0"]
    total = sum(1 for l in r.lines() if "kp-nsleep-ret: " in l)
    assert missed == SLEEPERS - 1 and hits == total + missed, (hits, missed, total)
    # do_nanosleep() (default maxactive, a clean entry) inside it: every sleeper returns from
    # both, the inner frame first (one task, two slots, LIFO).
    inner = [l for l in window if "kp-dosleep-ret: " in l]
    assert len(inner) == SLEEPERS and all(l.endswith(" ret=0") for l in inner), r.explain(f"{inner}")
    pid = re.search(r"kp-nsleep-ret: pid=(\d+) ", rets[0]).group(1)
    order = [l for l in window if f"pid={pid} " in l]
    assert "kp-dosleep-ret" in order[0] and "kp-nsleep-ret" in order[1], order
    hits, missed = r.profile()["r_do_nanosleep_0"]
    assert missed == 0 and hits == sum(1 for l in r.lines() if "kp-dosleep-ret: " in l), (hits, missed)


def test_trampoline_fallback_returns_to_its_caller(kret_boot, kret):
    """strncpy_from_user() keeps the trampoline (its exits cannot take a jump): copying /init's
    path it returns the path's length, and its return handler sees the real return address (in
    getname_flags.part.0) as regs->ip.  getname_flags() is hooked at every exit, and its tail
    call to getname_flags.part.0 swaps the slot for the trampoline (HOOK_SWAP)."""
    r = kret_boot
    got = [re.search(r"kp-sfu-ret: task=(\d+) ret=(\d+) ret_addr=(\S+) ip=(\S+)$", l) for l in r.lines()
           if "kp-sfu-ret: " in l]
    assert got and all(m for m in got), r.explain(f"no return of strncpy_from_user for {FALLBACK_PATH}")
    for m in got:
        caller = kret["image"].function_at(int(m.group(3), 16))
        assert int(m.group(2)) == len(FALLBACK_PATH) and m.group(3) == m.group(4), m.group(0)
        assert caller is not None and caller.name in ("getname_flags", "getname_flags.part.0"), (m.group(0), caller)
    # getname_flags() returned through the trampoline its tail call swapped in (the hook
    # before its `jmp getname_flags.part.0`): every call has its return handler, which sees its
    # caller's real return address as regs->ip.
    rets = [re.search(r"kp-getname-ret: task=(\d+) ret=(\S+) ret_addr=(\S+) ip=(\S+)$", l) for l in r.lines()
            if "kp-getname-ret: " in l]
    ghits, gmissed = r.profile()["r_getname_flags_0"]
    assert gmissed == 0 and len(rets) == ghits > 10 and all(rets), (ghits, gmissed, len(rets))
    for m in rets:
        caller = kret["image"].function_at(int(m.group(3), 16))
        assert m.group(3) == m.group(4) and caller is not None and not caller.name.startswith("getname"), \
            (m.group(0), caller)
    hits, missed = r.profile()["r_strncpy_from_user_0"]
    assert missed == 0 and hits >= len(got), (hits, missed)


def test_tail_call_between_hooked_functions(kret_boot, kret):
    """__x64_sys_read() tail-calls ksys_read() (`check`: a pending tail call): one read of
    READ_SIZE bytes runs ksys_read()'s return handler, then __x64_sys_read()'s, both at the
    same slot with the same return address (the system call's caller).  ksys_read()'s handler
    never reads regs, so its exits take the clean hook, which hands over to the full one for
    __x64_sys_read()'s instance."""
    assert re.search(r"^__x64_sys_read\+0x0  r  ftrace  returns: 0x[0-9a-f]+ tail->0x[0-9a-f]+ \(pending\)$",
                     kret["check"], re.M), kret["check"]
    r = kret_boot
    lines = [l for l in r.lines() if "kp-kread-ret: " in l or "kp-xread-ret: " in l]
    assert len(lines) == 2 and "kp-kread-ret" in lines[0] and "kp-xread-ret" in lines[1], r.explain(f"{lines}")
    k = re.search(r"task=(\d+) ret_addr=(\S+)$", lines[0]).groups()
    x = re.search(r"task=(\d+) ret_addr=(\S+) ip=(\S+) sp=(\S+)$", lines[1]).groups()
    assert k == x[:2] and x[1] == x[2], lines
    caller = kret["image"].function_at(int(k[1], 16))
    assert caller is not None and caller.name in ("do_syscall_64", "x64_sys_call"), (lines, caller)
    prof = r.profile()
    (kh, km), (xh, xm) = prof["r_ksys_read_0"], prof["r___x64_sys_read_0"]
    assert km == 0 and xm == 0 and kh >= xh > 0, prof

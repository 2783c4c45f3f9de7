"""kretprobes in Debian's arm64 kernel, booted (qemu-system-aarch64 -M virt -cpu max: pointer
authentication on, KASLR): the entry past the ftrace NOPs swaps x30 for our trampoline before the
function's paciasp signs it (arch_prepare_kretprobe()), so autiasp checks the swapped value and the
function returns to the trampoline, which runs the return handler and returns to the real address.
Handlers as for an arm64 module: entry_handler and data_size (ri->data), regs_return_value(),
regs->pc the real return address, get_kretprobe(ri); nested return-probed calls (ksys_write()
calling vfs_write()) return in order; maxactive 1 with two concurrent calls: nmissed; the
instance of a call that never returns (invoke_syscall() of exit_group) freed when the task exits;
the kernel's own kretprobe event on the same function in the same boot."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arm64_env  # noqa: E402
import kernel_env  # noqa: E402
from rewriter.targets.linux_kernel.aarch64 import image as arm_image  # noqa: E402

pytestmark = pytest.mark.kernel

HANDLER = r"""#include <linux/kprobes.h>
#include <linux/sched.h>

int getppid_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	*(unsigned long *)ri->data = regs->sp;
	return 0;
}

int getppid_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("kprewrite-kret: getppid ret=%ld pc=%lx sp-same=%d addr=%lx comm=%s pid=%d\n",
		(long)regs_return_value(regs), regs->pc, *(unsigned long *)ri->data == regs->sp,
		(unsigned long)get_kretprobe(ri)->kp.addr, current->comm, current->pid);
	return 0;
}

/* ksys_write() calls vfs_write(): nested instances, returns in order. */
int write_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	*(unsigned long *)ri->data = regs->regs[2];
	return regs->regs[2] != 7777;		/* only dd's write: no return handler for others */
}

int write_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("kprewrite-kret: %s count=%lu ret=%ld\n", get_kretprobe(ri)->kp.symbol_name,
		*(unsigned long *)ri->data, (long)regs_return_value(regs));
	return 0;
}

int sleep_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("kprewrite-kret: do_nanosleep ret=%ld nmissed=%d\n", (long)regs_return_value(regs),
		get_kretprobe(ri)->nmissed);
	return 0;
}

/* invoke_syscall() of exit_group never returns: the dead task's instance is freed at do_exit()
 * (maxactive 1: else the next task's calls would all miss). */
int exit_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	const char *c = current->comm;

	if (c[0] != 'k' || c[1] != 'r' || c[2] != 'e' || c[3] != 't' || c[4] != 'x')
		return 1;
	if (regs->regs[1] == 94)	/* __NR_exit_group */
		pr_info("kprewrite-kret: exit_group claimed\n");
	return 0;
}
"""
SPEC = """[[kretprobe]]
symbol_name = "__arm64_sys_getppid"
handler = "getppid_ret"
entry_handler = "getppid_entry"
data_size = 8
[[kretprobe]]
symbol_name = "ksys_write"
handler = "write_ret"
entry_handler = "write_entry"
data_size = 8
[[kretprobe]]
symbol_name = "vfs_write"
handler = "write_ret"
entry_handler = "write_entry"
data_size = 8
[[kretprobe]]
symbol_name = "do_nanosleep"
handler = "sleep_ret"
maxactive = 1
[[kretprobe]]
symbol_name = "invoke_syscall"
entry_handler = "exit_entry"
maxactive = 1
"""
INIT = ("grep -w -e invoke_syscall -e __arm64_sys_getppid -e __kretprobe_trampoline /proc/kallsyms\n"
        "for i in 1 2 3; do sh -c 'echo PPID=$PPID'; done\n"
        "dd if=/dev/zero of=/dev/null bs=7777 count=1 2>/dev/null\n"
        "sleep 1 & sleep 1 & wait\n"
        "usleep 10000\n"
        # comm "kretx": exit_entry() claims the instances of this program's system calls only.
        "ln -s /bin/busybox /tmp/kretx\n"
        "for i in 1 2 3; do /tmp/kretx true; done\n"
        # The kernel's own kretprobe event on a function whose entry we probe.
        "cd /sys/kernel/tracing\n"
        "echo 'r:kk __arm64_sys_getppid ret=$retval' > kprobe_events\n"
        "echo 1 > events/kprobes/kk/enable\n"
        "sh -c 'echo PPID2=$PPID'\n"
        "echo 0 > events/kprobes/kk/enable\n"
        "grep ' kk: ' trace\n"
        "echo KRET-DONE\n")
PACIASP = bytes.fromhex("3f2303d5")


_env = arm64_env.env


@pytest.fixture(scope="module")
def instrumented(arm64_kernel, tmp_path_factory):
    d = tmp_path_factory.mktemp("arm64-kret")
    (d / "h.c").write_text(HANDLER)
    spec = d / "probes.toml"
    spec.write_text('handlers = ["h.c"]\n' + SPEC)
    r = kprewrite("check", arm64_kernel.vmlinuz, "--spec", spec)
    lines = r.stdout.splitlines()
    assert [l.split("  returns:")[0] for l in lines] == [
        f"{f}+0x0  r  ftrace" for f in ("__arm64_sys_getppid", "ksys_write", "vfs_write", "do_nanosleep",
                                        "invoke_syscall")], r.stdout
    assert all(re.search(r"returns: trampoline  kretprobe_trampoline at 0x[0-9a-f]+: the return address is "
                         r"swapped at entry", l) for l in lines), r.stdout
    out = d / "Image.kp"
    kprewrite("instrument", arm64_kernel.vmlinuz, "--spec", spec, "-o", out)
    return out


def test_kretprobes_fire_with_pointer_authentication(arm64_kernel, instrumented, tmp_path_factory):
    img = arm_image.parse(arm64_kernel.vmlinuz.read_bytes(), str(arm64_kernel.vmlinuz))
    # The swap runs before paciasp: the instruction after the ftrace NOPs, where the jump goes
    # (its copy runs in the detour after the handlers), is the function's paciasp.
    for f in ("ksys_write", "vfs_write"):
        at = img.syms[f] + 8 - img.text
        assert img.data[at:at + 4] == PACIASP, f
        word = int.from_bytes(instrumented.read_bytes()[at:at + 4], "little")
        assert word >> 26 == 0b000101, f"{f}+8 is not a B"
    rd = _env(arm64_env.build_initramfs, kernel_env.init_script(INIT))
    log = tmp_path_factory.mktemp("boots") / "arm64-kret.console.txt"
    r = _env(lambda: arm64_env.boot(instrumented, rd, log=log))
    assert r.reached() and r.powered_off, r.explain("no clean boot to user space and power-off")
    assert not r.problems(), r.explain("kernel problems")
    assert arm64_env.WX_PASSED in r.console and "KRET-DONE" in r.console, r.explain("W+X check or /init")
    kall = {m.group(2): int(m.group(1), 16)
            for m in re.finditer(r"^([0-9a-f]{16}) [tT] (invoke_syscall|__arm64_sys_getppid|__kretprobe_trampoline)$",
                                       r.console, re.M)}
    assert len(kall) == 3, r.explain("no kallsyms lines")
    # getppid: the return value each shell printed (init's is 0), regs->pc the real return address
    # in invoke_syscall (not our trampoline), sp back at its value at the entry, kp.addr the entry
    # where the kernel runs (KASLR).  With the kernel's own kretprobe on the function (its entry
    # swapped x30 first), the address ours returns to is the kernel's trampoline.
    ours = re.compile(r"kprewrite-kret: getppid ret=(-?\d+) pc=([0-9a-f]+) sp-same=(\d) addr=([0-9a-f]+) "
                      r"comm=(\S+) pid=(\d+)")
    kk = r.console.index("PPID2=")
    rets, layered = ours.findall(r.console[:kk]), ours.findall(r.console[kk - 400:kk])
    assert len(rets) >= 4 and layered, r.explain("getppid's return handler")
    for ret, pc, same, addr, comm, pid in rets:
        assert same == "1" and int(addr, 16) == kall["__arm64_sys_getppid"], rets
        assert (0 < int(pc, 16) - kall["invoke_syscall"] < 0x100 if (ret, pc) != layered[-1][:2]
                else int(pc, 16) == kall["__kretprobe_trampoline"]), (pc, hex(kall["invoke_syscall"]))
    assert layered[-1][0] == "1" and int(layered[-1][1], 16) == kall["__kretprobe_trampoline"], layered
    assert [p for p in re.findall(r"^PPID=(\d+)", r.console, re.M)] == ["1"] * 3
    assert [ret for ret, *_, comm, _ in rets if comm == "sh"][:3] == ["1"] * 3, rets
    # Nested: vfs_write() returns inside ksys_write(), each with dd's count and result.
    assert re.findall(r"kprewrite-kret: (\w+) count=7777 ret=(\d+)", r.console) == [
        ("vfs_write", "7777"), ("ksys_write", "7777")], r.explain("nested returns")
    # maxactive 1: the second concurrent sleep found no instance (nmissed), and said so after.
    sleeps = re.findall(r"do_nanosleep ret=0 nmissed=(\d+)", r.console)
    assert len(sleeps) >= 2 and sleeps[0] == "1" and set(sleeps) == {"1"}, sleeps
    # A task's instance left by exit_group (never returning) is freed at do_exit(): every run
    # of the program claims it again (maxactive 1).
    assert r.console.count("kprewrite-kret: exit_group claimed") == 3, r.explain("instances of dead tasks")
    # The kernel's own kretprobe on __arm64_sys_getppid, ours on it too: both see the return.
    kk = re.findall(r" kk: \((\w+)\+0x[0-9a-f]+/0x[0-9a-f]+ <- __arm64_sys_getppid\) ret=(0x[0-9a-f]+)", r.console)
    assert kk and kk[-1] == ("invoke_syscall", "0x1"), r.explain("the kernel's kretprobe event saw no return")
    assert "PPID2=1" in r.console

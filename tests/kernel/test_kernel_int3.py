"""Breakpoint (INT3) probes in Debian's kernel: `optimize = false` makes every probe that is not
at an ftrace site an int3, handled through our hook on kprobe_int3_handler()'s ftrace site.  One
rewrite of Debian's vmlinuz and one boot (-smp 2, KASLR on) for the module:

- each out-of-line mode on kernel code the /init workload runs: an emulated call, jcc and jmp
  (the post_handler sees the branch's result), a boosted push with a pre_handler changing the
  path (kill(KILL_PID, 0) returns 0 without running __x64_sys_kill), a boosted RIP-relative
  `add $1, total_forks(%rip)` (the post_handler sees total_forks one higher), and a single-stepped
  `bt $0x20, %r12` (not boostable; the copy ends with an int3: CF after it is bit 32 of r12);
- an int3 probe hit on both CPUs at the same time (two shells pinned with taskset);
- the kernel's own tracefs kprobes (an int3 one inside kill_pid_info, kprobes-optimization off,
  and an ftrace one on __x64_sys_kill) firing in the same window as ours, with the same counts;
- exact hit counts (kprobe_profile at power-off) against the syscalls /init makes;
- a probe hit before the kernel's #BP handler exists: sched_clock_cpu() (notrace, an int3 site)
  runs for the first printk()'s timestamp, through the early IDT (our hook on
  early_idt_handler_common's call of do_early_exception()): the boot goes on, those hits run
  no handler (counted as "hits before"), and the pre_handler fires once the tables exist.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import capstone
import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

from kernel_env import KILL_OVERRIDE_C, assert_boot_ok, init_script, sections

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rewriter.elf.image import Image  # noqa: E402
from rewriter.targets import linux_kernel  # noqa: E402

pytestmark = pytest.mark.kernel

KILL_PID = 4243       # kill(KILL_PID, 0) succeeds: the pre_handler returns 0 for it
OVERRIDES = 20        # more of them, after the first
CONCURRENT = 300      # kill -0 1 per pinned shell
TRACED = 25           # kill -0 1 while the kernel's own kprobes are enabled
TRACING = "/sys/kernel/tracing"
DEBUGFS = "/sys/kernel/debug/kprewrite"

COMMANDS = f"""
kill -0 {KILL_PID}; echo "kill-status=$?"
ok=0; for i in $(seq {OVERRIDES}); do kill -0 {KILL_PID} 2>/dev/null && ok=$((ok + 1)); done; echo "kill-ok=$ok"
for i in 1 2 3; do /bin/true; done
taskset -c 0 sh -c 'for i in $(seq {CONCURRENT}); do kill -0 1; done' &
taskset -c 1 sh -c 'for i in $(seq {CONCURRENT}); do kill -0 1; done' &
wait
echo 0 > /proc/sys/debug/kprobes-optimization
echo 'p:kpneighbor kill_pid_info+NEIGHBOR_OFF' > {TRACING}/kprobe_events
echo 'p:kpentry __x64_sys_kill' >> {TRACING}/kprobe_events
echo 1 > {TRACING}/events/kprobes/enable
sync
for i in $(seq {TRACED}); do kill -0 1; done
sync
echo 0 > {TRACING}/events/kprobes/enable
echo "kpneighbor=$(grep -c ' kpneighbor: ' {TRACING}/trace)"
echo "kpentry=$(grep -c ' kpentry: ' {TRACING}/trace)"
sed 's/^/kplist: /' /sys/kernel/debug/kprobes/list
echo "== debugfs list"; cat {DEBUGFS}/list
echo "== debugfs enabled"; cat {DEBUGFS}/enabled
echo 0 > {DEBUGFS}/enabled; echo "enabled-now=$(cat {DEBUGFS}/enabled)"
kill -0 {KILL_PID} 2>/dev/null; echo "disarmed-kill=$?"
echo 1 > {DEBUGFS}/enabled; kill -0 {KILL_PID}; echo "armed-kill=$?"
echo "== debugfs profile"; cat {DEBUGFS}/profile
echo "== end"
"""
# The kernel command line's kprewrite.enabled=0: nothing fires until /init arms the probes.
DISARMED_COMMANDS = f"""
echo "enabled-at-boot=$(cat {DEBUGFS}/enabled)"
kill -0 {KILL_PID} 2>/dev/null; echo "disarmed-kill=$?"
echo "== debugfs profile"; cat {DEBUGFS}/profile
echo "== end"
echo 1 > {DEBUGFS}/enabled; kill -0 {KILL_PID}; echo "armed-kill=$?"
"""

HANDLERS = r"""
#include <linux/kprobes.h>

extern unsigned long total_forks;

static unsigned long n_ss, bad_ss, n_jcc, bad_jcc, n_call, bad_call, n_jmp, bad_jmp, n_rip, bad_rip, n_pc, bad_pc;
static unsigned long fork_before, cpu_hits[2], both, spins;
static int inside;

static inline int cpu(void)
{
	int c;
	__asm__ volatile("movl %%gs:cpu_number, %0" : "=r"(c));
	return c;
}

/* copy_process: `bt $0x20, %r12`, single-stepped; CF is bit 32 of r12 (unchanged by bt). */
static void bt_post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
	__atomic_fetch_add(&n_ss, 1, __ATOMIC_RELAXED);
	if ((regs->flags & 1) != ((regs->r12 >> 32) & 1) || regs->ip != (unsigned long)p->addr + BT_LEN)
		__atomic_fetch_add(&bad_ss, 1, __ATOMIC_RELAXED);
}

/* The jb after it, emulated: taken exactly when CF is set. */
static void jcc_post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
	unsigned long a = (unsigned long)p->addr;
	__atomic_fetch_add(&n_jcc, 1, __ATOMIC_RELAXED);
	if (regs->ip != ((regs->flags & 1) ? a + JCC_TARGET_OFF : a + JCC_LEN))
		__atomic_fetch_add(&bad_jcc, 1, __ATOMIC_RELAXED);
}

/* copy_process: `add $1, total_forks(%rip)`, boosted with its displacement moved to the slot. */
static int rip_pre(struct kprobe *p, struct pt_regs *regs)
{
	fork_before = total_forks;	/* under tasklist_lock: forks do not interleave here */
	return 0;
}

static void rip_post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
	n_rip++;
	if (total_forks != fork_before + 1)
		bad_rip++;
}

/* copy_process: `incq %gs:process_counts(%rip)`, a per-CPU counter through a RIP-relative
 * operand (a KASLR inverse relocation), boosted; irqs are off there (tasklist_lock). */
static unsigned long pc_before;

static inline unsigned long process_count(void)
{
	unsigned long v;
	__asm__ volatile("movq %%gs:process_counts, %0" : "=r"(v));
	return v;
}

static int pc_pre(struct kprobe *p, struct pt_regs *regs)
{
	pc_before = process_count();
	return 0;
}

static void pc_post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
	n_pc++;
	if (process_count() != pc_before + 1)
		bad_pc++;
}

/* __x64_sys_kill+5 (push %r12, boosted): kill(KILL_PID, 0) returns 0 at once (kernel_env.KILL_OVERRIDE_C). */
""" + KILL_OVERRIDE_C + r"""
/* __x64_sys_kill's call __task_pid_nr_ns, emulated: hit on both CPUs at once. */
static int call_pre(struct kprobe *p, struct pt_regs *regs)
{
	__atomic_fetch_add(&cpu_hits[cpu() & 1], 1, __ATOMIC_RELAXED);
	if (__atomic_add_fetch(&inside, 1, __ATOMIC_ACQ_REL) == 2) {
		__atomic_fetch_add(&both, 1, __ATOMIC_RELAXED);
	} else if (__atomic_load_n(&both, __ATOMIC_RELAXED) < 3 && __atomic_fetch_add(&spins, 1, __ATOMIC_RELAXED) < 400) {
		for (int i = 0; i < 200000 && __atomic_load_n(&inside, __ATOMIC_ACQUIRE) < 2; i++)
			__builtin_ia32_pause();
	}
	__atomic_fetch_sub(&inside, 1, __ATOMIC_ACQ_REL);
	return 0;
}

static void call_post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
	unsigned long a = (unsigned long)p->addr;
	__atomic_fetch_add(&n_call, 1, __ATOMIC_RELAXED);
	if (regs->ip != a + CALL_TARGET_OFF || *(unsigned long *)regs->sp != a + 5)
		__atomic_fetch_add(&bad_call, 1, __ATOMIC_RELAXED);
}

/* kill_something_info's jmp to its epilogue (pid > 0), emulated. */
static void jmp_post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
	__atomic_fetch_add(&n_jmp, 1, __ATOMIC_RELAXED);
	if (regs->ip != (unsigned long)p->addr + JMP_TARGET_OFF)
		__atomic_fetch_add(&bad_jmp, 1, __ATOMIC_RELAXED);
}

/* sched_clock_cpu+0 (push %rbp, boosted): hit from start_kernel()'s first printk() on, through the
 * early IDT before idt_setup_early_traps(); this runs only once the tables exist. */
static unsigned long n_sclock;

static int sclock_pre(struct kprobe *p, struct pt_regs *regs)
{
	__atomic_fetch_add(&n_sclock, 1, __ATOMIC_RELAXED);
	return 0;
}

/* sync(2): the counters so far. */
static int report(struct kprobe *p, struct pt_regs *regs)
{
	pr_info("kp-report: ss=%lu/%lu jcc=%lu/%lu rip=%lu/%lu pc=%lu/%lu call=%lu/%lu jmp=%lu/%lu cpu0=%lu cpu1=%lu both=%lu sclock=%lu\n",
		n_ss, bad_ss, n_jcc, bad_jcc, n_rip, bad_rip, n_pc, bad_pc, n_call, bad_call, n_jmp, bad_jmp,
		cpu_hits[0], cpu_hits[1], both, __atomic_load_n(&n_sclock, __ATOMIC_RELAXED));
	return 0;
}
"""



def _find(image, func: str, want) -> tuple[int, object]:
    """(offset, capstone insn) of the first instruction of func that `want` accepts."""
    f = next(f for f in image.functions if f.name == func)
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    for i in cs.disasm(image.read(f.start, f.end - f.start), f.start):
        if want(i):
            return i.address - f.start, i
    pytest.fail(f"no such instruction in {func}")


def _target(i) -> int:
    return int(i.op_str, 16)


@pytest.fixture(scope="module")
def probed(tmp_path_factory, debian_kernel):
    """The instructions found in this kernel's code, the spec, `check`'s modes, the rewritten vmlinuz."""
    d = tmp_path_factory.mktemp("int3")
    image = Image(str(debian_kernel.vmlinux))
    linux_kernel.load_symbols(image)
    ksym = {s.name: s.addr for s in image.kernel_symbols}       # kallsyms: data and per-CPU symbols too
    total_forks, process_counts = ksym["total_forks"], ksym["process_counts"]
    bt_off, bt = _find(image, "copy_process", lambda i: i.mnemonic == "bt" and i.op_str.endswith(", 0x20"))
    jcc_off, jcc = _find(image, "copy_process", lambda i: i.address == bt.address + bt.size)
    assert jcc.mnemonic == "jb", jcc
    rip_off, rip = _find(image, "copy_process", lambda i: i.mnemonic == "add" and "rip" in i.op_str and
                         i.address + i.size + int(i.op_str.split("+ ")[1].split("]")[0], 16) == total_forks)
    pc_off, _ = _find(image, "copy_process", lambda i: i.mnemonic == "inc" and i.op_str.startswith("qword ptr gs:[rip")
                      and (i.address + i.size + int(i.op_str.split("+ ")[1].split("]")[0], 16)) % 2**64 == process_counts)
    call_off, call = _find(image, "__x64_sys_kill", lambda i: i.mnemonic == "call" and
                           image.function_at(_target(i)).name == "__task_pid_nr_ns")
    # kill_something_info(sig, info, pid > 0): the jmp to its epilogue after kill_pid_info().
    ks_call, _ = _find(image, "kill_something_info", lambda i: i.mnemonic == "call" and
                       image.function_at(_target(i)).name == "kill_pid_info")
    jmp_off, jmp = _find(image, "kill_something_info", lambda i: i.mnemonic == "jmp" and
                         i.address > image.symbols["kill_something_info"][0] + ks_call and
                         image.function_at(_target(i)).name == "kill_something_info")
    neighbor, _ = _find(image, "kill_pid_info", lambda i: i.address > image.symbols["kill_pid_info"][0])
    (d / "int3_handlers.c").write_text(
        HANDLERS.replace("KILL_PID", str(KILL_PID)).replace("BT_LEN", str(bt.size)).replace("JCC_LEN", str(jcc.size))
        .replace("JCC_TARGET_OFF", f"{_target(jcc) - jcc.address:#x}UL")
        .replace("CALL_TARGET_OFF", f"{_target(call) - call.address:#x}UL")
        .replace("JMP_TARGET_OFF", f"{_target(jmp) - jmp.address:#x}UL"))
    probes = [("copy_process", bt_off, None, "bt_post", "single-step"),
              ("copy_process", jcc_off, None, "jcc_post", "emulate"),
              ("copy_process", rip_off, "rip_pre", "rip_post", "boost"),
              ("copy_process", pc_off, "pc_pre", "pc_post", "boost"),
              ("__x64_sys_kill", 5, "kill_override", None, "boost"),
              ("__x64_sys_kill", call_off, "call_pre", "call_post", "emulate"),
              ("kill_something_info", jmp_off, None, "jmp_post", "emulate"),
              ("__x64_sys_sync", 0, "report", None, None),
              ("sched_clock_cpu", 0, "sclock_pre", None, "boost")]
    spec = d / "probes.toml"
    spec.write_text('optimize = false\nhandlers = ["int3_handlers.c"]\n' + "".join(
        f'[[kprobe]]\nsymbol_name = "{f}"\noffset = {o:#x}\n'
        + (f'pre_handler = "{pre}"\n' if pre else "") + (f'post_handler = "{post}"\n' if post else "")
        for f, o, pre, post, _ in probes))
    r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec)
    lines = r.stdout.splitlines()
    for (f, o, _, _, mode), line in zip(probes, lines):
        if mode is None:
            assert line == f"{f}+{o:#x}  k  ftrace", line
        else:
            assert line.startswith(f"{f}+{o:#x}  k  int3  kprobes_optimization") and line.endswith(f"[{mode}]"), line
    # A bzImage, booted with KASLR on: the slots' copies carry their KASLR entries, and the
    # emulated targets and slots are found with the runtime's bias (the KASLR offset).
    out = d / "vmlinuz.kp"
    kprewrite("instrument", debian_kernel.vmlinuz, "--spec", spec, "-o", out)
    return {"dir": d, "spec": spec, "out": out, "neighbor": neighbor, "probes": probes,
            "hook": image.symbols["kprobe_int3_handler"][0]}


@pytest.fixture(scope="module")
def booted(probed, make_initramfs, boot_kernel):
    initrd = make_initramfs(init_script(COMMANDS.replace("NEIGHBOR_OFF", f"{probed['neighbor']:#x}")))
    return boot_kernel("int3-bzimage-smp2", probed["out"], initrd, smp=2, timeout=240)


def _reports(r) -> list[dict[str, tuple[int, ...]]]:
    out = []
    for m in re.finditer(r"kp-report: (.*)$", r.console, re.M):
        out.append({k: tuple(int(x) for x in v.split("/")) for k, v in (kv.split("=") for kv in m.group(1).split())})
    return out



def test_boots_and_every_mode_runs_right(booted):
    """No oops/BUG/WARNING (a wrong emulation or relocation in copy_process or kill would show),
    and each handler saw its instruction's effect on every hit."""
    r = booted
    assert_boot_ok(r)
    reps = _reports(r)
    # sync before and after the traced window, and poweroff's own
    assert len(reps) == 3, r.explain("three kp-report lines (sync(2) calls)")
    last = reps[-1]
    for k in ("ss", "jcc", "rip", "pc", "call", "jmp"):
        n, bad = last[k]
        assert n > 0 and bad == 0, r.explain(f"{k}: {n} hits, {bad} wrong")
    # Every fork runs the first three; process_counts counts new thread-group leaders only.
    assert last["ss"][0] == last["jcc"][0] == last["rip"][0] >= last["pc"][0], last


def test_a_pre_handler_changing_the_path(booted):
    r = booted
    assert re.search(r"^kill-status=0$", r.console, re.M), r.explain("kill -0 of no process should succeed")
    assert re.search(rf"^kill-ok={OVERRIDES}$", r.console, re.M), r.explain(f"{OVERRIDES} overridden kills")


def test_a_probe_hit_before_the_kernels_int3_handler(booted):
    """sched_clock_cpu+0, an int3, hit by start_kernel()'s first printk() before
    idt_setup_early_traps(): the early IDT used to halt there (a hang before the console).
    Now those hits run the instruction and no handler ("hits before" at setup_per_cpu_areas),
    and the pre_handler fires on every later hit (the profile counts them)."""
    r = booted
    m = re.search(r"kprewrite: built the tables of \d+ probes at setup_per_cpu_areas .*; "
                  r"(\d+) hits before ran no handler", r.console)
    assert m and int(m.group(1)) > 0, r.explain("no early hits counted before the tables")
    last = _reports(r)[-1]
    assert last["sclock"][0] > 100, last        # the scheduler's clock, on every tick and switch
    hits, missed = r.profile()["p_sched_clock_cpu_0"]
    assert hits >= last["sclock"][0], (hits, last)


def test_an_int3_probe_hit_on_both_cpus_at_once(booted):
    last = _reports(booted)[-1]
    assert last["cpu0"][0] >= CONCURRENT and last["cpu1"][0] >= CONCURRENT, last
    assert last["both"][0] > 0, booted.explain(f"the handler never ran on both CPUs at once: {last}")


def test_the_kernels_own_kprobes_fire_next_to_ours(booted, probed):
    """tracefs kprobes: an int3 one (optimization off) inside kill_pid_info, which
    kill_something_info calls, and an ftrace one on __x64_sys_kill; each fired once per kill in
    the window, as our jmp probe in kill_something_info did."""
    r = booted
    assert re.search(rf"^kpneighbor={TRACED}$", r.console, re.M), r.explain(f"{TRACED} kpneighbor events")
    assert re.search(rf"^kpentry={TRACED}$", r.console, re.M), r.explain(f"{TRACED} kpentry events")
    kplist = [l for l in r.lines() if l.startswith("kplist: ")]
    assert any("kill_pid_info+" in l and "[OPTIMIZED]" not in l for l in kplist), kplist
    assert any("__x64_sys_kill+0x0" in l and "[FTRACE]" in l for l in kplist), kplist
    before, after, _ = _reports(r)
    assert after["jmp"][0] - before["jmp"][0] == TRACED, (before, after)


def test_hit_counts_are_exact(booted, probed):
    """kprobe_profile at power-off against the kills /init made."""
    rows = booted.profile()
    p = {f"{f}+{o:#x}": rows[f"p_{f}_{o}"] for f, o, *_ in probed["probes"]}
    # The kill made while disarmed (debugfs enabled = 0) is not counted; the one after, overridden, is.
    kills = 1 + OVERRIDES + 2 * CONCURRENT + TRACED + 1
    assert p["__x64_sys_kill+0x5"] == (kills, 0), rows
    call = [k for k in p if k.startswith("__x64_sys_kill+") and k != "__x64_sys_kill+0x5"][0]
    assert p[call] == (kills - 2 - OVERRIDES, 0), rows
    jmp = [k for k in p if k.startswith("kill_something_info+")][0]
    assert p[jmp] == (2 * CONCURRENT + TRACED, 0), rows
    last = _reports(booted)[-1]
    assert p[call][0] == last["call"][0] == last["cpu0"][0] + last["cpu1"][0], (rows, last)


def test_list_shows_the_modes(probed):
    lines = kprewrite("list", probed["out"]).stdout.splitlines()
    want = {"single-step": "SINGLESTEP", "emulate": "EMULATED", "boost": "BOOSTED", None: "FTRACE"}
    for f, o, _, _, mode in probed["probes"]:
        assert any(re.fullmatch(rf"[0-9a-f]{{16}}  k  {f}\+{o:#x} \[{want[mode]}\]", l) for l in lines), (f, lines)


def test_the_int3_hook_is_a_call_on_kprobe_int3_handlers_ftrace_site(probed, debian_kernel):
    """kprobe_int3_handler()'s ftrace site calls our hook, do_int3()'s calls of it call the hook's
    C half, and `diff` names them (nothing unattributed)."""
    out = probed["dir"] / "vmlinux.kp"       # diff reads a vmlinux (a bzImage's is re-laid when written)
    kprewrite("instrument", debian_kernel.vmlinux, "--spec", probed["spec"], "-o", out)
    code = Image(str(out)).read(probed["hook"], 5)
    assert code[0] == 0xE8, code.hex()
    doc = json.loads(kprewrite("diff", debian_kernel.vmlinux, out, "--format", "json").stdout)
    assert doc["unattributed"] == [], doc["unattributed"]
    assert any("the int3 hook" in c["detail"] and c["address"] == hex(probed["hook"]) for c in doc["changes"]), \
        [c for c in doc["changes"] if c["what"] == "target"]
    # do_int3()'s own calls (and its copies inlined into exc_int3()) call the hook's C half directly.
    direct = [c["detail"] for c in doc["changes"] if "call kp_arch_int3_bp, not kprobe_int3_handler" in c["detail"]]
    assert any(d.startswith("do_int3+") for d in direct), direct
    # early_idt_handler_common's call of do_early_exception() calls our early #BP entry.
    assert any(c["detail"].startswith("early_idt_handler_common+") and "call kp_kernel_early_exception" in c["detail"]
               for c in doc["changes"]), [c for c in doc["changes"] if c["what"] == "target"]


def test_debugfs_views(booted, probed):
    """kprewrite/list, enabled and profile in debugfs, read and written from /init: writing 0
    disarms every probe (kill(KILL_PID, 0) fails again, its int3 still runs the instruction), 1
    arms them again."""
    r = booted
    sec = sections(r.console)
    listed = sec["debugfs list"]
    want = {"single-step": "SINGLESTEP", "emulate": "EMULATED", "boost": "BOOSTED", None: "FTRACE"}
    for f, o, _, _, mode in probed["probes"]:
        assert any(re.fullmatch(rf"[0-9a-f]{{16}}  k  {f}\+{o:#x}    \[{want[mode]}\]", l) for l in listed), (f, listed)
    assert any(re.fullmatch(r"[0-9a-f]{16}  k  setup_per_cpu_areas\+0x0    \[FTRACE\]", l) for l in listed), listed
    assert sec["debugfs enabled"][0] == "1", sec["debugfs enabled"]
    assert re.search(r"^enabled-now=0$", r.console, re.M)
    assert re.search(r"^disarmed-kill=1$", r.console, re.M), r.explain("a disarmed probe changed the path")
    assert re.search(r"^armed-kill=0$", r.console, re.M), r.explain("armed again, the probe should change the path")
    rows = {}
    for l in sec["debugfs profile"]:
        m = re.fullmatch(r"  (\S+) +(\d+) +(\d+)", l)
        assert m, l
        rows[m.group(1)] = int(m.group(2)), int(m.group(3))
    assert rows["p___x64_sys_kill_5"] == (1 + OVERRIDES + 2 * CONCURRENT + TRACED + 1, 0), rows
    assert rows["kprewrite_setup_per_cpu_areas"] == (1, 0), rows


def test_kernel_command_line_disarms_every_probe(probed, make_initramfs, boot_kernel):
    """kprewrite.enabled=0: the boot hooks still keep our pages (W+X check passes), no probe of the
    spec fires (no copy_process hit in the profile, though the kernel forked), until /init arms them."""
    initrd = make_initramfs(init_script(DISARMED_COMMANDS))
    r = boot_kernel("int3-bzimage-disarmed", probed["out"], initrd, smp=2, timeout=180,
                    extra_append="kprewrite.enabled=0")
    assert_boot_ok(r)
    assert "kprewrite: kprewrite.enabled=0: every probe disarmed" in r.console, r.explain("no disarm line")
    assert re.search(r"^enabled-at-boot=0$", r.console, re.M), r.explain("enabled should read 0")
    assert re.search(r"^disarmed-kill=1$", r.console, re.M), r.explain("a disarmed probe changed the path")
    assert re.search(r"^armed-kill=0$", r.console, re.M), r.explain("armed, the probe should change the path")
    rows = {}
    for l in sections(r.console)["debugfs profile"]:
        m = re.fullmatch(r"  (\S+) +(\d+) +(\d+)", l)
        rows[m.group(1)] = int(m.group(2)), int(m.group(3))
    bt = f"p_copy_process_{probed['probes'][0][1]}"
    assert rows[bt] == (0, 0) and rows["p___x64_sys_kill_5"] == (0, 0), rows   # cat was forked, kill made
    assert rows["kprewrite_free_kernel_image_pages"][0] >= 2, rows


# --- a breakpoint on every instruction of real functions, against the kernel's own kprobes ---------

EVERY = ("__x64_sys_kill", "kill_something_info", "__kill_pgrp_info")
# Only /init makes these calls (kill(2)): kill(1, 0) (kill_pid_info), kill(0, 0) in a new
# session (__kill_pgrp_info's loop over one process), kill(999, 0) (ESRCH).
WORKLOAD = """
for i in $(seq 10); do kill -0 1; done
setsid sh -c 'for i in $(seq 7); do kill -0 0; done'
for i in $(seq 3); do kill -0 999 2>/dev/null; done
"""
OURS = f"""
cat {DEBUGFS}/profile > /tmp/before
{WORKLOAD}
cat {DEBUGFS}/profile > /tmp/after
echo "== before"; cat /tmp/before; echo "== after"; cat /tmp/after; echo "== end"
"""


def _profile_rows(lines) -> dict[str, tuple[int, int]]:
    rows = {}
    for l in lines:
        m = re.fullmatch(r"\s*(\S+) +(\d+) +(\d+)", l)
        if m:
            rows[m.group(1)] = int(m.group(2)), int(m.group(3))
    return rows


@pytest.fixture(scope="module")
def every(tmp_path_factory, debian_kernel):
    """Every instruction of EVERY but the entry (an ftrace site) as an int3 probe (--no-optimize);
    the ones refused (return thunks, paravirt calls: sites patched at boot) left out."""
    d = tmp_path_factory.mktemp("int3-every")
    image = Image(str(debian_kernel.vmlinux))
    linux_kernel.load_symbols(image)
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    probes = []
    for name in EVERY:
        f = next(f for f in image.functions if f.name == name)
        probes += [(name, i.address - f.start) for i in cs.disasm(image.read(f.start, f.end - f.start), f.start)
                   if i.address > f.start]
    spec = d / "every.toml"

    def write(ps):      # no `optimize = false` here: --no-optimize on the command line does the same
        spec.write_text("".join(f'[[kprobe]]\nsymbol_name = "{n}"\noffset = {o:#x}\n' for n, o in ps))
    write(probes)
    r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec, "--no-optimize", check=False)
    lines = r.stdout.splitlines()
    assert len(lines) == len(probes)
    decision = [l.split("  ")[2].split()[0] for l in lines]
    assert set(decision) == {"int3", "refused"}, lines
    probes = [p for p, d in zip(probes, decision) if d == "int3"]
    write(probes)
    out = d / "vmlinux.kp"
    kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "--no-optimize", "-o", out)
    return {"out": out, "probes": probes}


def test_every_instruction_hit_counts_match_the_kernels_own_kprobes(every, debian_kernel, make_initramfs,
                                                                     boot_kernel):
    """The same probes as tracefs kprobe_events on the unmodified kernel, the same /init workload:
    per-probe hit counts equal (kprobe_profile), and the rewritten kernel behaves the same."""
    probes = every["probes"]
    assert len(probes) > 150, len(probes)
    r = boot_kernel("int3-every-vmlinux", every["out"], make_initramfs(init_script(OURS)), smp=2, timeout=180)
    assert_boot_ok(r)
    sec = sections(r.console)
    before, after = _profile_rows(sec["before"]), _profile_rows(sec["after"])
    ours = {f"{n}+{o}": after[f"p_{n}_{o}"][0] - before[f"p_{n}_{o}"][0] for n, o in probes}
    assert all(after[f"p_{n}_{o}"][1] == 0 for n, o in probes), after
    events = "".join(f"echo 'p:o_{n}_{o} {n}+{o:#x}' >> {TRACING}/kprobe_events\n" for n, o in probes)
    oracle = (f"{events}echo 1 > {TRACING}/events/kprobes/enable\n{WORKLOAD}"
              f"echo 0 > {TRACING}/events/kprobes/enable\necho '== oracle'; cat {TRACING}/kprobe_profile\necho '== end'\n")
    o = boot_kernel("int3-every-oracle", debian_kernel.vmlinux, make_initramfs(init_script(oracle)), smp=2, timeout=180)
    assert_boot_ok(o)
    rows = _profile_rows(sections(o.console)["oracle"])
    theirs = {f"{n}+{o_}": rows[f"o_{n}_{o_}"][0] for n, o_ in probes if f"o_{n}_{o_}" in rows}
    assert len(theirs) >= 0.9 * len(probes), (len(theirs), len(probes))
    diff = {k: (ours[k], v) for k, v in theirs.items() if ours[k] != v}
    assert not diff, diff
    hit = sum(1 for v in ours.values() if v)
    assert hit > 100 and max(ours.values()) >= 10, ours
    print(f"\nevery instruction: {len(probes)} int3 probes, {len(theirs)} compared with the kernel's own, "
          f"{hit} hit")


# --- a hit of ours inside a handler of ours: missed (kprobes_inc_nmissed_count()) ------------------

NEST_KILLS = 10
NEST_HANDLERS = r"""
#include <linux/kprobes.h>

/* The outer probe's pre_handler calls ktime_get(), where two more int3 probes of ours sit. */
int nest_outer(struct kprobe *p, struct pt_regs *regs)
{
	(void)p; (void)regs;
	return ktime_get() == 0;	/* never: 0, run the instruction */
}
"""


def test_a_hit_inside_a_handler_counts_as_missed(tmp_path, debian_kernel, make_initramfs, boot_kernel):
    """An int3 probe's pre_handler (on __x64_sys_kill+5, boosted) calls ktime_get(), which has two
    int3 probes of ours: each of their hits from inside it counts in nmissed and runs only its
    instruction (the kernel's kprobe_int3_handler() with kprobe_running()); the kills go on."""
    (tmp_path / "nest.c").write_text(NEST_HANDLERS)
    spec = tmp_path / "nest.toml"
    inner = (0xB, 0x13)       # push %r12, xor %r12d,%r12d: boosted
    spec.write_text('optimize = false\nhandlers = ["nest.c"]\n'
                    '[[kprobe]]\nsymbol_name = "__x64_sys_kill"\noffset = 5\npre_handler = "nest_outer"\n'
                    + "".join(f'[[kprobe]]\nsymbol_name = "ktime_get"\noffset = {o:#x}\n' for o in inner))
    lines = kprewrite("check", debian_kernel.vmlinux, "--spec", spec).stdout.splitlines()
    assert all("  k  int3  " in l for l in lines), lines
    out = tmp_path / "vmlinux.kp"
    kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "-o", out)
    commands = (f"cat {DEBUGFS}/profile > /tmp/before\n"
                f"for i in $(seq {NEST_KILLS}); do kill -0 1; done; echo \"kill-status=$?\"\n"
                f"cat {DEBUGFS}/profile > /tmp/after\n"
                'echo "== before"; cat /tmp/before; echo "== after"; cat /tmp/after; echo "== end"\n')
    r = boot_kernel("int3-nested-vmlinux", out, make_initramfs(init_script(commands)), smp=2, timeout=180)
    assert_boot_ok(r)
    assert re.search(r"^kill-status=0$", r.console, re.M), r.explain("kill -0 1 should succeed")
    sec = sections(r.console)
    before, after = _profile_rows(sec["before"]), _profile_rows(sec["after"])
    delta = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}
    assert delta["p___x64_sys_kill_5"] == (NEST_KILLS, 0), delta
    for o in inner:
        hits, missed = delta[f"p_ktime_get_{o}"]
        assert missed == NEST_KILLS, (o, delta)     # every call from the handler; none counted as a hit

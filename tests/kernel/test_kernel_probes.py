"""The first end-to-end kernel probes: `instrument` on Debian's stripped vmlinux writes a vmlinux
that boots under qemu-system-x86_64 -smp 2 with no boot parameter, and whose probes fire with C
handlers printing through the kernel's printk: the kernel's kprobe_example handlers on
kernel_clone (an ftrace site), a handler on do_sys_openat2's ftrace site reading the file name
from regs->si with the kernel's strncpy_from_user_nofault(), and a jump-optimized probe inside
do_sys_openat2 reading the registers the function copied its arguments to.  One rewrite and one
boot are shared by the tests of this module."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import capstone
import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

from kernel_env import DEFAULT_APPEND, DONE_MARKER, KILL_OVERRIDE_C, WX_PASSED, assert_boot_ok, init_script

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rewriter.elf.image import Image  # noqa: E402
from rewriter.targets import linux_kernel  # noqa: E402
from rewriter.targets.linux_kernel import sites as ks  # noqa: E402
from rewriter.targets.linux_kernel.symbols import kernel  # noqa: E402

pytestmark = pytest.mark.kernel

FORKS = 4                                   # /bin/true runs /init makes between the markers
OPEN_FILE = "/etc/kprewrite-hello"          # a file only /init opens
KILL_PID = 4242                             # kill(KILL_PID, 0) succeeds: a pre_handler returns 0 for it
KILLS = 500                                 # path changes in a row, interrupts arriving among them

# /dev/kmsg puts the markers in the kernel log, in order with the handlers' printk lines.
# The record echoed from dmesg is renamed (kp_open-...) so that no count of the handlers'
# lines takes it, whole or cut in two by a kernel message that runs into it under load.
COMMANDS = f"""
echo LOOP-START > /dev/kmsg
for i in {' '.join(str(i) for i in range(FORKS))}; do /bin/true; done
echo LOOP-END > /dev/kmsg
cat {OPEN_FILE} > /dev/null & echo "cat-pid=$!" > /dev/kmsg; wait
kill -0 {KILL_PID}; echo "kill-status=$?"
ok=0; for i in $(seq {KILLS}); do kill -0 {KILL_PID} 2>/dev/null && ok=$((ok + 1)); done; echo "kill-ok=$ok"
dmesg -r | grep -m1 'kp-open-entry: ' | sed 's/^/raw: /; s/kp-open/kp_open/'
echo {DONE_MARKER}
sleep 1
"""
# The sleep: /init's output drains through the serial line after the fact, and the
# `poweroff -f` that follows init_script()'s own DONE line can cut the last lines.

OPEN_HANDLERS = r"""
#include <linux/kprobes.h>
#include <linux/sched.h>	/* struct task_struct and current, from the image's BTF */
#include <linux/preempt.h>

/* The kernel's own: a NUL-terminated string from user space, never faults. */
long strncpy_from_user_nofault(char *dst, const void __user *unsafe_addr, long count);

static void print_name(const char *what, int dfd, unsigned long user_name)
{
	char name[64];
	long n = strncpy_from_user_nofault(name, (const void __user *)user_name, sizeof(name) - 1);
	name[n > 0 ? n : 0] = 0;
	pr_info("%s: dfd=%d name=%s\n", what, dfd, n > 0 ? name : "(fault)");
	if (n > 0 && __builtin_strcmp(name, "OPEN_FILE") == 0)
		pr_info("%s-task: comm=%s pid=%d\n", what, current->comm, current->pid);
}

/* Reentrancy: open_entry() calls ktime_get(), which has a probe too.  That hit is on the
 * same CPU while a handler runs, so it must count as missed and run no handler; hits
 * elsewhere (timers, other CPUs: their own stacks) run it. */
static unsigned long open_frame;	/* open_entry()'s frame while it calls ktime_get() */
static unsigned long ktime_hits;

static int ktime_hit(struct kprobe *p, struct pt_regs *regs)
{
	unsigned long frame = __atomic_load_n(&open_frame, __ATOMIC_RELAXED);
	if (frame && regs->sp < frame && regs->sp > frame - 8192)
		pr_info("kp-nested: a handler ran inside open_entry\n");
	__atomic_fetch_add(&ktime_hits, 1, __ATOMIC_RELAXED);
	return 0;
}

/* __x64_sys_kill(const struct pt_regs *user): kill(KILL_PID, 0) returns 0 at once (kernel_env.KILL_OVERRIDE_C), as
 * the kernel's override_function_with_return() does (a pre_handler changing the path). */
""" + KILL_OVERRIDE_C + r"""
/* do_sys_openat2(int dfd, const char __user *filename, struct open_how *how), at its entry. */
static int open_entry(struct kprobe *p, struct pt_regs *regs)
{
	__atomic_store_n(&open_frame, (unsigned long)__builtin_frame_address(0), __ATOMIC_RELAXED);
	ktime_get();
	__atomic_store_n(&open_frame, 0, __ATOMIC_RELAXED);
	print_name("kp-open-entry", (int)regs->di, regs->si);
	pr_info("kp-open-entry-preempt: %d\n", preempt_count());
	pr_info("kp-ktime-hits: %lu\n", __atomic_load_n(&ktime_hits, __ATOMIC_RELAXED));
	return 0;
}

/* __x64_sys_openat's entry: a handler that never reads regs gets a clean call (no
 * struct pt_regs built, kp_optprobe_clean_entry). */
static int openat_seen(struct kprobe *p, struct pt_regs *regs)
{
	/* optimized_callback() runs handlers with preemption disabled: so does the template. */
	pr_info("kp-openat-clean: %s preempt=%d\n", p->symbol_name, preempt_count());
	return 0;
}

/* setup_per_cpu_areas(), whose site the runtime's boot hook that builds the probe
 * tables shares: it runs before them, from the structures written whole. */
static int percpu_setup_seen(struct kprobe *p, struct pt_regs *regs)
{
	pr_info("kp-percpu-setup: %s %s\n", p->symbol_name, p->name);
	return 0;
}

/* setup_arch() runs before the tables are built: its hit runs no handler. */
static int too_early(struct kprobe *p, struct pt_regs *regs)
{
	pr_info("kp-too-early\n");
	return 0;
}

/* Inside it, once the arguments sit in the registers the function moved them to. */
static int open_inside(struct kprobe *p, struct pt_regs *regs)
{
	print_name("kp-open-inside", (int)regs->DFD_REG, regs->NAME_REG);
	return 0;
}
"""

# capstone's 64/32-bit register names -> struct pt_regs fields.
PT_REGS = {**{f"r{i}": f"r{i}" for i in range(8, 16)}, **{f"r{i}d": f"r{i}" for i in range(8, 16)},
           "rbx": "bx", "ebx": "bx", "rbp": "bp", "ebp": "bp"}



def inside_probe(image) -> tuple[int, str, str]:
    """(offset, pt_regs field holding filename, field holding dfd) for a probe inside
    do_sys_openat2, right after it copied both arguments to callee-saved registers."""
    f = next(f for f in image.functions if f.name == "do_sys_openat2")
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    name_reg = dfd_reg = None
    for insn in cs.disasm(image.read(f.start, min(64, f.end - f.start)), f.start):
        ops = [o.strip() for o in insn.op_str.split(",")]
        if insn.mnemonic == "mov" and len(ops) == 2 and ops[0] in PT_REGS:
            if ops[1] == "rsi" and name_reg is None:
                name_reg = PT_REGS[ops[0]]
            elif ops[1] == "edi" and dfd_reg is None:
                dfd_reg = PT_REGS[ops[0]]
        if name_reg and dfd_reg:
            return insn.address + insn.size - f.start, name_reg, dfd_reg
    pytest.fail("do_sys_openat2 does not copy filename and dfd to callee-saved registers in its first 64 bytes")


@pytest.fixture(scope="module")
def probed(tmp_path_factory, debian_kernel):
    """The spec, its handlers and the rewritten vmlinux."""
    d = tmp_path_factory.mktemp("kprobes")
    image = Image(str(debian_kernel.vmlinux))
    linux_kernel.load_symbols(image)
    off, name_reg, dfd_reg = inside_probe(image)
    (d / "open_handlers.c").write_text(OPEN_HANDLERS.replace("NAME_REG", name_reg).replace("DFD_REG", dfd_reg)
                                       .replace("KILL_PID", str(KILL_PID)).replace("OPEN_FILE", OPEN_FILE))
    sample = ROOT / "samples" / "kprobe_example" / "handlers.c"
    spec = d / "probes.toml"
    spec.write_text(f'handlers = ["{sample}", "open_handlers.c"]\n'
                    '[[kprobe]]\nsymbol_name = "kernel_clone"\npre_handler = "handler_pre"\npost_handler = "handler_post"\n'
                    '[[kprobe]]\nsymbol_name = "do_sys_openat2"\npre_handler = "open_entry"\n'
                    f'[[kprobe]]\nsymbol_name = "do_sys_openat2"\noffset = {off:#x}\npre_handler = "open_inside"\n'
                    '[[kprobe]]\nsymbol_name = "ktime_get"\npre_handler = "ktime_hit"\n'
                    '[[kprobe]]\nsymbol_name = "__x64_sys_kill"\npre_handler = "kill_override"\n'
                    '[[kprobe]]\nsymbol_name = "__x64_sys_openat"\npre_handler = "openat_seen"\n'
                    '[[kprobe]]\nsymbol_name = "setup_per_cpu_areas"\npre_handler = "percpu_setup_seen"\n'
                    '[[kprobe]]\nsymbol_name = "setup_arch"\npre_handler = "too_early"\n')
    r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec)
    assert r.stdout.splitlines() == ["kernel_clone+0x0  k  ftrace", "do_sys_openat2+0x0  k  ftrace",
                                     f"do_sys_openat2+{off:#x}  k  optimized", "ktime_get+0x0  k  ftrace",
                                     "__x64_sys_kill+0x0  k  ftrace", "__x64_sys_openat+0x0  k  ftrace",
                                     "setup_per_cpu_areas+0x0  k  ftrace", "setup_arch+0x0  k  ftrace"], r.stdout
    out = d / "vmlinux.kp"
    kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "-o", out)
    lay = linux_kernel.plan_layout(image)
    return {"dir": d, "spec": spec, "out": out, "offset": off, "regs": (name_reg, dfd_reg),
            "kernel_clone": image.symbols["kernel_clone"][0], "gap": (lay.rx_vaddr, lay.end),
            "data_gap": (lay.data_vaddr, lay.data_end)}


@pytest.fixture(scope="module")
def probed_boot(probed, make_initramfs, boot_kernel):
    initrd = make_initramfs(init_script(COMMANDS), {OPEN_FILE: "hello\n"})
    return boot_kernel("probed-vmlinux-smp2", probed["out"], initrd, smp=2, timeout=120)


def test_boots_with_no_boot_parameter(probed_boot, probed):
    """User space after mark_rodata_ro(), /init done, the kernel's W+X check passed, no
    oops/BUG/WARNING (ftrace's included), clean power-off; our pages kept, the rest freed."""
    r = probed_boot
    assert_boot_ok(r)
    assert r.cmd[r.cmd.index("-append") + 1] == DEFAULT_APPEND, r.cmd     # none of ours
    kept = {}
    for gap, what, start, end in (("text/rodata", "code", *probed["gap"]), ("rodata/data", "data", *probed["data_gap"])):
        m = re.search(rf"kprewrite: kept (\w+)\.\.(\w+) of the {gap} gap: {what} (\d+) KiB", r.console)
        assert m, r.explain(f"no line from the free_kernel_image_pages boot hook for the {gap} gap")
        freed = re.search(rf"Freeing unused kernel image \({gap} gap\) memory: (\d+)K", r.console)
        assert int(m.group(1), 16) == start
        assert freed and int(freed.group(1)) == ((end - start) >> 10) - int(m.group(3)), \
            r.explain(f"the {gap} gap freed is not the gap minus our pages")
        kept[what] = m.group(3)
    print(f"\nprobed vmlinux: boot to power-off {r.seconds:.2f} s ({r.accel}, -smp 2); kept "
          f"{kept['code']} KiB code of the text/rodata gap, {kept['data']} KiB data of the rodata/data gap")


def test_kprobe_example_on_kernel_clone(probed_boot, probed):
    """The kernel sample's handlers, unchanged: one handler_pre and one handler_post per fork,
    from early boot on, and after mark_rodata_ro() exactly one pair per fork /init makes."""
    r = probed_boot
    lines = r.lines()
    wx = next(n for n, l in enumerate(lines) if WX_PASSED in l)
    assert any("handler_pre: <kernel_clone>" in l for l in lines[:wx]), r.explain("no hit before mark_rodata_ro()")
    loop = r.lines_between("LOOP-START", "LOOP-END")
    pre = [l for l in loop if "handler_pre: <kernel_clone>" in l]
    post = [l for l in loop if "handler_post: <kernel_clone>" in l]
    assert len(pre) == FORKS and len(post) == FORKS, r.explain(f"{FORKS} forks between the markers")
    # As in the kernel: p->addr is the probed address, ip is addr + 1 (as if an int3 had trapped).
    addr = probed["kernel_clone"]
    assert re.search(rf"handler_pre: <kernel_clone> p->addr = 0x{addr:016x}, ip = {addr + 1:x}, "
                     r"flags = 0x[0-9a-f]+$", pre[0]), pre[0]
    assert re.search(rf"handler_post: <kernel_clone> p->addr = 0x{addr:016x}, flags = 0x[0-9a-f]+$", post[0]), post[0]


def test_ftrace_site_probe_reads_the_file_name(probed_boot):
    """do_sys_openat2's ftrace site: regs->si is the user's file name and regs->di the dfd."""
    r = probed_boot
    assert re.search(rf"kp-open-entry: dfd=-100 name={re.escape(OPEN_FILE)}$", r.console, re.M), \
        r.explain(f"no kp-open-entry line for {OPEN_FILE}")
    # pr_info()'s level reaches the kernel's log (dmesg -r: <6> is KERN_INFO).
    assert re.search(r"^raw: <6>\[ *[\d.]+\] kp_open-entry: ", r.console, re.M), r.explain("no KERN_INFO record")


def test_handlers_read_current_from_the_images_btf(probed_boot):
    """current->comm and current->pid, with struct task_struct from the image's own BTF: the
    task that opened the file is the `cat` /init started, with the pid the shell reported."""
    r = probed_boot
    pid = re.search(r"\] cat-pid=(\d+)$", r.console, re.M)     # through /dev/kmsg: a whole log line
    assert pid, r.explain("/init did not report cat's pid")
    for what in ("kp-open-entry", "kp-open-inside"):
        assert re.search(rf"{what}-task: comm=cat pid={pid.group(1)}$", r.console, re.M), \
            r.explain(f"no {what}-task line naming cat and its pid {pid.group(1)}")


def test_optimized_probe_inside_the_function_reads_registers(probed_boot, probed):
    """A jump-optimized probe inside do_sys_openat2 sees the registers the function moved its
    arguments to (the same name and dfd as at the entry)."""
    r = probed_boot
    assert re.search(rf"kp-open-inside: dfd=-100 name={re.escape(OPEN_FILE)}$", r.console, re.M), \
        r.explain(f"no kp-open-inside line for {OPEN_FILE} (regs {probed['regs']})")
    log = r.lines()
    entry = [l.split("kp-open-entry: ")[1] for l in log if "kp-open-entry: " in l]
    inside = [l.split("kp-open-inside: ")[1] for l in log if "kp-open-inside: " in l]
    # The same opens, each as often (two CPUs: concurrent opens' lines may interleave in either order).
    assert sorted(entry) == sorted(inside) and len(entry) > 3, r.explain("the entry and the inside probe saw different opens")


def test_a_hit_inside_a_handler_on_the_same_cpu_is_missed(probed_boot):
    """ktime_get()'s probe fires all the time, but never inside open_entry(), which calls
    ktime_get() on the CPU its own dispatch holds (preemption is disabled there)."""
    r = probed_boot
    hits = [int(l.split("kp-ktime-hits: ")[1]) for l in r.lines() if "kp-ktime-hits: " in l]
    assert len(hits) > 3 and hits[-1] > hits[0] > 0, r.explain("ktime_get()'s probe should fire")
    assert "kp-nested" not in r.console, r.explain("a probe ran its handler inside another probe's handler")


def test_a_pre_handler_changing_regs_ip_changes_the_path(probed_boot):
    """kill(4242, 0) has no such process to find, yet returns 0: the pre_handler set regs->ax,
    regs->ip (the return address) and regs->sp and returned 1, so __x64_sys_kill never ran."""
    r = probed_boot
    # /init's line may run into a kernel message on the serial console: the value ends at a non-digit.
    assert re.search(r"^kill-status=0(?!\d)", r.console, re.M), r.explain("kill -0 should have succeeded")
    assert re.search(rf"^kill-ok={KILLS}(?!\d)", r.console, re.M), r.explain(f"{KILLS} kill -0 should have succeeded")



def test_hit_and_missed_counters_are_exact(probed_boot, probed):
    """The per-CPU counters summed at power-off (-smp 2) against the handlers' own lines."""
    r = probed_boot
    rows = r.profile()
    log = r.lines()
    count = lambda what: sum(what in l for l in log)  # noqa: E731
    assert rows["p_kernel_clone_0"] == (count("handler_pre: <kernel_clone>"), 0), rows
    assert count("handler_post: <kernel_clone>") == count("handler_pre: <kernel_clone>")
    opens = count("kp-open-entry: ")
    assert rows["p_do_sys_openat2_0"] == (opens, 0) and rows[f"p_do_sys_openat2_{probed['offset']}"] == (opens, 0), rows
    assert rows["p___x64_sys_kill_0"] == (1 + KILLS, 0), rows
    # The clean call counts and runs its handler as the full one does: every openat(2)
    # reaches do_sys_openat2 (busybox opens files with openat only).
    assert rows["p___x64_sys_openat_0"] == (count("kp-openat-clean: __x64_sys_openat"), 0), rows
    # Handlers run with preemption disabled, in the clean-call template as in the full one.
    counts = [int(l.rsplit("=", 1)[1]) for l in probed_boot.lines() if "kp-openat-clean: " in l]
    counts += [int(l.rsplit(": ", 1)[1]) for l in probed_boot.lines() if "kp-open-entry-preempt: " in l]
    assert counts and all(c >= 1 for c in counts), counts
    assert rows["p___x64_sys_openat_0"][0] == opens, (rows, opens)
    # Each open_entry() calls ktime_get() while it runs: at least that many misses.
    hits, missed = rows["p_ktime_get_0"]
    assert hits > 0 and missed >= opens, rows
    for fn in ("setup_per_cpu_areas", "set_memory_ro", "set_memory_nx", "free_kernel_image_pages", "kernel_power_off"):
        assert rows[f"kprewrite_{fn}"][0] >= 1, (fn, rows)


def test_probe_tables_are_built_at_setup_per_cpu_areas(probed_boot):
    """The tables are decoded from their records at the setup_per_cpu_areas() hook: names
    from the running kernel's kallsyms (p->symbol_name, the default event name), a probe
    sharing the hook's site runs before them, a hit before them runs no handler and is
    counted; kprobe_profile has every probe by its name."""
    r = probed_boot
    m = re.search(r"kprewrite: built the tables of (\d+) probes at setup_per_cpu_areas \((\d+) KiB, "
                  r"(\d+) names from kallsyms\); (\d+) hits before ran no handler", r.console)
    assert m, r.explain("no line from the table build")
    hooks = len(linux_kernel.BOOT_HOOKS) + len(linux_kernel.SHUTDOWN_HOOKS)
    assert int(m.group(1)) == 8 + hooks and int(m.group(3)) >= 8 and int(m.group(4)) >= 1, m.group(0)
    assert sum("kp-percpu-setup: setup_per_cpu_areas p_setup_per_cpu_areas_0" in l for l in r.lines()) == 1
    assert "kp-too-early" not in r.console
    rows = r.profile()
    assert rows["p_setup_per_cpu_areas_0"] == (1, 0) and rows["p_setup_arch_0"] == (0, 0), rows
    assert rows["kprewrite_setup_per_cpu_areas"] == (1, 0), rows


def test_preempt_full_reschedules_on_the_way_out(probed, make_initramfs, boot_kernel):
    """Under preempt=full a reschedule asked for while a handler runs is taken when the
    dispatch drops the preemption count, through the image's preempt_schedule static call
    (preempt_enable(), as optimized_callback() ends): the same workload, exact counters."""
    initrd = make_initramfs(init_script(COMMANDS), {OPEN_FILE: "hello\n"})
    r = boot_kernel("probed-vmlinux-preempt-full", probed["out"], initrd, smp=2, timeout=120,
                    extra_append="preempt=full")
    assert "Dynamic Preempt: full" in r.console
    assert r.reached() and r.powered_off and not r.problems(), r.problems() or r.console[-3000:]
    rows = r.profile()
    log = r.lines()
    assert rows["p_kernel_clone_0"] == (sum("handler_pre: <kernel_clone>" in l for l in log), 0), rows
    assert rows["p___x64_sys_kill_0"] == (1 + KILLS, 0), rows


def _detour_entry(image, addr: int) -> int:
    """The runtime entry a site's detour calls: the jmp at the site (past an ftrace site, which
    stays `call __fentry__` for ftrace: Rules.share_ftrace), then the detour's first call."""
    code = image.read(addr, 5)
    if code[0] == 0xE8:
        addr, code = addr + 5, image.read(addr + 5, 5)
    assert code[0] == 0xE9, code.hex()
    detour = addr + 5 + int.from_bytes(code[1:], "little", signed=True)
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    call = next(i for i in cs.disasm(image.read(detour, 32), detour) if i.mnemonic == "call")
    return int(call.op_str, 16)


def test_clean_handler_gets_a_clean_call(probed):
    """A pre_handler that never reads regs is called through the runtime's clean entry
    (no struct pt_regs), the others through the pt_regs one, as in user space."""
    out = Image(str(probed["out"]))
    linux_kernel.load_symbols(out)
    full = {_detour_entry(out, out.symbols[f][0]) for f in ("kernel_clone", "do_sys_openat2", "__x64_sys_kill")}
    clean = _detour_entry(out, out.symbols["__x64_sys_openat"][0])
    assert len(full) == 1 and clean not in full, (full, clean)


def test_ftrace_site_probes_leave_the_site_to_ftrace(probed, debian_kernel):
    """A probe on an ftrace site leaves the site to ftrace (Rules.share_ftrace): the site still
    holds `call __fentry__` and its __mcount_loc entry stays, the jump follows it.  A kernel has
    no red zone: the detour's stub is `push $SITE; call` the runtime's short entry (which returns
    over SITE); the site's nop is not copied, so after the stub (with a post_handler, a second
    push and call) comes the copy of the instructions the jump displaced, then the jump back to
    the end of that region (docs/kernel.md, "Where the code goes")."""
    orig = Image(str(debian_kernel.vmlinux))
    linux_kernel.load_symbols(orig)
    out = Image(str(probed["out"]))
    linux_kernel.load_symbols(out)
    sites = {m.site for m in ks.mcount_locs(kernel(out))}
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    for name, calls in (("__x64_sys_openat", 1), ("do_sys_openat2", 1), ("kernel_clone", 2)):
        site = out.symbols[name][0]
        assert site in sites and out.read(site, 5) == orig.read(site, 5) and out.read(site, 1) == b"\xe8", name
        code = out.read(site + 5, 5)
        assert code[0] == 0xE9, (name, code.hex())
        detour = site + 10 + int.from_bytes(code[1:], "little", signed=True)
        insns = list(cs.disasm(out.read(detour, 64), detour))
        assert [i.mnemonic for i in insns[:2 * calls]] == ["push", "call"] * calls, (name, insns)
        back = next(i for i in insns[2 * calls:] if i.mnemonic == "jmp")
        end = int(back.op_str, 16)
        copied = insns[2 * calls:insns.index(back)]
        displaced = list(cs.disasm(orig.read(site + 5, end - site - 5), site + 5))
        assert copied and [(i.mnemonic, i.size) for i in copied] == [(i.mnemonic, i.size) for i in displaced], \
            (name, copied, displaced)
        assert end - site - 5 >= 5 and out.read(site + 10, end - site - 10) == b"\xcc" * (end - site - 10), name


def test_list_reads_the_probes_back(probed, debian_kernel):
    r = kprewrite("list", probed["out"])
    lines = r.stdout.splitlines()
    off = probed["offset"]
    assert any(re.fullmatch(r"[0-9a-f]{16}  k  kernel_clone\+0x0 \[FTRACE\]", l) for l in lines), lines
    assert any(re.fullmatch(r"[0-9a-f]{16}  k  do_sys_openat2\+0x0 \[FTRACE\]", l) for l in lines), lines
    assert any(re.fullmatch(rf"[0-9a-f]{{16}}  k  do_sys_openat2\+{off:#x} \[OPTIMIZED\]", l) for l in lines), lines
    # The boot hooks are probes too, on ftrace sites.
    for fn in ("setup_per_cpu_areas", "set_memory_ro", "set_memory_nx", "free_kernel_image_pages"):
        assert any(re.fullmatch(rf"[0-9a-f]{{16}}  k  {fn}\+0x0 \[FTRACE\]", l) for l in lines), (fn, lines)


def test_rewriting_twice_gives_identical_bytes(probed, debian_kernel):
    again = probed["dir"] / "vmlinux.kp.again"
    kprewrite("instrument", debian_kernel.vmlinux, "--spec", probed["spec"], "-o", again)
    assert again.read_bytes() == probed["out"].read_bytes()


def test_handler_calling_a_symbol_the_image_lacks_is_refused(tmp_path, debian_kernel):
    (tmp_path / "bad.c").write_text("#include <linux/kprobes.h>\n"
                                    "void kprewrite_no_such_kernel_function(void);\n"
                                    "static int pre(struct kprobe *p, struct pt_regs *regs)\n"
                                    "{ kprewrite_no_such_kernel_function(); return 0; }\n")
    spec = tmp_path / "probes.toml"
    spec.write_text('handlers = ["bad.c"]\n[[kprobe]]\nsymbol_name = "kernel_clone"\npre_handler = "pre"\n')
    out = tmp_path / "vmlinux.kp"
    r = kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "-o", out, check=False)
    assert r.returncode == 1 and not out.exists()
    assert r.stderr.splitlines() == ["kprewrite: bad.c: kprewrite_no_such_kernel_function is not a symbol of vmlinux"]

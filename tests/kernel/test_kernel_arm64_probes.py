"""Jump-optimized kprobes in Debian's arm64 kernel, booted: `kprewrite instrument` of its Image
(vmlinuz) with a C pre_handler on __arm64_sys_getppid's entry (a `B` past its ftrace NOPs to a
detour in the text padding; regs->pc and p->addr the entry, as the kernel's kprobe there), booted in qemu-system-aarch64 -M virt -cpu max (pointer authentication on,
KASLR seeded by RNDR) with a busybox initramfs.  The handler counts its hits in a static
variable (the probes' data: kept init memory) and prints them with pr_info(), with
current->comm and current->pid (linux/sched.h made from the Image's BTF).  The kernel's
samples/kprobes/kprobe_example.c handlers (samples/kprobe_example/handlers.c: its CONFIG_ARM64
lines, regs->pc and regs->pstate), unchanged, pre and post, on __arm64_sys_newuname+12 (the
`stp x29, x30, [sp, #-16]!` after paciasp, copied into the detour).  Breakpoint probes where no
jump may go (strncpy_from_user: exception-table entries): brk, the kernel's break hooks
(registered from setup_arch()'s entry), the instruction single-stepped out of line."""
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

HANDLER = r"""
#include <linux/kprobes.h>
#include <linux/sched.h>

static unsigned long hits;
void dump_stack(void);

int getppid_pre(struct kprobe *p, struct pt_regs *regs)
{
	if (!hits++)
		dump_stack();       /* the kernel's unwinder, through the detour */
	pr_info("kprewrite-arm64: getppid hit %lu pc=%lx addr=%lx pstate=%lx sp=%lx comm=%s pid=%d\n", hits, regs->pc,
		(unsigned long)p->addr, regs->pstate, regs->sp, current->comm, current->pid);
	return 0;
}

/* Breakpoint probes (brk, the kernel's break hooks): strncpy_from_user has exception-table
 * entries, so no jump goes in it; pre and post on one instruction, a pre on the next. */
static unsigned long brk_pre_hits, brk_post_hits, brk_pre2_hits;

int brk_pre(struct kprobe *p, struct pt_regs *regs)
{
	if (++brk_pre_hits <= 2)
		pr_info("kprewrite-arm64: brk pre %s+%u pc=%lx pstate=%lx\n", p->symbol_name, p->offset, regs->pc,
			regs->pstate);
	return 0;
}

void brk_post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
	if (++brk_post_hits <= 2)
		pr_info("kprewrite-arm64: brk post %s+%u pc=%lx\n", p->symbol_name, p->offset, regs->pc);
}

int brk_pre2(struct kprobe *p, struct pt_regs *regs)
{
	if (++brk_pre2_hits % 20 == 0)
		pr_info("kprewrite-arm64: brk counts %lu %lu %lu\n", brk_pre_hits, brk_post_hits, brk_pre2_hits);
	return 0;
}

/* Reentry: this handler's printk reaches vprintk again, which runs no handler and counts in
 * nmissed (kprobe_running()). */
static unsigned long vprintk_hits;

int vprintk_pre(struct kprobe *p, struct pt_regs *regs)
{
	if (++vprintk_hits % 100 == 0)
		pr_info("kprewrite-arm64: vprintk hit %lu nmissed %lu\n", vprintk_hits, p->nmissed);
	return 0;
}

/* In the init text, from the first C of the boot on. */
int init_pre(struct kprobe *p, struct pt_regs *regs)
{
	pr_info("kprewrite-arm64: init-text probe %s+%u\n", p->symbol_name, p->offset);
	return 0;
}

/* A change of path at an entry: sethostname() from busybox's hostname returns 0 at once. */
int sethostname_override(struct kprobe *p, struct pt_regs *regs)
{
	const char *c = current->comm;

	if (c[0] != 'h' || c[1] != 'o' || c[2] != 's' || c[3] != 't')
		return 0;
	regs->regs[0] = 0;
	regs->pc = regs->regs[30];
	return 1;
}
"""
CALLS = 5
INIT = ("grep -w -e __arm64_sys_getppid -e strncpy_from_user /proc/kallsyms\n"
        f"for i in $(seq {CALLS}); do sh -c 'echo ppid=$PPID' >/dev/null; done\n"
        "uname -r\n"
        "hostname kprewrite-x; echo SETHOSTNAME-RC=$? NAME=$(hostname)\n"
        "echo kprewrite-y > /proc/sys/kernel/hostname; echo NAME2=$(hostname)\n"
        "echo CALLS-DONE\n"
        # The kernel's own function tracer and kprobe on the probed function, beside ours.
        "cd /sys/kernel/tracing\n"
        "echo __arm64_sys_getppid > set_ftrace_filter\n"
        "echo function > current_tracer\n"
        "sh -c 'echo $PPID' >/dev/null\n"
        "echo 0 > tracing_on\n"            # (a change of tracer would clear the buffer)
        "echo FTRACE-HITS $(grep -c '__arm64_sys_getppid <-' trace)\n"
        "echo nop > current_tracer\n"
        "echo 1 > tracing_on\n"
        "echo 'p:kpk __arm64_sys_getppid' > kprobe_events\n"
        "echo 1 > events/kprobes/kpk/enable\n"
        "sh -c 'echo $PPID' >/dev/null\n"
        "echo 0 > events/kprobes/kpk/enable\n"
        "echo KPROBE-HITS $(grep -c 'kpk: (__arm64_sys_getppid+0x0' trace)\n")
HIT = re.compile(r"kprewrite-arm64: getppid hit (\d+) pc=([0-9a-f]+) addr=([0-9a-f]+) pstate=([0-9a-f]+) sp=([0-9a-f]+)")
COMM = re.compile(r"kprewrite-arm64: getppid hit \d+ .* comm=(\S+) pid=(\d+)$", re.M)


_env = arm64_env.env


@pytest.fixture(scope="module")
def instrumented(arm64_kernel, tmp_path_factory):
    d = tmp_path_factory.mktemp("arm64-probe")
    (d / "h.c").write_text(HANDLER)
    spec = d / "probes.toml"
    sample = Path(__file__).resolve().parents[2] / "samples" / "kprobe_example" / "handlers.c"
    spec.write_text(f'handlers = ["h.c", "{sample}"]\n'
                    '[[kprobe]]\nsymbol_name = "__arm64_sys_getppid"\npre_handler = "getppid_pre"\n'
                    # A second probe on the same address: one detour calls both, in order.
                    '[[kprobe]]\nsymbol_name = "__arm64_sys_getppid"\npre_handler = "handler_pre"\n'
                    '[[kprobe]]\nsymbol_name = "__arm64_sys_newuname"\noffset = 12\npre_handler = "handler_pre"\n'
                    'post_handler = "handler_post"\n'
                    '[[kprobe]]\nsymbol_name = "__arm64_sys_sethostname"\npre_handler = "sethostname_override"\n'
                    '[[kprobe]]\nsymbol_name = "setup_arch"\npre_handler = "init_pre"\n'
                    '[[kprobe]]\nsymbol_name = "strncpy_from_user"\noffset = 12\npre_handler = "brk_pre"\n'
                    'post_handler = "brk_post"\n'
                    '[[kprobe]]\nsymbol_name = "strncpy_from_user"\noffset = 16\npre_handler = "brk_pre2"\n'
                    '[[kprobe]]\nsymbol_name = "vprintk"\npre_handler = "vprintk_pre"\n')
    r = kprewrite("check", arm64_kernel.vmlinuz, "--spec", spec)
    assert "".join(r.stdout.splitlines(True)[:5]) == "__arm64_sys_getppid+0x0  k  ftrace\n" * 2 + "__arm64_sys_newuname+0xc  k  optimized\n" \
        "__arm64_sys_sethostname+0x0  k  ftrace\nsetup_arch+0x0  k  ftrace\n", r.stdout.splitlines(True)[:5]
    assert r.stdout.splitlines()[-1] == "vprintk+0x0  k  ftrace"
    assert len(r.stdout.splitlines()) == 8 and all(re.fullmatch(r"strncpy_from_user\+0x(c|10)  k  int3  __ex_table at 0x[0-9a-f]+: strncpy_from_user has "
                            r"an exception table entry: .*\[single-step\]\n", l) for l in r.stdout.splitlines(True)[5:7]), \
        r.stdout
    out = d / "Image.kp"
    kprewrite("instrument", arm64_kernel.vmlinuz, "--spec", spec, "-o", out)
    return out


@pytest.fixture(scope="module")
def initramfs():
    return _env(arm64_env.build_initramfs, kernel_env.init_script(INIT))


def _boot(kernel, initrd, name, tmp_path_factory, **kw):
    log = tmp_path_factory.mktemp("boots") / f"{name}.console.txt"
    return _env(lambda: arm64_env.boot(kernel, initrd, log=log, **kw))


def _check(r, link_site: int) -> int:
    """The boot's hits (1..n, in order, at the relocated site); returns the running site."""
    assert r.reached() and r.powered_off, r.explain("no clean boot to user space and power-off")
    assert not r.problems(), r.explain("kernel problems")
    assert arm64_env.WX_PASSED in r.console, r.explain("no W+X check")
    m = re.search(r"^([0-9a-f]{16}) T __arm64_sys_getppid$", r.console, re.M)
    assert m, r.explain("no kallsyms line")
    running = int(m.group(1), 16)
    hits = [tuple(int(x, 16) if i else int(x) for i, x in enumerate(h.groups())) for h in HIT.finditer(r.console)]
    assert hits, r.explain("the probe never fired")
    assert [h[0] for h in hits] == list(range(1, len(hits) + 1)), hits        # the counter, in kept init memory
    calls = r.console.index("CALLS-DONE")
    assert sum(1 for h in HIT.finditer(r.console[:calls])) >= CALLS, r.explain("fewer hits than calls")
    for n, pc, addr, pstate, sp in hits:
        # regs->pc and p->addr: the probed address where the kernel runs (KASLR: not the link address).
        assert pc == addr == running, (hex(pc), hex(addr), hex(running))
        assert pstate & 0xF == 0b0101 and sp >> 48 == 0xFFFF        # EL1h: the kernel's own stack
    assert (running - link_site) % 0x10000 == 0
    # dump_stack() from the handler: the kernel's unwinder walks the detour's frame record to
    # the probed function, then the syscall path down to the exception entry.
    trace = r.console[r.console.index("Call trace:"):].splitlines()[1:16]
    names = [l.split()[-1].split("+")[0] for l in trace]
    assert "dump_stack" in names and "__arm64_sys_getppid" in names and "el0t_64_sync" in names, trace
    # current->comm and ->pid, the kernel's types from the Image's BTF: /init's shells, none pid 0.
    comms = COMM.findall(r.console)
    assert len(comms) == len(hits) and {"sh", "init"} & {c for c, _ in comms} and all(int(p) > 0 for _, p in comms)
    # The second probe on the entry: the sample's handler_pre after ours, each time.
    both = re.findall(r"(getppid hit \d+|handler_pre: <__arm64_sys_getppid> p->addr = 0x\S+, pc = 0x[0-9a-f]+)",
                      r.console)
    assert len(both) == 2 * len(hits) and all(a.startswith("getppid hit") and b.endswith(f"pc = {running:#x}")
                                              for a, b in zip(both[::2], both[1::2])), both[:6]
    # setup_arch() (init text): before the kernel's own first messages are out of start_kernel().
    lines = r.lines()
    i = next(n for n, l in enumerate(lines) if "kprewrite-arm64: init-text probe setup_arch+0" in l)
    assert i < next(n for n, l in enumerate(lines) if "Zone ranges" in l or "KASLR" in l)
    # The breakpoint probes: pre at +12 (the kernel's pt_regs: EL1h), post with pc past it, and the
    # probe on the next instruction each time too.
    sfu = int(re.search(r"^([0-9a-f]{16}) T strncpy_from_user$", r.console, re.M).group(1), 16)
    assert sfu - running == NEWUNAME_LINK[1] - link_site
    pre = re.findall(r"brk pre strncpy_from_user\+12 pc=([0-9a-f]+) pstate=([0-9a-f]+)", r.console)
    post = re.findall(r"brk post strncpy_from_user\+12 pc=([0-9a-f]+)", r.console)
    assert pre and post and all(int(pc, 16) == sfu + 12 and int(ps, 16) & 0xF == 5 for pc, ps in pre), pre
    assert all(int(pc, 16) == sfu + 16 for pc in post), post
    counts = re.findall(r"brk counts (\d+) (\d+) (\d+)", r.console)
    assert counts and all(a == b == c for a, b, c in counts), counts
    # Reentry: the printk of every handler (this one's included) reaches vprintk, which runs no
    # handler then and counts it missed: at least once per earlier print of its own.
    vp = [(int(a), int(b)) for a, b in re.findall(r"vprintk hit (\d+) nmissed (\d+)", r.console)]
    assert len(vp) >= 2 and all(h == 100 * (n + 1) and m >= n for n, (h, m) in enumerate(vp)), vp
    assert all(a[1] <= b[1] for a, b in zip(vp, vp[1:])), vp
    # The pre_handler that changed the path: sethostname() returned 0 and did nothing.
    assert re.search(r"^SETHOSTNAME-RC=0 NAME=\(none\)$", r.console, re.M) and "NAME2=kprewrite-y" in r.console, \
        r.explain("sethostname() was not overridden")
    # ftrace and the kernel's kprobe still work on the function, and ours fired with them.
    m = re.search(r"^FTRACE-HITS (\d+)$", r.console, re.M)
    assert m and int(m.group(1)) >= 1, r.explain("the function tracer saw no call")
    m = re.search(r"^KPROBE-HITS (\d+)$", r.console, re.M)
    assert m and int(m.group(1)) >= 1, r.explain("the kernel's kprobe saw no call")
    assert hits[-1][0] >= CALLS + 2
    # The sample's handlers, pre then post, once per uname call at least.
    lines = r.lines()
    pre = [n for n, l in enumerate(lines) if "handler_pre: <__arm64_sys_newuname> p->addr = 0x" in l]
    post = [n for n, l in enumerate(lines) if "handler_post: <__arm64_sys_newuname> p->addr = 0x" in l]
    assert pre and len(pre) == len(post) and all(a < b for a, b in zip(pre, post)), r.explain("no pre/post pairs")
    m = re.search(r"handler_pre: <__arm64_sys_newuname> p->addr = 0x\S+, pc = 0x([0-9a-f]+), pstate = 0x([0-9a-f]+)",
                  r.console)
    assert int(m.group(1), 16) == running - link_site + NEWUNAME_LINK[0] + 12 and int(m.group(2), 16) & 0xF == 5
    return running


NEWUNAME_LINK = []


@pytest.fixture(scope="module")
def img(arm64_kernel):
    i = arm_image.parse(arm64_kernel.vmlinuz.read_bytes(), str(arm64_kernel.vmlinuz))
    NEWUNAME_LINK[:] = [i.syms["__arm64_sys_newuname"], i.syms["strncpy_from_user"]]
    return i


def test_optimized_probe_fires_under_kaslr(arm64_kernel, img, instrumented, initramfs, tmp_path_factory):
    site = img.syms["__arm64_sys_getppid"]
    # The Image: entry + 8 (after the ftrace NOPs) holds `b` to the text padding.
    new = arm_image.parse(instrumented.read_bytes(), str(instrumented))
    code = instrumented.read_bytes()[site - img.text:site - img.text + 12]
    assert code[:8] == arm64_kernel.vmlinuz.read_bytes()[site - img.text:site - img.text + 8] == bytes.fromhex("1f2003d5") * 2
    word = int.from_bytes(code[8:], "little")
    assert word >> 26 == 0b000101
    target = site + 8 + ((word & 0x3FFFFFF) ^ 0x2000000) * 4 - 0x2000000 * 4
    assert new.syms["_stext"] <= target < new.syms["_etext"] and target > img.syms["__idmap_text_end"]
    r = _boot(instrumented, initramfs, "arm64-probe", tmp_path_factory)
    running = _check(r, site)
    assert running != site, "KASLR did not move the kernel (nokaslr?)"


@pytest.mark.slow
def test_kaslr_boots_uefi_and_cortex_a72(img, instrumented, initramfs, arm64_kernel, tmp_path_factory):
    """Four more boots (13-24 s each under TCG with -cpu max): two each at its own base; one
    through UEFI (AAVMF; the EFI stub places the kernel); one on a CPU without pointer
    authentication (cortex-a72; the seed from the device tree)."""
    site = img.syms["__arm64_sys_getppid"]
    bases = {_check(_boot(instrumented, initramfs, f"arm64-kaslr-{i}", tmp_path_factory), site) for i in range(2)}
    assert len(bases) == 2, bases
    r = _boot(instrumented, initramfs, "arm64-uefi", tmp_path_factory, uefi=True)
    assert "EFI stub: Booting Linux Kernel" in r.console, r.explain("not booted through UEFI")
    _check(r, site)
    _check(_boot(instrumented, initramfs, "arm64-cortex-a72", tmp_path_factory, cpu="cortex-a72"), site)


def _refused(arm64_kernel, tmp_path, handler_c: str) -> str:
    """instrument with one pre_handler from handler_c on __arm64_sys_getppid: refused (exit 1, no
    output file); its stderr."""
    (tmp_path / "h.c").write_text("#include <linux/kprobes.h>\n" + handler_c)
    spec = tmp_path / "probes.toml"
    spec.write_text('handlers = ["h.c"]\n[[kprobe]]\nsymbol_name = "__arm64_sys_getppid"\npre_handler = "pre"\n')
    out = tmp_path / "Image.kp"
    r = kprewrite("instrument", arm64_kernel.vmlinuz, "--spec", spec, "-o", out, check=False)
    assert r.returncode == 1 and not out.exists(), r.stderr
    return r.stderr


def test_absolute_addresses_refused(arm64_kernel, tmp_path):
    """A handler holding an address in its data (a pointer initialized statically) would need a
    relocation KASLR applies; the Image's table has no room for ours: refused, one line."""
    err = _refused(arm64_kernel, tmp_path, "static int n;\nstatic int *volatile p = &n;\n"
                   "int pre(struct kprobe *k, struct pt_regs *r) { return (*p)++ & 0; }\n")
    assert len(err.splitlines()) == 1 and "absolute relocation (R_AARCH64_ABS64) in .data" in err, err


def test_code_beyond_the_text_padding_refused(arm64_kernel, tmp_path):
    """The handlers' code and read-only data go in the text padding before _etext (~54 KiB in
    Debian's build): more is refused, saying how much was needed and how much there is."""
    err = _refused(arm64_kernel, tmp_path, "static const char big[80000] = { 1 };\n"
                   "int pre(struct kprobe *k, struct pt_regs *r) { return big[r->regs[0] & 0xffff]; }\n")
    assert re.search(r"the probes need \d+ bytes of code; the text padding has \d+ \(before _etext 0x[0-9a-f]+\)$",
                     err.strip()), err


def test_data_beyond_the_room_kept_after_boot_refused(arm64_kernel, tmp_path):
    """The handlers' writable data goes in the unused .rela.dyn entries after the last 2 MiB
    boundary before __init_end (free_initmem() unmaps a whole block mapping below it): 64 KiB
    in Debian's build.  More is refused, saying how much was needed and how much there is."""
    err = _refused(arm64_kernel, tmp_path, "static char big[80000] = { 1 };\n"
                   "int pre(struct kprobe *k, struct pt_regs *r) { return big[r->regs[0] & 0xffff]++ & 0; }\n")
    m = re.search(r"the probes need (\d+) bytes of data; the room kept after boot .* has (\d+)$", err.strip())
    assert m and len(err.splitlines()) == 1 and int(m.group(1)) > 80000 > int(m.group(2)) > 32768, err

"""Stacks that unwind through probes in a kernel (docs/kernel.md, "Stacks through
probes"): a handler calling the kernel's dump_stack() shows the probed function and its
callers, each a reliable frame (no `? ` mark: the ORC unwinder stepped to it) and no
unwinder warning, for an ftrace-site probe at a function's entry, a jump-optimized probe
inside it, a breakpoint probe (through the kernel's #BP entry and its pt_regs), a
kretprobe's return handler at a hooked exit, and a kretprobe kept on the trampoline
(its function has returned: its callers).  Before, every frame after dump_stack_lvl was
`? `, and the probed function missing for all but the breakpoint.  One rewrite and one
boot shared by the tests of this module."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

from kernel_env import assert_boot_ok, init_script
from test_kernel_probes import inside_probe

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rewriter.elf.image import Image  # noqa: E402
from rewriter.targets import linux_kernel  # noqa: E402

pytestmark = pytest.mark.kernel

OPEN_FILE = "/etc/kprewrite-stack"      # only `cat` opens it, once

# Each handler dumps the stack once, for `cat` only (comm), after a line naming the kind.
HANDLERS = r"""
#include <linux/kprobes.h>
#include <linux/sched.h>

void dump_stack(void);

static int is_cat(void)
{
	const char *c = current->comm;
	return c[0] == 'c' && c[1] == 'a' && c[2] == 't' && c[3] == 0;
}

static void dump_once(int *done, const char *kind)
{
	if (!is_cat() || __atomic_exchange_n(done, 1, __ATOMIC_RELAXED))
		return;
	pr_info("kp-stack-begin %s\n", kind);
	dump_stack();
	pr_info("kp-stack-end %s\n", kind);
}

static int d_ftrace, d_opt, d_ret, d_tramp, d_int3;

int at_entry(struct kprobe *p, struct pt_regs *regs) { dump_once(&d_ftrace, "ftrace"); return 0; }
int inside(struct kprobe *p, struct pt_regs *regs) { dump_once(&d_opt, "optimized"); return 0; }
int breakpoint(struct kprobe *p, struct pt_regs *regs) { dump_once(&d_int3, "int3"); return 0; }
int at_return(struct kretprobe_instance *ri, struct pt_regs *regs) { dump_once(&d_ret, "kretprobe"); return 0; }
int at_tramp(struct kretprobe_instance *ri, struct pt_regs *regs) { dump_once(&d_tramp, "trampoline"); return 0; }
"""

COMMANDS = f"""
cat {OPEN_FILE} > /dev/null
echo "== kallsyms"; grep -w kprewrite /proc/kallsyms
sleep 0.5
"""

# A frame dump_stack() prints: "[    2.39] ? do_sys_openat2+0x1/0x170" (`? `: not reliable).
FRAME = re.compile(r"^\[ *[\d.]+\]  (\? )?([\w.]+)\+0x([0-9a-f]+)/0x[0-9a-f]+$")


@pytest.fixture(scope="module")
def unwound(tmp_path_factory, debian_kernel, make_initramfs, boot_kernel):
    """The spec: an ftrace-site probe and an optimized one in do_sys_openat2, a breakpoint
    probe on strncpy_from_user() (it has an __ex_table entry), kretprobes on do_filp_open()
    (its exit hooked) and do_dentry_open() (an indirect jump: the trampoline); the boot."""
    d = tmp_path_factory.mktemp("unwind")
    image = Image(str(debian_kernel.vmlinux))
    linux_kernel.load_symbols(image)
    off = inside_probe(image)[0]
    (d / "handlers.c").write_text(HANDLERS)
    spec = d / "probes.toml"
    spec.write_text('handlers = ["handlers.c"]\n'
                    '[[kprobe]]\nsymbol_name = "do_sys_openat2"\npre_handler = "at_entry"\n'
                    f'[[kprobe]]\nsymbol_name = "do_sys_openat2"\noffset = {off:#x}\npre_handler = "inside"\n'
                    '[[kprobe]]\nsymbol_name = "strncpy_from_user"\npre_handler = "breakpoint"\n'
                    '[[kretprobe]]\nsymbol_name = "do_filp_open"\nhandler = "at_return"\n'
                    '[[kretprobe]]\nsymbol_name = "do_dentry_open"\nhandler = "at_tramp"\n')
    check = kprewrite("check", debian_kernel.vmlinux, "--spec", spec).stdout.splitlines()
    kinds = [l.split()[2] for l in check]
    assert kinds == ["ftrace", "optimized", "int3", "ftrace", "ftrace"], check
    assert re.search(r"returns: 0x[0-9a-f]+ ret$", check[3]) and "returns: trampoline" in check[4], check
    out = d / "vmlinux.kp"
    kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "-o", out)
    initrd = make_initramfs(init_script(COMMANDS), {OPEN_FILE: "stack\n"})
    r = boot_kernel("unwind-vmlinux-smp2", out, initrd, smp=2, timeout=120)
    return r, off, linux_kernel.plan_layout(image).rx_vaddr


def trace(r, kind: str) -> list[str]:
    lines = r.lines_between(f"kp-stack-begin {kind}", f"kp-stack-end {kind}")
    assert any(l.endswith("Call Trace:") for l in lines), r.explain(f"no dump_stack() from the {kind} handler")
    return lines


def reliable(lines: list[str]) -> list[str]:
    """The frames the unwinder stepped to, as name+0xoffset."""
    return [f"{m.group(2)}+0x{m.group(3)}" for m in map(FRAME.match, lines) if m and not m.group(1)]


def assert_frames(r, kind: str, frames: list[str], want: list[str]) -> None:
    """`want` in order among the reliable frames, one after the other."""
    names = [f.split("+")[0] for f in frames]
    at = next((i for i in range(len(frames)) if frames[i] == want[0] or names[i] == want[0]), None)
    assert at is not None and names[at:at + len(want)] == [w.split("+")[0] for w in want], \
        r.explain(f"{kind}: the reliable frames {frames} do not go {' -> '.join(want)}")


def test_boots_with_no_unwinder_warning(unwound):
    """The boot is clean: dump_stack()'s own Call Trace lines aside, no WARNING (the ORC
    unwinder's are "WARNING: ..."), and no line about unwinding."""
    r = unwound[0]
    assert_boot_ok(r, allow=("Call Trace",))
    bad = [l for l in r.lines() if "WARNING" in l or "unwind" in l.lower()]
    assert not bad, r.explain(f"unwinder lines: {bad}")


def test_ftrace_site_probe(unwound):
    """At do_sys_openat2's ftrace site: the function at the hit (+1, as regs->ip reads),
    then __x64_sys_openat and do_syscall_64, each reliable."""
    r = unwound[0]
    assert_frames(r, "ftrace", reliable(trace(r, "ftrace")),
                  ["do_sys_openat2+0x1", "__x64_sys_openat", "do_syscall_64", "entry_SYSCALL_64_after_hwframe"])


def test_optimized_probe(unwound):
    """Inside do_sys_openat2 (a jump to the detour): the function at the probed instruction + 1."""
    r, off, _ = unwound
    assert_frames(r, "optimized", reliable(trace(r, "optimized")),
                  [f"do_sys_openat2+{off + 1:#x}", "__x64_sys_openat", "do_syscall_64"])


def test_breakpoint_probe(unwound):
    """An int3 in strncpy_from_user(): through the kernel's #BP entry (exc_int3, its pt_regs
    printed as RIP: strncpy_from_user+0x1) into getname_flags and do_sys_openat2."""
    r = unwound[0]
    lines = trace(r, "int3")
    assert any(re.search(r"RIP: 0010:strncpy_from_user\+0x1/", l) for l in lines), r.explain("no RIP line")
    frames = reliable(lines)
    assert_frames(r, "int3", frames, ["exc_int3", "asm_exc_int3"])
    assert_frames(r, "int3", frames, ["getname_flags.part.0", "do_sys_openat2", "__x64_sys_openat"])


def test_kretprobe_at_a_hooked_exit(unwound):
    """do_filp_open()'s return handler runs before its return: the function (its frame at
    the exit is the one at its entry: +0x1), then do_sys_openat2 and __x64_sys_openat."""
    r = unwound[0]
    assert_frames(r, "kretprobe", reliable(trace(r, "kretprobe")),
                  ["do_filp_open+0x1", "do_sys_openat2", "__x64_sys_openat"])


def test_kretprobe_on_the_trampoline(unwound):
    """do_dentry_open() returned into the trampoline: its callers, from the real return
    address the trampoline handler keeps in the slot (in path_openat: vfs_open is inlined)."""
    r = unwound[0]
    assert_frames(r, "trampoline", reliable(trace(r, "trampoline")), ["path_openat", "do_filp_open", "do_sys_openat2"])


def test_code_is_kernel_text_for_the_stack_printer(unwound):
    """Our code is registered as a BPF image is (bpf_ksym_add()): /proc/kallsyms lists it
    from the gap's start, in two ranges (the kretprobe trampoline's first byte left out),
    and the runtime's and handlers' frames print as reliable kernel text."""
    r, _, gap = unwound
    syms = re.findall(r"^([0-9a-f]{16}) t kprewrite\t\[bpf\]$", r.between(), re.M)
    assert len(syms) == 2 and int(syms[0], 16) == gap, r.explain("no kprewrite [bpf] ranges in /proc/kallsyms")
    assert any(f.startswith("_etext+") for f in reliable(trace(r, "ftrace"))), r.explain("our frames are not reliable")

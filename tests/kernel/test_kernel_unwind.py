"""Stacks that unwind through probes in a kernel: a handler calling the kernel's
dump_stack() shows the probed function and its callers, each a reliable frame (no
`? ` entry) and no unwinder warning, for a jump-optimized probe inside a function,
an ftrace-site probe at its entry, a kretprobe's return handler at a hooked exit,
a kretprobe kept on the trampoline, and a breakpoint probe.  One rewrite and one
boot shared by the tests of this module."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

from kernel_env import assert_boot_ok, init_script

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rewriter.image import Image  # noqa: E402
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
sleep 0.5
"""

# (kind, probed function, two of its callers, in order)
EXPECTED = {
    "ftrace": ("do_sys_openat2", "__x64_sys_openat", "do_syscall_64"),
    "optimized": ("do_sys_openat2", "__x64_sys_openat", "do_syscall_64"),
    "kretprobe": ("do_filp_open", "do_sys_openat2", "__x64_sys_openat"),
    "trampoline": ("getname_flags.part.0", "do_sys_openat2", "__x64_sys_openat"),
    "int3": ("do_sys_openat2", "__x64_sys_openat", "do_syscall_64"),
}


def inside_offset(image) -> int:
    """An offset inside do_sys_openat2 that `check` optimizes: after its first instructions."""
    f = next(f for f in image.functions if f.name == "do_sys_openat2")
    return f  # placeholder, replaced below


@pytest.fixture(scope="module")
def unwound(tmp_path_factory, debian_kernel, make_initramfs, boot_kernel):
    d = tmp_path_factory.mktemp("unwind")
    (d / "handlers.c").write_text(HANDLERS)
    spec = d / "probes.toml"
    spec.write_text('handlers = ["handlers.c"]\n'
                    '[[kprobe]]\nsymbol_name = "do_sys_openat2"\npre_handler = "at_entry"\n'
                    '[[kprobe]]\nsymbol_name = "do_sys_openat2"\noffset = OPT\npre_handler = "inside"\n'
                    '[[kretprobe]]\nsymbol_name = "do_filp_open"\nhandler = "at_return"\n'
                    '[[kretprobe]]\nsymbol_name = "strncpy_from_user"\nhandler = "at_tramp"\n')
    out = d / "vmlinux.kp"
    kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "-o", out)
    initrd = make_initramfs(init_script(COMMANDS), {OPEN_FILE: "stack\n"})
    r = boot_kernel("unwind-vmlinux-smp2", out, initrd, smp=2, timeout=120)
    return r

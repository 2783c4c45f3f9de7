"""Probes from a glob in Debian's arm64 kernel, booted: the sites whose probes all come from globs
are reached through one struct ftrace_ops the rewritten Image registers at kernel_init_freeable()'s
entry (ftrace_set_filter_ips() with the sites, register_ftrace_function() asking for pt_regs), as
the kernel's kprobes on ftrace (kprobe_ftrace_handler()) but without a kprobe per function: no code
per site, so a probe on every function fits where ~54 KiB of text padding holds no detour per
function.  A named probe on a function a glob also matches keeps its jump past the ftrace NOPs;
a glob's probe on a function without an ftrace site is skipped (ftrace_location), as ftrace's own
filters reach only available_filter_functions.  A second boot with kprewrite.enabled=0: nothing of
the spec runs.  The slow test: `symbol_name = "*"`, every
function (38,019), booted."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arm64_env  # noqa: E402
import kernel_env  # noqa: E402

pytestmark = pytest.mark.kernel

HANDLER = r"""
#include <linux/kprobes.h>
#include <linux/sched.h>

static unsigned long hits;

/* Every sys_get* call: its p->addr and regs->pc (the entry), named by the kernel's kallsyms. */
int glob_pre(struct kprobe *p, struct pt_regs *regs)
{
	if (++hits <= 200)
		pr_info("kprewrite-glob: %ps addr=%lx pc=%lx lr=%lx hits=%lu\n", (void *)p->addr,
			(unsigned long)p->addr, regs->pc, regs->regs[30], hits);
	return 0;
}

/* A named probe on a function the glob matches too: its own detour, past the ftrace NOPs. */
int named_pre(struct kprobe *p, struct pt_regs *regs)
{
	pr_info("kprewrite-named: %s addr=%lx pc=%lx\n", p->symbol_name, (unsigned long)p->addr, regs->pc);
	return 0;
}

/* A pre_handler that changes the path through ftrace: getegid() returns 4242 for `id`. */
int override_pre(struct kprobe *p, struct pt_regs *regs)
{
	if (current->comm[0] != 'i' || current->comm[1] != 'd' || current->comm[2])
		return 0;
	regs->regs[0] = 4242;
	regs->pc = regs->regs[30];
	return 1;
}
"""
SPEC = """handlers = ["h.c"]
[[kprobe]]
symbol_name = "__arm64_sys_get[gpu]*"
pre_handler = "glob_pre"
[[kprobe]]
symbol_name = "__arm64_sys_getppid"
pre_handler = "named_pre"
[[kprobe]]
symbol_name = "__arm64_sys_getegi?"
pre_handler = "override_pre"
"""
# busybox's id (comm "id") calls getuid, getgid and getegid; `id -G` prints the group ids.
INIT = ("grep -w -e __arm64_sys_getuid -e __arm64_sys_getppid -e __arm64_sys_getegid /proc/kallsyms\n"
        "echo EGID=$(id -g)\n"
        "sh -c 'echo PPID=$PPID'\n"
        "echo GLOB-DONE\n")


_env = arm64_env.env


def test_glob_probes_fire_through_ftrace(arm64_kernel, tmp_path, tmp_path_factory):
    (tmp_path / "h.c").write_text(HANDLER)
    spec = tmp_path / "probes.toml"
    spec.write_text(SPEC)
    r = kprewrite("check", arm64_kernel.vmlinuz, "--spec", spec)
    lines = dict(l.split("  ", 1) for l in r.stdout.splitlines())
    assert lines["__arm64_sys_getuid+0x0"] == lines["__arm64_sys_getppid+0x0"] == "k  ftrace", r.stdout
    out = tmp_path / "Image.kp"
    kprewrite("instrument", arm64_kernel.vmlinuz, "--spec", spec, "-o", out)
    # Only the named probe's function has a jump (entry + 8); the glob's functions are untouched.
    from rewriter.targets.linux_kernel.aarch64 import image as arm_image
    img = arm_image.parse(arm64_kernel.vmlinuz.read_bytes(), str(arm64_kernel.vmlinuz))
    new = out.read_bytes()
    for f, changed in (("__arm64_sys_getppid", True), ("__arm64_sys_getuid", False), ("__arm64_sys_getegid", False)):
        at = img.syms[f] - img.text
        assert (new[at:at + 16] != img.data[at:at + 16]) == changed, f
    rd = _env(arm64_env.build_initramfs, kernel_env.init_script(INIT))
    b = _env(lambda: arm64_env.boot(out, rd, log=tmp_path_factory.mktemp("boots") / "arm64-glob.console.txt"))
    assert b.reached() and b.powered_off, b.explain("no clean boot to user space and power-off")
    assert not b.problems() and arm64_env.WX_PASSED in b.console and "GLOB-DONE" in b.console, b.explain("boot")
    kall = {m.group(2): int(m.group(1), 16) for m in re.finditer(r"^([0-9a-f]{16}) T (\S+)$", b.console, re.M)}
    hits = re.findall(r"kprewrite-glob: (\S+) addr=([0-9a-f]+) pc=([0-9a-f]+) lr=([0-9a-f]+)",
                      b.console)
    seen = {f for f, *_ in hits}
    assert {"__arm64_sys_getuid", "__arm64_sys_getgid", "__arm64_sys_getppid"} <= seen, b.explain("glob hits")
    for f, addr, pc, lr in hits:
        # p->addr and regs->pc: the entry where the kernel runs (KASLR); lr: the caller's.
        assert int(addr, 16) == int(pc, 16) and (f not in kall or kall[f] == int(addr, 16)), (f, addr, pc)
        assert int(lr, 16) >> 48 == 0xFFFF
    # The named probe on getppid: its detour, beside the glob's probe on the same site.
    named = re.findall(r"kprewrite-named: __arm64_sys_getppid addr=([0-9a-f]+) pc=([0-9a-f]+)", b.console)
    assert named and all(int(a, 16) == int(p, 16) == kall["__arm64_sys_getppid"] for a, p in named), named
    assert "PPID=" in b.console
    # The override through ftrace: getegid() returned 4242 for id without running (0 as root).
    assert re.search(r"^EGID=4242$", b.console, re.M), b.explain("id -g: getegid not overridden")
    # kprewrite.enabled=0 on the command line: nothing of the spec runs (the glob's ftrace_ops,
    # the named probe's detour), our own hooks still do (the ftrace_ops is registered).
    off = _env(lambda: arm64_env.boot(out, rd, extra_append="kprewrite.enabled=0",
                                      log=tmp_path_factory.mktemp("boots") / "arm64-glob-off.console.txt"))
    assert off.reached() and off.powered_off and not off.problems(), off.explain("boot with kprewrite.enabled=0")
    assert "kprewrite: kprewrite.enabled=0: every probe disarmed" in off.console, off.explain("not disarmed")
    assert "kprewrite-glob" not in off.console and "kprewrite-named" not in off.console, off.explain("a probe ran")
    assert re.search(r"^EGID=0$", off.console, re.M) and "GLOB-DONE" in off.console, off.explain("getegid")


@pytest.mark.slow
def test_every_function_boots(arm64_kernel, tmp_path, tmp_path_factory):
    """`symbol_name = "*"`: every function with an ftrace site (38,019 in Debian's 6.1 build) through
    the ftrace_ops, the others skipped with the check that refused them; boots with -smp 2 (about a
    minute under TCG) and the handler counts millions of hits."""
    (tmp_path / "h.c").write_text("#include <linux/kprobes.h>\nstatic unsigned long hits;\n"
                                  "int pre(struct kprobe *p, struct pt_regs *regs)\n{\n"
                                  "\tif (!(++hits & 0xfffff))\n"
                                  "\t\tpr_info(\"kprewrite-star: %lu hits, now %ps\\n\", hits, (void *)p->addr);\n"
                                  "\treturn 0;\n}\n")
    spec = tmp_path / "star.toml"
    spec.write_text('handlers = ["h.c"]\n[[kprobe]]\nsymbol_name = "*"\npre_handler = "pre"\n')
    out = tmp_path / "Image.star"
    r = kprewrite("instrument", arm64_kernel.vmlinuz, "--spec", spec, "-o", out)
    m = re.search(r"(\d+) probes placed, (\d+) from globs skipped", r.stderr)
    assert m and int(m.group(1)) > 36_000, r.stderr
    assert re.search(r"\d+  ftrace_location", r.stderr), r.stderr
    rd = _env(arm64_env.build_initramfs, kernel_env.init_script("sh -c 'echo PPID=$PPID'\necho STAR-DONE\n"))
    b = _env(lambda: arm64_env.boot(out, rd, timeout=600,
                                    log=tmp_path_factory.mktemp("boots") / "arm64-star.console.txt"))
    assert b.reached() and b.powered_off, b.explain("no clean boot to user space and power-off")
    assert not b.problems() and arm64_env.WX_PASSED in b.console and "STAR-DONE" in b.console, b.explain("boot")
    counts = [int(n) for n in re.findall(r"kprewrite-star: (\d+) hits", b.console)]
    assert len(counts) >= 2 and counts == sorted(counts), counts


@pytest.mark.slow
def test_elf_vmlinux_in_elf_out(arm64_kernel, tmp_path):
    """The -dbg package's ELF vmlinux (262 MB download, kept in the cache) is read as the Image
    objcopy makes of it and written back into its PT_LOADs: `check` says the same as for the
    Image, and `objcopy -O binary` of the output (arch/arm64/boot/Makefile's flags) is byte for
    byte the Image kprewrite writes from vmlinuz with the same spec; the detours' code, between
    the ELF's sections, has a section of its own so that objcopy keeps it."""
    import shutil
    import subprocess
    objcopy = shutil.which("aarch64-linux-gnu-objcopy")
    if objcopy is None:
        pytest.skip("aarch64-linux-gnu-objcopy (binutils-aarch64-linux-gnu) is not installed")
    elf = _env(arm64_env.obtain_dbg_vmlinux, arm64_kernel)
    (tmp_path / "h.c").write_text(HANDLER)
    spec = tmp_path / "probes.toml"
    spec.write_text(SPEC + '[[kprobe]]\nsymbol_name = "__arm64_sys_newuname"\noffset = 12\npre_handler = "named_pre"\n')
    a = kprewrite("check", elf, "--spec", spec)
    b = kprewrite("check", arm64_kernel.vmlinuz, "--spec", spec)
    assert a.stdout == b.stdout and "__arm64_sys_newuname+0xc  k  optimized" in a.stdout, (a.stdout, b.stdout)
    kprewrite("instrument", elf, "--spec", spec, "-o", tmp_path / "vmlinux.kp")
    kprewrite("instrument", arm64_kernel.vmlinuz, "--spec", spec, "-o", tmp_path / "Image.kp")
    subprocess.run([objcopy, "-O", "binary", "-R", ".note", "-R", ".note.gnu.build-id", "-R", ".comment", "-S",
                    str(tmp_path / "vmlinux.kp"), str(tmp_path / "Image.objcopy")], check=True)
    made, written = (tmp_path / "Image.objcopy").read_bytes(), (tmp_path / "Image.kp").read_bytes()
    assert made == written and written != arm64_kernel.vmlinuz.read_bytes()
    r = subprocess.run(["readelf", "-SW", str(tmp_path / "vmlinux.kp")], capture_output=True, text=True)
    assert re.search(r"\.kprewrite\.text\s+PROGBITS\s+ffff8000", r.stdout), r.stdout[-2000:]

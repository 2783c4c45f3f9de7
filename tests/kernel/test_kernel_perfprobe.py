"""perf probe definitions in Debian's kernel, from its own BTF (rewriter/probes/perfprobe/btfprobe.py):

- no boot: `do_sys_openat2 dfd filename:string how->flags` compiles to the line written by hand
  with the x86-64 argument registers and struct open_how's offsets read from BTF here; `%return`
  gets `$retval` typed from the prototype (long: s64); what BTF cannot give is a one-line error;
- a boot of the rewritten vmlinuz: a static program opens a file with open() and openat2(),
  and the values our BTF-compiled event traced (int, user string, open_how's three members
  through the pointer) equal those of the kernel's own tracefs kprobe event written with
  register fetch args on the same function, in a boot of the unmodified vmlinuz.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

from kernel_env import assert_boot_ok, init_script, sections

pytestmark = pytest.mark.kernel

TRACING = "/sys/kernel/tracing"
FILE = "/kp-btf-file"


def _open_how(vmlinux) -> dict[str, int]:
    """struct open_how's member offsets, from the image's BTF (not from our compiler)."""
    from elftools.elf.elffile import ELFFile

    from rewriter.targets.linux_kernel import btf
    with open(vmlinux, "rb") as f:
        data = ELFFile(f).get_section_by_name(".BTF").data()
    types = btf.parse(data, str(vmlinux))
    return {m: btf.member_offset(types, "open_how", m) for m in ("flags", "mode", "resolve")}


def _compiled(stdout: str) -> dict[str, str]:
    return dict(l.split(": ", 1) for l in stdout.splitlines() if l.startswith("probes["))


def test_compiled_line_equals_the_register_line(tmp_path, debian_kernel):
    off = _open_how(debian_kernel.vmlinux)
    assert off["flags"] is not None and off["mode"] is not None, off
    spec = tmp_path / "probes.toml"
    spec.write_text('probes = ["do_sys_openat2 dfd filename:string how->flags",\n'
                    '          "do_sys_openat2%return $retval",\n'
                    '          "kp_g:kp_m=do_sys_openat2 how->mode f=filename:ustring",\n'
                    '          "do_sys_openat2 dfd %di dfd $comm"]\n')
    r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec)
    got = _compiled(r.stdout)
    assert got["probes[1]"] == (f"p:probe/do_sys_openat2 do_sys_openat2 dfd=%di:s32 "
                                f"filename_string=+0(%si):string flags=+{off['flags']}(%dx):x64"), got
    assert got["probes[2]"] == "r:probe/do_sys_openat2__return do_sys_openat2 retval=$retval:s64", got
    assert got["probes[3]"] == f"p:kp_g/kp_m do_sys_openat2 mode=+{off['mode']}(%dx):x64 f=+0(%si):ustring", got
    # raw fetch args passed on, named as in user programs; a name used twice gets _1
    assert got["probes[4]"] == ("p:probe/do_sys_openat2_1 do_sys_openat2 dfd=%di:s32 arg2=%di dfd_1=%di:s32 "
                                "arg4=$comm"), got


@pytest.mark.parametrize("definition, message", [
    ("do_sys_openat2 nosuch", "probes[1]: no parameter 'nosuch' in 'do_sys_openat2' "
                              "(BTF has its parameters only: dfd, filename, how)"),
    ("do_sys_openat2:3 dfd", "probes[1]: a source line: a kernel's BTF has no line table"),
    ("do_sys_openat2+4 dfd", "probes[1]: +OFFS: a kernel's BTF has no line table"),
    ("kp_no_such_function dfd", "probes[1]: function 'kp_no_such_function' not found in the BTF of vmlinux"),
    ("do_sys_openat2 how->nope", "probes[1]: 'how->nope': struct open_how has no member 'nope'"),
    ("do_sys_openat2 dfd->x", "probes[1]: 'dfd->x': dfd is not a pointer (int)"),
    ("do_sys_openat2 dfd:string", "probes[1]: 'dfd:string' is int, not a char pointer"),
])
def test_what_btf_cannot_give_is_one_line(tmp_path, debian_kernel, definition, message):
    spec = tmp_path / "probes.toml"
    spec.write_text(f'probes = ["{definition}"]\n')
    r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("kprewrite: probes.toml: ") and message in lines[0], lines


OPENER_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/openat2.h>

int main(void)
{
	int fd = open("FILE", O_WRONLY | O_CREAT | O_TRUNC, 0640);
	printf("open=%d pid=%d\n", fd >= 0, getpid());
	close(fd);
	struct open_how how = { .flags = O_RDONLY | O_CLOEXEC, .mode = 0, .resolve = RESOLVE_NO_SYMLINKS };
	long r = syscall(SYS_openat2, AT_FDCWD, "FILE", &how, sizeof how);
	printf("openat2=%d\n", r >= 0);
	return 0;
}
"""

# The kernel's own event, same function, the arguments as registers (no BTF, no names).
REGISTER_EVENT = ("p:kp_reg do_sys_openat2 dfd=%di:s32 file=+0(%si):ustring flags=+FLAGS(%dx):x64 "
                  "mode=+MODE(%dx):x64 resolve=+RESOLVE(%dx):x64")


def _boot(boot_kernel, make_initramfs, name, kernel, opener, commands):
    initrd = make_initramfs(init_script(commands), {"opener": opener})
    r = boot_kernel(name, kernel, initrd, smp=2, timeout=240)
    assert_boot_ok(r)
    m = re.search(r"^open=1 pid=(\d+)$", r.console, re.M)
    assert m and re.search(r"^openat2=1$", r.console, re.M), r.explain("the opener did not run")
    from rewriter.trace import formats as tracefmt
    recs = [x for x in (tracefmt.parse_line(l) for l in sections(r.console)["trace"]) if x is not None]
    return [x for x in recs if x.pid == int(m.group(1))]


@pytest.fixture(scope="module")
def traced(tmp_path_factory, debian_kernel, make_initramfs, boot_kernel):
    """The opener's records: (the rewritten kernel's BTF-compiled event's, the unmodified
    kernel's own tracefs event's).  Two boots: the kernel refuses its own kprobe on a
    function whose ftrace site a rewrite has taken ("Could not probe notrace function")."""
    d = tmp_path_factory.mktemp("perfprobe")
    spec = d / "probes.toml"
    spec.write_text('probes = ["kp_btf=do_sys_openat2 dfd file=filename:ustring how->flags how->mode how->resolve"]\n')
    out = d / "vmlinuz.kp"
    kprewrite("instrument", debian_kernel.vmlinuz, "--spec", spec, "-o", out)
    src = d / "opener.c"
    src.write_text(OPENER_C.replace("FILE", FILE))
    subprocess.run(["gcc", "-static", "-O2", "-o", d / "opener", src], check=True)
    off = _open_how(debian_kernel.vmlinux)
    reg = REGISTER_EVENT.replace("FLAGS", str(off["flags"])).replace("MODE", str(off["mode"])) \
        .replace("RESOLVE", str(off["resolve"]))
    show = f'echo "== trace"; cat {TRACING}/trace\necho "== end"\n'
    ours = _boot(boot_kernel, make_initramfs, "perfprobe-btf", out, d / "opener", "/opener\n" + show)
    commands = f"""
echo '{reg}' > {TRACING}/kprobe_events
echo 1 > {TRACING}/events/kprobes/kp_reg/enable
/opener
echo 0 > {TRACING}/events/kprobes/kp_reg/enable
""" + show
    theirs = _boot(boot_kernel, make_initramfs, "perfprobe-tracefs", debian_kernel.vmlinuz, d / "opener", commands)
    return [r.args for r in ours if r.event == "kp_btf"], [r.args for r in theirs if r.event == "kp_reg"]


def test_btf_event_equals_the_register_event(traced):
    ours, theirs = traced
    assert len(ours) == 2 and ours == theirs, (ours, theirs)
    # and they are the values the program passed (open() adds O_LARGEFILE on 64-bit)
    creat = {**ours[0], **{k: int(v, 16) for k, v in ours[0].items() if isinstance(v, str) and v.startswith("0x")}}
    assert creat["dfd"] == -100 and creat["file"] == FILE, creat
    assert creat["flags"] & 0o1101 == 0o1101 and creat["mode"] == 0o640 and creat["resolve"] == 0, creat
    o2 = {**ours[1], **{k: int(v, 16) for k, v in ours[1].items() if isinstance(v, str) and v.startswith("0x")}}
    assert o2["file"] == FILE and o2["flags"] & 0o2000000 and o2["mode"] == 0 and o2["resolve"] == 0x04, o2

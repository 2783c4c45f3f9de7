"""The kernel's safety rules that only a kernel shows (tests/test_safety_rules.py holds the
rest): each proven by a boot of Debian's vmlinux under QEMU.  One spec, four rewrites: with
every rule on, the kernel boots clean and every probe placed counts its hits; with one rule
switched off (KPREWRITE_UNSAFE_OFF, honoured because conftest sets KPREWRITE_TEST_SUITE), the
boot goes wrong: an oops, a panic, or /init never finishing.

- boot_patched_tables: a probe at do_exit+0x2d, whose region would take the paravirt call at
  +0x2f that apply_alternatives() rewrites at boot (to `pushf; pop %rax`);
- exception_tables: a probe on strncpy_from_user's word load (an __ex_table instruction),
  and do_exit's handler reading user address 16 with strncpy_from_user_nofault(): the load
  faults, and only at its own address does the exception table know a fixup;
- probe_in_region: probes at do_sys_openat2+0x5 and +0x7, the second inside the first's
  region (a kernel target does not share regions).

Four rewrites and four boots: run with -m kernel."""
from __future__ import annotations

import re
import subprocess

import pytest

from conftest import KPREWRITE, TREE_ENV, kprewrite

from kernel_env import DONE_MARKER, assert_boot_ok, init_script

pytestmark = pytest.mark.kernel

FORKS = 4
OPEN_FILE = "/etc/kprewrite-safety"
EFAULT = -14

HANDLERS = r"""
#include <linux/kprobes.h>

long strncpy_from_user_nofault(char *dst, const void __user *unsafe_addr, long count);

/* do_exit: every exit counts, and reads user address 16 with the kernel's nofault copy
 * (its load faults; the exception table's fixup makes it return -EFAULT). */
static int exit_hit(struct kprobe *p, struct pt_regs *regs)
{
	char buf[8];
	pr_info("kp-safety-exit: nofault=%ld\n",
		strncpy_from_user_nofault(buf, (const void __user *)16, sizeof(buf)));
	return 0;
}

static int open_a(struct kprobe *p, struct pt_regs *regs)
{
	pr_info("kp-safety-open-a\n");
	return 0;
}

static int open_b(struct kprobe *p, struct pt_regs *regs)
{
	pr_info("kp-safety-open-b\n");
	return 0;
}
"""

# strncpy_from_user's word load (+0x98): from a glob, as the rule refuses it a jump and an
# int3 alike (the int3 would sit on an instruction with an exception fixup): skipped, not an
# error, while the rule is on.
SPEC = """handlers = ["handlers.c"]
[[kprobe]]
symbol_name = "do_exit"
offset = 0x2d
pre_handler = "exit_hit"
[[kprobe]]
symbol_name = "strncpy_from_use?"
offset = 0x98
[[kprobe]]
symbol_name = "do_sys_openat2"
offset = 0x5
pre_handler = "open_a"
[[kprobe]]
symbol_name = "do_sys_openat2"
offset = 0x7
pre_handler = "open_b"
"""

# What `check` says with every rule on, and with each one off (only its own lines change).
ON = {"do_exit+0x2d": "int3  .altinstructions", "strncpy_from_user+0x98": "refused  __ex_table",
      "do_sys_openat2+0x5": "int3  probe_in_region", "do_sys_openat2+0x7": "optimized"}
OFF = {"boot_patched_tables": {"do_exit+0x2d": "optimized"},
       "exception_tables": {"strncpy_from_user+0x98": "optimized"},
       "probe_in_region": {"do_sys_openat2+0x5": "optimized"}}

COMMANDS = f"""
echo LOOP-START > /dev/kmsg
for i in {' '.join(str(i) for i in range(FORKS))}; do /bin/true; done
cat {OPEN_FILE} > /dev/null
echo LOOP-END > /dev/kmsg
sleep 1
"""


def _decisions(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        m = re.match(r"(\S+)  k  (\S+)(?:  (\S+))?", line)
        if m:
            out[m.group(1)] = f"{m.group(2)}  {m.group(3)}" if m.group(3) else m.group(2)
    return out


@pytest.fixture(scope="module")
def rewrites(tmp_path_factory, debian_kernel):
    """rewrites(rule or None) -> the vmlinux rewritten with that rule off (None: all on)."""
    d = tmp_path_factory.mktemp("safety")
    (d / "handlers.c").write_text(HANDLERS)
    spec = d / "probes.toml"
    spec.write_text(SPEC)
    cache = {}

    def get(rule):
        if rule not in cache:
            env = {**TREE_ENV, **({"KPREWRITE_UNSAFE_OFF": rule} if rule else {})}
            r = subprocess.run([*KPREWRITE, "check", debian_kernel.vmlinux, "--spec", spec],
                               capture_output=True, text=True, env=env)
            assert r.returncode == 0, r.stderr
            assert _decisions(r.stdout) == {**ON, **OFF.get(rule, {})}, r.stdout
            out = d / f"vmlinux.{rule or 'on'}"
            r = subprocess.run([*KPREWRITE, "instrument", debian_kernel.vmlinux, "--spec", spec, "-o", out],
                               capture_output=True, text=True, env=env)
            assert r.returncode == 0, r.stderr
            cache[rule] = out
        return cache[rule]
    return get


@pytest.fixture(scope="module")
def boots(rewrites, make_initramfs, boot_kernel):
    """boots(rule or None) -> the boot of rewrites(rule)."""
    initrd = make_initramfs(init_script(COMMANDS), {OPEN_FILE: "safety\n"})
    cache = {}

    def get(rule):
        if rule not in cache:
            # A broken kernel may hang after its oops (a good boot takes about ten seconds).
            cache[rule] = boot_kernel(f"safety-{rule or 'on'}", rewrites(rule), initrd, smp=2,
                                      timeout=120 if rule is None else 30)
        return cache[rule]
    return get


def _on(boots):
    """With every rule on: a clean boot, and every probe placed counts its hits."""
    r = boots(None)
    assert_boot_ok(r)
    loop = r.lines_between("LOOP-START", "LOOP-END")
    exits = [l for l in loop if "kp-safety-exit: " in l]
    assert len(exits) >= FORKS, r.explain(f"fewer than {FORKS} exits counted")
    assert all(l.endswith(f"nofault={EFAULT}") for l in exits), r.explain("the nofault read did not return -EFAULT")
    a = sum("kp-safety-open-a" in l for l in loop)
    b = sum("kp-safety-open-b" in l for l in loop)
    assert a == b and a >= 1, r.explain(f"opens counted {a} and {b} times")
    return r


def _goes_wrong(boots, rule: str, what: str):
    """With the rule on, _on(); with it off, the kernel reports `what` (a line of its oops)."""
    _on(boots)
    r = boots(rule)
    assert not r.reached(DONE_MARKER) or r.problems() or not r.powered_off, \
        r.explain(f"{rule} switched off, the kernel still boots clean")
    assert re.search(what, r.console), r.explain(f"{rule} switched off: no line matching {what!r}")


def test_boot_patched_tables(boots):
    # apply_alternatives() wrote `pushf; pop %rax` over the jump's rel32: the first exit
    # jumps to a garbage address in the kernel half.
    _goes_wrong(boots, "boot_patched_tables", r"BUG: unable to handle page fault for address: ffffffff")


def test_exception_tables(boots):
    # The word load faults at its copy in the detour, which no __ex_table entry names: an
    # oops for user address 16 instead of the fixup's -EFAULT.
    _goes_wrong(boots, "exception_tables", r"BUG: kernel NULL pointer dereference, address: 0000000000000010")


def test_probe_in_region(boots):
    # The second jump's bytes over the first one's: the first open jumps to garbage.
    _goes_wrong(boots, "probe_in_region", r"BUG: unable to handle page fault for address")

"""A probe on every function of Debian's kernel: one `[[kprobe]] symbol_name = "*"`
table with an empty pre_handler -- ftrace sites, jump-optimized entries and breakpoint probes
alike -- fits in the two gaps (the short stubs, docs/kernel.md "Where the code goes") and boots
with -smp 2 and no boot parameter: /init runs, the W+X check passes, the power-off is clean, and
kprobe_profile counts hits of each kind of probe.  The breakpoint sites from the glob keep their
instructions in the image and are armed at the sched_init_smp() boot hook (Xen PVH's entry runs
memcmp(), an int3 site, before any IDT; a CPU coming up runs native_write_cr4() before its own).
One rewrite (about a minute) and one boot (about 30 s under TCG): `pytest -m slow`.
benchmarks/kernel_entries.py --all measures the same."""
from __future__ import annotations

import re

import pytest

from conftest import kprewrite
from kernel_env import assert_boot_ok, init_script
from rewriter.elf.image import Image
from rewriter.targets import linux_kernel

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

HANDLER = "#include <linux/kprobes.h>\nint pre(struct kprobe *p, struct pt_regs *regs) { return 0; }\n"
# One function of each kind /init's boot surely runs (decisions checked below).
KINDS = {"do_sys_openat2": "ftrace", "strncmp": "optimized", "strcmp": "int3", "sched_clock_cpu": "int3"}


@pytest.fixture(scope="module")
def every(tmp_path_factory, debian_kernel):
    d = tmp_path_factory.mktemp("every")
    (d / "h.c").write_text(HANDLER)
    spec = d / "star.toml"
    spec.write_text('handlers = ["h.c"]\n[[kprobe]]\nsymbol_name = "*"\npre_handler = "pre"\n')
    r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec)
    decisions = {}
    for line in r.stdout.splitlines():
        f = line.split()
        if len(f) >= 3 and f[0].endswith("+0x0"):
            decisions.setdefault(f[0][:-4], f[2])
    out = d / "vmlinux.star"
    r = kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "-o", out)
    return {"out": out, "decisions": decisions, "stderr": r.stderr}


def test_every_function_fits(every, debian_kernel):
    m = re.search(r"(\d+) probes placed, (\d+) from globs skipped", every["stderr"])
    assert m and int(m.group(1)) > 45_000, every["stderr"]
    assert {f: every["decisions"].get(f) for f in KINDS} == KINDS
    image = Image(str(debian_kernel.vmlinux))
    linux_kernel.load_symbols(image)
    gap = linux_kernel.plan_layout(image)
    out = Image(str(every["out"]))
    text, data = out.section_named(".kprewrite.text"), out.section_named(".kprewrite.data")
    assert gap.rx_vaddr <= text.addr and text.addr + text.size <= gap.end, (hex(text.addr), text.size)
    assert gap.data_vaddr <= data.addr and data.addr + data.size <= gap.data_end, (hex(data.addr), data.size)
    # A breakpoint site from the glob is not armed in the image (the runtime arms it at boot).
    for f in ("strcmp", "sched_clock_cpu"):
        a = image.symbols[f][0]
        assert out.read(a, 1) == image.read(a, 1) != b"\xcc", f


def test_every_function_boots(every, make_initramfs, boot_kernel):
    initrd = make_initramfs(init_script("echo hello; ls / > /dev/null; cat /proc/version"))
    r = boot_kernel("every-function-smp2", every["out"], initrd, smp=2, timeout=600)
    assert_boot_ok(r)
    # Every row, wherever another CPU's line lands among the 45,000 (BootResult.profile() stops
    # there); static functions sharing a name share an event name.
    found = re.findall(r"\]   (p_\S+) +(\d+) +(\d+)", r.console)
    assert len(found) > 45_000, len(found)
    assert sum(1 for _, h, _ in found if int(h)) > 5_000, r.explain("few probes hit")
    rows = {e: (int(h), int(m)) for e, h, m in found}
    for f in KINDS:
        assert rows[f"p_{f}_0"][0] > 0, (f, rows[f"p_{f}_0"])


# A kretprobe with a handler on every function: the kretprobes' tables are built at boot too
# (16-byte records, struct kretprobe and the instance pools in memblock, names from kallsyms),
# the site records with the data: docs/kernel.md "kretprobes in a kernel".  The handler counts
# the returns it sees and says so at two marks.
KRET_HANDLER = """#include <linux/kprobes.h>
static unsigned long returns;
int ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	unsigned long n = __atomic_add_fetch(&returns, 1, __ATOMIC_RELAXED);
	if (n == 1000 || n == 1000000)
		pr_info("kretboot: %lu returns\\n", n);
	return 0;
}
"""


@pytest.fixture(scope="module")
def every_kret(tmp_path_factory, debian_kernel):
    d = tmp_path_factory.mktemp("every_kret")
    (d / "h.c").write_text(KRET_HANDLER)
    spec = d / "star.toml"
    spec.write_text('handlers = ["h.c"]\n[[kretprobe]]\nsymbol_name = "*"\nhandler = "ret"\n')
    out = d / "vmlinux.star"
    r = kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "-o", out)
    listed = [line for line in kprewrite("list", out).stdout.splitlines() if "  r  " in line]
    return {"out": out, "stderr": r.stderr, "listed": len(listed)}


def test_every_function_kretprobe_fits(every_kret, debian_kernel):
    m = re.search(r"(\d+) probes placed", every_kret["stderr"])
    assert m and int(m.group(1)) > 42_000 and every_kret["listed"] > 42_000, (every_kret["stderr"], every_kret["listed"])
    image = Image(str(debian_kernel.vmlinux))
    linux_kernel.load_symbols(image)
    gap = linux_kernel.plan_layout(image)
    out = Image(str(every_kret["out"]))
    text, data = out.section_named(".kprewrite.text"), out.section_named(".kprewrite.data")
    assert gap.rx_vaddr <= text.addr and text.addr + text.size <= gap.end, (hex(text.addr), text.size)
    assert gap.data_vaddr <= data.addr and data.addr + data.size <= gap.data_end, (hex(data.addr), data.size)


def test_every_function_kretprobe_boots(every_kret, make_initramfs, boot_kernel):
    """Boots to /init with -smp 2; debugfs lists every kretprobe; the handler ran for a
    million returns; kprobe_profile's rows count the entries and, where more tasks sleep in
    a function than its maxactive (10) instances, nmissed."""
    initrd = make_initramfs(init_script(
        "cat /proc/version\n"
        "echo kp-list-lines: $(grep -c '  r  ' /sys/kernel/debug/kprewrite/list)\n"
        "grep -E '^  r_(do_sys_openat2|kernel_clone|schedule)_0 ' /sys/kernel/debug/kprewrite/profile"
        " | while read -r l; do echo \"kp-profile: $l\"; done\n"))
    r = boot_kernel("every-kretprobe-smp2", every_kret["out"], initrd, smp=2, timeout=900)
    assert_boot_ok(r)
    assert re.search(r"kprewrite: built the tables of \d+ probes at setup_per_cpu_areas", r.console), r.explain("no tables")
    assert "kretboot: 1000000 returns" in r.console, r.explain("the return handler did not run a million times")
    m = re.search(r"^kp-list-lines: (\d+)$", r.console, re.M)
    assert m and int(m.group(1)) == every_kret["listed"], r.explain(f"debugfs list: {m and m.group(1)}")
    rows = {e: (int(h), int(n)) for e, h, n in re.findall(r"^kp-profile: (r_\S+) +(\d+) +(\d+)$", r.console, re.M)}
    assert set(rows) == {"r_do_sys_openat2_0", "r_kernel_clone_0", "r_schedule_0"}, r.explain(f"profile rows: {rows}")
    assert rows["r_do_sys_openat2_0"][0] > 0 and rows["r_kernel_clone_0"][0] > 0, rows
    assert rows["r_schedule_0"][1] > 0, rows        # more sleepers than maxactive

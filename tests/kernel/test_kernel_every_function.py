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

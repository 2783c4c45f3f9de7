"""Probe tables read-only in a kernel: from mark_rodata_ro() on, what a probe hit
follows to code -- the sites (their resume addresses), the probe lists, the handler pairs the
dispatch calls, the kretprobes' records and their kinds (the handlers), the records, the breakpoint descriptors and the
tables' own pointers -- cannot be written; what must change (struct kprobe's nmissed and flags,
handler data) still can.  Debian's vmlinux rewritten once, booted once (-smp 2, no boot
parameter), every assertion read from that boot.

The handlers try a write over each of them with the kernel's copy_to_kernel_nofault() (the
value written back unchanged), which returns -EFAULT where the page is read-only:
- at free_initmem(), the last thing kernel_init() does before mark_readonly(): every write
  succeeds (the tables are writable until then, as the kernel's __ro_after_init data is);
- at do_sys_openat2() when /init opens a marker file, in user space's time: every write over
  the tables fails, the writes over struct kprobe's nmissed and a handler's own data succeed;
- then a handler stores other code's address in the writable handler fields of its struct
  kprobe and of the kretprobe's struct kretprobe (plain stores: no fault): nothing calls them,
  the next open runs the probes' own handlers (the dispatch calls through the read-only pairs),
  and the profile at power-off counts every hit;
- the kernel's W+X check passes and the boot is clean (no oops).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

from kernel_env import DONE_MARKER, WX_PASSED, assert_boot_ok, init_script

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rewriter.elf.image import Image  # noqa: E402
from rewriter.targets import linux_kernel  # noqa: E402

pytestmark = pytest.mark.kernel

MARKER = "/etc/kp-ro-marker"        # a file only /init opens
OPENS = 3                           # the opens of MARKER /init makes

COMMANDS = f"""
for i in {' '.join(str(i) for i in range(OPENS))}; do cat {MARKER} > /dev/null; done
echo {DONE_MARKER}
sleep 1
"""

# The runtime's tables, by the names the runtime gives them (the handlers are linked with it).
HANDLERS = r"""
#include <linux/kprobes.h>

long copy_to_kernel_nofault(void *dst, const void *src, unsigned long size);
long strncpy_from_user_nofault(char *dst, const void __user *unsafe_addr, long count);

struct kp_handler_rec { void *pre, *post; };
struct kp_site { unsigned long addr, post_ip, resume, resume_post; unsigned int first, count; };
extern const struct kp_handler_rec *kp_site_handlers;	/* the pairs the dispatch calls */
extern struct kp_site *kp_sites;
extern struct kprobe *const *kp_site_probes;
extern const struct kp_handler_rec *kp_site_fast;	/* a clean hit's probe and pre_handler per site */
extern struct kprobe *kp_probes;
extern const struct kp_handler_rec kp_rec_handlers[];	/* the records' handler pairs */
extern char kp_probe_recs[], kp_site_recs[];
extern char kp_kret_recs[];				/* a kretprobe's record names its kind */
extern const struct kp_handler_rec kp_kret_kinds[];	/* {handler, entry_handler, ...} */
extern struct kretprobe *kp_kretprobes;
extern const struct kp_handler_rec *kp_kret_handler_table;	/* built from the kinds: the dispatch's */
extern char kp_breakpoints[];				/* the breakpoint descriptors */
extern const unsigned int kp_nsites;

static unsigned long seen;		/* handler data: writable */

/* A write of the bytes at `at` with their own value: 0, or -EFAULT (-14) on a read-only page. */
static long rw(const void *at, unsigned long size)
{
	return copy_to_kernel_nofault((void *)at, at, size);
}
#define RW(x) rw(&(x), sizeof(x))

static void try_writes(const char *when, struct kprobe *p)
{
	const struct kp_site *last = &kp_sites[kp_nsites - 1];
	pr_info("kp-ro-%s: site_handlers=%ld sites=%ld site_probes=%ld ptr_handlers=%ld ptr_sites=%ld "
		"ptr_probes=%ld rec_handlers=%ld probe_recs=%ld site_recs=%ld kret_recs=%ld kret_kinds=%ld "
		"ptr_krets=%ld kret_handlers=%ld ptr_kret_handlers=%ld int3_sites=%ld site_fast=%ld ptr_site_fast=%ld nmissed=%ld flags=%ld data=%ld\n", when,
		RW(kp_site_handlers[last->first]), RW(last->resume), RW(kp_site_probes[last->first]),
		RW(kp_site_handlers), RW(kp_sites), RW(kp_site_probes), RW(kp_rec_handlers[0]),
		rw(kp_probe_recs, 8), rw(kp_site_recs, 8), rw(kp_kret_recs, 8), RW(kp_kret_kinds[0]), RW(kp_kretprobes),
		RW(kp_kret_handler_table[0]), RW(kp_kret_handler_table), rw(kp_breakpoints, 8),
		RW(kp_site_fast[kp_nsites - 1]), RW(kp_site_fast), RW(p->nmissed), RW(p->flags), RW(seen));
}

static int evil(struct kprobe *p, struct pt_regs *regs)
{
	pr_info("kp-ro-evil: called\n");
	return 0;
}

/* free_initmem(): kernel_init()'s last step before mark_readonly(). */
static int before_ro(struct kprobe *p, struct pt_regs *regs)
{
	try_writes("before", p);
	return 0;
}

static int is_marker(unsigned long user_name)
{
	char name[64];
	long n = strncpy_from_user_nofault(name, (const void __user *)user_name, sizeof(name) - 1);
	name[n > 0 ? n : 0] = 0;
	return n > 0 && __builtin_strcmp(name, "MARKER") == 0;
}

/* do_sys_openat2(dfd, filename, how), at its entry. */
static int open_entry(struct kprobe *p, struct pt_regs *regs)
{
	if (!is_marker(regs->si))
		return 0;
	unsigned long n = __atomic_add_fetch(&seen, 1, __ATOMIC_RELAXED);
	pr_info("kp-ro-open: %lu\n", n);
	if (n == 1) {
		try_writes("after", p);
		/* The writable handler fields: plain stores, never called. */
		p->pre_handler = evil;
		kp_kretprobes[0].kp.pre_handler = evil;
		kp_kretprobes[0].handler = (kretprobe_handler_t)evil;
		kp_kretprobes[0].entry_handler = (kretprobe_handler_t)evil;
		pr_info("kp-ro-redirected: %d\n", p->pre_handler == evil);
	}
	return 0;
}

/* The breakpoint probe inside do_sys_openat2 (optimize = false). */
static unsigned long inside_hits;
static int open_inside(struct kprobe *p, struct pt_regs *regs)
{
	__atomic_add_fetch(&inside_hits, 1, __ATOMIC_RELAXED);
	return 0;
}

/* A kretprobe on do_sys_openat2: the marker's opens return a descriptor. */
static int ret_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	return !is_marker(regs->si);	/* non-zero: no return handler for this call */
}

static int ret_handler(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("kp-ro-ret: fd=%ld inside_hits=%d\n", (long)regs->ax,
		__atomic_load_n(&inside_hits, __ATOMIC_RELAXED) > 0);
	return 0;
}
"""


@pytest.fixture(scope="module")
def probed(tmp_path_factory, debian_kernel):
    d = tmp_path_factory.mktemp("ro_tables")
    image = Image(str(debian_kernel.vmlinux))
    linux_kernel.load_symbols(image)
    f = next(f for f in image.functions if f.name == "do_sys_openat2")
    assert image.read(f.start, 1) == b"\xe8"        # call __fentry__: the next instruction is at +5
    (d / "ro_handlers.c").write_text(HANDLERS.replace("MARKER", MARKER))
    spec = d / "probes.toml"
    spec.write_text('optimize = false\nhandlers = ["ro_handlers.c"]\n'
                    '[[kprobe]]\nsymbol_name = "free_initmem"\npre_handler = "before_ro"\n'
                    '[[kprobe]]\nsymbol_name = "do_sys_openat2"\npre_handler = "open_entry"\n'
                    '[[kprobe]]\nsymbol_name = "do_sys_openat2"\noffset = 5\npre_handler = "open_inside"\n'
                    '[[kretprobe]]\nsymbol_name = "do_sys_openat2"\nhandler = "ret_handler"\n'
                    'entry_handler = "ret_entry"\n')
    r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec)
    lines = r.stdout.splitlines()
    # The entry's jump cannot follow its ftrace site (the probe at +5 is there): the site is taken.
    assert lines[:3] == ["free_initmem+0x0  k  ftrace", "do_sys_openat2+0x0  k  ftrace  site taken, not shared "
                         "with ftrace: probe_in_region at " + f"{f.start + 5:#x}: another probe sits in "
                         f"[{f.start + 5:#x}, {f.start + 10:#x}), where the jump past the ftrace site would go"] \
        + lines[2:3], r.stdout
    assert lines[2].startswith("do_sys_openat2+0x5  k  int3"), r.stdout
    out = d / "vmlinux.kp"
    kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "-o", out)
    return out


@pytest.fixture(scope="module")
def ro_boot(probed, make_initramfs, boot_kernel):
    initrd = make_initramfs(init_script(COMMANDS), {MARKER.lstrip("/"): "ro\n"})
    return boot_kernel("ro-tables-vmlinux-smp2", probed, initrd, smp=2, timeout=180)


def _writes(r, when: str) -> dict[str, int]:
    m = re.search(rf"kp-ro-{when}: (.*)$", r.console, re.M)
    assert m, r.explain(f"no kp-ro-{when} line")
    return {k: int(v) for k, v in (kv.split("=") for kv in m.group(1).split())}


TABLES = ("site_handlers", "sites", "site_probes", "ptr_handlers", "ptr_sites", "ptr_probes", "rec_handlers",
          "probe_recs", "site_recs", "kret_recs", "kret_kinds", "ptr_krets", "kret_handlers",
          "ptr_kret_handlers", "int3_sites", "site_fast", "ptr_site_fast")
EFAULT = -14


def test_boot_is_clean_and_wx_check_passes(ro_boot):
    r = ro_boot
    assert_boot_ok(r)           # user space, /init done, W+X check passed, no oops/BUG/WARNING
    m = re.search(r"kprewrite: probe tables read-only: (\d+) KiB of sites, probe lists and handlers; "
                  r"(\d+) KiB of records and descriptors", r.console)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0, r.explain("no line from the set_memory_ro() boot hook")
    lines = r.lines()
    at = next(n for n, l in enumerate(lines) if "kprewrite: probe tables read-only" in l)
    wx = next(n for n, l in enumerate(lines) if WX_PASSED in l)
    assert at < wx, r.explain("the tables went read-only after the W+X check")


def test_tables_writable_until_mark_rodata_ro(ro_boot):
    """At free_initmem(), just before mark_readonly(): the tables are still being set up."""
    r = ro_boot
    w = _writes(r, "before")
    assert set(w) == set(TABLES) | {"nmissed", "flags", "data"}
    # The rodata in our text gap is the kernel text mapping's: writable until mark_rodata_ro() too.
    assert all(v == 0 for v in w.values()), r.explain(f"a write before mark_rodata_ro() failed: {w}")
    lines = r.lines()
    before = next(n for n, l in enumerate(lines) if "kp-ro-before:" in l)
    assert before < next(n for n, l in enumerate(lines) if "kprewrite: probe tables read-only" in l)


def test_tables_read_only_after_mark_rodata_ro(ro_boot):
    """In user space's time: every write over the tables faults (copy_to_kernel_nofault()'s
    -EFAULT), the counters, flags and handler data stay writable."""
    r = ro_boot
    w = _writes(r, "after")
    wrote = {k for k in TABLES if w[k] != EFAULT}
    assert not wrote, r.explain(f"writable after mark_rodata_ro(): {sorted(wrote)} ({w})")
    assert w["nmissed"] == w["flags"] == w["data"] == 0, r.explain(f"the writable state is not writable: {w}")


def test_handler_fields_are_not_called_and_probes_still_count(ro_boot):
    """The struct kprobe / struct kretprobe handler fields pointed at other code: nothing calls
    it; every open of the marker still runs the probes' own handlers, and every hit counts."""
    r = ro_boot
    assert "kp-ro-redirected: 1" in r.console, r.explain("the handler did not store over its fields")
    assert "kp-ro-evil" not in r.console, r.explain("a probe called the handler field written at run time")
    opens = re.findall(r"kp-ro-open: (\d+)$", r.console, re.M)
    assert opens == [str(i + 1) for i in range(OPENS)], r.explain(f"{OPENS} opens of {MARKER} expected")
    rets = re.findall(r"kp-ro-ret: fd=(\d+) inside_hits=1$", r.console, re.M)
    assert len(rets) == OPENS, r.explain("the kretprobe's return handler did not fire on every open")
    prof = r.profile()
    entry = prof["p_do_sys_openat2_0"]
    inside = prof["p_do_sys_openat2_5"]
    assert entry[0] >= OPENS and inside[0] >= OPENS, r.explain(f"hits: {prof}")
    assert prof["p_free_initmem_0"][0] == 1, r.explain(f"hits: {prof}")

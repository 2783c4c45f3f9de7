"""kprobe_events lines and fetch args in Debian's kernel, into the kernel's own ftrace ring buffer.
One rewrite of Debian's vmlinuz and one boot (-smp 2, KASLR on) for the module:

- `events` lines on do_sys_openat2 (an ftrace site): `$arg1`, `+0(%si):ustring` (the file name in
  user memory, copy_from_user_nofault), `+0(%si):string` on that user pointer (kernel memory only:
  (fault), as the kernel's copy_from_kernel_nofault() refuses it), `$comm`, `$stack0:symbol` (the
  running kernel's kallsyms), `@linux_banner:string` (a kernel data symbol, moved by KASLR);
- a `fetch` string on a [[kprobe]] in do_filp_open: `+0(+0(%si)):string`, struct filename's name
  in kernel memory;
- a static program opening a missing file and a bad pointer (0x1000): (fault), no oops;
- the trace file read from /init: our lines in the kernel's format, between the lines of the
  kernel's own tracefs kprobe event on getname (which do_sys_openat2 calls between the two probes of ours);
- an event on trap_init(), before early_trace_init() has made the ring buffer: printk;
- `kprewrite trace` on the saved trace file: JSON lines and the Chrome/Perfetto timeline;
- where the tree has kernel kretprobes, an `r` line's `$retval` (else that test is skipped).
"""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

from kernel_env import assert_boot_ok, init_script, sections

pytestmark = pytest.mark.kernel

TRACING = "/sys/kernel/tracing"
MISSING = "/kp-events-missing"
BAD = 0x1000

SPEC = r'''
events = [
  "p:kp_open do_sys_openat2 dfd=$arg1:s32 file=+0(%si):ustring kfile=+0(%si):string comm=$comm caller=$stack0:symbol",
  "p:kp_banner do_sys_openat2 banner=@linux_banner:string jif=@jiffies_64:u64",
  "p:kp_early trap_init",
]

[[kprobe]]
symbol_name = "do_filp_open"
name = "kp_filp"
fetch = "name=+0(+0(%si)):string"
'''

OPENER_C = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
#include <sys/syscall.h>

int main(void)
{
	int fd = open("MISSING", O_RDONLY);
	printf("open-missing=%d errno=%d pid=%d\n", fd, fd < 0 ? errno : 0, getpid());
	long r = syscall(SYS_openat, AT_FDCWD, (const char *)BAD, O_RDONLY);
	printf("open-bad=%ld errno=%d\n", r, r < 0 ? errno : 0);
	return 0;
}
"""

COMMANDS = f"""
echo 'p:kpk getname name=+0(%di):ustring' > {TRACING}/kprobe_events
echo 1 > {TRACING}/events/kprobes/kpk/enable
/opener
echo 0 > {TRACING}/events/kprobes/kpk/enable
echo "== trace"; cat {TRACING}/trace
echo "== version"; cat /proc/version
echo "== end"
"""


# `$retval` needs kernel kretprobes: the `r` line is kept where the tree places them.
RETURN_EVENT = '  "r:kp_open_ret do_sys_openat2 ret=$retval:s64",\n'


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory, debian_kernel):
    d = tmp_path_factory.mktemp("events")
    spec = d / "probes.toml"
    spec.write_text(SPEC.replace('  "p:kp_early', RETURN_EVENT + '  "p:kp_early'))
    r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec, check=False)
    kret = r.returncode == 0
    if not kret:
        assert "kretprobes are not supported" in r.stderr, r.stderr
        spec.write_text(SPEC)
        r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec)
    lines = r.stdout.splitlines()
    assert any(l.startswith("do_sys_openat2+0x0  k  ftrace") for l in lines), lines
    assert any(l.startswith("trap_init+0x0  k  ") for l in lines), lines
    out = d / "vmlinuz.kp"
    kprewrite("instrument", debian_kernel.vmlinuz, "--spec", spec, "-o", out)
    src = d / "opener.c"
    src.write_text(OPENER_C.replace("MISSING", MISSING).replace("BAD", hex(BAD)))
    subprocess.run(["gcc", "-static", "-O2", "-o", d / "opener", src], check=True)
    return {"dir": d, "out": out, "opener": d / "opener", "kret": kret}


@pytest.fixture(scope="module")
def booted(rewritten, make_initramfs, boot_kernel):
    initrd = make_initramfs(init_script(COMMANDS), {"opener": rewritten["opener"]})
    r = boot_kernel("events-bzimage-smp2", rewritten["out"], initrd, smp=2, timeout=240)
    assert_boot_ok(r)
    return r


@pytest.fixture(scope="module")
def trace(booted):
    """(the trace file's lines, the records `kprewrite trace` made of them, opener's pid)."""
    from rewriter.trace import formats as tracefmt
    lines = sections(booted.console)["trace"]
    m = re.search(r"^open-missing=-1 errno=2 pid=(\d+)$", booted.console, re.M)
    assert m, booted.explain("the opener did not run")
    recs = [r for r in (tracefmt.parse_line(l) for l in lines) if r is not None]
    return lines, recs, int(m.group(1))


def test_ustring_from_user_memory_and_fault(booted, trace):
    """The file name read from user memory; the bad pointer reads as (fault), never an oops
    (assert_boot_ok); a kernel `string` on a user pointer is (fault) too, as in the kernel."""
    assert re.search(r"^open-bad=-1 errno=14$", booted.console, re.M), booted.explain("openat(0x1000)")
    _, recs, pid = trace
    mine = [r for r in recs if r.pid == pid and r.event == "kp_open"]
    assert [r.args["file"] for r in mine] == [MISSING, "(fault)"], mine
    for r in mine:
        assert r.args["dfd"] == -100 and r.args["comm"] == "opener" and r.comm == "opener", r
        assert r.args["kfile"] == "(fault)", r
        assert re.fullmatch(r"(do_sys_open|__x64_sys_openat)\+0x[0-9a-f]+/0x[0-9a-f]+", r.args["caller"]), r
        assert r.loc.startswith("do_sys_openat2+0x0/0x"), r


def test_kernel_memory_strings_and_data_symbols(booted, trace):
    """@linux_banner read through kallsyms' address moved by KASLR equals /proc/version;
    @jiffies_64 never goes back; struct filename's name (kernel memory) is the file opened."""
    _, recs, pid = trace
    version = sections(booted.console)["version"][0]
    banners = [r for r in recs if r.event == "kp_banner"]
    assert banners and all(r.args["banner"] == version + "\n" for r in banners), (version, banners[:2])
    jif = [r.args["jif"] for r in banners]
    assert all(isinstance(j, int) for j in jif) and jif == sorted(jif), jif
    filp = [r.args["name"] for r in recs if r.pid == pid and r.event == "kp_filp"]
    assert filp == ["/opener", MISSING], filp      # execve's do_open_execat(), then the open


def test_lines_in_the_ring_buffer_next_to_the_kernels_own_event(trace):
    """Entries of our events' own output types, printed as the kernel prints its kprobe
    events' (context, irq flags, then "EVENT: (SYM+off/size) args": no trace_printk() ip in
    front), and in order with the kernel's own kprobe event on getname: do_sys_openat2's
    entry, then getname (which reads the same name, or the same fault), then do_filp_open."""
    lines, recs, pid = trace
    ours = [l for l in lines if " kp_open: " in l and f"-{pid} " in l]
    assert ours and all(re.match(rf"^\s+opener-{pid}\s+\[\d\d\d\] \S{{5}}\s+\d+\.\d{{6}}: kp_open: "
                                 r"\(do_sys_openat2\+0x0/0x[0-9a-f]+\) dfd=-100 ", l) for l in ours), ours
    # the kernel's own event's line has the same shape
    kpk = [l for l in lines if " kpk: " in l and f"-{pid} " in l]
    assert kpk and all(re.match(rf"^\s+opener-{pid}\s+\[\d\d\d\] \S{{5}}\s+\d+\.\d{{6}}: kpk: \(getname\+0x0/", l)
                       for l in kpk), kpk
    # /init's own lines, before any event of the kernel was enabled: its name saved too
    # (tracing_record_cmdline()), not "<...>"
    early = [l for l in lines if " kp_open: " in l and "-1 " in l]
    assert early and all(l.lstrip().startswith("init-1 ") for l in early), early[:3]
    seq = [(r.event, r.args.get("file", r.args.get("name"))) for r in recs
           if r.pid == pid and r.event in ("kp_open", "kpk", "kp_filp")]
    assert seq == [("kpk", "/opener"), ("kp_filp", "/opener"),       # the shell's execve of /opener
                   ("kp_open", MISSING), ("kpk", MISSING), ("kp_filp", MISSING),
                   ("kp_open", "(fault)"), ("kpk", "(fault)")], seq


def test_printk_before_the_ring_buffer(booted):
    """trap_init() runs before early_trace_init(): its event goes to the kernel log, whole."""
    from rewriter.trace import formats as tracefmt
    early = [l for l in booted.lines() if " kp_early: " in l]
    assert len(early) == 1, booted.explain("one kp_early line in the kernel log")
    r = tracefmt.parse_line(early[0])
    assert r and r.comm.startswith("swapper") and r.pid == 0 and r.loc.startswith("trap_init+0x0/0x"), early


def test_kprewrite_trace_reads_the_saved_trace_file(trace, tmp_path):
    lines, _, pid = trace
    saved = tmp_path / "trace"
    saved.write_text("\n".join(lines) + "\n")
    recs = [json.loads(l) for l in kprewrite("trace", saved).stdout.splitlines()]
    events = {r["event"] for r in recs}
    assert {"kp_open", "kp_banner", "kpk", "kp_filp"} <= events, events
    first = next(r for r in recs if r["event"] == "kp_open" and r["pid"] == pid)
    assert first["args"]["file"] == MISSING and first["func"] == "do_sys_openat2" and first["kind"] == "probe", first
    doc = json.loads(kprewrite("trace", saved, "--format", "chrome").stdout)
    # an event at a function's entry whose return is traced too is the call's slice (its entry event in args)
    names = {e["name"] if e.get("ph") == "i" else e["args"]["entry"] for e in doc["traceEvents"]
             if e.get("ph") in ("i", "X")}
    assert {"kp_open", "kpk", "kp_filp"} <= names, names
    threads = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert "opener" in threads, threads
    # `kprewrite report`: each event counted as the records were
    rep = json.loads(kprewrite("report", saved, "--format", "json").stdout)
    counts = {e["event"]: e["count"] for e in rep["events"]}
    assert counts["kp_open"] == sum(r["event"] == "kp_open" for r in recs), counts


def test_retval_of_a_return_event(rewritten, trace):
    """An `r` line: `$retval` of do_sys_openat2 (-ENOENT, then -EFAULT for the bad pointer), the
    caller as the kernel's kretprobe events print it, and the timeline's slice pairing both."""
    if not rewritten["kret"]:
        pytest.skip("kernel kretprobes are not in this tree: `r` lines are refused")
    lines, recs, pid = trace
    rets = [r for r in recs if r.pid == pid and r.event == "kp_open_ret"]
    assert [r.args["ret"] for r in rets] == [-2, -14], rets
    assert all(re.fullmatch(r"(do_sys_open|__x64_sys_openat)\+0x[0-9a-f]+/0x[0-9a-f]+ <- do_sys_openat2", r.loc)
               for r in rets), rets
    from rewriter.trace import formats as tracefmt
    doc = tracefmt.chrome([r for r in recs if r.event != "kp_banner"])   # one entry event per call
    slices = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e["tid"] == pid]
    assert [(e["name"], e["args"]["entry.file"], e["args"]["return.ret"]) for e in slices] == [
        ("do_sys_openat2", MISSING, -2), ("do_sys_openat2", "(fault)", -14)], slices

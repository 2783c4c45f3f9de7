"""Trace events on Debian's arm64 kernel (kprobe_events lines and `fetch` args): each hit's fetched
values written into the kernel's ftrace ring buffer by the runtime placed at boot
(aarch64/runtime.py: kp_trace.c, kp_fetch.c, kp_trace_buffer.c in the blob), the detour's
dispatch (or the kretprobe trampoline) calling the event's handler through a pointer in the
Image's kept data (aarch64/build.py: events_c()), each event a trace_event_call with
/sys/kernel/tracing/events/kprobes/<EVENT>/.  One boot (qemu-system-aarch64 -M virt -cpu max,
KASLR):

- `p:kp_open do_filp_open dfd=%x0:s32 arg1=$arg1:s32 path=+0(+0(%x1)):string`: `cat /kp-one`
  opens "/kp-one" from the current directory (AT_FDCWD, -100): the line has both, from the
  registers' names and the argument's, and the string through struct filename's name;
- `r:kp_ppid __arm64_sys_getppid ret=$retval:s32`: a shell started by /init (pid 1) reads
  getppid() for $PPID: the return value 1;
- a [[kprobe]] with `fetch` and a pre_handler on __arm64_sys_getppid's entry: `pc=%pc` is the
  function's address where the kernel runs (/proc/kallsyms), `@__arm64_sys_getppid+4` reads its
  second ftrace NOP there (KASLR), and the handler still runs;
- `format` lists the fields (the kernel's names, types and offsets) and the print fmt; a
  `filter` on the string field keeps one file's lines; `enable` 0 writes nothing;
- a `trigger` (hist) counts the hits by path;
- an event on a breakpoint probe (strncpy_from_user+16: `brk`, the kernel's break hook) writes
  its lines too (getname()'s count, EMBEDDED_NAME_MAX);
- perf-probe lines (`probes`, from the Image's BTF: `dfd` and `pathname->name:string` as perf
  probe fetches them, x0 and the string through x1's struct filename; `%return $retval`) write
  the same values.
"""
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

HANDLER = r"""#include <linux/kprobes.h>

int ppid_pre(struct kprobe *p, struct pt_regs *regs)
{
	pr_info("kprewrite-ev: getppid handler\n");
	return 0;
}
"""
SPEC = """handlers = ["h.c"]
events = [
  "p:kp_open do_filp_open dfd=%x0:s32 arg1=$arg1:s32 path=+0(+0(%x1)):string",
  "r:kp_ppid __arm64_sys_getppid ret=$retval:s32",
  "p:kp_brk strncpy_from_user+16 count=%x2:u32",
]
probes = ["do_filp_open dfd pathname->name:string", "__arm64_sys_getppid%return $retval"]
[[kprobe]]
symbol_name = "__arm64_sys_getppid"
name = "kp_getppid"
pre_handler = "ppid_pre"
fetch = "pc=%pc sp=%sp nop=@__arm64_sys_getppid+4:x32"
"""
T = "/sys/kernel/tracing"
E = f"{T}/events/kprobes"
INIT = (f"grep -w -e __arm64_sys_getppid -e invoke_syscall /proc/kallsyms\n"
        "echo one > /kp-one; echo two > /kp-two\n"
        f"echo \"== ls\"; ls {E}/kp_open\n"
        f"echo \"== enable\"; cat {E}/kp_open/enable {E}/kp_ppid/enable {E}/kp_getppid/enable\n"
        f"echo \"== format\"; cat {E}/kp_open/format\n"
        f"echo \"== format_ret\"; cat {E}/kp_ppid/format\n"
        f"echo > {T}/trace\n"
        "cat /kp-one >/dev/null\n"
        "sh -c 'echo PPID=$PPID'\n"
        f"echo \"== trace\"; cat {T}/trace\n"
        f"echo 'path == \"/kp-two\"' > {E}/kp_open/filter\n"
        f"echo > {T}/trace\n"
        "cat /kp-one /kp-two /kp-one >/dev/null\n"
        f"echo \"== trace_filter\"; cat {T}/trace\n"
        f"echo 0 > {E}/kp_open/filter\n"
        f"echo 'hist:keys=path' > {E}/kp_open/trigger\n"
        "cat /kp-two /kp-two /kp-two >/dev/null\n"
        f"echo \"== hist\"; cat {E}/kp_open/hist\n"
        f"echo '!hist:keys=path' > {E}/kp_open/trigger\n"
        f"echo 0 > {E}/kp_open/enable; echo 0 > {E}/kp_ppid/enable; echo 0 > {E}/kp_getppid/enable\n"
        f"echo > {T}/trace\n"
        "cat /kp-one >/dev/null; sh -c 'echo PPID=$PPID'\n"
        f"echo \"== trace_off\"; cat {T}/trace\n"
        "echo \"== end\"\n")

_env = arm64_env.env


@pytest.fixture(scope="module")
def ev_boot(arm64_kernel, tmp_path_factory):
    d = tmp_path_factory.mktemp("arm64-events")
    (d / "h.c").write_text(HANDLER)
    spec = d / "probes.toml"
    spec.write_text(SPEC)
    out = d / "Image.kp"
    kprewrite("instrument", arm64_kernel.vmlinuz, "--spec", spec, "-o", out)
    rd = _env(arm64_env.build_initramfs, kernel_env.init_script(INIT))
    r = _env(lambda: arm64_env.boot(out, rd, log=d / "arm64-events.console.txt"))
    assert r.reached() and r.powered_off, r.explain("no clean boot to user space and power-off")
    assert not r.problems(), r.explain("kernel problems")
    assert "== end" in r.console, r.explain("/init")
    return r


def _section(r, name: str) -> list[str]:
    text = r.console
    start = text.index(f"== {name}\n") + len(f"== {name}\n")
    end = text.index("\n== ", start)
    return [l for l in text[start:end].splitlines() if l.strip() and not re.match(r"^\[\s*\d+\.\d+\]", l)]


def _events(lines: list[str], event: str) -> list[str]:
    return [l for l in lines if f" {event}: " in l]


def _kallsyms(r) -> dict[str, int]:
    return {m.group(2): int(m.group(1), 16) for m in re.finditer(r"^([0-9a-f]{16}) [tT] (\w+)$", r.console, re.M)}


def test_event_folders_enabled_from_boot(ev_boot):
    """Each event is a trace_event_call: events/kprobes/<EVENT>/ has the kernel's files, and the
    events are enabled in the top instance from their registration on."""
    assert {"enable", "filter", "format", "hist", "id", "trigger"} <= set(" ".join(_section(ev_boot, "ls")).split())
    assert _section(ev_boot, "enable") == ["1", "1", "1"], ev_boot.explain("enable")


def test_format_lists_the_fields(ev_boot):
    """`format`: __probe_ip then each fetch arg at its offset with the kernel's type names
    (s32, a string's __data_loc), and the print fmt; a kretprobe event's __probe_func and
    __probe_ret_ip."""
    fmt = _section(ev_boot, "format")
    fields = [re.sub(r"\s+", " ", l.strip()) for l in fmt if l.strip().startswith("field:")]
    assert fields[-4:] == ["field:unsigned long __probe_ip; offset:8; size:8; signed:0;",
                           "field:s32 dfd; offset:16; size:4; signed:1;",
                           "field:s32 arg1; offset:20; size:4; signed:1;",
                           "field:__data_loc char[] path; offset:24; size:4; signed:1;"], fmt
    assert fmt[-1] == ('print fmt: "(%lx) dfd=%d arg1=%d path=\\"%s\\"", REC->__probe_ip, REC->dfd, REC->arg1, '
                       '__get_str(path)'), fmt
    ret = [re.sub(r"\s+", " ", l.strip()) for l in _section(ev_boot, "format_ret") if l.strip().startswith("field:")]
    assert ret[-3:] == ["field:unsigned long __probe_func; offset:8; size:8; signed:0;",
                        "field:unsigned long __probe_ret_ip; offset:16; size:8; signed:0;",
                        "field:s32 ret; offset:24; size:4; signed:1;"], ret


def test_values_in_the_ring_buffer(ev_boot):
    """The trace has the values the program caused: cat's open of /kp-one from AT_FDCWD (-100, in
    x0 and as $arg1), the string through struct filename; the shell's getppid() returning 1; the
    [[kprobe]]'s pc, getppid's address under KASLR, its handler run once per hit."""
    r = ev_boot
    trace = _section(r, "trace")
    opens = [l for l in _events(trace, "kp_open") if " cat-" in l and "/kp-" in l]
    assert len(opens) == 1 and re.search(r': \(do_filp_open\+0x0/0x[0-9a-f]+\) dfd=-100 arg1=-100 path="/kp-one"$',
                                         opens[0]), trace
    ppid = [l for l in _events(trace, "kp_ppid") if " sh-" in l]
    assert len(ppid) == 1 and re.search(r": \(invoke_syscall\+0x[0-9a-f]+/0x[0-9a-f]+ <- __arm64_sys_getppid\) "
                                        r"ret=1$", ppid[0]), trace
    kall = _kallsyms(r)
    hits = [l for l in _events(trace, "kp_getppid") if " sh-" in l]
    assert len(hits) == 1, trace
    # @SYM: the second ftrace NOP where the kernel runs (KASLR: the link address + the offset)
    m = re.search(r"\(__arm64_sys_getppid\+0x0/0x[0-9a-f]+\) pc=0x([0-9a-f]+) sp=0x([0-9a-f]+) nop=0xd503201f$",
                  hits[0])
    assert m and int(m.group(1), 16) == kall["__arm64_sys_getppid"] and int(m.group(2), 16) >> 48 == 0xffff, hits
    assert "PPID=1" in r.console and "kprewrite-ev: getppid handler" in r.console, r.explain("the handler")


def test_perf_probe_lines(ev_boot):
    """`probes` lines, translated from BTF as perf probe translates them (check prints the
    kprobe_events line): their events carry the values the tracefs-syntax events above carry."""
    trace = _section(ev_boot, "trace")
    opens = [l for l in _events(trace, "do_filp_open") if " cat-" in l and "/kp-" in l]
    assert len(opens) == 1 and re.search(r': \(do_filp_open\+0x0/0x[0-9a-f]+\) dfd=-100 name="/kp-one"$', opens[0]), trace
    ret = [l for l in _events(trace, "__arm64_sys_getppid__return") if " sh-" in l]
    assert len(ret) == 1 and re.search(r": \(invoke_syscall\+0x[0-9a-f]+/0x[0-9a-f]+ <- __arm64_sys_getppid\) "
                                       r"retval=1$", ret[0]), trace


def test_perf_probe_lines_translated(arm64_kernel, tmp_path):
    """What perf probe would fetch for them on arm64: `check` prints the kprobe_events lines."""
    spec = tmp_path / "p.toml"
    spec.write_text('probes = ["do_filp_open dfd pathname->name:string", "__arm64_sys_getppid%return $retval"]\n')
    r = kprewrite("check", arm64_kernel.vmlinuz, "--spec", spec)
    assert r.stdout.splitlines()[-2:] == [
        "probes[1]: p:probe/do_filp_open do_filp_open dfd=%x0:s32 name=+0(+0(%x1)):string",
        "probes[2]: r:probe/__arm64_sys_getppid__return __arm64_sys_getppid retval=$retval:s64"], r.stdout


def test_event_on_a_breakpoint_probe(ev_boot):
    """strncpy_from_user+16 takes a `brk` (no jump fits there): its event is written from the
    break hook's dispatch; cat's getname() copies its paths with count = EMBEDDED_NAME_MAX
    (PATH_MAX less struct filename's 32-byte head)."""
    lines = [l for l in _events(_section(ev_boot, "trace"), "kp_brk") if " cat-" in l]
    assert lines and all(re.search(r": \(strncpy_from_user\+0x10/0x[0-9a-f]+\) count=\d+$", l) for l in lines), lines
    assert any(l.endswith(" count=4064") for l in lines), lines


def test_filter_keeps_one_file(ev_boot):
    """`path == "/kp-two"`: of cat's three opens, the one of /kp-two."""
    lines = _events(_section(ev_boot, "trace_filter"), "kp_open")
    assert len(lines) == 1 and lines[0].endswith('path="/kp-two"'), lines


def test_hist_trigger_counts(ev_boot):
    """A hist trigger keyed on the string field counts cat's three opens of /kp-two."""
    hist = _section(ev_boot, "hist")
    assert any(re.match(r'^\{ path: /kp-two\s*\} hitcount:\s+3$', l) for l in hist), hist


def test_hits_before_the_runtime_is_placed(ev_boot):
    """do_filp_open() runs during the initcalls, before the runtime is placed: those hits write no
    event and are counted, the count said in the kernel log when the runtime is placed."""
    m = re.search(r"kprewrite: (\d+) trace event hits before the runtime was placed: not written", ev_boot.console)
    assert m and int(m.group(1)) > 0, ev_boot.explain("the early hits' line")
    assert ev_boot.console.index(m.group(0)) < ev_boot.console.index("kprewrite: the runtime placed in module memory")


def test_disabled_writes_nothing(ev_boot):
    """`enable` 0: the hits write nothing."""
    trace = _section(ev_boot, "trace_off")
    assert not any(f" {e}: " in l for l in trace for e in ("kp_open", "kp_ppid", "kp_getppid")), trace

"""The kernel's own controls of our trace events: each `events` line of a
rewritten kernel is a trace_event_call, so tracefs has events/kprobes/<EVENT>/ with enable, filter,
trigger, format, hist and id.  One rewrite of Debian's vmlinuz and one boot (-smp 2, KASLR on):

- `p:kp_fadv ksys_fadvise64_64 fd=$arg1:s32 off=$arg2:s64 advice=$arg4:s32 comm=$comm` and an `r`
  line on the same function; a static program (/fadv N OFF) calls posix_fadvise(fd, OFF, 0, ...) N
  times, so the script controls the count and the value of `off` (nothing else in the initramfs
  calls fadvise64);
- `format`: the fetch args as fields with the kernel's names, types, offsets and signedness
  (kprobe_event_define_fields()), and its print fmt; the `r` event's __probe_func/__probe_ret_ip;
- `enable`: 1 from boot (as `trace_event=` would); 0 writes nothing; 1 again writes;
- `filter`: `off == 100` keeps the 4 of 10 calls made with 100; a string filter on the
  __data_loc `comm` field with a numeric condition;
- an instance (instances/kp): the event enabled there only writes there;
- `trigger`: `hist:keys=off` counts 3 and 9, and its total equals kprobe_profile's hits of the
  probe over the same calls (debugfs kprewrite/profile, read before and after);
- not a dynamic event: kprobe_events does not list it, and a tracefs kprobe event of the same
  name is refused;
- perf: a counter opened on the event's id (PERF_TYPE_TRACEPOINT, as `perf stat -e
  kprobes:kp_fadv` opens one) counts the calls of the process it follows, with a filter on a
  field set through perf (PERF_EVENT_IOC_SET_FILTER) and on the `r` event's retval; a sampling
  event (`perf record -e kprobes:kp_fadv`, PERF_SAMPLE_RAW) gets one sample a call with the raw
  fields at the offsets `format` gives;
- BPF: a BPF_PROG_TYPE_KPROBE program loaded with the bpf system call and attached to the event
  (PERF_EVENT_IOC_SET_BPF) counts every hit in an array map and sums an argument read from its
  pt_regs: the count equals kprobe_profile's;
- the kernel's own tracers on the function we probe at its entry (an ftrace site we share): a
  tracefs kprobe event on ksys_fadvise64_64 and the function tracer filtered to it, both firing
  with ours, one line each a call.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

from kernel_env import assert_boot_ok, init_script, perfbpf_program, perfcount_program, sections

pytestmark = pytest.mark.kernel

T = "/sys/kernel/tracing"
E = f"{T}/events/kprobes/kp_fadv"
PROFILE = "/sys/kernel/debug/kprewrite/profile"

SPEC = r'''
events = [
  "p:kp_fadv ksys_fadvise64_64 fd=$arg1:s32 off=$arg2:s64 advice=$arg4:s32 comm=$comm",
  "r:kp_fadv_ret ksys_fadvise64_64 ret=$retval:s32",
  "p:kp_fadv_comm ksys_fadvise64_64 comm=$comm",
]
'''

FADV_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* fadv N OFF: posix_fadvise(fd, OFF, 0, POSIX_FADV_NORMAL) N times on this program's file. */
int main(int argc, char **argv)
{
	int n = atoi(argv[1]);
	long off = atol(argv[2]);
	int fd = open(argv[0], O_RDONLY), bad = 0;
	for (int i = 0; i < n; i++)
		bad += posix_fadvise(fd, off, 0, POSIX_FADV_NORMAL) != 0;
	printf("fadv off=%ld n=%d bad=%d pid=%d\n", off, n, bad, getpid());
	return 0;
}
"""

# (calls, off) of each phase; the counts asserted below come from these.
COMMANDS = f"""
echo "== ls"; ls {E}
echo "== format"; cat {E}/format
echo "== format_ret"; cat {T}/events/kprobes/kp_fadv_ret/format
echo "== id"; cat {E}/id
echo "== enable"; cat {E}/enable
/fadv 2 50
echo 0 > {E}/enable
/fadv 5 60
echo "== trace_enable"; cat {T}/trace
echo 1 > {E}/enable
echo > {T}/trace
echo 'off == 100' > {E}/filter
/fadv 4 100
/fadv 6 101
echo "== trace_filter"; cat {T}/trace
echo '(comm == "fadv" || comm == "init") && off > 100' > {E}/filter
echo > {T}/trace
/fadv 2 102
/fadv 3 99
echo "== trace_strfilter"; cat {T}/trace
echo 0 > {E}/filter
echo 0 > {E}/enable
mkdir {T}/instances/kp
echo 1 > {T}/instances/kp/events/kprobes/kp_fadv/enable
echo > {T}/trace
/fadv 1 77
echo "== trace_instance"; cat {T}/instances/kp/trace
echo "== trace_top"; cat {T}/trace
echo 0 > {T}/instances/kp/events/kprobes/kp_fadv/enable
rmdir {T}/instances/kp
echo 1 > {E}/enable
echo "== profile_before"; cat {PROFILE}
echo 'hist:keys=off' > {E}/trigger
/fadv 3 100
/fadv 9 101
echo "== profile_after"; cat {PROFILE}
echo "== hist"; cat {E}/hist
echo "== kprobe_events"; cat {T}/kprobe_events
echo "== same_name"; echo 'p:kp_fadv vfs_fadvise' >> {T}/kprobe_events && echo accepted || echo refused
echo "== perf"
/perfcount $(cat {E}/id) "" /fadv 4 200
/perfcount $(cat {E}/id) "off == 200" /fadv 6 201
/perfcount $(cat {E}/id) "off == 200" /fadv 3 200
[ -d {T}/events/kprobes/kp_fadv_ret ] && /perfcount $(cat {T}/events/kprobes/kp_fadv_ret/id) "ret == 0" /fadv 5 202
echo "== perf_sample"
/perfbpf sample $(cat {E}/id) /fadv 3 210
echo "== perf_sample_comm"
/perfbpf sample $(cat {T}/events/kprobes/kp_fadv_comm/id) /fadv 2 211
echo "== profile_bpf_before"; cat {PROFILE}
echo "== bpf"
/perfbpf bpf $(cat {E}/id) /fadv 7 220
echo "== profile_bpf_after"; cat {PROFILE}
echo "== own"
echo 'p:kk ksys_fadvise64_64 off=%si:s64' >> {T}/kprobe_events && echo accepted || echo refused
echo 1 > {T}/events/kprobes/kk/enable
echo ksys_fadvise64_64 > {T}/set_ftrace_filter && echo filtered || echo not-filtered
echo function > {T}/current_tracer
echo > {T}/trace
/fadv 3 300
echo "== trace_own"; cat {T}/trace
echo nop > {T}/current_tracer
echo 0 > {T}/events/kprobes/kk/enable
echo "== end"
"""


@pytest.fixture(scope="module")
def booted(tmp_path_factory, debian_kernel, make_initramfs, boot_kernel):
    d = tmp_path_factory.mktemp("event-controls")
    spec = d / "probes.toml"
    spec.write_text(SPEC)
    r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec, check=False)
    if r.returncode and "kretprobes are not supported" in r.stderr:
        spec.write_text(SPEC.replace('  "r:kp_fadv_ret', '  # "r:kp_fadv_ret'))
        r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec)
    assert r.returncode == 0, r.stderr
    assert any(l.startswith("ksys_fadvise64_64+0x0  k  ") for l in r.stdout.splitlines()), r.stdout
    out = d / "vmlinuz.kp"
    kprewrite("instrument", debian_kernel.vmlinuz, "--spec", spec, "-o", out)
    src = d / "fadv.c"
    src.write_text(FADV_C)
    subprocess.run(["gcc", "-static", "-O2", "-o", d / "fadv", src], check=True)
    initrd = make_initramfs(init_script(COMMANDS), {"fadv": d / "fadv", "perfcount": perfcount_program(d),
                                                        "perfbpf": perfbpf_program(d)})
    b = boot_kernel("event-controls-bzimage-smp2", out, initrd, smp=2, timeout=240)
    assert_boot_ok(b)
    return b


@pytest.fixture(scope="module")
def out(booted):
    s = sections(booted.console)
    assert "end" in s, booted.explain("/init did not finish")
    return s


def _fadv_pids(booted) -> dict[tuple[int, int], int]:
    """(off, n) -> pid of each /fadv run (what it printed)."""
    runs = {}
    for m in re.finditer(r"^fadv off=(\d+) n=(\d+) bad=0 pid=(\d+)$", booted.console, re.M):
        runs[int(m.group(1)), int(m.group(2))] = int(m.group(3))
    return runs


def _offs(lines: list[str]) -> list[int]:
    """`off` of each kp_fadv line (the kernel's trace format, printed by our .trace)."""
    offs = []
    for l in lines:
        m = re.search(r" kp_fadv: \(ksys_fadvise64_64\+0x0/0x[0-9a-f]+\) fd=\d+ off=(-?\d+) advice=0 comm=\"(\S+)\"$", l)
        if m:
            offs.append(int(m.group(1)))
    return offs


def _fields(lines: list[str]) -> list[tuple[str, str, int, int, int]]:
    """(type, name, offset, size, signed) of each field line of a `format` file."""
    out = []
    for l in lines:
        m = re.fullmatch(r"\s*field:(.+) (\S+);\s*offset:(\d+);\s*size:(\d+);\s*signed:(\d+);", l)
        if m:
            out.append((m.group(1), m.group(2), int(m.group(3)), int(m.group(4)), int(m.group(5))))
    return out


def test_event_folder_and_format(out):
    """events/kprobes/kp_fadv/ has the kernel's files; `format` lists the fetch args as fields
    after the common ones and __probe_ip, packed as traceprobe_define_arg_fields() places them
    (a string as its u32 __data_loc), and print fmt as __set_print_fmt() writes it."""
    assert {"enable", "filter", "format", "hist", "id", "trigger"} <= set(" ".join(out["ls"]).split()), out["ls"]
    fmt = out["format"]
    assert fmt[0] == "name: kp_fadv", fmt
    assert fmt[1] == f"ID: {out['id'][0]}", (fmt[1], out["id"])
    fields = _fields(fmt)
    assert fields[:4] == [("unsigned short", "common_type", 0, 2, 0), ("unsigned char", "common_flags", 2, 1, 0),
                          ("unsigned char", "common_preempt_count", 3, 1, 0), ("int", "common_pid", 4, 4, 1)], fields
    assert fields[4:] == [("unsigned long", "__probe_ip", 8, 8, 0), ("s32", "fd", 16, 4, 1), ("s64", "off", 20, 8, 1),
                          ("s32", "advice", 28, 4, 1), ("__data_loc char[]", "comm", 32, 4, 1)], fields
    assert fmt[-1] == ('print fmt: "(%lx) fd=%d off=%Ld advice=%d comm=\\"%s\\"", REC->__probe_ip, REC->fd, '
                       'REC->off, REC->advice, __get_str(comm)'), fmt[-1]


def test_return_event_format(out):
    fields = _fields(out["format_ret"])
    if not fields:
        pytest.skip("kernel kretprobes are not in this tree: `r` lines are refused")
    assert fields[4:] == [("unsigned long", "__probe_func", 8, 8, 0), ("unsigned long", "__probe_ret_ip", 16, 8, 0),
                          ("s32", "ret", 24, 4, 1)], fields
    assert out["format_ret"][-1] == ('print fmt: "(%lx <- %lx) ret=%d", REC->__probe_func, REC->__probe_ret_ip, '
                                     'REC->ret'), out["format_ret"][-1]


def test_enable(booted, out):
    """Enabled from boot; `echo 0 > enable`: the calls made then write nothing."""
    assert out["enable"][0] == "1", out["enable"]
    runs = _fadv_pids(booted)
    assert (50, 2) in runs and (60, 5) in runs, runs
    assert _offs(out["trace_enable"]) == [50, 50], out["trace_enable"]


def test_filter_drops_the_other_half(booted, out):
    """`off == 100`: the 4 calls with 100 are written, the 6 with 101 are not."""
    runs = _fadv_pids(booted)
    assert (100, 4) in runs and (101, 6) in runs, runs
    lines = [l for l in out["trace_filter"] if " kp_fadv: " in l]
    assert _offs(lines) == [100] * 4, out["trace_filter"]
    assert all(f"fadv-{runs[100, 4]} " in l for l in lines), lines


def test_string_filter(out):
    """A filter on the __data_loc string field (and a number): the 2 calls with 102, not the 3 with 99."""
    assert _offs(out["trace_strfilter"]) == [102, 102], out["trace_strfilter"]


def test_instance(out):
    """Enabled only in instances/kp: written to its buffer, not the top instance's."""
    assert _offs(out["trace_instance"]) == [77], out["trace_instance"]
    assert _offs(out["trace_top"]) == [], out["trace_top"]


def test_not_a_dynamic_event(out):
    """kprobe_events does not list ours, and refuses a tracefs kprobe event of the same name."""
    assert not any("kp_fadv" in l for l in out["kprobe_events"]), out["kprobe_events"]
    assert out["same_name"][-1] == "refused", out["same_name"]


def _profile_hits(lines: list[str], event: str) -> int:
    for l in lines:
        parts = l.split()
        if parts and parts[0] == event:
            return int(parts[1])
    raise AssertionError(f"no {event} in kprobe_profile: {lines}")


def test_hist_trigger_counts(booted, out):
    """`hist:keys=off`: 3 and 9 hits, and the total equals the probe's hits in kprobe_profile over
    the same calls (nothing but /fadv calls fadvise64); its final count is every call made."""
    hist = "\n".join(out["hist"])
    assert re.search(r"^\{ off:\s+100 \} hitcount:\s+3$", hist, re.M), hist
    assert re.search(r"^\{ off:\s+101 \} hitcount:\s+9$", hist, re.M), hist
    total = int(re.search(r"^\s+Hits: (\d+)$", hist, re.M).group(1))
    delta = _profile_hits(out["profile_after"], "kp_fadv") - _profile_hits(out["profile_before"], "kp_fadv")
    assert total == delta == 12, (total, delta, hist)
    # the probe fires whether or not its event is enabled (kprobe_profile counts every hit)
    assert booted.profile()["kp_fadv"][0] == 2 + 5 + 4 + 6 + 2 + 3 + 1 + 3 + 9 + (4 + 6 + 3 + 5) + 3 + 2 + 7 + 3, booted.profile()


def test_perf_counts_the_event_with_a_filter(out):
    """perf on our events (kprobe_register()'s TRACE_REG_PERF_* cases, kprobe_perf_func()): a
    counter on kp_fadv's id counts the 4 calls of the /fadv it follows (the top instance's enable
    and hist trigger do not matter to perf); with the filter `off == 200` set through perf, 0 of 6
    calls with 201 and 3 of 3 with 200; on kp_fadv_ret with `ret == 0`, its 5 returns.  Each
    counter is opened and closed in turn (TRACE_REG_PERF_REGISTER, then UNREGISTER)."""
    want = [4, 0, 3] + ([5] if any(l == "name: kp_fadv_ret" for l in out["format_ret"]) else [])
    got = [int(m.group(1)) for l in out["perf"] for m in [re.fullmatch(r"perf count=(\d+)", l)] if m]
    assert got == want, out["perf"]


def _trace_entry(raw: bytes) -> tuple[int, int]:
    """(type, pid) of a struct trace_entry: unsigned short type, flags, preempt_count, int pid."""
    return int.from_bytes(raw[0:2], "little"), int.from_bytes(raw[4:8], "little", signed=True)


def test_perf_samples_carry_the_raw_fields(out):
    """A sampling event on kp_fadv (sample_period 1, PERF_SAMPLE_RAW, enable_on_exec on /fadv):
    3 samples for 3 calls, each the kernel's record of the event: its type, the pid of /fadv, and
    `off` and `advice` at the offsets the event's `format` gives."""
    lines = out["perf_sample"]
    assert "perf samples=3 lost=0" in lines, lines
    event_id = int(out["id"][0])
    fields = {name: (off, size) for _, name, off, size, _ in _fields(out["format"])}
    samples = [re.fullmatch(r"sample pid=(\d+) raw=([0-9a-f]+)", l) for l in lines]
    samples = [(int(m.group(1)), bytes.fromhex(m.group(2))) for m in samples if m]
    assert len(samples) == 3, lines

    def field(raw: bytes, name: str) -> int:
        off, size = fields[name]
        return int.from_bytes(raw[off:off + size], "little", signed=True)
    for pid, raw in samples:
        assert _trace_entry(raw) == (event_id, pid), (raw.hex(), event_id, pid)
        assert (field(raw, "off"), field(raw, "advice")) == (210, 0), raw.hex()


def test_bpf_program_counts_hits_and_reads_an_argument(out):
    """A BPF_PROG_TYPE_KPROBE program on kp_fadv (perf_event_set_bpf_prog() takes it: the call is
    flagged TRACE_EVENT_FL_KPROBE; the hit runs it through trace_call_bpf()): 7 hits, each reading
    `off` (220) from regs->si, and kprobe_profile counted the same 7."""
    assert "bpf hits=7 argsum=1540" in out["bpf"], out["bpf"]
    delta = _profile_hits(out["profile_bpf_after"], "kp_fadv") - _profile_hits(out["profile_bpf_before"], "kp_fadv")
    assert delta == 7, (out["profile_bpf_before"], out["profile_bpf_after"])


def test_kernels_own_kprobe_and_function_tracer_on_our_probed_entry(out):
    """Our probe's jump follows the function's ftrace site (Rules.share_ftrace), so the site is
    still ftrace's: the kernel accepts its own tracefs kprobe event at ksys_fadvise64_64 (placed
    on ftrace, KPROBE_FLAG_FTRACE) and the function tracer filtered to it, and in 3 calls all
    three fire 3 times: the function tracer's line, the kernel's `kk` and our kp_fadv."""
    assert out["own"][:2] == ["accepted", "filtered"], out["own"]
    trace = out["trace_own"]
    func = [l for l in trace if re.search(r"\bksys_fadvise64_64 <-", l)]
    kk = [l for l in trace if re.search(r" kk: \(ksys_fadvise64_64\+0x0/0x[0-9a-f]+\) off=300$", l)]
    ours = [l for l in trace if " kp_fadv: " in l]
    assert len(func) == len(kk) == 3 and _offs(ours) == [300] * 3, trace


def test_perf_samples_an_event_that_reads_no_register(out):
    """kp_fadv_comm fetches only $comm (no register): a kernel's events still pass the probed
    context's pt_regs (Rules.events_pt_regs), which perf's sample header reads
    (perf_misc_flags()) and a BPF program takes as its context: 2 samples for 2 calls, each
    with the pid and the task's name in the raw record."""
    lines = out["perf_sample_comm"]
    assert "perf samples=2 lost=0" in lines, lines
    samples = [re.fullmatch(r"sample pid=(\d+) raw=([0-9a-f]+)", l) for l in lines]
    samples = [(int(m.group(1)), bytes.fromhex(m.group(2))) for m in samples if m]
    assert len(samples) == 2 and all(_trace_entry(raw)[1] == pid and b"fadv\0" in raw for pid, raw in samples), lines

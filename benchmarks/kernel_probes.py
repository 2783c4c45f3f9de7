#!/usr/bin/env python3
"""Kernel benchmark: the cost of a probe hit, ours and the running kernel's own kprobes, side by
side in the same boot, under qemu-system-x86_64.

Run: python3 benchmarks/kernel_probes.py [--modes icount,tcg] [-n N] [--reps R] [--warmup W] [--keep DIR] [--int3]
                                         [--write-table benchmarks/README.md] [--check]
     (--write-table FILE: the icount table, dated, with the commit measured and the machine, replaces
      what lies between <!-- kernel_probes:begin --> and <!-- kernel_probes:end --> in FILE;
      kernel_probes-int3, -kret, -singlestep for those tables)
     (--check: exit status 3 when ours costs MORE than any of the kernel's configurations it is
      compared with, when (icount) a row of ours grew by more than 2% over the table committed in
      benchmarks/README.md, or a check failed; every kernel row prints a "verdict:" line, less or
      MORE, and each of ours a "guard:" line)
     (--int3: ours at +0xe is a breakpoint probe, compared with the kernel's INT3 kprobes)
     (--singlestep: row k, a breakpoint probe whose instruction is single-stepped: see SINGLESTEP_DOC below)
     (--kret: kretprobes, rows r and ro: ours on getuid (empty handler) and geteuid (empty
      entry_handler and handler), the kernel's on getgid: register_kretprobe() in the module, both
      ways, and the tracefs `r:` event, with and without tracing_on)
     (fetches Debian's cloud kernel like tests/kernel do; needs gcc, make, qemu-system-x86, busybox-static)

What is measured
----------------
/init runs benchmarks/kernel/syscall_loop.c (static): N calls of a system call made with the
`syscall` instruction, timed with clock_gettime(CLOCK_MONOTONIC), each loop after a warm-up.

Our probes are compiled in and cannot be disarmed at run time (a disabled kprobe still takes its
detour), so "ours" and "the kernel's" sit on twin functions, all in ONE boot of ONE rewritten kernel:

  getuid  -> __do_sys_getuid     our probe at the entry (ftrace site), empty pre_handler
  geteuid -> __do_sys_geteuid    our probe at +0xe (jump-optimized), empty pre_handler
  getgid  -> __do_sys_getgid     the kernel's own kprobes, at +0x0 and +0xe, one configuration at a time
  getegid -> __do_sys_getegid    never probed: the reference loop run right before the others

The four functions are the same instructions (checked here with capstone): they differ only in
the cred field they read and in calling from_kuid_munged / from_kgid_munged.  Each phase of the
boot runs R rounds of the four loops in turn (getegid, getgid, getuid, geteuid); a loop's cost is
taken relative to the getegid loop of the same round, which cancels drift of the host:

  per hit = (median over rounds of [T(x) - T(getegid)]  -  the same difference with x unprobed) / N

and, beside it, from each loop's fastest round ("best", since the host's load only adds time):
  (min T(x) - min T(getegid) - the same difference with x unprobed) / N

"x unprobed" is phase 0 of the same boot for getgid; for getuid/geteuid (always probed in the
rewritten kernel) it comes from a short calibration boot of the UNMODIFIED kernel (the only
second boot), since the syscall dispatch costs slightly differently per system call number.

The kernel's configurations: a kernel module (benchmarks/kernel/bench_kprobe.c) whose
register_kprobe() probe has an empty pre_handler that counts its hits -- like for like with
ours; it is built with Debian's linux-headers package of the same kernel (apt-get download,
unpacked into the kernel cache; nothing installed) and loaded with busybox insmod (the kernel
does not force module signatures), and its phases are left out with a note where that cannot
be done; tracefs `kprobe_events` (an event: its handler writes a record to the ring buffer);
the same with tracing_on = 0 (the handler runs, the ring buffer refuses the record); and a
kprobe with no event output made without a module: a perf kprobe (the "kprobe" PMU) with a
BPF program that returns 0 (tracefs alone cannot make a kprobe with no output).  At the entry the
kernel uses its ftrace site ([FTRACE]); at +0xe it jump-optimizes ([OPTIMIZED], after waiting
1 s for the asynchronous optimizer); with /proc/sys/debug/kprobes-optimization = 0 it stays an
INT3 kprobe.  debugfs kprobes/list, tracefs kprobe_profile and the module's hit count are read
in each phase to check; our probes' hits are read from their kprobe_profile at power-off.

Modes: "icount" is TCG with -icount shift=0,sleep=off: the guest's clock advances 1 ns per
guest instruction, so numbers are deterministic instruction counts, immune to the load of the
shared host -- but a trap (INT3, exception entry) costs no more than its instructions there.
"tcg" is plain TCG with the host's wall clock: noisy on shared cores, and TCG's own costs
(leaving translated code for an exception, ...) are not a real CPU's.  Ratios matter, not ns.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "kernel"))
sys.path.insert(0, str(ROOT))
import kernel_env  # noqa: E402

LOOP_SRC = HERE / "kernel" / "syscall_loop.c"
HANDLER_SRC = HERE / "kernel" / "empty_handler.c"
MODULE_SRC = HERE / "kernel" / "bench_kprobe.c"

TWINS = {"getuid": "__do_sys_getuid", "geteuid": "__do_sys_geteuid",
         "getgid": "__do_sys_getgid", "getegid": "__do_sys_getegid"}
INSIDE = 0xE                    # mov rax, [rax + cred]: after the fentry call and the gs: load
OURS_ENTRY, OURS_INSIDE, KERNEL, REF = "getuid", "geteuid", "getgid", "getegid"
LABELS = (REF, KERNEL, OURS_ENTRY, OURS_INSIDE)   # the order of the loops in a round
TRACING = "/sys/kernel/tracing"
OPT_SYSCTL = "/proc/sys/debug/kprobes-optimization"
KFUNC = TWINS[KERNEL]

# (key, description, where, how, the kind kprobes/list must show)
PHASES = [
    ("none", "no kernel probe", None, None, None),
    ("k-entry-mod", "kernel kprobe at entry, module, empty pre_handler", 0, "module", "FTRACE"),
    ("k-entry-event", "kernel kprobe at entry, tracefs event", 0, "event", "FTRACE"),
    ("k-entry-off", "kernel kprobe at entry, event, tracing_on=0", 0, "event-off", "FTRACE"),
    ("k-entry-bpf", "kernel kprobe at entry, empty BPF prog", 0, "bpf", "FTRACE"),
    ("k-opt-mod", "kernel kprobe +0xe optimized, module, empty pre_handler", INSIDE, "module", "OPTIMIZED"),
    ("k-opt-event", "kernel kprobe +0xe optimized, tracefs event", INSIDE, "event", "OPTIMIZED"),
    ("k-opt-off", "kernel kprobe +0xe optimized, tracing_on=0", INSIDE, "event-off", "OPTIMIZED"),
    ("k-opt-bpf", "kernel kprobe +0xe optimized, empty BPF prog", INSIDE, "bpf", "OPTIMIZED"),
    ("k-int3-mod", "kernel kprobe +0xe INT3, module, empty pre_handler", INSIDE, "module", ""),
    ("k-int3-event", "kernel kprobe +0xe INT3, tracefs event", INSIDE, "event", ""),
    ("k-int3-off", "kernel kprobe +0xe INT3, tracing_on=0", INSIDE, "event-off", ""),
    ("k-int3-bpf", "kernel kprobe +0xe INT3, empty BPF prog", INSIDE, "bpf", ""),
]
# --kret: kretprobes at the entry (the kernel's at its ftrace site, whatever kprobes-optimization says).
KRET_PHASES = [
    ("none", "no kernel probe", None, None, None),
    ("k-ret-mod", "kernel kretprobe, module, empty handler", 0, "kret-module", "FTRACE"),
    ("k-reto-mod", "kernel kretprobe, module, empty entry_handler+handler", 0, "kreto-module", "FTRACE"),
    ("k-ret-event", "kernel kretprobe, tracefs r: event", 0, "kret-event", "FTRACE"),
    ("k-ret-off", "kernel kretprobe, r: event, tracing_on=0", 0, "kret-event-off", "FTRACE"),
]
KRET = False
MODES = {"icount": ("-icount", "shift=0,sleep=off"), "tcg": ()}
# (N, rounds, warm-up calls) per mode: icount is deterministic (3 rounds only to show it) but
# runs ~3x slower.  Wall-clock TCG: short loops (~5 ms), many rounds: the other tenants' load comes
# in bursts longer than a loop, so each loop's best round is a clean one; it is reported beside
# the medians, which move with the load.
DEFAULTS = {"icount": (100_000, 3, 20_000), "tcg": (10_000, 60, 2_000)}


def sh(cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"kernel_probes: {' '.join(map(str, cmd))} failed:\n{r.stderr}{r.stdout}")
    return r


def kprewrite(*args) -> str:
    return sh([sys.executable, "-m", "rewriter", *map(str, args)], env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout


def check_twins(vmlinux: Path) -> None:
    """The four functions are the same instructions, and +INSIDE is an instruction boundary."""
    import capstone
    from rewriter.elf.image import Image
    from rewriter.targets import linux_kernel
    image = Image(str(vmlinux))
    linux_kernel.load_symbols(image)
    funcs = {f.name: f for f in image.functions}
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    shapes = {}
    for sc, name in TWINS.items():
        f = funcs[name]
        insns = list(cs.disasm(image.read(f.start, f.end - f.start), f.start))
        shapes[sc] = [(i.address - f.start, i.mnemonic) for i in insns]
        if INSIDE not in [off for off, _ in shapes[sc]]:
            sys.exit(f"kernel_probes: {name}+{INSIDE:#x} is not an instruction boundary in this kernel")
    if len({tuple(s) for s in shapes.values()}) != 1:
        sys.exit(f"kernel_probes: {', '.join(TWINS.values())} are no longer twins in this kernel: {shapes}")


def rewrite(k, work: Path, int3: bool = False) -> Path:
    spec = work / "probes.toml"
    if KRET:        # rows r and ro: kretprobes on both, the second with an entry_handler too
        spec.write_text(f'handlers = ["{HANDLER_SRC}"]\n'
                        f'[[kretprobe]]\nsymbol_name = "{TWINS[OURS_ENTRY]}"\nhandler = "bench_ret_empty"\n'
                        f'[[kretprobe]]\nsymbol_name = "{TWINS[OURS_INSIDE]}"\nhandler = "bench_ret_empty"\n'
                        'entry_handler = "bench_ret_empty"\n')
    else:
        spec.write_text(("optimize = false\n" if int3 else "") + f'handlers = ["{HANDLER_SRC}"]\n'
                        f'[[kprobe]]\nsymbol_name = "{TWINS[OURS_ENTRY]}"\npre_handler = "bench_empty"\n'
                        f'[[kprobe]]\nsymbol_name = "{TWINS[OURS_INSIDE]}"\noffset = {INSIDE:#x}\npre_handler = "bench_empty"\n')
    plan = kprewrite("check", k.vmlinux, "--spec", spec).split("\n")
    want = [f"{TWINS[OURS_ENTRY]}+0x0  k  ftrace", f"{TWINS[OURS_INSIDE]}+{INSIDE:#x}  k  optimized"]
    if KRET:
        # Every exit hooked (the return address never replaced), each a ret.
        want = [f"{TWINS[x]}+0x0  r  ftrace  returns: 0x" for x in (OURS_ENTRY, OURS_INSIDE)]
        want = [p if p.startswith(w) and p.endswith(" ret") and "trampoline" not in p else w + "... ret"
                for p, w in zip(plan, want)]
    if int3:        # --int3: ours at +0xe is a breakpoint probe, its instruction boosted
        want[1] = plan[1] if plan[1].startswith(f"{TWINS[OURS_INSIDE]}+{INSIDE:#x}  k  int3 ") and \
            plan[1].endswith("[boost]") else "an int3 [boost] line"
    if plan[:2] != want:
        sys.exit(f"kernel_probes: check says {plan}, expected {want}")
    # The kernel's own would be placed the same way at its twin: same check.
    spec2 = work / "kernel-twin.toml"
    spec2.write_text(f'[[kprobe]]\nsymbol_name = "{KFUNC}"\n[[kprobe]]\nsymbol_name = "{KFUNC}"\noffset = {INSIDE:#x}\n')
    plan2 = kprewrite("check", k.vmlinux, "--spec", spec2).split("\n")
    print("kprewrite check:  " + "; ".join(plan[:2]) + "   (and at the kernel's twin: " + "; ".join(plan2[:2]) + ")")
    out = work / "vmlinux.kp"
    t = time.monotonic()
    kprewrite("instrument", k.vmlinux, "--spec", spec, "-o", out)
    listed = [l for l in kprewrite("list", out).splitlines() if "__do_sys_" in l]
    print(f"kprewrite instrument: {time.monotonic() - t:.1f} s; list: " + "; ".join(listed))
    return out


def setup_cmds(where: int | None, how: str | None, int3: bool, func: str = KFUNC) -> tuple[str, str, str]:
    """(setup, the -b option of syscall_loop, teardown) shell text of a phase (the kernel's
    probe on func+where)."""
    if how is None:
        return "", "", ""
    pre = f"echo 0 > {OPT_SYSCTL}\n" if int3 else ""
    post = f"echo 1 > {OPT_SYSCTL}\n" if int3 else ""
    if how == "bpf":
        return pre, f"-b {func}+{where:#x}", post
    listing = f"grep {func} /sys/kernel/debug/kprobes/list | sed 's/^/LIST /'\n"
    if how in ("kret-module", "kreto-module"):
        kret = 1 if how == "kret-module" else 2
        setup = (f"insmod /bench_kprobe.ko symbol={func} kret={kret} || echo SETUP-FAILED\n" + listing)
        return setup, "", "rmmod bench_kprobe\n"
    if how == "module":
        setup = (pre + f"insmod /bench_kprobe.ko symbol={func} offset={where} || echo SETUP-FAILED\n"
                 "sleep 1\n" + listing)   # sleep: the kprobe optimizer is a delayed work
        return setup, "", "rmmod bench_kprobe\n" + post
    ev = f"r:bench {func}" if how.startswith("kret") else f"p:bench {func}" + (f"+{where:#x}" if where else "")
    setup = (pre + f"echo '{ev}' > {TRACING}/kprobe_events || echo SETUP-FAILED\n"
             f"echo 1 > {TRACING}/events/kprobes/bench/enable || echo SETUP-FAILED\n")
    if how.endswith("event-off"):
        setup += f"echo 0 > {TRACING}/tracing_on\n"
    setup += "sleep 1\n"   # the kprobe optimizer is a delayed work
    setup += listing
    teardown = (f"sed 's/^/PROFILE /' {TRACING}/kprobe_profile\n"
                f"echo 0 > {TRACING}/events/kprobes/bench/enable\necho > {TRACING}/kprobe_events\n"
                f"echo 1 > {TRACING}/tracing_on\necho > {TRACING}/trace\n" + post)
    return setup, "", teardown


def init_commands(phases, n: int, reps: int, warmup: int, labels=None, func: str = KFUNC) -> str:
    out = ["echo '== info'",
           "uname -r", "grep -m1 'model name' /proc/cpuinfo",
           "echo clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource)",
           "grep -H . /sys/devices/system/cpu/vulnerabilities/* | sed 's|.*/||'"]
    loops = " ".join(f"{l}={l}" for l in (labels or LABELS))
    for key, _, where, how, _ in phases:
        setup, bpf, teardown = setup_cmds(where, how, key.startswith(("k-int3", "k-ss")), func)
        out.append(f"echo '== phase {key}'")
        out.append(setup.rstrip())
        out.append(f"/bench -n {n} -r {reps} -w {warmup} {bpf} {loops}")
        out.append(teardown.rstrip())
    out.append("echo '== end'")
    out.append("sleep 1")
    return "\n".join(l for l in out if l) + "\n"


def build_module(k, work: Path) -> Path | None:
    """bench_kprobe.ko for this kernel, built with Debian's linux-headers package of the same
    release (apt-get download of it and its two dependencies, unpacked into the kernel cache,
    nothing installed) and gcc; None, with the reason printed, where that cannot be done."""
    hdr = kernel_env.cache_dir() / f"headers-{k.release}_{k.version}"
    abi = k.release.removesuffix("-cloud-amd64")              # 6.1.0-56
    kbuild = "linux-kbuild-" + ".".join(abi.split(".")[:2])    # linux-kbuild-6.1
    build = hdr / "usr" / "src" / f"linux-headers-{k.release}"
    if not (hdr / ".done").exists():
        dl = work / "debs"
        dl.mkdir(exist_ok=True)
        pkgs = [f"linux-headers-{k.release}={k.version}", f"linux-headers-{abi}-common={k.version}",
                f"{kbuild}={k.version}"]
        r = subprocess.run(["apt-get", "download", "-q", *pkgs], cwd=dl, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"no module phases: apt-get download {' '.join(pkgs)} failed: {r.stderr.strip()[-300:]}")
            return None
        hdr.mkdir(parents=True, exist_ok=True)
        for deb in sorted(dl.glob("*.deb")):
            sh(["dpkg-deb", "-x", str(deb), str(hdr)])
            deb.unlink()
        # The arch Makefile includes the common tree by its absolute /usr/src path.
        mk = build / "Makefile"
        mk.write_text(mk.read_text().replace("/usr/src/", f"{hdr}/usr/src/"))
        (hdr / ".done").write_text("")
    src = work / "module"
    src.mkdir(exist_ok=True)
    (src / "bench_kprobe.c").write_text(MODULE_SRC.read_text())
    (src / "Kbuild").write_text("obj-m := bench_kprobe.o\n")
    r = subprocess.run(["make", "-C", str(build), f"M={src}", "modules"], capture_output=True, text=True)
    ko = src / "bench_kprobe.ko"
    if r.returncode != 0 or not ko.exists():
        print(f"no module phases: building bench_kprobe.ko failed:\n{r.stderr[-1500:]}")
        return None
    return ko


def run_boot(kernel: Path, phases, n, reps, warmup, mode, files: dict, log: Path, labels=None,
             func: str = KFUNC) -> kernel_env.BootResult:
    init = kernel_env.init_script(init_commands(phases, n, reps, warmup, labels, func))
    initrd = kernel_env.build_initramfs(init, files)
    r = kernel_env.boot(kernel, initrd, smp=1, timeout=600, accel="tcg", qemu_args=MODES[mode], log=log)
    if not r.reached(kernel_env.DONE_MARKER) or "== end" not in r.console:
        sys.exit(r.explain(f"{kernel.name} ({mode}): /init did not finish"))
    bad = r.problems()
    if bad:
        sys.exit(r.explain("the kernel reported problems:\n  " + "\n  ".join(bad[:10])))
    return r


def parse(r: kernel_env.BootResult) -> dict:
    secs = kernel_env.sections(r.between())
    phases = {}
    for name, lines in secs.items():
        if not name.startswith("phase "):
            continue
        res: dict[str, list[int]] = {}
        for l in lines:
            m = re.match(r"RESULT (\S+) (\d+) (\d+) (\d+)$", l)
            if m:
                res.setdefault(m.group(1), []).append(int(m.group(3)))
        phases[name[6:]] = {"results": res, "lines": lines}
    return {"info": secs.get("info", []), "phases": phases}


def ours_profile(r: kernel_env.BootResult) -> dict[str, tuple[int, int]]:
    lines = r.lines()
    i = next((n for n, l in enumerate(lines) if l.endswith("kprobe_profile at kernel_power_off:")), None)
    rows = {}
    for l in lines[i + 1:] if i is not None else []:
        m = re.fullmatch(r"\[ *[\d.]+\]   (\S+) +(\d+) +(\d+)", l)
        if not m:
            break
        rows[m.group(1)] = int(m.group(2)), int(m.group(3))
    return rows


def diffs(res: dict[str, list[int]], label: str) -> list[int]:
    return [x - b for x, b in zip(res[label], res[REF])]


def med(xs) -> float:
    return statistics.median(xs)


INSIDE_KIND = "optimized"       # "int3" with --int3


def analyse(main: dict, calib: dict, n: int, reps: int, warmup: int) -> tuple[list, list[str], dict]:
    """Table rows, the checks made on the way, and {phase key or label: cost of a hit}."""
    notes = []
    p0 = main["phases"]["none"]["results"]
    c0 = calib["phases"]["none"]["results"]
    # x unprobed, relative to getegid in the same round.
    ref = {KERNEL: med(diffs(p0, KERNEL)),
           OURS_ENTRY: med(diffs(c0, OURS_ENTRY)), OURS_INSIDE: med(diffs(c0, OURS_INSIDE))}
    # The best-of-rounds estimate: each loop's fastest round (host load only ever adds time).
    ref_min = {KERNEL: min(p0[KERNEL]) - min(p0[REF]),
               OURS_ENTRY: min(c0[OURS_ENTRY]) - min(c0[REF]), OURS_INSIDE: min(c0[OURS_INSIDE]) - min(c0[REF])}
    ref_all = min(x for ph in main["phases"].values() for x in ph["results"][REF])
    rows = []
    rows.append(("(0) no probe: getegid, the reference", "-", med(p0[REF]) / n, None, None, None, None))
    rows.append(("(0) no probe: getgid (kernel's twin)", "-", med(p0[KERNEL]) / n, None, None, None, None))
    for lab in (OURS_ENTRY, OURS_INSIDE):
        rows.append((f"(0) no probe: {lab} (unmodified kernel boot)", "-", med(c0[lab]) / n, None, None, None, None))
    ours, ours_min = {}, {}
    hits, hits_min = ours, ours_min
    ours_rows = ((OURS_ENTRY, "(1) ours at entry", "ftrace"), (OURS_INSIDE, "(2) ours at +0xe", INSIDE_KIND))
    if KRET:
        ours_rows = ((OURS_ENTRY, "(r) ours kretprobe", "ftrace"), (OURS_INSIDE, "(ro) ours kretprobe", "ftrace"))
    for lab, what, kind in ours_rows:
        per_call = med([x for ph in main["phases"].values() for x in ph["results"][lab]]) / n
        d = [x for ph in main["phases"].values() for x in diffs(ph["results"], lab)]
        ours[lab] = (med(d) - ref[lab]) / n
        ours_min[lab] = (min(x for ph in main["phases"].values() for x in ph["results"][lab]) - ref_all
                         - ref_min[lab]) / n
        handler = ("empty handler" if lab == OURS_ENTRY else "empty entry_handler+handler") if KRET else "empty pre_handler"
        rows.append((f"{what}, {handler}", kind, per_call, ours[lab], 1.0, ours_min[lab], 1.0))
    for key, desc, where, how, kind in (KRET_PHASES if KRET else PHASES)[1:]:
        ph = main["phases"].get(key)
        if ph is None:
            continue
        res = ph["results"]
        hit = (med(diffs(res, KERNEL)) - ref[KERNEL]) / n
        hits[key] = hit
        # --kret: the kernel's kretprobe with an entry_handler against ours with one (row ro).
        inside = where != 0 or key == "k-reto-mod"
        against = ours[OURS_INSIDE] if inside else ours[OURS_ENTRY]
        hit_min = (min(res[KERNEL]) - min(res[REF]) - ref_min[KERNEL]) / n
        hits_min[key] = hit_min
        against_min = ours_min[OURS_INSIDE] if inside else ours_min[OURS_ENTRY]
        listed = [l for l in ph["lines"] if l.startswith(("LIST ", "BPF-KPROBE ")) and KFUNC in l]
        tag = ("FTRACE" if "[FTRACE]" in " ".join(listed) else "OPTIMIZED" if "[OPTIMIZED]" in " ".join(listed)
               else "int3" if listed else "?")
        if not listed or (kind and f"[{kind}]" not in " ".join(listed)) or (not kind and "[OPTIMIZED]" in " ".join(listed)):
            notes.append(f"{key}: kprobes/list shows {listed!r}, expected {kind or 'neither [FTRACE] nor [OPTIMIZED]'}")
        prof = [l.split() for l in ph["lines"] if l.startswith("PROFILE ")]
        if "event" in how:
            want = reps * (n + warmup)
            got = [(int(p[2]), int(p[3])) for p in prof if len(p) >= 4 and p[1] == "bench"]
            if got != [(want, 0)]:
                notes.append(f"{key}: tracefs kprobe_profile says (hits, missed) {got}, expected [({want}, 0)]")
        if how.endswith("module"):
            want = reps * (n + warmup)
            got = [tuple(map(int, m.groups())) for l in ph["lines"]
                   for m in [re.search(r"bench_kprobe: \S+ hits (\d+) nmissed (\d+)", l)] if m]
            if got != [(want, 0)]:
                notes.append(f"{key}: the module's (hits, nmissed) {got}, expected [({want}, 0)]")
        if any(l.startswith(("BPF-ERROR", "SETUP-FAILED")) for l in ph["lines"]):
            notes.append(f"{key}: setup failed: " + "; ".join(l for l in ph["lines"] if "ERROR" in l or "FAILED" in l))
        num = ("ro" if inside else "r") if KRET else '3' if where == 0 else '5' if key.startswith('k-int3') else '4'
        rows.append((f"({num}) {desc}", tag,
                     med(res[KERNEL]) / n, hit, hit / against if against > 0 else float("nan"),
                     hit_min, hit_min / against_min if against_min > 0 else float("nan")))
    return rows, notes, (hits, hits_min)


def print_goal(hits: tuple[dict, dict]) -> None:
    """Issue 10's goal: our optimized probe costs less than the kernel's own optimized kprobe,
    and far less than its INT3 kprobe (like for like: the module's empty pre_handler).
    Both estimates: from medians, and from each loop's best round."""
    for est, h in zip(("medians", "best rounds"), hits):
        if KRET:
            for lab, key, what in ((OURS_ENTRY, "k-ret-mod", "kretprobe, empty handler"),
                                   (OURS_INSIDE, "k-reto-mod", "kretprobe, empty entry_handler+handler"),
                                   (OURS_ENTRY, "k-ret-off", "kretprobe r: event, tracing_on=0")):
                if key in h and h[key] > 0:
                    print(f"  goal ({est}): ours {h[lab]:.1f} vs the kernel's {what} {h[key]:.1f} per hit: "
                          f"ours costs {h[lab] / h[key]:.2f}x theirs ({'less' if h[lab] < h[key] else 'MORE'})")
            continue
        ours = h[OURS_INSIDE]
        for key, what in (("k-opt-mod", "the kernel's optimized kprobe"), ("k-int3-mod", "the kernel's INT3 kprobe"),
                          ("k-int3-bpf", "the kernel's INT3 kprobe + empty BPF prog"),
                          ("k-opt-bpf", "the kernel's optimized kprobe + empty BPF prog")):
            if key in h and h[key] > 0:
                k = h[key]
                print(f"  goal ({est}): ours at +0xe {ours:.1f} vs {what} {k:.1f} per hit: ours costs "
                      f"{ours / k:.2f}x theirs ({'less' if ours < k else 'MORE'})")


def print_table(rows) -> None:
    """ns/call: median loop time / N; ns/hit and x ours: from medians; the last two: best rounds."""
    print(f"  {'configuration':60s} {'probe':9s} {'ns/call':>8s} {'ns/hit':>8s} {'x ours':>7s}"
          f" {'best:ns/hit':>11s} {'x ours':>7s}")
    f = lambda x, w, p: "" if x is None else f"{x:{w}.{p}f}"  # noqa: E731
    for what, kind, per_call, hit, ratio, hit_min, ratio_min in rows:
        print(f"  {what:60s} {kind:9s} {per_call:8.1f} {f(hit, 8, 1):>8s} {f(ratio, 7, 2):>7s}"
              f" {f(hit_min, 11, 1):>11s} {f(ratio_min, 7, 2):>7s}")


def is_ours(what: str) -> bool:
    return " ours " in what


def print_verdicts(rows) -> int:
    """Each of the kernel's configurations against ours at the same place (the row's
    "x ours": its cost over ours, from medians): "less" when ours costs less.  Prints a
    line per row and a summary; returns how many rows say MORE (the check of
    tests/kernel/test_kernel_bench.py and --check)."""
    more = 0
    for what, kind, per_call, hit, ratio, hit_min, ratio_min in rows:
        if hit is None or is_ours(what):
            continue
        less = ratio == ratio and ratio > 1       # nan (ours costs nothing measurable): MORE
        more += not less
        print(f"  verdict: {what}: {hit:.1f} per hit, ours {hit / ratio:.1f}: ours costs "
              f"{1 / ratio:.2f}x theirs ({'less' if less else 'MORE'})")
    n = sum(1 for r in rows if r[3] is not None and not is_ours(r[0]))
    print(f"  verdict: ours costs less than the kernel's own in {n - more} of {n} rows"
          + ("" if not more else f": MORE in {more}"))
    return more


# --- the regression guard: ours against the committed table --------------------------------------
README = ROOT / "benchmarks" / "README.md"
GUARD_GROWTH = 1.02     # ours may cost at most 2% more guest instructions a hit than the committed table says


def committed_hits(path: Path, marker: str) -> dict[str, float]:
    """Ours' per-hit figures in the table last committed between <!-- MARKER:begin --> and
    <!-- MARKER:end --> of path (its bold rows): configuration -> guest instructions a hit."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    doc = path.read_text() if path.exists() else ""
    i, j = doc.find(begin), doc.find(end)
    out = {}
    for line in doc[i:j].splitlines() if 0 <= i < j else []:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("**(") and cells[3].startswith("**"):
            out[cells[0].strip("*")] = float(cells[3].strip("*").replace(",", ""))
    return out


def committed_params(path: Path, marker: str) -> tuple[int, int, int] | None:
    """(calls per loop, warm-up calls, rounds) the committed table was measured with (its head
    says), or None: the guard compares runs of the same loops only."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    doc = path.read_text() if path.exists() else ""
    i, j = doc.find(begin), doc.find(end)
    m = re.search(r"loops of ([\d,]+) calls after ([\d,]+) warm-up calls, (\d+) rounds per phase", doc[i:j]) \
        if 0 <= i < j else None
    return tuple(int(g.replace(",", "")) for g in m.groups()) if m else None


def guard(rows, committed: dict[str, float], notes: list[str]) -> None:
    """Each of our rows against the committed table (icount: deterministic): a row that grew by
    more than GUARD_GROWTH is a failed check (notes), whatever the kernel's own cost; prints a
    line per row."""
    for what, kind, per_call, hit, *_ in rows:
        base = committed.get(what)
        if hit is None or not is_ours(what) or base is None:
            continue
        grew = hit > base * GUARD_GROWTH
        print(f"  guard: {what}: {hit:.1f} per hit, the committed table {base:.1f} "
              f"({hit / base - 1:+.1%}: {'REGRESSION' if grew else 'kept'})")
        if grew:
            notes.append(f"{what}: {hit:.1f} guest instructions a hit, {hit / base - 1:+.1%} over the committed "
                         f"{base:.1f} (the guard allows {GUARD_GROWTH - 1:.0%})")


# --- the table in benchmarks/README.md (--write-table) -------------------------------------------
TABLE_MARKER = "kernel_probes"      # <!-- kernel_probes:begin --> ... <!-- kernel_probes:end -->


def measured_commit() -> str:
    """git rev-parse --short HEAD of the tree measured, "+dirty" if it has changes."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def markdown_table(rows, notes: list[str], head: str) -> str:
    """The benchmark's table as markdown: head (what, when, where), then every row."""
    out = [head, "",
           "| configuration | probe | instructions per call | per hit | × ours | ours against it |",
           "|---|---|---|---|---|---|"]
    for what, kind, per_call, hit, ratio, hit_min, ratio_min in rows:
        if hit is None:
            out.append(f"| {what} | {kind} | {per_call:,.1f} | | | |")
        elif is_ours(what):
            out.append(f"| **{what}** | {kind} | {per_call:,.1f} | **{hit:,.1f}** | 1 | |")
        else:
            less = ratio == ratio and ratio > 1
            out.append(f"| {what} | {kind} | {per_call:,.1f} | {hit:,.1f} | {ratio:.2f} | "
                       f"{'less' if less else '**MORE**'} |")
    if notes:
        out += [""] + [f"CHECK FAILED: {n}" for n in notes]
    return "\n".join(out) + "\n"


def write_table(path: Path, marker: str, text: str) -> None:
    """Replace what lies between <!-- MARKER:begin --> and <!-- MARKER:end --> in path."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    doc = path.read_text()
    i, j = doc.find(begin), doc.find(end)
    if i < 0 or j < i:
        sys.exit(f"kernel_probes: {path} has no {begin} ... {end} pair to write the table between")
    path.write_text(doc[:i + len(begin)] + "\n" + text + doc[j:])
    print(f"wrote the table between {begin} and {end} in {path}")


def table_head(args, k, mode: str, n: int, reps: int, warmup: int, commit: str, machine: str) -> str:
    cmd = " ".join(["python3", "benchmarks/kernel_probes.py"] + sys.argv[1:])
    return (f"Generated by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}; "
            f"{machine}; guest {k.release}, QEMU TCG `{' '.join(MODES[mode]) or 'wall clock'}`, `-smp 1`; loops of "
            f"{n:,} calls after {warmup:,} warm-up calls, {reps} rounds per phase.  Per hit: the median over "
            f"rounds of the loop's time against the unprobed reference loop, less the same difference unprobed"
            + (", in guest instructions (deterministic)" if mode == "icount" else ", in ns of the host's clock (noisy)")
            + "; × ours: a configuration's cost over ours at the same place (\"less\": ours costs less).")



def check_ours(r, calls: int, kind: str, inside: int, notes: list[str]) -> None:
    """Our two probes counted every call the loops made, 0 missed (their kprobe_profile rows
    at power-off); prints them, then every failed check of `notes`."""
    prof = ours_profile(r)
    for lab, off in ((OURS_ENTRY, 0), (OURS_INSIDE, inside)):
        check_hits(prof, f"{kind}_{TWINS[lab]}_{off}", calls, notes)
    for note in notes:
        print(f"  CHECK FAILED: {note}")


def check_hits(prof: dict, name: str, calls: int, notes: list[str]) -> None:
    """One of our probes counted every call the loops made, 0 missed; a note if not."""
    hits = prof.get(name)
    ok = hits is not None and hits[0] >= calls and hits[1] == 0
    print(f"  ours {name}: (hits, missed) = {hits} at power-off; the loops made {calls} calls"
          + ("" if ok else "   <-- MISMATCH"))
    if not ok:
        notes.append(f"{name}: hits {hits}, expected >= {calls}, 0 missed")

# --- row k: a single-stepped breakpoint probe (--singlestep) -------------------------------------
SINGLESTEP_DOC = """
SINGLESTEP (row k)
------------------
The twins above have no instruction that either the kernel or we single-step: their movs are
boosted, their call/jmp emulated.  Nor has any pair of identical functions on a cheap system
call's path in Debian's 6.1 kernel (a scan of every function for one with an instruction that
can_boost() refuses and prepare_emulation() does not emulate, grouped by shape, finds twins only
among trace_raw_output_*, page-table, APIC, perf NMI and retpoline-thunk code).  So row k probes
ONE instruction, the same for ours and the kernel's, in two boots (icount counts are
deterministic, so boots compare as rounds do):

  task_sched_runtime+0xb2   prefetcht0 0x40(%rax): prefetch_curr_exec_start(), on the path of
                            clock_gettime(CLOCK_THREAD_CPUTIME_ID) for the calling task (running
                            and queued: task_rq_lock(), then the prefetches), which the vDSO does
                            not serve.  0f 18 is not in twobyte_is_boostable[], nor is it emulated:
                            the kernel's INT3 kprobe copies it into its insn slot and single-steps
                            it there (an int3 after the copy, since 5.14); ours does the same
                            (`check` says int3 [single-step]; Rules.singlestep_breakpoint).

  the rewritten kernel      ours, an int3 probe (optimize = false), empty pre_handler;
                            /init times the cputime loop against getegid (never probed)
  the unmodified kernel     phase none: the same loops unprobed (ours' and the kernel's
                            baseline); then the kernel's INT3 kprobes on the same instruction
                            (kprobes-optimization = 0): the module (empty pre_handler),
                            an empty BPF program, the tracefs event

The kernel's probes are measured in the unmodified kernel: in the rewritten one every kernel
int3 trap passes through our int3 hook first (our site lookup, a miss), which would charge the
kernel's two traps per hit with our lookup.
"""
SS_FUNC, SS_OFF, SS_LOOP = "task_sched_runtime", 0xB2, "cputime"
SS_LABELS = (REF, SS_LOOP)
SS_PHASES = [
    ("none", "no probe", None, None, None),
    ("k-ss-mod", "kernel kprobe INT3 single-step, module, empty pre_handler", SS_OFF, "module", ""),
    ("k-ss-bpf", "kernel kprobe INT3 single-step, empty BPF prog", SS_OFF, "bpf", ""),
    ("k-ss-event", "kernel kprobe INT3 single-step, tracefs event", SS_OFF, "event", ""),
]


def singlestep_rewrite(k, work: Path) -> Path:
    """Ours at SS_FUNC+SS_OFF: an int3 probe whose instruction is single-stepped (check says so)."""
    import json
    spec = work / "probes-ss.toml"
    spec.write_text(f'optimize = false\nhandlers = ["{HANDLER_SRC}"]\n[[kprobe]]\nsymbol_name = "{SS_FUNC}"\n'
                    f'offset = {SS_OFF:#x}\npre_handler = "bench_empty"\n')
    plan = json.loads(kprewrite("check", k.vmlinux, "--spec", spec, "--format", "json"))["probes"][0]
    if (plan["decision"], plan.get("int3")) != ("int3", "single-step"):
        sys.exit(f"kernel_probes: check says {plan}, expected an int3 probe, single-stepped")
    text = kprewrite("check", k.vmlinux, "--spec", spec).split("\n")[0]
    out = work / "vmlinux-ss.kp"
    t = time.monotonic()
    kprewrite("instrument", k.vmlinux, "--spec", spec, "-o", out)
    print(f"kprewrite check: {text}; instrument {time.monotonic() - t:.1f} s")
    return out


def singlestep_check_insn(vmlinux: Path) -> str:
    """The probed instruction, which both the kernel and we single-step (can_boost(): no;
    prepare_emulation(): no)."""
    from rewriter.elf.image import Image
    from rewriter.targets import linux_kernel
    from rewriter.arch.x86_64 import insn as x86insn
    import capstone
    image = Image(str(vmlinux))
    linux_kernel.load_symbols(image)
    f = next(f for f in image.functions if f.name == SS_FUNC)
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    at = {i.address - f.start: i for i in cs.disasm(image.read(f.start, f.end - f.start), f.start)}
    i = at.get(SS_OFF)
    info = x86insn.classify(bytes(i.bytes), i.address) if i else None
    if i is None or info.boostable or info.emulate or i.mnemonic != "prefetcht0":
        sys.exit(f"kernel_probes: {SS_FUNC}+{SS_OFF:#x} is not the single-stepped prefetcht0 of 6.1: "
                 f"{i and (i.mnemonic, i.op_str)} {info}")
    return f"{i.mnemonic} {i.op_str} ({i.bytes.hex()}: {info.boost_reason})"


def singlestep_analyse(main: dict, calib: dict, n: int, reps: int, warmup: int):
    """Row k: (rows, notes).  Per hit = (T(cputime) - T(getegid)) of the probed configuration,
    minus the same difference unprobed (the unmodified kernel's phase none), over N."""
    notes = []
    base_ph = calib["phases"]["none"]["results"]
    base = med(diffs(base_ph, SS_LOOP))
    base_min = min(base_ph[SS_LOOP]) - min(base_ph[REF])
    rows = [("(0) no probe: getegid, the reference", "-", med(base_ph[REF]) / n, None, None, None, None),
            (f"(0) no probe: {SS_LOOP} (unmodified kernel)", "-", med(base_ph[SS_LOOP]) / n, None, None, None, None)]
    res = main["phases"]["none"]["results"]
    ours = (med(diffs(res, SS_LOOP)) - base) / n
    ours_min = (min(res[SS_LOOP]) - min(res[REF]) - base_min) / n
    rows.append(("(k) ours int3, single-stepped, empty pre_handler", "int3", med(res[SS_LOOP]) / n,
                 ours, 1.0, ours_min, 1.0))
    calls = reps * (n + warmup)
    for key, desc, where, how, kind in SS_PHASES[1:]:
        ph = calib["phases"].get(key)
        if ph is None:
            continue
        r = ph["results"]
        hit = (med(diffs(r, SS_LOOP)) - base) / n
        hit_min = (min(r[SS_LOOP]) - min(r[REF]) - base_min) / n
        listed = [l for l in ph["lines"] if l.startswith(("LIST ", "BPF-KPROBE ")) and SS_FUNC in l]
        if not listed or "[OPTIMIZED]" in " ".join(listed) or "[FTRACE]" in " ".join(listed):
            notes.append(f"{key}: kprobes/list shows {listed!r}, expected an INT3 kprobe")
        if how == "module":
            got = [tuple(map(int, m.groups())) for l in ph["lines"]
                   for m in [re.search(r"bench_kprobe: \S+ hits (\d+) nmissed (\d+)", l)] if m]
            if len(got) != 1 or got[0][0] < calls or got[0][1]:
                notes.append(f"{key}: the module's (hits, nmissed) {got}, expected >= {calls}, 0 missed")
        if how == "event":
            prof = [l.split() for l in ph["lines"] if l.startswith("PROFILE ")]
            got = [(int(p[2]), int(p[3])) for p in prof if len(p) >= 4 and p[1] == "bench"]
            if len(got) != 1 or got[0][0] < calls or got[0][1]:
                notes.append(f"{key}: tracefs kprobe_profile (hits, missed) {got}, expected >= {calls}, 0 missed")
        if any(l.startswith(("BPF-ERROR", "SETUP-FAILED")) for l in ph["lines"]):
            notes.append(f"{key}: setup failed")
        rows.append((f"(k) {desc}", "int3", med(r[SS_LOOP]) / n, hit, hit / ours if ours > 0 else float("nan"),
                     hit_min, hit_min / ours_min if ours_min > 0 else float("nan")))
    return rows, notes


def singlestep_main(args, k, work: Path) -> list:
    """Row k's boots in each mode: [(mode, n, reps, warmup, rows, notes, rows saying MORE)]."""
    results = []
    print(f"probed: {SS_FUNC}+{SS_OFF:#x}: {singlestep_check_insn(k.vmlinux)}")
    loop_bin = work / "syscall_loop"
    sh(["gcc", "-static", "-O2", "-Wall", "-o", str(loop_bin), str(LOOP_SRC)])
    kp = singlestep_rewrite(k, work)
    ko = build_module(k, work)
    files = {"bench": loop_bin, **({"bench_kprobe.ko": ko} if ko else {})}
    phases = [ph for ph in SS_PHASES if ko or ph[3] != "module"]
    for mode in args.modes.split(","):
        n, reps, warmup = (a if a is not None else d for a, d in zip((args.n, args.reps, args.warmup), DEFAULTS[mode]))
        t = time.monotonic()
        calib = run_boot(k.vmlinux, phases, n, reps, warmup, mode, files, work / f"unmodified-ss-{mode}.console.txt",
                         SS_LABELS, SS_FUNC)
        t1 = time.monotonic()
        r = run_boot(kp, SS_PHASES[:1], n, reps, warmup, mode, files, work / f"rewritten-ss-{mode}.console.txt",
                     SS_LABELS, SS_FUNC)
        t2 = time.monotonic()
        rows, notes = singlestep_analyse(parse(r), parse(calib), n, reps, warmup)
        print(f"\n== QEMU mode: {mode}; unmodified kernel boot {t1 - t:.0f} s, rewritten kernel boot {t2 - t1:.0f} s; "
              f"loops of N = {n} calls after {warmup} warm-up calls, {reps} rounds per phase, -smp 1")
        print_table(rows)
        more = print_verdicts(rows)
        if mode == "icount":
            guard(rows, committed_hits(README, TABLE_MARKER + "-singlestep"), notes)
        check_hits(ours_profile(r), f"p_{SS_FUNC}_{SS_OFF}", reps * (n + warmup), notes)
        for note in notes:
            print(f"  CHECK FAILED: {note}")
        results.append((mode, n, reps, warmup, rows, notes, more))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="icount,tcg", help="comma-separated: icount, tcg (default both)")
    ap.add_argument("-n", type=int, help="system calls per timed loop (default: icount 100000, tcg 10000)")
    ap.add_argument("--reps", type=int, help="rounds per phase (default: icount 3, tcg 60)")
    ap.add_argument("--warmup", type=int, help="untimed calls before each loop (default: icount 20000, tcg 2000)")
    ap.add_argument("--keep", metavar="DIR", help="keep the rewritten kernel, spec and consoles in DIR")
    ap.add_argument("--int3", action="store_true", help="ours at +0xe as a breakpoint probe (optimize = false), "
                    "against the kernel's INT3 kprobes only")
    ap.add_argument("--kret", action="store_true", help="kretprobes (rows r and ro): ours against the kernel's "
                    "register_kretprobe() and tracefs r: event")
    ap.add_argument("--singlestep", action="store_true", help="row k: a breakpoint probe whose instruction is "
                    "single-stepped, ours against the kernel's INT3 kprobes on the same instruction")
    ap.add_argument("--write-table", metavar="FILE", type=Path,
                    help="write the icount table, dated, with the commit and the machine, between "
                    "<!-- kernel_probes:begin --> and <!-- kernel_probes:end --> in FILE (e.g. benchmarks/README.md; "
                    "with --int3, --kret or --singlestep: the markers kernel_probes-int3, -kret, -singlestep)")
    ap.add_argument("--check", action="store_true",
                    help="exit with status 3 when ours costs MORE than any of the kernel's configurations, or "
                    "(icount) a row of ours grew by more than 2%% over the table committed in benchmarks/README.md")
    args = ap.parse_args()
    if args.write_table and "icount" not in args.modes.split(","):
        sys.exit("kernel_probes: --write-table writes the icount figures: add icount to --modes")
    commit = measured_commit()      # the tree measured, before anything is written
    global INSIDE_KIND, KRET
    KRET = args.kret
    if args.int3:
        INSIDE_KIND = "int3"
    t_start = time.monotonic()

    k = kernel_env.obtain_kernel()
    qemu = sh(["qemu-system-x86_64", "--version"]).stdout.splitlines()[0]
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"kernel: {k.release} ({k.package} {k.version})")
    machine = f"{cpu}, {os.cpu_count()} CPUs (shared), {platform.machine()}, {qemu}"
    print(f"machine: {cpu}, {os.cpu_count()} CPUs (shared), {platform.machine()}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {qemu}")
    print(f"commit: {commit}")
    marker = TABLE_MARKER + ("-singlestep" if args.singlestep else "-kret" if args.kret else
                             "-int3" if args.int3 else "")
    if args.write_table and f"<!-- {marker}:begin -->" not in args.write_table.read_text():
        sys.exit(f"kernel_probes: {args.write_table} has no <!-- {marker}:begin --> marker")
    results = []

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.singlestep:
        results = singlestep_main(args, k, work)
        finish(args, k, work, results, marker, commit, machine, t_start)
        return
    check_twins(k.vmlinux)
    loop_bin = work / "syscall_loop"
    sh(["gcc", "-static", "-O2", "-Wall", "-o", str(loop_bin), str(LOOP_SRC)])
    kp = rewrite(k, work, args.int3)
    ko = build_module(k, work)
    files = {"bench": loop_bin, **({"bench_kprobe.ko": ko} if ko else {})}
    phases = [ph for ph in KRET_PHASES if ko or not (ph[3] or "").endswith("module")] if KRET else \
        [ph for ph in PHASES if (ko or ph[3] != "module") and (not args.int3 or ph[0] in ("none", "k-int3-mod",
                                                                                              "k-int3-bpf", "k-int3-event"))]

    for mode in args.modes.split(","):
        n, reps, warmup = (a if a is not None else d for a, d in zip((args.n, args.reps, args.warmup), DEFAULTS[mode]))
        t = time.monotonic()
        calib = run_boot(k.vmlinux, PHASES[:1], n, reps, warmup, mode, files,
                         work / f"unmodified-{mode}.console.txt")
        t1 = time.monotonic()
        r = run_boot(kp, phases, n, reps, warmup, mode, files, work / f"rewritten-{mode}.console.txt")
        t2 = time.monotonic()
        main_p, calib_p = parse(r), parse(calib)
        rows, notes, hits = analyse(main_p, calib_p, n, reps, warmup)
        desc = ("TCG, -icount shift=0,sleep=off: 1 ns = 1 guest instruction (deterministic)" if mode == "icount"
                else "TCG, wall clock of the shared host (noisy)")
        print(f"\n== QEMU mode: {desc}; calibration boot {t1 - t:.0f} s, benchmark boot {t2 - t1:.0f} s")
        info = main_p["info"]
        print("guest: " + "; ".join(l.replace("\t", "") for l in info if "model name" in l or l.startswith("clocksource"))
              + f"; -smp 1, -m 512; loops of N = {n} calls after {warmup} warm-up calls, {reps} rounds per phase")
        print_table(rows)
        print_goal(hits)
        more = print_verdicts(rows)
        if mode == "icount":
            if committed_params(README, marker) == (n, warmup, reps):
                guard(rows, committed_hits(README, marker), notes)
            else:
                print(f"  guard: not compared: the committed table's loops were {committed_params(README, marker)} "
                      f"(calls, warm-up, rounds), these ({n}, {warmup}, {reps})")
        check_ours(r, len(phases) * reps * (n + warmup), "r" if KRET else "p", 0 if KRET else INSIDE, notes)
        results.append((mode, n, reps, warmup, rows, notes, more))
    finish(args, k, work, results, marker, commit, machine, t_start)


def finish(args, k, work: Path, results: list, marker: str, commit: str, machine: str, t_start: float) -> None:
    """--write-table and --check on each mode's (mode, n, reps, warmup, rows, notes, rows saying MORE)."""
    if not args.keep:
        shutil.rmtree(work)
    for mode, n, reps, warmup, rows, notes, more in results:
        if args.write_table and mode == "icount":
            head = table_head(args, k, mode, n, reps, warmup, commit, machine)
            write_table(args.write_table, marker, markdown_table(rows, notes, head))
    print(f"\ntotal {time.monotonic() - t_start:.0f} s")
    if args.check and any(more or notes for *_, notes, more in results):
        print("kernel_probes: --check: " + "; ".join(
            f"{mode}: MORE in {more} rows, {len(notes)} failed checks" for mode, *_, notes, more in results),
            file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Kernel benchmark, arm64: the cost of a probe hit, ours and Debian's arm64 kernel's own kprobes
(BRK) side by side in the same boot, under qemu-system-aarch64 -M virt -cpu max.

Run: python3 benchmarks/kernel_arm64_probes.py [--modes icount,tcg] [-n N] [--reps R] [--warmup W]
                                               [--keep DIR] [--write-table benchmarks/README.md] [--check]
     (--write-table FILE: the icount table, dated, with the commit measured and the machine, replaces
      what lies between <!-- kernel_arm64_probes:begin --> and <!-- kernel_arm64_probes:end --> in FILE)
     (--check: exit status 3 when ours costs MORE than any of the kernel's configurations it is
      compared with, when (icount) a row of ours grew by more than 2% over the table committed in
      benchmarks/README.md, or a check failed)
     (fetches Debian's arm64 cloud kernel like tests/kernel/arm64_env.py does; needs
      aarch64-linux-gnu-gcc, make, qemu-system-arm, qemu-user)

The harness is benchmarks/kernel_probes.py's (x86-64), imported: the syscall loop
(benchmarks/kernel/syscall_loop.c, `svc #0` when built for arm64), the phases' shell text,
the per-hit arithmetic, the table, the guard.  Mainline arm64 has no optimized kprobes and, in
6.1, no kprobes on ftrace: every kprobe of the kernel's is a BRK, its instruction single-stepped
out of line or simulated; a kretprobe is a BRK kprobe at the entry that swaps x30.

Twin system calls (the same instructions, checked with capstone: they differ only in the cred
field they load and the from_k*id_munged() they call):

  getuid  -> __arm64_sys_getuid     ours at the entry (a `B` past the ftrace NOPs), empty pre_handler
  geteuid -> __arm64_sys_geteuid    ours at +0x18 (ldr x0, [x0, #0x768]: jump-optimized), empty pre_handler
  getgid  -> __arm64_sys_getgid     the kernel's own, at +0x0 and +0x18, one configuration at a time
  getegid -> __arm64_sys_getegid    never probed: the reference loop run right before the others

and in a second rewritten kernel (kretprobes): ours on getuid (empty handler) and on geteuid
(empty entry_handler and handler), the kernel's on getgid; in a third, ours on getuid's entry with
a trace event (no fetch args, as the kernel's `p:bench`) and the counting pre_handler.  Four
boots: the unmodified kernel (the loops unprobed: ours' baseline), the kprobe kernel (phase none,
then the kernel's kprobes from the module benchmarks/kernel/bench_kprobe.c, the tracefs `p:`
event, the event with tracing_on = 0), the kretprobe kernel (the module's register_kretprobe(),
both ways, the tracefs `r:` event, with and without tracing_on), the event kernel (phase none:
our event's entries written are read from the trace's header, its hits from the handler).  Every handler, ours and the module's,
counts its hits in a static variable; ours' counts are printed from a probe on
__arm64_sys_sync (benchmarks/kernel/arm64_handlers.c), the module's at rmmod, tracefs's in
kprobe_profile, each checked against the calls the loops made.

The module is built on this x86-64 host with Debian's linux-headers-<release> (arm64),
linux-headers-<abi>-common and the amd64 linux-kbuild (fixdep, modpost run natively: the
headers' scripts and tools symlinks lead into it), `make ARCH=arm64
CROSS_COMPILE=aarch64-linux-gnu-`; apt-get download, unpacked into the kernel cache.

Per hit = (median over rounds of [T(x) - T(getegid)] - the same difference with x unprobed) / N,
in guest instructions under -icount shift=0,sleep=off (1 ns = 1 instruction: deterministic);
a trap (BRK, the single-step's exception) costs no more than its instructions there.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import kernel_probes as kp  # noqa: E402  (puts tests/kernel and the tree on sys.path)
import arm64_env  # noqa: E402
import kernel_env  # noqa: E402

HANDLER_SRC = HERE / "kernel" / "arm64_handlers.c"
TWINS = {"getuid": "__arm64_sys_getuid", "geteuid": "__arm64_sys_geteuid",
         "getgid": "__arm64_sys_getgid", "getegid": "__arm64_sys_getegid"}
INSIDE = 0x18                   # ldr x0, [x0, #0x768]: current->cred, after the frame record
OURS_ENTRY, OURS_INSIDE, KERNEL, REF = kp.OURS_ENTRY, kp.OURS_INSIDE, kp.KERNEL, kp.REF
KFUNC = TWINS[KERNEL]
REPORT = "__arm64_sys_sync"     # bench_report(): our hit counts, from `sync` at the end
CPU = "max,pauth-impdef=on"     # pointer authentication on, with QEMU's cheaper (same-instruction) cipher
TABLE_MARKER = "kernel_arm64_probes"

# (key, description, where, how, boot): how as in kernel_probes.setup_cmds().
PHASES = [
    ("none", "no kernel probe", None, None, "p"),
    ("k-entry-mod", "kernel kprobe at entry, BRK, module, empty pre_handler", 0, "module", "p"),
    ("k-entry-event", "kernel kprobe at entry, BRK, tracefs p: event", 0, "event", "p"),
    ("k-entry-off", "kernel kprobe at entry, BRK, p: event, tracing_on=0", 0, "event-off", "p"),
    ("k-in-mod", f"kernel kprobe +{INSIDE:#x}, BRK, module, empty pre_handler", INSIDE, "module", "p"),
    ("k-in-event", f"kernel kprobe +{INSIDE:#x}, BRK, tracefs p: event", INSIDE, "event", "p"),
    ("k-in-off", f"kernel kprobe +{INSIDE:#x}, BRK, p: event, tracing_on=0", INSIDE, "event-off", "p"),
]
KRET_PHASES = [
    ("none", "no kernel probe", None, None, "r"),
    ("k-ret-mod", "kernel kretprobe, BRK, module, empty handler", 0, "kret-module", "r"),
    ("k-reto-mod", "kernel kretprobe, BRK, module, empty entry_handler+handler", 0, "kreto-module", "r"),
    ("k-ret-event", "kernel kretprobe, BRK, tracefs r: event", 0, "kret-event", "r"),
    ("k-ret-off", "kernel kretprobe, BRK, r: event, tracing_on=0", 0, "kret-event-off", "r"),
]
# The third rewritten kernel: ours with a trace event (no fetch args, as the kernel's `p:bench`),
# written into the ring buffer by the runtime placed at boot; the trace's header read after.
EVENT_PHASES = [("none", "no kernel probe", None, None, "e")]
TRACE_HEAD = "head -3 /sys/kernel/tracing/trace | sed -n 's/^# entries-in-buffer/EVENTS &/p'\n"
# Which of ours each kernel configuration is compared with (the kernel's p: event with ours, when
# the event boot ran, else with our empty pre_handler).
AGAINST = {"k-entry-mod": "entry", "k-entry-event": "event", "k-entry-off": "entry",
           "k-in-mod": "inside", "k-in-event": "inside", "k-in-off": "inside",
           "k-ret-mod": "ret", "k-reto-mod": "reto", "k-ret-event": "ret", "k-ret-off": "ret"}
OURS = {  # key: (boot, loop, row, probe kind as `check` says)
    "entry": ("p", OURS_ENTRY, "(1) ours at entry, empty pre_handler", "ftrace"),
    "inside": ("p", OURS_INSIDE, f"(2) ours at +{INSIDE:#x}, empty pre_handler", "optimized"),
    "ret": ("r", OURS_ENTRY, "(r) ours kretprobe, empty handler", "ftrace"),
    "reto": ("r", OURS_INSIDE, "(ro) ours kretprobe, empty entry_handler+handler", "ftrace"),
    "event": ("e", OURS_ENTRY, "(e) ours at entry, p: event (no args) into the ring buffer, empty pre_handler",
              "ftrace"),
}
COUNTED_AS = {"event": "entry"}     # the handler whose count ours_hits() reports for it
GOAL = 0.3      # issue 40: our jump-optimized hit <= 0.3x the kernel's BRK kprobe on the same function
DEFAULTS = kp.DEFAULTS


def check_twins(image_path: Path) -> None:
    """The four functions are the same instructions up to their immediates and call targets,
    and +INSIDE is an instruction."""
    import capstone
    from rewriter.targets.linux_kernel.aarch64 import image as arm_image
    img = arm_image.parse(image_path.read_bytes(), str(image_path))
    cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)
    shapes = {}
    for sc, name in TWINS.items():
        a = img.syms[name]
        end = min(v for v in img.syms.values() if v > a)
        insns = list(cs.disasm(img.data[a - img.text:end - img.text], a))
        shapes[sc] = [(i.address - a, i.mnemonic) for i in insns]
        if (INSIDE, "ldr") not in shapes[sc] or shapes[sc][:3] != [(0, "nop"), (4, "nop"), (8, "paciasp")]:
            sys.exit(f"kernel_arm64_probes: {name} is not the 6.1 shape (nop, nop, paciasp, ... ldr at "
                     f"+{INSIDE:#x}): {shapes[sc]}")
    if len({tuple(s) for s in shapes.values()}) != 1:
        sys.exit(f"kernel_arm64_probes: {', '.join(TWINS.values())} are no longer twins in this kernel: {shapes}")


def rewrite(k, work: Path, boot: str) -> Path:
    """Ours: kprobes (boot "p") or kretprobes (boot "r") on getuid and geteuid, and the report
    probe; `check` must place them as the table says."""
    spec = work / f"probes-{boot}.toml"
    text = f'handlers = ["{HANDLER_SRC}"]\n'
    if boot == "e":
        text += (f'[[kprobe]]\nsymbol_name = "{TWINS[OURS_ENTRY]}"\nname = "bench_ours"\npre_handler = "bench_entry"\n'
                 'fetch = ""\n')
        want = [f"{TWINS[OURS_ENTRY]}+0x0  k  ftrace"]
    elif boot == "p":
        text += (f'[[kprobe]]\nsymbol_name = "{TWINS[OURS_ENTRY]}"\npre_handler = "bench_entry"\n'
                 f'[[kprobe]]\nsymbol_name = "{TWINS[OURS_INSIDE]}"\noffset = {INSIDE:#x}\npre_handler = "bench_inside"\n')
        want = [f"{TWINS[OURS_ENTRY]}+0x0  k  ftrace", f"{TWINS[OURS_INSIDE]}+{INSIDE:#x}  k  optimized"]
    else:
        text += (f'[[kretprobe]]\nsymbol_name = "{TWINS[OURS_ENTRY]}"\nhandler = "bench_ret"\n'
                 f'[[kretprobe]]\nsymbol_name = "{TWINS[OURS_INSIDE]}"\nhandler = "bench_reto"\n'
                 'entry_handler = "bench_reto_entry"\n')
        want = [f"{TWINS[x]}+0x0  r  ftrace  returns: trampoline" for x in (OURS_ENTRY, OURS_INSIDE)]
    text += f'[[kprobe]]\nsymbol_name = "{REPORT}"\npre_handler = "bench_report"\n'
    spec.write_text(text)
    plan = kp.kprewrite("check", k.vmlinuz, "--spec", spec).splitlines()
    want.append(f"{REPORT}+0x0  k  ftrace")
    if sorted(next((p[:len(w)] for p in plan if p.startswith(w.split()[0] + " ")), None) or "" for w in want) != sorted(want):
        sys.exit(f"kernel_arm64_probes: check says {plan}, expected {want}")
    out = work / f"Image-{boot}.kp"
    t = time.monotonic()
    kp.kprewrite("instrument", k.vmlinuz, "--spec", spec, "-o", out)
    print(f"kprewrite check: {'; '.join(p[:60] for p in plan)}; instrument {time.monotonic() - t:.1f} s")
    return out


def build_module(k, work: Path) -> Path | None:
    """bench_kprobe.ko for this arm64 kernel, cross-built here; None, with the reason printed,
    where that cannot be done."""
    hdr = arm64_env._root() / f"headers-{k.release}_{k.version}"
    abi = k.release.removesuffix("-cloud-arm64")              # 6.1.0-57
    kbuild = "linux-kbuild-" + ".".join(abi.split(".")[:2])    # linux-kbuild-6.1
    build = hdr / "usr" / "src" / f"linux-headers-{k.release}"
    if not (hdr / ".done").exists():
        dl = work / "debs"
        dl.mkdir(exist_ok=True)
        # The host's kbuild (amd64): its fixdep and modpost run here (no binfmt_misc for arm64 ones).
        pkgs = [f"linux-headers-{k.release}:arm64={k.version}", f"linux-headers-{abi}-common={k.version}",
                f"{kbuild}:amd64={k.version}"]
        r = subprocess.run(["apt-get", "download", "-q", *pkgs], cwd=dl, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"no module phases: apt-get download {' '.join(pkgs)} failed: {r.stderr.strip()[-300:]}")
            return None
        shutil.rmtree(hdr, ignore_errors=True)
        hdr.mkdir(parents=True)
        for deb in sorted(dl.glob("*.deb")):
            kp.sh(["dpkg-deb", "-x", str(deb), str(hdr)])
            deb.unlink()
        # scripts -> ../../lib/linux-kbuild-6.1/scripts: relative, into the amd64 kbuild unpacked beside.
        for link in ("scripts", "tools"):
            if not (build / link).resolve().is_dir():
                print(f"no module phases: {build / link} leads nowhere ({os.readlink(build / link)})")
                return None
        # The arch Makefile includes the common tree by its absolute /usr/src path.
        mk = build / "Makefile"
        mk.write_text(mk.read_text().replace("/usr/src/", f"{hdr}/usr/src/"))
        (hdr / ".done").write_text("")
    src = work / "module"
    src.mkdir(exist_ok=True)
    (src / "bench_kprobe.c").write_text(kp.MODULE_SRC.read_text())
    (src / "Kbuild").write_text("obj-m := bench_kprobe.o\n")
    r = subprocess.run(["make", "-C", str(build), f"M={src}", "ARCH=arm64", "CROSS_COMPILE=aarch64-linux-gnu-",
                        "modules"], capture_output=True, text=True)
    ko = src / "bench_kprobe.ko"
    if r.returncode != 0 or not ko.exists():
        print(f"no module phases: building bench_kprobe.ko failed:\n{r.stderr[-1500:]}")
        return None
    return ko


def run_boot(image: Path, phases, n, reps, warmup, mode, files: dict, log: Path) -> kernel_env.BootResult:
    init = kp.init_commands([ph[:4] + (None,) for ph in phases], n, reps, warmup, func=KFUNC) + "sync\n"
    if phases and phases[0][4] == "e":
        init += TRACE_HEAD
    initrd = arm64_env.build_initramfs(kernel_env.init_script(init), files)
    r = arm64_env.boot(image, initrd, cpu=CPU, smp=1, memory=512, timeout=1800, log=log, qemu_args=kp.MODES[mode])
    if not r.reached(kernel_env.DONE_MARKER) or "== end" not in r.console:
        sys.exit(r.explain(f"{image.name} ({mode}): /init did not finish"))
    bad = r.problems()
    if bad:
        sys.exit(r.explain("the kernel reported problems:\n  " + "\n  ".join(bad[:10])))
    return r


def ours_hits(r) -> dict[str, int]:
    """Our handlers' counts, the last report (bench_report() on `sync`)."""
    m = re.findall(r"kprewrite-bench: hits entry (\d+) inside (\d+) ret (\d+) reto (\d+)", r.console)
    return dict(zip(("entry", "inside", "ret", "reto"), map(int, m[-1]))) if m else {}


def analyse(boots: dict, calib: dict, counts: dict, n: int, reps: int, warmup: int):
    """Table rows, the checks made on the way, {key: (ours' per hit, the kernel's per hit)}."""
    notes, rows, ours = [], [], {}
    c0 = calib["phases"]["none"]["results"]
    p0 = next(iter(boots.values()))["phases"]["none"]["results"]
    rows.append(("(0) no probe: getegid, the reference", "-", kp.med(p0[REF]) / n, None, None, None, None))
    rows.append(("(0) no probe: getgid (kernel's twin)", "-", kp.med(p0[KERNEL]) / n, None, None, None, None))
    for lab in (OURS_ENTRY, OURS_INSIDE):
        rows.append((f"(0) no probe: {lab} (unmodified kernel boot)", "-", kp.med(c0[lab]) / n, None, None, None, None))
    for key, (boot, lab, what, kind) in OURS.items():
        if boot not in boots:
            continue
        phs = boots[boot]["phases"].values()
        d = [x for ph in phs for x in kp.diffs(ph["results"], lab)]
        ours[key] = (kp.med(d) - kp.med(kp.diffs(c0, lab))) / n
        rows.append((what, kind, kp.med([x for ph in phs for x in ph["results"][lab]]) / n, ours[key], 1.0, None, None))
        calls = len(boots[boot]["phases"]) * reps * (n + warmup)
        got = counts[boot].get(COUNTED_AS.get(key, key))
        if key == "event":
            written = [int(w) for w in re.findall(r"^EVENTS # entries-in-buffer/entries-written: \d+/(\d+)",
                                                  boots[boot]["console"], re.M)]
            print(f"  ours event: {written} entries written into the ring buffer")
            if not written or written[-1] < calls:
                notes.append(f"ours event: the trace says {written} entries written, expected >= {calls}")
        print(f"  ours {key}: {got} hits counted by its handler; the loops made {calls} calls")
        if got is None or got < calls:
            notes.append(f"ours {key}: its handler counted {got} hits, expected >= {calls}")
    pairs = {}
    for key, desc, where, how, boot in PHASES[1:] + KRET_PHASES[1:]:
        ph = boots.get(boot, {}).get("phases", {}).get(key)
        if ph is None:
            continue
        res = ph["results"]
        ref = kp.med(kp.diffs(boots[boot]["phases"]["none"]["results"], KERNEL))
        hit = (kp.med(kp.diffs(res, KERNEL)) - ref) / n
        against = ours.get(AGAINST[key], ours.get("entry"))
        pairs[key] = (against, hit)
        listed = [l for l in ph["lines"] if l.startswith("LIST ") and KFUNC in l]
        if not listed or any(f"[{t}]" in l for l in listed for t in ("FTRACE", "OPTIMIZED", "DISABLED")):
            notes.append(f"{key}: kprobes/list shows {listed!r}, expected the kernel's kprobe (BRK), enabled")
        want = reps * (n + warmup)
        if "event" in how:
            prof = [l.split() for l in ph["lines"] if l.startswith("PROFILE ")]
            got = [(int(p[2]), int(p[3])) for p in prof if len(p) >= 4 and p[1] == "bench"]
            if got != [(want, 0)]:
                notes.append(f"{key}: tracefs kprobe_profile says (hits, missed) {got}, expected [({want}, 0)]")
        if how.endswith("module"):
            got = [tuple(map(int, m.groups())) for l in ph["lines"]
                   for m in [re.search(r"bench_kprobe: \S+ hits (\d+) nmissed (\d+)", l)] if m]
            if got != [(want, 0)]:
                notes.append(f"{key}: the module's (hits, nmissed) {got}, expected [({want}, 0)]")
        if any("SETUP-FAILED" in l for l in ph["lines"]):
            notes.append(f"{key}: setup failed")
        num = {"entry": "3", "event": "3", "inside": "4", "ret": "r", "reto": "ro"}[AGAINST[key]]
        rows.append((f"({num}) {desc}", "brk", kp.med(res[KERNEL]) / n, hit,
                     hit / against if against > 0 else float("nan"), None, None))
    return rows, notes, pairs


def print_goal(pairs: dict) -> None:
    """Issue 40: ours <= GOAL x the kernel's BRK kprobe from a module, on the same function."""
    for key, what in (("k-entry-mod", "at the entry"), ("k-in-mod", f"at +{INSIDE:#x}")):
        if key in pairs:
            o, t = pairs[key]
            print(f"  goal: ours {what} {o:.1f} vs the kernel's BRK (module) {t:.1f} per hit: ours costs "
                  f"{o / t:.2f}x theirs ({'met' if o / t <= GOAL else 'NOT met'}: <= {GOAL}x)")


def markdown_table(rows, notes: list[str], head: str) -> str:
    """kernel_probes' layout (the guard reads ours' bold per-hit cells), with ours ÷ theirs."""
    out = [head, "",
           "| configuration | probe | instructions per call | per hit | × ours | ours ÷ it |",
           "|---|---|---|---|---|---|"]
    for what, kind, per_call, hit, ratio, *_ in rows:
        if hit is None:
            out.append(f"| {what} | {kind} | {per_call:,.1f} | | | |")
        elif kp.is_ours(what):
            out.append(f"| **{what}** | {kind} | {per_call:,.1f} | **{hit:,.1f}** | 1 | |")
        else:
            less = ratio == ratio and ratio > 1
            out.append(f"| {what} | {kind} | {per_call:,.1f} | {hit:,.1f} | {ratio:.2f} | "
                       f"{1 / ratio:.2f}{'' if less else ' **MORE**'} |")
    if notes:
        out += [""] + [f"CHECK FAILED: {n}" for n in notes]
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="icount", help="comma-separated: icount, tcg (default icount)")
    ap.add_argument("-n", type=int, help="system calls per timed loop (default: icount 100000, tcg 10000)")
    ap.add_argument("--reps", type=int, help="rounds per phase (default: icount 3, tcg 60)")
    ap.add_argument("--warmup", type=int, help="untimed calls before each loop (default: icount 20000, tcg 2000)")
    ap.add_argument("--keep", metavar="DIR", help="keep the rewritten kernels, specs and consoles in DIR")
    ap.add_argument("--only", choices=("p", "r", "e"),
                    help="p: the kprobe boot only; r: the kretprobe boot only; e: the event boot only")
    ap.add_argument("--write-table", metavar="FILE", type=Path,
                    help=f"write the icount table between <!-- {TABLE_MARKER}:begin --> and <!-- {TABLE_MARKER}:end --> "
                    "in FILE (e.g. benchmarks/README.md)")
    ap.add_argument("--check", action="store_true", help="exit with status 3 when ours costs MORE than any of the "
                    "kernel's configurations, a check failed, or (icount) a row of ours grew by more than 2%% over "
                    "the committed table")
    args = ap.parse_args()
    if args.write_table and "icount" not in args.modes.split(","):
        sys.exit("kernel_arm64_probes: --write-table writes the icount figures: add icount to --modes")
    if args.write_table and f"<!-- {TABLE_MARKER}:begin -->" not in args.write_table.read_text():
        sys.exit(f"kernel_arm64_probes: {args.write_table} has no <!-- {TABLE_MARKER}:begin --> marker")
    commit = kp.measured_commit()
    t_start = time.monotonic()
    k = arm64_env.obtain_arm64_kernel()
    qemu = kp.sh([arm64_env.QEMU_SYSTEM, "--version"]).stdout.splitlines()[0]
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    machine = f"{cpu}, {os.cpu_count()} CPUs (shared), {platform.machine()}, {qemu}"
    print(f"kernel: {k.release} ({k.package} {k.version})\nmachine: {machine}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\ncommit: {commit}")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kp-arm64-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    check_twins(k.vmlinuz)
    loop_bin = work / "syscall_loop"
    kp.sh(["aarch64-linux-gnu-gcc", "-static", "-O2", "-Wall", "-o", str(loop_bin), str(kp.LOOP_SRC)])
    boots = [b for b in ("p", "r", "e") if args.only in (None, b)]
    images = {b: rewrite(k, work, b) for b in boots}
    ko = build_module(k, work)
    files = {"bench": loop_bin, **({"bench_kprobe.ko": ko} if ko else {})}
    results = []
    for mode in args.modes.split(","):
        n, reps, warmup = (a if a is not None else d for a, d in zip((args.n, args.reps, args.warmup), DEFAULTS[mode]))
        t = time.monotonic()
        calib = kp.parse(run_boot(k.vmlinuz, PHASES[:1], n, reps, warmup, mode, files,
                                  work / f"unmodified-{mode}.console.txt"))
        times = [f"unmodified kernel boot {time.monotonic() - t:.0f} s"]
        parsed, counts = {}, {}
        for b in boots:
            t = time.monotonic()
            phases = [ph for ph in {"p": PHASES, "r": KRET_PHASES, "e": EVENT_PHASES}[b]
                      if ko or not (ph[3] or "").endswith("module")]
            r = run_boot(images[b], phases, n, reps, warmup, mode, files, work / f"rewritten-{b}-{mode}.console.txt")
            parsed[b], counts[b] = kp.parse(r), ours_hits(r)
            parsed[b]["console"] = r.console
            times.append(f"{b} boot {time.monotonic() - t:.0f} s")
        rows, notes, pairs = analyse(parsed, calib, counts, n, reps, warmup)
        print(f"\n== QEMU mode: {mode} {' '.join(kp.MODES[mode])}; {', '.join(times)}; loops of N = {n} calls after "
              f"{warmup} warm-up calls, {reps} rounds per phase, -smp 1, -cpu {CPU}")
        kp.print_table(rows)
        print_goal(pairs)
        more = kp.print_verdicts(rows)
        if mode == "icount":
            if kp.committed_params(kp.README, TABLE_MARKER) == (n, warmup, reps):
                kp.guard(rows, kp.committed_hits(kp.README, TABLE_MARKER), notes)
            else:
                print(f"  guard: not compared: the committed table's loops were "
                      f"{kp.committed_params(kp.README, TABLE_MARKER)} (calls, warm-up, rounds), these ({n}, {warmup}, {reps})")
        for note in notes:
            print(f"  CHECK FAILED: {note}")
        results.append((mode, n, reps, warmup, rows, notes, more))
    if not args.keep:
        shutil.rmtree(work)
    for mode, n, reps, warmup, rows, notes, more in results:
        if args.write_table and mode == "icount":
            argv = [a for n, a in enumerate(sys.argv[1:]) if a != "--keep" and sys.argv[n:n + 1] != ["--keep"]]
            cmd = " ".join(["python3", "benchmarks/kernel_arm64_probes.py"] + argv)
            head = (f"Generated by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}; "
                    f"{machine}; guest {k.release}, QEMU TCG `-M virt -cpu {CPU} {' '.join(kp.MODES[mode])}`, "
                    f"`-smp 1`; loops of {n:,} calls after {warmup:,} warm-up calls, {reps} rounds per phase.  Per hit: "
                    "the median over rounds of the loop's time against the unprobed reference loop, less the same "
                    "difference unprobed, in guest instructions (deterministic); × ours: a configuration's cost over "
                    "ours at the same place; ours ÷ it: the inverse (**MORE**: ours costs more).")
            kp.write_table(args.write_table, TABLE_MARKER, markdown_table(rows, notes, head))
    print(f"\ntotal {time.monotonic() - t_start:.0f} s")
    if args.check and any(more or notes for *_, notes, more in results):
        print("kernel_arm64_probes: --check: " + "; ".join(
            f"{mode}: MORE in {more} rows, {len(notes)} failed checks" for mode, *_, notes, more in results),
            file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()

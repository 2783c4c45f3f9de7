"""Every instruction of eight functions probed, under qemu-aarch64
(KPREWRITE_TEST_ARCH=aarch64): a C program whose functions stress the arm64 back
end -- a switch through a jump table (adrp/add, ldrb, adr, br), adr and ldr/ldrsw
literal with cbz/tbz/b.cond loops, bl and a tail b, exclusive load/store loops
(__atomic builtins, -march=armv8-a without LSE or outline atomics), a leaf with
stack use, a recursive function, a loop over an array and floating point --
compiled -O2 and -O0.  One [[kprobe]] per instruction offset (from the symbol
table), rewritten twice: as planned (jump-optimized where allowed) and with
--no-optimize (every probe a brk: the oracle).  Both must print and return what
the original does, and every probe's hit count (KPREWRITE_PROFILE) must equal
the other's and the number of times QEMU executed that instruction in the
original program (qemu-aarch64 -singlestep -d exec,nochain: one log line per
instruction executed in the functions' range).  The only probes `check` refuses
are the kernel's refusals: can_probe in the ldxr ... stxr sequences."""
from __future__ import annotations

import collections
import json
import re
import subprocess

import pytest

from conftest import cc, function, instrument, insns, kprewrite, profile, qemu_command, run, write_spec

ARCHES = ["aarch64"]

FUNCS = ("classify", "pcrel", "calls", "atomics", "stackleaf", "fib", "sum_array", "poly")

PROGRAM = r"""
#include <stdio.h>
#include <string.h>
__asm__(".section .rodata\n.p2align 3\nlitq: .quad 1000\nlitw: .word -7\n.text\n");
static const int table[8] = {3, 1, 4, 1, 5, 9, 2, 6};
long counter;
volatile long sink;

/* a switch dense enough for a jump table: adrp/add, ldrb, adr, add, br */
__attribute__((noipa)) long classify(int k) {
    switch (k) {
    case 0: return 11;
    case 1: return sink * 7 + 3;
    case 2: return sink + 5;
    case 3: return 40;
    case 4: return sink << 4;
    case 5: return 99;
    case 6: return sink - 1;
    case 7: return 123;
    case 8: return sink ^ 77;
    case 9: return 17;
    case 10: return sink | 256;
    default: return -1;
    }
}

/* adr, ldr/ldrsw literal, adrp; cbz, tbz/tbnz, b.cond loops */
__attribute__((noipa)) long pcrel(unsigned long x) {
    long a, b, c;
    __asm__("adr %0, litq\n\tldr %1, litq\n\tldrsw %2, litw" : "=r"(a), "=r"(b), "=r"(c));
    long s = *(long *)a + b + c + table[x & 7];
    while (x) {
        if (x & 4) s += 3;
        if (x & 1) s ^= 0x55;
        if (x & (1UL << 5)) s -= 9;
        x >>= 1;
        if (s > 5000) break;
    }
    return s;
}

__attribute__((noipa)) long leaf2(long x) { return x * 3 + 1; }
/* bl, then a tail call */
__attribute__((noipa)) long calls(long x) {
    long y = leaf2(x) + leaf2(x + 1);
    if (y & 1) y++;
    return leaf2(y);
}

/* exclusive load/store: ldaxr/stlxr loops (-march=armv8-a, no LSE, no outline atomics) */
__attribute__((noipa)) long atomics(long v) {
    long old = __atomic_fetch_add(&counter, v, __ATOMIC_SEQ_CST);
    long expect = old + v;
    __atomic_compare_exchange_n(&counter, &expect, expect * 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return old;
}

/* a leaf with stack use */
__attribute__((noipa)) long stackleaf(int n) {
    volatile char buf[64];
    for (int i = 0; i < 64; i++) buf[i] = (char)(i * n);
    long s = 0;
    for (int i = 0; i < 64; i += 3) s += buf[i];
    return s;
}

__attribute__((noipa)) long fib(int n) { return n < 2 ? n : fib(n - 1) + fib(n - 2); }

__attribute__((noipa)) long sum_array(const int *a, int n) {
    long s = 0;
    for (int i = 0; i < n; i++) s += a[i] * (i + 1);
    return s;
}

__attribute__((noipa)) double poly(double x, int n) {
    double r = 0.0;
    for (int i = 0; i < n; i++) r = r * x + 1.5 / (i + 1);
    return r > 100.0 ? 100.0 : r * 0.25;
}

int main(void) {
    int arr[37];
    for (int i = 0; i < 37; i++) arr[i] = i * i - 20;
    long t = 0;
    for (int i = -1; i < 13; i++) { sink = i; t += classify(i); }
    printf("classify %ld\n", t);
    for (unsigned long i = 0; i < 12; i++) printf("pcrel(%lu) = %ld\n", i, pcrel(i * 37));
    for (long i = 0; i < 5; i++) t += calls(i);
    printf("calls %ld\n", t);
    for (long i = 1; i < 6; i++) t += atomics(i);
    printf("atomics %ld %ld\n", t, counter);
    printf("stackleaf %ld %ld\n", stackleaf(3), stackleaf(7));
    printf("fib %ld\n", fib(12));
    printf("sum_array %ld %ld\n", sum_array(arr, 37), sum_array(arr, 0));
    printf("poly %.6f %.6f %.6f\n", poly(0.5, 10), poly(3.0, 8), poly(-1.25, 0));
    return (int)(t & 63);
}
"""

# Each hit also checks what a handler sees: pc at the probed address (as the arm64
# kernel's handlers do), whether the probe traps or detours.
HANDLERS = r"""
#include <linux/kprobes.h>
int pre(struct kprobe *p, struct pt_regs *regs)
{
    if (regs->pc != (unsigned long)p->addr)
        pr_err("BAD pre pc %s+%u\n", p->symbol_name, p->offset);
    return 0;
}
void post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
    if (regs->pc == (unsigned long)p->addr)     /* pc is where execution resumes */
        pr_err("BAD post pc %s+%u\n", p->symbol_name, p->offset);
    if (p->offset == 0)                         /* the entries: counted against the profile */
        pr_info("post %s+0\n", p->symbol_name);
}
"""

# -no-pie: the functions sit at their link-time addresses, which QEMU's -dfilter names.
FLAGS = ("-march=armv8-a", "-mno-outline-atomics", "-no-pie")
# The variants: -O2, -O0, and -O2 with the large code model's literal pools, where gcc
# itself loads every global's address with an ldr literal (from the pool after each function).
LEVELS = {"O2": ("-O2",), "O0": ("-O0",), "O2-large": ("-O2", "-mcmodel=large", "-fno-PIC", "-mpc-relative-literal-loads")}
# The default run builds -O2 only (about 30 s under qemu); the others are marked slow.
SLOW = {"O0", "O2-large"}


def _levels(*modes):
    return [pytest.param(level, *modes, marks=[pytest.mark.slow] if level in SLOW else []) for level in LEVELS]


def executed(prog, lo: int, hi: int, rc: int) -> collections.Counter:
    """address -> times QEMU executed the instruction there (lo <= address < hi), in
    the original program: one translation block per instruction (-singlestep), each
    execution logged (-d exec, nochain: no block jumps straight into the next)."""
    log = prog.with_name(prog.name + ".exec.log")
    r = subprocess.run([*qemu_command(), "-singlestep", "-d", "exec,nochain", "-dfilter", f"{lo:#x}..{hi - 1:#x}",
                        "-D", str(log), str(prog)], capture_output=True, text=True, timeout=120)
    assert r.returncode == rc, r.stdout + r.stderr
    counts = collections.Counter()
    for m in re.finditer(r"^Trace \d+: 0x[0-9a-f]+ \[[0-9a-f]+/([0-9a-f]+)/", log.read_text(), re.M):
        pc = int(m.group(1), 16)
        if lo <= pc < hi:
            counts[pc] += 1
    return counts


@pytest.fixture(scope="module")
def built(request, tmp_path_factory):
    """The program built with LEVELS[level], its output, QEMU's count of each instruction of
    FUNCS, `check --format json` of a probe on every instruction, and the spec
    of the probes check accepts."""
    level = request.param
    tmp = tmp_path_factory.mktemp(f"every-insn-{level}")
    prog = cc(tmp, f"prog{level}", PROGRAM, *LEVELS[level], *FLAGS)
    want = run(prog, runner="qemu")
    assert "poly " in want.stdout, want.stdout + want.stderr
    sites = []                                  # (function, offset, address)
    for f in FUNCS:
        start, end = function(prog, f)
        sites += [(f, off, start + off) for off in range(0, end - start, 4)]
    lo, hi = min(a for *_, a in sites), max(a for *_, a in sites) + 4
    counts = executed(prog, lo, hi, want.returncode)
    table = lambda s: f'[[kprobe]]\nsymbol_name = "{s[0]}"\noffset = {s[1]}\npre_handler = "pre"\n'
    full = write_spec(tmp, 'handlers = ["handlers.c"]\n' + "".join(map(table, sites)), HANDLERS, name="all.toml")
    r = kprewrite("check", prog, "--spec", full, "--format", "json", check=False)
    doc = json.loads(r.stdout)
    refused = {p["address"] for p in doc["probes"] if p["decision"] == "refused"}
    # Explicit probes the kernel refuses are errors (register_kprobe() fails): exit 1, one line each.
    assert (r.returncode != 0) == bool(refused) and len(doc["errors"]) == len(refused), r.stderr
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n' + "".join(table(s) for s in sites if f"{s[2]:#x}" not in refused),
                      name="ok.toml")
    post = write_spec(tmp, spec.read_text().replace('pre_handler = "pre"\n', 'pre_handler = "pre"\npost_handler = "post"\n'),
                      name="post.toml")
    return level, tmp, prog, want, sites, counts, doc, {"optimized": spec, "brk": spec, "post": post}


def exclusive_ranges(prog) -> list[tuple[int, int]]:
    """[ldxr address, stxr address] of each exclusive sequence in `atomics`, read
    with Capstone (not the rewriter's decoder)."""
    out, start = [], None
    for off, i in insns(prog, "atomics"):
        if re.fullmatch(r"ld[a]?xr[bh]?|ld[a]?xp", i.mnemonic):
            start = i.address
        elif re.fullmatch(r"st[l]?xr[bh]?|st[l]?xp", i.mnemonic) and start is not None:
            out.append((start, i.address))
            start = None
    return out


def _branch(i) -> bool:
    return i.mnemonic in ("b", "bl", "br", "blr", "ret", "cbz", "cbnz", "tbz", "tbnz") or i.mnemonic.startswith("b.")


@pytest.mark.parametrize("built", _levels(), indirect=True)
def test_check_decisions(built):
    """Every probe is jump-optimized (one instruction under each B) except those the
    kernel refuses: every instruction from an ldxr to its stxr, with can_probe and
    the address.  The counts go to the test's output (-rP shows them)."""
    level, tmp, prog, want, sites, counts, doc, specs = built
    probes = doc["probes"]
    assert len(probes) == len(sites)
    tally = collections.Counter(p["decision"] for p in probes)
    print(f"{' '.join(LEVELS[level])}: {len(probes)} probes: {tally['optimized']} optimized, {tally['int3']} brk, "
          f"{tally['refused']} refused")
    if level == "O2-large":     # gcc's own ldr literal loads from the pool, probed like the rest
        assert sum(1 for _, i in insns(prog, "classify") if i.mnemonic == "ldr" and "[" not in i.op_str) >= 2
    ranges = exclusive_ranges(prog)
    assert len(ranges) >= 2, ranges              # fetch_add and compare_exchange
    in_seq = {f"{a:#x}" for lo, hi in ranges for a in range(lo, hi + 4, 4)}
    refused = {p["address"]: p["reason"] for p in probes if p["decision"] == "refused"}
    assert set(refused) == in_seq, (sorted(refused), sorted(in_seq))
    for addr, reason in refused.items():
        assert reason["check"] == "can_probe" and reason["address"] == addr, reason
        assert reason["message"].startswith(f"can_probe at {addr}: ") and "exclusive" in reason["message"], reason
    # The rest: no instruction here stops a jump (no other probe lies under a one-instruction region).
    assert tally["optimized"] == len(probes) - len(refused) and not tally["int3"], tally
    # The oracle's plan: the same refusals, every other probe a brk, simulated (emulate:
    # the PC-relative and branch classes of simulate-insn.c) or stepped out of line.
    oracle = json.loads(kprewrite("check", prog, "--spec", specs["brk"], "--no-optimize", "--format", "json").stdout)["probes"]
    assert {p["decision"] for p in oracle} == {"int3"} and len(oracle) == len(probes) - len(refused)
    how = collections.Counter(p["int3"] for p in oracle)
    print(f"  --no-optimize: {len(oracle)} brk ({', '.join(f'{n} {k}' for k, n in sorted(how.items()))})")
    kinds = {p["address"]: p["int3"] for p in oracle}
    for f in FUNCS:
        for off, i in insns(prog, f):
            literal = i.mnemonic in ("ldr", "ldrsw") and "[" not in i.op_str and i.op_str[0] in "xw"
            if f"{i.address:#x}" not in refused and (literal or _branch(i) or i.mnemonic in ("adr", "adrp")):
                assert kinds[f"{i.address:#x}"] == "emulate", (f, off, i.mnemonic, kinds[f"{i.address:#x}"])
    # With post_handlers, the branches stay breakpoints (no post_handler after a branch in a
    # detour, as the kernel's optprobes); the rest are optimized.
    mixed = json.loads(kprewrite("check", prog, "--spec", specs["post"], "--format", "json").stdout)["probes"]
    tally = collections.Counter(p["decision"] for p in mixed)
    print(f"  with post_handlers: {tally['optimized']} optimized, {tally['int3']} brk")
    branches = {f"{i.address:#x}" for f in FUNCS for _, i in insns(prog, f) if _branch(i)} - set(refused)
    assert {p["address"] for p in mixed if p["decision"] == "int3"} == branches
    assert all(p["reason"]["check"] == "post_handler" for p in mixed if p["decision"] == "int3")


# post_handlers at -O2 only (the suite's time): they change which probes trap, not what a detour relocates.
@pytest.mark.parametrize("built, mode", [p for mode in ("optimized", "brk") for p in _levels(mode)] + [("O2", "post")],
                         indirect=["built"])
def test_every_instruction_counted(built, mode):
    """The rewritten program prints and returns what the original does; every probe's
    hits are the times QEMU executed its instruction in the original.  post: with
    post_handlers too (the branches breakpoints, the rest detours)."""
    level, tmp, prog, want, sites, counts, doc, specs = built
    extra = ("--no-optimize",) if mode == "brk" else ()
    out = instrument(prog, specs[mode], tmp / f"prog{level}-{mode}", *extra)
    if mode == "brk":
        flags = {p["name"]: p["flags"] for p in json.loads(kprewrite("list", out, "--format", "json").stdout)["probes"]}
        assert not any("OPTIMIZED" in f for f in flags.values()), flags
    r = run(out, runner="qemu", env={"KPREWRITE_PROFILE": "-"}, timeout=60)
    assert (r.returncode, r.stdout) == (want.returncode, want.stdout), r.stdout + r.stderr
    assert "BAD" not in r.stderr, r.stderr
    prof = profile(r.stderr)
    refused = {p["address"] for p in doc["probes"] if p["decision"] == "refused"}
    got, expect = {}, {}
    for f, off, addr in sites:
        if f"{addr:#x}" in refused:
            continue
        name = f"p_{f}_{off}"
        got[name] = prof[name][0]
        expect[name] = counts[addr]
    wrong = {n: (got[n], expect[n]) for n in got if got[n] != expect[n]}
    assert not wrong, wrong
    assert not any(m for _, m in prof.values()), "nmissed"
    hit = sum(1 for v in got.values() if v)
    assert hit >= 0.8 * len(got), (hit, len(got))
    # The counts are the program's: main calls classify 14 times, pcrel 12, calls and
    # atomics 5, poly 3; fib(12) makes 465 calls at -O0 (-O2 turns one of the two into a loop).
    assert (got["p_classify_0"], got["p_pcrel_0"], got["p_calls_0"], got["p_atomics_0"], got["p_poly_0"]) == (14, 12, 5, 5, 3)
    assert got["p_fib_0"] == 465 if level == "O0" else 233 <= got["p_fib_0"] <= 465
    posts = collections.Counter(l.split()[1] for l in r.stderr.splitlines() if l.startswith("post "))
    assert posts == (collections.Counter({f"{f}+0": got[f"p_{f}_0"] for f in FUNCS}) if mode == "post" else {}), posts

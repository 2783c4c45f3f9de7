"""Unit tests of the stages on synthetic code: resolve, analysis, the planner's safety
rules, numbering and return sites, the emitters, the blacklist index and a target's
reserved ranges.  Each case is a few instructions assembled into a real (tiny, static)
ELF by the system assembler and linker, loaded with the real Image; the stages run in
this process, so every rule is checked in milliseconds, beside the end-to-end tests."""
from __future__ import annotations

import random
import subprocess
from pathlib import Path

import capstone
import pytest

from rewriter.analysis import blacklist as bl
from rewriter.analysis.functions import Analysis
from rewriter.arch import get_arch
from rewriter.errors import KprewriteError
from rewriter.elf.image import Image
from rewriter.planner import FTRACE, BREAKPOINT, OPTIMIZED, REFUSED, plan
from rewriter.probes.resolve import is_entry, resolve
from rewriter.analysis.rules import Rules
from rewriter.probes.spec import KprobeSpec, KretprobeSpec, Spec

ARCHES = ["x86_64"]      # x86-64 only: x86-64 assembly (the stages on synthetic x86 code)

ARCH = get_arch("x86_64")


def assemble(tmp: Path, body: str) -> Image:
    """`body` (Intel syntax, functions declared with FUNC name / END name) as a static ELF."""
    lines = [".intel_syntax noprefix", ".text", ".globl _start", "_start: ud2"]
    for line in body.strip().splitlines():
        w = line.split()
        if w and w[0] == "FUNC":
            lines += [".p2align 4", f".globl {w[1]}", f".type {w[1]}, @function", f"{w[1]}:"]
        elif w and w[0] == "END":
            lines.append(f".size {w[1]}, .-{w[1]}")
        else:
            lines.append(line)
    src = tmp / "code.s"
    src.write_text("\n".join(lines) + "\n")
    out = tmp / "code"
    r = subprocess.run(["gcc", "-nostdlib", "-static", "-no-pie", "-o", str(out), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return Image(str(out))


def kprobe(sym: str, offset: int = 0, **kw) -> KprobeSpec:
    return KprobeSpec(f"[[kprobe]] {sym}+{offset}", sym, None, offset, **kw)


def planned(image: Image, kprobes=(), kretprobes=(), optimize=True, rules=None):
    spec = Spec(Path("/nonexistent/p.toml"), [], optimize, list(kprobes), list(kretprobes))
    probes, errors = resolve(image, spec, ARCH)
    assert not errors, errors
    an = Analysis(image, ARCH)
    return plan(image, an, ARCH, probes, rules or Rules(bl.Index(bl.compute(image))), optimize, "p.toml")


def site_of(p, addr):
    return next(s for s in p.sites if s.addr == addr)


def sym(image: Image, name: str) -> int:
    return image.symbols[name][0]


def test_region_is_whole_instructions(tmp_path):
    image = assemble(tmp_path, """
FUNC f
    push rbx
    mov rbx, rdi
    lea rax, [rdi + 1]
    pop rbx
    ret
END f
""")
    p = planned(image, [kprobe("f")])
    s = site_of(p, sym(image, "f"))
    assert s.decision == OPTIMIZED
    # push rbx (1) + mov rbx, rdi (3) + lea (4): the first whole instructions covering 5 bytes.
    assert [i.addr - s.addr for i in s.dcr] == [0, 1, 4] and s.region_end - s.addr == 8


def test_jump_into_region_keeps_an_int3(tmp_path):
    image = assemble(tmp_path, """
FUNC f
    test edi, edi
    jz 1f
1:  mov eax, 1
    ret
END f
""")
    f = sym(image, "f")
    p = planned(image, [kprobe("f")])
    s = site_of(p, f)
    assert s.decision == BREAKPOINT and s.reason.check == "jump_into_region"
    assert s.reason.addr == f + 2          # the jz is the offender
    assert s.xol.mode in ("boost", "emulate", "single-step")


@pytest.mark.parametrize("insn, check", [("jmp rax", "indirect_jump"), ("std", "direction_flag")])
def test_function_wide_refusals(tmp_path, insn, check):
    image = assemble(tmp_path, f"""
FUNC f
    mov rax, rdi
    add rax, 8
    {insn}
    ret
END f
""")
    f = sym(image, "f")
    s = site_of(planned(image, [kprobe("f")]), f)
    assert s.decision == BREAKPOINT and s.reason.check == check and s.reason.addr == f + 7


def test_short_function_and_no_optimize(tmp_path):
    image = assemble(tmp_path, """
FUNC tiny
    ret
END tiny
FUNC g
    mov rax, rdi
    add rax, 8
    ret
END g
.globl h
.type h, @function
h:
    ret
.size h, .-h
.globl h2
.type h2, @function
h2:
    mov rax, 1
    ret
.size h2, .-h2
""")
    p = planned(image, [kprobe("tiny"), kprobe("g"), kprobe("h")])
    # tiny borrows the nop padding before g; h is followed by h2 at once.
    tiny = site_of(p, sym(image, "tiny"))
    assert tiny.decision == OPTIMIZED and tiny.dcr[-1].addr >= sym(image, "tiny") + 1
    assert site_of(p, sym(image, "h")).reason.check == "func_size"
    assert site_of(p, sym(image, "g")).decision == OPTIMIZED
    p = planned(image, [kprobe("g")], optimize=False)
    s = site_of(p, sym(image, "g"))
    assert s.decision == BREAKPOINT and "kprobes_optimization" in str(s.reason)


def test_registration_refusals_are_errors_for_explicit_probes(tmp_path):
    image = assemble(tmp_path, """
FUNC f
    mov rax, rdi
    add rax, 8
    ret
END f
""")
    p = planned(image, [kprobe("f", 1), kprobe("f", 0x40)])
    assert not p.sites and len(p.errors) == 2
    assert "is not an instruction boundary of f" in p.errors[0]
    assert "no function symbol or FDE covers" in p.errors[1]
    assert [r[1] for r in p.rejected] == [REFUSED, REFUSED]


def test_aggregation_numbering_and_probe_in_region(tmp_path):
    image = assemble(tmp_path, """
FUNC f
    push rbx
    mov rbx, rdi
    lea rax, [rdi + 1]
    pop rbx
    ret
END f
""")
    f = sym(image, "f")
    p = planned(image, [kprobe("f", 1, pre_handler="a"), kprobe("f", 0, pre_handler="b"), kprobe("f", 0, post_handler="c")],
                [KretprobeSpec("[[kretprobe]] f", "f", None, 0)])
    at_f, at_f1 = site_of(p, f), site_of(p, f + 1)
    # Three kprobes and rp->kp at f aggregate; the probe at f+1 inside f's region keeps f an int3.
    assert len(at_f.probes) == 3 and at_f.decision == BREAKPOINT and at_f.reason.check == "probe_in_region"
    assert at_f1.decision == OPTIMIZED
    # f's ret has no room for a jump (f+1's region reaches it): a breakpoint return hook.
    assert [s.index for s in p.sites] == [0, 1, 2] and p.sites[2].kret_hook and not p.sites[2].probes
    # kp_probes[] in spec order, kp_kretprobes[] after them for the hit counters.
    assert [(q.spec.offset, q.slot) for _, q in p.kprobes] == [(1, 0), (0, 1), (0, 2)]
    (_, rp, g), = p.kretprobes
    assert is_entry(rp) and rp.slot == 0 and p.hit_slot(rp) == 3 and g.site is at_f


def test_kretprobe_checks_and_return_sites(tmp_path):
    image = assemble(tmp_path, """
FUNC two_rets
    mov ecx, 5
    test edi, edi
    jz 1f
    mov eax, 1
    add eax, 2
    ret
1:  mov eax, 7
    add eax, 3
    ret
END two_rets
FUNC spins
1:  jmp 1b
END spins
""")
    p = planned(image, [], [KretprobeSpec("[[kretprobe]] a", "two_rets", None, 0),
                            KretprobeSpec("[[kretprobe]] b", "two_rets", None, 4),
                            KretprobeSpec("[[kretprobe]] c", "spins", None, 0)])
    assert len(p.errors) == 2
    assert "must be on a function entry" in p.errors[0] and "never returns" in p.errors[1]
    (_, _, g), = p.kretprobes
    rets = [e.addr for e in g.exits]
    assert len(rets) == 2 and all(image.read(a, 1) == b"\xc3" for a in rets)
    # Each ret gets a return site whose region holds the ret and takes a 5-byte jump: the
    # first ends with it, the last runs on into the alignment padding after the function.
    first, last = sorted(p.ret_sites, key=lambda rs: rs.addr)
    assert (first.exit.addr, last.exit.addr) == tuple(rets)
    assert first.region_end == first.exit.addr + 1 and first.region_end - first.addr >= 5
    assert last.addr <= last.exit.addr < last.region_end and last.region_end - last.addr >= 5
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    pad = list(cs.disasm_lite(image.read(last.exit.addr + 1, 16), last.exit.addr + 1))
    assert {m for a, _, m, _ in pad if a < last.region_end} <= {"nop", "int3"}


def test_target_rules_reserved_and_ftrace(tmp_path):
    image = assemble(tmp_path, """
FUNC f
    nop DWORD PTR [rax + rax]
    push rbx
    mov rbx, rdi
    lea rax, [rdi + 1]
    pop rbx
    ret
END f
""")
    f = sym(image, "f")
    # A site patched at load (as a kernel's .smp_locks entry) inside the region refuses it, by name.
    rules = Rules(bl.Index(bl.compute(image)), bl.Index([bl.BlacklistEntry(f + 6, f + 7, "lock", ".smp_locks")]))
    s = site_of(planned(image, [kprobe("f", 5)], rules=rules), f + 5)
    assert s.decision == BREAKPOINT and s.reason.check == ".smp_locks" and s.reason.addr == f + 6
    # An ftrace site: the 5-byte nop is the probe's whole region, whatever optimize says.
    rules = Rules(bl.Index(bl.compute(image)), ftrace={f: None})
    s = site_of(planned(image, [kprobe("f")], optimize=False, rules=rules), f)
    assert s.decision == FTRACE and s.region_end == f + 5
    # A target without breakpoint probes refuses what it cannot optimize.
    rules = Rules(bl.Index(bl.compute(image)), breakpoints=False)
    p = planned(image, [kprobe("f", 5)], optimize=False, rules=rules)
    assert not p.sites and "kprobes_optimization" in p.errors[0]


def test_blacklist_index_matches_a_linear_scan():
    rnd = random.Random(7)
    entries = []
    for i in range(300):
        lo = rnd.randrange(0, 5000)
        entries.append(bl.BlacklistEntry(lo, lo + rnd.randrange(1, 400), f"s{i}", "r"))
    index = bl.Index(entries)
    ordered = sorted(entries, key=lambda e: (e.start, e.end, e.symbol))
    for _ in range(2000):
        lo = rnd.randrange(0, 5600)
        hi = lo + rnd.randrange(1, 20)
        want = next((e for e in ordered if e.start < hi and lo < e.end), None)
        assert index.overlapping(lo, hi) == want


def test_emitters(tmp_path):
    em = ARCH.emit
    # The jump over a 7-byte region: jmp rel32, then int3 over the rest.
    assert em.jump_patch(0x1000, 7, 0x2000) == b"\xe9" + (0x2000 - 0x1005).to_bytes(4, "little", signed=True) + b"\xcc\xcc"
    # A RIP-relative load moved elsewhere still reaches the same address.
    image = assemble(tmp_path, """
FUNC f
    lea rax, [rip + data]
    ret
END f
data: .quad 0
""")
    f = sym(image, "f")
    s = site_of(planned(image, [kprobe("f")]), f)
    insn = s.dcr[0]
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    cs.detail = True

    def target(code, at):
        i = next(cs.disasm(code, at))
        return i.address + i.size + i.operands[1].mem.disp

    moved = em.relocate(insn, f + 0x100000)
    assert target(moved, f + 0x100000) == target(insn.code, f)
    # The detour: stub, the DCR copy, the jump back after the region.
    code, resume, resume_post = em.detour(s.index, s.dcr, False, 0x500000, 0x600000, 0x600100)
    back = next(cs.disasm(code[-5:], 0x500000 + len(code) - 5))
    assert back.mnemonic == "jmp" and int(back.op_str, 16) == s.region_end and resume == resume_post


def test_every_target_answers_the_declared_interface():
    """targets.base.Target: every target package (each folder of rewriter/targets/) has
    every declared member after base.declare(), functions with the declared parameters,
    so a stage can call any target the same way; and declare() refuses a target that
    lacks a required member."""
    import importlib
    import inspect

    from rewriter import targets
    from rewriter.targets import base
    folders = sorted(p.name for p in Path(targets.__file__).parent.iterdir()
                     if (p / "__init__.py").is_file())
    assert folders == ["linux_kernel", "linux_module", "linux_user"]
    # An architecture's variant of the kernel target (linux_kernel.for_arch(): <arch>/target.py).
    variants = [f"linux_kernel.{p.parent.name}.target" for p in
                sorted((Path(targets.__file__).parent / "linux_kernel").glob("*/target.py"))]
    assert "linux_kernel.aarch64.target" in variants
    declared = base.members()
    assert {"write", "rules", "plan_layout", "tables_c", "notes", "runtime_variant", "DIFF_REFUSAL"} <= set(declared)
    assert "build" not in declared      # one back half for every target: its steps, asked in order
    for folder in folders + variants:
        target = importlib.import_module(f"rewriter.targets.{folder}")
        assert target.name == folder.split(".")[0]
        for n, default in declared.items():
            assert hasattr(target, n), (folder, n)
            if callable(default):
                want = list(inspect.signature(default).parameters)[1:]          # without self
                assert list(inspect.signature(getattr(target, n)).parameters) == want, (folder, n)
    # The defaults answer: a user program has no notes; a module and the arm64 kernel go through
    # the same back half's steps, answering them themselves, and are not laid out in place.
    from rewriter.targets import linux_module, linux_user
    from rewriter.targets.linux_kernel.aarch64 import target as arm64_kernel
    assert linux_user.notes(None, []) == [] and linux_user.runtime_variant(None, None) is None
    assert linux_module.DIFF_REFUSAL
    assert {"lay_out", "tables", "link", "emit", "write"} <= set(declared)
    assert linux_module.link is not declared["link"] and linux_user.link.__doc__ == declared["link"].__doc__
    for step in ("lay_out", "tables", "runtime_variant", "link", "unlinked", "emit", "write"):
        assert getattr(arm64_kernel, step).__module__.endswith("aarch64.build"), step
    assert arm64_kernel.runtime_variant(None, None) is False    # no runtime of link/runtime.py's
    with pytest.raises(KprewriteError, match="linux_module: not laid out in place"):
        linux_module.plan_layout(None)
    with pytest.raises(TypeError, match="lacks rules"):
        base.declare({"__name__": "t", "name": "t", "load_symbols": None})


def test_every_kernel_arch_answers_the_declared_interface():
    """targets.linux_kernel.archbase.KernelArch: the architecture's part of the kernel
    target (x86_64/) has every member, functions with the declared parameters."""
    import inspect

    from rewriter.targets.linux_kernel import archbase, sites, symbols
    declared = {n: v for n, v in vars(archbase.KernelArch).items() if not n.startswith("_") and callable(v)}
    assert {"breakpoint_hook", "thread_key", "write_container"} <= set(declared)
    assert "x86_64" in symbols.arch_folders()
    for machine in symbols.arch_folders():
        kern = symbols.arch_named(machine)
        for n in archbase.KernelArch.__annotations__:
            assert hasattr(kern, n), (machine, n)
        for n, f in declared.items():
            want = list(inspect.signature(f).parameters)[1:]          # without self
            assert list(inspect.signature(getattr(kern, n)).parameters) == want, (machine, n)
        assert issubclass(kern.sites.KernelImage, sites.KernelImage), machine


def test_the_kernel_targets_generic_modules_name_no_x86_fact():
    """x86-64's part of the kernel target (opcodes, %gs, relocation types, return thunks,
    the boot protocol) lives in targets/linux_kernel/x86_64/, not in the generic modules."""
    import re
    from pathlib import Path

    import rewriter.targets.linux_kernel as lk
    x86 = re.compile(r"%%?gs:|pushfq|R_X86_64|\\x(e8|e9|cc|eb)|__x86_|this_cpu_off|CS_ARCH_X86|bzimage|kaslr")
    for f in sorted(Path(lk.__file__).parent.glob("*.py")):
        hits = [ln for ln in f.read_text().splitlines() if x86.search(ln)]
        assert not hits, (f.name, hits)

def test_cache_keeps_the_most_recently_used_entries(tmp_path, monkeypatch):
    """The cache evicts: each kind keeps its KEEP most recently used entries (a read
    counts as a use), so rewriting after every runtime edit does not grow it without end."""
    import os
    import time
    from rewriter import cache
    monkeypatch.setenv("KPREWRITE_CACHE", str(tmp_path))
    t0 = time.time() - 1000
    for i in range(cache.KEEP):
        cache.put("analysis", f"k{i}", b"x%d" % i)
        os.utime(tmp_path / "analysis" / f"k{i}", (t0 + i, t0 + i))
    assert cache.get("analysis", "k0") == b"x0"         # the oldest, read: now the newest
    cache.put("analysis", "new", b"y")                  # one over KEEP: the least recently used goes
    left = sorted(p.name for p in (tmp_path / "analysis").iterdir())
    assert len(left) == cache.KEEP and "k1" not in left and {"k0", "new", "k2"} <= set(left)


def test_short_clean_entry_keeps_no_flags_where_they_are_dead():
    """A kernel's clean detour calls the entry that keeps no flags where the arithmetic
    flags are dead at the site (Site.flags_live, forms.py), the full one elsewhere."""
    from rewriter.emit.emission import detour_entries
    from rewriter.planner.model import Site
    s = Site(0x1000, [])
    s.clean, s.flags_live = True, False
    assert detour_entries(s, short=True) == ("kp_optprobe_short_clean_nf_entry", "kp_optprobe_short_clean_post_entry")
    assert detour_entries(s) == ("kp_optprobe_clean_entry", "kp_optprobe_clean_post_entry")   # no short stubs
    s.flags_live = True
    assert detour_entries(s, short=True)[0] == "kp_optprobe_short_clean_entry"
    s.clean = False
    assert detour_entries(s, short=True)[0] == "kp_optprobe_short_entry"

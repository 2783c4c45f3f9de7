"""The "how" stages from a plan made by hand, without the planner: layout
places what a plan asks for (its own Layout, the plan untouched), emission
writes exactly that, the tables name it.  The plan is plain data
(planner/model.py), so a plan built here from a real gcc-compiled program's
instructions drives the stages as the planner's would (E9Patch's split: what
to patch, then how)."""
from __future__ import annotations

import capstone
import pytest

from conftest import cc
from rewriter.emit import emission, layout, tables
from rewriter import targets
from rewriter.analysis.functions import Analysis
from rewriter.arch import get_arch
from rewriter.elf.image import Image
from rewriter.planner import BREAKPOINT, NO_HANDLER, OPTIMIZED, Plan, Site, choose_forms, make_breakpoint
from rewriter.probes.resolve import Probe
from rewriter.probes.spec import KprobeSpec

SRC = r"""
#include <stdio.h>
__attribute__((noinline)) long f(long x) { return x * 3 + 1; }
__attribute__((noinline)) long g(long x) { if (x > 5) return f(x) - 2; return x; }
int main(int argc, char **argv) { printf("%ld\n", g(argc + 10)); return 0; }
"""


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    return cc(tmp_path_factory.mktemp("stages"), "prog", SRC, "-O2", "-fcf-protection=none")


def _probe(image, name: str, index: int, addr: int | None = None) -> Probe:
    f = next(f for f in image.functions if f.name == name)
    addr = f.start if addr is None else addr
    spec = KprobeSpec(table="[[kprobe]]", symbol_name=name, addr=None, offset=addr - f.start)
    return Probe(spec, index, addr, f, name, addr - f.start, False)


def _plan(image, arch, analysis) -> Plan:
    """f's entry jump-optimized, g's entry a breakpoint probe: as the planner
    numbers them (sites by address, kp_probes[] in spec order)."""
    pf, pg = _probe(image, "f", 0), _probe(image, "g", 1)
    sf = Site(pf.addr, [pf])
    sf.dcr = arch.optprobe.can_optimize(image, analysis, pf.func, pf.addr)
    assert isinstance(sf.dcr, list), sf.dcr
    sf.decision = OPTIMIZED
    sg = make_breakpoint(image, arch, Site(pg.addr, [pg]))
    plan = Plan(sites=sorted([sf, sg], key=lambda s: s.addr))
    for i, s in enumerate(plan.sites):
        s.index = i
    plan.kprobes = [(sf, pf), (sg, pg)]
    pf.slot, pg.slot = 0, 1
    return plan


@pytest.fixture(scope="module")
def staged(prog):
    image = Image(str(prog))
    arch = get_arch(image.machine)
    target = targets.for_image(image)
    rules = target.rules(image, arch)
    analysis = Analysis(image, arch, extra_sources=rules.jump_target_sources,
                        read_indirect_jumps=rules.read_indirect_jumps)
    plan = _plan(image, arch, analysis)
    choose_forms(plan, image, arch, {}, {}, rules)
    c = emission.Code(image, arch, plan, {}, set(), target.thread_key(image))
    before = _snapshot(plan)
    lay = layout.place(c, target)
    assert _snapshot(plan) == before, "layout wrote into the plan"
    sym = emission.Far(lay.text_addr)          # the runtime's symbols, placed past the new code
    rx, patches = emission.emit(c, lay, sym)
    tables.generate(c, lay, target, {})
    assert _snapshot(plan) == before, "emission or the tables wrote into the plan"
    return image, arch, target, plan, c, lay, rx, dict(patches)


def _snapshot(plan) -> str:
    """Everything the plan holds, as text (dataclass reprs recurse into sites, regions,
    breakpoint descriptors): equal before and after a stage that leaves it alone."""
    return repr(plan)


def _disasm(code: bytes, at: int):
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    return list(md.disasm(code, at))


def test_layout_places_each_piece_apart_and_aligned(staged):
    """Every detour and slot the plan needs gets its own bytes below the runtime,
    16-byte aligned (64 for a light hit: its hot part takes one cache line)."""
    image, arch, target, plan, c, lay, rx, patches = staged
    pieces = sorted((lay.detour(s), lay.sizes[("site" if s.decision != BREAKPOINT else "xol", s.index)], s)
                    for s in plan.sites if s.decision != BREAKPOINT or s.xol.mode != "emulate")
    assert pieces, "nothing laid out"
    for (a, n, s), nxt in zip(pieces, pieces[1:] + [None]):
        assert a % (64 if s.light else 16) == 0 or s.decision == BREAKPOINT
        assert lay.rx_vaddr <= a and a + n <= lay.text_addr
        if nxt is not None:
            assert a + n <= nxt[0], "pieces overlap"
    assert lay.text_addr % 64 == 0


def test_emission_patches_what_the_plan_says(staged):
    """The optimized site's bytes become a jump to its detour, the breakpoint
    site's first byte the arch's breakpoint; nothing else of the image changes."""
    image, arch, target, plan, c, lay, rx, patches = staged
    sf = next(s for s in plan.sites if s.decision == OPTIMIZED)
    sg = next(s for s in plan.sites if s.decision == BREAKPOINT)
    assert set(patches) == {sf.addr, sg.addr}
    jmp = _disasm(patches[sf.addr], sf.addr)[0]
    assert jmp.mnemonic == "jmp" and int(jmp.op_str, 16) == lay.detour(sf)
    assert len(patches[sf.addr]) == sf.region_end - sf.addr      # the region's rest filled
    assert patches[sg.addr] == arch.breakpoint


def test_the_detour_copies_the_region_and_jumps_back(staged):
    """The detour ends with the jump back to the region's end (the kernel's
    optprobe template: saved state, handler call, the DCR copy, jmp back)."""
    image, arch, target, plan, c, lay, rx, patches = staged
    sf = next(s for s in plan.sites if s.decision == OPTIMIZED)
    n = lay.sizes[("site", sf.index)]
    detour = lay.detour(sf)
    code = bytes(rx[detour - lay.rx_vaddr:detour - lay.rx_vaddr + n])
    insns = _disasm(code, detour)
    assert sum(i.size for i in insns) == n, "the detour does not decode to its end"
    backs = [i for i in insns if i.mnemonic == "jmp" and i.op_str.startswith("0x")
             and int(i.op_str, 16) == sf.region_end]
    assert backs, "no jump back to the region's end"
    copied = [i.bytes for i in insns]
    for insn in sf.dcr:                       # position-independent copies are verbatim
        if not _disasm(insn.code, insn.addr)[0].op_str.count("rip"):
            assert bytes(insn.code) in copied


def test_tables_name_every_probe_of_the_plan(staged):
    """tables.generate() reads the plan and its layout: one struct kprobe per planned
    kprobe, the breakpoint site's descriptor, no kretprobe."""
    image, arch, target, plan, c, lay, rx, patches = staged
    table = tables.generate(c, lay, target, {})
    assert "#define KP_NHITS 2" in table.c and "const unsigned int kp_nprobes = 2;" in table.c
    data = table.asm
    assert "kp_probes:" in data and f".size kp_probes, {2 * 72}" in data
    for s in plan.sites:                       # each probe at its planned address (.addr, then .symbol_name)
        assert f"\t.quad {s.addr},.Lkp_str" in data, s.addr
    assert '.string "f"' in data and '.string "g"' in data


def test_forms_without_handlers_are_light(staged):
    """choose_forms() on a plan with no handler anywhere: the optimized site only counts
    (Rules.light_hits of a user target), at a function entry the red zone is free."""
    image, arch, target, plan, c, lay, rx, patches = staged
    sf = next(s for s in plan.sites if s.decision == OPTIMIZED)
    assert sf.template and sf.clean and sf.light and sf.red_zone
    assert NO_HANDLER.reads_regs is False

"""Stage 3: analyse functions.

Decodes every function of the image once (the arch decoder) and gathers the
known jump targets from pluggable sources: the kernel checks that no jump lands
in a probe's jump target prohibition region (JTPR) and that no exception-table
fixup does; in user space the equivalents are direct branches anywhere in the
image (a function's .cold part jumps back into it), C++ landing pads (LSDA),
code addresses taken by relocations, and code symbols.  A kernel image adds
__ex_table, alternatives, jump labels, static calls and ftrace sites as more
sources.
"""
from __future__ import annotations

import bisect
from typing import Callable, Iterable

from array import array

from . import cache, ehframe, safety
from .image import Function, Image

# A source yields (target address, what makes it a target).
TargetSource = Callable[[Image, "Analysis"], Iterable[tuple[int, str]]]


# Decoding every function of a large image (a kernel: 46,000 functions, 6.8 million
# instructions) costs half a minute in Capstone; the targets are cached by the image's
# bytes and function bounds, so a second `check` of the same image skips it.
BIG_IMAGE = 1 << 24


# Longer than any instruction (x86-64's longest is 15 bytes): decoding a function's
# first bytes up to addr + PREFIX finds every instruction that starts before addr + 1.
PREFIX = 16


def branch_targets(image: Image, an: "Analysis"):
    for target, src in _branch_pairs(image, an):
        yield target, f"jump from {src:#x}"


def _branch_pairs(image: Image, an: "Analysis"):
    """(target, address of the branch) of every direct branch (branch_targets(),
    as numbers: Analysis reads them so, not through the strings)."""
    k = None
    if len(image.data) >= BIG_IMAGE:
        bounds = array("Q", [x for f in image.functions for x in (f.start, f.end)]).tobytes()
        k = cache.key(b"branch_targets", an.arch.name.encode(), image.data, bounds)
        got = cache.get("analysis", k)
        if got is not None:
            pairs = array("Q")
            pairs.frombytes(got)
            it = iter(pairs)
            yield from zip(it, it)
            return
    pairs = array("Q")
    for f in image.functions:
        for target, src in an.decoded(f).branches:
            pairs.extend((target & 0xFFFFFFFFFFFFFFFF, src))
            yield target, src
    if k is not None:
        cache.put("analysis", k, pairs.tobytes())


def landing_pad_targets(image: Image, an: "Analysis"):
    if not safety.enabled("lsda_landing_pads"):
        return
    for fde_start, pads in ehframe.landing_pads(image.data, image.fdes, image.path).items():
        for pad in pads:
            yield pad, f"C++ landing pad of the function at {fde_start:#x}"


def relocation_targets(image: Image, an: "Analysis"):
    for _, r_offset, addend in image.relative_relocations():
        if image.is_code(addend):
            yield addend, f"code address taken by the relocation at {r_offset:#x}"


def symbol_targets(image: Image, an: "Analysis"):
    for addr in image.code_symbols:
        yield addr, f"code symbol at {addr:#x}"


def code_ref_targets(image: Image, an: "Analysis"):
    """Code addresses the code computes (x86: a RIP-relative lea): a register may
    hold one and jump to it."""
    if not an.read_indirect_jumps:
        return
    for f in image.functions:
        for target, src in an.decoded(f).code_refs or ():
            if image.is_code(target):
                yield target, f"code address computed at {src:#x}"


def fixed_pointer_targets(image: Image, an: "Analysis"):
    """In an image linked at a fixed address (no relocations name its stored code
    addresses): every constant in its bytes that may be one (the arch's
    fixed_code_pointers())."""
    if not an.read_indirect_jumps:
        return
    scan = getattr(getattr(an.arch, "jumptable", None), "fixed_code_pointers", None)
    if scan is not None:
        yield from scan(image, an)


def indirect_jump_targets(image: Image, an: "Analysis"):
    """The entries of the jump tables the arch reads (last: its slices stop at the
    targets the other sources found).  Where the target says not to (a kernel),
    the kernel's rule stays: any indirect jump refuses its function."""
    if not an.read_indirect_jumps:
        return
    resolve = getattr(an.arch, "jumptable", None)
    if resolve is None:
        return
    for f in image.functions:
        if not an.decoded(f).indirect_jumps:
            continue
        jumps = resolve.resolve(image, an, f)
        an.indirect[f.start] = jumps
        for j in jumps:
            for t in j.targets:
                yield t, (f"jump table entry of the jump at {j.addr:#x}" if j.kind == "jump table"
                          else f"target of the indirect jump at {j.addr:#x}")


DEFAULT_SOURCES: list[TargetSource] = [branch_targets, landing_pad_targets, relocation_targets, symbol_targets,
                                       code_ref_targets, fixed_pointer_targets, indirect_jump_targets]


class Analysis:
    """Decoded functions and known jump targets of one image."""

    def __init__(self, image: Image, arch, sources: list[TargetSource] | None = None,
                 extra_sources: list[TargetSource] = (), read_indirect_jumps: bool = True):
        self.image = image
        self.read_indirect_jumps = read_indirect_jumps
        self.fixed_pointers_scanned = False
        self.arch = arch
        self._decoded: dict[int, object] = {}
        self._memo: dict[str, dict] = {}
        self.targets: dict[int, str] = {}
        # func.start -> the arch's reading of each of its indirect jumps (jumptable.resolve)
        self.indirect: dict[int, list] = {}
        # Targets named by something other than a direct branch (a jump into a
        # function's middle from what a backward slice cannot follow).
        self.entered: set[int] = set()
        self.branch_sources: dict[int, list[int]] = {}     # target -> every direct branch to it
        for source in [*(sources if sources is not None else DEFAULT_SOURCES), *extra_sources]:
            if source is branch_targets:        # the same, without a string to format and parse a branch
                targets, sources_of = self.targets, self.branch_sources
                for target, src in _branch_pairs(image, self):
                    if target not in targets:
                        targets[target] = f"jump from {src:#x}"
                    got = sources_of.get(target)
                    if got is None:
                        sources_of[target] = [src]
                    else:
                        got.append(src)
                continue
            for target, why in source(image, self):
                self.targets.setdefault(target, why)
                if source is not branch_targets:
                    self.entered.add(target)
                elif why.startswith("jump from "):
                    self.branch_sources.setdefault(target, []).append(int(why[10:], 16))
        self._sorted_targets = sorted(self.targets)

    def decoded(self, f: Function):
        d = self._decoded.get(f.start)
        if d is None:
            d = self.arch.decode_function(self.image.read(f.start, f.end - f.start), f.start)
            self._decoded[f.start] = d
        return d

    def unbounded_indirect_jump(self, f: Function):
        """The first indirect jump of f whose targets are not all known jump targets
        (the kernel's insn_is_indirect_jump() refusal, narrowed to what the arch could
        not read), as (address, why); None if every one is read."""
        jumps = self.unbounded_indirect_jumps(f)
        if jumps is None:
            return self.decoded(f).indirect_jump, "it may have a jump table"
        return jumps[0] if jumps else None

    def unbounded_indirect_jumps(self, f: Function):
        """Every indirect jump of f whose targets are not all known, as (address,
        why); None when f's indirect jumps were not read at all (then not even
        their addresses are all known)."""
        d = self.decoded(f)
        if d.indirect_jump is None:
            return []
        jumps = self.indirect.get(f.start)
        if jumps is None:
            return None
        return [(j.addr, j.why) for j in jumps if j.kind == "unbounded"]

    def memo(self, kind: str, key, compute):
        """What an arch back end derives from a decoded function (its exits...),
        computed once per image."""
        table = self._memo.setdefault(kind, {})
        if key not in table:
            table[key] = compute()
        return table[key]

    def is_boundary(self, f: Function, addr: int) -> bool:
        d = self._decoded.get(f.start)
        if d is None and f.start <= addr < f.start + PREFIX:
            # Near the start (a probe on an entry) the bytes up to addr + PREFIX give the
            # same boundaries up to addr as the whole function: a kernel's 37,000 entry
            # probes need no whole-function decoding (the targets came from the cache).
            end = min(f.end, addr + PREFIX)
            d = self.arch.decode_function(self.image.read(f.start, end - f.start), f.start)
        b = (d or self.decoded(f)).boundaries
        off = addr - f.start
        i = bisect.bisect_left(b, off)
        return i < len(b) and b[i] == off

    def targets_in(self, lo: int, hi: int) -> list[tuple[int, str]]:
        """Known jump targets in [lo, hi)."""
        i = bisect.bisect_left(self._sorted_targets, lo)
        out = []
        while i < len(self._sorted_targets) and self._sorted_targets[i] < hi:
            t = self._sorted_targets[i]
            out.append((t, self.targets[t]))
            i += 1
        return out

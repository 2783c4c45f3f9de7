"""Stage 3: analyse functions.

Decodes every function of the image once (the arch decoder) and gathers the
known jump targets from pluggable sources: the kernel checks that no jump lands
in a probe's jump target prohibition region (JTPR) and that no exception-table
fixup does; in user space the equivalents are direct branches anywhere in the
image (a function's .cold part jumps back into it), C++ landing pads (LSDA),
code addresses taken by relocations, and code symbols.  A kernel image adds
__ex_table, alternatives, jump labels, static calls and ftrace sites as more
sources.

What the sources find depends on the image alone, so it is kept in kprewrite's
cache (cache.py, kind analysis-state) and a second analysis of the same image reads
it back.  Without it, a large image's functions are decoded by forked worker
processes, a slice each, joined in the functions' order, then its indirect jumps
read by workers too (indirect_jump_targets()), and the analysis is written to the
cache by a forked child while the rewrite goes on.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import os
import pickle
from typing import Callable, Iterable

from array import array
from itertools import chain

from .. import cache, safety
from ..elf import ehframe
from . import workers
from ..elf.image import Function, Image

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
    for pairs in _branch_lists(image, an):
        yield from pairs


def _branch_lists(image: Image, an: "Analysis"):
    """_branch_pairs() a list (or an iterator) at a time: each function's, or a
    kernel's from the cache or a worker."""
    k = None
    if len(image.data) >= BIG_IMAGE:
        bounds = array("Q", [x for f in image.functions for x in (f.start, f.end)]).tobytes()
        k = cache.key(b"branch_targets", an.arch.name.encode(), image.data, bounds)
        got = cache.get("analysis", k)
        if got is not None:
            pairs = array("Q")
            pairs.frombytes(got)
            it = iter(pairs)
            yield zip(it, it)
            return
    pairs = array("Q")
    if k is not None and not an.read_indirect_jumps and workers.jobs() > 1 and not an.decode_probed:
        # A kernel: only the branches are needed here (its probes decode their own
        # functions' first bytes), so the workers send back the pairs alone.
        for chunk in _in_workers(image, an.arch, _pairs_of):
            pairs.frombytes(chunk)
        it = iter(pairs)
        yield zip(it, it)
        cache.put("analysis", k, pairs.tobytes())
        return
    if workers.jobs() > 1 and len(image.functions) >= PARALLEL_FUNCTIONS and not an.all_decoded:
        an.decode_all()
    decoded = an.decoded
    if k is None:
        for f in image.functions:
            yield decoded(f).branches
        return
    for f in image.functions:
        branches = decoded(f).branches
        _extend_pairs(pairs, branches)
        yield branches
    cache.put("analysis", k, pairs.tobytes())


# Decoding is split over worker processes (one per CPU, KPREWRITE_JOBS to choose) when
# an image has this many functions: below it, starting them costs more than it saves.
PARALLEL_FUNCTIONS = 2000
# Slices of about the same bytes each (decoding costs by the byte: libpython's 16
# slices of as many functions each held 93 to 423 KB), small enough that the workers
# end together and that this process joins the last one soon after.
CHUNKS = 32
# A jump-table reading's slices (_read_in_workers).
READ_SLICES = 64


def _slices(funcs: list[Function], count: int) -> list[tuple[int, int]]:
    """(lo, hi) of at most `count` consecutive slices of funcs, about as many bytes each."""
    total = sum(f.end - f.start for f in funcs) or 1
    out, lo, got = [], 0, 0
    for i, f in enumerate(funcs):
        got += f.end - f.start
        if got * count >= total * (len(out) + 1) or i == len(funcs) - 1:
            out.append((lo, i + 1))
            lo = i + 1
    return out


def _pairs_of(lo: int, hi: int) -> bytes:
    image, arch = workers.shared()
    pairs = array("Q")
    for f in image.functions[lo:hi]:
        _extend_pairs(pairs, arch.decode_function(image.read(f.start, f.end - f.start), f.start).branches)
    return pairs.tobytes()


def _extend_pairs(pairs: array, branches) -> None:
    """(target, source) of each branch onto `pairs`, flat: in one extend() (a kernel's
    700,000 branches a step each were 0.2 s), a target out of 64 bits wrapped as a
    step each does it."""
    n = len(pairs)
    try:
        pairs.extend(chain.from_iterable(branches))
    except OverflowError:
        del pairs[n:]
        for target, src in branches:
            pairs.extend((target & 0xFFFFFFFFFFFFFFFF, src))


def _decoded_of(lo: int, hi: int) -> list:
    image, arch = workers.shared()
    return [arch.decode_function(image.read(f.start, f.end - f.start), f.start) for f in image.functions[lo:hi]]


def _in_workers(image: Image, arch, fn, slices=None, work=None):
    """workers.in_workers() of fn over image.functions in CHUNKS slices (_slices(); or
    over the (lo, hi) of `slices`, of another list fn reads); fn reads `work` (by
    default (image, arch)) as workers.shared()."""
    return workers.in_workers(fn, _slices(image.functions, CHUNKS) if slices is None else slices,
                              (image, arch) if work is None else work, image.path, "its analysis")


def landing_pad_targets(image: Image, an: "Analysis"):
    if not safety.enabled("lsda_landing_pads"):
        return
    for fde_start, pads in ehframe.landing_pads(image.data, image.fdes, image.path).items():
        for pad in pads:
            yield pad, f"C++ landing pad of the function at {fde_start:#x}"


def _code_test(image: Image) -> Callable[[int], bool]:
    """image.is_code() for many addresses (a relocation's, a lea's: libpython has
    45,000): its ranges merged where they meet, then one bisect an address."""
    lows, highs = [], []
    for lo, hi in sorted(image.exec_ranges):
        if lows and lo <= highs[-1]:
            highs[-1] = max(highs[-1], hi)
        else:
            lows.append(lo)
            highs.append(hi)
    find = bisect.bisect_right

    def is_code(addr: int) -> bool:
        i = find(lows, addr) - 1
        return i >= 0 and addr < highs[i]
    return is_code


def relocation_targets(image: Image, an: "Analysis"):
    is_code = _code_test(image)
    for _, r_offset, addend in image.relative_relocations():
        if is_code(addend):
            yield addend, f"code address taken by the relocation at {r_offset:#x}"


def symbol_targets(image: Image, an: "Analysis"):
    for addr in image.code_symbols:
        yield addr, f"code symbol at {addr:#x}"


def code_ref_targets(image: Image, an: "Analysis"):
    """Code addresses the code computes (x86: a RIP-relative lea): a register may
    hold one and jump to it."""
    if not an.read_indirect_jumps:
        return
    is_code = _code_test(image)
    for f in image.functions:
        for target, src in an.decoded(f).code_refs or ():
            if is_code(target):
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
    todo = [f for f in image.functions if an.decoded(f).indirect_jumps]
    read = {}
    if workers.jobs() > 1 and len(image.functions) >= PARALLEL_FUNCTIONS and len(todo) > 1:
        read = _read_in_workers(image, an, todo)
    added: list[int] = []       # the targets yielded so far, sorted
    for f in todo:
        jumps = read.get(f.start)
        i = bisect.bisect_left(added, f.start)
        if jumps is None or (i < len(added) and added[i] < f.end):
            # A worker read f before an earlier function's readings named an address
            # of f (they are known targets by now): read it again, as one process does.
            jumps = resolve.resolve(image, an, f)
        an.indirect[f.start] = jumps
        for j in jumps:
            for t in j.targets:
                bisect.insort(added, t)
                yield t, (f"jump table entry of the jump at {j.addr:#x}" if j.kind == "jump table"
                          else f"target of the indirect jump at {j.addr:#x}")


def _read_in_workers(image: Image, an: "Analysis", todo: list[Function]) -> dict[int, list]:
    """jumptable.resolve() of each function of `todo`, in forked workers (_in_workers),
    with the targets every other source found.  One process reads the functions in
    order, each with the targets the earlier ones' readings added too; but a reading
    asks the analysis about the function's own addresses only (the arch's resolve()
    promises it), so a worker's reading is that one unless an earlier reading
    named an address of the function (indirect_jump_targets() then reads it again)."""
    # A few large functions cost most (libpython: 16 of 446 half the time): the largest
    # first, each slice about a 64th of the bytes, so that the workers end together.
    order = sorted(todo, key=lambda f: f.start - f.end)
    share = sum(f.end - f.start for f in order) / READ_SLICES
    slices, lo, got = [], 0, 0
    for i, f in enumerate(order):
        got += f.end - f.start
        if got >= share or i == len(order) - 1:
            slices.append((lo, i + 1))
            lo, got = i + 1, 0
    out = {}
    for got in _in_workers(image, an.arch, _resolved_of, slices, work=(image, an, order)):
        out.update(got)
    return out


def _resolved_of(lo: int, hi: int) -> list:
    image, an, todo = workers.shared()
    return [(f.start, an.arch.jumptable.resolve(image, an, f)) for f in todo[lo:hi]]


# Sources that read the image alone (not the decoded functions, not other sources' targets).
_IMAGE_ONLY = (landing_pad_targets, relocation_targets, symbol_targets)

DEFAULT_SOURCES: list[TargetSource] = [branch_targets, landing_pad_targets, relocation_targets, symbol_targets,
                                       code_ref_targets, fixed_pointer_targets, indirect_jump_targets]


def _state_key(image: Image, arch, sources, read_indirect_jumps: bool) -> str | None:
    """The analysis cache's key: the image's bytes, function bounds and symbols, the
    arch, the sources, and kprewrite's code; None (no caching) when a safety rule is
    switched off (the test suite's rule-off runs) or a source has no lasting name."""
    if os.environ.get(safety.OFF_VAR):
        return None
    if any("<" in getattr(s, "__qualname__", "<") for s in sources):
        return None             # a lambda or a local function: its name does not say what it does
    bounds = array("Q", [x for f in image.functions for x in (f.start, f.end)]).tobytes()
    syms = repr((sorted(image.symbols.items()), image.code_symbols)).encode()
    names = ",".join(f"{s.__module__}.{s.__qualname__}" for s in sources).encode()
    return cache.key(b"analysis-state", cache.code_version(), arch.name.encode(), image.data, bounds, syms,
                     names, bytes([bool(read_indirect_jumps)]))


# Pickling an image's analysis and writing it to the cache (0.15 s for libpython; 0.05 s
# with the workers' slices kept as they came, _save_state()) is done by a forked child
# while the rewrite goes on, where this process may fork (as workers.jobs() decides, and
# no other thread runs): the child pickles the state as it was at the fork.  The sooner
# it is done the better: while it runs, this process copies each page it writes that
# the child shares (with the whole state pickled there, 0.1-0.15 s more of planning).
# The children are waited for before this process reads the cache's analyses and when
# it exits, so the entry is there once the command is done.
_WRITERS: list[int] = []
_AT_EXIT = False


def _write_state(k: str, state: dict) -> None:
    import threading
    if workers.jobs() > 1 and threading.active_count() == 1 and hasattr(os, "fork"):
        global _AT_EXIT
        if not _AT_EXIT:
            import atexit
            atexit.register(_wait_writers)
            _AT_EXIT = True
        parent = os.getpid()
        try:
            pid = os.fork()
            if pid == 0:
                _put_state(k, state)
        except OSError:
            if os.getpid() != parent:
                raise
            _put_state(k, state)        # no process to spare: written here
            return
        finally:
            # The child never returns into the caller, whatever is raised in it (a signal
            # delivered as it starts: KeyboardInterrupt before any handler of its own),
            # nor runs the parent's exit handlers or flushes its buffered output.
            if os.getpid() != parent:
                os._exit(0)
        _WRITERS.append(pid)
        return
    _put_state(k, state)


def _put_state(k: str, state: dict) -> None:
    try:
        data = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        # An arch's derived object that does not pickle: its memo is derived again.
        memo = {}
        for kind, table in state["_memo"].items():
            try:
                pickle.dumps(table)
            except Exception:
                continue
            memo[kind] = table
        state = {**state, "_memo": memo}
        try:
            data = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            return
    cache.put("analysis-state", k, data)


def _wait_writers() -> None:
    while _WRITERS:
        pid = _WRITERS.pop()
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


@contextlib.contextmanager
def _unscanned():
    """The decoded functions as they come from the workers, kept out of the cyclic
    collector: they live as long as the analysis (libpython: some 200,000 objects), and
    the collector's rescans of them were a third of this process's analysis time.  Young
    garbage is collected first, the collector is paused while they are made, and they
    are frozen then (gc.freeze(): never scanned again, never collected)."""
    if not gc.isenabled():
        yield
        return
    gc.collect(0)
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


class Analysis:
    """Decoded functions and known jump targets of one image."""

    def __init__(self, image: Image, arch, sources: list[TargetSource] | None = None,
                 extra_sources: list[TargetSource] = (), read_indirect_jumps: bool = True,
                 probed_functions: int = 0):
        self.image = image
        self.read_indirect_jumps = read_indirect_jumps
        # The planner decodes each probed function whole (can_optimize()): past
        # PARALLEL_FUNCTIONS of them (a kernel's every entry), the workers that read a
        # kernel's branches send the decoded functions back, not the branches alone.
        self.decode_probed = probed_functions >= PARALLEL_FUNCTIONS
        self.fixed_pointers_scanned = False
        self.arch = arch
        self._decoded: dict[int, object] = {}
        self.all_decoded = False        # by decode_all()
        self._memo: dict[str, dict] = {}
        self.targets: dict[int, str] = {}
        # func.start -> the arch's reading of each of its indirect jumps (jumptable.resolve)
        self.indirect: dict[int, list] = {}
        # Targets named by something other than a direct branch (a jump into a
        # function's middle from what a backward slice cannot follow).
        self.entered: set[int] = set()
        self.branch_sources: dict[int, list[int]] = {}     # target -> every direct branch to it
        sources = [*(sources if sources is not None else DEFAULT_SOURCES), *extra_sources]
        k = _state_key(image, arch, sources, read_indirect_jumps)
        if k is not None and self._load_state(k):
            return
        # In workers (a small image): what the analysis makes lives as long as it does,
        # and is kept out of the cyclic collector (_unscanned()).
        many = branch_targets in sources and workers.jobs() > 1 and len(image.functions) >= PARALLEL_FUNCTIONS
        parallel = many and len(image.data) < BIG_IMAGE
        # A big image (a kernel) decoded by the workers too: its decoded functions and
        # branches (millions of tuples and lists) are kept out of the collector as well.
        with _unscanned() if many else contextlib.nullcontext():
            self._find(image, arch, sources, read_indirect_jumps, parallel, keep_raw=k is not None)
        self._sorted_targets = sorted(self.targets)
        if k is not None:
            self._save_state(k)

    def _find(self, image: Image, arch, sources, read_indirect_jumps: bool, parallel: bool,
              keep_raw: bool = False) -> None:
        """Every source's targets, the decoded functions (in workers when parallel;
        keep_raw: their slices kept as they came too, for _save_state())."""
        early = {}
        branched = False
        if parallel:
            # The workers decode (branch_targets' decode_all()) while this process
            # reads the targets that depend on the image alone, then makes the
            # branches into targets a slice at a time, as the workers send them.
            job = workers.Workers(_decoded_of, _slices(image.functions, CHUNKS), (image, arch), image.path,
                                  "its analysis", keep_raw=keep_raw)
            try:
                for source in sources:
                    if source in _IMAGE_ONLY:
                        early[source] = list(source(image, self))
                if indirect_jump_targets in sources and read_indirect_jumps:
                    prepare = getattr(getattr(arch, "jumptable", None), "prepare", None)
                    if prepare is not None:
                        prepare(image, self)        # once here, not in each jump-table reader
                if sources[0] is branch_targets:
                    self._add_branches(self._decoded_branches(job.results()))
                    branched = True
                else:
                    self._take_decoded(job.results())
                if job.raw is not None and len(job.raw) == job.count:
                    self._decoded_raw = [job.raw[i] for i in range(job.count)]
            finally:
                job.close()
        for source in sources:
            if source is branch_targets:        # the same, without a string to format and parse a branch
                if not branched:
                    self._add_branches(_branch_lists(image, self))
                continue
            for target, why in (early[source] if source in early else source(image, self)):
                self.targets.setdefault(target, why)
                self.entered.add(target)

    # What the sources found depends only on the image (its bytes, functions and
    # symbols), the sources and this code: a second rewrite of the same image (another
    # spec, the same spec again) reads it from kprewrite's cache instead of decoding
    # every function.  An image's decoded functions go with it when it is small
    # enough that reading them back is cheaper than decoding them again.
    _STATE = ("targets", "entered", "branch_sources", "indirect", "fixed_pointers_scanned", "fixed_pointers")

    def _save_state(self, k: str) -> None:
        state = {n: getattr(self, n) for n in self._STATE if hasattr(self, n)}
        state["_memo"] = dict(self._memo)
        if len(self.image.data) < BIG_IMAGE:
            raw = self.__dict__.pop("_decoded_raw", None)
            if raw is not None:
                # The workers' slices as they came, pickled: half the pickling of the
                # state not done again (the writer, forked, is done sooner, and this
                # process copies fewer of the pages it shares with it as it plans on).
                state["_decoded_slices"] = raw
            else:
                state["_decoded"] = self._decoded
        _write_state(k, state)

    def _load_state(self, k: str) -> bool:
        _wait_writers()            # this process's own entry, if one is being written
        data = cache.get("analysis-state", k)
        if data is None:
            return False
        try:
            with _unscanned():
                state = pickle.loads(data)
        except Exception:
            return False
        slices = state.pop("_decoded_slices", None)
        if slices is not None:          # _save_state()'s workers' slices, merged as they came
            try:
                with _unscanned():
                    self._take_decoded(workers.result_of(raw) for raw in slices)
            except Exception:
                self._decoded, self.all_decoded = {}, False
                return False
        for n, v in state.items():
            setattr(self, n, v)
        self._sorted_targets = sorted(self.targets)
        return True

    def decode_all(self) -> None:
        """Every function decoded, in worker processes (see _in_workers)."""
        self._take_decoded(_in_workers(self.image, self.arch, _decoded_of))

    def _add_branches(self, lists) -> None:
        """branch_targets()' targets, and every branch to each (branch_sources)."""
        targets, sources_of = self.targets, self.branch_sources
        for branches in lists:
            for target, src in branches:
                got = sources_of.get(target)
                if got is None:
                    sources_of[target] = [src]
                    if target not in targets:
                        targets[target] = f"jump from {src:#x}"
                else:
                    got.append(src)

    def _merged(self, chunks):
        """Each slice's decoded functions (image.functions in order, a slice at a
        time) into _decoded, the first of a start kept; yields each slice's (lo, hi)
        once it is in."""
        funcs, decoded = self.image.functions, self._decoded
        i = 0
        for chunk in chunks:
            lo = i
            for d in chunk:
                decoded.setdefault(funcs[i].start, d)
                i += 1
            yield lo, i
        self.all_decoded = True

    def _decoded_branches(self, chunks):
        """_take_decoded(), yielding each function's branches (as _branch_lists() does
        after decode_all()) once its slice has come."""
        funcs, decoded = self.image.functions, self._decoded
        for lo, hi in self._merged(chunks):
            for f in funcs[lo:hi]:
                yield decoded[f.start].branches

    def _take_decoded(self, chunks) -> None:
        for _ in self._merged(chunks):
            pass

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

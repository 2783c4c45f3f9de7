"""kprewrite's cache of what a rewrite derives from its inputs alone (an image's
analysis, the linked probe table) and the decoding split over worker processes:
each gives the same analysis and the same output bytes as the work done afresh in
one process.  Fast: one small compile, three rewrites."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from conftest import ALL_ARCHES, ARCH, TREE_ENV, cc, write_spec

from rewriter.analysis import functions as A
from rewriter.analysis import workers as W
from rewriter.arch import get_arch
from rewriter.errors import KprewriteError
from rewriter.elf.image import Image

ARCHES = ALL_ARCHES

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) int pick(int x) {
    switch (x) { case 0: return 11; case 1: return 23; case 2: return 37; case 3: return 41;
                 case 4: return 53; case 5: return 67; case 6: return 71; default: return -1; }
}
__attribute__((noinline)) int twice(int x) { return pick(x) * 2; }
int main(int argc, char **argv) { printf("%d %d\n", pick(argc), twice(atoi(argc > 1 ? argv[1] : "3"))); return 0; }
"""


def _state(an):
    return (dict(an.targets), sorted(an.entered), dict(an.branch_sources),
            {k: [(j.addr, j.kind, j.targets, j.why) for j in v] for k, v in an.indirect.items()},
            {f: (d.boundaries.tobytes(), d.branches, d.exits, d.indirect_jumps) for f, d in an._decoded.items()})


@pytest.mark.skipif(ARCH != "x86_64", reason="x86-64's jump tables (arch/x86_64/jumptable.py)")
def test_analysis_from_the_cache_and_from_workers(tmp_path, monkeypatch):
    """An image's analysis read back from the cache, and one decoded by two worker
    processes, equal the analysis done in one process with no cache."""
    prog = cc(tmp_path, "prog", PROGRAM, "-O2")
    image = Image(str(prog))
    arch = get_arch(image.machine)
    monkeypatch.setenv("KPREWRITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KPREWRITE_JOBS", "1")
    fresh = A.Analysis(image, arch)
    assert fresh.indirect and list((tmp_path / "cache" / "analysis-state").iterdir())
    cached = A.Analysis(image, arch)
    assert _state(cached) == _state(fresh)
    monkeypatch.setenv("KPREWRITE_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setattr(W, "jobs", lambda: 2)        # even in a test runner's threaded process
    monkeypatch.setattr(A, "PARALLEL_FUNCTIONS", 1)
    parallel = A.Analysis(image, arch)
    assert _state(parallel) == _state(fresh)
    # Its entry keeps the workers' slices as they came (not pickled again): read back, the same.
    A._wait_writers()
    from rewriter import cache
    import pickle
    (entry,) = (tmp_path / "cache2" / "analysis-state").iterdir()
    assert "_decoded_slices" in pickle.loads(cache.get("analysis-state", entry.name))
    assert _state(A.Analysis(image, arch)) == _state(fresh)
    pairs = b"".join(A._in_workers(image, arch, A._pairs_of))
    monkeypatch.setattr(W, "_WORK", (image, arch))
    assert pairs == A._pairs_of(0, len(image.functions)) and pairs


def test_analysis_written_by_a_forked_child_that_never_runs_on_in_the_caller(tmp_path, monkeypatch):
    """Where workers may run, the analysis is written to the cache by a forked child: the
    entry is there once the child is waited for, and reads back as the same analysis.  The
    child exits whatever is raised in it, even as it starts (a signal delivered then): it
    never returns into the caller's code (here: the test, in a second process)."""
    if threading.active_count() > 1:
        pytest.skip("a process running other threads writes the analysis in place")
    prog = cc(tmp_path, "prog", PROGRAM, "-O2")
    image = Image(str(prog))
    arch = get_arch(image.machine)
    monkeypatch.setenv("KPREWRITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(W, "jobs", lambda: 2)
    fresh = A.Analysis(image, arch)
    assert A._WRITERS                               # a child writes it
    A._wait_writers()
    assert list((tmp_path / "cache" / "analysis-state").iterdir())
    assert _state(A.Analysis(image, arch)) == _state(fresh)

    parent, escaped = os.getpid(), tmp_path / "escaped"
    fork = os.fork

    def interrupted_fork():
        pid = fork()
        if pid == 0:
            raise KeyboardInterrupt                 # SIGINT as the child starts
        return pid

    monkeypatch.setattr(os, "fork", interrupted_fork)
    monkeypatch.setenv("KPREWRITE_CACHE", str(tmp_path / "cache2"))
    try:
        again = A.Analysis(image, arch)
    except BaseException:
        if os.getpid() != parent:
            escaped.write_text("the writer ran on in the caller")
            os._exit(3)
        raise
    A._wait_writers()
    assert not escaped.exists()
    assert _state(again) == _state(fresh)


def _killed(lo: int, hi: int):
    """A slice whose worker is killed (the out-of-memory killer) before it sends its result."""
    if lo == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return hi - lo


def test_a_worker_killed_is_an_error_not_a_wait_forever(tmp_path, monkeypatch):
    """A worker that dies before it sends its slice's result: the analysis raises a
    one-line error instead of waiting for it forever."""
    image = Image(str(cc(tmp_path, "prog", PROGRAM, "-O2")))
    monkeypatch.setattr(W, "jobs", lambda: 2)
    with pytest.raises(KprewriteError, match="worker process .* killed .* KPREWRITE_JOBS=1"):
        list(A._in_workers(image, get_arch(image.machine), _killed))
    assert W.shared() is None
    assert sum(A._in_workers(image, get_arch(image.machine), len_of_slice)) == len(image.functions)


def len_of_slice(lo: int, hi: int) -> int:
    return hi - lo


def _raising(lo: int, hi: int):
    if lo:
        raise ValueError(f"slice at {lo}")
    return hi - lo


def test_what_a_worker_raises_is_raised_here_and_no_worker_is_left(tmp_path, monkeypatch):
    """An error in a worker's slice is raised in the analysis, as in one process, and
    the workers are ended and waited for (none left running, none a zombie)."""
    image = Image(str(cc(tmp_path, "prog", PROGRAM, "-O2")))
    monkeypatch.setattr(W, "jobs", lambda: 2)
    job = W.Workers(_raising, A._slices(image.functions, A.CHUNKS), (image, get_arch(image.machine)), image.path, "its analysis")
    pids = list(job.conns)
    assert len(pids) == 2
    try:
        with pytest.raises(ValueError, match="slice at"):
            list(job.results())
    finally:
        job.close()
    assert W.shared() is None
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


@pytest.mark.parametrize("forks", [0, 1])
def test_no_process_to_spare_the_work_is_done_anyway(tmp_path, monkeypatch, forks):
    """fork() failing (EAGAIN: a process limit) before any worker, or after the first:
    the slices are done by the workers started, or by this process, and the analysis
    equals the one done in one process."""
    image = Image(str(cc(tmp_path, "prog", PROGRAM, "-O2")))
    arch = get_arch(image.machine)
    monkeypatch.setenv("KPREWRITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KPREWRITE_JOBS", "1")
    fresh = A.Analysis(image, arch)
    monkeypatch.setenv("KPREWRITE_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setattr(W, "jobs", lambda: 2)
    monkeypatch.setattr(A, "PARALLEL_FUNCTIONS", 1)
    fork, started = os.fork, []

    def limited_fork():
        if len(started) >= forks and os.getpid() == parent:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        pid = fork()
        if pid:
            started.append(pid)
        return pid
    parent = os.getpid()
    monkeypatch.setattr(os, "fork", limited_fork)
    assert sum(A._in_workers(image, arch, len_of_slice)) == len(image.functions)
    assert len(started) == forks
    assert _state(A.Analysis(image, arch)) == _state(fresh)


def test_second_rewrite_reads_the_cache_and_writes_the_same_bytes(tmp_path):
    """The first rewrite fills the cache (the analysis, the linked blob); the second
    reads them (it runs no gcc for the table: its blob entry is not rewritten) and
    writes the same bytes, as does a rewrite from an empty cache."""
    prog = cc(tmp_path, "prog", PROGRAM, "-O2")
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "*"\n')
    cache = tmp_path / "cache"
    env = {**TREE_ENV, "KPREWRITE_CACHE": str(cache)}

    def rewrite(out):
        subprocess.run([sys.executable, "-m", "rewriter", "instrument", str(prog), "--spec", str(spec), "-o", str(out)],
                       check=True, env=env, cwd=tmp_path, capture_output=True)
        return out.read_bytes()

    first = rewrite(tmp_path / "a")
    blobs = list((cache / "blob").iterdir())
    assert len(blobs) == 1 and list((cache / "analysis-state").iterdir())
    inode = blobs[0].stat().st_ino
    second = rewrite(tmp_path / "b")
    assert second == first
    assert blobs[0].stat().st_ino == inode          # read, not written again (a put replaces the file)
    env["KPREWRITE_CACHE"] = str(tmp_path / "empty")
    assert rewrite(tmp_path / "c") == first


def test_a_cache_folder_others_may_write_is_not_used(tmp_path):
    """A cache folder others may write to is neither read nor written: its entries are
    unpickled and its compiled runtime is linked into the output.  Every entry of a
    filled cache is spoiled, then the folder opened to everyone: the rewrite still
    writes the same bytes (it read nothing there) and adds nothing; made private again,
    the spoiled entries are read, found damaged and made again (the compiled runtime's
    against its manifest, the others as they fail to unpickle or to check): the same
    bytes, and the cache's runtime whole again."""
    prog = cc(tmp_path, "prog", PROGRAM, "-O2")
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "*"\n')
    cache = tmp_path / "cache"
    env = {**TREE_ENV, "KPREWRITE_CACHE": str(cache)}

    def rewrite(out, check=True):
        r = subprocess.run([sys.executable, "-m", "rewriter", "instrument", str(prog), "--spec", str(spec), "-o", str(out)],
                           env=env, cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0 or not check, r.stderr
        return out.read_bytes() if r.returncode == 0 else None

    first = rewrite(tmp_path / "a")
    assert (cache.stat().st_mode & 0o777) == 0o700          # made private
    entries = sorted(f for f in cache.rglob("*") if f.is_file())
    assert any(f.suffix == ".o" for f in entries) and list((cache / "blob").iterdir())
    for f in entries:
        f.write_bytes(b"spoiled")
    cache.chmod(0o777)
    assert rewrite(tmp_path / "b") == first
    assert sorted(f for f in cache.rglob("*") if f.is_file()) == entries
    cache.chmod(0o755)
    assert rewrite(tmp_path / "c") == first                 # the spoiled entries, read and made again
    objs = [f for f in cache.rglob("runtime-*/*.o")]
    assert objs and all(f.read_bytes() != b"spoiled" for f in objs)


def test_a_damaged_runtime_in_the_cache_is_built_again(tmp_path):
    """A compiled runtime object cut short in the cache (a full disk, a damaged file):
    the next rewrite finds it unlike its entry's manifest, builds the runtime again and
    writes the same bytes, rather than failing in the linker."""
    prog = cc(tmp_path, "prog", PROGRAM, "-O2")
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "*"\n')
    cache = tmp_path / "cache"
    env = {**TREE_ENV, "KPREWRITE_CACHE": str(cache)}

    def rewrite(out):
        r = subprocess.run([sys.executable, "-m", "rewriter", "instrument", str(prog), "--spec", str(spec), "-o", str(out)],
                           env=env, cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return out.read_bytes()

    first = rewrite(tmp_path / "a")
    (entry,) = cache.glob("runtime-*")
    core = next(entry.glob("rt_kp_core*.o"))
    whole = core.read_bytes()
    core.write_bytes(whole[:100])
    assert rewrite(tmp_path / "b") == first
    (again,) = cache.glob("runtime-*")
    assert again.name == entry.name and (again / core.name).read_bytes() == whole
    assert not list(cache.glob(".runtime-*"))              # the damaged one set aside, then deleted

# crossing's jump table lands inside target, a function after it that has an indirect
# jump of its own: read with the other sources' targets only (a worker), target's jump
# would miss the three entries that one process has found by the time it reads target.
CROSSING = r"""
__asm__(
"    .text\n"
"    .globl crossing\n    .type crossing, @function\n"
"crossing:\n"
"    cmpl $2, %edi\n"
"    ja 1f\n"
"    leaq table(%rip), %rdx\n"
"    movslq (%rdx,%rdi,4), %rax\n"
"    addq %rdx, %rax\n"
"    jmp *%rax\n"
"1:  xorl %eax, %eax\n"
"    ret\n"
"    .size crossing, .-crossing\n"
"    .globl target\n    .type target, @function\n"
"target:\n"
"    movl $1, %eax\n"
"entry0: addl $1, %eax\n"
"entry1: addl $2, %eax\n"
"entry2: movq %rsi, %rcx\n"
"    jmp *%rcx\n"
"    .size target, .-target\n"
"    .section .rodata\n"
"    .p2align 2\n"
"table: .long entry0-table, entry1-table, entry2-table\n"
"    .text\n");
int crossing(int, void *);
int main(int argc, char **argv) { return argc > 5 ? crossing(argc, argv[0]) : 0; }
"""


@pytest.mark.skipif(ARCH != "x86_64", reason="x86-64 assembly and jump tables")
def test_jump_tables_read_by_workers_again_where_an_earlier_table_lands(tmp_path, monkeypatch):
    """The workers read every function's indirect jumps with the targets the other
    sources found; a function an earlier function's jump table lands in is read
    again in order, as one process reads it, so the analysis is the same."""
    prog = cc(tmp_path, "prog", CROSSING, "-O2")
    image = Image(str(prog))
    arch = get_arch(image.machine)
    target = image.function_named("target")
    monkeypatch.setenv("KPREWRITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KPREWRITE_JOBS", "1")
    fresh = A.Analysis(image, arch)
    assert [j.kind for j in fresh.indirect[image.function_named("crossing").start]] == ["jump table"]
    assert fresh.indirect[target.start]
    again = []
    resolve = arch.jumptable.resolve

    def counted(image, an, f):          # called in this process only for a reading done again
        again.append(f.start)
        return resolve(image, an, f)

    monkeypatch.setattr(arch.jumptable, "resolve", counted)
    monkeypatch.setenv("KPREWRITE_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setattr(W, "jobs", lambda: 2)
    monkeypatch.setattr(A, "PARALLEL_FUNCTIONS", 1)
    parallel = A.Analysis(image, arch)
    assert again == [target.start]
    assert _state(parallel) == _state(fresh)


def _slice_of_work(lo: int, hi: int):
    return W.shared()[lo:hi]


def test_a_pool_doing_its_work_here_keeps_it_while_another_opens_and_closes(monkeypatch):
    """A pool whose fork failed does its slices in this process when its results are
    read: another pool opened and closed meanwhile does not take its work away."""
    monkeypatch.setattr(W, "jobs", lambda: 2)
    fork = os.fork

    def no_fork():
        raise BlockingIOError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(os, "fork", no_fork)
    a = W.Workers(_slice_of_work, [(0, 2), (2, 3)], ["a", "b", "c"], "a", "task a")
    monkeypatch.setattr(os, "fork", fork)
    b = W.Workers(_slice_of_work, [(0, 1)], ["x"], "b", "task b")
    try:
        assert list(b.results()) == [["x"]]
    finally:
        b.close()
    try:
        assert list(a.results()) == [["a", "b"], ["c"]]
    finally:
        a.close()
    assert W.shared() is None

"""Forked worker processes: fn(lo, hi) over slices of work, in children that share
this process's memory as it was at the fork (nothing is sent to them but the
slices' numbers; each result comes back pickled), the results in the slices'
order, so that the output is the same bytes as the work done in one process.
The analysis decodes an image's functions so (analysis/functions.py), and a user image's
detours' unwind programs are computed so while the linker runs
(targets/linux_user/unwind.py).

One pool at a time: its work is this module's, read by fn as shared()."""
from __future__ import annotations

import gc
import os
import pickle

_WORK = None        # what the workers read (Workers' `work`): shared with the parent at the fork, not sent


def shared():
    """The running pool's `work` (in a worker, or here when no worker could be started)."""
    return _WORK


def jobs() -> int:
    """How many worker processes run at once: $KPREWRITE_JOBS, else one per CPU
    this process may run on; one in a process running other threads (forking it could
    copy a lock another thread holds: the library called from a threaded program)."""
    import threading
    if threading.active_count() > 1:
        return 1
    v = os.environ.get("KPREWRITE_JOBS", "")
    if v:       # a mistyped count is a bad input, not the default in silence
        from ..errors import KprewriteError
        if not (v.isdigit() and int(v) > 0):
            raise KprewriteError(f"KPREWRITE_JOBS={v!r}: not a count of processes (a whole number >= 1)")
        return int(v)
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def in_workers(fn, slices: list[tuple[int, int]], work, path: str, task: str):
    """fn(lo, hi) of each slice, in forked worker processes (as many as jobs()), the
    results in the slices' order; fn reads `work` as shared().  path and task name
    the work in an error ("PATH: a worker process of TASK was killed ...")."""
    job = Workers(fn, slices, work, path, task)
    try:
        yield from job.results()
    finally:
        job.close()


class Workers:
    """in_workers() started at once: the workers run while this process does
    something else, until results() is read.

    jobs() forked children take the slices' numbers in turn from one pipe (a read of
    4 bytes takes one whole), and send each slice's result, pickled, through a pipe
    of their own; this process reads the results as they come and gives them in the
    slices' order.  Not multiprocessing.Pool: its two threads here, which take the
    results while this process merges them, cost it as much again as unpickling them
    (libpython: 0.06 s more)."""

    def __init__(self, fn, slices: list[tuple[int, int]], work, path: str, task: str, keep_raw: bool = False):
        """keep_raw: each slice's result is kept as it came, pickled, in raw[i] (a
        caller that stores the results keeps their bytes rather than pickle them
        again); none when no child could be started."""
        global _WORK
        self.path, self.task, self.work = path, task, work
        self.raw: dict[int, bytes] | None = {} if keep_raw else None
        self.count = len(slices)
        self.conns: dict[int, object] = {}        # child's pid -> the pipe it sends its results through
        _WORK = work
        self.local = None                         # (fn, slices) when no child could be started
        tasks, feed = os.pipe()
        try:
            for _ in range(min(jobs(), self.count)):
                try:
                    self._fork(tasks, feed, fn, slices)
                except OSError:     # no process to spare (EAGAIN, ENOMEM): those started take every slice
                    break
            if not self.conns:      # none: this process does the work, in results()
                self.local = (fn, slices)
                self.raw = None
                return
            with open(feed, "wb", closefd=False) as f:
                f.write(b"".join(i.to_bytes(4, "little") for i in range(self.count)))
        except BaseException:
            self.close()
            raise
        finally:
            os.close(tasks)
            os.close(feed)

    def _fork(self, tasks: int, feed: int, fn, slices) -> None:
        from multiprocessing.connection import Connection
        r, w = os.pipe()
        parent = os.getpid()
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(feed)
                    os.close(r)
                    _serve(tasks, Connection(w, readable=False), fn, slices)
                finally:
                    os._exit(0)
        except BaseException:
            # The child never returns into the caller, whatever is raised in it (a signal
            # delivered as it starts: KeyboardInterrupt before the try above), nor runs
            # the parent's exit handlers or flushes its buffered output.
            if os.getpid() != parent:
                os._exit(1)
            os.close(r)
            os.close(w)
            raise
        os.close(w)
        self.conns[pid] = Connection(r, writable=False)
        try:
            import fcntl             # room for a few slices' results (Linux): a child goes on
            fcntl.fcntl(r, fcntl.F_SETPIPE_SZ, 1 << 20)     # while this process merges
        except (ImportError, AttributeError, OSError):
            pass

    def results(self):
        """The slices' results in order.  A child that ends before it is done (the
        out-of-memory killer) is an error: its slice would never come."""
        global _WORK
        if self.local is not None:
            fn, slices = self.local
            for lo, hi in slices:
                _WORK = self.work       # this pool's, whatever another opened since
                yield fn(lo, hi)
            return
        from multiprocessing.connection import wait
        got, want, live = {}, 0, dict(self.conns)
        while want < self.count:
            if want not in got and not live:
                from ..errors import KprewriteError
                raise KprewriteError(f"{self.path}: the worker processes of {self.task} ended without a slice's result")
            # What has come, read at once: a child's pipe full would stop it.
            for conn in wait(list(live.values()), timeout=None if want not in got else 0):
                pid = next(p for p, c in live.items() if c is conn)
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    data = None
                if not data:
                    del live[pid]
                    if data is None:
                        from ..errors import KprewriteError
                        raise KprewriteError(f"{self.path}: a worker process of {self.task} was killed before it was "
                                             "done (out of memory?); KPREWRITE_JOBS=1 does the work in this process")
                    continue
                i, ok, result = pickle.loads(data)
                if not ok:
                    raise result
                got[i] = result
                if self.raw is not None:
                    self.raw[i] = data
            if want in got:
                yield got.pop(want)
                want += 1

    def close(self) -> None:
        global _WORK
        import signal
        for pid, conn in self.conns.items():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            conn.close()
        for pid in self.conns:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.conns = {}
        if _WORK is self.work:      # not another pool's, opened since
            _WORK = None


def result_of(raw: bytes):
    """A slice's result from the bytes Workers.raw kept."""
    return pickle.loads(raw)[2]


def _serve(tasks: int, out, fn, slices) -> None:
    """A worker child: fn over each slice whose number it reads from `tasks`, each
    result sent (its number, whether fn returned, what it returned or raised), then
    an empty message once there is no slice left.  The cyclic collector is off: the
    child exits once the work is done, and would only rescan what it decodes."""
    gc.disable()
    while True:
        b = os.read(tasks, 4)
        if len(b) < 4:
            break
        i = int.from_bytes(b, "little")
        try:
            msg = (i, True, fn(*slices[i]))
        except Exception as e:
            msg = (i, False, e)
        try:
            data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            data = pickle.dumps((i, False, RuntimeError(f"{e!r} (a worker process' result)")))
        out.send_bytes(data)
    out.send_bytes(b"")

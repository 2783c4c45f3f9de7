"""A multi-threaded server from Debian under load (issue 41, section 2): memcached (4
worker threads, Debian's stripped build), with 16 clients on connections of their own
making 52,800 requests (17,600 `set`s, 35,200 `get`s), every reply checked byte for byte
by tests/server/load.c.  Rewritten four ways:

- a kprobe on every function (no handler: light hits),
- a kretprobe on every function, without a handler (light) and with one,
- `[[function_graph]]` on every function, traced to a binary trace
  (KPREWRITE_TRACE_FORMAT=binary).

Each rewrite must serve every reply right, exit 0 on SIGTERM, and count exactly: the
functions called once a `get` (and once a `set`) have profile counts equal to the
server's own `stats` (cmd_get, cmd_set), with nothing missed; in the binary trace
their entries equal the same statistics, and every entry of every thread has its
return, in order, but for the frames still running when the server exits (the threads'
outermost functions).  Debian's memcached is stripped, so the functions are named by
address (sub_<hex>): which are called once a request is learnt first, from two small
sequential runs of the kprobe rewrite with other ratios of `get`s to `set`s.

The original runs under the same load in the same test, and the throughput ratio
(rewritten over original) is printed (`-s`) and kept as a property
(benchmarks/README.md has the row).  memcached is the installed one, else Debian's
package fetched with `apt-get download` into ~/.cache/kprewrite/debian (its libraries,
libevent and libsasl2, must be installed).  Slow: some 2 minutes on 2 cores."""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from conftest import cc, instrument, profile, write_spec

ARCHES = ["x86_64"]      # x86-64 only: Debian's x86-64 memcached
pytestmark = pytest.mark.slow

CACHE = Path(os.environ.get("KPREWRITE_DEBIAN_CACHE", Path.home() / ".cache" / "kprewrite" / "debian"))
LOAD = Path(__file__).parent / "server" / "load.c"
CLIENTS, ROUNDS, GETS = 16, 1100, 2          # 16 x 1,100 x (1 set + 2 gets) = 52,800 requests
THREADS = 4

RET_HANDLER = r"""
#include <kprewrite/kprobes.h>
unsigned long returns;
int ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
    __atomic_add_fetch(&returns, 1, __ATOMIC_RELAXED);
    return 0;
}
"""

SPECS = {
    "kprobe": ('[[kprobe]]\nsymbol_name = "*"\n', None),
    "kretprobe": ('[[kretprobe]]\nsymbol_name = "*"\n', None),
    "kretprobe+handler": ('handlers = ["handlers.c"]\n[[kretprobe]]\nsymbol_name = "*"\nhandler = "ret"\n',
                          RET_HANDLER),
    "function_graph": ('[[function_graph]]\nsymbol_name = "*"\n', None),
}


def _memcached() -> Path:
    """Debian's memcached: the installed one, else the package's, fetched once."""
    found = shutil.which("memcached")
    if found:
        return Path(found)
    root = CACHE / "memcached"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "memcached.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "done").is_file():
            if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
                pytest.skip("memcached is not installed, and apt-get and dpkg-deb are needed to fetch it")
            shutil.rmtree(root, ignore_errors=True)
            (root / "debs").mkdir(parents=True)
            r = subprocess.run(["apt-get", "download", "-q", "memcached"], cwd=root / "debs", capture_output=True,
                               text=True, timeout=600)
            if r.returncode != 0:
                pytest.skip(f"apt-get download memcached failed: {' '.join(r.stderr.split())[-200:]}")
            for deb in (root / "debs").glob("*.deb"):
                subprocess.run(["dpkg-deb", "-x", str(deb), str(root / "tree")], check=True)
            (root / "done").write_text("")
    return root / "tree" / "usr" / "bin" / "memcached"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(tmp folder, memcached, the load generator)."""
    tmp = tmp_path_factory.mktemp("server")
    mc = _memcached()
    r = subprocess.run([str(mc), "-V"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"{mc} does not run here (its libraries: libevent-2.1-7, libsasl2-2): {r.stderr.strip()}")
    prog = tmp / "memcached"
    shutil.copy(mc, prog)
    load = cc(tmp, "load", LOAD.read_text(), "-O2", "-pthread")
    return tmp, prog, load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stats(port: int) -> dict[str, int]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"stats\r\n")
        data = b""
        while not data.endswith(b"END\r\n"):
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
    out = {}
    for line in data.decode().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "STAT" and parts[2].isdigit():
            out[parts[1]] = int(parts[2])
    return out


def serve(binary: Path, load: Path, clients: int, rounds: int, gets: int, env: dict | None = None) -> dict:
    """Runs the server, the load against it, reads its stats, stops it with SIGTERM:
    {"seconds" (the load's wall time), "cpu" (the server's user + sys), "stats", "status",
    "stderr"}.  Every reply is checked by the load generator."""
    port = _free_port()
    args = [str(binary), "-l", "127.0.0.1", "-p", str(port), "-U", "0", "-t", str(THREADS), "-m", "64", "-c", "1024"]
    if os.geteuid() == 0:
        args += ["-u", "root"]          # memcached refuses root without it
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert p.poll() is None, p.communicate()
                assert time.monotonic() < deadline, "the server never listened"
                time.sleep(0.05)
        r = subprocess.run([str(load), str(port), str(clients), str(rounds), str(gets)], capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, (r.stdout, r.stderr)
        ok, sets, got, seconds = r.stdout.split()
        assert (ok, int(sets), int(got)) == ("ok", clients * rounds, clients * rounds * gets), r.stdout
        stats = _stats(port)
        cpu = _cpu_seconds(p.pid)
        p.send_signal(signal.SIGTERM)
        _, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return {"seconds": float(seconds), "cpu": cpu, "stats": stats, "status": p.returncode, "stderr": stderr}


def _cpu_seconds(pid: int) -> float:
    """The process's user + system time so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _func(event: str) -> str:
    """p_sub_a790_0, r_sub_a790_0 -> sub_a790."""
    return event[2:].rsplit("_", 1)[0]


def _counts(path: Path, prefix: str = "p_") -> dict[str, tuple[int, int]]:
    """The profile file's rows of one kind (p_: kprobes, r_: kretprobes) by function:
    (hits, nmissed)."""
    return {_func(e): v for e, v in profile(path.read_text()).items() if e.startswith(prefix)}


@pytest.fixture(scope="module")
def once_a_request(server):
    """The functions called once a `get` and once a `set`: counted alike by two small runs of
    the kprobe rewrite, one with 3 gets a set, one with 1."""
    tmp, prog, load = server
    d = tmp / "calibrate"
    d.mkdir()
    kp = instrument(prog, write_spec(d, SPECS["kprobe"][0]), d / "memcached.kp")
    runs = []
    for rounds, gets in ((60, 3), (45, 1)):
        prof = d / f"prof.{gets}"
        r = serve(kp, load, 1, rounds, gets, {"KPREWRITE_PROFILE": str(prof)})
        assert r["status"] == 0, r["stderr"]
        assert (r["stats"]["cmd_set"], r["stats"]["cmd_get"]) == (rounds, rounds * gets)
        runs.append({f: hits for f, (hits, _) in _counts(prof).items()})
    per_get = sorted(f for f in runs[0] if runs[0][f] == 180 and runs[1].get(f) == 45)
    per_set = sorted(f for f in runs[0] if runs[0][f] == 60 and runs[1].get(f) == 45)
    assert per_get and per_set, runs
    return per_get, per_set


# --- the binary trace: every entry with its return ------------------------------------------------

def trace_calls(path: Path) -> dict[int, list[tuple[str, bool]]]:
    """Each thread's records, (function, is a return), in the order written (the chunks'
    records, a thread's chunks ordered by time): read from the file's layout
    (rewriter/trace/binary.py) without formatting a line."""
    from rewriter.trace import binary as tb
    data = path.read_bytes()
    assert tb.is_binary(data), path
    _, _, chunk, _, _ = struct.unpack_from("<IIIII", data, 8)
    images, pending = {}, []
    i, n = 1, len(data) // chunk
    while i < n:
        kind, image, length = struct.unpack_from("<IIQ", data, i * chunk)
        if kind == tb.KIND_IMAGE:
            images[i] = tb.Image(data, i * chunk + 16, length, str(path))
            i += max(1, (16 + length + chunk - 1) // chunk)
            continue
        if kind == tb.KIND_RECORDS:
            pending.append((i, image))
        i += 1
    per_thread = defaultdict(list)          # tid -> [(ns, seq, function, is_return)]
    seq = 0
    for i, image in pending:
        img = images[image]
        names = [(_func(e.name.decode()), e.is_return, bool(e.args)) for e in img.events]
        words = memoryview(data)[i * chunk + 16:(i + 1) * chunk].cast("Q")
        k, end, tid = 0, len(words), None
        while k < end:
            w = words[k]
            if not w:
                break
            ident = w & 0xFFFF
            if ident == tb.CTX:
                tid = words[k + 1] & 0xFFFFFFFF
                k += 5
                continue
            func, is_ret, has_args = names[ident - 1]
            assert not has_args
            k += 2 if is_ret else 1
            per_thread[tid].append((w >> 16, seq, func, is_ret))
            seq += 1
    return {tid: [(f, r) for _, _, f, r in sorted(recs)] for tid, recs in per_thread.items()}


def unreturned(calls: list[tuple[str, bool]]) -> list[str]:
    """The entries left without a return (outermost first); a return that is not the
    innermost open entry's fails."""
    stack = []
    for func, is_ret in calls:
        if is_ret:
            assert stack and stack[-1] == func, (func, stack[-8:])
            stack.pop()
        else:
            stack.append(func)
    return stack


# --- the test --------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(SPECS))
def test_server_under_load(server, once_a_request, variant, record_property):
    tmp, prog, load = server
    per_get, per_set = once_a_request
    d = tmp / variant
    d.mkdir()
    text, handlers = SPECS[variant]
    out = instrument(prog, write_spec(d, text, handlers), d / "memcached.kp")
    base = serve(prog, load, CLIENTS, ROUNDS, GETS)
    assert base["status"] == 0, base["stderr"]
    env = {"KPREWRITE_PROFILE": str(d / "profile")}
    if variant == "function_graph":
        env.update(KPREWRITE_TRACE=str(d / "trace"), KPREWRITE_TRACE_FORMAT="binary")
    got = serve(out, load, CLIENTS, ROUNDS, GETS, env)
    assert got["status"] == 0 and "kprewrite" not in got["stderr"], got["stderr"]
    sets, gets = got["stats"]["cmd_set"], got["stats"]["cmd_get"]
    assert (sets, gets, got["stats"]["get_hits"]) == (CLIENTS * ROUNDS, CLIENTS * ROUNDS * GETS,
                                                      CLIENTS * ROUNDS * GETS)
    kinds = {"kprobe": ["p_"], "function_graph": ["p_", "r_"]}.get(variant, ["r_"])
    for kind in kinds:
        counts = _counts(d / "profile", kind)
        assert counts and sum(m for _, m in counts.values()) == 0, {f: c for f, c in counts.items() if c[1]}
        for funcs, want in ((per_get, gets), (per_set, sets)):
            assert {f: counts[f][0] for f in funcs} == {f: want for f in funcs}, kind
    counts = _counts(d / "profile", kinds[0])
    if variant == "function_graph":
        threads = trace_calls(d / "trace")
        entries, returns = Counter(), Counter()
        left = {}
        for tid, calls in threads.items():
            for func, is_ret in calls:
                (returns if is_ret else entries)[func] += 1
            left[tid] = unreturned(calls)
        # Still running at exit: the threads' outermost frames only (main's, the workers' loops).
        assert all(len(s) <= 4 for s in left.values()), left
        for funcs, want in ((per_get, gets), (per_set, sets)):
            assert {f: (entries[f], returns[f]) for f in funcs} == {f: (want, want) for f in funcs}
            assert not any(f in s for s in left.values() for f in funcs)
        # Every hit has its record (a kretprobe's hits are its entries).
        assert sum(entries.values()) == sum(c for c, _ in counts.values())
        assert sum(returns.values()) == sum(entries.values()) - sum(len(s) for s in left.values())
    ratio = base["seconds"] / got["seconds"]
    record_property("throughput_ratio", round(ratio, 3))
    record_property("server_cpu_ratio", round(got["cpu"] / max(base["cpu"], 0.01), 3))
    print(f"\n{variant}: {CLIENTS * ROUNDS * (1 + GETS)} requests, original {base['seconds']:.2f} s "
          f"(server {base['cpu']:.2f} s CPU), rewritten {got['seconds']:.2f} s ({got['cpu']:.2f} s): throughput "
          f"{ratio:.3f}x the original's; {len(per_get)} functions once a get, {len(per_set)} once a set, "
          f"{sum(c for c, _ in counts.values())} hits")

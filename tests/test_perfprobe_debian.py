"""Probes by source line and local name in a Debian library no one here compiled,
its DWARF in the separate debug file of Debian's debug package: the
values the rewritten library traces are gdb's at the same addresses.

- libsqlite3 (libsqlite3-0, run by the sqlite3 shell) with libsqlite3-0-dbgsym.
  -dbgsym packages are in Debian's debug archive (the `bookworm-debug` suite),
  which apt reaches only where it is in apt's sources; elsewhere the case skips,
  saying so.
- libc (libc6, run by a small C program calling qsort) with libc6-dbg, which is in
  the main archive: the same build-id tree (usr/lib/debug/.build-id/xx/yyyy.debug).

The debug package of the installed version is fetched with `apt-get download`
and extracted with `dpkg-deb -x` into a cache ($KPREWRITE_DBGSYM_CACHE, else
~/.cache/kprewrite/dbgsym), once; kprewrite finds the debug file there through
KPREWRITE_DEBUG_FILE_DIRECTORY, gdb through `set debug-file-directory`.

The probe lines are chosen from the debug information (the library is built by
Debian, its line numbers are not ours to fix): lines of the function where at
least one local integer has a value at every address of the line (a location
list's entry there, a constant or a static: not a stack slot that may not be set
yet, whose garbage differs between two runs).  Pointers are
left out: the rewritten library is a bigger file, so the addresses the program
maps after it differ from the run under gdb.  Each probe reads its line's
available integers by name (`FUNC:RLN a b c`), and every hit is compared with
gdb's `print` at a breakpoint on the same address.  Slow (pyelftools reads the
whole DWARF of the library three times, and the library is rewritten)."""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import conftest
from conftest import cc, instrument, run, write_spec
from rewriter.trace import formats as tracefmt

ARCHES = ["x86_64"]      # x86-64 only: Debian's x86-64 libraries and their debug packages
pytestmark = pytest.mark.slow

CACHE = Path(os.environ.get("KPREWRITE_DBGSYM_CACHE", Path.home() / ".cache" / "kprewrite" / "dbgsym"))

QSORT = r"""
#include <stdio.h>
#include <stdlib.h>
static int cmp(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }
int main(void)
{
    int small[7] = { 5, -3, 9, 1, 1, 8, 0 };
    static int big[3000];
    for (int i = 0; i < 3000; i++)
        big[i] = (i * 7919) % 3001;
    qsort(small, 7, sizeof small[0], cmp);
    qsort(big, 3000, sizeof big[0], cmp);
    printf("%d %d %d %d\n", small[0], small[6], big[0], big[2999]);
    return 0;
}
"""

SQL = ("CREATE TABLE t(a INTEGER, b TEXT); INSERT INTO t VALUES (1, 'one'), (22, 'two'), (333, 'three'); "
       "SELECT a * 2, upper(b) FROM t WHERE a > 5 ORDER BY a DESC;")

CASES = {
    # package, its debug package, the library, the function probed, the program's expected output
    "libsqlite3": ("libsqlite3-0", "libsqlite3-0-dbgsym", "/usr/lib/x86_64-linux-gnu/libsqlite3.so.0",
                   "sqlite3RunParser", "666|THREE\n44|TWO\n"),
    "libc": ("libc6", "libc6-dbg", "/lib/x86_64-linux-gnu/libc.so.6", "__qsort_r", "-3 9 0 3000\n"),
}


def _version(package: str) -> str:
    r = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", package], capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout:
        pytest.skip(f"{package} is not installed")
    return r.stdout


def debug_dir(package: str, debug_package: str) -> Path:
    """The usr/lib/debug folder of debug_package (the installed package's version),
    extracted into CACHE once; a lock keeps pytest-xdist's workers apart."""
    version = _version(package)
    root = CACHE / f"{debug_package}_{version}"
    done = root / "done"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{debug_package}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
                pytest.skip("apt-get and dpkg-deb are needed to fetch Debian's debug packages")
            shutil.rmtree(root, ignore_errors=True)
            debs = root / "debs"
            debs.mkdir(parents=True)
            r = subprocess.run(["apt-get", "download", "-q", f"{debug_package}={version}"], cwd=debs,
                               capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                where = ("Debian's debug archive (the bookworm-debug suite) is not in apt's sources here, "
                         "or not reachable" if debug_package.endswith("-dbgsym") else "apt-get download failed")
                pytest.skip(f"{debug_package} {version} cannot be fetched ({where}): "
                            f"{' '.join(r.stderr.split())[-200:]}")
            for deb in debs.glob("*.deb"):
                subprocess.run(["dpkg-deb", "-x", str(deb), str(root / "tree")], check=True)
            done.write_text(version)
    return root / "tree" / "usr" / "lib" / "debug"


def _build_id(path: str) -> str:
    from elftools.elf.elffile import ELFFile
    with open(path, "rb") as f:
        notes = ELFFile(f).get_section_by_name(".note.gnu.build-id")
        return next(n["n_desc"] for n in notes.iter_notes() if n["n_type"] == "NT_GNU_BUILD_ID")


def _text_addr(path: str) -> int:
    from elftools.elf.elffile import ELFFile
    with open(path, "rb") as f:
        return ELFFile(f).get_section_by_name(".text")["sh_addr"]


def choose_probes(lib: str, function: str, most: int = 6) -> list[tuple[str, list[int], list[str]]]:
    """Probe definitions `e<N>=FUNC:RLN v...` for lines of `function` where at least one
    local (not only parameters) that is an integer can be read at every address of the
    line: (definition, its addresses, the variables), at most `most`, in line order, no
    two at the same addresses (the declarations at the top of an -O2 function share its
    entry).  The lines with the most locals that are not constants (in registers or
    memory: values the code computed) are taken."""
    from rewriter import targets
    from rewriter.arch import get_arch
    from rewriter.probes.perfprobe import compile as C
    from rewriter.probes.perfprobe import debug_info
    from rewriter.probes.perfprobe import dwarf as D
    from rewriter.probes.perfprobe.syntax import parse
    image = targets.load(lib)
    dbg = debug_info(image, get_arch(image.machine))
    assert dbg.source.startswith(os.environ["KPREWRITE_DEBUG_FILE_DIRECTORY"]), dbg.source
    insts = dbg.instances(function)
    assert insts, f"{function} is not in the debug information of {lib}"
    rels = sorted({r.line - i.decl_line for i in insts for r in dbg.lines(i.cu)
                   if r.file == i.decl_file and i.contains(r.addr) and r.line > i.decl_line})
    found, seen = [], set()
    for rel in rels:
        try:
            sites = C.sites(dbg, image, parse(f"{function}:{rel} x").point)
        except C.ProbeError:
            continue
        if tuple(s.addr for s in sites) in seen:
            continue
        common, computed = None, set()
        for site in sites:
            ok = set()
            for v in dbg.scope(site.inst, site.addr):
                s = D.strip(v.type)
                if s is None or s.tag not in ("DW_TAG_base_type", "DW_TAG_enumeration_type") \
                        or not C._scalar(v.type):
                    continue
                try:
                    C.compile_var(dbg, image, site, parse(f"{function} {v.name}").args[0], v)
                except C.ProbeError:
                    continue
                if not v.param and not _set(dbg, v, site):
                    continue
                ok.add((v.name, v.param))
                if not v.param and dbg.location(v.die, site.inst, site.addr).kind != "imm":
                    computed.add(v.name)
            common = ok if common is None else common & ok
        if common and any(not param for _, param in common):
            seen.add(tuple(s.addr for s in sites))
            names = sorted(n for n, _ in common)
            score = len(computed & set(names))
            found.append((-score, rel, [s.addr for s in sites], names))
    chosen = sorted(sorted(found)[:most], key=lambda f: f[1])
    return [(f"e{i}={function}:{rel} " + " ".join(names), addrs, names)
            for i, (_, rel, addrs, names) in enumerate(chosen)]


def _set(dbg, v, site) -> bool:
    """Whether a local has a value at the site, not only a place: a location list's entry
    (in optimized code, gcc's var-tracking starts one where the variable is assigned), a
    constant or a static variable.  A single location for the whole scope (a stack slot
    of a variable whose address is taken) holds garbage until the code sets it, and that
    garbage differs between the run under gdb and ours."""
    a = v.die.attributes.get("DW_AT_location")
    if a is None or a.form in ("DW_FORM_sec_offset", "DW_FORM_loclistx", "DW_FORM_data4", "DW_FORM_data8"):
        return True
    loc = dbg.location(v.die, site.inst, site.addr)
    return loc.kind == "imm" or (loc.kind == "mem" and loc.base is None)


GDB_SCRIPT = r"""
import gdb
gdb.execute("set pagination off")
gdb.execute("set confirm off")
gdb.execute("set debug-file-directory {debug_dir}")
gdb.execute("set stop-on-solib-events 1")
gdb.execute("run")
base = None
while base is None:
    for line in gdb.execute("info sharedlibrary", to_string=True).splitlines():
        f = line.split()
        if f and f[0].startswith("0x") and f[-1].endswith("/{soname}"):
            base = int(f[0], 16) - {text:#x}
    if base is None:
        gdb.execute("continue")
gdb.execute("set stop-on-solib-events 0")


class Probe(gdb.Breakpoint):
    def __init__(self, index, addr, names):
        super().__init__("*%#x" % (base + addr), internal=True)
        self.index, self.names = index, names

    def stop(self):
        vals = []
        for n in self.names:
            try:
                vals.append("%s=%d" % (n, int(gdb.parse_and_eval(n))))
            except gdb.error as e:
                vals.append("%s=<%s>" % (n, e))
        print("HIT %d %s" % (self.index, " ".join(vals)))
        return False


for i, (addr, names) in enumerate({probes!r}):
    Probe(i, addr, names)
gdb.execute("continue")
"""


def gdb_hits(cmd: list[str], lib: str, dbgdir: Path, probes: list[tuple[int, list[str]]], tmp: Path):
    """gdb's values at each address of `probes` ((address in the library, names)), in hit order:
    (probe index, {name: value or '<why not>'})."""
    script = tmp / "probes.py"
    script.write_text(GDB_SCRIPT.format(debug_dir=dbgdir, soname=os.path.basename(lib), text=_text_addr(lib),
                                        probes=probes))
    r = subprocess.run(["gdb", "-nx", "-batch", "-x", str(script), "--args", *cmd], capture_output=True,
                       text=True, timeout=600)
    hits = []
    for line in r.stdout.splitlines():
        m = re.fullmatch(r"HIT (\d+) ?(.*)", line)
        if m:
            hits.append((int(m.group(1)), dict(kv.split("=", 1) for kv in m.group(2).split())))
    assert hits, r.stdout[-2000:] + r.stderr[-2000:]
    return hits


@pytest.mark.parametrize("case", list(CASES))
def test_dbgsym_values_match_gdb(case, tmp_path, monkeypatch):
    package, debug_package, lib, function, expect = CASES[case]
    if not shutil.which("gdb"):
        pytest.skip("gdb not installed")
    if not os.path.exists(lib):
        pytest.skip(f"{lib} ({package}) is not installed")
    dbgdir = debug_dir(package, debug_package)
    bid = _build_id(lib)
    debug_file = dbgdir / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    assert debug_file.is_file(), f"{debug_package} has no {debug_file.relative_to(dbgdir)} for {lib}: " \
                                 f"is it the installed {package}'s version?"
    # for choose_probes and the CLI: only there (not /usr/lib/debug, where libc6-dbg may be installed)
    monkeypatch.setenv("KPREWRITE_DEBUG_FILE_DIRECTORY", str(dbgdir))
    monkeypatch.setitem(conftest.TREE_ENV, "KPREWRITE_DEBUG_FILE_DIRECTORY", str(dbgdir))
    probes = choose_probes(lib, function)
    assert probes, f"no line of {function} has a local integer that can be read"
    spec = write_spec(tmp_path, "probes = [\n" + "".join(f'  "{d}",\n' for d, _, _ in probes) + "]\n")
    libdir = tmp_path / "lib"
    libdir.mkdir()
    instrument(Path(lib), spec, libdir / os.path.basename(lib))
    if case == "libc":
        cmd = [str(cc(tmp_path, "qsort", QSORT, "-O2"))]
    else:
        if not shutil.which("sqlite3"):
            pytest.skip("the sqlite3 shell is not installed")
        cmd = [shutil.which("sqlite3"), ":memory:", SQL]
    # the events of a definition with several addresses are e<N>, e<N>_1, ...: in address order
    addrs = [(f"e{i}" + (f"_{j}" if j else ""), a, names)
             for i, (_, sites, names) in enumerate(probes) for j, a in enumerate(sites)]
    oracle = gdb_hits(cmd, lib, dbgdir, [(a, names) for _, a, names in addrs], tmp_path)
    r = run(cmd[0], *cmd[1:], libdir=libdir)
    assert r.returncode == 0 and r.stdout == expect, (r.stdout, r.stderr[-2000:])
    recs = [x for x in map(tracefmt.parse_line, r.stderr.splitlines()) if x is not None]
    events = [e for e, _, _ in addrs]
    ours = [(events.index(x.event), x.args) for x in recs]
    assert [i for i, _ in ours] == [i for i, _ in oracle], (ours[:20], oracle[:20])
    assert any(len(args) for _, args in ours), ours[:20]
    for (i, args), (_, want) in zip(ours, oracle):
        assert set(args) == set(want), (events[i], args, want)
        for name, v in args.items():
            assert not want[name].startswith("<"), (events[i], name, want[name])
            # modulo 2**64: a value gdb prints negative may be traced as unsigned (xN)
            mine = int(v, 0) if isinstance(v, str) else v
            assert mine % (1 << 64) == int(want[name]) % (1 << 64), (events[i], name, args, want)
    print(f"{case}: {len(ours)} hits of {len(probes)} lines of {function} equal to gdb's: "
          + "; ".join(d for d, _, _ in probes))


"""Probes by function, source line and variable name (perf probe's syntax, the
spec's `probes`): the values the probes trace are compared with gdb's at the same
address, in a program compiled at -O0 and at -O2, natively and under QEMU; the
addresses and fetch args with `perf probe -D`'s where perf is installed."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from conftest import cc, kprewrite, run, write_spec
from rewriter.trace import formats as tracefmt

ARCHES = ["x86_64"]      # x86-64 only: gdb's values natively and under qemu-x86_64; AArch64's: test_aarch64_perfprobe.py

PROGRAM = r"""
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
struct point { int x; long y; char name[8]; };
struct rec { struct point *pt; int vals[4]; const char *label; };
long counter = 40;
__attribute__((noinline)) void sink(long x) { __asm__ volatile("" :: "r"(x) : "memory"); }
__attribute__((noinline)) int parse_line(const char *buf, int len, struct rec *r)
{
    int sum = 0;
    for (int i = 0; i < len; i++) {
        sum += buf[i] * (i + 1);
        sink(sum);
    }
    r->vals[1] = sum;
    counter += sum;
    return sum + r->pt->x;
}
__attribute__((noinline)) long clobbered(long n)
{
    sink(n * 2);
    sink(7);
    return 5;
}
static inline int scale(int v, int k)
{
    int w = v * k;
    sink(w);
    return w + v;
}
__attribute__((noinline)) int twice(int a, int b) { return scale(a, 3) + scale(b, 5); }
int main(int argc, char **argv)
{
    struct point p = { 7, 99, "pt" };
    struct rec r = { &p, {1, 2, 3, 4}, "label" };
    const char *s = argc > 1 ? argv[1] : "hello";
    int v = parse_line(s, (int)strlen(s), &r);
    clobbered(argc > 2 ? atol(argv[2]) : 21);
    sink(twice(argc + 2, v));
    printf("%d %ld\n", v, counter);
    return 0;
}
"""

# Each probe: its definition, and per argument (name, gdb expression, 'd' number or 's' string).
PROBES = {
    "entry": ("e_entry=parse_line b=buf:string len=len n=r->pt->x v1=r->vals[1] lab=r->label:string "
              "nm=r->pt->name",
              [("b", "buf", "s"), ("len", "len", "d"), ("n", "r->pt->x", "d"), ("v1", "r->vals[1]", "d"),
               ("lab", "r->label", "s"), ("nm", "r->pt->name", "s")]),
    "loop": ("e_loop=parse_line:4 sum=sum b=buf:string", [("sum", "sum", "d"), ("b", "buf", "s")]),
    "after": ("e_after=parse_line:7 sum=sum c=counter v1=r->vals[1]",
              [("sum", "sum", "d"), ("c", "counter", "d"), ("v1", "r->vals[1]", "d")]),
    # inlined at -O2 (probed in twice, at each inlined copy whose line 3 has code), a function at -O0
    # (its `v` is optimized out there with -fno-omit-frame-pointer: gdb says so too)
    "inl": ("e_inl=scale:3 k=k w=w", [("k", "k", "d"), ("w", "w", "d")]),
}


def gdb_values(binary, where: list[str], exprs: list[list[tuple[str, str, str]]], *args) -> list[tuple[int, dict]]:
    """gdb's values at breakpoints `where` (FUNC+0xOFF), in hit order: (breakpoint index, {name: text})."""
    script = ["set pagination off", "set confirm off"]
    for i, (w, ex) in enumerate(zip(where, exprs)):
        script += [f"break *{w}", "commands", "silent", f'printf "HIT {i}\\n"']
        for name, e, kind in ex:
            script.append(f'printf "V {name}=%s\\n", {e}' if kind == "s" else f'printf "V {name}=%ld\\n", (long)({e})')
        script += ["continue", "end"]
    script.append("run " + " ".join(map(str, args)))
    return gdb_hits(binary, script)


def gdb_hits(binary, script: list[str]) -> list[tuple[int, dict]]:
    """Runs binary under `gdb -batch` with script, whose breakpoints print `HIT i` and then
    `V name=value` lines: (i, {name: value}) in hit order."""
    path = binary.with_suffix(".gdb")
    path.write_text("\n".join(script) + "\n")
    r = subprocess.run(["gdb", "-nx", "-batch", "-x", str(path), str(binary)], capture_output=True, text=True,
                       timeout=120)
    hits: list[tuple[int, dict]] = []
    for line in r.stdout.splitlines():
        if line.startswith("HIT "):
            hits.append((int(line[4:]), {}))
        elif line.startswith("V ") and hits:
            k, _, v = line[2:].partition("=")
            hits[-1][1][k] = v
    assert hits, r.stdout + r.stderr
    return hits


def _ours(args: dict, kinds: dict) -> dict:
    """Trace values as gdb's printf writes them: numbers in decimal, strings as they are."""
    out = {}
    for k, v in args.items():
        if kinds[k] == "d":
            out[k] = str(int(v, 0) if isinstance(v, str) else v)
        else:
            out[k] = v
    return out


FLAGS = {"0": ["-O0"], "2": ["-O2"], "2fp": ["-O2", "-fno-omit-frame-pointer"]}


def _build(tmp, opt):
    prog = cc(tmp, f"prog{opt}", PROGRAM, *FLAGS[opt], "-g")
    spec = write_spec(tmp, "probes = [\n" + "".join(f'  "{d}",\n' for d, _ in PROBES.values())
                      + '  "clobbered%return rv=$retval",\n]\n')
    check = kprewrite("check", prog, "--spec", spec).stdout.splitlines()
    out = tmp / f"prog{opt}.kp"
    kprewrite("instrument", prog, "--spec", spec, "-o", out)
    return prog, out, check


@pytest.fixture(scope="module", params=list(FLAGS))
def built(request, tmp_path_factory):
    if not shutil.which("gdb"):
        pytest.skip("gdb not installed")
    return request.param, _build(tmp_path_factory.mktemp(f"perfprobe{request.param}"), request.param)


def _compiled(check: list[str]) -> dict[str, tuple[str, str]]:
    """event -> (location, fetch args) from check's `probes[N]: p:GRP/EVENT LOC ARGS` lines."""
    out = {}
    for line in check:
        m = re.match(r"probes\[\d+\]: ([pr]):\w+/(\w+) (\S+)(.*)", line)
        if m:
            out[m.group(2)] = (m.group(3), m.group(4).strip())
    return out


def _key(event: str) -> str:
    """The PROBES key of an event: e_KEY, or e_KEY_N for a definition's later addresses."""
    return re.fullmatch(r"e_([a-z]+)(_\d+)?", event).group(1)


def test_values_match_gdb(built, runner):
    opt, (prog, out, check) = built
    compiled = _compiled(check)
    assert {"e_entry", "e_loop", "e_after", "e_inl", "clobbered__return"} <= set(compiled), check
    events = sorted(e for e in compiled if e.startswith("e_"))
    where = [compiled[e][0] for e in events]
    oracle = gdb_values(prog, where, [PROBES[_key(e)][1] for e in events], "abcd")
    r = run(out, "abcd", runner=runner)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{sum(ord(c) * (i + 1) for i, c in enumerate('abcd')) + 7} " \
                       f"{40 + sum(ord(c) * (i + 1) for i, c in enumerate('abcd'))}\n"
    recs = [x for x in map(tracefmt.parse_line, r.stderr.splitlines()) if x is not None]
    ours = [(events.index(x.event), x.args) for x in recs if x.event.startswith("e_")]
    assert [i for i, _ in ours] == [i for i, _ in oracle], (ours, oracle)
    assert len([i for i, _ in ours if events[i] == "e_loop"]) == 4            # once per iteration
    assert any(_key(events[i]) == "inl" for i, _ in ours)
    for (i, args), (_, want) in zip(ours, oracle):
        kinds = {k: kind for k, _, kind in PROBES[_key(events[i])][1]}
        assert _ours(args, kinds) == want, (events[i], args, want)
    # %return: the value gdb's `finish` reports.
    ret = [x for x in recs if x.event == "clobbered__return"]
    assert len(ret) == 1 and ret[0].args["rv"] == 5
    # -O2 inlines scale() into twice(): the probe is at the inlined copy
    assert compiled["e_inl"][0].startswith("scale" if opt == "0" else "twice+"), compiled["e_inl"]


def test_locations(built):
    """-O0: locals and parameters in the frame; -O2: in registers."""
    opt, (prog, out, check) = built
    args = _compiled(check)["e_loop"][1]
    if opt == "0":
        assert re.search(r"sum=-\d+\(%bp\):s32", args) and re.search(r"b=\+0\(-\d+\(%bp\)\):string", args)
    else:
        assert re.search(r"sum=%\w+:s32", args), args


def test_clobbered_parameter(built, tmp_path):
    """A parameter whose register was reused: 'not available', never a stale value."""
    opt, (prog, out, check) = built
    spec = write_spec(tmp_path, 'probes = ["clobbered:3 n"]\n')
    r = kprewrite("check", prog, "--spec", spec, check=False)
    if opt == "0":
        assert r.returncode == 0 and re.search(r"n=-\d+\(%bp\):s64", r.stdout)
        return
    assert r.returncode == 1
    m = re.fullmatch(r"kprewrite: probes\.toml: probes\[1\]: 'n' is not available at (clobbered\+0x[0-9a-f]+) "
                     r"\(optimized out: .*\)\n", r.stderr)
    assert m, r.stderr
    # gdb agrees: at that address n is optimized out (or only its entry value is known).
    g = subprocess.run(["gdb", "-nx", "-batch", "-ex", f"break *{m.group(1)}", "-ex", "run", "-ex", "print n", str(prog)],
                       capture_output=True, text=True, timeout=120)
    assert "<optimized out>" in g.stdout or "@entry" in g.stdout, g.stdout


def test_retval_matches_gdb_finish(built):
    opt, (prog, out, check) = built
    g = subprocess.run(["gdb", "-nx", "-batch", "-ex", "break clobbered", "-ex", "run", "-ex", "finish", str(prog)],
                       capture_output=True, text=True, timeout=120)
    m = re.search(r"Value returned is \$\d+ = (-?\d+)", g.stdout)
    assert m and int(m.group(1)) == 5, g.stdout
    assert _compiled(check)["clobbered__return"][1] == "rv=$retval:s64"


PERF_SPECS = ["parse_line buf len", "parse_line%return $retval", "clobbered"]


@pytest.mark.parametrize("built", ["0", "2"], indirect=True)   # the same code at -O2 with a frame pointer
def test_perf_agrees(built, tmp_path):
    """perf probe -D: the same addresses (and, at -O0, the same fetch args)."""
    opt, (prog, out, check) = built
    perf = shutil.which("perf")
    if not perf or subprocess.run([perf, "probe", "-x", str(prog), "-D", "clobbered"], capture_output=True).returncode:
        pytest.skip("perf probe -D does not work here")
    from rewriter import targets
    image = targets.load(str(prog))
    for spec in PERF_SPECS:
        r = subprocess.run([perf, "probe", "-x", str(prog), "-D", spec], capture_output=True, text=True)
        theirs = [l for l in r.stdout.splitlines() if l[:2] in ("p:", "r:")]
        (tmp_path / "probes.toml").write_text(f'probes = ["{spec}"]\n')
        mine = [l.split(": ", 1)[1] for l in kprewrite("check", prog, "--spec", tmp_path / "probes.toml").stdout.splitlines()
                if l.startswith("probes[")]
        assert len(theirs) == len(mine), (theirs, mine)
        for t, m in zip(theirs, mine):
            taddr = int(t.split()[1].rsplit(":", 1)[1], 16)
            loc = m.split()[1]
            fn, _, off = loc.partition("+")
            assert taddr == image.symbols[fn][0] + (int(off, 16) if off else 0), (t, m)
            if opt == "0" and "%return" not in spec:
                # perf leaves arguments unnamed only for $retval; with names the fetch args are equal
                assert t.split()[2:] == m.split()[2:], (t, m)


@pytest.mark.parametrize("built", ["0", "2"], indirect=True)   # the same code at -O2 with a frame pointer
def test_listing(built):
    opt, (prog, out, check) = built
    lines = kprewrite("probe-lines", prog, "parse_line").stdout.splitlines()
    assert re.fullmatch(rf"<parse_line@/.*/prog{opt}\.c:0>", lines[0]), lines[0]
    assert any(re.fullmatch(r"\s+4\s+sum \+= buf\[i\] \* \(i \+ 1\);", l) for l in lines), lines
    v = kprewrite("probe-vars", prog, "parse_line:4").stdout.splitlines()
    assert v[0].startswith("@<parse_line+0x")
    assert any(re.fullmatch(r"\tlocal\tint\tsum\t\S+:s32", l) for l in v), v
    assert any(re.fullmatch(r"\tparam\tconst char\*\tbuf\t\S+:x64", l) for l in v), v


ERRORS = [
    ("parse_line:4 nosuch", "no variable 'nosuch' at parse_line+0x"),
    ("parse_line r->nope", "struct rec has no member 'nope'"),
    ("parse_line r.pt", "r is a pointer; use '->pt'"),
    ("parse_line%return buf", "column 19: 'buf' at %return: only $retval"),
    ("nowhere", "function 'nowhere' not found in the debug information"),
    ("parse_line:400", "line 400 of 'parse_line'"),
    ("parse_line r->vals[9]", "index 9 is past the end"),
    ("parse_line;nomatch*", "no line of 'parse_line' with code matches ';nomatch*'"),
]


@pytest.mark.parametrize("built", ["0", "2"], indirect=True)   # the same code at -O2 with a frame pointer
def test_errors(built, tmp_path):
    """Each bad definition: one line naming it (all of them reported at once), no traceback."""
    opt, (prog, out, check) = built
    spec = write_spec(tmp_path, "probes = [" + ", ".join(f'"{t}"' for t, _ in ERRORS) + "]\n")
    r = kprewrite("check", prog, "--spec", spec, check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(l.startswith("kprewrite: ") for l in r.stderr.splitlines()), r.stderr
    for i, (text, message) in enumerate(ERRORS, 1):
        assert any(l.startswith(f"kprewrite: probes.toml: probes[{i}]: ") and message in l
                   for l in r.stderr.splitlines()), (text, r.stderr)


def test_no_debug_info(tmp_path):
    prog = cc(tmp_path, "nodebug", "int main(void) { return 0; }\n", "-O2")
    r = kprewrite("check", prog, "--spec", write_spec(tmp_path, 'probes = ["main"]\n'), check=False)
    assert r.returncode == 1 and "has no DWARF debug information" in r.stderr, r.stderr


@pytest.mark.parametrize("built", ["0", "2"], indirect=True)   # the same code at -O2 with a frame pointer
def test_debug_info_elsewhere(built, tmp_path):
    """The DWARF compressed in the image (gcc -gz), or in a separate file named by
    .gnu_debuglink (objcopy --only-keep-debug): the same compiled lines."""
    opt, (prog, out, check) = built
    spec = write_spec(tmp_path, 'probes = ["e=parse_line:4 sum b=buf:string", "f=parse_line r->pt->x"]\n')

    def compiled(binary):
        return [l.split(" ", 1)[1].split(" ", 1)[1] for l in kprewrite("check", binary, "--spec", spec).stdout.splitlines()
                if l.startswith("probes[")]
    want = compiled(prog)
    assert len(want) == 2
    z = cc(tmp_path, "progz", PROGRAM, *FLAGS[opt], "-g", "-gz")
    assert want == compiled(z)
    dbg, stripped = tmp_path / "prog.debug", tmp_path / "stripped"
    subprocess.run(["objcopy", "--only-keep-debug", str(prog), str(dbg)], check=True)
    subprocess.run(["objcopy", "--strip-debug", f"--add-gnu-debuglink={dbg}", str(prog), str(stripped)], check=True)
    assert want == compiled(stripped)
    dbg.unlink()
    r = kprewrite("check", stripped, "--spec", spec, check=False)
    assert r.returncode == 1 and "no separate debug file was found" in r.stderr, r.stderr


@pytest.mark.parametrize("built", ["0", "2"], indirect=True)
def test_lazy_pattern(built, tmp_path):
    """FUNC;PTN and SRC;PTN: the lines whose source matches the glob, blanks ignored."""
    opt, (prog, out, check) = built
    spec = write_spec(tmp_path, 'probes = ["a=parse_line;sum+=* sum", "b=parse_line:4 sum", '
                                f'"c=prog{opt}.c;r->vals*=sum;", "d=parse_line:7"]\n')
    got = _compiled(kprewrite("check", prog, "--spec", spec).stdout.splitlines())
    assert got["a"] == got["b"] and got["c"][0] == got["d"][0], got
    # check --format json: the same lines, as `compiled` records
    doc = json.loads(kprewrite("check", prog, "--spec", spec, "--format", "json").stdout)
    assert sorted({c["table"] for c in doc["compiled"]}) == ["probes[1]", "probes[2]", "probes[3]", "probes[4]"]
    assert _compiled([f"{c['table']}: {c['event']}" for c in doc["compiled"]]) == got


@pytest.mark.parametrize("built", ["2"], indirect=True)
def test_build_id_debug_file(built, tmp_path, monkeypatch):
    """A stripped image whose DWARF is in DEBUG_ROOT/.build-id/xx/yyyy.debug (where Debian's
    -dbgsym packages put it): found by its build-id, the same locations as the image's own."""
    from elftools.elf.elffile import ELFFile
    from rewriter.probes.perfprobe import dwarf as D
    opt, (prog, out, check) = built
    with open(prog, "rb") as f:
        note = next(n for n in ELFFile(f).get_section_by_name(".note.gnu.build-id").iter_notes())
        bid = note["n_desc"]
    dbg = tmp_path / ".build-id" / bid[:2] / (bid[2:] + ".debug")
    dbg.parent.mkdir(parents=True)
    stripped = tmp_path / "stripped"
    subprocess.run(["objcopy", "--only-keep-debug", str(prog), str(dbg)], check=True)
    subprocess.run(["objcopy", "--strip-debug", str(prog), str(stripped)], check=True)
    from rewriter.probes.perfprobe import debugfile
    monkeypatch.setattr(debugfile, "DEBUG_ROOT", str(tmp_path))
    regs = {0: "ax", 1: "dx", 2: "cx", 3: "bx", 4: "si", 5: "di", 6: "bp", 7: "sp"}

    def locs(path):
        info = D.DebugInfo(str(path), path.read_bytes(), regs)
        inst = info.instances("parse_line")[0]
        return info.source, [(v.name, info.location(v.die, inst, inst.entry).value()) for v in info.scope(inst, inst.entry)
                             if v.param]
    src, mine = locs(stripped)
    assert src == str(dbg) and mine == locs(prog)[1] and [n for n, _ in mine] == ["buf", "len", "r"]
    dbg.unlink()
    with pytest.raises(D.NoDebugInfo):
        locs(stripped)


@pytest.mark.parametrize("built", ["2"], indirect=True)
def test_debug_file_directory(built, tmp_path):
    """KPREWRITE_DEBUG_FILE_DIRECTORY (gdb's debug-file-directory): a build-id tree in a folder
    of one's own, as `dpkg-deb -x` of a -dbgsym package leaves it, found through the CLI;
    without it, the error names the folders searched."""
    import os
    from conftest import KPREWRITE, TREE_ENV
    from elftools.elf.elffile import ELFFile
    opt, (prog, out, check) = built
    with open(prog, "rb") as f:
        bid = next(n for n in ELFFile(f).get_section_by_name(".note.gnu.build-id").iter_notes())["n_desc"]
    root = tmp_path / "usr" / "lib" / "debug"
    dbg = root / ".build-id" / bid[:2] / (bid[2:] + ".debug")
    dbg.parent.mkdir(parents=True)
    stripped = tmp_path / "stripped"
    subprocess.run(["objcopy", "--only-keep-debug", str(prog), str(dbg)], check=True)
    subprocess.run(["objcopy", "--strip-debug", str(prog), str(stripped)], check=True)
    spec = write_spec(tmp_path, 'probes = ["e=parse_line:4 sum b=buf:string"]\n')

    def check_with(dirs):
        env = {k: v for k, v in TREE_ENV.items() if k != "KPREWRITE_DEBUG_FILE_DIRECTORY"}
        if dirs is not None:
            env["KPREWRITE_DEBUG_FILE_DIRECTORY"] = dirs
        return subprocess.run([*KPREWRITE, "check", str(stripped), "--spec", str(spec)], capture_output=True,
                              text=True, env=env)
    def compiled(stdout):        # the location and fetch args (the group is named after the file)
        return [l.split(" ", 2)[2] for l in stdout.splitlines() if l.startswith("probes[")]
    want = compiled(kprewrite("check", prog, "--spec", spec).stdout)
    r = check_with(f"{tmp_path / 'nothing'}:{root}")
    assert r.returncode == 0 and compiled(r.stdout) == want and len(want) == 1, r.stderr
    r = check_with(None)
    assert r.returncode == 1 and "no separate debug file was found (build-id or .gnu_debuglink under " \
                                 "/usr/lib/debug)" in r.stderr, r.stderr
    r = check_with(str(tmp_path / "nothing"))
    assert r.returncode == 1 and f"under {tmp_path / 'nothing'})" in r.stderr and os.path.isfile(dbg), r.stderr
    # KPREWRITE_DEBUG_FILE naming a missing file or a folder: one line that says which
    for named, why in ((tmp_path / "nothing.debug", "no such file"), (root, "is a directory")):
        r = subprocess.run([*KPREWRITE, "check", str(stripped), "--spec", str(spec)], capture_output=True, text=True,
                           env={**TREE_ENV, "KPREWRITE_DEBUG_FILE": str(named)})
        assert r.returncode == 1 and r.stderr == f"kprewrite: probes.toml: probes[1]: KPREWRITE_DEBUG_FILE={named}: " \
            f"{why}\n", r.stderr

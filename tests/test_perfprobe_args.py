"""Probes by name on parameters that are not in the six argument registers
: parameters passed on the stack (the seventh on), a struct passed by
value in two registers (a composite DWARF location, DW_OP_piece), and a double in
%xmm0.  The values traced are gdb's at the same addresses, at -O0 and -O2,
natively and under QEMU; what fetch args cannot read is a one-line error naming
the variable, the address and the register.  Bitfields of a struct in registers, and
a struct copy gcc splits into DW_OP_bit_pieces, read as their bits (bW@S/C), equal
gdb's at -O0, -O1 and -O2."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from conftest import cc, kprewrite, run, write_spec
from test_perfprobe import gdb_hits
from rewriter.trace import formats as tracefmt

ARCHES = ["x86_64"]      # x86-64 only: x86-64's argument registers and stack (the seventh on), %xmm0

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
struct pair { long a; long b; };
struct mix { int x; int y; long z; };
__attribute__((noinline)) void sink(long x) { __asm__ volatile("" :: "r"(x) : "memory"); }
__attribute__((noinline)) long many(long a, long b, long c, long d, long e, long f, long g, int h, short i,
                                    signed char j)
{
    long t = a + b + c + d + e + f;
    sink(t);
    sink(g * h);
    return t + g + h + i + j;
}
__attribute__((noinline)) long split(struct pair p, struct mix m, int k)
{
    sink(p.a);
    sink(m.y);
    return p.a + p.b * k + m.x + m.y + m.z;
}
__attribute__((noinline)) double fp(double x, long n)
{
    sink(n);
    return x * n;
}
int main(int argc, char **argv)
{
    long base = argc > 1 ? atol(argv[1]) : 3;
    struct pair p = { base, base * 10 };
    struct mix m = { (int)base + 1, -(int)base - 2, base * 100 };
    long r = many(base, base + 1, base + 2, base + 3, base + 4, base + 5, -base - 6, -(int)base - 7,
                  (short)(-base - 8), (signed char)(-base - 9));
    r += split(p, m, (int)base * 2);
    printf("%ld %.2f\n", r, fp(base * 0.5, base));
    return 0;
}
"""

# event: (definition, [(argument, gdb expression)])
PROBES = {
    "stack": ("stack=many a g h i j", [("a", "a"), ("g", "g"), ("h", "h"), ("i", "i"), ("j", "j")]),
    "stackline": ("stackline=many:4 g h i j t", [("g", "g"), ("h", "h"), ("i", "i"), ("j", "j"), ("t", "t")]),
    "pieces": ("pieces=split pa=p.a pb=p.b mx=m.x my=m.y mz=m.z k",
               [("pa", "p.a"), ("pb", "p.b"), ("mx", "m.x"), ("my", "m.y"), ("mz", "m.z"), ("k", "k")]),
    "piecesline": ("piecesline=split:2 pa=p.a pb=p.b mx=m.x mz=m.z",
                   [("pa", "p.a"), ("pb", "p.b"), ("mx", "m.x"), ("mz", "m.z")]),
    "fpn": ("fpn=fp n", [("n", "n")]),
}
# -O0 only: the double is in the frame, and a cast reads its bits; without one it is read
# as its bits too (x64, perf's type for it)
BITS = ("bits=fp:2 xb=x:x64", [("xb", "*(long *)&x")])
FPX = ("fpx=fp:2 x", [("x", "*(long *)&x")])

FLAGS = {"0": ["-O0"], "2": ["-O2"], "2fp": ["-O2", "-fno-omit-frame-pointer"]}


def _probes(opt):
    return {**PROBES, **({"bits": BITS, "fpx": FPX} if opt == "0" else {})}


def _build(tmp, opt):
    prog = cc(tmp, f"args{opt}", PROGRAM, *FLAGS[opt], "-g")
    spec = write_spec(tmp, "probes = [\n" + "".join(f'  "{d}",\n' for d, _ in _probes(opt).values()) + "]\n")
    check = kprewrite("check", prog, "--spec", spec).stdout.splitlines()
    out = tmp / f"args{opt}.kp"
    kprewrite("instrument", prog, "--spec", spec, "-o", out)
    return prog, out, check


@pytest.fixture(scope="module", params=list(FLAGS))
def built(request, tmp_path_factory):
    if not shutil.which("gdb"):
        pytest.skip("gdb not installed")
    return request.param, _build(tmp_path_factory.mktemp(f"perfprobeargs{request.param}"), request.param)


def _compiled(check: list[str]) -> dict[str, tuple[str, dict[str, str]]]:
    """event -> (location, {argument: fetch arg}) from check's `probes[N]: p:GRP/EVENT LOC ARGS` lines."""
    out = {}
    for line in check:
        m = re.match(r"probes\[\d+\]: p:\w+/(\w+) (\S+)(.*)", line)
        if m:
            out[m.group(1)] = (m.group(2), dict(a.split("=", 1) for a in m.group(3).split()))
    return out


def gdb_values(binary, events: list[tuple[str, list[tuple[str, str]]]]) -> list[tuple[int, dict]]:
    """gdb's values at the events' locations (FUNC+0xOFF), in hit order: (event index, {name: value}).
    Events at one address share a breakpoint (gdb runs one breakpoint's commands per stop)
    and are printed in index order."""
    script = ["set pagination off", "set confirm off"]
    at: dict[str, list[int]] = {}
    for i, (where, _) in enumerate(events):
        at.setdefault(where, []).append(i)
    for where, idx in at.items():
        script += [f"break *{where}", "commands", "silent"]
        for i in idx:
            script.append(f'printf "HIT {i}\\n"')
            # no (long) cast: gdb 13 fails on a cast of a member of a struct in pieces
            # ("Should not be able to create a lazy value with an enclosing type")
            script += [f'printf "V {n}=%ld\\n", {e}' for n, e in events[i][1]]
        script += ["continue", "end"]
    script.append("run")
    return gdb_hits(binary, script)


def _bits(fetch: str) -> int:
    """The width of a fetch arg's type: sN/uN/xN, or bW@S/C."""
    t = fetch.rsplit(":", 1)[1]
    m = re.fullmatch(r"[sux](\d+)|b(\d+)@\d+/\d+", t)
    return int(m.group(1) or m.group(2))


def test_values_match_gdb(built, runner):
    opt, (prog, out, check) = built
    probes = _probes(opt)
    compiled = _compiled(check)
    assert set(compiled) == set(probes), check
    events = sorted(probes)
    oracle = gdb_values(prog, [(compiled[ev][0], probes[ev][1]) for ev in events])
    r = run(out, runner=runner)
    assert r.returncode == 0 and r.stdout == "473 4.50\n", \
        (r.stdout, r.stderr)
    recs = [x for x in map(tracefmt.parse_line, r.stderr.splitlines()) if x is not None]
    # the probes of one address in event order, as gdb's are
    ours, run_ = [], []
    for x in recs + [None]:
        if run_ and (x is None or x.loc != run_[-1].loc):
            ours += sorted((events.index(y.event), y.args) for y in run_)
            run_ = []
        if x is not None:
            run_.append(x)
    assert [i for i, _ in ours] == [i for i, _ in oracle] and len(ours) == len(events), (ours, oracle)
    for (i, args), (_, want) in zip(ours, oracle):
        fetch = compiled[events[i]][1]
        assert set(args) == set(want), (events[i], args, want)
        for name, v in args.items():
            mine = int(v, 0) if isinstance(v, str) else v
            # equal in the fetch type's width: m.y in the upper half of a register is read as
            # unsigned bits (b32@32/64), gdb prints the int
            assert (mine - int(want[name])) % (1 << _bits(fetch[name])) == 0, (events[i], name, args, want)
    # the values are the interesting ones: negative stack arguments, a negative int in a register's upper half
    got = dict(ours)
    assert got[events.index("stack")]["j"] == -12 and got[events.index("stack")]["i"] == -11
    assert int(got[events.index("pieces")]["my"]) % (1 << 32) == (1 << 32) - 5


def test_locations(built):
    """The seventh argument on is on the stack (the CFA's slots: +8(%sp) at -O2's entry, the frame
    pointer's at -O0); at -O2 the structs are in registers, a member in a register's upper half
    read as a bitfield of it."""
    opt, (prog, out, check) = built
    c = _compiled(check)
    stack, pieces = c["stack"][1], c["pieces"][1]
    if opt == "0":
        assert stack["g"] == "+16(%bp):s64" and stack["h"] == "+24(%bp):s32", stack
        assert re.fullmatch(r"-\d+\(%bp\):s32", pieces["my"]), pieces
    else:
        assert stack == {"a": "%di:s64", "g": "+8(%sp):s64", "h": "+16(%sp):s32", "i": "+24(%sp):s16",
                         "j": "+32(%sp):s8"}, stack
        assert pieces == {"pa": "%di:s64", "pb": "%si:s64", "mx": "%dx:s32", "my": "%dx:b32@32/64",
                          "mz": "%cx:s64", "k": "%r8:s32"}, pieces


def perf_agrees(prog, spec: str, tmp_path) -> list[str]:
    """`perf probe -x PROG -D SPEC` and our `check` of the same definition: one line each,
    the same fetch args (skipped where perf cannot run); ours returned."""
    perf = shutil.which("perf")
    r = subprocess.run([perf, "probe", "-x", str(prog), "-D", spec], capture_output=True, text=True) if perf else None
    if r is None or r.returncode:
        pytest.skip("perf probe -D does not work here")
    theirs = [l for l in r.stdout.splitlines() if l.startswith("p:")]
    mine = [l.split(": ", 1)[1] for l in kprewrite("check", prog, "--spec", write_spec(tmp_path, f'probes = ["{spec}"]\n'))
            .stdout.splitlines() if l.startswith("probes[")]
    assert len(theirs) == len(mine) == 1 and theirs[0].split()[2:] == mine[0].split()[2:], (theirs, mine)
    return mine


@pytest.mark.parametrize("built", ["0", "2"], indirect=True)
def test_perf_agrees_on_stack_arguments(built, tmp_path):
    """perf probe -D: the same fetch args for the stack arguments."""
    opt, (prog, out, check) = built
    perf_agrees(prog, "many g h i j", tmp_path)


@pytest.mark.parametrize("built", ["0"], indirect=True)
def test_perf_agrees_on_doubles_in_memory(built, tmp_path):
    """perf probe -D reads a double in the frame, and a float and a double through a pointer, as
    their bits (x64, x32): the same fetch args as ours (a long double, which perf cuts to 64
    bits, is refused)."""
    opt, (prog, out, check) = built
    mine = perf_agrees(prog, "fp x n", tmp_path)
    assert re.fullmatch(r"x=-\d+\(%bp\):x64", mine[0].split()[2]), mine


def test_not_readable(built, tmp_path):
    """A double in %xmm0 (perf 6.1: "Mapping for the register number 17 missing") or returned, a struct
    in pieces read whole, a member of it cast to another type: one line each, naming the
    variable and the address; gdb agrees where the double is."""
    opt, (prog, out, check) = built
    defs = ["fp x n", "split p", "split m.y:s32", "fp%return $retval", "fp%return $retval:x64"]
    r = kprewrite("check", prog, "--spec", write_spec(tmp_path, "probes = [" + ", ".join(f'"{d}"' for d in defs) + "]\n"),
                  check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    err = {int(m.group(1)): m.group(2) for m in re.finditer(r"kprewrite: probes\.toml: probes\[(\d)\]: (.*)", r.stderr)}
    # $retval is the integer return register, not a double's value (perf 6.1 reads it anyway): at any -O
    assert err[4] == err[5] == "'$retval' at fp%return: the return value is floating-point (double), returned " \
                               "in a floating-point register, which fetch args cannot read", err
    if opt == "0":
        assert 1 not in err, err                         # in the frame: its bits, x64
        assert re.fullmatch(r"'p' at split\+0x[0-9a-f]+ is a struct \(struct pair\): name a member .*", err[2]), err
        assert 3 not in err, err                         # in memory: any cast reads it
        return
    m = re.fullmatch(r"'x' is not available at (fp\+0x0) \(in %xmm0 \(DWARF register 17\), a floating-point or vector "
                     r"register, which fetch args cannot read\)", err[1])
    assert m, err
    assert err[2] == "'p' at split+0x0 is struct pair, split into pieces (DW_OP_piece; bytes 0..7: %di, " \
                     "8..15: %si): name a member (.F, [N])", err
    assert err[3] == "'m.y' at split+0x0 is in bits 32..63 of %dx: it can be read only as those bits " \
                     "(b32@32/64), not as 's32'", err
    g = subprocess.run(["gdb", "-nx", "-batch", "-ex", f"break *{m.group(1)}", "-ex", "run", "-ex", "info address x",
                        "-ex", "print x", str(prog)], capture_output=True, text=True, timeout=120)
    assert "a variable in $xmm0" in g.stdout and "= 1.5" in g.stdout, g.stdout


# --- bitfields of a struct in registers, and DW_OP_bit_piece -------------------------------------------

BITS_PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
struct bits { unsigned a:3; int b:5; unsigned c:12; _Bool f:1; long d; };
__attribute__((noinline)) void sink(long x) { __asm__ volatile("" :: "r"(x) : "memory"); }
__attribute__((noinline)) long bitf(struct bits s, int k)
{
    sink(s.c);
    struct bits t = s;
    t.b = k;
    t.a = k + 1;
    sink(t.a + t.b);
    sink(t.c);
    return s.a + s.b * k + s.c + t.a + t.b + s.d + s.f;
}
int main(int argc, char **argv)
{
    int base = argc > 1 ? atoi(argv[1]) : 3;
    struct bits s = { base + 2, -base - 4, base * 100 + 5, 1, base * 1000 };
    long r = bitf(s, base);
    r += bitf(s, -base - 5);
    printf("%ld\n", r);
    return 0;
}
"""

# the struct passed by value (at -O1/-O2 in %di and %si: DW_OP_piece), its bitfields
# (the signed one read as its bits), and the copy t, at -O1/-O2 split into DW_OP_bit_pieces
# (t.b: the low 5 bits of a register; at -O1 t.c: 12 bits at a frame slot)
BITS_PROBES = {
    "bents": ("bents=bitf sa=s.a sb=s.b sc=s.c sf=s.f sd=s.d k",
              [("sa", "s.a"), ("sb", "s.b"), ("sc", "s.c"), ("sf", "s.f"), ("sd", "s.d"), ("k", "k")]),
    "btb": ("btb=bitf:6 tb=t.b", [("tb", "t.b")]),
}
BITS_TC = ("btc=bitf:6 tc=t.c", [("tc", "t.c")])          # -O0 and -O1; -O2: optimized out
BITS_FLAGS = {"0": ["-O0"], "1": ["-O1"], "2": ["-O2"]}


def _bits_probes(opt):
    return {**BITS_PROBES, **({"btc": BITS_TC} if opt != "2" else {})}


@pytest.fixture(scope="module", params=list(BITS_FLAGS))
def bits_built(request, tmp_path_factory):
    if not shutil.which("gdb"):
        pytest.skip("gdb not installed")
    opt, tmp = request.param, tmp_path_factory.mktemp(f"perfprobebits{request.param}")
    prog = cc(tmp, f"bits{opt}", BITS_PROGRAM, *BITS_FLAGS[opt], "-g")
    spec = write_spec(tmp, "probes = [\n" + "".join(f'  "{d}",\n' for d, _ in _bits_probes(opt).values()) + "]\n")
    check = kprewrite("check", prog, "--spec", spec).stdout.splitlines()
    out = tmp / f"bits{opt}.kp"
    kprewrite("instrument", prog, "--spec", spec, "-o", out)
    return opt, prog, out, check


def test_bitfields_in_registers_match_gdb(bits_built, runner):
    opt, prog, out, check = bits_built
    probes = _bits_probes(opt)
    compiled = _compiled(check)
    assert set(compiled) == set(probes), check
    ents = compiled["bents"][1]
    if opt == "0":             # in the frame: the container and its bits
        assert re.fullmatch(r"-\d+\(%bp\):b12@8/32", ents["sc"]), ents
    else:                      # in %di: the register's bits
        assert ents == {"sa": "%di:b3@0/64", "sb": "%di:b5@3/64", "sc": "%di:b12@8/64", "sf": "%di:b1@20/64",
                        "sd": "%si:s64", "k": "%dx:s32"}, ents
        assert re.fullmatch(r"%r\w+:b5@0/64", compiled["btb"][1]["tb"]), compiled["btb"]
    if opt == "1":             # a DW_OP_bit_piece in the frame: the bytes that hold it
        assert re.fullmatch(r"\+\d+\(%sp\):b12@0/16", compiled["btc"][1]["tc"]), compiled["btc"]
    events = sorted(probes)
    oracle = gdb_values(prog, [(compiled[ev][0], probes[ev][1]) for ev in events])
    r = run(out, runner=runner)
    assert r.returncode == 0 and r.stdout == "6657\n", (r.stdout, r.stderr)
    recs = [x for x in map(tracefmt.parse_line, r.stderr.splitlines()) if x is not None]
    ours = []
    run_: list = []
    for x in recs + [None]:
        if run_ and (x is None or x.loc != run_[-1].loc):
            ours += sorted((events.index(y.event), y.args) for y in run_)
            run_ = []
        if x is not None:
            run_.append(x)
    assert [i for i, _ in ours] == [i for i, _ in oracle] and len(ours) == 2 * len(events), (ours, oracle)
    for (i, args), (_, want) in zip(ours, oracle):
        fetch = compiled[events[i]][1]
        assert set(args) == set(want), (events[i], args, want)
        for name, v in args.items():
            mine = int(v, 0) if isinstance(v, str) else v
            # equal in the field's width: a signed bitfield is read as its bits, gdb prints the int
            assert (mine - int(want[name])) % (1 << _bits(fetch[name])) == 0, (events[i], name, args, want)
    # the signed bitfields are negative: s.b = -7, and t.b = k = -8 on the second call
    sb = [a["sb"] for i, a in ours if events[i] == "bents"]
    tb = [a["tb"] for i, a in ours if events[i] == "btb"]
    assert [int(v, 0) if isinstance(v, str) else v for v in sb] == [32 - 7] * 2, sb
    assert [int(v, 0) if isinstance(v, str) else v for v in tb] == [3, 32 - 8], tb


def test_bit_pieces_not_readable(bits_built, tmp_path):
    """What a DW_OP_bit_piece location leaves out: one line each, naming the pieces."""
    opt, prog, out, check = bits_built
    if opt != "2":
        pytest.skip("the -O2 build's locations")
    defs = ["bitf:6 t", "bitf:6 tc=t.c", "bitf:6 ta=t.a", "bitf:6 tb=t.b:s32"]
    r = kprewrite("check", prog, "--spec", write_spec(tmp_path, "probes = [" + ", ".join(f'"{d}"' for d in defs) + "]\n"),
                  check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    err = {int(m.group(1)): m.group(2) for m in re.finditer(r"kprewrite: probes\.toml: probes\[(\d)\]: (.*)", r.stderr)}
    assert re.fullmatch(r"'t' at bitf\+0x[0-9a-f]+ is struct bits, split into pieces \(DW_OP_bit_piece; bits "
                        r"0\.\.2: computed \(DW_OP_breg\d+ 1; DW_OP_stack_value\), which fetch args cannot express, "
                        r"3\.\.7: bits 0\.\.4 of %\w+, 8\.\.127: optimized out\): name a member \(\.F, \[N\]\)", err[1]), err
    assert re.fullmatch(r"'t\.c' at bitf\+0x[0-9a-f]+: t\.c is not available here \(optimized out: its piece of the "
                        r"variable's location, DW_OP_bit_piece\)", err[2]), err
    assert "t.a is not available here (computed (DW_OP_breg" in err[3], err
    assert re.fullmatch(r"'t\.b' at bitf\+0x[0-9a-f]+ is in bits 0\.\.4 of %\w+: it can be read only as those bits "
                        r"\(b5@0/64\), not as 's32'", err[4]), err

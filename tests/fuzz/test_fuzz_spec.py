"""Fuzzing what a user writes: specs (TOML structure, keys, value types, globs,
offsets, handlers), `events` lines and `fetch` strings (kprobe_events syntax,
built from its grammar's pieces, then mutated), and `kprewrite trace` input
(trace lines, built and mutated).  Each case runs the CLI in-process
(harness.run_case) against a small real program compiled by gcc."""
from __future__ import annotations

import datetime
import subprocess

import pytest
from hypothesis import given, strategies as st

from harness import count, fuzz_settings, run_case
from test_fuzz_elf import PROGRAM

SYMBOLS = ["work", "pick", "main", "counter", "fp", "printf", "strlen", "_start", "nosuch", "*", "w*", "?ork",
           "[wp]*", "[", "[!a-z]*", "work.cold", "main+4", "", " ", "0x1000", "work\x00", "ω"]
KEYS = ["symbol_name", "addr", "offset", "pre_handler", "post_handler", "handler", "entry_handler",
        "maxactive", "data_size", "disabled", "name", "fetch", "offest", "symbol"]
TOP = ["handlers", "optimize", "kprobe", "kretprobe", "events", "event", "kprobes"]

# --- kprobe_events pieces ------------------------------------------------------------------------
REGS = ["%di", "%si", "%dx", "%cx", "%r8", "%r9", "%ax", "%sp", "%ip", "%flags", "%rdi", "%eax", "%xmm0", "%", "%r16"]
VARS = ["$retval", "$stack", "$stack0", "$stack3", "$stack99999999999", "$arg1", "$arg6", "$arg0", "$arg7",
        "$comm", "$COMM", "$", "$foo", "@counter", "@counter+4", "@counter-8", "@nosuch", "@0x1000", "@",
        "\"str\"", "\"unclosed", "\\\"imm\"", "\\123", "\\0x7fffffffffffffff", "\\-1", "\\"]
TYPES = ["u8", "u16", "u32", "u64", "s8", "s16", "s32", "s64", "x8", "x16", "x32", "x64", "string", "ustring",
         "symbol", "symstr", "char", "b4@8/32", "b0@0/8", "b65@0/64", "b1@63/64", "b4@8", "bogus", "u32[3]",
         "u8[64]", "u8[65]", "string[2]", "u32[", "u32[0]", "u32[x]", ""]


@st.composite
def fetch_body(draw, depth=0):
    leaf = draw(st.sampled_from(REGS + VARS + [str(draw(st.integers(-2 ** 65, 2 ** 65)))]))
    if depth < 4 and draw(st.booleans()):
        off = draw(st.sampled_from(["+0", "+8", "-8", "+0x10", "8", "+", "+99999999999999999999", "+u0", "-0x7fffffff"]))
        return f"{off}({draw(fetch_body(depth + 1))}{draw(st.sampled_from([')', ')', '', '))']))}"
    return leaf


@st.composite
def fetch_arg(draw):
    name = draw(st.sampled_from(["a", "b", "arg", "_x", "1bad", "a-b", "", "x" * 40, "a"]))
    body = draw(fetch_body())
    t = draw(st.sampled_from(TYPES))
    eq = "=" if name else ""
    return f"{name}{eq}{body}" + (f":{t}" if t else "")


def fetch_string():
    return st.lists(fetch_arg(), max_size=6).map(" ".join)


@st.composite
def event_line(draw):
    kind = draw(st.sampled_from(["p", "r", "r4", "r99999", "p:", "-:", "x", "p:ev", "r:g/ev", "p:g/", "p:/e",
                                 "p:bad-name", "p:" + "e" * 80, "r:my/ret"]))
    where = draw(st.sampled_from(SYMBOLS + ["work+0", "work+1", "work+0x4", "main+999999", "work%return",
                                            "0x0", "0xffffffffffffffff", "work+-1", "+0"]))
    return f"{kind} {where} {draw(fetch_string())}".strip()


def mutate_text(draw, text: str) -> str:
    for _ in range(draw(st.integers(0, 3))):
        if not text:
            break
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["del", "ins", "dup"]))
        if op == "del":
            text = text[:i] + text[i + 1:]
        elif op == "ins":
            text = text[:i] + draw(st.sampled_from(list("()[]{}=:+-%$@\"\\ ,#\n\t0x") + ["\x00", "é"])) + text[i:]
        else:
            text = text[:i] + text[i:i + 8] + text[i:]
    return text


# --- TOML ---------------------------------------------------------------------------------------
SCALARS = st.one_of(st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.sampled_from([0, 1, 4, -1, 2 ** 31, 2 ** 32, 2 ** 64]),
                    st.floats(allow_nan=True), st.sampled_from(SYMBOLS), st.text(max_size=12),
                    st.dates(), st.times())
VALUES = st.recursive(SCALARS, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.sampled_from(KEYS), c, max_size=3)),
                      max_leaves=6)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(repr(v), repr(v))
    if isinstance(v, str):
        return '"' + "".join(c if c.isprintable() and c not in '"\\' else f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF
                             else f"\\U{ord(c):08x}" for c in v) + '"'
    if isinstance(v, (datetime.date, datetime.time)):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f'"{k}" = {toml_value(x)}' for k, x in v.items()) + "}"


@st.composite
def probe_table(draw, kind):
    t = {}
    if draw(st.integers(0, 4)):
        t["symbol_name"] = draw(st.sampled_from(SYMBOLS))
    if not draw(st.integers(0, 5)):
        t["addr"] = draw(st.one_of(st.integers(0, 2 ** 64 - 1), st.sampled_from([0x1139, 0x401136, 0x1000])))
    if draw(st.booleans()):
        t["offset"] = draw(st.one_of(st.integers(0, 40), st.integers(-5, 2 ** 33)))
    if draw(st.booleans()):
        t["fetch"] = draw(fetch_string())
    for k in draw(st.lists(st.sampled_from(KEYS), max_size=3)):
        t[k] = draw(VALUES)
    return t


@st.composite
def spec_text(draw):
    lines = []
    if draw(st.booleans()):
        lines.append(f"optimize = {toml_value(draw(st.one_of(st.booleans(), VALUES)))}")
    if draw(st.booleans()):
        lines.append(f"events = {toml_value(draw(st.lists(st.one_of(event_line(), st.text(max_size=10)), max_size=4)))}")
    if not draw(st.integers(0, 6)):
        lines.append(f"handlers = {toml_value(draw(st.lists(st.sampled_from(['h.c', 'nosuch.c', 'x.o', '', '..', '/', 'h.txt']), max_size=2)))}")
    for k in draw(st.lists(st.sampled_from(TOP), max_size=2)):
        lines.append(f"{k} = {toml_value(draw(VALUES))}")
    for kind in draw(st.lists(st.sampled_from(["kprobe", "kretprobe"]), max_size=4)):
        lines.append(f"[[{kind}]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in draw(probe_table(kind)).items()]
    text = "\n".join(lines) + "\n"
    return mutate_text(draw, text) if not draw(st.integers(0, 4)) else text


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz_prog")
    (d / "p.c").write_text(PROGRAM)
    r = subprocess.run(["gcc", "-O2", str(d / "p.c"), "-o", str(d / "prog")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return d / "prog"


def _case(tmp_path_factory, program, spec_bytes: bytes, cmd: str, target: str):
    d = tmp_path_factory.mktemp("case", numbered=True)
    prog = d / "prog"
    prog.write_bytes(program.read_bytes())
    spec = d / "probes.toml"
    spec.write_bytes(spec_bytes)
    out = d / "out"
    args = ["check", prog, "--spec", spec] if cmd == "check" else ["instrument", prog, "--spec", spec, "-o", out]
    count(target)
    run_case(args, [prog, spec], d, out)
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


@fuzz_settings(500)
@given(text=spec_text(), cmd=st.sampled_from(["check", "check", "check", "instrument"]))
def test_fuzz_spec(text, cmd, program, tmp_path_factory):
    _case(tmp_path_factory, program, text.encode("utf-8", "surrogatepass"), cmd, "spec")


@fuzz_settings(500)
@given(lines=st.lists(event_line(), min_size=1, max_size=3), fetch=fetch_string(), kret=st.booleans(),
       cmd=st.sampled_from(["check", "check", "check", "instrument"]), data=st.data())
def test_fuzz_events_and_fetch(lines, fetch, kret, cmd, data, program, tmp_path_factory):
    lines = [mutate_text(data.draw, l) for l in lines]
    fetch = mutate_text(data.draw, fetch)
    kind = "kretprobe" if kret else "kprobe"
    text = (f"events = {toml_value(lines)}\n[[{kind}]]\nsymbol_name = \"work\"\nfetch = {toml_value(fetch)}\n")
    _case(tmp_path_factory, program, text.encode("utf-8", "surrogatepass"), cmd, "events/fetch")


# --- trace input --------------------------------------------------------------------------------
@st.composite
def trace_line(draw):
    comm = draw(st.sampled_from(["prog", "a b", "x-1", "", "-", "très"]))
    pid = draw(st.sampled_from(["123", "0", "99999999999999999999", "-1", "x"]))
    cpu = draw(st.sampled_from(["000", "1", "", "x"]))
    ts = draw(st.sampled_from(["12.345678", "0.0", "1.", ".5", "99999999999999999999.9", "1.2.3", "1e5"]))
    event = draw(st.sampled_from(["p_work_0", "r_work_0", "g/e", "e:", ""]))
    loc = draw(st.sampled_from(["work+0x0/0x20", "work+0x4/0x20", "main+0x13/0x40 <- work", " <- ", "<- x",
                                "0x1234", "work+0xzz/0x1", "", "(", "a <- b <- c"]))
    args = " ".join(draw(st.lists(st.sampled_from(
        ['a=1', 'b=-5', 's="hi"', 's="\\x4"', 's="\\xzz"', 's="\\', 'arr={1,2,3}', 'arr={', 'x={"a,b",2}',
         'e=', '=1', 'noeq', 'n=0xff', 'q="a b"', 'u="\\u12"']), max_size=4)))
    line = f"{comm}-{pid} [{cpu}] {ts}: {event}: ({loc}) {args}"
    return mutate_text(draw, line) if not draw(st.integers(0, 3)) else line


@fuzz_settings(1000)
@given(lines=st.lists(st.one_of(trace_line(), st.text(max_size=20)), max_size=8),
       fmt=st.sampled_from(["jsonl", "chrome"]), to_file=st.booleans(), raw=st.binary(max_size=16))
def test_fuzz_trace(lines, fmt, to_file, raw, tmp_path_factory):
    d = tmp_path_factory.mktemp("case", numbered=True)
    f = d / "trace.txt"
    f.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + raw)
    out = d / "trace.json"
    count("trace")
    r = run_case(["trace", f, "--format", fmt] + (["-o", out] if to_file else []), [f], d, out)
    assert r.code == 0 or not out.exists()
    for p in d.iterdir():
        p.unlink()
    d.rmdir()

"""FETCHARGS: every form and type against known values in a real program,
natively and under QEMU; a faulting dereference; parse errors with carets.
Cross-built for aarch64 too, under qemu-aarch64 (KPREWRITE_TEST_ARCH=aarch64),
with the kernel's arm64 register names (test_events.regs())."""
from __future__ import annotations

import re

import pytest

from conftest import ALL_ARCHES, ARCH, CROSS, cc, kprewrite, rewritten, run, toml_value, write_spec
from rewriter.probes import events as E
from rewriter.probes import fetch as F
from test_events import RETADDR, regs

ARCHES = ALL_ARCHES

PROGRAM = r"""
#include <stdio.h>
#include <stddef.h>
#include <string.h>
#include <sys/prctl.h>
struct item {
    int id;
    short neg;
    unsigned flags;
    char name[12];
    const char *label;
    unsigned bits;
    long arr[4];
    const char *names[2];
    struct item *self;
    signed char sc;
    unsigned long long big;
};
struct item glob = { 7, -5, 0xabcd, "globname", "glob-label", 0x2d, {1, -2, 3, -4}, {"g0", "g1"}, &glob, -100, 0 };
long counter = 42;
const char *gstr = "global string";
char gbuf[] = "0123456789abcdef";
char *gmid = gbuf + 8;
__attribute__((noinline)) long other(long x) { return x ^ 0x55; }
long (*fnptr)(long) = other;
__attribute__((noinline)) long work(struct item *it, long x, const char *s, long a4, long a5, long a6, long a7, long a8,
                                    long a9)
{
    __asm__ volatile("" ::: "memory");
    return ((unsigned long)it > 4096 ? it->id : 0) + x + (long)strlen(s) + a4 + a5 + a6 + a7 + a8 + a9;
}
static struct item it = { 3, -7, 0x10, "local", "lbl", 0x5a, {10, 20, -30, 40}, {"n0", "n1"}, &it, -3,
                          0xfedcba9876543210ULL };
int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "offsets")) {
        printf("id=%zu neg=%zu flags=%zu name=%zu label=%zu bits=%zu arr=%zu names=%zu self=%zu sc=%zu big=%zu\n",
               offsetof(struct item, id), offsetof(struct item, neg), offsetof(struct item, flags),
               offsetof(struct item, name), offsetof(struct item, label), offsetof(struct item, bits),
               offsetof(struct item, arr), offsetof(struct item, names), offsetof(struct item, self),
               offsetof(struct item, sc), offsetof(struct item, big));
        return 0;
    }
    char comm[17] = {0};
    prctl(PR_GET_NAME, comm);
    printf("comm=%s it=%p\n", comm, (void *)&it);
    fflush(stdout);
    long sum = work(&it, -1, "hello world", 4, 5, 6, 7, 8, 9);
    sum += work((struct item *)16, 5, "bad", 0, 0, 0, 0, 0, 0);
    sum += other(1);
    printf("sum=%ld\n", sum);
    return 0;
}
"""

# name -> (FETCHARG, expected value in the first work() call or a check function)
CASES = {
    "id": ("+{id}(%di):s32", "3"),
    "neg": ("+{neg}(%di):s16", "-7"),
    "negu": ("+{neg}(%di):u16", "65529"),
    "negx": ("+{neg}(%di):x16", "0xfff9"),
    "flags": ("+{flags}(%di):x32", "0x10"),
    "flagsu8": ("+{flags}(%di):u8", "16"),
    "name": ("+{name}(%di):string", '"local"'),
    "uname": ("+{name}(%di):ustring", '"local"'),
    "label": ("+0(+{label}(%di)):string", '"lbl"'),
    "x": ("%si:s64", "-1"),
    "xu8": ("%si:u8", "255"),
    "xs8": ("%si:s8", "-1"),
    "xx32": ("%si:x32", "0xffffffff"),
    "xdef": ("%si", "0xffffffffffffffff"),
    "s": ("+0(%dx):string", '"hello world"'),
    "arr": ("+{arr}(%di):s64[4]", "{10,20,-30,40}"),
    "arrx": ("+{arr}(%di):x8[2]", "{0xa,0x0}"),
    "names": ("+{names}(%di):string[2]", '{"n0","n1"}'),
    "bits": ("+{bits}(%di):b4@2/32", "6"),
    "bit0": ("+{bits}(%di):b1@0/8", "0"),
    "bit1": ("+{bits}(%di):b1@1/8", "1"),
    "c": ("+{name}(%di):char", "'l'"),
    "sc": ("+{sc}(%di):s8", "-3"),
    "big": ("+{big}(%di):u64", str(0xfedcba9876543210)),
    "bigs": ("+{big}(%di):s64", str(0xfedcba9876543210 - (1 << 64))),
    "deep": ("+{id}(+{self}(+{self}(%di))):s32", "3"),
    "udr": ("+u{id}(%di):s32", "3"),
    "minus": ("-8(@gmid):string", '"0123456789abcdef"'),
    "a2": ("$arg2:s64", "-1"),
    "a4": ("$arg4:u32", "4"),
    "a7": ("$arg7:s64", "7"),
    "a8": ("$arg8:s64", "8"),
    "a9": ("$arg9:s64", "9"),          # on the stack on both arches (x86-64: from the 7th, arm64: the 9th)
    "g": ("@glob:s32", "7"),
    "gneg": ("@glob+{neg}:s16", "-5"),
    "gc": ("@counter:u64", "42"),
    "gs": ("+0(@gstr):string", '"global string"'),
    "gname": ("@glob+{name}:string", '"globname"'),
    "sym": ("@fnptr:symbol", re.compile(r"other\+0x0/0x[0-9a-f]+")),
    "symstr": ("@fnptr:symstr", re.compile(r'"other\+0x0/0x[0-9a-f]+"')),
    "ret": (f"{RETADDR}:symbol", re.compile(r"main\+0x[0-9a-f]+/0x[0-9a-f]+")),
    "stk": ("$stack", re.compile(r"0x[0-9a-f]{6,}")),
    "stk0": ("+0($stack)", re.compile(r"0x[0-9a-f]+")),
    "s0": ("$stack0", re.compile(r"0x[0-9a-f]+")),
    "s1": ("$stack1", re.compile(r"0x[0-9a-f]+")),
    "stk1": ("+8($stack)", re.compile(r"0x[0-9a-f]+")),
    "imm": ("\\-5:s8", "-5"),
    "immx": ("\\0x1f", "0x1f"),
    "immu": ("\\300:u16", "300"),
    "istr": ('\\"hi"', '"hi"'),
    "comm": ("$comm", None),                 # the program's own PR_GET_NAME
    "comm2": ("$comm:string", None),
}
if ARCH == "x86_64":        # the return address is the stack's top at an entry
    CASES["stk0s"] = ("+0($stack):symbol", re.compile(r"main\+0x[0-9a-f]+/0x[0-9a-f]+"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """PROGRAM, and the offsets of its struct fields it prints."""
    prog = cc(tmp_path_factory.mktemp("fetch"), "prog", PROGRAM, "-O2", "-fno-inline")
    offs = dict(kv.split("=") for kv in run(prog, "offsets", runner="qemu" if CROSS else "native").stdout.split())
    return prog, offs


def parse_trace(stderr: str, event: str) -> list[dict[str, str]]:
    from rewriter.trace import formats as tracefmt
    out = []
    for line in stderr.splitlines():
        r = tracefmt.parse_line(line)
        if r is not None and r.event == event:
            m = re.search(r"\) (.*)$", line)
            out.append(dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\{[^}]*\}|\S+)', m.group(1))))
    return out


def test_every_form_and_type(once, built, runner):
    prog, offs = built
    args = " ".join(f"{n}={regs(a).format(**offs)}" for n, (a, _) in CASES.items())
    out = once(rewritten, prog, f"events = [{toml_value('p:work_entry work ' + args)}]\n")
    r = run(out, runner=runner)
    assert r.returncode == 0, r.stderr
    comm = re.search(r"comm=(\S+)", r.stdout).group(1)
    lines = parse_trace(r.stderr, "work_entry")
    assert len(lines) == 2, r.stderr
    first, bad = lines
    for name, (_, want) in CASES.items():
        got = first[name]
        if want is None:
            assert got == f'"{comm}"', (name, got)
        elif isinstance(want, str):
            assert got == want, (name, got, want)
        else:
            assert want.fullmatch(got), (name, got)
    # $stackN is the Nth long at sp; at an x86-64 entry the first is the return address.
    assert first["stk0"] == first["s0"] and first["stk1"] == first["s1"]
    assert ARCH != "x86_64" or first["stk0s"] == first["ret"]
    # The first hit's line starts like the kernel's: COMM-PID [CPU] SEC.USEC: EVENT: (SYM+off/size)
    line = [l for l in r.stderr.splitlines() if "work_entry" in l][0]
    assert re.match(r"^\s*\S.*-\d+\s+\[\d{3}\] +\d+\.\d{9}: work_entry: \(work\+0x[04]/0x[0-9a-f]+\) ", line), line
    assert line.startswith(" " * (16 - len(comm)) + comm + "-")
    # Second call: it = 16, a bad pointer.  Every dereference of it prints (fault); nothing crashes.
    for name in ("id", "neg", "name", "label", "deep", "udr", "c", "bits"):
        assert bad[name] == "(fault)", (name, bad[name])
    assert bad["arr"] == "{(fault),(fault),(fault),(fault)}"
    assert bad["names"] == "(fault)"
    assert bad["x"] == "5" and bad["s"] == '"bad"' and bad["g"] == "7"
    assert "sum=" in r.stdout


def test_kprobe_table_fetch_with_handler(once, built, runner):
    """A [[kprobe]] with both `fetch` and a pre_handler: the trace line, then the handler."""
    prog, offs = built
    handlers = r"""
#include <kprewrite/kprobes.h>
int on_work(struct kprobe *p, struct pt_regs *regs)
{
    pr_info("handler x=%ld\n", (long)regs_get_kernel_argument(regs, 1));
    return 0;
}
"""
    out = once(rewritten, prog, regs(f"""
handlers = ["handlers.c"]
[[kprobe]]
symbol_name = "work"
pre_handler = "on_work"
name = "work_fetch"
fetch = "x=%si:s64 id=+{offs['id']}(%di):s32"
[[kprobe]]
symbol_name = "other"
fetch = ""
"""), handlers)
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    i = [k for k, l in enumerate(lines) if "work_fetch: (work+" in l]
    assert len(i) == 2
    assert lines[i[0]].endswith(" x=-1 id=3") and lines[i[0] + 1] == "handler x=-1"
    assert lines[i[1]].endswith(" x=5 id=(fault)") and lines[i[1] + 1] == "handler x=5"
    other = [l for l in lines if "p_other_0: (other+" in l]
    assert len(other) == 1 and other[0].endswith(")")        # an empty fetch: a line with no args


# --- parser: unit tests and error carets ---------------------------------------------------------

def test_parse_codes():
    def code(a, ret=False):
        args = F.parse_args(F.split_args(a), F.ParseFlags(is_return=ret, fentry=True))
        return [(i.op, i.size, i.imm, i.param) for i in args[0].code]
    assert code("%di") == [("REG", 0, 0, 112), ("ST_RAW", 8, 0, 0), ("END", 0, 0, 0)]
    assert code("+8(%si):string") == [("REG", 0, 0, 104), ("ST_STRING", 0, 8, 0), ("END", 0, 0, 0)]
    assert code("+0(+8(%di)):u32[4]") == [("REG", 0, 0, 112), ("DEREF", 0, 8, 0), ("ST_MEM", 4, 0, 0),
                                          ("LP_ARRAY", 0, 0, 4), ("END", 0, 0, 0)]
    assert code("-16($stack):s32")[:2] == [("STACKP", 0, 0, 0), ("ST_MEM", 4, -16, 0)]
    assert code("$retval", ret=True)[0][0] == "RETVAL"
    assert code("$arg3")[0] == ("ARG", 0, 0, 2)
    assert code("\\-1")[0] == ("IMM", 0, (1 << 64) - 1, 0)
    bf = F.parse_args(F.split_args("+0(%di):b3@5/16"), F.ParseFlags(fentry=True))[0].code
    assert (bf[-2].op, bf[-2].size, bf[-2].lshift, bf[-2].rshift) == ("MOD_BF", 2, 8, 13)
    args = F.parse_args(F.split_args("%di foo=%si $comm"), F.ParseFlags(fentry=True))
    assert [a.name for a in args] == ["arg1", "foo", "arg3"]
    assert args[2].type.name == "string"



def test_build_arg_as_parsed():
    """fetch.build_arg() (perf probe's args, made from data) gives what parse_arg() makes
    of the same NAME=BODY written at the same column: the instructions, or the error and
    its column."""
    di, sp = F.reg("di"), F.reg("sp")
    cases = [(F.Fetch(di, "s32"), False), (F.Fetch(F.deref(-20, F.reg("bp")), "x64"), False),
             (F.Fetch(F.deref(0, F.deref(24, F.reg("dx"))), "string"), False),
             (F.Fetch(F.deref(16, di), "ustring"), False), (F.Fetch(F.addr(0x4010), "u32"), False),
             (F.Fetch(F.addr(0x4010), "string"), False), (F.Fetch(F.imm(-5), "s64"), False),
             (F.Fetch(F.imm(7), "u8"), False), (F.Fetch(F.reg("ax"), "b5@8/64"), False),
             (F.Fetch(F.deref(4, sp), "b3@2/32"), False), (F.Fetch(F.deref(8, di), "u16[4]"), False),
             (F.Fetch(F.RETVAL, "s32"), True), (F.Fetch(F.deref(0, F.RETVAL), "string"), True),
             # errors: a bad cast, $retval on a probe, an array of a register, too deep
             (F.Fetch(di, "foo"), False), (F.Fetch(F.RETVAL, "x64"), False), (F.Fetch(di, "u8[2]"), False),
             (F.Fetch(F.deref(0, di), "b9@0/8"), False), (F.Fetch(di, "string"), False),
             (F.Fetch(F.reg("zz"), "u8"), False)]
    deep = di
    for _ in range(15):
        deep = F.deref(1, deep)
    cases.append((F.Fetch(deep, "u8"), False))
    cases.append((F.Fetch(F.deref(0, F.reg("bx")), "x" * 60), False))      # longer than MAX_ARGSTR_LEN

    def outcome(make, *args):
        try:
            return make(*args)
        except F.FetchError as e:
            return (e.column, e.code, e.message)

    for body, ret in cases:
        flags = F.ParseFlags(is_return=ret, fentry=True)
        for before in ([], F.parse_args([("v=%si", 0)], flags)):
            name = "w" if before else "v"
            made = outcome(F.build_arg, name, body, 9, flags, list(before))
            parsed = outcome(F.parse_arg, f"{name}={body.text}", 9, flags, list(before))
            assert made == parsed, body.text
    used = F.parse_args([("v=%si", 0)], F.ParseFlags())
    assert outcome(F.build_arg, "v", F.Fetch(di, "u8"), 9, F.ParseFlags(), used)[1] == "USED_ARG_NAME"

def test_parse_event_lines():
    ev = E.parse_line("p:grp/myev work+8 a=%di", 1)
    assert (ev.is_return, ev.group, ev.event, ev.symbol, ev.offset) == (False, "grp", "myev", "work", 8)
    ev = E.parse_line("p work", 1)
    assert (ev.group, ev.event) == ("kprobes", "p_work_0")
    ev = E.parse_line("p work+0x10", 1)
    assert ev.event == "p_work_16"
    ev = E.parse_line("p 0x401136 %ax", 1)
    assert (ev.addr, ev.event) == (0x401136, "p_0x401136")
    ev = E.parse_line("r work $retval", 1)
    assert (ev.is_return, ev.event, ev.maxactive) == (True, "r_work_0", 0)
    ev = E.parse_line("r20:myret work ret=$retval:s32", 1)
    assert (ev.is_return, ev.event, ev.maxactive) == (True, "myret", 20)
    ev = E.parse_line("p:g/ work%return", 1)
    assert (ev.is_return, ev.group, ev.event) == (True, "g", "r_work_0")
    ev = E.parse_line("p:g.ev work", 1)
    assert (ev.group, ev.event) == ("g", "ev")


# (line, the text the caret must point at, message)
ERRORS = [
    ("p:myprobe work x=%foo", "%foo", "Invalid register name"),
    ("p:myprobe work x=+0(%di", "", "Dereference brace is not closed"),
    ("p:myprobe work x=+0%di", "+0%di", "Dereference needs a brace"),
    ("p:myprobe work x=+zz(%di)", "+zz(", "Invalid dereference offset"),
    ("p:myprobe work x=$retval", "$retval", "$retval is not available on probe"),
    ("p:myprobe work x=$foo", "$foo", "Invalid $-variable specified"),
    ("p:myprobe work x=%di:u7", "u7", "Unknown type is specified"),
    ("p:myprobe work x=%di:string", "string", "String accepts only memory argument"),
    ("p:myprobe work x=%di:u32[4]", "u32[4]", "Array accepts only memory argument"),
    ("p:myprobe work x=+0(%di):u32[4", "", "Array is not closed"),
    ("p:myprobe work x=+0(%di):u32[0]", "0]", "Invalid array size"),
    ("p:myprobe work x=+0(%di):u32[65]", "65]", "Array number is too big"),
    ("p:myprobe work x=+0(%di):u32[2]x", "x", "Array has wrong suffix"),
    ("p:myprobe work x=+0(%di):b0@1/32", "b0@", "Invalid bitfield"),
    ("p:myprobe work x=+0(%di):b30@4/32", "b30@", "Invalid bitfield"),
    ("p:myprobe work x=+0(%di):b3@4/24", "b3@", "Unknown type is specified"),
    ("p:myprobe work 1x=%di", "1x=", "Argument name must follow the same rules as C identifiers"),
    ("p:myprobe work =%di", "=%di", "Argument name is not specified"),
    ("p:myprobe work x=%di x=%si", "x=%si", "This argument name is already used"),
    ("p:myprobe work x=", "", "No argument expression"),
    ("p:myprobe work x=+0($comm)", "$comm", "$comm can not be dereferenced"),
    ("p:myprobe work x=$comm:u32", "u32", "$comm and immediate-string only accepts string type"),
    ("p:myprobe work x=\\zz", "zz", "Invalid immediate value"),
    ("p:myprobe work x=\\\"abc", "", "String is not closed"),
    ("p:myprobe work x=@+10", "@+10", "File offset is not available with kprobe"),
    ("p:myprobe work x=@nosuchsym", "nosuchsym", "Symbol not found in the image"),
    ("p:myprobe work+4 x=$arg1", "$arg1", "$argN can be used only on function entry"),
    ("p:myprobe work x=$arg0", "$arg0", "Invalid argument number"),
    ("q:myprobe work", "q:myprobe", "Probe type must be"),
    ("p5:myprobe work", "5:myprobe", "Maxactive is only for function exit"),
    ("r0:myprobe work", "0:myprobe", "Invalid maxactive number"),
    ("r5000:myprobe work", "5000:", "Maxactive is too big"),
    ("r:myprobe work+4", "work+4", "Retprobe address must be an function entry"),
    ("p:myprobe work%foo", "%foo", "Invalid probed address suffix"),
    ("p:1bad work", "1bad", "Event name must follow the same rules as C identifiers"),
    ("p:/ev work", "/ev", "Group name is not specified"),
    ("p: work", " work", "Event name is not specified"),
    ("p:myprobe", "", "Invalid probed address or symbol"),
    ("p:myprobe libc:malloc", "libc:malloc", "Module names are not supported"),
]


@pytest.fixture(scope="module")
def small(built):
    return built[0]


@pytest.mark.parametrize("line,at,msg", ERRORS, ids=[e[2][:30] + f"-{i}" for i, e in enumerate(ERRORS)])
def test_error_caret(tmp_path, small, line, at, msg):
    line, at = regs(line), regs(at)         # the same columns: arm64's x0..x3 are as long as di si dx cx
    spec = write_spec(tmp_path, f'events = ["p:fine work", {toml_value(line)}]\n')
    r = kprewrite("instrument", small, "--spec", spec, "-o", tmp_path / "out", check=False)
    assert r.returncode != 0 and not (tmp_path / "out").exists()
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    k = [i for i, l in enumerate(lines) if "events[2]: column" in l]
    assert len(k) == 1, r.stderr
    head, cmd, caret = lines[k[0]:k[0] + 3]
    assert head.startswith("kprewrite: probes.toml: events[2]: column ") and msg in head, head
    assert cmd == "kprewrite:   Command: " + line
    col = caret.index("^") - len("kprewrite:   Command: ")
    assert caret.startswith("kprewrite:") and set(caret[len("kprewrite:"):-1]) <= {" "} and caret.endswith("^")
    assert int(re.search(r"column (\d+)", head).group(1)) == col + 1
    if at:
        assert line[col:col + len(at)] == at, (line, col, at)
    else:
        assert col >= len(line) - 1, (line, col)


def test_fetch_string_error_names_the_table(tmp_path, small):
    spec = write_spec(tmp_path, regs('[[kprobe]]\nsymbol_name = "work"\nfetch = "a=%di b=+8(%si:u8"\n'))
    r = kprewrite("check", small, "--spec", spec, check=False)
    assert r.returncode != 0
    head, cmd, caret = r.stderr.splitlines()
    # As in the kernel, the type is split off first: the brace is missing after "%si".
    assert head == "kprewrite: probes.toml: [[kprobe]] #1: fetch: column 15: Dereference brace is not closed"
    assert cmd == regs("kprewrite:   Command: a=%di b=+8(%si:u8")
    assert caret.index("^") == len("kprewrite:   Command: ") + 14


def test_every_error_reported(tmp_path, small):
    spec = write_spec(tmp_path, 'events = ["p:a work x=%foo", "p:b work y=$bar", "p:c work", "p:c other"]\n')
    r = kprewrite("check", small, "--spec", spec, check=False)
    assert r.returncode != 0
    heads = [l for l in r.stderr.splitlines() if "column" in l]
    assert [h.split(":")[2].strip() for h in heads] == ["events[1]", "events[2]", "events[4]"]
    assert "already used by another event (events[3])" in heads[2]

"""Unit tests of what kprewrite reads in compiled handler code (rewriter/link/handlers.py and
rewriter/arch/x86_64/handler_abi.py): whether a handler may read its regs argument
(the clean call or the full pt_regs frame), whether it touches vector/x87 state
(detours do not save it), and which call-clobbered registers a leaf writes (what
the clean template saves).  Real gcc objects, read with pyelftools and capstone; no
rewrite, a few compiles: seconds."""
from __future__ import annotations

import subprocess
from pathlib import Path

import capstone
import pytest

from conftest import CC
from rewriter.link import handlers
from rewriter import link
from rewriter.arch import get_arch
from rewriter.probes.spec import KprobeSpec, KretprobeSpec, Spec

ARCHES = ["x86_64"]      # x86-64 only: x86-64 handler code and gcc flags (-mfunction-return, xrstor, SSE)

ARCH = get_arch("x86_64")
ABI = ARCH.handler_abi

# Plain C with the handlers' signature (regs is the second argument: %rsi).
PLAIN = r"""
struct regs { long di, si, ax; };
extern long sink;
extern int other(void *p, void *r);
int reads(void *p, struct regs *regs) { sink = regs->di; return 0; }
int ignores(void *p, struct regs *regs) { sink++; return 0; }
int passes(void *p, struct regs *regs) { return other(p, regs) + 1; }
int drops(void *p, struct regs *regs) { return other(p, 0); }
int branchy(void *p, struct regs *regs, long k) { if (k > 3) sink = regs->ax; return 0; }
long leaf3(long a, long b, long c) { return a * b + c; }
double sse(void *p, struct regs *regs, double x) { return x * 2.5 + sink; }
long double x87(long double x) { return x * x; }
"""


def _compile(tmp: Path, name: str, source: str, *flags: str) -> Path:
    src = tmp / f"{name}.c"
    src.write_text(source)
    out = tmp / f"{name}.o"
    r = subprocess.run([CC, "-O2", "-c", "-fcf-protection=none", *flags, str(src), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def objs(tmp_path_factory):
    d = tmp_path_factory.mktemp("handler_abi")
    return {
        "plain": link.object_functions([_compile(d, "plain", PLAIN)]),
        "thunk": link.object_functions([_compile(d, "thunk", PLAIN, "-mfunction-return=thunk-extern")]),
        "dir": d,
    }


def _disasm(code: bytes, at: int = 0):
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    return list(md.disasm(code, at))


def _uses(fn) -> bool:
    off, body, relocs = fn
    return ABI.may_use_regs(body, off, off + len(body), relocs)


def test_may_use_regs_follows_rsi(objs):
    """A handler that reads regs, passes it to a call, or reads it on one branch only may
    use it; one that never does (or overwrites %rsi before a tail call) may not."""
    f = objs["plain"]
    assert _uses(f["reads"]) and _uses(f["passes"]) and _uses(f["branchy"])
    assert not _uses(f["ignores"])
    # other(p, 0): %esi zeroed (xor esi,esi: a write, not a read), then a tail jmp out.
    off, body, _ = f["drops"]
    text = [(i.mnemonic, i.op_str) for i in _disasm(body, off)]
    assert ("xor", "esi, esi") in text, text
    assert not _uses(f["drops"])
    # The same function without the zeroing: its jump out of the function may take regs.
    assert _uses(f["passes"])


# pt_regs-shaped (21 words, as the kernel's), with handlers that only load from it and
# handlers that use it any other way.
LOADS = r"""
struct regs { unsigned long r15, r14, r13, r12, bp, bx, r11, r10, r9, r8, ax, cx, dx, si, di,
              orig_ax, ip, cs, flags, sp, ss; };
extern long sink;
extern int other(void *p, void *r);
extern int printk(const char *fmt, ...);
int one(void *p, struct regs *regs) { sink += regs->di; return 0; }
int two(void *p, struct regs *regs) { return regs->ax == 0xdead && regs->flags & 1; }
int low(void *p, struct regs *regs) { sink += (unsigned char)(regs->flags >> 8) + (int)regs->sp; return 0; }
int prints(void *p, struct regs *regs) { printk("%lx %lx\n", regs->si, regs->di); return 0; }
int writes(void *p, struct regs *regs) { regs->di = 5; return 0; }
int bumps(void *p, struct regs *regs) { regs->ax++; return 0; }
int passes(void *p, struct regs *regs) { return other(p, regs); }
int keeps(void *p, struct regs *regs) { sink = (long)regs; return 0; }
int field(void *p, struct regs *regs) { sink = (long)&regs->di; return 0; }
int computed(void *p, struct regs *regs, long k) { sink = ((unsigned long *)regs)[k]; return 0; }
int beyond(void *p, struct regs *regs) { sink = ((unsigned long *)regs)[21]; return 0; }
int reads_then_calls(void *p, struct regs *regs) { sink = regs->di; return other(p, 0); }
"""

PT_SIZE = 168
PT = {"bx": 40, "ax": 80, "si": 104, "di": 112, "ip": 128, "flags": 144, "sp": 152}


def test_regs_loads_only_for_plain_loads(tmp_path):
    """regs_loads(): the pt_regs words a handler reads, when it only loads from regs at
    constant offsets (a partial pt_regs will do); None when it writes regs, passes it
    on, lets it escape, reads at a computed offset or beyond pt_regs."""
    f = link.object_functions([_compile(tmp_path, "loads", LOADS)])

    def loads(name):
        off, body, relocs = f[name]
        assert ABI.may_use_regs(body, off, off + len(body), relocs), name
        return ABI.regs_loads(body, off, off + len(body), relocs, limit=PT_SIZE)

    assert loads("one") == {PT["di"]}
    assert loads("two") == {PT["ax"], PT["flags"]}
    assert loads("low") == {PT["flags"], PT["sp"]}            # a byte and a half word: their words
    assert loads("prints") == {PT["si"], PT["di"]}            # %rsi overwritten by its last load
    assert loads("reads_then_calls") == {PT["di"]}            # %esi zeroed before the call
    for name in ("writes", "bumps", "passes", "keeps", "field", "computed", "beyond"):
        assert loads(name) is None, name
    # In the rewriter's own terms (link/handlers.py): the fields next to reads_regs.
    off, body, relocs = f["one"]
    assert ABI.regs_loads(body, off, off + len(body), relocs) == {PT["di"]}   # the runtime's PT_SIZE


def test_return_thunk_is_a_return(objs):
    """With -mfunction-return=thunk-extern a handler returns by `jmp __x86_return_thunk`:
    named by its relocation, it ends the path; without the relocation (unknown jump out)
    the analysis stays conservative."""
    off, body, relocs = objs["thunk"]["ignores"]
    jmps = [i for i in _disasm(body, off) if i.mnemonic == "jmp"]
    assert jmps and relocs.get(jmps[-1].address + 1) in ABI.RETURN_THUNKS, relocs
    assert not ABI.may_use_regs(body, off, off + len(body), relocs)
    assert ABI.may_use_regs(body, off, off + len(body), {})


def test_vector_use(objs, tmp_path):
    """SSE and x87 code is found (at its first vector instruction); general-register
    code and a handler built with -mgeneral-regs-only are clean."""
    f = objs["plain"]
    for name, regs in (("sse", "xmm"), ("x87", "st")):
        off, body, _ = f[name]
        at = ABI.vector_use(body, off)
        assert at is not None, name
        first = next(i for i in _disasm(body, off) if i.address == at)
        before = [i for i in _disasm(body, off) if i.address < at]
        assert regs in first.op_str or first.mnemonic.startswith("f"), (first.mnemonic, first.op_str)
        assert not any("xmm" in i.op_str or i.mnemonic.startswith("f") for i in before)
    for name in ("reads", "ignores", "passes", "leaf3"):
        off, body, _ = f[name]
        assert ABI.vector_use(body, off) is None, name
    gro = link.object_functions([_compile(tmp_path, "gro", PLAIN.replace("double", "long").replace("2.5", "5"),
                                          "-mgeneral-regs-only")])
    assert all(ABI.vector_use(body, off) is None for off, body, _ in gro.values())


ALIASES = {**{n: f"r{x}" for x in ("ax", "cx", "dx") for n in (f"r{x}", f"e{x}", x, x[0] + "l", x[0] + "h")},
           **{n: f"r{x}" for x in ("si", "di") for n in (f"r{x}", f"e{x}", x, x + "l")},
           **{f"r{i}{s}": f"r{i}" for i in (8, 9, 10, 11) for s in ("", "d", "w", "b")}}


def test_clobbered_scratch_of_leaves(objs):
    """A leaf's written call-clobbered registers, each by its 64-bit name (eax -> rax);
    a function that calls out (or jumps out) is unknown: None."""
    f = objs["plain"]
    for name in ("reads", "ignores", "leaf3", "branchy"):
        off, body, _ = f[name]
        got = ABI.clobbered_scratch(body, off)
        # Independently: every register capstone says the code writes, by its 64-bit name.
        want = set()
        md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
        md.detail = True
        for ci in md.disasm(body, off):
            want |= {ALIASES[ci.reg_name(r)] for r in ci.regs_access()[1] if ci.reg_name(r) in ALIASES}
        assert got == want and got <= set(ABI.SCRATCH), (name, got, want)
        assert "rax" in got, name          # each returns a value in eax / rax
    assert ABI.clobbered_scratch(*reversed(f["passes"][:2])) is None     # calls other()
    assert ABI.clobbered_scratch(*reversed(f["drops"][:2])) is None      # tail jmp out


SOURCE = r"""
#include <linux/kprobes.h>
static long seen;
int pre_reads(struct kprobe *p, struct pt_regs *regs) { seen = regs->di; return 0; }
int pre_counts(struct kprobe *p, struct pt_regs *regs) { seen++; return 0; }
static int ret_handler(struct kretprobe_instance *ri, struct pt_regs *regs) { seen += regs->ax; return 0; }
"""


def _spec(tmp: Path, files: list[Path], kprobes=(), kretprobes=()) -> Spec:
    return Spec(tmp / "p.toml", files, True, list(kprobes), list(kretprobes))


def test_handlers_resolve_and_read(tmp_path):
    """handlers.resolve(): each name to the file defining it (a C source's static handler
    exported under kp_handler_NAME); compile_and_read(): each handler's code read, so a
    counting handler gets the clean call and one reading regs the full frame."""
    src = tmp_path / "h.c"
    src.write_text(SOURCE)
    spec = _spec(tmp_path, [src],
                 [KprobeSpec("[[kprobe]] #1", "f", None, pre_handler="pre_reads"),
                  KprobeSpec("[[kprobe]] #2", "g", None, pre_handler="pre_counts")],
                 [KretprobeSpec("[[kretprobe]] #1", "f", None, handler="ret_handler")])
    assert handlers.names(spec) == {"pre_reads", "pre_counts", "ret_handler"}
    symbols, exports, errors = handlers.resolve(spec, ARCH)
    assert errors == []
    assert symbols == {n: f"kp_handler_{n}" for n in ("pre_reads", "pre_counts", "ret_handler")}
    assert sorted(exports[src]) == ["pre_counts", "pre_reads", "ret_handler"]
    objs, code = handlers.compile_and_read(spec, ARCH, symbols, exports, tmp_path)
    assert len(objs) == 1 and objs[0].exists()
    assert code["pre_reads"].reads_regs and code["ret_handler"].reads_regs
    assert not code["pre_counts"].reads_regs
    assert code["pre_counts"].clobbers is not None and "rax" in code["pre_counts"].clobbers
    assert code["pre_counts"].symbol == "kp_handler_pre_counts"
    # A runtime handler (a target's own) is not looked for in the files.
    symbols, _, errors = handlers.resolve(spec, ARCH, runtime_handlers=frozenset({"pre_reads"}))
    assert errors == [] and symbols["pre_reads"] == "pre_reads"


def test_handlers_refused(tmp_path):
    """A name defined nowhere, and a prebuilt object that uses SSE: one error line each."""
    obj = _compile(tmp_path, "vec", "double seen; int pre_vec(void *p, void *r) { seen *= 1.5; return 0; }\n")
    spec = _spec(tmp_path, [obj], [KprobeSpec("[[kprobe]] #1", "f", None, pre_handler="pre_vec",
                                              post_handler="nowhere")])
    symbols, _, errors = handlers.resolve(spec, ARCH)
    assert symbols == {"pre_vec": "pre_vec"}
    assert len(errors) == 2, errors
    assert errors[0].startswith("p.toml: handlers: vec.o uses SSE/AVX/x87 registers at 0x")
    assert errors[0].endswith("compile it with -mgeneral-regs-only")
    assert errors[1] == "p.toml: [[kprobe]] #1: post_handler 'nowhere' is not defined in any handler file (vec.o)"
    # The same handler built -mgeneral-regs-only (no double): accepted.
    clean = _compile(tmp_path, "ok", "long seen; int pre_vec(void *p, void *r) { seen *= 3; return 0; }\n")
    _, _, errors = handlers.resolve(_spec(tmp_path, [clean], [KprobeSpec("[[kprobe]] #1", "f", None,
                                                                           pre_handler="pre_vec")]), ARCH)
    assert errors == []


CMOV = r"""
#include <linux/kprobes.h>
static struct pt_regs fallback;
static int pre_pick(struct kprobe *p, struct pt_regs *regs)
{
	struct pt_regs *r = p->nmissed ? &fallback : regs;   /* gcc -O2: cmovne %rax,%rsi */
	pr_info("di=%lu\n", r->di);
	return 0;
}
"""


def test_conditional_move_keeps_regs(tmp_path):
    """`r = cond ? &other : regs; r->di`: on one path %rsi still holds regs after the cmov."""
    src = tmp_path / "h.c"
    src.write_text(CMOV)
    spec = _spec(tmp_path, [src], [KprobeSpec("[[kprobe]] #1", "f", None, pre_handler="pre_pick")])
    symbols, exports, errors = handlers.resolve(spec, ARCH)
    assert errors == []
    _, code = handlers.compile_and_read(spec, ARCH, symbols, exports, tmp_path)
    fn = link.object_functions([tmp_path / "handler0.o"])["pre_pick"]
    assert any(i.mnemonic.startswith("cmov") and i.op_str.startswith("rsi") for i in _disasm(fn[1], fn[0]))
    assert code["pre_pick"].reads_regs


RESTORE = r"""
static char area[512] __attribute__((aligned(64)));
int pre_fxrstor(void *p, void *r) { __asm__ volatile("fxrstor %0" :: "m"(area)); return 0; }
int pre_xrstor(void *p, void *r) { __asm__ volatile("xrstor %0" :: "m"(area), "a"(-1), "d"(-1)); return 0; }
"""


def test_vector_use_state_restore(tmp_path):
    """Instructions that load the whole x87/SSE state count as vector use."""
    funcs = link.object_functions([_compile(tmp_path, "restore", RESTORE)])
    for name in ("pre_fxrstor", "pre_xrstor"):
        off, body, _ = funcs[name]
        assert ABI.vector_use(body, off) is not None, name


TAIL = r"""
struct regs { long di, si, ax; };
extern long sink;
extern int other(void *p, struct regs *r);
int pre_tail(void *p, struct regs *regs) { if (__builtin_expect(p != 0, 1)) return other(p, regs); sink = 1; return 0; }
int pre_tail0(void *p, struct regs *regs) { if (__builtin_expect(p != 0, 1)) return other(p, 0); sink = 1; return 0; }
"""


def test_relocated_tail_jump_leaves(tmp_path):
    """A jmp whose operand is relocated to another symbol leaves the function, regs live."""
    off, body, relocs = link.object_functions([_compile(tmp_path, "tail", TAIL)])["pre_tail"]
    jmp = next(i for i in _disasm(body, off) if i.mnemonic == "jmp")
    assert relocs.get(jmp.address + 1) == "other" and off <= int(jmp.op_str, 16) < off + len(body)
    assert ABI.may_use_regs(body, off, off + len(body), relocs)


def test_relocated_tail_jump_clobbers_unknown(tmp_path):
    """A leaf that tail-calls out: what it clobbers is the callee's, unknown."""
    funcs = link.object_functions([_compile(tmp_path, "tail", TAIL)])
    off, body, relocs = funcs["pre_tail0"]
    assert "other" in relocs.values()
    assert not ABI.may_use_regs(body, off, off + len(body), relocs)      # right: %esi zeroed first
    assert ABI.clobbered_scratch(body, off, relocs) is None

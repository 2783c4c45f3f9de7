"""Stacks that unwind through probes: glibc's backtrace() taken inside a handler
goes on through the runtime and the detour into the probed function and its
callers (main -> a -> b -> c, c probed), for an optimized probe (a template
detour, and an aggregated site's stub through the runtime's shared entry and C
callback), a breakpoint probe (the runtime's SIGTRAP handler, its signal return)
and a kretprobe's return handler (a return-site detour and the runtime's return
hook).  Handlers cannot call the C library, so each executes an illegal instruction (`ud2`): the
program's SIGILL handler takes the backtrace (through the kernel's signal frame
into the handler, libgcc's unwinder reading the output's PT_GNU_EH_FRAME table)
and steps over it.  With the image's own table put back (PT_GNU_EH_FRAME as the
input had it), the same backtrace stops at the handler: the new table is what
makes the difference."""
from __future__ import annotations

import os
import re
import struct

import pytest

from conftest import ALL_ARCHES, CROSS, FACTS, cc, instrument, run, write_spec

ARCHES = ALL_ARCHES
LOCAL = "qemu" if CROSS else "native"      # the runner of the tests that run once
# An arch whose back end writes no unwind table for the new code yet (no unwind_info()):
# every test here fails there, and must pass once it does.
pytestmark = pytest.mark.xfail(not FACTS.DETOUR_CFI, strict=True,
                               reason="the back end writes no unwind table for detours (rewriter/targets/linux_user/unwind.py)")

PROGRAM = r"""
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>
static void on_ill(int sig, siginfo_t *si, void *uc)
{
    void *pcs[64];
    int n = backtrace(pcs, 64);
    backtrace_symbols_fd(pcs, n, 1);
    write(1, "--\n", 3);
    ((ucontext_t *)uc)->UC_PC += ILL_SIZE;     /* over the handler's illegal instruction */
}
volatile int sink;
__attribute__((noinline)) int c(int x) { sink += x; return x * 3 + sink; }
__attribute__((noinline)) int b(int x) { int r = c(x + 1); sink += r; return r + 1; }
__attribute__((noinline)) int a(int x) { int r = b(x + 1); sink += r; return r + 2; }
int main(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_ill;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGILL, &sa, NULL);
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("r=%d\n", a(1));
    return 0;
}
""".replace("UC_PC", FACTS.UC_PC).replace("ILL_SIZE", str(FACTS.ILLEGAL_INSN[1]))

HANDLERS = r"""
#include <linux/kprobes.h>
static int n;
int pre(struct kprobe *p, struct pt_regs *regs) { __asm__ volatile("ud2"); return 0; }
int count(struct kprobe *p, struct pt_regs *regs) { n++; return 0; }
int ret(struct kretprobe_instance *ri, struct pt_regs *regs) { __asm__ volatile("ud2"); return 0; }
""".replace("ud2", FACTS.ILLEGAL_INSN[0])

SPECS = {
    "optimized": ('[[kprobe]]\nsymbol_name = "c"\npre_handler = "pre"\n', ()),
    # Two probes on one site: the probe stub, kp_optprobe_clean_entry and the C callback.
    "aggregated": ('[[kprobe]]\nsymbol_name = "c"\npre_handler = "pre"\n'
                   '[[kprobe]]\nsymbol_name = "c"\npre_handler = "count"\n', ()),
    "breakpoint": ('[[kprobe]]\nsymbol_name = "c"\npre_handler = "pre"\n', ("--no-optimize",)),
    "kretprobe": ('[[kretprobe]]\nsymbol_name = "c"\nhandler = "ret"\n', ()),
}

PT_LOAD, PT_GNU_EH_FRAME = 1, 0x6474E550


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unwind")
    return cc(tmp, "prog", PROGRAM, "-O1", "-fno-inline", "-rdynamic")


def _phdrs(data: bytes):
    off, num = struct.unpack_from("<Q", data, 32)[0], struct.unpack_from("<H", data, 56)[0]
    return [(off + i * 56, struct.unpack_from("<IIQQQQQQ", data, off + i * 56)) for i in range(num)]


def frames(stdout: str) -> list[str]:
    """The first backtrace's frames: the function name (or '' for an address
    with none: the handler, the runtime, a detour)."""
    out = []
    for line in stdout.split("--\n")[0].splitlines():
        m = re.match(r".*\((\w*)\+0x[0-9a-f]+\)\[", line) or re.match(r".*\(\)\[", line)
        out.append(m.group(1) if m and m.groups() else "")
    return out


@pytest.mark.parametrize("kind", SPECS)
def test_backtrace_in_handler_reaches_the_callers(prog, tmp_path, kind):
    text, extra = SPECS[kind]
    spec = write_spec(tmp_path, 'handlers = ["handlers.c"]\n' + text, HANDLERS)
    out = instrument(prog, spec, tmp_path / "prog.kp", *extra)
    r = run(out, runner=LOCAL)
    assert r.returncode == 0 and "r=15" in r.stdout, (r.returncode, r.stdout, r.stderr)
    names = frames(r.stdout)
    assert "c" in names, r.stdout
    i = names.index("c")
    # The probed function, its callers in order; before it the handler and the new code.
    assert names[i:i + 4] == ["c", "b", "a", "main"], r.stdout
    assert names[:i].count("") >= 2, r.stdout      # the handler, the detour or the runtime
    assert names[0] == "on_ill" or names[0] == "", r.stdout

    # The input's own PT_GNU_EH_FRAME put back: the unwinder finds no FDE for the
    # handler (the runtime's are not in that table) and the backtrace stops there.
    data = bytearray(out.read_bytes())
    orig = dict((h[1][0], h[1]) for h in _phdrs(prog.read_bytes()))[PT_GNU_EH_FRAME]
    for off, h in _phdrs(bytes(data)):
        if h[0] == PT_GNU_EH_FRAME:
            struct.pack_into("<IIQQQQQQ", data, off, *orig)
    old = tmp_path / "prog.oldtable"
    old.write_bytes(bytes(data))
    old.chmod(0o755)
    r = run(old, runner=LOCAL)
    assert "c" not in frames(r.stdout), r.stdout


def test_the_tables_are_deterministic(prog, tmp_path):
    """Same input, same spec: the same bytes, unwind tables included."""
    text, _ = SPECS["kretprobe"]
    spec = write_spec(tmp_path, 'handlers = ["handlers.c"]\n' + text, HANDLERS)
    one = instrument(prog, spec, tmp_path / "one").read_bytes()
    two = instrument(prog, spec, tmp_path / "two").read_bytes()
    assert one == two
    eh = [h for _, h in _phdrs(one) if h[0] == PT_GNU_EH_FRAME]
    loads = [h for _, h in _phdrs(one) if h[0] == PT_LOAD]
    # The table lies in the last, read-only, segment the rewrite added.
    assert eh and loads[-1][3] <= eh[0][3] < loads[-1][3] + loads[-1][6] and loads[-1][1] == 4


def test_unwind_programs_from_the_layout_are_those_of_the_final_code(prog, tmp_path, monkeypatch):
    """The detours' call frame programs are computed from the code the layout
    sized (placeholder runtime addresses) while the linker runs: they must be
    those the final code gives, for every kind of detour (light, template, clean,
    full, aggregated, return sites)."""
    import dataclasses

    from rewriter.emit import emission, layout
    from rewriter import link, pipeline
    from rewriter.targets.linux_user import unwind
    monkeypatch.setenv("KPREWRITE_CACHE", str(tmp_path / "cache"))      # nothing cached: computed
    spec = write_spec(tmp_path, 'handlers = ["handlers.c"]\n'
                      '[[kprobe]]\nsymbol_name = "*"\n[[kretprobe]]\nsymbol_name = "*"\n'
                      '[[kprobe]]\nsymbol_name = "c"\npre_handler = "pre"\n'
                      '[[kprobe]]\nsymbol_name = "b"\npre_handler = "count"\n', HANDLERS)
    s = pipeline.prepare(str(prog), str(spec))
    objs = pipeline.compile_handlers(s, tmp_path)
    c = emission.Code(s.image, s.arch, s.plan, s.handler_symbols, set(s.traces), s.target.thread_key(s.image))
    lay = layout.place(c, s.target)
    early = unwind.programs(s.plan, lay, s.arch)
    assert len(early) >= 6 and lay.code
    pipeline.build(s, objs, tmp_path)        # the real symbols: emission.emit()'s code
    blob = link.read_blob((tmp_path / "blob.elf").read_bytes(), tmp_path / "blob.elf")
    rx, _ = emission.emit(c, lay, blob.symbols)
    final = unwind.programs(s.plan, dataclasses.replace(lay, code={}), s.arch, rx)     # all from rx
    assert sorted(early) == sorted(final)

    # Computed by worker processes (a large image's: unwind.PARALLEL_PIECES), the same,
    # in the same order; and no worker is left once they are read.
    from rewriter.analysis import workers
    monkeypatch.setattr(unwind, "PARALLEL_PIECES", 1)
    monkeypatch.setattr(workers, "jobs", lambda: 2)
    started = unwind.Programs(s.plan, lay, s.arch)
    assert started.job is not None and len(started.job.conns) == 2
    pids = list(started.job.conns)
    assert started.result() == early and started.job is None
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)

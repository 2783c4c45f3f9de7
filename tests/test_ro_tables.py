"""Read-only probe tables: once the runtime has relocated itself, the
handlers the dispatch calls (kp_site_handlers[], kp_kret_handlers[]), the sites,
their probe lists and the breakpoint descriptors are read-only (runtime/kp_core.c, kp_relocate(); the linker
script's .data.rel.ro in rewriter/link/ld.py).  A probed program with a memory-corruption
bug -- here a deliberate out-of-bounds write past one of its own arrays -- that
overwrites a handler pointer dies of SIGSEGV at the write instead of running its
value at the next hit; overwriting the (still writable) handler fields of
struct kprobe calls nothing either.  Natively and under qemu-user."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from conftest import ALL_ARCHES, cc, instrument, run, symbols, write_spec

ARCHES = ALL_ARCHES

RUNTIME_INCLUDE = Path(__file__).resolve().parent.parent / "runtime" / "include"

# argv[1]: a byte offset from `table` (in the program's .bss) to write &evil at; no
# argument: no write.  The program is not PIE, so its tables (and the runtime's)
# are where a first run's handler says they are.
PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
long table[4];
__attribute__((noinline)) int evil(void) { puts("evil"); fflush(stdout); return 0; }
__attribute__((noinline)) long work(long x) { __asm__ volatile("" ::: "memory"); return x * 3; }
__attribute__((noinline)) long caller(long x) { return work(x) + 1; }
int main(int argc, char **argv)
{
    if (argc > 1) {
        long off = strtol(argv[1], 0, 0);
        table[off / (long)sizeof(long)] = (long)evil;     /* out of bounds */
        puts("written");
        fflush(stdout);
    }
    printf("%ld\n", caller(2));
    return 0;
}
"""

HANDLERS = r"""
#include <kprewrite/kprobes.h>
#include <linux/printk.h>
extern char kp_site_handlers[], kp_kret_handlers[], kp_site_probes[], kp_sites[], kp_probes[], kp_breakpoints[];
static int pre(struct kprobe *p, struct pt_regs *regs)
{
    printk("pre\n");
    printk("at kp_site_handlers=%lx kp_kret_handlers=%lx kp_site_probes=%lx kp_sites=%lx kp_probes=%lx "
           "kp_breakpoints=%lx\n", (unsigned long)kp_site_handlers, (unsigned long)kp_kret_handlers,
           (unsigned long)kp_site_probes, (unsigned long)kp_sites, (unsigned long)kp_probes,
           (unsigned long)kp_breakpoints);
    return 0;
}
static void post(struct kprobe *p, struct pt_regs *regs, unsigned long flags) { printk("post\n"); }
static int second(struct kprobe *p, struct pt_regs *regs) { printk("second\n"); return 0; }
static int ret(struct kretprobe_instance *ri, struct pt_regs *regs) { printk("ret\n"); return 0; }
"""

SPEC = """handlers = ["handlers.c"]
[[kprobe]]
symbol_name = "work"
pre_handler = "pre"
post_handler = "post"
[[kprobe]]
symbol_name = "work"
pre_handler = "second"
[[kretprobe]]
symbol_name = "caller"
handler = "ret"
"""

PTR = 8
KPROBE_PRE, KPROBE_POST = 3 * PTR, 4 * PTR        # struct kprobe: addr, symbol_name, offset, pre, post
HANDLER_LINES = ["pre", "second", "post", "ret"]


@pytest.fixture(scope="module", params=["optimized", "int3"])
def built(request, tmp_path_factory):
    """The rewrite (jump-optimized, or breakpoints: the trap's dispatch) and the
    address of the program's `table`."""
    tmp = tmp_path_factory.mktemp("ro_tables")
    prog = cc(tmp, "prog", PROGRAM, "-O1", "-no-pie")
    flags = ["--no-optimize"] if request.param == "int3" else []
    out = instrument(prog, write_spec(tmp, SPEC, HANDLERS), tmp / "prog.kp", *flags)
    return out, symbols(prog)["table"]


def _run(out: Path, runner: str, *args):
    r = run(out, *args, runner=runner)
    return r.returncode, r.stdout, r.stderr


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("at ")]


def _offset(built, runner: str, name: str) -> str:
    """argv[1] that makes the program write over `name` (its address from a first run)."""
    out, table = built
    rc, stdout, stderr = _run(out, runner)
    assert rc == 0, stderr
    at = dict(w.split("=") for line in stderr.splitlines() if line.startswith("at ") for w in line.split()[1:])
    return hex(int(at[name], 16) - table)


def test_no_write_runs(built, runner):
    out, _ = built
    rc, stdout, stderr = _run(out, runner)
    assert rc == 0, stderr
    assert stdout == "7\n"
    assert _lines(stderr) == HANDLER_LINES, stderr


@pytest.mark.parametrize("table,offset", [("kp_site_handlers", 0), ("kp_site_handlers", PTR),
                                          ("kp_site_handlers", 2 * PTR), ("kp_kret_handlers", 0),
                                          ("kp_site_probes", 0), ("kp_sites", 0), ("kp_breakpoints", PTR)])
def test_overwrite_read_only_table_faults(built, runner, table, offset):
    """A write over a handler pointer (or the site and probe lists that lead to
    one, or a breakpoint's descriptor: its out-of-line slot) is a SIGSEGV at the
    write: nothing is called."""
    rc, stdout, stderr = _run(built[0], runner, hex(int(_offset(built, runner, table), 16) + offset))
    assert rc == -signal.SIGSEGV, (rc, stdout, stderr)
    assert "written" not in stdout and "evil" not in stdout


@pytest.mark.parametrize("field", [KPROBE_PRE, KPROBE_POST])
def test_struct_kprobe_handler_fields_not_called(built, runner, field):
    """struct kprobe's handler fields stay writable (beside nmissed and flags) but
    the dispatch does not call them: the write takes no effect."""
    rc, stdout, stderr = _run(built[0], runner, hex(int(_offset(built, runner, "kp_probes"), 16) + field))
    assert rc == 0, (rc, stdout, stderr)
    assert stdout == "written\n7\n"
    assert _lines(stderr) == HANDLER_LINES, stderr

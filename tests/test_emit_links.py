"""emission.emit() patches the code the layout built (placeholder runtime
addresses) where the arch logged a field reaching the runtime (Layout.links),
rather than building each detour again: the result must be the bytes a build
with the linked runtime's symbols gives, for every kind of detour (templates
clean and full, a kretprobe's entry and inlined return hooks, aggregated sites
through the probe stubs, a post_handler's second stub, a short function's
region holding its ret, light detours, return sites)."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import ARCH, cc, write_spec

ARCHES = ["x86_64"]      # x86-64 only: x86-64 assembly; x86-64 logs its links (AArch64 builds each detour again)

PROGRAM = r"""
#include <stdio.h>
volatile int sink;
__attribute__((noinline)) int leaf(int x) { return x + 1; }
__attribute__((noinline)) int loop(int n) { int s = 0; for (int i = 0; i < n; i++) s += leaf(i) ^ sink; return s; }
__attribute__((noinline)) int c(int x) { sink += x; return x * 3 + sink; }
__attribute__((noinline)) int b(int x) { int r = c(x + 1); sink += r; return r + 1; }
__attribute__((noinline)) int a(int x) { int r = b(x + 1); sink += r; return r + 2; }
__attribute__((noinline)) int tail(int x) { sink++; return c(x); }
/* Two-byte instructions: probes at +0, +2 and +4 share one region; a tail jump. */
__asm__(".text\n.globl s_two\n.type s_two,@function\ns_two:\n"
        "  mov %edi,%eax\n  add %eax,%eax\n  inc %eax\n  inc %eax\n  ret\n.size s_two,.-s_two\n"
        ".globl tailj\n.type tailj,@function\ntailj:\n"
        "  add $1,%edi\n  add $2,%edi\n  jmp c\n.size tailj,.-tailj\n");
int s_two(int), tailj(int);
int main(void) { printf("%d %d %d %d %d\n", a(1), loop(5), tail(2), s_two(3), tailj(4)); return 0; }
"""

HANDLERS = r"""
#include <linux/kprobes.h>
static int n;
int count(struct kprobe *p, struct pt_regs *regs) { n++; return 0; }
int full(struct kprobe *p, struct pt_regs *regs) { n += regs->ip & 1; return 0; }
void post(struct kprobe *p, struct pt_regs *regs, unsigned long flags) { n++; }
int enter(struct kretprobe_instance *ri, struct pt_regs *regs) { n++; return 0; }
int ret(struct kretprobe_instance *ri, struct pt_regs *regs) { n++; return 0; }
int fullret(struct kretprobe_instance *ri, struct pt_regs *regs) { n += regs->ax & 1; return 0; }
"""

SPECS = {
    "handlers": 'handlers = ["handlers.c"]\n'
                '[[kprobe]]\nsymbol_name = "a"\npre_handler = "count"\n'              # clean template
                '[[kprobe]]\nsymbol_name = "b"\npre_handler = "full"\n'               # full template
                '[[kprobe]]\nsymbol_name = "c"\npre_handler = "count"\n'              # aggregated
                '[[kprobe]]\nsymbol_name = "c"\npre_handler = "full"\n'
                '[[kprobe]]\nsymbol_name = "loop"\npre_handler = "count"\npost_handler = "post"\n'
                '[[kretprobe]]\nsymbol_name = "leaf"\nhandler = "ret"\n'              # its ret in the region
                '[[kretprobe]]\nsymbol_name = "tail"\nhandler = "fullret"\nentry_handler = "enter"\n'
                '[[kretprobe]]\nsymbol_name = "main"\nhandler = "ret"\nentry_handler = "enter"\n'
                '[[kretprobe]]\nsymbol_name = "tailj"\nhandler = "ret"\n'                # a tail jump's hook
                '[[kprobe]]\nsymbol_name = "s_two"\npre_handler = "count"\n'          # a shared region
                '[[kprobe]]\nsymbol_name = "s_two"\noffset = 2\npre_handler = "count"\n'
                '[[kprobe]]\nsymbol_name = "s_two"\noffset = 4\npre_handler = "full"\n',
    "light": '[[kprobe]]\nsymbol_name = "*"\n',
    "every": 'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "*"\n'
             '[[kretprobe]]\nsymbol_name = "*"\nhandler = "ret"\n',
}


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    return cc(tmp_path_factory.mktemp("links"), "prog", PROGRAM, "-O1", "-fno-inline")


@pytest.mark.skipif(ARCH != "x86_64", reason="x86-64 logs its links (aarch64 builds each detour again)")
@pytest.mark.parametrize("kind", SPECS)
def test_patched_detours_are_the_detours_built_again(prog, tmp_path, monkeypatch, kind):
    from rewriter.emit import emission, layout
    from rewriter import link, pipeline
    monkeypatch.setenv("KPREWRITE_CACHE", str(tmp_path / "cache"))
    spec = write_spec(tmp_path, SPECS[kind], HANDLERS)
    s = pipeline.prepare(str(prog), str(spec))
    objs = pipeline.compile_handlers(s, tmp_path)
    pipeline.build(s, objs, tmp_path)
    blob = link.read_blob((tmp_path / "blob.elf").read_bytes(), tmp_path / "blob.elf")
    c = emission.Code(s.image, s.arch, s.plan, s.handler_symbols, set(s.traces), s.target.thread_key(s.image))
    lay = layout.place(c, s.target)
    assert lay.links and any(lay.links.values()), "no detour's links logged"
    patched = emission.emit(c, lay, blob.symbols)
    built = emission.emit(c, dataclasses.replace(lay, links={}), blob.symbols)
    assert patched[1] == built[1]
    # Detour by detour, to name the one that differs.
    for key, at in [(("site", st.index), lay.detour(st)) for st in s.plan.sites] + \
                   [(("ret", rs.addr), lay.detour(rs)) for rs in s.plan.ret_sites]:
        if key in lay.links:
            o, n = at - lay.rx_vaddr, lay.sizes[key]
            assert patched[0][o:o + n] == built[0][o:o + n], (key, hex(at))
    assert patched[0] == built[0]
    forms = {(st.template, st.clean, st.light, bool(st.ret_hooks), st.with_post)
             for st in s.plan.sites if ("site", st.index) in lay.links}
    assert len(forms) >= (3 if kind == "handlers" else 1), forms
    if kind != "light":
        assert any(k[0] == "ret" for k in lay.links), "no return site linked"
    if kind == "handlers":      # a region's head and riders jump one to the next: built again
        assert any(st.riders for st in s.plan.sites)

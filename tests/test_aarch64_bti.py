"""AArch64 pointer authentication and BTI: programs built with
-mbranch-protection (BTI landing pads, paciasp/autiasp) and marked BTI in
their GNU property note, run under `qemu-aarch64 -cpu max`, which maps a
BTI-marked ELF's code guarded (an indirect branch that lands on anything but a
landing pad raises SIGILL) and authenticates return addresses.

The programs are freestanding (-nostdlib, raw system calls): Debian's crt
files carry no BTI note, so a libc program cannot be BTI-marked honestly.
Checked: entry probes on `paciasp` (the landing pad of an indirect call: a
breakpoint, with the landing_pad refusal, where the pages are guarded; a `B`
where they are not), kretprobes on functions that sign their return address
(hooked exits and the trampoline), a shared object whose start-up stub is
called by ld.so through a register, and that the output keeps the note."""
from __future__ import annotations

import subprocess

import pytest

from conftest import cc, check_lines, function, instrument, qemu_command, write_spec

ARCHES = ["aarch64"]

PROGRAM = r"""
static long sys3(long n, long a, long b, long c) {
    register long x8 __asm__("x8") = n, x0 __asm__("x0") = a, x1 __asm__("x1") = b, x2 __asm__("x2") = c;
    __asm__ volatile("svc #0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2) : "memory");
    return x0;
}
__attribute__((noinline)) void putnum(const char *tag, long v) {
    char buf[64], d[24]; int n = 0, k = 0;
    while (*tag) buf[n++] = *tag++;
    if (v < 0) { buf[n++] = '-'; v = -v; }
    do { d[k++] = '0' + v % 10; v /= 10; } while (v);
    while (k) buf[n++] = d[--k];
    buf[n++] = '\n';
    sys3(64, 1, (long)buf, n);
}
__attribute__((noinline)) int leaf(int a) { return a * 3; }
/* Signs x30 (paciasp, its landing pad: called through fp) and authenticates it. */
__attribute__((noinline)) int mid(int a) { int r = leaf(a) + 1; putnum("mid ", r); return r; }
/* A br (exits unknown: the kretprobe trampoline); GCC shrink-wraps its paciasp
   after the entry, so the trampoline address in x30 is signed and authenticated. */
__attribute__((noinline)) int cg(int x) {
    static void *t[] = {&&a, &&b, &&c};
    goto *t[x % 3];
a: putnum("a ", x); return x + 100;
b: return x + 200;
c: return x + 300;
}
int (*volatile fp)(int) = mid;
void _start(void) {
    long t = 0;
    for (int i = 0; i < 3; i++) t += fp(i) + cg(i);
    putnum("t ", t);
    sys3(93, 0, 0, 0);
}
"""

HANDLERS = r"""
#include <linux/kprobes.h>
int pre(struct kprobe *p, struct pt_regs *regs)
{
    pr_info("pre %s+%u x0=%ld\n", p->symbol_name, p->offset, (long)regs->regs[0]);
    return 0;
}
int ret_handler(struct kretprobe_instance *ri, struct pt_regs *regs)
{
    pr_info("ret %s = %ld\n", ri->rp->kp.symbol_name, (long)regs_return_value(regs));
    return 0;
}
"""

SPEC = """handlers = ["handlers.c"]
[[kprobe]]
symbol_name = "mid"
pre_handler = "pre"
[[kprobe]]
symbol_name = "leaf"
pre_handler = "pre"
[[kretprobe]]
symbol_name = "mid"
handler = "ret_handler"
[[kretprobe]]
symbol_name = "cg"
handler = "ret_handler"
"""

# -mbranch-protection=standard: BTI and PAC; pac-ret: PAC only (no BTI note).
PROTECTION = {"bti+pac": ("-mbranch-protection=standard", "-Wl,-z,force-bti"),
              "pac": ("-mbranch-protection=pac-ret",)}


def run_max(binary, env=None):
    """Under qemu-aarch64 -cpu max (BTI and PAC): returncode, stdout, stderr."""
    import os
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([*qemu_command(), "-cpu", "max", str(binary)], capture_output=True, text=True,
                          env=e, timeout=120)


def gnu_property(binary) -> str:
    r = subprocess.run(["readelf", "-n", str(binary)], capture_output=True, text=True)
    return " ".join(l.strip() for l in r.stdout.splitlines() if "AArch64 feature" in l)


@pytest.fixture(scope="module")
def progs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bti")
    out = {}
    for k, flags in PROTECTION.items():
        p = cc(tmp, f"prog-{k}", PROGRAM, "-O2", "-static", "-nostdlib", *flags)
        r = run_max(p)
        assert r.returncode == 0 and r.stdout.endswith("t 615\n"), r.stdout + r.stderr
        out[k] = p
    assert "BTI" in gnu_property(out["bti+pac"]) and "BTI" not in gnu_property(out["pac"])
    return tmp, out


def test_bti_is_enforced(tmp_path):
    """The control: under -cpu max an indirect call in a BTI-marked program to
    code without a landing pad dies (so the runs below mean something)."""
    bad = cc(tmp_path, "bad", r"""
int nopad(int);
__asm__(".text\n.globl nopad\n.type nopad,%function\nnopad:\n add w0, w0, #1\n ret\n");
int (*volatile f)(int) = nopad;
void _start(void) {
    register long x8 __asm__("x8") = 93, x0 __asm__("x0") = f(1);
    __asm__ volatile("svc #0" :: "r"(x8), "r"(x0));
}
""", "-O2", "-static", "-nostdlib", "-mbranch-protection=standard", "-Wl,-z,force-bti")
    r = run_max(bad)
    assert r.returncode != 2 and r.returncode != 0, r


@pytest.mark.parametrize("mode", ["optimized", "brk"])
@pytest.mark.parametrize("prot", list(PROTECTION))
def test_entry_and_return_probes(progs, prot, mode):
    tmp, built = progs
    prog = built[prot]
    spec = write_spec(tmp, SPEC, HANDLERS, name=f"{prot}-{mode}.toml")
    extra = ("--no-optimize",) if mode == "brk" else ()
    plan = {l.split("  ")[0] + l.split("  ")[1]: l for l in check_lines(prog, spec, *extra)}
    mid, _ = function(prog, "mid")
    lo = 4 if prot == "bti+pac" else 0
    if mode == "optimized":
        if prot == "bti+pac":
            # mid's paciasp is its landing pad: no B over it while the pages are guarded.
            assert f"int3  landing_pad at {mid:#x}" in plan["mid+0x0k"], plan
            # mid's kretprobe has the same entry: a breakpoint, and `check` says so.
            assert plan["mid+0x0r"].startswith(f"mid+0x0  r  int3  landing_pad at {mid:#x}"), plan
        else:
            assert "optimized" in plan["mid+0x0k"], plan
        # leaf's probe past its bti c (BTI builds; arch_adjust_kprobe_addr()).
        assert "optimized" in plan[f"leaf+{lo:#x}k"], plan
        assert "returns: trampoline" in plan[f"cg+{lo:#x}r"], plan
    out = instrument(prog, spec, tmp / f"{prot}-{mode}.kp", *extra)
    assert gnu_property(out) == gnu_property(prog)          # the note is kept, and honest
    r = run_max(out)
    assert r.returncode == 0 and r.stdout == run_max(prog).stdout, r.stdout + r.stderr
    want = []
    for i in range(3):
        want += [f"pre mid+0 x0={i}", f"pre leaf+{lo} x0={i}", f"ret mid = {3 * i + 1}", f"ret cg = {i + 100 * (i + 1)}"]
    assert [l for l in r.stderr.splitlines() if l.startswith(("pre ", "ret "))] == want, r.stderr


LIBRARY = r"""
int ready;
__attribute__((constructor)) static void init(void) { ready = 1; }
__attribute__((noinline)) int libwork(int n) { int s = 0; for (int i = 0; i < n; i++) s += i * 2 + 1; return s * ready; }
"""
LIB_MAIN = r"""
#include <stdio.h>
int libwork(int);
int main(void) { int t = 0; for (int i = 0; i < 5; i++) t += libwork(i); printf("lib total %d\n", t); return 0; }
"""


@pytest.mark.parametrize("mode", ["optimized", "brk"])
def test_bti_shared_object(tmp_path, mode):
    """A BTI-marked shared object (ld.so maps it guarded, mprotect PROT_BTI):
    ld.so calls the runtime's start-up through a register from the init array,
    handlers through the runtime's pointers; both land on `bti c`."""
    lib = cc(tmp_path, "libw.so", LIBRARY, "-O2", "-shared", "-fPIC", "-nostartfiles",
             "-mbranch-protection=standard", "-Wl,-z,force-bti")
    assert "BTI" in gnu_property(lib)
    main = cc(tmp_path, "main", LIB_MAIN, "-O2", f"-L{tmp_path}", "-lw")
    spec = write_spec(tmp_path, 'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "libwork"\n'
                      'pre_handler = "pre"\n[[kretprobe]]\nsymbol_name = "libwork"\nhandler = "ret_handler"\n',
                      HANDLERS)
    extra = ("--no-optimize",) if mode == "brk" else ()
    (tmp_path / "out").mkdir()
    instrument(lib, spec, tmp_path / "out" / "libw.so", *extra)
    assert gnu_property(tmp_path / "out" / "libw.so") == gnu_property(lib)
    r = run_max(main, env={"QEMU_LD_LIBRARY_PATH": str(tmp_path / "out"),
                           "LD_LIBRARY_PATH": str(tmp_path / "out")})
    assert r.returncode == 0 and r.stdout == "lib total 30\n", r.stdout + r.stderr
    assert [l for l in r.stderr.splitlines() if l.startswith("ret ")] == [
        f"ret libwork = {i * i}" for i in range(5)], r.stderr

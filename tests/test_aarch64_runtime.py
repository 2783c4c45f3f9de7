"""The runtime's AArch64 folders, built with the cross toolchain and proved under
qemu-aarch64 whatever the host (so it runs in the default x86-64 run too):
every source of the linux_user recipe compiles for aarch64 with the recipe's and
the arch's flags; the asm-offsets give the pt_regs layout kp_regs.h documents;
Linux's ABI in arch/aarch64/uapi/kp_uapi.h matches the cross C library's own
headers; and a freestanding program linked with the platform's signal, sighook
and clock objects (tests/aarch64/uapi_probe.c, regs.S) uses the raw system
calls, the thread pointer, the auxiliary vector, the fault-free copy, the
kp_regs.h save/restore macros and the SIGTRAP path (a real `brk #0x004`, the
ucontext, SA_RESTORER's rt_sigreturn, forwarding to the program's handler), and
prints what it saw."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ALL_ARCHES, ROOT, qemu_command
from rewriter.link import runtime as lr

ARCHES = ALL_ARCHES      # conftest: cross-built, runs on either host
ARCH, PLATFORM = "aarch64", "linux_user"
CC = "aarch64-linux-gnu-gcc"
HERE = Path(__file__).resolve().parent / "aarch64"
RUNTIME = ROOT / "runtime"
# The objects the probe program links (the rest need a rewriter's probe tables).
LINKED = ["platform/linux_user/kp_signal.c", "platform/linux_user/kp_sighook.c",
          "platform/linux_user/clock_cpus.c", "kp_lib.c", "arch/aarch64/linux_user/sigreturn.S"]


def _cc(*args, what):
    r = subprocess.run([CC, *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, f"{what}:\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The runtime compiled for aarch64 (object per source, kp_asm_offsets.h), as
    link/runtime.py builds it."""
    if not shutil.which(CC):
        pytest.skip(f"{CC} not installed (gcc-aarch64-linux-gnu)")
    out = tmp_path_factory.mktemp("aarch64_runtime")
    flags, inc = lr.cflags(ARCH, PLATFORM), lr._includes(ARCH, PLATFORM)
    c_srcs, asm_srcs, offset_srcs = lr._runtime_files(ARCH, PLATFORM)
    offsets = {}
    for i, src in enumerate(offset_srcs):
        _cc(*flags, *inc, "-S", RUNTIME / src, "-o", out / f"off{i}.s", what=src)
        offsets.update((n, int(v)) for n, v in re.findall(r'"->(\w+) [$#]?(-?\d+)"', (out / f"off{i}.s").read_text()))
    (out / "include").mkdir()
    (out / "include" / "kp_asm_offsets.h").write_text("".join(f"#define {n} {v}\n" for n, v in offsets.items()))
    objs = {}
    for src in c_srcs + asm_srcs:
        if not (RUNTIME / src).exists():
            # The brk trap code (arch/aarch64/linux_user/kp_brk_signal.c, with kp_brk.c) is
            # the back end's; compiled once it is there.
            assert src == "arch/aarch64/linux_user/kp_brk_signal.c", src
            continue
        o = out / (src.replace("/", "_") + ".o")
        _cc(*(flags if src.endswith(".c") else ()), *inc, f"-I{out / 'include'}", "-c", RUNTIME / src, "-o", o, what=src)
        objs[src] = o
    return out, flags, inc, offsets, objs


def test_every_runtime_source_compiles_for_aarch64(built):
    _, _, _, _, objs = built
    assert "arch/aarch64/linux_user/sigreturn.S" in objs and "kp_core.c" in objs and len(objs) >= 12
    for o in objs.values():
        nm = subprocess.run(["aarch64-linux-gnu-nm", "-u", str(o)], capture_output=True, text=True).stdout
        # Freestanding: no libgcc helpers (outline atomics), no libc beyond kp_lib.c's.
        assert "__aarch64_" not in nm, (o, nm)


def test_pt_regs_layout(built):
    """What kp_regs.h documents and the emitted detours rely on."""
    offsets = built[3]
    assert [offsets[f"PT_X{n}"] for n in range(31)] == [8 * n for n in range(31)]
    assert (offsets["PT_FP"], offsets["PT_LR"]) == (232, 240)
    assert (offsets["PT_SP"], offsets["PT_PC"], offsets["PT_PSTATE"]) == (248, 256, 264)
    assert (offsets["PT_ORIG_X0"], offsets["PT_SYSCALLNO"], offsets["PT_SIZE"]) == (272, 280, 288)
    assert offsets["ARITH_FLAGS"] == 0xf0000000 and offsets["BREAKPOINT_SITE_SIZE"] == 64
    assert offsets["KPROBE_SIZE"] == 72     # generic structures, as on x86-64 (LP64 both)


def test_uapi_matches_the_c_library(tmp_path, built):
    """Every number and offset of kp_uapi.h against the cross toolchain's own
    headers: a static assertion each, so a wrong one fails to compile."""
    uapi = (RUNTIME / "arch/aarch64/uapi/kp_uapi.h").read_text()
    nrs = re.findall(r"^#define (__NR_\w+) \d+", uapi, re.M)
    assert len(nrs) >= 20
    src = tmp_path / "uapi_check.c"
    src.write_text(
        "#define _GNU_SOURCE\n#include <asm/unistd.h>\n#include <signal.h>\n#include <ucontext.h>\n#include <stddef.h>\n"
        "#include <fcntl.h>\n"
        + "".join(f"enum {{ v_{n} = {n} }};\n#undef {n}\n" for n in nrs)
        + '#include "kp_uapi.h"\n'
        + "".join(f'_Static_assert(v_{n} == {n}, "{n}");\n' for n in nrs)
        + "".join(f'_Static_assert({a} == {b}, "{a}");\n' for a, b in [
            ("KP_AT_FDCWD", "AT_FDCWD"),
            ("KP_SA_SIGINFO", "SA_SIGINFO"), ("KP_SA_RESTORER", "0x04000000"), ("KP_SA_ONSTACK", "SA_ONSTACK"),
            ("KP_SA_RESTART", "SA_RESTART"), ("KP_SA_NODEFER", "SA_NODEFER"), ("KP_SA_RESETHAND", "SA_RESETHAND"),
            ("KP_UC_SIGMASK", "offsetof(ucontext_t, uc_sigmask)"),
            ("KP_UC_MCONTEXT", "offsetof(ucontext_t, uc_mcontext)"),
            ("KP_UC_FAULT_ADDRESS", "offsetof(ucontext_t, uc_mcontext.fault_address)"),
            ("KP_UC_REGS", "offsetof(ucontext_t, uc_mcontext.regs)"),
            ("KP_UC_SP", "offsetof(ucontext_t, uc_mcontext.sp)"),
            ("KP_UC_PC", "offsetof(ucontext_t, uc_mcontext.pc)"),
            ("KP_UC_PSTATE", "offsetof(ucontext_t, uc_mcontext.pstate)"),
            ("KP_UC_RESERVED", "offsetof(ucontext_t, uc_mcontext.__reserved)"),
            ("sizeof(struct kp_ucontext)", "sizeof(ucontext_t)"),
            ("KP_TRAP_BRKPT", "TRAP_BRKPT")]))
    _cc("-fsyntax-only", f"-I{RUNTIME / 'arch/aarch64/uapi'}", src, what="kp_uapi.h against the C library")


def test_sample_handlers_compile_for_aarch64(tmp_path):
    """samples/kprobe_example's handlers (the kernel's, with its CONFIG_ARM64 branch)."""
    if not shutil.which(CC):
        pytest.skip(f"{CC} not installed")
    src = ROOT / "samples/kprobe_example/handlers.c"
    flags = (*lr.cflags(ARCH, PLATFORM), *lr._includes(ARCH, PLATFORM))    # as link/compile.py compiles them
    _cc(*flags, "-Werror=implicit-function-declaration", "-c", src, "-o", tmp_path / "h.o", what=src)
    r = _cc(*flags, "-E", src, what=src)
    assert "regs->pstate" in r.stdout and "regs->ip" not in r.stdout


@pytest.fixture(scope="module")
def probe_program(built):
    out, flags, inc, _, objs = built
    prog = out / "uapi_probe"
    _cc(*flags, *inc, "-c", HERE / "uapi_probe.c", "-o", out / "uapi_probe.o", what="uapi_probe.c")
    _cc(*inc, f"-I{out / 'include'}", "-c", HERE / "regs.S", "-o", out / "regs.o", what="regs.S")
    _cc("-nostdlib", "-static", "-o", prog, out / "uapi_probe.o", out / "regs.o", *(objs[s] for s in LINKED),
        what="linking uapi_probe")
    return prog


def _run(prog, *args):
    r = subprocess.run([*qemu_command(ARCH), str(prog), *args], capture_output=True, text=True, timeout=60)
    return r, dict(l.split(" ", 1) for l in r.stdout.splitlines() if " " in l)


def test_platform_system_calls(probe_program):
    r, out = _run(probe_program)
    assert r.returncode == 0, r.stdout + r.stderr
    assert out["pid==tid"] == "1"
    # tpidr_el0 is 0 with no C library, and what was written is read back.
    assert out["tp"] == "0x0 -> 0x7f0012345000 0x7f0012345000"
    # openat(AT_FDCWD) through kp_sys_open(); the same page size as the stack's auxv.
    assert re.fullmatch(r"fd 1 pagesz (\d+) \1", out["auxv"]) and "pagesz 0 " not in out["auxv"], out["auxv"]
    assert out["ncpus"] == "1 ktime 1"
    # mprotect 0; a readable word copied; a PROT_NONE page is -EFAULT, not a crash.
    assert out["mmap"] == "1 mprotect 0 copy 0 0x5a5a1234 unmapped -14"
    assert out["cpu"] == "1"


def test_pt_regs_save_restore_macros(probe_program):
    r, out = _run(probe_program)
    assert out["regs:"] == "saved 1 restored 1 size 288", r.stdout


def test_brk_trap_and_forwarding(probe_program):
    """A brk #0x004 reaches the runtime's SIGTRAP handler (kp_signal.c) with pc at
    the brk; the handler's changes to x1, NZCV and pc come back through
    rt_sigreturn; a SIGTRAP sent by tgkill goes to the program's own handler."""
    r, out = _run(probe_program)
    assert out["brk:"] == "calls 1 pc-at-brk 1 insn 0xd4200080 x0 20 nzcv 0x40000000 -> x1 41 nzcv 0x20000000", r.stdout
    assert out["forwarded:"] == "sig 5 code -6"      # SI_TKILL


def test_unhandled_sigtrap_kills_as_the_default(probe_program):
    """No program handler: a sent SIGTRAP is redelivered with the default action."""
    r, out = _run(probe_program, "die")
    assert out["brk:"].startswith("calls 1 pc-at-brk 1"), r.stdout
    assert "forwarded:" not in out and r.returncode == -5, (r.returncode, r.stdout, r.stderr)


def test_qemu_runs_a_dynamic_program_from_the_sysroot(tmp_path):
    """conftest's runner for aarch64: -L at the cross sysroot finds ld-linux-aarch64.so.1 and libc."""
    if not shutil.which(CC):
        pytest.skip(f"{CC} not installed")
    src = tmp_path / "hello.c"
    src.write_text('#include <stdio.h>\nint main(int c, char **v) { printf("hello %s %d\\n", v[1], c); return 3; }\n')
    _cc(src, "-o", tmp_path / "hello", what="hello.c")
    r = subprocess.run([*qemu_command(ARCH), str(tmp_path / "hello"), "arm64"], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (3, "hello arm64 2\n"), r.stdout + r.stderr

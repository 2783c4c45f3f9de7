"""Unit tests of the link stage's rules, in milliseconds: how the runtime is
composed per (arch, platform) from a target's recipe and the arch's toolchain,
where its files are found, which tools build for the image's arch, C literals,
gcc depfiles, what objects hold, and that importing the back end compiles
nothing."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rewriter import depfile, link
from rewriter.link import runtime as link_runtime, toolchain as link_toolchain
from rewriter.errors import KprewriteError
from conftest import ALL_ARCHES

ARCHES = ALL_ARCHES

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "runtime"


def test_cflags_are_the_recipe_then_the_arch():
    """A target's recipe names no CPU; the arch adds its flags for the recipe's kind of code."""
    for platform in ("linux_user", "linux_kernel"):
        recipe = link_runtime.recipe(platform)
        assert not [f for f in recipe.CFLAGS if f.startswith("-m")], platform
    user = link.cflags("x86_64", "linux_user")
    kernel = link.cflags("x86_64", "linux_kernel")
    assert "-mgeneral-regs-only" in user and "-fPIC" in user and "-mcmodel=kernel" not in user
    assert {"-mgeneral-regs-only", "-mcmodel=kernel", "-mno-red-zone", "-D__KERNEL__", "-fno-pic"} <= set(kernel)
    assert "-fPIC" not in kernel
    assert link_runtime.pie("linux_user") and not link_runtime.pie("linux_kernel")
    with pytest.raises(KprewriteError, match="no runtime platform 'nowhere'"):
        link_runtime.recipe("nowhere")


def test_runtime_files_by_folder():
    """The .S files are the arch's, then those of the platform's arch folders: a user
    process links the signal return, a kernel image has no such file to exclude."""
    c, asm, offsets = link_runtime._runtime_files("x86_64", "linux_user")
    # The SIGTRAP's ucontext is a user process's: its file holds the arch's trap code
    # (one unit); a kernel links the trap code alone.
    assert c[0] == "kp_core.c" and "arch/x86_64/linux_user/kp_int3_signal.c" in c
    assert "#include <kp_int3.c>" in (RUNTIME / "arch/x86_64/linux_user/kp_int3_signal.c").read_text()
    kc, _, _ = link_runtime._runtime_files("x86_64", "linux_kernel")
    assert "arch/x86_64/kp_int3.c" in kc and not any("kp_int3_signal" in f for f in kc)
    assert asm == ["arch/x86_64/kretprobe_entry.S", "arch/x86_64/optprobe_entry.S",
                   "arch/x86_64/linux_user/sigreturn.S"]
    assert offsets == ["kp_asm_offsets.c", "arch/x86_64/kp_asm_offsets.c"]
    _, kasm, _ = link_runtime._runtime_files("x86_64", "linux_kernel")
    assert kasm == ["arch/x86_64/kretprobe_entry.S", "arch/x86_64/optprobe_entry.S"]
    inc = link._includes("x86_64", "linux_kernel")
    assert inc == [f"-I{RUNTIME / p}" if p else f"-I{RUNTIME}" for p in
                   ("include", "", "arch/x86_64", "arch/x86_64/linux_kernel",
                    "platform/linux_kernel")]


def test_runtime_includes_by_path_only():
    """Every #include of the runtime is found through -I: no relative climb."""
    for f in link.runtime_sources():
        for line in f.read_text().splitlines():
            m = re.match(r'\s*#\s*include\s*[<"]([^>"]+)[>"]', line)
            assert not m or ".." not in m.group(1), f"{f}: {line}"


def test_handler_api_alone():
    """<kprewrite/kprobes.h> compiles with -I runtime/include alone (a probed program's
    NOKPROBE_SYMBOL): its arch half is chosen by the compiler's target."""
    r = subprocess.run(["gcc", "-fsyntax-only", "-x", "c", f"-I{RUNTIME / 'include'}", "-"],
                       input="#include <kprewrite/kprobes.h>\n"
                             "unsigned long f(struct pt_regs *r) { return regs_return_value(r) + instruction_pointer(r); }\n",
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_tools_for_the_image_arch(monkeypatch):
    """The compiler and linker of the arch's triple, else the host's for the host's
    arch; never a host tool for another arch."""
    monkeypatch.delenv("CC", raising=False)
    from rewriter.arch import host_machine
    ld = link.linker("x86_64")
    assert ld in ("x86_64-linux-gnu-ld", "ld") and (ld != "ld" or host_machine() == "x86_64")
    assert link.compiler("x86_64") in ("x86_64-linux-gnu-gcc", "gcc")
    monkeypatch.setenv("CC", "gcc")
    assert link.compiler("x86_64") == "gcc"
    with pytest.raises(KprewriteError, match="no toolchain"):
        link_toolchain.arch_toolchain("nosucharch")


def test_c_string():
    assert link.c_string(None) == "0"
    assert link.c_string('a"b\\c') == '"a\\"b\\\\c"'
    assert link.c_string("é\n") == '"\\303\\251\\012"'


def test_read_depfile(tmp_path):
    d = tmp_path / "x.d"
    d.write_text(f"x.o: {tmp_path}/a\\ b.c \\\n {tmp_path}/c$$d.h {tmp_path}/e\\#f.h\n")
    assert depfile.read(d) == [tmp_path / "a b.c", tmp_path / "c$d.h", tmp_path / "e#f.h"]


def test_object_contents(tmp_path):
    """Sized functions with their relocations, executable sections, and the symbols
    the image must provide, from a real object."""
    src = tmp_path / "h.c"
    src.write_text("extern int image_fn(int);\nint h(int x) { return image_fn(x) + 1; }\n")
    obj = tmp_path / "h.o"
    subprocess.run(["gcc", "-O2", "-fno-asynchronous-unwind-tables", "-c", str(src), "-o", str(obj)], check=True)
    funcs = link.object_functions([obj])
    off, body, relocs = funcs["h"]
    assert len(body) > 0 and "image_fn" in relocs.values()
    assert body in b"".join(link.executable_sections(obj))
    assert link.undefined_symbols([obj]) == {"image_fn": obj}
    assert link.undefined_symbols([obj], {"image_fn"}) == {}


def test_import_compiles_nothing(tmp_path):
    """Importing the back end and the stages builds no runtime: the asm offsets are
    read at first use."""
    env = dict(os.environ, KPREWRITE_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    code = ("import rewriter.arch.x86_64, rewriter.pipeline, rewriter.targets.linux_user, "
            "rewriter.targets.linux_kernel, rewriter.cli")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path)
    assert not list((tmp_path / "cache").glob("runtime-*"))


@pytest.mark.parametrize("text_addr, moved", [(0x10040, True), (0x10100, False)])
def test_code_linked_where_the_layout_put_it(tmp_path, text_addr, moved):
    """A section aligned past the layout's alignment would move the linked code off the
    address every detour calls into: refused in one line, not written wrong."""
    src = tmp_path / "aligned.s"
    src.write_text(".text\n.p2align 8\n.globl f\nf:\n ret\n")
    obj = tmp_path / "aligned.o"
    subprocess.run(["as", str(src), "-o", str(obj)], check=True)
    if moved:
        with pytest.raises(KprewriteError, match=rf"linked at 0x10100, not at {text_addr:#x}"):
            link.link(tmp_path, [obj], text_addr, "linux_user")
    else:
        assert link.link(tmp_path, [obj], text_addr, "linux_user").text_addr == text_addr

"""Bad input: one clear line each, non-zero exit, no traceback, no output, input untouched.
Run for aarch64 too (KPREWRITE_TEST_ARCH=aarch64), but for the tests marked x86_only."""
from __future__ import annotations

import hashlib
import subprocess

import pytest

from conftest import ALL_ARCHES, ARCH, ROOT, cc, kprewrite, run, write_spec

ARCHES = ALL_ARCHES
# A test of x86-64 code, its register names, its EM_ or its reach (rel32: a PT_LOAD 2 GiB away stops the
# rewrite; aarch64 falls back site by site instead, tests/test_aarch64_reach.py).
x86_only = pytest.mark.skipif(ARCH != "x86_64", reason="depends on x86-64 code")

PROGRAM = r"""
#include <stdio.h>
#include <kprewrite/kprobes.h>
__attribute__((noinline)) int work(int x) { return x * x * 3 + x / 7 + 1; }
__attribute__((noinline)) int secret(int x) { return x * 7; }
NOKPROBE_SYMBOL(secret);
int main(void) { printf("%d\n", work(1) + secret(2)); return 0; }
"""
GOOD_HANDLERS = "#include <kprewrite/kprobes.h>\nint h(struct kprobe *p, struct pt_regs *r) { return 0; }\n"


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    """Read only: every failing rewrite checks that it is left untouched."""
    return cc(tmp_path_factory.mktemp("bad_input"), "prog", PROGRAM, "-O2", f"-I{ROOT / 'runtime' / 'include'}")


def fails(tmp_path, inp, spec, *expect):
    out = tmp_path / "out"
    before = hashlib.sha256(inp.read_bytes()).hexdigest() if inp.exists() else None
    r = kprewrite("instrument", inp, "--spec", spec, "-o", out, check=False)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert not out.exists()
    lines = r.stderr.strip().splitlines()
    for e in expect:
        assert any(e in l for l in lines), (e, lines)
    if before:
        assert hashlib.sha256(inp.read_bytes()).hexdigest() == before
    return lines


def test_not_elf(tmp_path):
    f = tmp_path / "notelf"
    f.write_text("#!/bin/sh\necho hi\n")
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    assert fails(tmp_path, f, spec, "notelf: not an ELF file") == [f"kprewrite: {f}: not an ELF file"]


def test_truncated(tmp_path, prog):
    t = tmp_path / "trunc"
    t.write_bytes(prog.read_bytes()[:3000])
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    assert len(fails(tmp_path, t, spec, "truncated ELF file")) == 1


@x86_only
def test_relocatable_object_that_is_not_a_module(tmp_path):
    """An object file, or a .ko cut short before its section headers: one line saying what it
    is not, rather than the ELF type number."""
    obj = tmp_path / "obj.o"
    subprocess.run(["gcc", "-c", "-o", obj, "-x", "c", "-"], input="int work(int x) { return x + 1; }\n",
                   text=True, check=True)
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    assert fails(tmp_path, obj, spec, "not a readable kernel module") == [
        f"kprewrite: {obj}: a relocatable object that is not a readable kernel module (no .gnu.linkonce.this_module "
        "section in its section headers: truncated, or not a .ko)"]


def test_module_of_an_arch_without_a_module_folder(tmp_path):
    """A .ko of an architecture the module target has no folder for (an AArch64 object whose
    e_machine says RISC-V, which no back end takes): one line naming the machine and the
    folders there are, no output."""
    ko = tmp_path / "m.ko"
    src = '__attribute__((section(".gnu.linkonce.this_module"))) char this_module[64];\nint work(int x) { return x + 1; }\n'
    r = subprocess.run(["aarch64-linux-gnu-gcc", "-c", "-o", ko, "-x", "c", "-"], input=src, text=True,
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip("no aarch64-linux-gnu-gcc")
    data = bytearray(ko.read_bytes())
    data[18:20] = (243).to_bytes(2, "little")          # EM_RISCV
    ko.write_bytes(data)
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    assert fails(tmp_path, ko, spec, "not supported yet") == [
        f"kprewrite: {ko}: kernel modules for e_machine 243 are not supported yet (rewriter/targets/linux_module/ "
        "has aarch64, x86_64)"]


def test_bti_guarded_arm64_module(tmp_path):
    """An arm64 module whose property note claims BTI (a kernel built with CONFIG_ARM64_BTI_KERNEL
    guards module text): one line, no output; the same module without BTI is taken."""
    src = ('__attribute__((section(".gnu.linkonce.this_module"))) char this_module[64];\n'
           'int work(int x) { return x + 1; }\nint init_module(void) { return 0; }\nvoid cleanup_module(void) { }\n')
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\noffset = 4\n')
    for protection, guarded in (("standard", True), ("none", False)):
        ko = tmp_path / f"{protection}.ko"
        r = subprocess.run(["aarch64-linux-gnu-gcc", "-O2", f"-mbranch-protection={protection}", "-c", "-o", ko,
                            "-x", "c", "-"], input=src, text=True, capture_output=True)
        if r.returncode != 0:
            pytest.skip("no aarch64-linux-gnu-gcc")
        if guarded:
            assert fails(tmp_path, ko, spec, "landing_pad") == [
                f"kprewrite: {ko}: landing_pad at .note.gnu.property: a BTI-guarded module is not written yet (its "
                "new code has no BTI landing pads)"]
        else:
            assert kprewrite("check", ko, "--spec", spec).stdout == "work+0x4  k  optimized\n"


def test_arm64_module_site_without_a_jump(tmp_path):
    """An arm64 module has no breakpoint probes: a site no jump may go (a function with an
    exception-table entry, whose fixup may come back into it) is refused in one line naming the
    check and the address, by check as by instrument."""
    ko = tmp_path / "ex.ko"
    src = ('__attribute__((section(".gnu.linkonce.this_module"))) char this_module[64];\n'
           'int work(int x) { asm volatile("1: nop\\n .pushsection __ex_table,\\"a\\"\\n .balign 4\\n .long 1b - .\\n"\n'
           '" .long 1b - .\\n .short 0\\n .short 0\\n .popsection"); return x + 1; }\n'
           'int init_module(void) { return 0; }\nvoid cleanup_module(void) { }\n')
    r = subprocess.run(["aarch64-linux-gnu-gcc", "-O2", "-c", "-o", ko, "-x", "c", "-"], input=src, text=True,
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"no aarch64-linux-gnu-gcc ({r.stderr.strip()[-200:]})")
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\noffset = 4\n')
    line = ("__ex_table at 0xffff800000000000: work has an exception table entry: its fixup may jump back into the "
            "function")
    assert kprewrite("check", ko, "--spec", spec, check=False).stdout == f"work+0x4  k  refused  {line}\n"
    assert fails(tmp_path, ko, spec, "__ex_table") == [f"kprewrite: {spec.name}: [[kprobe]] #1 (work+0x4): {line}"]


def test_arm64_module_post_handler_after_an_entry_branch(tmp_path):
    """A probe on a function's entry is taken past its ftrace NOPs: where the instruction there is a
    branch (a cbz), its post_handler could not run after the copy (the detour's call follows it, and
    both ways of the copy leave before): refused in one line, as a post_handler after a branch
    inside a function is; without the post_handler the probe is taken."""
    ko = tmp_path / "m.ko"
    src = ('__attribute__((section(".gnu.linkonce.this_module"))) char this_module[64];\nint other(int);\n'
           '__attribute__((patchable_function_entry(2))) int work(int *p) { if (!p) return other(1); return *p; }\n'
           'int init_module(void) { return 0; }\nvoid cleanup_module(void) { }\n')
    r = subprocess.run(["aarch64-linux-gnu-gcc", "-O2", "-mbranch-protection=none", "-c", "-o", ko, "-x", "c", "-"],
                       input=src, text=True, capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"no aarch64-linux-gnu-gcc ({r.stderr.strip()[-200:]})")
    (tmp_path / "h.c").write_text("#include <linux/kprobes.h>\n"
                                  "void post(struct kprobe *p, struct pt_regs *regs, unsigned long f) { }\n")
    spec = write_spec(tmp_path, 'handlers = ["h.c"]\n[[kprobe]]\nsymbol_name = "work"\npost_handler = "post"\n')
    line = "post_handler at 0xffff800000000008: a post_handler cannot run after a branch in a detour"
    assert kprewrite("check", ko, "--spec", spec, check=False).stdout == f"work+0x0  k  refused  {line}\n"
    assert fails(tmp_path, ko, spec, "post_handler") == [f"kprewrite: {spec.name}: [[kprobe]] #1 (work+0x0): {line}"]
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    assert kprewrite("check", ko, "--spec", spec).stdout == "work+0x0  k  ftrace\n"


def test_wrong_machine(tmp_path, prog):
    from rewriter.arch import MACHINES
    # A machine no back end takes (EM_AARCH64 is supported now; a new arch may take another).
    machine, name = next((m, n) for m, n in ((243, "EM_RISCV"), (3, "EM_386"), (40, "EM_ARM")) if m not in MACHINES)
    data = bytearray(prog.read_bytes())
    data[18:20] = machine.to_bytes(2, "little")
    f = tmp_path / "other"
    f.write_bytes(data)
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    assert len(fails(tmp_path, f, spec, f"ELF machine is {name};", "x86-64 (EM_X86_64)", "aarch64 (EM_AARCH64)")) == 1


def test_malformed_toml(tmp_path, prog):
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work\n')
    lines = fails(tmp_path, prog, spec, "probes.toml: ")
    assert len(lines) == 1 and "line 2" in lines[0]


def test_unknown_key_and_typo(tmp_path, prog):
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\noffest = 0\n')
    assert fails(tmp_path, prog, spec) == ["kprewrite: probes.toml: [[kprobe]] #1: unknown key 'offest' (did you mean 'offset'?)"]


def test_missing_symbol_and_handler(tmp_path, prog):
    spec = write_spec(tmp_path, 'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "nosuch"\n'
                      '[[kprobe]]\nsymbol_name = "work"\npre_handler = "missing_handler"\n', GOOD_HANDLERS)
    lines = fails(tmp_path, prog, spec, "symbol 'nosuch' not found", "pre_handler 'missing_handler' is not defined")
    assert len(lines) in (1, 2)


def test_missing_handler_file(tmp_path, prog):
    spec = write_spec(tmp_path, 'handlers = ["nothere.c"]\n[[kprobe]]\nsymbol_name = "work"\n')
    assert len(fails(tmp_path, prog, spec, "handler file 'nothere.c': no such file")) == 1


def test_offset_off_instruction_boundary(tmp_path, prog):
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\noffset = 1\n')
    assert len(fails(tmp_path, prog, spec, "[[kprobe]] #1 (work+0x1)", "not an instruction boundary")) == 1


def test_blacklisted(tmp_path, prog):
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "secret"\n')
    assert len(fails(tmp_path, prog, spec, "blacklisted: NOKPROBE_SYMBOL")) == 1
    r = kprewrite("blacklist", prog)
    assert any(l.endswith("  secret  NOKPROBE_SYMBOL") for l in r.stdout.splitlines()), r.stdout
    assert any("PLT stub" in l for l in r.stdout.splitlines())


def test_every_failing_probe_named(tmp_path, prog):
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "secret"\n[[kprobe]]\nsymbol_name = "work"\noffset = 1\n'
                      '[[kprobe]]\nsymbol_name = "work"\n')
    lines = fails(tmp_path, prog, spec, "[[kprobe]] #1", "[[kprobe]] #2")
    assert len(lines) == 2


@x86_only
def test_fetch_on_a_kretprobe_and_its_syntax_error(tmp_path, prog):
    """`fetch` on [[kretprobe]] compiles for the return ($retval); $retval on a
    kprobe is refused with the kernel's error and column."""
    spec = write_spec(tmp_path, '[[kretprobe]]\nsymbol_name = "work"\nfetch = "ret=$retval:s32"\n')
    out = tmp_path / "ok"
    kprewrite("instrument", prog, "--spec", spec, "-o", out)
    r = run(out)
    assert r.returncode == 0 and r.stdout == "18\n"
    assert r.stderr.count(": r_work_0: (main+0x") == 1 and "<- work) ret=4\n" in r.stderr, r.stderr
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\nfetch = "ret=$retval"\n', name="bad.toml")
    lines = fails(tmp_path, prog, spec, "bad.toml: [[kprobe]] #1: fetch")
    assert "Traceback" not in "\n".join(lines)


def test_list_on_plain_binary(tmp_path, prog):
    r = kprewrite("list", prog, check=False)
    assert r.returncode != 0 and "not rewritten by kprewrite" in r.stderr and "Traceback" not in r.stderr


# --- found by the fuzzer (tests/fuzz): each a damaged real ELF or a bad line -------------------

def _section(path, name):
    """(sh_offset, sh_size, offset of its section header) of section `name`."""
    from elftools.elf.elffile import ELFFile
    with open(path, "rb") as f:
        e = ELFFile(f)
        for i, s in enumerate(e.iter_sections()):
            if s.name == name:
                return s["sh_offset"], s["sh_size"], e["e_shoff"] + i * e["e_shentsize"]
    raise AssertionError(name)


def _damaged(tmp_path, prog, name, edit):
    data = bytearray(prog.read_bytes())
    edit(data)
    f = tmp_path / name
    f.write_bytes(data)
    return f


def _one_clean_line(r, *expect):
    """A failure of `check`/`blacklist`/`list`: exit 1, one line, naming what is expected, nothing else."""
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert all(l.startswith("kprewrite: ") for l in lines), lines
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    for e in expect:
        assert any(e in l for l in lines), (e, lines)
    return lines


def test_unknown_section_type_prints_no_warning(tmp_path, prog):
    """LIEF warned 'RuntimeWarning: 29806 is not a valid TYPE.' and Python printed the line
    of kprewrite's source under it; an unknown sh_type is only a number."""
    _, _, sh = _section(prog, ".comment")
    f = _damaged(tmp_path, prog, "odd_type", lambda d: d.__setitem__(slice(sh + 4, sh + 8), (29806).to_bytes(4, "little")))
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    r = kprewrite("check", f, "--spec", spec)
    assert r.stderr == "" and "work+0x0  k  optimized" in r.stdout


def test_malformed_eh_frame_names_the_file(tmp_path, prog):
    off, size, _ = _section(prog, ".eh_frame")
    f = _damaged(tmp_path, prog, "bad_eh", lambda d: d.__setitem__(slice(off, off + 4), (size + 64).to_bytes(4, "little")))
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    lines = fails(tmp_path, f, spec, f"{f}: record length runs past the section: malformed .eh_frame at 0x")
    assert len(lines) == 1


def test_non_utf8_names(tmp_path, prog):
    """A section or symbol name that is not UTF-8 (LIEF gives bytes: 'startswith first arg
    must be bytes', 'cannot use a string pattern on a bytes-like object'): read with escapes."""
    soff, _, _ = _section(prog, ".shstrtab")
    toff, tsize, _ = _section(prog, ".strtab")
    strtab = prog.read_bytes()[toff:toff + tsize]
    at = strtab.index(b"\0work\0") + 1

    def edit(d):
        d[soff + 1] = 0xFF                         # the first section name
        d[toff + at] = 0xFE                        # 'work' -> b'\xfeork'
    f = _damaged(tmp_path, prog, "bad_names", edit)
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "*ork"\n[[kprobe]]\nsymbol_name = "m*"\n')
    r = kprewrite("check", f, "--spec", spec)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "main+0x0  k  optimized" in r.stdout and "\\xfeork+0x0  k  optimized" in r.stdout, r.stdout
    assert kprewrite("blacklist", f).returncode == 0


def test_list_on_a_damaged_elf(tmp_path):
    f = tmp_path / "four_bytes"
    f.write_bytes(b"\x7fELF")
    _one_clean_line(kprewrite("list", f, check=False), f"{f}: malformed .kprewrite")


def test_list_on_an_elf_with_shifted_headers(tmp_path, prog):
    """Seven bytes inserted at the program headers: section names at offsets past any
    seekable position (was 'internal error: OverflowError' once list read files in memory;
    found by the fuzzer's random run)."""
    def shift(d):
        at = int.from_bytes(d[32:40], "little")
        d[at:at] = bytes(7)
    f = _damaged(tmp_path, prog, "shifted_phdrs", shift)
    r = kprewrite("list", f, check=False)
    assert r.returncode == 1 and "internal error" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert str(f) in r.stderr, r.stderr


@x86_only
def test_pt_load_out_of_reach(tmp_path, prog):
    """A PT_LOAD whose p_memsz reaches past 4 GiB: the detours would be out of jump reach
    (was 'internal error: EmitError: jmp back: displacement ... does not fit in 32 bits')."""
    from elftools.elf.elffile import ELFFile
    with open(prog, "rb") as fh:
        e = ELFFile(fh)
        i = next(i for i, s in enumerate(e.iter_segments()) if s["p_type"] == "PT_LOAD" and s["p_flags"] & 1)
        ph = e["e_phoff"] + i * e["e_phentsize"]
    f = _damaged(tmp_path, prog, "huge_load", lambda d: d.__setitem__(slice(ph + 40, ph + 48), (1 << 32).to_bytes(8, "little")))
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    assert len(fails(tmp_path, f, spec, f"{f}: its PT_LOAD segments end at", "out of jump reach")) == 1


def test_no_pt_load(tmp_path, prog):
    from elftools.elf.elffile import ELFFile
    with open(prog, "rb") as fh:
        e = ELFFile(fh)
        phs = [e["e_phoff"] + i * e["e_phentsize"] for i, s in enumerate(e.iter_segments()) if s["p_type"] == "PT_LOAD"]
    f = _damaged(tmp_path, prog, "no_load", lambda d: [d.__setitem__(slice(p, p + 4), (4).to_bytes(4, "little")) for p in phs])
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    assert len(fails(tmp_path, f, spec, f"{f}: no PT_LOAD segment")) == 1


@x86_only
def test_control_character_in_an_events_line(tmp_path, prog):
    """A newline inside an events string: the error_log lines show it escaped, one line each."""
    spec = write_spec(tmp_path, 'events = ["p work\\na=%di a=%si"]\n')
    lines = fails(tmp_path, prog, spec, "probes.toml: events[1]: column 14: This argument name is already used",
                  "kprewrite:   Command: p work\\na=%di a=%si")
    assert len(lines) == 3 and lines[2].index("^") == lines[1].index("a=%si")


def test_trace_bad_hex_escape(tmp_path):
    f = tmp_path / "trace.txt"
    f.write_text('prog-1 [000] 1.000001: p_work_0: (work+0x0/0x10) s="\\xzz\\x41"\n')
    r = kprewrite("trace", f)
    assert r.returncode == 0 and '"s": "xzzA"' in r.stdout, (r.stdout, r.stderr)


KPROBES_TEXT = r"""
#include <stdio.h>
#include <kprewrite/kprobes.h>
__kprobes __attribute__((noinline)) int hidden_a(int x) { return x * 3 + 1; }
__kprobes __attribute__((noinline)) int hidden_b(int x) { return hidden_a(x) * 5; }
__attribute__((noinline)) int work(int x) { return hidden_b(x) + 1; }
int main(void) { printf("%d\n", work(2)); return 0; }
"""


def test_kprobes_text_listed_function_by_function(tmp_path):
    """debugfs kprobes/blacklist lists each function of .kprobes.text by its own name
    (kprobe_add_area_blacklist()), not the section as one range; each is refused by name."""
    prog = cc(tmp_path, "kt", KPROBES_TEXT, "-O2", f"-I{ROOT / 'runtime' / 'include'}")
    lines = kprewrite("blacklist", prog).stdout.splitlines()
    mine = [l for l in lines if "kprobes.text" in l]
    assert [l.split()[1] for l in mine] == ["hidden_a", "hidden_b"], lines
    assert all(l.endswith("in .kprobes.text (__kprobes)") for l in mine)
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "hidden_b"\n')
    assert len(fails(tmp_path, prog, spec, "is blacklisted: in .kprobes.text (__kprobes) (hidden_b)")) == 1


def test_pt_load_far_past_the_file(tmp_path, prog):
    """A p_memsz of 1 GiB: the new segments' file offset follows their address, so the output
    would be a gigabyte of zeros (the fuzzer's case took half a minute to write 1.3 GB)."""
    from elftools.elf.elffile import ELFFile
    with open(prog, "rb") as fh:
        e = ELFFile(fh)
        ph = e["e_phoff"] + next(i for i, s in enumerate(e.iter_segments()) if s["p_type"] == "PT_LOAD") * e["e_phentsize"]
    f = _damaged(tmp_path, prog, "big_bss", lambda d: d.__setitem__(slice(ph + 40, ph + 48), (1 << 30).to_bytes(8, "little")))
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    assert len(fails(tmp_path, f, spec, f"{f}: its PT_LOAD segments end at 0x40000000", "at most 512 MiB")) == 1


FAR_CALL = r"""
#include <stdio.h>
/* A call whose rel32 reaches below address 0 (only damaged code has one); never run. */
__asm__(".text\n.globl far_call\n.type far_call, @function\nfar_call:\n"
        "  call . - 0x7ffff000\n  ret\n.size far_call, . - far_call\n");
int main(int argc, char **argv) { printf("%d\n", argc); return 0; }
"""


@x86_only
def test_instruction_that_cannot_be_relocated(tmp_path):
    """A probed call whose target is out of rel32 reach of the detour (the fuzzer's random
    .text bytes; was 'internal error: EmitError: call: displacement ... does not fit in
    32 bits'): one line naming the file and the probe, as __copy_instruction()'s failure
    refuses the kprobe."""
    prog = cc(tmp_path, "far", FAR_CALL, "-O2")
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "far_call"\n')
    assert len(fails(tmp_path, prog, spec, f"{prog}: probe at 0x", "an instruction cannot be relocated to the new code",
                     "does not fit in 32 bits")) == 1


def test_entry_point_outside_the_code(tmp_path, prog):
    """e_entry pointing past the image (was 'internal error: KsError: Invalid fixup' from
    assembling the entry stub's jmp)."""
    f = _damaged(tmp_path, prog, "far_entry", lambda d: d.__setitem__(28, 2))     # e_entry + 2**33
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    assert len(fails(tmp_path, f, spec, f"{f}: entry point 0x2", "(e_entry) is not in the image's code")) == 1


def test_dt_relasz_past_the_file(tmp_path, prog):
    """A DT_RELASZ of 4 GiB + 0x120 (the fuzzer's random run, on the C++ program): the
    base-relative relocations were read entry by entry, 179 million of them, a hang
    (`check` still running after two minutes); now one line naming the file."""
    import time
    off, size, _ = _section(prog, ".dynamic")
    data = prog.read_bytes()
    at = next(off + i + 8 for i in range(0, size, 16) if int.from_bytes(data[off + i:off + i + 8], "little") == 8)

    def edit(d):
        d[at:at + 8] = (int.from_bytes(d[at:at + 8], "little") + (1 << 32)).to_bytes(8, "little")
    f = _damaged(tmp_path, prog, "huge_relasz", edit)
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    t = time.monotonic()
    r = kprewrite("check", f, "--spec", spec, check=False)
    assert time.monotonic() - t < 30
    assert len(_one_clean_line(r, f"{f}: malformed dynamic section: DT_RELA at 0x", "runs past the end of the file")) == 1
    assert len(fails(tmp_path, f, spec, f"{f}: malformed dynamic section")) == 1


def test_truncated_nameless_section_is_named_by_index(tmp_path, prog):
    """A section whose sh_name and sh_size are both damaged: the message said `section  ends
    at` (an empty name; the fuzzer's messages); it names the section by its index now."""
    from elftools.elf.elffile import ELFFile
    with open(prog, "rb") as fh:
        e = ELFFile(fh)
        i = next(i for i, s in enumerate(e.iter_sections()) if s.name == ".comment")
        sh = e["e_shoff"] + i * e["e_shentsize"]

    def edit(d):
        d[sh:sh + 4] = bytes(4)                                    # sh_name: the empty string
        d[sh + 32:sh + 40] = (1 << 20).to_bytes(8, "little")       # sh_size: past the file
    f = _damaged(tmp_path, prog, "nameless", edit)
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    assert len(fails(tmp_path, f, spec, f"{f}: truncated ELF file (section #{i} (no name) ends at")) == 1


@x86_only
def test_bitfield_numbers_read_as_the_kernel_reads_them(tmp_path, prog):
    """`b04@8/32` (the fuzzer's random run: 'ValueError: invalid literal for int() with base
    0: '04'' out of Python's int()): the kernel reads a bitfield's width and offset with
    simple_strtoul(), so 04 is octal 4 and `b4@08/32` stops at the 8 (Invalid bitfield)."""
    ok = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\nfetch = "x=%di:b04@010/32"\n', name="ok.toml")
    r = kprewrite("check", prog, "--spec", ok)
    assert r.returncode == 0 and "work+0x0  k" in r.stdout, r.stderr
    bad = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\nfetch = "_x=$stack9:b4@08/32 a=%di:u8"\n', name="bad.toml")
    lines = _one_clean_line(kprewrite("check", prog, "--spec", bad, check=False),
                            "bad.toml: [[kprobe]] #1: fetch: column 12: Invalid bitfield")
    assert lines[1:] and all(l.startswith("kprewrite:  ") for l in lines[1:]), lines


def test_lzo_bomb_leaves_no_open_pipe(tmp_path):
    """Found by the fuzzer (tests/fuzz/test_fuzz_hostile.py): an LZO bzImage decompressing past
    its trailer's size killed lzop but left its stderr pipe open (a ResourceWarning line on
    standard error under -W default)."""
    import shutil
    import struct
    import subprocess
    import sys
    if not shutil.which("lzop"):
        pytest.skip("lzop not installed (Debian package lzop)")
    stream = subprocess.run(["lzop", "-1", "-c", "-q"], input=bytes(4 << 20), capture_output=True, check=True).stdout
    payload = stream + struct.pack("<I", 4096)
    setup = bytearray(1024)
    setup[0x1F1] = 1
    setup[0x1FE:0x200] = b"\x55\xaa"
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", setup, 0x206, 0x020F)
    struct.pack_into("<II", setup, 0x248, 0x40, len(payload))
    img = tmp_path / "bzImage"
    img.write_bytes(bytes(setup) + b"\x90" * 0x40 + payload + bytes(16))
    from conftest import KPREWRITE, TREE_ENV
    r = subprocess.run([sys.executable, "-W", "default", *KPREWRITE[1:], "list", str(img)], capture_output=True,
                       text=True, env=TREE_ENV)
    assert r.returncode == 1
    assert r.stderr.splitlines() == [f"kprewrite: {img}: truncated or corrupt lzo payload: it decompresses to more "
                                     "than 4096 bytes, its trailer says 4096 (a decompression bomb, or a wrong trailer)"]


@pytest.mark.parametrize("jobs", ["abc", "0"])
def test_kprewrite_jobs_not_a_count(tmp_path, prog, jobs, monkeypatch):
    """KPREWRITE_JOBS that is not a count is named, not ignored in silence."""
    import conftest
    monkeypatch.setitem(conftest.TREE_ENV, "KPREWRITE_JOBS", jobs)
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    assert fails(tmp_path, prog, spec, "KPREWRITE_JOBS") == [
        f"kprewrite: KPREWRITE_JOBS='{jobs}': not a count of processes (a whole number >= 1)"]

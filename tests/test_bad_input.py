"""Bad input: one clear line each, non-zero exit, no traceback, no output, input untouched."""
from __future__ import annotations

import hashlib

import pytest

from conftest import ROOT, cc, kprewrite, run, write_spec

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


def test_wrong_machine(tmp_path, prog):
    data = bytearray(prog.read_bytes())
    data[18:20] = (183).to_bytes(2, "little")     # EM_AARCH64
    f = tmp_path / "arm"
    f.write_bytes(data)
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    assert len(fails(tmp_path, f, spec, "EM_AARCH64", "x86-64")) == 1


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
    assert len(fails(tmp_path, prog, spec, "handler file 'nothere.c' not found")) == 1


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

"""The architecture interface (rewriter/arch/base.py): every back end in
arch.MACHINES provides every member the generic stages use, with the declared
parameters, so a second architecture is a folder the stages call the same way."""
import inspect
import typing

import pytest

from rewriter.arch import MACHINES, base, get_arch

from conftest import ALL_ARCHES

ARCHES = ALL_ARCHES        # conftest: this module runs for either
BACKENDS = sorted(set(MACHINES.values()))
# Arch members that are parts, each declared by its own Protocol.
PARTS = {"optprobe": base.OptProbe, "kprobe_xol": base.KprobeXol, "retprobe": base.RetProbe,
         "emit": base.Emit, "handler_abi": base.HandlerAbi, "fetch_regs": base.FetchRegs,
         "toolchain": base.Toolchain}


def _methods(proto) -> dict:
    return {n: v for n, v in vars(proto).items() if not n.startswith("_") and inspect.isfunction(v)}


def _annotations(proto) -> dict:
    return typing.get_type_hints(proto, globalns=vars(base))


def _check(obj, proto, where: str) -> None:
    for n, t in _annotations(proto).items():
        assert hasattr(obj, n), f"{where} has no {n}"
        v = getattr(obj, n)
        if t in (int, str, bytes, bool):
            assert isinstance(v, t) and not (t is int and isinstance(v, bool)), f"{where}.{n} is not {t.__name__}"
    for n, f in _methods(proto).items():
        assert hasattr(obj, n), f"{where} has no {n}()"
        want = list(inspect.signature(f).parameters)[1:]            # without self
        got = list(inspect.signature(getattr(obj, n)).parameters)
        assert got == want, f"{where}.{n}{tuple(got)}: declared {tuple(want)}"


@pytest.mark.parametrize("name", BACKENDS)
def test_every_arch_answers_the_declared_interface(name):
    arch = get_arch(name)
    _check(arch, base.Arch, name)
    assert MACHINES[arch.e_machine] == name == arch.name
    assert set(PARTS) <= set(_annotations(base.Arch))
    for part, proto in PARTS.items():
        _check(getattr(arch, part), proto, f"{name}.{part}")


def test_the_declaration_covers_what_the_stages_use():
    """A member the generic stages read from an arch but base.Arch does not
    declare is a hole in the interface a second arch would fall through."""
    import re
    from pathlib import Path
    root = Path(base.__file__).resolve().parents[1]
    generic = [p for p in root.rglob("*.py") if "arch" not in p.relative_to(root).parts]
    declared = set(_annotations(base.Arch)) | set(_methods(base.Arch))
    parts = {n: set(_annotations(p)) | set(_methods(p)) for n, p in PARTS.items()}
    missing = set()
    for p in generic:
        # The code's names alone (a string may name a place, "arch.x86_64.optprobe:...").
        text = "".join(t for _, t in _code_tokens(p, strings=False))
        for m in re.finditer(r"\barch\.([A-Za-z_][A-Za-z_0-9]*)(?:\.([A-Za-z_][A-Za-z_0-9]*))?", text):
            top, sub = m.group(1), m.group(2)
            if top in ("base",):                                   # the module rewriter.arch.base
                continue
            if top not in declared:
                missing.add(f"{p.name}: arch.{top}")
            elif top in parts and sub and sub not in parts[top]:
                missing.add(f"{p.name}: arch.{top}.{sub}")
    assert not missing, sorted(missing)


@pytest.mark.parametrize("name", BACKENDS)
def test_direct_branches_are_named_and_retargeted(name, tmp_path):
    """direct_branch_target() and with_branch_target(): the planner's retargeting
    reads and rewrites a copied branch only through these two."""
    arch = get_arch(name)
    if name != "x86_64":
        pytest.skip("the encodings below are x86-64's")
    from rewriter.arch.base import DcrInsn
    from rewriter.arch.x86_64.insn import classify
    call = b"\xe8\x10\x00\x00\x00"                  # call .+0x15
    insn = DcrInsn(0x1000, call, classify(call, 0x1000))
    assert arch.direct_branch_target(insn) == 0x1015
    moved = arch.with_branch_target(insn, 0x2000)
    assert arch.direct_branch_target(moved) == 0x2000 and moved.code == call
    # relocate() encodes the new target from wherever the copy goes (a call's copy
    # pushes the original return address, then jumps).
    import capstone
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    last = list(md.disasm(arch.emit.relocate(moved, 0x5000), 0x5000))[-1]
    assert last.mnemonic == "jmp" and int(last.op_str, 16) == 0x2000
    nop = b"\x90"
    assert arch.direct_branch_target(DcrInsn(0x1000, nop, classify(nop, 0x1000))) is None


# x86-64 facts as code names or string literals: registers, instruction classes,
# encodings, relocation and capstone/keystone constants.
X86_FACT = r"""\b(rax|rbx|rcx|rdx|rsi|rdi|rsp|rbp|rip|eflags|r(8|9|1[0-5]))\b|%[re]?(ax|bx|cx|dx|si|di|sp|bp|ip)\b|
    \b(call|jmp|jcc)\ rel\b|rel(8|32)|R_X86_64|(?<!EM_)X86_|x86_64-linux|\\x(0f|90|cc|e8|e9|eb|f3)|endbr|%[fg]s:|pushfq|popfq"""


STRINGS_STILL_X86 = {"safety.py"}


def _code_tokens(path, strings: bool = True):
    """(line, text) of every name, operator and string literal (with strings) of a
    module's code, its docstrings and comments left out (they may explain with x86
    examples)."""
    import io
    import tokenize
    out, prev, depth = [], None, 0
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        # A docstring is an expression statement of its own: a string at a line's start
        # inside brackets (an argument on a continuation line) is code.
        if tok.type == tokenize.STRING and depth == 0 and \
                prev in (None, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.NL):
            prev = tok.type
            continue
        if tok.type in (tokenize.NAME, tokenize.OP) or (strings and tok.type == tokenize.STRING):
            out.append((tok.start[0], tok.string if tok.type == tokenize.OP else f" {tok.string} "))
        if tok.type not in (tokenize.COMMENT,):
            prev = tok.type
    return out


def test_generic_code_names_no_x86_fact():
    """Outside the arch folders (rewriter/arch/<arch>/, rewriter/targets/*/<arch>/) the
    code names no x86-64 register, instruction class, encoding or relocation: a
    second architecture is added folders, not edits.  (Comments may give x86
    examples; code and strings may not.)"""
    import re
    from pathlib import Path
    root = Path(base.__file__).resolve().parents[1]
    arch_dirs = set(MACHINES.values())
    fact = re.compile(X86_FACT, re.X)
    hits = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if rel.parts[0] == "arch" and len(rel.parts) > 2 or arch_dirs & set(rel.parts[:-1]):
            continue
        # Known, listed in docs/limitations.md: the safety rules' texts give the failures
        # the x86-64 tests showed (their strings only; its code is checked).
        for line, text in _code_tokens(p, strings=str(rel) not in STRINGS_STILL_X86):
            if fact.search(text):
                hits.append(f"{rel}:{line}: {text[:60]}")
    assert not hits, "\n".join(hits)


# --- a new architecture: its folders and one registry line per layer ---------------------------

def _outside_arch_folders(root, suffixes):
    """Files under `root` outside every back end's folders (a path part named after one)."""
    arch_dirs = set(MACHINES.values())
    return [p for p in sorted(root.rglob("*")) if p.suffix in suffixes
            and not arch_dirs & set(p.relative_to(root).parts[:-1])]


def test_rewriter_names_a_back_end_only_in_its_registry():
    """The rewriter's code outside the arch folders (rewriter/arch/<arch>/,
    rewriter/targets/*/<arch>/) names no back end but in rewriter/arch/__init__.py, whose
    MACHINES is the one line a new architecture adds outside its folders.  (Comments and
    docstrings may name them.)"""
    import re
    from pathlib import Path
    root = Path(base.__file__).resolve().parents[1]
    name = re.compile(r"\b(" + "|".join(sorted(BACKENDS)) + r")\b")
    hits = [f"{p.relative_to(root)}:{line}: {text.strip()[:60]}"
            for p in _outside_arch_folders(root, {".py"}) if p != root / "arch" / "__init__.py"
            for line, text in _code_tokens(p) if name.search(text)]
    assert not hits, "\n".join(hits)


def test_runtime_names_a_back_end_only_in_its_registry():
    """The runtime's C outside runtime/arch/<arch>/ and runtime/include/kprewrite/arch/<arch>/
    names no back end (nor its compiler's macro) but in kprobes.h's chain, which has each
    back end's `defined(...)` and `#include <kprewrite/arch/<arch>/ptrace.h>`."""
    import re
    from pathlib import Path
    root = Path(base.__file__).resolve().parents[2] / "runtime"
    registry = root / "include" / "kprewrite" / "kprobes.h"
    name = re.compile("|".join(sorted(BACKENDS)))
    hits, chain = [], []
    for p in _outside_arch_folders(root, {".c", ".h", ".S"}):
        code = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), p.read_text(), flags=re.S)
        for i, line in enumerate(re.sub(r"//[^\n]*", "", code).splitlines(), 1):
            if not name.search(line):
                continue
            if p == registry and re.fullmatch(r"#(el)?if defined\(__\w+__\)|#include <kprewrite/arch/\w+/ptrace\.h>",
                                              line.strip()):
                chain.append(line.strip())
            else:
                hits.append(f"{p.relative_to(root)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)
    for arch in BACKENDS:
        assert f"#include <kprewrite/arch/{arch}/ptrace.h>" in chain, f"kprobes.h: no line for {arch}"
        assert (root / "include" / "kprewrite" / "arch" / arch / "ptrace.h").is_file()
        assert (root / "arch" / arch / "kp_arch.h").is_file()


def test_tests_take_arch_facts_from_their_registry():
    """The tests' arch facts are tests/arches/<arch>.py, one per back end, each naming
    what the others do; a test module's ARCHES is ALL_ARCHES (written for every
    architecture) or one architecture, never a list a new one would have to join."""
    import ast
    from pathlib import Path
    from conftest import ALL_ARCHES, ALL_FACTS
    assert ALL_ARCHES == BACKENDS, "tests/arches/ and rewriter.arch.MACHINES name different architectures"
    names = {a: {n for n in vars(f) if n.isupper()} for a, f in ALL_FACTS.items()}
    assert all(n == names[ALL_ARCHES[0]] for n in names.values()), names
    tests = Path(__file__).resolve().parent
    bad = []
    for p in sorted(tests.rglob("*.py")):
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ARCHES" for t in node.targets):
                v = node.value
                one = isinstance(v, ast.List) and len(v.elts) == 1 and isinstance(v.elts[0], ast.Constant) \
                    and v.elts[0].value in ALL_ARCHES
                if not (one or isinstance(v, ast.Name) and v.id == "ALL_ARCHES"):
                    bad.append(f"{p.relative_to(tests)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)

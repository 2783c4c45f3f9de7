"""Shared helpers: compile real programs with gcc, rewrite them with the real
CLI, run them natively and under QEMU user mode (qemu-<arch>).

The architecture under test is the host's, or KPREWRITE_TEST_ARCH (a cross
compiler <triple>-gcc and qemu-<arch> then build and run everything, and the
"native" runner is skipped).  An architecture's facts (its triple, Capstone
mode, register names...) are tests/arches/<arch>.py, ARCH's loaded as FACTS; a
test module written for every architecture says `ARCHES = ALL_ARCHES` and takes
them from there, one written for one architecture names it (`ARCHES = ["aarch64"]`),
and one with no ARCHES is x86-64's (its programs hold x86-64 assembly or facts)
and skipped elsewhere.

Every test module takes its helpers from here: compiling (`cc`), the CLI
(`kprewrite`, `instrument`, which also checks with `attributed` that
`kprewrite diff` explains every byte the rewrite changed, `check_lines`), spec text (`write_spec`,
`probe_spec`), running (`run`, the `runner` fixture), reading results
(`profile`, `meta`), the symbols of a binary (`symbols`, `functions`, `insns`),
and `once`, which builds what a native/QEMU pair of a test shares."""
from __future__ import annotations

import importlib
import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import capstone
import pytest
from elftools.elf.elffile import ELFFile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))      # in-process imports of rewriter: this tree too
from rewriter.arch import host_machine  # noqa: E402

# The CLI of this tree, not whatever `kprewrite` comes first on PATH (another checkout).
KPREWRITE = [sys.executable, "-m", "rewriter"]
os.environ["KPREWRITE_TEST_SUITE"] = "1"   # honours KPREWRITE_UNSAFE_OFF (rewriter/safety.py): the suite only
TREE_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
HOST_ARCH = host_machine()
ARCH = os.environ.get("KPREWRITE_TEST_ARCH", HOST_ARCH)
# Each architecture's facts (tests/arches/<arch>.py, the tests' one registry): ARCH's are FACTS.
ALL_ARCHES = sorted(p.stem for p in (Path(__file__).parent / "arches").glob("*.py") if p.stem != "__init__")
ALL_FACTS = {a: importlib.import_module(f"arches.{a}") for a in ALL_ARCHES}
TRIPLES = {a: f.TRIPLE for a, f in ALL_FACTS.items()}
if ARCH not in ALL_FACTS:
    raise pytest.UsageError(f"KPREWRITE_TEST_ARCH={ARCH}: no tests/arches/{ARCH}.py (there are {', '.join(ALL_ARCHES)})")
FACTS = ALL_FACTS[ARCH]
CROSS = ARCH != HOST_ARCH


def compiler(arch: str = ARCH, cxx: bool = False) -> str:
    """gcc (g++) building programs of `arch`: the host's, or the cross compiler of its triple."""
    name = "g++" if cxx else "gcc"
    return name if arch == HOST_ARCH else f"{TRIPLES[arch]}-{name}"


CC, CXX = compiler(), compiler(cxx=True)
QEMU = shutil.which(f"qemu-{ARCH}")


def qemu_command(arch: str = ARCH) -> list[str]:
    """qemu-<arch> (first word of a command line running a program of `arch`), with
    -L at the cross sysroot (Debian's libc6-dev-<arch>-cross: /usr/<triple>) when
    `arch` is not the host's: there it finds the program's dynamic loader and libraries.
    Note: qemu-user prints its own load errors on standard output."""
    qemu = shutil.which(f"qemu-{arch}")
    if not qemu:
        pytest.skip(f"qemu-{arch} not installed")
    sysroot = Path("/usr") / TRIPLES[arch]
    return [qemu, "-L", str(sysroot)] if arch != HOST_ARCH and sysroot.is_dir() else [qemu]


# The libpython of the interpreter running the tests, if it has one.
LIBPYTHON = (Path(sysconfig.get_config_var("LIBDIR")) / (sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY"))
             if sysconfig.get_config_var("Py_ENABLE_SHARED") else None)
RUNNERS = ["qemu"] if CROSS else ["native", "qemu"]


def pytest_collection_modifyitems(config, items):
    """Modules not written for ARCH (no ARCHES naming it; the default is x86-64 only) are skipped."""
    for item in items:
        arches = getattr(item.module, "ARCHES", ["x86_64"]) if item.module is not None else ["x86_64"]
        if ARCH not in arches:
            item.add_marker(pytest.mark.skip(reason=f"written for {', '.join(arches)}, not {ARCH}"))


# --- building ---------------------------------------------------------------------------------

def cc(tmp: Path, name: str, source: str, *flags: str, lang: str = "c", skip_without_static: bool = False) -> Path:
    """Compiles `source` to tmp/name with gcc (g++ for lang="c++").  With
    skip_without_static, a -static link that finds no static libraries skips the test."""
    src = tmp / f"{name}.{'cc' if lang == 'c++' else 'c'}"
    src.write_text(source)
    out = tmp / name
    compiler = CXX if lang == "c++" else CC
    r = subprocess.run([compiler, str(src), *flags, "-o", str(out)], capture_output=True, text=True)
    if skip_without_static and r.returncode != 0 and "-static" in flags and "cannot find" in r.stderr:
        pytest.skip("no static libc/libstdc++ installed")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="session")
def _once_cache() -> dict:
    return {}


@pytest.fixture
def once(_once_cache, tmp_path_factory):
    """once(build, *args) -> build(tmp, *args), computed once per (build, args) in
    the session, in a directory of its own (tmp_path_factory).

    A test parametrized by `runner` puts its compile and rewrite in such a build
    function: the native and the QEMU run then share the built and rewritten
    files, and each runs (and asserts) only what differs.  A build that fails is
    not kept: the other runner's test builds again, and fails the same way.

    What a build writes goes in its tmp, each file under a name of its own:
    instrument()'s default output (next to the input) would be overwritten by
    the next build or rewrite of the same input (a module-scoped program)."""
    def get(build, *args):
        key = (build.__module__, build.__qualname__, args)
        if key not in _once_cache:
            _once_cache[key] = build(tmp_path_factory.mktemp(build.__name__.strip("_")), *args)
        return _once_cache[key]
    return get


# --- the CLI ------------------------------------------------------------------------------------

def kprewrite(*args, check=True, cwd=None) -> subprocess.CompletedProcess:
    r = subprocess.run([*KPREWRITE, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=TREE_ENV)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def instrument(binary: Path, spec: Path, out: Path | None = None, *extra) -> Path:
    """`kprewrite instrument`; then every byte the rewrite changed in `binary` must be
    attributed to a probe site or a known part of the rewrite (attributed())."""
    out = out or binary.with_name(binary.name + ".kp")
    kprewrite("instrument", binary, "--spec", spec, "-o", out, *extra)
    attributed(binary, out)
    return out


def attributed(original: Path, rewritten: Path) -> dict:
    """`kprewrite diff`'s document (in-process, through the API: no second
    interpreter per rewrite), asserting that it explains every change."""
    import rewriter
    d = rewriter.diff(original, rewritten)
    assert d.ok, "\n".join(d.errors)
    return d.doc


def rewritten(tmp: Path, binary: Path, text: str, handlers: str | None = None) -> Path:
    """`binary` rewritten with the spec `text` (and handlers.c holding `handlers`),
    written in tmp: a build for once(rewritten, binary, text, ...)."""
    return instrument(binary, write_spec(tmp, text, handlers), tmp / (binary.name + ".kp"))


def check_lines(binary: Path, spec: Path, *extra) -> list[str]:
    """`kprewrite check`'s lines: SYMBOL+0xOFF  k|r  DECISION  [CHECK at ADDR] ..."""
    return kprewrite("check", binary, "--spec", spec, *extra).stdout.splitlines()


def with_oracle(tmp: Path, prog: Path, funcs) -> tuple:
    """A probe on each of `funcs`' entries: (check lines, the rewrite, the same
    probes as breakpoints: --no-optimize, the oracle whose hits do not depend on
    the jump analysis), written in tmp."""
    spec = write_spec(tmp, "".join(f'[[kprobe]]\nsymbol_name = "{f}"\n' for f in funcs))
    return (check_lines(prog, spec), instrument(prog, spec, tmp / "opt"),
            instrument(prog, spec, tmp / "int3", "--no-optimize"))


def oracle_runs(prog: Path, rewritten: Path, oracle: Path, runner, *args) -> tuple:
    """The original, the rewrite and its breakpoint oracle (with_oracle()'s) run with `args`
    on `runner`: (want, got, ref), each exiting 0 with the original's output, the last two
    with their profiles (KPREWRITE_PROFILE) on standard error."""
    want = run(prog, *args, runner=runner)
    assert want.returncode == 0
    got = run(rewritten, *args, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert got.returncode == 0 and got.stdout == want.stdout, got.stdout + got.stderr[-2000:]
    ref = run(oracle, *args, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert ref.returncode == 0 and ref.stdout == want.stdout, ref.stderr[-2000:]
    return want, got, ref


# --- specs -------------------------------------------------------------------------------------

def write_spec(tmp: Path, text: str, handlers: str | None = None, name="probes.toml") -> Path:
    """tmp/name holding `text`, and tmp/handlers.c holding `handlers` if given."""
    if handlers is not None:
        (tmp / "handlers.c").write_text(handlers)
    p = tmp / name
    p.write_text(text)
    return p


def toml_value(v) -> str:
    """A TOML value: a bool, an int, or a basic string (quotes and backslashes escaped)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def probe_spec(kind: str, targets, handlers: bool = True, extra: str = "", **keys) -> str:
    """Spec text: `handlers = ["handlers.c"]` (unless handlers=False), one
    [[kind]] table per target, a symbol name or (symbol, offset), each with the
    given keys (a None value leaves its key out), then `extra` verbatim."""
    out = ['handlers = ["handlers.c"]'] if handlers else []
    for t in targets:
        sym, off = t if isinstance(t, tuple) else (t, None)
        table = [f"[[{kind}]]", f"symbol_name = {toml_value(sym)}"]
        if off is not None:
            table.append(f"offset = {off}")
        table += [f"{k} = {toml_value(v)}" for k, v in keys.items() if v is not None]
        out.append("\n".join(table))
    return "\n".join(out) + "\n" + extra


# --- inputs for the bzImage readers ---------------------------------------------------------------

def make_bzimage(payload: bytes) -> bytes:
    """A minimal bzImage (tests/test_hostile_input.py, tests/fuzz): a boot sector with a 2.15 setup header, one setup sector, then the payload."""
    setup = bytearray(2 * 512)
    setup[0x1F1] = 1
    setup[0x1FE:0x200] = b"\x55\xaa"
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", setup, 0x206, 0x020F)
    setup[0x211] = 0x01
    struct.pack_into("<II", setup, 0x248, 0x40, len(payload))
    return bytes(setup) + b"\x90" * 0x40 + payload + b"\0" * 16


# --- running -------------------------------------------------------------------------------------

def run(binary: Path, *args, runner="native", env=None, libdir: Path | None = None,
        timeout=120) -> subprocess.CompletedProcess:
    """Runs `binary` natively or under qemu-<ARCH>, with `env` added to the
    environment; `libdir` goes first on the library path (both loaders')."""
    cmd = [str(binary), *map(str, args)]
    if runner == "qemu":
        cmd = [*qemu_command(), *cmd]
    e = dict(os.environ)
    if libdir is not None:
        e["LD_LIBRARY_PATH"] = str(libdir)
        if runner == "qemu":
            e["QEMU_LD_LIBRARY_PATH"] = str(libdir)
    e.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=timeout)


@pytest.fixture(params=RUNNERS)
def runner(request):
    return request.param


def profile(stderr: str) -> dict[str, tuple[int, int]]:
    """Parse the kprobe_profile lines the runtime writes with KPREWRITE_PROFILE=-."""
    out = {}
    for line in stderr.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() and line.startswith("  "):
            out[parts[0]] = (int(parts[1]), int(parts[2]))
    return out


def meta(binary: Path) -> dict:
    """The .kprewrite.meta section of a rewritten file (the probe list `kprewrite
    list` reads), read with pyelftools."""
    with open(binary, "rb") as f:
        sec = ELFFile(f).get_section_by_name(".kprewrite.meta")
        assert sec is not None, f"{binary}: no .kprewrite.meta section"
        return json.loads(sec.data())


# --- symbols and code of a binary (pyelftools and capstone, not the rewriter's own reader) --------

def _defined_symbols(path: Path):
    with open(path, "rb") as fh:
        symtab = ELFFile(fh).get_section_by_name(".symtab")
        assert symtab is not None, f"{path} has no .symtab"
        for s in symtab.iter_symbols():
            if s.name and s["st_shndx"] != "SHN_UNDEF" and s["st_info"]["type"] not in ("STT_FILE", "STT_SECTION"):
                yield s


def symbols(path: Path) -> dict[str, int]:
    """name -> link-time address of the defined symbols of .symtab (what nm lists)."""
    return {s.name: s["st_value"] for s in _defined_symbols(path)}


def functions(path: Path) -> dict[str, list[tuple[int, int]]]:
    """name -> [(start, end)] of the defined STT_FUNC symbols with a size."""
    out: dict[str, list[tuple[int, int]]] = {}
    for s in _defined_symbols(path):
        if s["st_info"]["type"] == "STT_FUNC" and s["st_size"]:
            out.setdefault(s.name, []).append((s["st_value"], s["st_value"] + s["st_size"]))
    return out


def function(path: Path, name: str) -> tuple[int, int]:
    """(start, end) of the one sized function `name`."""
    found = functions(path).get(name, [])
    assert len(found) == 1, (path, name, found)
    return found[0]


def va_to_off(data: bytes, va: int) -> int:
    """File offset of a link-time address, through the PT_LOAD segments."""
    phoff, = struct.unpack_from("<Q", data, 32)
    phnum, = struct.unpack_from("<H", data, 56)
    for i in range(phnum):
        t, _, off, pva, _, fsz, _, _ = struct.unpack_from("<IIQQQQQQ", data, phoff + i * 56)
        if t == 1 and pva <= va < pva + fsz:
            return off + va - pva
    raise AssertionError(f"{va:#x} not in any PT_LOAD")


def read_at(path: Path, va: int, size: int) -> bytes:
    """`size` bytes of the file at link-time address `va`."""
    data = Path(path).read_bytes()
    off = va_to_off(data, va)
    return data[off:off + size]


_md = capstone.Cs(*FACTS.CAPSTONE)


def insns(path: Path, func: str) -> list:
    """[(offset, capstone insn)] of function `func`, decoded linearly from its start."""
    start, end = function(path, func)
    return [(i.address - start, i) for i in _md.disasm(read_at(path, start, end - start), start)]


# The kernel-image tests' fixtures (tests/kernel/fixtures.py).
from kernel.fixtures import arm64_kernel, boot_kernel, debian_kernel, make_initramfs  # noqa: E402,F401
from kernel.fixtures import pytest_terminal_summary as _kernel_boots_summary  # noqa: E402


# One conftest.py for the whole tree: a second one (tests/kernel, tests/fuzz) would be
# imported as `conftest` too and shadow this module for `from conftest import ...`.
def pytest_terminal_summary(terminalreporter):
    _kernel_boots_summary(terminalreporter)
    harness = sys.modules.get("harness")        # tests/fuzz/harness.py, if the fuzz tests ran
    if harness is not None and harness.COUNTS:
        parts = ", ".join(f"{k} {v}" for k, v in sorted(harness.COUNTS.items()))
        terminalreporter.write_line(f"fuzz: {sum(harness.COUNTS.values())} cases run ({parts})")

"""perf probe definitions in Debian's kernel from its DWARF: Debian's linux-image-<release>-dbg
(the vmlinux with DWARF, fetched with `apt-get download` and only that file extracted into the
kernel cache), read one compilation unit at a time (rewriter/probes/perfprobe/dwarf.py, by_address).

The oracle is perf itself, reading the same debug vmlinux with libdw (`perf probe -k VMLINUX`):

- no boot: source lines and locals (`do_sys_openat2:17 fd tmp->name:string op.open_flag ...`),
  FUNC@SRC:RLN, SRC:ALN, an inlined function's sites and %return compile to the kprobe_events
  lines `perf probe -D` prints (the same addresses, registers, stack offsets and types);
  probe-vars names perf -V's variables, and probe-lines the lines perf -V finds an address for;
  the debug file is found under KPREWRITE_DEBUG_FILE_DIRECTORY as boot/vmlinux-RELEASE, by
  build-id, or named by KPREWRITE_DEBUG_FILE, and one whose build-id is another's is refused;
- a boot pair: the rewritten kernel's event at a line in do_sys_openat2 (locals in registers,
  a struct on the stack, members through pointers, a string) traces the same values as perf's
  own line written into tracefs' kprobe_events on a boot of the unmodified kernel.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess

import pytest

from conftest import KPREWRITE, TREE_ENV

import kernel_env
from kernel_env import assert_boot_ok, init_script, sections

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

TRACING = "/sys/kernel/tracing"
FILE = "/kp-dwarf-file"
LINE17 = "do_sys_openat2:17 fd f tmp->name:string op.open_flag op.mode op.intent f->f_flags f->f_mode"


@pytest.fixture(scope="module")
def kernel_dbg(debian_kernel):
    """The usr/lib/debug folder holding boot/vmlinux-<release> of the kernel's -dbg package,
    extracted once into the kernel cache (only the vmlinux: the package's modules are not needed)."""
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        pytest.skip("apt-get and dpkg-deb are needed to fetch the kernel's -dbg package")
    package = f"linux-image-{debian_kernel.release}-dbg"
    # not named linux-image*: tools that look for the kernel in the cache glob that
    root = kernel_env.cache_dir() / f"debug-{package}_{debian_kernel.version}"
    member = f"usr/lib/debug/boot/vmlinux-{debian_kernel.release}"
    with open(kernel_env.cache_dir() / f".{package}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / member).is_file():
            work = root.with_name(root.name + ".tmp")
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            r = subprocess.run(["apt-get", "download", "-q", f"{package}={debian_kernel.version}"], cwd=work,
                               capture_output=True, text=True, timeout=1800)
            debs = list(work.glob("*.deb"))
            if r.returncode != 0 or len(debs) != 1:
                shutil.rmtree(work, ignore_errors=True)
                pytest.skip(f"{package} {debian_kernel.version} cannot be fetched: "
                            f"{' '.join((r.stderr or r.stdout).split())[-200:]}")
            tar = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(debs[0])], stdout=subprocess.PIPE)
            subprocess.run(["tar", "-x", "-C", str(work), f"./{member}"], stdin=tar.stdout, check=True)
            tar.stdout.close()
            tar.wait()
            debs[0].unlink()
            shutil.rmtree(root, ignore_errors=True)
            work.rename(root)
    return root / "usr" / "lib" / "debug"


def run(*args, env=None, check=True):
    e = {k: v for k, v in TREE_ENV.items() if k not in ("KPREWRITE_DEBUG_FILE", "KPREWRITE_DEBUG_FILE_DIRECTORY")}
    r = subprocess.run([*KPREWRITE, *map(str, args)], capture_output=True, text=True, env={**e, **(env or {})})
    if check:
        assert r.returncode == 0, r.stderr
    return r


def perf(dbg_vmlinux, *args) -> subprocess.CompletedProcess:
    if not shutil.which("perf"):
        pytest.skip("perf (linux-perf) is not installed")
    return subprocess.run(["perf", "probe", "-k", str(dbg_vmlinux), *args], capture_output=True, text=True,
                          timeout=300)


def _compiled(stdout: str) -> list[str]:
    return [l.split(": ", 1)[1] for l in stdout.splitlines() if l.startswith("probes[")]


def _normal(line: str, symbols) -> tuple:
    """(kind, address, [fetch args]) of a kprobe_events line, the location as an address
    (perf writes SYM+<decimal>, we SYM or SYM+0x<hex>) and the args without their names
    (perf and we name an unnamed '$retval' differently)."""
    words = line.split()
    sym, _, off = words[1].partition("+")
    addr = symbols[sym] + (int(off, 0) if off else 0)
    return words[0][0], addr, [w.split("=", 1)[1] if "=" in w else w for w in words[2:]]


def _symbols(dbg_vmlinux) -> dict[str, int]:
    r = subprocess.run(["nm", str(dbg_vmlinux)], capture_output=True, text=True, check=True)
    out = {}
    for l in r.stdout.splitlines():
        a, t, n = l.split()[:3]
        if t in "tTwW":
            out.setdefault(n, int(a, 16))
    return out


def _dbg_vmlinux(kernel_dbg, debian_kernel):
    return kernel_dbg / "boot" / f"vmlinux-{debian_kernel.release}"


SPECS = [
    LINE17,
    "do_sys_openat2:15 fd tmp->name:string op.lookup_flags",
    "do_sys_openat2:5 fd how->flags dfd",
    "do_sys_openat2@fs/open.c:15 fd",
    "fs/open.c:1321 fd",
    "do_sys_openat2 dfd filename:string how->flags",
    "getname_flags filename",
    "do_sys_openat2%return $retval",
]


def test_lines_and_locals_equal_perfs(tmp_path, debian_kernel, kernel_dbg):
    dbgv = _dbg_vmlinux(kernel_dbg, debian_kernel)
    spec = tmp_path / "probes.toml"
    spec.write_text("probes = [" + ", ".join(f'"{s}"' for s in SPECS) + "]\n")
    r = run("check", debian_kernel.vmlinuz, "--spec", spec, env={"KPREWRITE_DEBUG_FILE_DIRECTORY": kernel_dbg})
    ours = _compiled(r.stdout)
    syms = _symbols(dbgv)
    # perf's names, where ours are perf's: the event, the last member, VAR_TYPE
    assert f"p:probe/do_sys_openat2_L17 do_sys_openat2+0xb2 fd=%bx:s32 f=%ax:x64 name=+0(+0(%r12)):string " \
           f"open_flag=+4(%sp):s32 mode=+8(%sp):x16 intent=+16(%sp):s32" in ours[0], ours
    for s in SPECS:
        p = perf(dbgv, "-D", s)
        assert p.returncode == 0, (s, p.stderr)
        theirs = sorted(_normal(l, syms) for l in p.stdout.splitlines() if l[:2] in ("p:", "r:"))
        mine = sorted(_normal(l, syms) for l in ours[:len(theirs)])
        # perf leaves $retval untyped (the kernel reads it as u64); ours is typed from DWARF
        mine = [(k, a, [re.sub(r"^\$retval:s64$", "$retval", x) for x in args]) for k, a, args in mine]
        assert mine == theirs, (s, mine, theirs)
        ours = ours[len(theirs):]
    assert ours == []
    assert len(SPECS) and "getname_flags" in SPECS[6]


def test_vars_and_lines_equal_perfs(tmp_path, debian_kernel, kernel_dbg):
    dbgv = _dbg_vmlinux(kernel_dbg, debian_kernel)
    env = {"KPREWRITE_DEBUG_FILE_DIRECTORY": kernel_dbg}
    # the variables perf finds at line 17 are those we can read there
    r = run("probe-vars", debian_kernel.vmlinuz, "do_sys_openat2:17", env=env)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("@<do_sys_openat2+0xb2> "), lines
    readable = {l.split("\t")[3] for l in lines[1:] if not l.split("\t")[4].startswith("(")}
    structs = {l.split("\t")[3] for l in lines[1:] if " is a struct " in l}
    p = perf(dbgv, "-V", "do_sys_openat2:17")
    assert p.returncode == 0, p.stderr
    theirs = {l.split()[-1] for l in p.stdout.splitlines()[2:]}
    assert readable | structs == theirs == {"fd", "f", "tmp", "op"}, (lines, p.stdout)
    # probe-lines: the lines perf -L lists (its -s source folder: stand-ins of fs/open.c and
    # fs/namei.c of numbered lines, the kernel's source is not needed to number them), for
    # functions with inlined calls, clones (getname_flags.part.0) and lines sharing addresses
    for name in ("open.c", "namei.c"):
        (tmp_path / "src" / "fs").mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / "fs" / name).write_text("".join(f"L{n}\n" for n in range(1, 6000)))
    for func in ("do_sys_openat2", "do_filp_open", "path_openat", "getname_flags"):
        r = run("probe-lines", debian_kernel.vmlinuz, func, env=env)
        ours = [int(l.split()[0]) for l in r.stdout.splitlines()[1:] if l.strip() and l.split()[0].isdigit()]
        p = perf(dbgv, "-s", tmp_path / "src", "-L", func)
        assert p.returncode == 0, p.stderr
        theirs = [int(l.split()[0]) for l in p.stdout.splitlines()[1:] if re.match(r"\s+\d+\s+L\d+$", l)]
        assert ours == theirs and len(ours) > 5, (func, ours, theirs)
        if func == "do_sys_openat2":
            assert {0, 5, 15, 17} <= set(ours) and not {2, 7} & set(ours), ours


def test_debug_file_found_by_build_id_or_named(tmp_path, debian_kernel, kernel_dbg):
    dbgv = _dbg_vmlinux(kernel_dbg, debian_kernel)
    from elftools.elf.elffile import ELFFile
    with open(debian_kernel.vmlinux, "rb") as f:
        bid = next(n["n_desc"] for s in ELFFile(f).iter_sections() if s["sh_type"] == "SHT_NOTE"
                   for n in s.iter_notes() if n["n_type"] == "NT_GNU_BUILD_ID" and n["n_name"] == "GNU")
    tree = tmp_path / "debug"
    (tree / ".build-id" / bid[:2]).mkdir(parents=True)
    os.symlink(dbgv, tree / ".build-id" / bid[:2] / f"{bid[2:]}.debug")
    want = "do_sys_openat2+0xb2 fd=%bx:s32"
    for env in ({"KPREWRITE_DEBUG_FILE_DIRECTORY": tree}, {"KPREWRITE_DEBUG_FILE": dbgv}):
        r = run("probe-vars", debian_kernel.vmlinuz, "do_sys_openat2:17", env=env)
        assert "\tfd\t%bx:s32" in r.stdout, (env, r.stdout)
        spec = tmp_path / "p.toml"
        spec.write_text('probes = ["do_sys_openat2:17 fd"]\n')
        assert want in run("check", debian_kernel.vmlinuz, "--spec", spec, env=env).stdout
    # another file's DWARF (a program's, with its own build-id) is refused, in one line
    src = tmp_path / "x.c"
    src.write_text("int main(void) { return 0; }\n")
    subprocess.run(["gcc", "-g", "-Wl,--build-id", "-o", tmp_path / "x", src], check=True)
    r = run("probe-vars", debian_kernel.vmlinuz, "do_sys_openat2:17", env={"KPREWRITE_DEBUG_FILE": tmp_path / "x"},
            check=False)
    err = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode != 0 and len(err) == 1 and f"not the image's {bid}" in err[0], r.stderr
    # no debug file: BTF, which has no lines (the BTF tests' case)
    r = run("probe-vars", debian_kernel.vmlinuz, "do_sys_openat2:17", env={"KPREWRITE_DEBUG_FILE_DIRECTORY": tmp_path},
            check=False)
    assert r.returncode != 0 and "BTF has no line table" in r.stderr, r.stderr


@pytest.mark.parametrize("definition, message", [
    ("include/linux/fs.h:100", "no compilation unit of vmlinux-"),
    ("do_sys_openat2;fd*", "';fd*' is matched against the source, and "),
    ("kp_no_such_function", "function 'kp_no_such_function' not found in the debug information of"),
    ("do_sys_openat2:17 op", "'op' at do_sys_openat2+0xb2 is a struct (struct open_flags): name a member"),
])
def test_what_the_dwarf_cannot_give_is_one_line(tmp_path, debian_kernel, kernel_dbg, definition, message):
    spec = tmp_path / "probes.toml"
    spec.write_text(f'probes = ["{definition}"]\n')
    r = run("check", debian_kernel.vmlinuz, "--spec", spec, env={"KPREWRITE_DEBUG_FILE_DIRECTORY": kernel_dbg},
            check=False)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode != 0 and len(lines) == 1 and message in lines[0], r.stderr


OPENER_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

int main(void)
{
	int fd = open("FILE", O_WRONLY | O_CREAT | O_TRUNC, 0640);
	int fd2 = open("FILE", O_RDONLY | O_CLOEXEC);
	int fd3 = openat(AT_FDCWD, "FILE", O_RDWR | O_APPEND);
	printf("open=%d pid=%d\n", fd >= 0 && fd2 >= 0 && fd3 >= 0, getpid());
	return 0;
}
"""


def _boot(boot_kernel, make_initramfs, name, kernel, opener, commands):
    initrd = make_initramfs(init_script(commands), {"opener": opener})
    r = boot_kernel(name, kernel, initrd, smp=2, timeout=240)
    assert_boot_ok(r)
    m = re.search(r"^open=1 pid=(\d+)$", r.console, re.M)
    assert m, r.explain("the opener did not run")
    from rewriter.trace import formats as tracefmt
    recs = [x for x in (tracefmt.parse_line(l) for l in sections(r.console)["trace"]) if x is not None]
    return [x for x in recs if x.pid == int(m.group(1))]


@pytest.fixture(scope="module")
def traced(tmp_path_factory, debian_kernel, kernel_dbg, make_initramfs, boot_kernel):
    """The opener's records at do_sys_openat2:17: (the rewritten kernel's, compiled from the
    debug vmlinux's DWARF; the unmodified kernel's tracefs event of perf's own line for the
    same definition).  Two boots, as test_kernel_perfprobe.py's pair."""
    d = tmp_path_factory.mktemp("perfprobe-dwarf")
    p = perf(_dbg_vmlinux(kernel_dbg, debian_kernel), "-D", LINE17)
    assert p.returncode == 0, p.stderr
    perf_line = next(l for l in p.stdout.splitlines() if l.startswith("p:"))
    perf_line = re.sub(r"^p:\S+", "p:kp_perf", perf_line)
    spec = d / "probes.toml"
    spec.write_text(f'probes = ["kp_dw={LINE17}"]\n')
    out = d / "vmlinuz.kp"
    run("instrument", debian_kernel.vmlinuz, "--spec", spec, "-o", out,
        env={"KPREWRITE_DEBUG_FILE_DIRECTORY": kernel_dbg})
    src = d / "opener.c"
    src.write_text(OPENER_C.replace("FILE", FILE))
    subprocess.run(["gcc", "-static", "-O2", "-o", d / "opener", src], check=True)
    show = f'echo "== trace"; cat {TRACING}/trace\necho "== end"\n'
    ours = _boot(boot_kernel, make_initramfs, "perfprobe-dwarf", out, d / "opener", "/opener\n" + show)
    commands = f"""
echo '{perf_line}' > {TRACING}/kprobe_events
echo 1 > {TRACING}/events/kprobes/kp_perf/enable
/opener
echo 0 > {TRACING}/events/kprobes/kp_perf/enable
""" + show
    theirs = _boot(boot_kernel, make_initramfs, "perfprobe-dwarf-tracefs", debian_kernel.vmlinuz, d / "opener",
                   commands)
    return [r.args for r in ours if r.event == "kp_dw"], [r.args for r in theirs if r.event == "kp_perf"]


def test_line_event_equals_perfs_event(traced):
    ours, theirs = traced
    # the struct file pointer differs between two boots; what it points to does not
    strip = lambda recs: [{k: v for k, v in r.items() if k != "f"} for r in recs]  # noqa: E731
    assert len(ours) == 3 and strip(ours) == strip(theirs), (ours, theirs)
    num = lambda v: int(v, 16) if isinstance(v, str) and v.startswith("0x") else v  # noqa: E731
    fds = [num(r["fd"]) for r in ours]
    assert all(isinstance(x, int) and x >= 0 for x in fds) and len(set(fds)) == 3, ours
    assert all(r["name"] == FILE for r in ours), ours
    # open_flags.open_flag: O_CREAT|O_TRUNC|O_WRONLY, then O_RDONLY (build_open_flags() takes
    # O_CLOEXEC out), then O_APPEND|O_RDWR
    flags = [num(r["open_flag"]) for r in ours]
    assert flags[0] & 0o1103 == 0o1101 and flags[1] & 0o3103 == 0 and flags[2] & 0o2003 == 0o2002, ours
    assert num(ours[0]["mode"]) & 0o7777 == 0o640, ours

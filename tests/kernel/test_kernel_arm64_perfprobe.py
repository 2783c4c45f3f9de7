"""perf probe definitions in Debian's arm64 kernel, against perf itself (`perf probe -k VMLINUX -D`,
reading the -dbg package's vmlinux with libdw): the kprobe_events lines `check` prints for them
are perf's -- the same addresses, the arm64 registers (%x0...%x30, %sp), stack offsets, members
through pointers and types.

- from the Image's BTF (no other input): a function's parameters, members through pointers, a
  string, and FUNC%return;
- from the -dbg vmlinux's DWARF (KPREWRITE_DEBUG_FILE): source lines and their locals (in
  callee-saved registers and on the stack), and a function inlined into its callers, each site.

Slow: the -dbg package is a 262 MB download (arm64_env.obtain_dbg_vmlinux(), cached).  The events
these lines become are traced in a boot by test_kernel_arm64_events.py."""
from __future__ import annotations

import subprocess

import pytest

from conftest import KPREWRITE, TREE_ENV

import arm64_env
from test_kernel_perfprobe_dwarf import _compiled, _normal, _symbols, perf

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

BTF_SPECS = [
    "do_sys_openat2 dfd filename how->flags how->mode",
    "do_filp_open dfd pathname->name:string op->open_flag",
    "vfs_read file count pos",
    "do_sys_openat2%return $retval",
]
DWARF_SPECS = [
    "do_sys_openat2:17 fd f tmp->name:string op.open_flag op.mode",
    "do_sys_openat2:5 fd how->flags dfd",
    "getname_flags filename",
]


@pytest.fixture(scope="module")
def dbg_vmlinux(arm64_kernel):
    return arm64_env.env(arm64_env.obtain_dbg_vmlinux, arm64_kernel)


def _check(image, specs, tmp_path, env=None) -> list[str]:
    spec = tmp_path / "probes.toml"
    spec.write_text("probes = [" + ", ".join(f'"{s}"' for s in specs) + "]\n")
    e = {k: v for k, v in TREE_ENV.items() if k not in ("KPREWRITE_DEBUG_FILE", "KPREWRITE_DEBUG_FILE_DIRECTORY")}
    r = subprocess.run([*KPREWRITE, "check", str(image), "--spec", str(spec)], capture_output=True, text=True,
                       env={**e, **(env or {})})
    assert r.returncode == 0, r.stderr
    return _compiled(r.stdout)


def _equal_perfs(ours: list[str], specs, dbgv) -> None:
    syms = _symbols(dbgv)
    for s in specs:
        p = perf(dbgv, "-D", s)
        assert p.returncode == 0, (s, p.stderr)
        theirs = sorted(_normal(l, syms) for l in p.stdout.splitlines() if l[:2] in ("p:", "r:"))
        assert theirs, (s, p.stdout)
        mine = sorted(_normal(l, syms) for l in ours[:len(theirs)])
        # perf probes a function's entry past its two ftrace NOPs (+8); ours is the entry, whose
        # hit runs past them too (docs/kernel.md: the probe on an entry takes the instruction
        # after the NOPs) -- the same instruction
        starts = set(syms.values())
        mine = [(k, a + 8 if k == "p" and a in starts else a, args) for k, a, args in mine]
        # perf leaves $retval untyped (the kernel reads it as u64); ours is typed from the BTF
        mine = [(k, a, [x.replace("$retval:s64", "$retval") for x in args]) for k, a, args in mine]
        assert mine == theirs, (s, mine, theirs)
        ours = ours[len(theirs):]
    assert ours == []


def test_btf_definitions_equal_perfs(arm64_kernel, dbg_vmlinux, tmp_path):
    ours = _check(arm64_kernel.vmlinuz, BTF_SPECS, tmp_path)
    assert ours[0] == ("p:probe/do_sys_openat2 do_sys_openat2 dfd=%x0:s32 filename=%x1:x64 "
                       "flags=+0(%x2):x64 mode=+8(%x2):x64"), ours
    _equal_perfs(ours, BTF_SPECS, dbg_vmlinux)


def test_dwarf_lines_and_inlined_sites_equal_perfs(arm64_kernel, dbg_vmlinux, tmp_path):
    ours = _check(arm64_kernel.vmlinuz, DWARF_SPECS, tmp_path, env={"KPREWRITE_DEBUG_FILE": str(dbg_vmlinux)})
    assert ours[0] == ("p:probe/do_sys_openat2_L17 do_sys_openat2+0xd0 fd=%x19:s32 f=%x0:x64 "
                       "name=+0(+0(%x22)):string open_flag=+4(%sp):s32 mode=+8(%sp):x16"), ours
    assert len([l for l in ours if "getname_flags" in l.split()[0]]) == 9, ours
    _equal_perfs(ours, DWARF_SPECS, dbg_vmlinux)

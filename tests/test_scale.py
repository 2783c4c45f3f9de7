"""At scale, on code no one here wrote: every function entry of the libpython
that runs these tests, then that interpreter's own regression tests on it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from conftest import kprewrite, profile

LIBDIR = sysconfig.get_config_var("LIBDIR")
LDLIB = sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY")


@pytest.mark.skipif(not sysconfig.get_config_var("Py_ENABLE_SHARED"), reason="this Python has no shared libpython")
def test_every_function_entry_of_libpython(tmp_path):
    lib = Path(LIBDIR) / LDLIB
    spec = tmp_path / "all.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "*"\n')
    check = kprewrite("check", lib, "--spec", spec)
    decisions = [l.split("  ")[2] for l in check.stdout.splitlines()]
    optimized = decisions.count("optimized")
    reasons: dict[str, int] = {}
    for l in check.stdout.splitlines():
        parts = l.split("  ")
        if parts[2] != "optimized":
            reasons[parts[3].split(" at ")[0]] = reasons.get(parts[3].split(" at ")[0], 0) + 1
    out_dir = tmp_path / "lib"
    out_dir.mkdir()
    t = time.monotonic()
    r = kprewrite("instrument", lib, "--spec", spec, "-o", out_dir / LDLIB)
    rewrite_s = time.monotonic() - t
    assert "probes placed" in r.stderr
    print(f"\nlibpython function entries: {len(decisions)}; optimized {optimized} "
          f"({100 * optimized / len(decisions):.1f}%); int3 {decisions.count('int3')}, "
          f"refused {decisions.count('refused')}; not optimized: "
          + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])))
    print(f"rewrite time {rewrite_s:.2f} s")
    assert optimized / len(decisions) > 0.85

    env = dict(os.environ, LD_LIBRARY_PATH=str(out_dir), KPREWRITE_PROFILE=str(tmp_path / "prof"))
    r = subprocess.run([sys.executable, "-c", "import json, re; print(json.dumps(re.findall('a+', 'caaab')))"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout == '["aaa"]\n', r.stderr
    rows = [l.split() for l in (tmp_path / "prof").read_text().splitlines()]
    # One kprobe_profile row per placed probe (static functions may share a name):
    # every entry is placed, optimized or as a breakpoint (int3) probe.
    # Refused are only what the kernel refuses as a kprobe (PLT stubs, can_probe).
    assert decisions.count("refused") < 10
    assert len(rows) == optimized + decisions.count("int3") and sum(int(r[1]) for r in rows) > 100_000
    (tmp_path / "prof").unlink()

    cmd = [sys.executable, "-m", "test", "test_json", "test_re", "test_list", "test_bisect"]
    t = time.monotonic()
    base = subprocess.run(cmd, capture_output=True, text=True)
    base_s = time.monotonic() - t
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    probed_s = time.monotonic() - t
    assert base.returncode == 0, base.stdout[-2000:]
    assert r.returncode == 0 and "Result: SUCCESS" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    hits = sum(int(l.split()[1]) for l in (tmp_path / "prof").read_text().splitlines())
    print(f"regression tests: {base_s:.2f} s original, {probed_s:.2f} s rewritten ({probed_s / base_s:.2f}x), {hits:,} probe hits")

    # The same entries with only the jump-optimized probes (E9Tool patches only
    # what it can jump to, so this is the figure to compare with it).
    listed = kprewrite("list", out_dir / LDLIB).stdout.splitlines()
    opt_addrs = [int(l.split()[0], 16) for l in listed if l.endswith("[OPTIMIZED]")]
    assert len(opt_addrs) == optimized
    spec_opt = tmp_path / "optimized.toml"
    spec_opt.write_text("".join(f"[[kprobe]]\naddr = {a:#x}\n" for a in opt_addrs))
    opt_dir = tmp_path / "lib-opt"
    opt_dir.mkdir()
    kprewrite("instrument", lib, "--spec", spec_opt, "-o", opt_dir / LDLIB)
    env_opt = dict(env, LD_LIBRARY_PATH=str(opt_dir), KPREWRITE_PROFILE=str(tmp_path / "prof-opt"))
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env_opt)
    opt_s = time.monotonic() - t
    assert r.returncode == 0 and "Result: SUCCESS" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    hits = sum(int(l.split()[1]) for l in (tmp_path / "prof-opt").read_text().splitlines())
    print(f"regression tests, jump-optimized entries only: {opt_s:.2f} s ({opt_s / base_s:.2f}x), {hits:,} probe hits")

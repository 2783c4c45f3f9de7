"""At scale, on code no one here wrote: every function entry of the libpython
that runs these tests, then that interpreter's own regression tests on it.

The regression tests with every entry probed (most of them breakpoint probes:
minutes) are marked slow, out of the default run (`pytest -m slow` runs them);
the rewrite itself, a short run, and the regression tests with only the
jump-optimized entries probed stay in it."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import LIBPYTHON, kprewrite

ARCHES = ["x86_64"]      # x86-64 only: the libpython running these tests (the host's)

pytestmark = pytest.mark.skipif(LIBPYTHON is None, reason="this Python has no shared libpython")

REGRTEST = [sys.executable, "-m", "test", "test_json", "test_re", "test_list", "test_bisect"]


@pytest.fixture(scope="module")
def every_entry(tmp_path_factory):
    """`check` and `instrument` of libpython with a probe on every function entry:
    (check's lines, the decisions, instrument's stderr, the folder of the rewritten library)."""
    tmp = tmp_path_factory.mktemp("libpython")
    spec = tmp / "all.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "*"\n')
    check = kprewrite("check", LIBPYTHON, "--spec", spec)
    out_dir = tmp / "lib"
    out_dir.mkdir()
    t = time.monotonic()
    r = kprewrite("instrument", LIBPYTHON, "--spec", spec, "-o", out_dir / LIBPYTHON.name)
    print(f"\nrewrite time {time.monotonic() - t:.2f} s")
    lines = check.stdout.splitlines()
    return lines, [l.split("  ")[2] for l in lines], r.stderr, out_dir


@pytest.fixture(scope="module")
def regrtest_original():
    """The regression tests on the original libpython: (result, seconds)."""
    t = time.monotonic()
    base = subprocess.run(REGRTEST, capture_output=True, text=True)
    return base, time.monotonic() - t


def test_every_function_entry_of_libpython(tmp_path, every_entry, regrtest_original):
    lines, decisions, stderr, out_dir = every_entry
    optimized = decisions.count("optimized")
    reasons: dict[str, int] = {}
    for l in lines:
        parts = l.split("  ")
        if parts[2] != "optimized":
            reasons[parts[3].split(" at ")[0]] = reasons.get(parts[3].split(" at ")[0], 0) + 1
    assert "probes placed" in stderr
    print(f"\nlibpython function entries: {len(decisions)}; optimized {optimized} "
          f"({100 * optimized / len(decisions):.1f}%); int3 {decisions.count('int3')}, "
          f"refused {decisions.count('refused')}; not optimized: "
          + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])))
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

    # The same entries with only the jump-optimized probes (E9Tool patches only
    # what it can jump to, so this is the figure to compare with it).
    base, base_s = regrtest_original
    assert base.returncode == 0, base.stdout[-2000:]
    listed = kprewrite("list", out_dir / LIBPYTHON.name).stdout.splitlines()
    opt_addrs = [int(l.split()[0], 16) for l in listed if l.endswith("[OPTIMIZED]")]
    assert len(opt_addrs) == optimized
    spec_opt = tmp_path / "optimized.toml"
    spec_opt.write_text("".join(f"[[kprobe]]\naddr = {a:#x}\n" for a in opt_addrs))
    opt_dir = tmp_path / "lib-opt"
    opt_dir.mkdir()
    kprewrite("instrument", LIBPYTHON, "--spec", spec_opt, "-o", opt_dir / LIBPYTHON.name)
    env_opt = dict(env, LD_LIBRARY_PATH=str(opt_dir), KPREWRITE_PROFILE=str(tmp_path / "prof-opt"))
    t = time.monotonic()
    r = subprocess.run(REGRTEST, capture_output=True, text=True, env=env_opt)
    opt_s = time.monotonic() - t
    assert r.returncode == 0 and "Result: SUCCESS" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    hits = sum(int(l.split()[1]) for l in (tmp_path / "prof-opt").read_text().splitlines())
    print(f"regression tests, jump-optimized entries only: {opt_s:.2f} s ({opt_s / base_s:.2f}x), {hits:,} probe hits")


@pytest.mark.slow
def test_regression_tests_with_every_entry_probed(tmp_path, every_entry, regrtest_original):
    """The interpreter's regression tests with every function entry probed, the
    breakpoint (int3) probes included: minutes, so out of the default run."""
    _, _, _, out_dir = every_entry
    base, base_s = regrtest_original
    assert base.returncode == 0, base.stdout[-2000:]
    env = dict(os.environ, LD_LIBRARY_PATH=str(out_dir), KPREWRITE_PROFILE=str(tmp_path / "prof"))
    t = time.monotonic()
    r = subprocess.run(REGRTEST, capture_output=True, text=True, env=env)
    probed_s = time.monotonic() - t
    assert r.returncode == 0 and "Result: SUCCESS" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    hits = sum(int(l.split()[1]) for l in (tmp_path / "prof").read_text().splitlines())
    print(f"regression tests: {base_s:.2f} s original, {probed_s:.2f} s rewritten ({probed_s / base_s:.2f}x), {hits:,} probe hits")

"""Every instruction of libpython's 50 largest functions probed (the
every-instruction figure): how many are jump-optimized, and why the rest are
not, from `kprewrite check --format json`.

    python3 benchmarks/libpython_insns.py [LIBPYTHON] [--instrument] [--run] [--oracle]

Functions are the library's FUNC symbols by size (one per address), their
instructions decoded linearly from the start with Capstone, one `addr =` probe
each.  --instrument also rewrites the library (timed); --run then runs
`python -m test test_json test_re test_list test_bisect` on it with
KPREWRITE_PROFILE and compares against the unprobed run.  --oracle (with
--instrument) also rewrites it with every probe a breakpoint (--no-optimize: the
traps' hits do not depend on the jump analysis, the oracle of
tests/test_jump_tables.py) and runs a small json/re script on both: the outputs
and every probe's hit count must be equal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from pathlib import Path

import capstone
from elftools.elf.elffile import ELFFile

ROOT = Path(__file__).resolve().parent.parent
KPREWRITE = [sys.executable, "-m", "rewriter"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def libpython() -> Path:
    return Path(sysconfig.get_config_var("LIBDIR")) / (sysconfig.get_config_var("INSTSONAME")
                                                        or sysconfig.get_config_var("LDLIBRARY"))


def largest_functions(path: Path, n: int = 50):
    """(name, address, size) of the n largest FUNC symbols, one per address."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        by_addr = {}
        for sec in ("symtab", "dynsym"):
            s = elf.get_section_by_name("." + sec)
            if s is None:
                continue
            for sym in s.iter_symbols():
                if sym["st_info"]["type"] == "STT_FUNC" and sym["st_size"] and sym["st_shndx"] != "SHN_UNDEF":
                    by_addr.setdefault(sym["st_value"], (sym.name, sym["st_value"], sym["st_size"]))
        funcs = sorted(by_addr.values(), key=lambda t: (-t[2], t[1]))[:n]
        text = elf.get_section_by_name(".text")
        base, data = text["sh_addr"], text.data()
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    out = []
    for name, addr, size in funcs:
        code = data[addr - base:addr - base + size]
        out.append((name, addr, [i.address for i in md.disasm(code, addr)]))
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    lib = Path(args[0]) if args else libpython()
    funcs = largest_functions(lib)
    addrs = [a for _, _, ins in funcs for a in ins]
    tmp = Path(tempfile.mkdtemp(prefix="kp-insns-"))
    spec = tmp / "insns.toml"
    spec.write_text("".join(f"[[kprobe]]\naddr = {a:#x}\n" for a in addrs))
    t = time.monotonic()
    r = subprocess.run([*KPREWRITE, "check", str(lib), "--spec", str(spec), "--format", "json"],
                       capture_output=True, text=True, env=ENV)
    doc = json.loads(r.stdout)
    dt = time.monotonic() - t
    decisions = Counter(p["decision"] for p in doc["probes"])
    reasons = Counter(p["reason"]["check"] for p in doc["probes"]
                      if p["decision"] != "optimized" and p["reason"])
    n = len(doc["probes"])
    print(f"{lib}: {len(funcs)} functions, {n} instructions probed (check: {dt:.1f} s)")
    print(f"  optimized {decisions['optimized']} ({100 * decisions['optimized'] / n:.1f}%), "
          f"int3 {decisions['int3']}, refused {decisions['refused']}")
    for check, k in reasons.most_common():
        print(f"    {k:7d}  {check}")
    if "--instrument" not in sys.argv:
        return
    out_dir = tmp / "lib"
    out_dir.mkdir()
    t = time.monotonic()
    subprocess.run([*KPREWRITE, "instrument", str(lib), "--spec", str(spec), "-o", str(out_dir / lib.name)],
                   check=True, env=ENV, capture_output=True)
    print(f"  instrument: {time.monotonic() - t:.1f} s")
    if "--oracle" in sys.argv:
        oracle(lib, spec, out_dir, tmp)
    if "--run" not in sys.argv:
        return
    test = [sys.executable, "-m", "test", "test_json", "test_re", "test_list", "test_bisect"]
    t = time.monotonic()
    base = subprocess.run(test, capture_output=True, text=True)
    t0 = time.monotonic() - t
    t = time.monotonic()
    env = dict(os.environ, LD_LIBRARY_PATH=str(out_dir), KPREWRITE_PROFILE=str(tmp / "profile"))
    probed = subprocess.run(test, capture_output=True, text=True, env=env)
    t1 = time.monotonic() - t
    hits = missed = 0
    for line in (tmp / "profile").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit():
            hits += int(parts[1])
            missed += int(parts[2])
    ok = probed.returncode == base.returncode == 0
    print(f"  regrtest: {'passes' if ok else 'FAILS'}, {t0:.2f} s -> {t1:.2f} s ({t1 / t0:.2f}x), "
          f"{hits} hits, {missed} missed")
    if not ok:
        print(probed.stdout[-2000:], probed.stderr[-2000:])


ORACLE_SCRIPT = ("import json, re\n"
                 "d = {str(i): [i, i * 2.5, 'x' * (i % 7), {'k': [None, True]}] for i in range(300)}\n"
                 "s = json.dumps(d, sort_keys=True)\n"
                 "assert json.loads(s) == d\n"
                 "print(len(s), len(re.findall(r'[0-9]+[.]?[0-9]*', s)), sorted(d)[:3])\n")


def _profile(path: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit():
            out[parts[0]] = (int(parts[1]), int(parts[2]))
    return out


def oracle(lib: Path, spec: Path, out_dir: Path, tmp: Path) -> None:
    """Every probe's hits with the jump-optimized library against the same probes as
    breakpoints, on ORACLE_SCRIPT."""
    int3_dir = tmp / "lib-int3"
    int3_dir.mkdir()
    subprocess.run([*KPREWRITE, "instrument", str(lib), "--spec", str(spec), "--no-optimize",
                    "-o", str(int3_dir / lib.name)], check=True, env=ENV, capture_output=True)
    want = subprocess.run([sys.executable, "-c", ORACLE_SCRIPT], capture_output=True, text=True)
    runs = {}
    for label, d in (("optimized", out_dir), ("int3", int3_dir)):
        prof = tmp / f"oracle-{label}"
        t = time.monotonic()
        r = subprocess.run([sys.executable, "-c", ORACLE_SCRIPT], capture_output=True, text=True,
                           env=dict(os.environ, LD_LIBRARY_PATH=str(d), KPREWRITE_PROFILE=str(prof)))
        runs[label] = (r, _profile(prof), time.monotonic() - t)
    (r1, p1, t1), (r2, p2, t2) = runs["optimized"], runs["int3"]
    same_out = r1.stdout == r2.stdout == want.stdout and r1.returncode == r2.returncode == want.returncode == 0
    diff = [k for k in p2 if p1.get(k) != p2[k]] + [k for k in p1 if k not in p2]
    print(f"  oracle: output {'equal' if same_out else 'DIFFERS'}; {len(p1)} probes, "
          f"{sum(h for h, _ in p1.values())} hits ({t1:.1f} s) against {sum(h for h, _ in p2.values())} "
          f"as breakpoints ({t2:.1f} s); {'every count equal' if not diff else f'{len(diff)} counts DIFFER'}")
    for k in diff[:10]:
        print(f"    {k}: {p1.get(k)} optimized, {p2.get(k)} int3")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The tiny-function case: a kretprobe on a 6-byte function,
`lea 0x1(%rdi,%rdi,1),%rax; ret`, placed last in .text (no padding after its
`ret` to borrow, so its entry's region grows to take the ret and the return
hook runs in the entry's detour), called in a tight loop.

Rows (each against the original in the same run, (rewritten - original) / N):

- ro:       empty entry_handler and handler (benchmarks/handlers.c), the end of .text;
- ro-pad:   the same on a copy of the function with padding after it (its ret has a
            region of its own), for comparison;
- r:        empty handler only, the end of .text;
- light:    no handler at all (a light kretprobe: the entry counts the hit, the exit
            runs nothing), the end of .text.

    python3 benchmarks/tiny.py         (BENCH_N calls, BENCH_RUNS runs, medians)

The loop is timed in CPU time (CLOCK_PROCESS_CPUTIME_ID), so that time spent
waiting for a CPU on a shared machine is not counted.  The figures are in
benchmarks/README.md."""
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
KPREWRITE = [sys.executable, "-m", "rewriter"]
TREE_ENV = dict(os.environ, PYTHONPATH=str(HERE.parent))
N = int(os.environ.get("BENCH_N", 50_000_000))
RUNS = int(os.environ.get("BENCH_RUNS", 7))

PROG = r"""
__asm__(
".text\n"
".globl tiny_pad\n.type tiny_pad,@function\n.p2align 4\ntiny_pad:\n"
"  .cfi_startproc\n  lea 0x1(%rdi,%rdi,1),%rax\n  ret\n  .cfi_endproc\n"
".size tiny_pad,.-tiny_pad\n.p2align 4\n"
/* Last in .text: a section of its own, sorted after every other .text input. */
".pushsection .text.zzz_last,\"ax\",@progbits\n"
".globl tiny6\n.type tiny6,@function\ntiny6:\n"
"  .cfi_startproc\n  lea 0x1(%rdi,%rdi,1),%rax\n  ret\n  .cfi_endproc\n"
".size tiny6,.-tiny6\n"
".popsection\n");
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
long tiny6(long), tiny_pad(long);
int main(int argc, char **argv)
{
	long n = atol(argv[1]), s = 0;
	long (*f)(long) = argc > 2 ? tiny_pad : tiny6;
	struct timespec a, b;
	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
	for (long i = 0; i < n; i++)
		s += f(i & 0xff);
	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
	printf("%.3f %ld\n", (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec), s);
	return 0;
}
"""

SPECS = {
    "ro": ("tiny6", 'handler = "empty_ret"\nentry_handler = "empty_entry"\n'),
    "ro-pad": ("tiny_pad", 'handler = "empty_ret"\nentry_handler = "empty_entry"\n'),
    "r": ("tiny6", 'handler = "empty_ret"\n'),
    "light": ("tiny6", ""),
}


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "tiny.c").write_text(PROG)
        orig = tmp / "tiny"
        subprocess.run(["gcc", "-O2", "-o", str(orig), str(tmp / "tiny.c")], check=True)
        text = subprocess.run(["readelf", "-SW", str(orig)], capture_output=True, text=True).stdout
        sec = next(l.split() for l in text.splitlines() if " .text " in l)
        end = int(sec[sec.index(".text") + 2], 16) + int(sec[sec.index(".text") + 4], 16)
        syms = {l.split()[2]: int(l.split()[0], 16)
                for l in subprocess.run(["nm", str(orig)], capture_output=True, text=True).stdout.splitlines()
                if len(l.split()) == 3}
        assert syms["tiny6"] + 6 == end, "tiny6 is not the last 6 bytes of .text"
        rows = {}
        for k, (fn, keys) in SPECS.items():
            spec = tmp / f"{k}.toml"
            spec.write_text((f'handlers = ["{HERE / "handlers.c"}"]\n' if keys else "")
                            + f'[[kretprobe]]\nsymbol_name = "{fn}"\n{keys}')
            out = tmp / f"tiny.{k}"
            subprocess.run([*KPREWRITE, "instrument", str(orig), "--spec", str(spec), "-o", str(out)],
                           check=True, env=TREE_ENV)
            line = subprocess.run([*KPREWRITE, "check", str(orig), "--spec", str(spec)], capture_output=True,
                                  text=True, env=TREE_ENV).stdout.strip()
            rows[k] = (out, ("pad",) if fn == "tiny_pad" else (), line)
        times = {k: [] for k in ["orig", "orig-pad", *rows]}
        for _ in range(RUNS):
            for k, args in (("orig", ()), ("orig-pad", ("pad",))):
                times[k].append(float(subprocess.run([str(orig), str(N), *args], capture_output=True, text=True,
                                                     check=True).stdout.split()[0]))
            for k, (exe, args, _) in rows.items():
                times[k].append(float(subprocess.run([str(exe), str(N), *args], capture_output=True, text=True,
                                                     check=True).stdout.split()[0]))
        print(f"N = {N:,} calls, {RUNS} runs each, medians; load {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print("| row | check | per call, original | per call, rewritten | per call added |")
        print("|---|---|---|---|---|")
        for k, (_, args, line) in rows.items():
            base = statistics.median(times["orig-pad" if args else "orig"]) / N
            m = statistics.median(times[k]) / N
            print(f"| {k} | `{line}` | {base:.2f} ns | {m:.2f} ns | **{m - base:.2f} ns** |")


if __name__ == "__main__":
    main()

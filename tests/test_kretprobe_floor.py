"""Kretprobes on every function at their floor (issue 27).

A stripped library's hot/cold split functions: the cold blocks have FDEs of
their own that start mid-frame (CFA %rsp+N, N > 8) and no `.cold` name; a
kretprobe there is refused by its CFA rule (entry_frame), and the hot part's
exits include its cold block's, as for a named `.cold` part."""
from __future__ import annotations

import re
import subprocess

from conftest import CC, cc, check_lines, instrument, profile, run, write_spec

LIB = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
__attribute__((noinline, cold)) void lib_warn(const char *what, long v) { fprintf(stderr, "warn %s %ld\n", what, v); }
long lib_sum(const int *a, int n) {
    long s = 0;
    for (int i = 0; i < n; i++) {
        if (__builtin_expect(a[i] < 0, 0)) {
            lib_warn("negative", a[i]);
            s -= a[i] * 2;
            continue;
        }
        s += a[i];
    }
    return s;
}
char *lib_join(const char *x, const char *y) {
    size_t n = strlen(x), m = strlen(y);
    char *r = malloc(n + m + 2);
    if (__builtin_expect(r == NULL, 0)) {
        lib_warn("oom", (long)(n + m));
        abort();
    }
    memcpy(r, x, n); r[n] = '/'; memcpy(r + n + 1, y, m + 1);
    return r;
}
int lib_classify(int v) {
    if (__builtin_expect(v > 1000000, 0)) {
        lib_warn("huge", v);
        return v % 7 + lib_classify(v / 1000);
    }
    return v & 3;
}
"""

MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
long lib_sum(const int *a, int n); char *lib_join(const char *x, const char *y); int lib_classify(int v);
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 100;
    int *a = malloc(n * sizeof *a);
    for (int i = 0; i < n; i++) a[i] = (i % 37 == 5) ? -i : i;
    long t = lib_sum(a, n);
    for (int i = 0; i < n; i++) t += lib_classify(i * 40503);
    char *j = lib_join("abc", "defg");
    printf("t=%ld j=%s\n", t, j);
    free(j); free(a);
    return 0;
}
"""


def _build_split(tmp):
    (tmp / "lib.c").write_text(LIB)
    lib = tmp / "libhc.so"
    subprocess.run([CC, "-O2", "-fPIC", "-shared", "-freorder-blocks-and-partition", str(tmp / "lib.c"),
                    "-o", str(lib)], check=True)
    subprocess.run(["strip", str(lib)], check=True)
    prog = cc(tmp, "main", MAIN, "-O2", f"-L{tmp}", "-lhc")
    spec = write_spec(tmp, '[[kretprobe]]\nsymbol_name = "*"\n')
    outs = {}
    for name, extra in (("opt", ()), ("int3", ("--no-optimize",))):
        (tmp / name).mkdir()
        outs[name] = instrument(lib, spec, tmp / name / "libhc.so", *extra)
    return prog, lib, check_lines(lib, spec), outs


def test_stripped_cold_parts_refused_by_their_cfa_rule(once, runner):
    prog, lib, check, outs = once(_build_split)
    cold = [l for l in check if re.match(r"sub_[0-9a-f]+\+0x0  r  refused  entry_frame at ", l)]
    # Three cold blocks (one per function with an unlikely path), each refused by its CFA rule.
    assert len(cold) == 3, "\n".join(check)
    assert all("is %rsp+" in l and "not %rsp+8" in l for l in cold), cold
    # The hot parts follow their cold blocks as .cold parts: every exit hooked, no trampoline.
    for f in ("lib_sum", "lib_join", "lib_classify"):
        line = next(l for l in check if l.startswith(f + "+0x0"))
        assert "  optimized  returns: 0x" in line and "trampoline" not in line and "int3" not in line, line
    want = run(prog, 200, runner=runner, libdir=lib.parent)
    assert want.returncode == 0 and "warn huge" in want.stderr, want.stderr
    counts = {}
    for name, out in outs.items():
        got = run(prog, 200, runner=runner, libdir=out.parent, env={"KPREWRITE_PROFILE": "-"})
        assert got.returncode == 0 and got.stdout == want.stdout, got.stdout + got.stderr[-2000:]
        counts[name] = profile(got.stderr)
    assert counts["opt"] == counts["int3"] and counts["opt"]["r_lib_classify_0"][0] >= 200, counts

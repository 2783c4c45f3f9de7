"""What the real-software tests share (test_real_software.py for x86-64,
test_aarch64_real_software.py under qemu-aarch64): the every-function specs, and the
comparison of an original's run with its rewrite's."""
from __future__ import annotations

from pathlib import Path

from conftest import profile

KPROBES = '[[kprobe]]\nsymbol_name = "*"\n'
# maxactive keeps each call's instance and every exit's hook (with nothing to run at the
# returns and no maxactive, a kretprobe is light: its exits are not hooked at all).
KRETPROBES = '[[kretprobe]]\nsymbol_name = "*"\nmaxactive = 20\n'


def assert_same_run(a, b, prof: Path | None) -> None:
    """The rewrite's run `b` printed and returned what the original's `a` did, and (with a
    profile file, KPREWRITE_PROFILE) its probes fired."""
    assert (b.returncode, b.stdout, b.stderr) == (a.returncode, a.stdout, a.stderr)
    if prof is None:
        return
    p = profile("\n".join("  " + line.strip() for line in prof.read_text().splitlines()))
    assert sum(h for h, _ in p.values()) > 0, prof.read_text()[:500]

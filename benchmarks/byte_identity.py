"""Byte identity of two revisions: the same inputs rewritten by each, the outputs compared.

    python3 benchmarks/byte_identity.py REV_A [REV_B]      (REV_B: the work tree)

A move of code (a module into a package, C text into runtime/ files) must leave every
output the same bytes; this checks it on user programs (the samples, the host's and, with
their cross compilers, every other back end's: AArch64), a system library with a probe on
every function and kretprobes, busybox with breakpoint probes, and, when the kernel tests'
cache has Debian's kernels (tests/kernel/kernel_env.py, arm64_env.py), a kernel module, the
vmlinux and the arm64 Image.
Each revision is checked out with `git worktree` into a temporary folder and run as
`python3 -m rewriter` from it.
Prints one line per output, SAME or DIFFERS, and exits 1 if any differs or fails.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
KERNEL_CACHE = Path.home() / ".cache" / "kprewrite" / "kernel"

MODULE_SPEC = """events = ["p:kp_mid romfs_get_tree+0xc fill=%si:x64", "r:kp_ret romfs_get_tree ret=$retval:s32"]
[[kprobe]]
symbol_name = "romfs_get_tree"
[[kprobe]]
symbol_name = "romfs_init_fs_context"
offset = 5
[[kprobe]]
symbol_name = "romfs_init_fs_context"
offset = 0xc
[[kretprobe]]
symbol_name = "romfs_fill_super"
"""
KERNEL_SPEC = """events = ["p:kp_open do_sys_openat2 dfd=%di:s32", "r:kp_getpid __x64_sys_getpid ret=$retval"]
[[kprobe]]
symbol_name = "__x64_sys_getppid"
[[kretprobe]]
symbol_name = "__x64_sys_getuid"
"""
ARM64_SPEC = """[[kprobe]]
symbol_name = "__arm64_sys_getppid"
[[kretprobe]]
symbol_name = "__arm64_sys_getuid"
"""


def inputs(work: Path) -> list[tuple[str, list[str], Path]]:
    """(name, instrument's arguments before -o, the folder to run in) of each case."""
    def cc(compiler: str, sample: str, out: str) -> Path | None:
        if not shutil.which(compiler):
            return None
        exe = work / out
        subprocess.run([compiler, "-O2", "-o", str(exe), str(SAMPLES / sample / "program.c")], check=True)
        return exe
    (work / "all.toml").write_text('[[kprobe]]\nsymbol_name = "*"\n')
    (work / "ret.toml").write_text('[[kretprobe]]\nsymbol_name = "sqlite3_*"\n')
    cases = []
    for sample in ("kprobe_example", "kretprobe_example", "events_example"):
        exe = cc("gcc", sample, sample)
        cases.append((sample, [str(exe), "--spec", "probes.toml"], SAMPLES / sample))
    # Every other back end's, with its cross compiler where installed (kprobe_example.aarch64...).
    sys.path.insert(0, str(ROOT))
    from rewriter.arch import MACHINES, get_arch, host_machine
    for arch in sorted(set(MACHINES.values()) - {host_machine()}):
        exe = cc(f"{get_arch(arch).toolchain.TRIPLE}-gcc", "kprobe_example", f"kprobe_example.{arch}")
        if exe:
            cases.append((f"kprobe_example.{arch}", [str(exe), "--spec", "probes.toml"], SAMPLES / "kprobe_example"))
    lib = Path("/usr/lib/x86_64-linux-gnu/libsqlite3.so.0")
    if lib.exists():
        cases.append(("sqlite3_every_kprobe", [str(lib), "--spec", str(work / "all.toml")], work))
        cases.append(("sqlite3_kretprobes", [str(lib), "--spec", str(work / "ret.toml")], work))
    if Path("/bin/busybox").exists():
        cases.append(("busybox_breakpoints", ["/bin/busybox", "--spec", str(work / "all.toml"), "--no-optimize"], work))
    # The newest cached kernel that has the files (an older folder may have been kept without them).
    (work / "module.toml").write_text(MODULE_SPEC)
    (work / "kernel.toml").write_text(KERNEL_SPEC)
    (work / "arm64.toml").write_text(ARM64_SPEC)
    for k in sorted(KERNEL_CACHE.glob("linux-image-*-amd64-*"), reverse=True):
        found = len(cases)
        ko = k / "modules/kernel/fs/romfs/romfs.ko"
        if ko.exists() and (k / "Module.symvers").exists():
            cases.append(("romfs.ko", [str(ko), "--spec", str(work / "module.toml"), "--system-map",
                                       str(k / "Module.symvers")], work))
        if (k / "vmlinux").exists():
            cases.append(("vmlinux", [str(k / "vmlinux"), "--spec", str(work / "kernel.toml")], work))
        if len(cases) > found:
            break
    for image in sorted(KERNEL_CACHE.glob("arm64/linux-image-*/vmlinuz-*"), reverse=True):
        cases.append(("arm64_Image", [str(image), "--spec", str(work / "arm64.toml")], work))
        break
    return cases


def rewrite(tree: Path, cases, out: Path) -> dict[str, str]:
    """name -> sha256 of the output (or the error) of each case rewritten by `tree`."""
    out.mkdir(parents=True, exist_ok=True)
    sums = {}
    for name, args, cwd in cases:
        o = out / name
        r = subprocess.run([sys.executable, "-m", "rewriter", "instrument", *args, "-o", str(o), "-q"],
                           cwd=cwd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
        sums[name] = hashlib.sha256(o.read_bytes()).hexdigest() if r.returncode == 0 else \
            "failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return sums


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__.strip().splitlines()[2].strip())
        return 2
    with tempfile.TemporaryDirectory(prefix="kp-bytes-") as tmp:
        tmp = Path(tmp)
        trees = []
        for i, rev in enumerate(argv):
            t = tmp / f"tree{i}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(t), rev], check=True)
            trees.append(t)
        if len(trees) == 1:
            trees.append(ROOT)
        try:
            (tmp / "in").mkdir()
            cases = inputs(tmp / "in")
            a, b = (rewrite(t, cases, tmp / f"out{i}") for i, t in enumerate(trees))
        finally:
            for t in trees:
                if t != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(t)], check=False)
    bad = 0
    for name, _, _ in cases:
        same = a[name] == b[name] and not a[name].startswith("failed")
        bad += not same
        print(f"{'SAME   ' if same else 'DIFFERS'} {name}: {a[name][:16]} {b[name][:16]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

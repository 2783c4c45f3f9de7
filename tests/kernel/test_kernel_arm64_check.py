"""`check` on Debian's arm64 cloud kernel (its vmlinuz: an uncompressed Image with an EFI stub),
detected without a flag: symbols from the Image's own kallsyms, the link address from its
relocation of kallsyms_relative_base, the ftrace NOPs and the NOKPROBE_SYMBOL list from its
relocation table, arm64's blacklisted sections from kallsyms' text markers.  Every refusal
names its check and address."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arm64_env  # noqa: E402
from rewriter.targets.linux_kernel.aarch64 import image as arm_image, sites as ks  # noqa: E402

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def image(arm64_kernel):
    return arm_image.parse(arm64_kernel.vmlinuz.read_bytes(), str(arm64_kernel.vmlinuz))


def test_image_is_read(arm64_kernel, image):
    assert arm64_kernel.vmlinuz.read_bytes()[:2] == b"MZ"          # the EFI stub's PE header
    s = image.syms
    # _stext is _text + 64 KiB (the head); the link address is the arm64 kernel's KIMAGE_VADDR.
    assert s["_stext"] == image.text + 0x10000 and image.text >> 48 == 0xFFFF
    assert s["_stext"] < s["__arm64_sys_getppid"] < s["_etext"] <= s["_sinittext"]
    # Every ftrace site is the entry of a function and holds its two NOPs.
    sites = ks.ftrace_sites(ks.KernelImage(image.vmlinux, image.kallsyms, image.path))
    starts = {k.addr for k in image.kallsyms.symbols}
    assert len(sites) > 30000 and sum(a in starts for a in sites) > 0.99 * len(sites)
    k = ks.KernelImage(image.vmlinux, image.kallsyms, image.path)
    assert ks.verify_sites(k)["__patchable_function_entries"] == 0
    # The getppid syscall: nop; nop; paciasp (the placement issue 40 proved by boots).
    assert k.code(s["__arm64_sys_getppid"], 12) == ks.NOP * 2 + struct.pack("<I", 0xD503233F)


def test_check_arm64_rules(tmp_path, arm64_kernel, image):
    s = image.syms
    probes = [("__arm64_sys_getpid", 8, ["optimized"]),
              # The entry: its jump goes past the ftrace NOPs (Rules.share_ftrace), the ftrace form.
              ("__arm64_sys_getppid", 0, ["ftrace"]),
              ("__arm64_sys_getppid", 4, ["refused", "ftrace site (ftrace_location()"]),
              ("get_kprobe", 0, ["refused", "NOKPROBE_SYMBOL"])]
    # The first function of each blacklisted section (past its ftrace NOPs, if it has them).
    k = ks.KernelImage(image.vmlinux, image.kallsyms, image.path)
    names = {}
    for sym in image.kallsyms.symbols:
        names[sym.name] = names.get(sym.name, 0) + 1
    for rng in (".entry.text", ".irqentry.text", ".idmap.text", ".hyp.text", ".hyp.idmap.text", ".kprobes.text",
                ".noinstr.text"):
        lo, hi = k.bounds(rng)
        once = {n for n in names if names[n] == 1}
        f = next((f for f in ks.functions_in(k, lo, hi) if f.name in once and not f.name.endswith(("_start", "_end"))),
                 None)
        if f is None:           # .irqentry.text: gic_handle_irq twice (GICv2's and GICv3's)
            continue
        off = 8 if k.code(f.start, 8) == ks.NOP * 2 else 0
        probes.append((f.name, off, ["refused", f"in {rng} ("]))
    # One site of each table found in the Image (tables.py), in a function of the text with a
    # unique name, past its ftrace NOPs.
    from rewriter.elf.image import Image
    from rewriter.targets import load
    from rewriter.targets.linux_kernel.symbols import kernel
    im = load(str(arm64_kernel.vmlinuz))
    im.target.load_symbols(im)
    kk = kernel(im)
    reserved = ks.kernel_sites(kk.data, None, kk.path, image=kk)
    by_table = {}
    for r in reserved:
        by_table.setdefault(r.table, []).append(r)
    once = {n for n in names if names[n] == 1}

    def pick(table, words, inside=False):
        for r in by_table[table]:
            f = kk.function_at(r.start)
            if f is None or f.name not in once or not s["_stext"] <= f.start < s["_etext"] or r.start < f.start + 12:
                continue
            if any(o.start <= r.start - 4 < o.end for o in reserved if o.table != table):
                continue
            if inside:                      # the instruction before: refused for the whole function
                if any(o.start < r.start and o.end > r.start - 4 for o in reserved if o.start != r.start):
                    continue
                return (f.name, r.start - 4 - f.start, words)
            return (f.name, r.start - f.start, words)
        raise AssertionError(f"no site of {table}")
    probes += [pick("__jump_table", ["refused", "jump label site"]),
               pick("__bug_table", ["refused", "BUG/WARN site"]),
               pick(".altinstructions", ["refused", "alternatives site"]),
               pick("__ex_table", ["refused", "exception table entry"]),
               pick("__ex_table", ["int3", "__ex_table at", "has an exception table entry"], inside=True)]
    assert len(probes) >= 14, probes
    spec = tmp_path / "probes.toml"
    spec.write_text("".join(f'[[kprobe]]\nsymbol_name = "{n}"\noffset = {o:#x}\n' for n, o, _ in probes))
    r = kprewrite("check", arm64_kernel.vmlinuz, "--spec", spec, check=False)
    lines = r.stdout.splitlines()
    assert len(lines) == len(probes), r.stdout + r.stderr
    for (sym, off, words), line in zip(probes, lines):
        assert line.startswith(f"{sym}+{off:#x}  k  "), (line, sym, off)
        for w in words:
            assert w in line, (line, words)
        if "refused" in words and "__ex_table at" not in words:
            assert f"{s[sym] + off:#x}" in line, line        # the check's address
    refused = sum("refused" in w for _, _, w in probes)
    assert r.returncode == 1 and len(r.stderr.splitlines()) == refused, r.stderr
    doc = json.loads(kprewrite("check", arm64_kernel.vmlinuz, "--spec", spec, "--format", "json", check=False).stdout)
    for (sym, off, words), p in zip(probes, doc["probes"]):
        assert int(p["address"], 16) == s[sym] + off and p["decision"] == words[0]
        if p["decision"] == "refused":
            assert p["reason"]["check"] and int(p["reason"]["address"], 16)


def test_tables_found(arm64_kernel, image):
    """The tables of relative entries kallsyms does not bound, found in the Image (tables.py):
    every jump label site a NOP or a B, every BUG site brk #0x800, sorted exception entries."""
    from rewriter.targets.linux_kernel.aarch64 import tables
    found = tables.find(image, image.vmlinux[0x10000:])
    assert set(found) == {"__ex_table", "__jump_table", "__bug_table", ".altinstructions"}, found
    from rewriter.targets.linux_kernel.aarch64.target import TABLE_SYMBOLS
    syms = {n: a for t, (a, b) in found.items() for n, a in zip(TABLE_SYMBOLS[t], (a, b))}
    k = ks.KernelImage(image.vmlinux, {**image.syms, **syms}, image.path)
    bad = ks.verify_sites(k)
    assert bad == {"__patchable_function_entries": 0, "__bug_table": 0, "__jump_table": 0}, bad
    insns = [e.insn for e in ks.ex_table(k)]
    assert len(insns) > 500 and insns == sorted(insns)


def test_blacklist_is_the_kernels(tmp_path, arm64_kernel):
    """`kprewrite blacklist` on the Image lists every range the booted kernel's
    /sys/kernel/debug/kprobes/blacklist does (NOKPROBE_SYMBOL and arm64's sections, function by
    function), at the same addresses less the KASLR offset; nothing else but NOKPROBE addresses
    outside any function (listed as one byte)."""
    import re
    import kernel_env
    rd = arm64_env.build_initramfs(kernel_env.init_script(
        "echo BL-START; cat /sys/kernel/debug/kprobes/blacklist; echo BL-END; grep -w _stext /proc/kallsyms"))
    r = arm64_env.boot(arm64_kernel.vmlinuz, rd, log=tmp_path / "console.txt")
    assert r.reached() and r.powered_off, r.explain("no boot")
    c = r.console
    stext = int(re.search(r"([0-9a-f]{16}) T _stext", c).group(1), 16)
    image = arm_image.parse(arm64_kernel.vmlinuz.read_bytes(), str(arm64_kernel.vmlinuz))
    off = stext - image.syms["_stext"]
    kern = {}
    for line in c[c.index("BL-START"):c.index("BL-END")].splitlines()[1:]:
        m = re.match(r"0x([0-9a-f]+)-0x([0-9a-f]+)\s+(\S+)", line.strip())
        if m:
            kern[(int(m.group(1), 16) - off, int(m.group(2), 16) - off)] = m.group(3)
    assert len(kern) > 400
    ours = {}
    for line in kprewrite("blacklist", arm64_kernel.vmlinuz).stdout.splitlines():
        se, sym, reason = line.split("  ", 2)
        if reason.startswith(("NOKPROBE", "in .")) and not reason.startswith("in .head"):
            a, b = (int(x, 16) for x in se.split("-"))
            ours[(a, b)] = sym
    assert {k: v for k, v in kern.items() if k not in ours} == {}
    extra = {k: v for k, v in ours.items() if k not in kern}
    assert all(b - a == 1 and v.startswith("0x") for (a, b), v in extra.items()), extra


def test_system_map(tmp_path, arm64_kernel, image):
    """--system-map: Debian's stub is refused; a System.map in the kernel's format (here made from
    the Image's kallsyms, so without the tables' bounds: those are still found) gives the same plan
    and blacklist as the Image's own kallsyms."""
    spec = tmp_path / "probes.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "__arm64_sys_getppid"\n'
                    '[[kprobe]]\nsymbol_name = "__arm64_sys_getpid"\noffset = 8\n')
    r = kprewrite("check", arm64_kernel.vmlinuz, "--spec", spec, "--system-map", arm64_kernel.system_map, check=False)
    assert r.returncode == 1 and "stub System.map" in r.stderr
    sm = tmp_path / "System.map"
    sm.write_text("".join(f"{s.addr:016x} {s.type} {s.name}\n" for s in image.kallsyms.symbols))
    a = kprewrite("check", arm64_kernel.vmlinuz, "--spec", spec)
    b = kprewrite("check", arm64_kernel.vmlinuz, "--spec", spec, "--system-map", sm)
    assert a.stdout == b.stdout == "__arm64_sys_getppid+0x0  k  ftrace\n__arm64_sys_getpid+0x8  k  optimized\n"
    assert kprewrite("blacklist", arm64_kernel.vmlinuz).stdout == \
        kprewrite("blacklist", arm64_kernel.vmlinuz, "--system-map", sm).stdout


def test_entry_and_past_its_nops_refused_by_check_as_by_instrument(tmp_path, arm64_kernel, image):
    """A probe on a function's entry and one at entry + 8: the entry's jump would go where the
    second probe is, and the entry's NOPs cannot be taken (ftrace_init_nop() rewrites the first at
    boot: Rules.take_ftrace), so the entry is refused, by `check` as by `instrument`, with the same
    line naming probe_in_region and the address; instrument writes nothing."""
    s = image.syms
    spec = tmp_path / "probes.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "__arm64_sys_getppid"\n'
                    '[[kprobe]]\nsymbol_name = "__arm64_sys_getppid"\noffset = 8\n')
    at = s["__arm64_sys_getppid"] + 8
    c = kprewrite("check", arm64_kernel.vmlinuz, "--spec", spec, check=False)
    assert c.returncode == 1, c.stdout + c.stderr
    assert c.stdout.splitlines()[0].startswith(f"__arm64_sys_getppid+0x0  k  refused  probe_in_region at {at:#x}: ")
    assert c.stdout.splitlines()[1] == "__arm64_sys_getppid+0x8  k  optimized", c.stdout
    out = tmp_path / "Image.kp"
    i = kprewrite("instrument", arm64_kernel.vmlinuz, "--spec", spec, "-o", out, check=False)
    assert i.returncode == 1 and not out.exists()
    assert i.stderr == c.stderr and len(c.stderr.splitlines()) == 1, (c.stderr, i.stderr)
    assert f"probe_in_region at {at:#x}: another probe sits in [{at:#x}, " in c.stderr, c.stderr


@pytest.mark.parametrize("spec, line", [
    # a glob's probes go through the ftrace_ops: one struct kprobe, no event per function (one line)
    ('[[kprobe]]\nsymbol_name = "__arm64_sys_getp*"\nfetch = "a=%x0"\n',
     "e.toml: [[kprobe]] #1 (__arm64_sys_getp*): a trace event on a glob's probes (through the ftrace_ops) is "
     "not written on arm64 kernels yet"),
    ('[[kprobe]]\nsymbol_name = "__arm64_sys_getpid"\ndisabled = true\n',
     "e.toml: [[kprobe]] #1 (__arm64_sys_getpid+0x0): a probe compiled in disabled is not written on arm64 "
     "kernels yet (nothing would arm it)"),
    # __arm64_sys_getppid+0x24 is its `bl`: a breakpoint probe (a post_handler after a branch is no jump)
    ('handlers = ["h.c"]\n[[kprobe]]\nsymbol_name = "__arm64_sys_getppid"\noffset = 0x24\npost_handler = "post"\n',
     "e.toml: [[kprobe]] #1 (__arm64_sys_getppid+0x24): a post_handler after a branch is not written on arm64 "
     "kernels yet"),
], ids=["glob-event", "disabled", "post-handler-after-branch"])
def test_what_arm64_does_not_write_is_refused_by_check_as_by_instrument(tmp_path, arm64_kernel, spec, line):
    """What build.py does not write on arm64 yet (an event on a glob, a probe compiled in disabled, a
    post_handler after a branch): check and instrument both refuse it in one line (exit 1, no
    output), rather than check accepting what instrument refuses or an Image written without it."""
    (tmp_path / "e.toml").write_text(spec)
    (tmp_path / "h.c").write_text("#include <linux/kprobes.h>\n"
                                  "void post(struct kprobe *p, struct pt_regs *r, unsigned long f) {}\n")
    out = tmp_path / "Image.kp"
    for cmd in (["check"], ["instrument", "-o", str(out)]):
        r = kprewrite(cmd[0], arm64_kernel.vmlinuz, "--spec", tmp_path / "e.toml", *cmd[1:], check=False)
        assert r.returncode == 1 and r.stderr.strip() == f"kprewrite: {line}", r.stderr
    assert not out.exists()

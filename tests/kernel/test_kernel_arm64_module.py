"""arm64 kernel modules: Debian's arm64 romfs.ko (the cloud kernel builds romfs as a module) rewritten
with jump-optimized kprobes and kretprobes, C handlers (pr_info), then in one boot of the unmodified Debian
arm64 Image under qemu-system-aarch64: loop.ko (unmodified) and the rewritten romfs.ko loaded with
insmod, three mounts that fail (/dev/null is no block device: romfs_get_tree() only) and one of a
romfs image on a loop device, the image's file read, each probe's counters read in debugfs (the
kernel's Module.symvers gives the CRCs of the debugfs functions the module's runtime adds), the
module removed (its exit prints each probe's hits); then romfs.ko rewritten with a counting kprobe on
every instruction `check` takes (956 of 1019), loaded, the image mounted and read through them all.

The probes cover each way a displaced instruction's copy is written in the module's detour
(aarch64/writer.py's copy()): paciasp past a function's ftrace NOPs (an entry probe), a carried
adrp and add (R_AARCH64_ADR_PREL_PG_HI21/ADD_ABS_LO12_NC against .rodata), a carried ldr
(LDST64_ABS_LO12_NC against a kernel symbol), a carried bl of a kernel function and one of the
module's own (CALL26), cbz and tbnz not taken, b.eq and a cbnz back taken (each re-encoded over a `B` back, its
target a JUMP26 against .text), a plain store with a pre_handler and a post_handler, a counting
probe in romfs_dev_read() that a pre_handler's own call of romfs_dev_read() reaches (missed:
nmissed 1); and two kretprobes (one sharing its entry's detour
with a kprobe).  Each handler's line must appear exactly as often as the function runs (a
kretprobe's with the values returned), and the file must read back.  What an arm64 module does not take yet is refused
with one line, by `check` as by `instrument`."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arm64_env  # noqa: E402
import kernel_env  # noqa: E402
from test_kernel_module import ROMFS_FILE, romfs_image  # noqa: E402

pytestmark = pytest.mark.kernel

MODULES = ["kernel/fs/romfs/romfs.ko", "kernel/drivers/block/loop.ko"]

HANDLER = r"""
#include <linux/kprobes.h>
#include <linux/printk.h>

static int on_hit(struct kprobe *p, struct pt_regs *regs)
{
	pr_info("kpmod: hit %s+%#x pc=%lx addr=%lx\n", p->symbol_name, p->offset, regs->pc, (unsigned long)p->addr);
	return 0;
}

/* The module's own (storage.c): the handlers are linked into the module. */
int romfs_dev_read(void *sb, unsigned long pos, void *buf, unsigned long buflen);

void dump_stack(void);

static int on_fill_super(struct kprobe *p, struct pt_regs *regs)
{
	/* romfs_fill_super(struct super_block *sb, ...): the super block in x19 by then */
	pr_info("kpmod: fill_super sb=%lx sp=%lx\n", regs->regs[19], regs->sp);
	dump_stack();		/* the kernel's unwinder, through the detour's frame record */
	return 0;
}

/* After romfs_fill_super()'s first read (x19 the super block, its size known): a handler that reaches a
 * probed function of the module (romfs_dev_read()+0x20), whose hit is missed (nmissed), not run.  A read
 * past the end, which romfs_dev_read() refuses (-EIO) before any block I/O (a handler runs with
 * interrupts masked: __bread() may not). */
static int on_reenter(struct kprobe *p, struct pt_regs *regs)
{
	char buf[8];
	int r = romfs_dev_read((void *)regs->regs[19], ~0UL, buf, sizeof(buf));
	pr_info("kpmod: reenter %s+%#x pc=%lx addr=%lx read %d\n", p->symbol_name, p->offset, regs->pc,
		(unsigned long)p->addr, r);
	return 0;
}

static void on_post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
	pr_info("kpmod: post %s+%#x pc=%lx addr=%lx x2=%lx\n", p->symbol_name, p->offset, regs->pc,
		(unsigned long)p->addr, regs->regs[2]);
}

static int on_return(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("kpmod: ret %s=%d pc=%lx\n", ri->rp->kp.symbol_name, (int)regs_return_value(regs), regs->pc);
	return 0;
}
"""

# kretprobes (name, the values returned in the boot): romfs_get_tree() -ENOTBLK on /dev/null, 0 on the
# loop device; romfs_fill_super() 0.  romfs_get_tree()'s shares its entry's detour with the kprobe there.
KRETPROBES = [("romfs_get_tree", [-15, -15, -15, 0]), ("romfs_fill_super", [0])]

# (function, offset, the instruction there, hits in the boot): romfs_fill_super() runs once (the
# real mount), romfs_get_tree() on each of the 4 mounts.
PROBES = [
    ("romfs_get_tree", 0, "paciasp past the ftrace NOPs", 4),
    ("romfs_fill_super", 0x40, "adrp x22, .rodata", 1),
    ("romfs_fill_super", 0x44, "add x22, x22, :lo12:.rodata", 1),
    ("romfs_fill_super", 0x68, "ldr x0, [x0, :lo12:kmalloc_caches+0x48]", 1),
    ("romfs_fill_super", 0x88, "bl kmalloc_trace", 1),
    ("romfs_fill_super", 0x90, "cbz x0 (not taken)", 1),
    ("romfs_fill_super", 0xa8, "bl romfs_dev_read", 1),
    ("romfs_fill_super", 0xb0, "tbnz w0, #31 (not taken)", 1),
    ("romfs_fill_super", 0xe4, "b.eq (taken: the magic matches)", 1),
    ("romfs_fill_super", 0x20c, "cbnz w0 (taken: back to +0x40, the block device's way)", 1),
    ("romfs_fill_super", 0x54, "str x2, [x19, #32]", 1),
    ("romfs_dev_read", 0x20, "cmp x1, x0: the position against the size (a count of its own)", None),
]

COMMANDS = """
mkdir -p /mnt
insmod /loop.ko; echo loop=$?
insmod /romfs.ko; echo insmod=$?
for i in 1 2 3; do mount -t romfs /dev/null /mnt 2>/dev/null; done
losetup /dev/loop0 /romfs.img; echo losetup=$?
mount -t romfs -o ro /dev/loop0 /mnt; echo mount=$?
cat /mnt/hello | sed 's/^/file: /'
umount /mnt
D=/sys/kernel/debug/kprewrite-romfs
for f in $D/*/*; do echo "counter: ${f#$D/} $(cat $f)"; done
rmmod romfs; echo rmmod=$?
ls $D 2>/dev/null | wc -l | sed 's/^/debugfs-left: /'
grep -c romfs /proc/modules | sed 's/^/loaded: /'
echo EVERY-INSN
insmod /romfs-all.ko; echo insmod-all=$?
mount -t romfs -o ro /dev/loop0 /mnt; echo mount-all=$?
cat /mnt/hello | sed 's/^/file-all: /'
ls /mnt | sed 's/^/ls-all: /'
umount /mnt
rmmod romfs; echo rmmod-all=$?
"""


@pytest.fixture(scope="module")
def modules(arm64_kernel) -> dict[str, Path]:
    romfs, loop = arm64_env.env(arm64_env.obtain_arm64_modules, arm64_kernel, MODULES)
    return {"romfs": romfs, "loop": loop}


def _spec(d: Path) -> Path:
    (d / "h.c").write_text(HANDLER)
    spec = d / "probes.toml"
    lines = ['handlers = ["h.c"]']
    for fn, off, _, _ in PROBES:
        pre = {("romfs_fill_super", 0x54): "on_fill_super", ("romfs_fill_super", 0xb0): "on_reenter",
               ("romfs_dev_read", 0x20): None}.get((fn, off), "on_hit")
        lines.append(f'[[kprobe]]\nsymbol_name = "{fn}"\noffset = {off:#x}'
                     + (f'\npre_handler = "{pre}"' if pre else "")
                     + ('\npost_handler = "on_post"' if pre == "on_fill_super" else ""))
    for fn, _ in KRETPROBES:
        lines.append(f'[[kretprobe]]\nsymbol_name = "{fn}"\nhandler = "on_return"')
    spec.write_text("\n".join(lines) + "\n")
    return spec


@pytest.fixture(scope="module")
def symvers(arm64_kernel) -> Path:
    return arm64_env.env(arm64_env.obtain_arm64_symvers, arm64_kernel)


@pytest.fixture(scope="module")
def rewritten(modules, symvers, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("arm64-module")
    spec = _spec(d)
    r = kprewrite("check", modules["romfs"], "--spec", spec)
    lines = r.stdout.splitlines()
    assert lines[:len(PROBES)] == [f"{fn}+{off:#x}  k  {'ftrace' if off == 0 else 'optimized'}"
                                   for fn, off, _, _ in PROBES], r.stdout
    assert [l.split("  returns:")[0] for l in lines[len(PROBES):]] == [f"{fn}+0x0  r  ftrace" for fn, _ in KRETPROBES]
    out = d / "romfs.ko"
    kprewrite("instrument", modules["romfs"], "--spec", spec, "--system-map", symvers, "-o", out)
    return out


@pytest.fixture(scope="module")
def every_insn(modules, tmp_path_factory) -> tuple[Path, list[tuple[str, int]]]:
    """romfs.ko with a counting kprobe on every instruction of its text that `check` takes (each
    jump-optimized, its copy in a detour), and those probes; what check refuses is left out (the
    ftrace NOPs, the alternatives, can_probe's and a probe in another's region)."""
    d = tmp_path_factory.mktemp("arm64-every-insn")
    nm = subprocess.run(["aarch64-linux-gnu-nm", "-S", str(modules["romfs"])], capture_output=True, text=True,
                        check=True).stdout
    funcs = [(n, int(size, 16)) for _, size, kind, n in (l.split() for l in nm.splitlines() if len(l.split()) == 4)
             if kind in "tT" and n not in ("init_module", "cleanup_module") and not n.startswith("init_")]
    spec = d / "all.toml"
    spec.write_text("".join(f'[[kprobe]]\nsymbol_name = "{n}"\noffset = {off}\n'
                            for n, size in funcs for off in range(0, size, 4)))
    r = kprewrite("check", modules["romfs"], "--spec", spec, check=False)
    taken = [(m.group(1), int(m.group(2), 16)) for m in re.finditer(r"^(\w+)\+0x([0-9a-f]+)  k  (\w+)", r.stdout, re.M)
             if m.group(3) != "refused"]
    assert len(taken) > 900 and r.stdout.count("  k  ") == sum(size // 4 for _, size in funcs), r.stdout[-2000:]
    assert all(m.group(1) == "optimized" for m in re.finditer(r"  k  (\w+)", r.stdout) if m.group(1) != "refused")
    spec.write_text("".join(f'[[kprobe]]\nsymbol_name = "{n}"\noffset = {off}\n' for n, off in taken))
    out = d / "romfs-all.ko"
    kprewrite("instrument", modules["romfs"], "--spec", spec, "-o", out)
    return out, taken


def _words(ko: Path, section: str) -> bytes:
    return subprocess.run(["aarch64-linux-gnu-objcopy", "-O", "binary", "-j", section, str(ko), "/dev/stdout"],
                          capture_output=True, check=True).stdout


def test_rewritten_module_layout(modules, rewritten):
    """Each probed instruction a `B` with a JUMP26 relocation against its detour, in .text.kprewrite;
    no placeholder left; the module's own init and exit redirected to ours."""
    rel = subprocess.run(["aarch64-linux-gnu-readelf", "-rW", str(rewritten)], capture_output=True, text=True).stdout
    jumps = re.findall(r"^([0-9a-f]+) +[0-9a-f]+ R_AARCH64_JUMP26 +[0-9a-f]+ kp_detour_(\d+) \+ 0$", rel, re.M)
    assert len(jumps) == len(PROBES) + 1, rel          # romfs_fill_super()'s entry: the kretprobe's
    assert "kp_module_init + 0" in rel and "kp_module_exit + 0" in rel
    nm = subprocess.run(["aarch64-linux-gnu-nm", str(rewritten)], capture_output=True, text=True).stdout
    assert "kp_ph_" not in nm
    syms = {m.group(2): int(m.group(1), 16) for m in re.finditer(r"^([0-9a-f]+) [tT] (\w+)$", nm, re.M)}
    text = _words(rewritten, ".text")
    for off, _ in jumps:
        assert text[int(off, 16):int(off, 16) + 4] == (0x14000000).to_bytes(4, "little")
    sites = sorted(syms[fn] + (8 if off == 0 else off) for fn, off, _, _ in [*PROBES, ("romfs_fill_super", 0, "", 0)])
    assert sorted(int(o, 16) for o, _ in jumps) == sites


REFUSED = [
    ('events = ["p:kp_x romfs_get_tree"]\n',
     r"kprewrite: p\.toml: event kp_x: trace events are not written for arm64 modules yet"),
    ('[[kprobe]]\nsymbol_name = "romfs_fill_super"\noffset = 0x88\npost_handler = "post"\n',
     r"kprewrite: p\.toml: \[\[kprobe\]\] #1 \(romfs_fill_super\+0x88\): post_handler at 0x[0-9a-f]+: a post_handler "
     r"cannot run after a branch in a detour"),
    ('[[kprobe]]\nsymbol_name = "romfs_get_tree"\noffset = 4\n',
     r"kprewrite: p\.toml: \[\[kprobe\]\] #1 \(romfs_get_tree\+0x4\): blacklist at 0x[0-9a-f]+: .*ftrace site.*"),
]


@pytest.mark.parametrize("text,line", REFUSED, ids=["event", "post_after_bl", "ftrace-nop"])
def test_refusals(modules, tmp_path, text, line):
    """What an arm64 module does not take yet: one line, naming the check and the address, from
    `check` and `instrument` alike, and no output."""
    spec = tmp_path / "p.toml"
    handlers = 'handlers = ["h.c"]\n' if "post_handler" in text else ""
    (tmp_path / "h.c").write_text("#include <linux/kprobes.h>\n"
                                  "void post(struct kprobe *p, struct pt_regs *regs, unsigned long f) { }\n")
    spec.write_text(handlers + text)
    for cmd in (("check",), ("instrument", "-o", tmp_path / "out.ko")):
        r = kprewrite(*cmd[:1], modules["romfs"], "--spec", spec, *cmd[1:], check=False)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert [l for l in r.stderr.splitlines() if re.fullmatch(line, l)], r.stderr
        assert not (tmp_path / "out.ko").exists()


def test_probes_fire_in_a_booted_kernel(arm64_kernel, modules, rewritten, every_insn, tmp_path_factory):
    """One boot of the unmodified Image: the rewritten module loads, each probe's pre_handler line
    appears once per run of its instruction, romfs mounts and reads its file back, and the exit's
    counters agree."""
    initrd = arm64_env.env(arm64_env.build_initramfs, kernel_env.init_script(COMMANDS),
                           {"romfs.ko": rewritten, "loop.ko": modules["loop"],
                            "romfs.img": romfs_image(b"hello", ROMFS_FILE), "romfs-all.ko": every_insn[0]})
    log = tmp_path_factory.mktemp("boots") / "arm64-module.console.txt"
    r = arm64_env.env(lambda: arm64_env.boot(arm64_kernel.vmlinuz, initrd, log=log))
    assert r.reached() and r.powered_off, r.explain("no clean boot to user space and power-off")
    assert not r.problems(), r.explain("kernel problems")
    out, all_out = r.between().split("EVERY-INSN\n")
    console, all_console = r.console.split("EVERY-INSN\n")
    for step in ("loop=0", "insmod=0", "losetup=0", "mount=0", "rmmod=0", "loaded: 0", "debugfs-left: 0"):
        assert re.search(rf"^{step}$", out, re.M), r.explain(f"no {step}")
    assert f"file: {ROMFS_FILE.decode().strip()}" in out, r.explain("the romfs file was not read back")
    hits = re.findall(r"kpmod: (?:hit|reenter) (\w+)\+(0x[0-9a-f]+|0) pc=([0-9a-f]+) addr=([0-9a-f]+)", console)
    for fn, off, _, n in PROBES:
        if (fn, off) in (("romfs_fill_super", 0x54), ("romfs_dev_read", 0x20)):
            continue
        mine = [h for h in hits if h[0] == fn and int(h[1], 16) == off]
        assert len(mine) == n, (fn, hex(off), len(mine), r.explain("hits"))
        # regs->pc and p->addr: the probed address (an entry probe's: the function's entry).
        assert all(pc == addr for _, _, pc, addr in mine), mine
    pcs = {(h[0], int(h[1], 16)): int(h[2], 16) for h in hits}
    assert pcs[("romfs_fill_super", 0x44)] - pcs[("romfs_fill_super", 0x40)] == 4
    assert pcs[("romfs_fill_super", 0xe4)] - pcs[("romfs_fill_super", 0x40)] == 0xa4
    sb = re.findall(r"kpmod: fill_super sb=([0-9a-f]+) sp=([0-9a-f]+)", console)
    assert len(sb) == 1 and int(sb[0][0], 16) >> 48 == 0xFFFF and int(sb[0][1], 16) >> 48 == 0xFFFF, sb
    # dump_stack() from the handler: through the dispatch and the detour's frame record to the probed
    # function, then the mount's path; a kretprobed function's return address is the trampoline by then
    # (romfs_fill_super()'s into get_tree_bdev(), romfs_get_tree()'s into vfs_get_tree(): the kernel's
    # unwinder does not know our trampoline, as it knows its own kretprobes').
    trace = console[console.index("Call trace:"):].splitlines()[1:20]
    frames = [re.sub(r"\+0x[0-9a-f]+/0x[0-9a-f]+", "", l.split("]  ", 1)[1]) for l in trace]
    i = frames.index("dump_stack")
    assert [re.sub(r"_\d+ ", "_N ", f) for f in frames[i + 1:i + 8]] == [
        "on_fill_super [romfs]", "kp_dispatch_N [romfs]", "kp_detour_N [romfs]", "romfs_fill_super [romfs]",
        "kp_kret_trampoline [romfs]", "romfs_get_tree [romfs]", "kp_kret_trampoline [romfs]"], trace
    assert frames[i + 8] == "path_mount" and "el0t_64_sync" in frames, trace
    # The post_handler: after the store (x2 = -1, stored to sb->s_maxbytes), pc the next instruction.
    post = re.findall(r"kpmod: post romfs_fill_super\+0x54 pc=([0-9a-f]+) addr=([0-9a-f]+) x2=([0-9a-f]+)", console)
    assert len(post) == 1 and int(post[0][0], 16) == int(post[0][1], 16) + 4 and post[0][2] == "ffffffff", post
    lines = r.lines()
    assert next(n for n, l in enumerate(lines) if "kpmod: fill_super sb=" in l) < \
        next(n for n, l in enumerate(lines) if "kpmod: post romfs_fill_super+0x54" in l)
    for fn, values in KRETPROBES:
        rets = re.findall(rf"kpmod: ret {fn}=(-?\d+) pc=([0-9a-f]+)", console)
        # regs->pc: the real return address (in the kernel: vfs_get_tree(), get_tree_bdev()), the same each time.
        assert [int(v) for v, _ in rets] == values and len({pc for _, pc in rets}) == 1, (fn, rets)
        assert int(rets[0][1], 16) >> 48 == 0xFFFF
    # The handler's own read: refused past the end (-EIO), its hit at romfs_dev_read+0x20 missed.
    assert re.findall(r"kpmod: reenter romfs_fill_super\+0xb0 pc=[0-9a-f]+ addr=[0-9a-f]+ read (-?\d+)$",
                      console, re.M) == ["-5"], r.explain("the reentering handler")
    exits = re.findall(r"kprewrite: romfs: \S+ (\w+)\+(0x[0-9a-f]+|0) hits (\d+)( returns \d+)? nmissed (\d+)",
                       console)
    reads = next(int(n) for fn, o, n, _, _ in exits if fn == "romfs_dev_read")
    assert reads >= 3, exits            # the superblock, the root's inode, the file's data at least
    assert [(fn, int(o, 16), int(n), ret, int(m)) for fn, o, n, ret, m in exits] == \
        [(fn, off, reads if n is None else n, "", int(fn == "romfs_dev_read")) for fn, off, _, n in PROBES] + \
        [(fn, 0, len(v), f" returns {len(v)}", 0) for fn, v in KRETPROBES], exits
    # The counters in debugfs while loaded: each probe's hits and nmissed, a kretprobe's returns.
    counters = dict(re.findall(r"^counter: (\S+) (\d+)$", out, re.M))
    names = re.findall(r"kprewrite: romfs: (\S+) ", console)
    assert len(counters) == 2 * len(PROBES) + 3 * len(KRETPROBES), counters
    for name, (fn, off, _, n) in zip(names, PROBES):
        missed = int(fn == "romfs_dev_read")
        assert int(counters[f"{name}/hits"]) == (n or reads) and counters[f"{name}/nmissed"] == str(missed), \
            (name, counters)
    for name, (fn, v) in zip(names[len(PROBES):], KRETPROBES):
        assert counters[f"{name}/hits"] == counters[f"{name}/returns"] == str(len(v)), (name, counters)
    # Every instruction's probe, in the module loaded again: the mount and the file work through them
    # all; each probe's exit line, the straight-line code's counts as the function's.
    for step in ("insmod-all=0", "mount-all=0", "rmmod-all=0"):
        assert re.search(rf"^{step}$", all_out, re.M), r.explain(f"no {step}")
    assert f"file-all: {ROMFS_FILE.decode().strip()}" in all_out and "ls-all: hello" in all_out, r.explain("every-insn")
    counts = {(fn, int(o, 16)): int(n) for fn, o, n in
              re.findall(r"kprewrite: romfs: \S+ (\w+)\+(0x[0-9a-f]+|0) hits (\d+) nmissed 0", all_console)}
    path, taken = every_insn
    assert sorted(counts) == sorted(taken), set(taken) ^ set(counts)
    assert counts[("romfs_fill_super", 0x8)] == counts[("romfs_fill_super", 0x40)] == counts[("romfs_fill_super", 0x54)] \
        == counts[("romfs_fill_super", 0xe4)] == 1, counts
    assert counts[("romfs_fill_super", 0x44)] == 1 and counts[("romfs_get_tree", 0x8)] == 1, counts
    assert sum(1 for n in counts.values() if n) > 600, sum(1 for n in counts.values() if n)

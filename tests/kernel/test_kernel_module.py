"""Kernel modules (.ko): Debian's own romfs.ko (the cloud kernel builds romfs as a module and
does not load it at boot) read as the module loader lays it out: the target detected, the
kernel's rules read from the module's own tables, `check` and `blacklist` on it; rewritten with
a C-handler probe with a `fetch`, a counting probe, a kretprobe and two `events` lines (a `p`
and an `r`) at ftrace sites, and optimized probes inside functions (a C handler, an event, counting
probes), with the kernel's Module.symvers for the CRCs of what the module's runtime calls, `list`
and readelf's relocations on it, and in one boot of the unmodified Debian kernel: insmod, mount(2)
exercising the probes, the events' lines in the ftrace ring buffer and each probe's counters in
debugfs while loaded, rmmod printing the hits, loaded, traced and counted again, loaded a third
time to mount a romfs image on a loop device (handlers' dump_stack() through the probes: the
module's ORC entries); then the same in a rewritten kernel image (each counts its own).  What a module does not take yet is refused with one line.

What the rules must find is counted independently, from the .ko's relocation sections (each
entry of __mcount_loc, .return_sites, .retpoline_sites is one relocation against the text):
binutils' readelf, not our reader."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rewriter import targets  # noqa: E402
from rewriter.targets import linux_module  # noqa: E402
from rewriter.targets.linux_module.x86_64.relocatable import KERNEL_STAND_IN, MODULE_BASE  # noqa: E402

pytestmark = pytest.mark.kernel

# romfs: small, not loaded at boot, exercised by mount(2); kvm-amd: .noinstr.text,
# .altinstructions and __ex_table, which romfs lacks (read only, never loaded).
MODULES = {"romfs": "kernel/fs/romfs/romfs.ko", "kvm-amd": "kernel/arch/x86/kvm/kvm-amd.ko",
           "loop": "kernel/drivers/block/loop.ko"}
# loop.ko (unmodified, no dependencies) gives a block device for a real romfs mount.


def obtain_modules(k: kernel_env.DebianKernel, rels: list[str]) -> list[Path]:
    """lib/modules/<release>/<rel> of the kernel's package for each rel, extracted once into its
    cache folder (the package fetched again with apt-get download: the kernel cache keeps only boot/)."""
    dests = [k.dir / "modules" / rel for rel in rels]
    if all(d.exists() for d in dests):
        return dests
    with kernel_env._locked(k.dir / ".modules.lock"):
        missing = [(rel, d) for rel, d in zip(rels, dests) if not d.exists()]
        if not missing:
            return dests
        work = k.dir / ".modules-dl"
        work.mkdir(exist_ok=True)
        r = subprocess.run(["apt-get", "download", "-q", f"{k.package}={k.version}"], cwd=work,
                           capture_output=True, text=True)
        debs = list(work.glob("*.deb"))
        if r.returncode != 0 or len(debs) != 1:
            pytest.fail(f"kernel test environment: apt-get download {k.package}={k.version} failed: "
                        f"{r.stderr.strip()[-300:]}", pytrace=False)
        for rel, dest in missing:
            member = f"./lib/modules/{k.release}/{rel}"
            tar = subprocess.run(f"dpkg-deb --fsys-tarfile {debs[0]} | tar -xO {member}", shell=True,
                                 capture_output=True)
            if tar.returncode != 0 or not tar.stdout.startswith(b"\x7fELF"):
                pytest.fail(f"kernel test environment: {debs[0].name} has no {member}", pytrace=False)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_suffix(".tmp")
            tmp.write_bytes(tar.stdout)
            tmp.rename(dest)
        for d in debs:
            d.unlink()
    return dests


def obtain_symvers(k: kernel_env.DebianKernel) -> Path:
    """The kernel's Module.symvers (the CRCs of its exported symbols), from Debian's linux-headers
    package of the same kernel (apt-get download once; the benchmark's extraction reused)."""
    dest = k.dir / "Module.symvers"
    if dest.exists():
        return dest
    with kernel_env._locked(k.dir / ".modules.lock"):
        if dest.exists():
            return dest
        member = f"./usr/src/linux-headers-{k.release}/Module.symvers"
        bench = kernel_env.cache_dir() / f"headers-{k.release}_{k.version}" / member
        if bench.is_file():
            data = bench.read_bytes()
        else:
            work = k.dir / ".modules-dl"
            work.mkdir(exist_ok=True)
            r = subprocess.run(["apt-get", "download", "-q", f"linux-headers-{k.release}={k.version}"], cwd=work,
                               capture_output=True, text=True)
            debs = list(work.glob("linux-headers-*.deb"))
            if r.returncode != 0 or len(debs) != 1:
                pytest.fail(f"kernel test environment: apt-get download linux-headers-{k.release}={k.version} "
                            f"failed: {r.stderr.strip()[-300:]}", pytrace=False)
            tar = subprocess.run(f"dpkg-deb --fsys-tarfile {debs[0]} | tar -xO {member}", shell=True,
                                 capture_output=True)
            debs[0].unlink()
            if tar.returncode != 0 or not tar.stdout.startswith(b"0x"):
                pytest.fail(f"kernel test environment: no {member} in linux-headers-{k.release}", pytrace=False)
            data = tar.stdout
        tmp = dest.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.rename(dest)
    return dest


@pytest.fixture(scope="module")
def symvers(debian_kernel) -> Path:
    return obtain_symvers(debian_kernel)


@pytest.fixture(scope="module")
def fs_context(debian_kernel) -> dict[str, int]:
    """Offsets of struct fs_context's fs_type and source, from the kernel's BTF (for the events'
    fetch args: the file system's name and the mount's source string)."""
    from elftools.elf.elffile import ELFFile
    from rewriter.targets.linux_kernel import btf
    with open(debian_kernel.vmlinux, "rb") as f:
        types = btf.parse(ELFFile(f).get_section_by_name(".BTF").data(), str(debian_kernel.vmlinux))
    return {m: btf.member_offset(types, "fs_context", m) for m in ("fs_type", "source")}


@pytest.fixture(scope="module")
def modules(debian_kernel) -> dict[str, Path]:
    return dict(zip(MODULES, obtain_modules(debian_kernel, list(MODULES.values()))))


@pytest.fixture(scope="module")
def romfs(modules) -> Path:
    return modules["romfs"]


def _relocations(ko: Path, section: str) -> int:
    out = subprocess.run(["readelf", "-W", "-r", str(ko)], capture_output=True, text=True, check=True).stdout
    m = re.search(rf"Relocation section '\.rela{re.escape(section)}' at offset \S+ contains (\d+) entr", out)
    return int(m.group(1)) if m else 0


def _func_syms(ko: Path) -> dict[str, tuple[str, int, int]]:
    """name -> (section name, value, size) of the .ko's FUNC symbols (readelf)."""
    out = subprocess.run(["readelf", "-W", "-s", "-S", str(ko)], capture_output=True, text=True, check=True).stdout
    secs = {int(i): n for i, n in re.findall(r"^\s*\[\s*(\d+)\]\s+(\S+)", out, re.M)}
    syms = {}
    for v, size, ndx, name in re.findall(r"^\s*\d+:\s+([0-9a-f]+)\s+(\d+)\s+FUNC\s+\w+\s+\w+\s+(\d+)\s+(\S+)$",
                                         out, re.M):
        syms[name] = (secs[int(ndx)], int(v, 16), int(size))
    return syms


def test_module_detected_and_laid_out(romfs):
    image = targets.load(str(romfs))
    assert image.target is linux_module
    f = image.function_named("romfs_get_tree")
    sec, value, size = _func_syms(romfs)["romfs_get_tree"]
    assert sec == ".text" and f is not None and f.end - f.start == size
    text = next(s for s in image.sections if s.name == ".text")
    assert text.addr >= MODULE_BASE and f.start == text.addr + value
    # The entry is an ftrace site: `call __fentry__` (relocated at insmod) or its nop.
    code = image.read(f.start, 5)
    assert code[:1] == b"\xe8" or code == bytes.fromhex("0f1f440000")


def test_blacklist_reads_the_module_tables(romfs):
    lines = kprewrite("blacklist", romfs).stdout.splitlines()

    def count(what):
        return sum(1 for line in lines if line.endswith(what))
    assert count("boot-patched site (__mcount_loc)") == _relocations(romfs, "__mcount_loc") > 0
    assert count("boot-patched site (.return_sites)") == _relocations(romfs, ".return_sites") > 0
    assert count("boot-patched site (.retpoline_sites)") == _relocations(romfs, ".retpoline_sites") > 0
    assert count("static call site (static_call_text_reserved)") == _relocations(romfs, ".static_call_sites") // 2
    assert count("jump label site (jump_label_text_reserved)") == _relocations(romfs, "__jump_table") // 3
    # Each function of .init.text (by address: init_module is an alias of init_romfs_fs).
    init = {}
    for n, (s, v, _) in _func_syms(romfs).items():
        if s == ".init.text":
            init.setdefault(v, set()).add(n)
    assert init and all(any(re.search(rf"  ({'|'.join(names)})  in \.init\.text", line) for line in lines)
                        for names in init.values())
    assert any("  _printk  a kernel symbol the module refers to" in line for line in lines)


def test_check_on_module(romfs, tmp_path):
    syms = _func_syms(romfs)
    spec = tmp_path / "probes.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "romfs_get_tree"\n'
                    '[[kprobe]]\nsymbol_name = "init_romfs_fs"\n'
                    '[[kprobe]]\nsymbol_name = "_printk"\n'
                    '[[kretprobe]]\nsymbol_name = "romfs_fill_super"\n')
    r = kprewrite("check", romfs, "--spec", spec, check=False)
    out = r.stdout
    assert re.search(r"^romfs_get_tree\+0x0  k  ftrace$", out, re.M), out
    assert re.search(r"^init_romfs_fs\+0x0  k  refused  blacklist at 0x\S+: .* in \.init\.text", out, re.M), out
    assert re.search(rf"^_printk\+0x0  k  refused  blacklist at {KERNEL_STAND_IN >> 32:#x}", out, re.M), out
    # A module's kretprobes are the kernel's: the return address swapped at entry.
    assert re.search(r"^romfs_fill_super\+0x0  r  ftrace  returns: trampoline  kretprobe_trampoline at ", out, re.M), out
    assert syms["romfs_fill_super"][0] == ".text"


def test_check_breakpoints_and_kretprobes_in_a_module(romfs, tmp_path):
    """A post_handler on a probe inside a function makes a breakpoint probe (the kernel optimizes
    no kprobe with one), single-stepped (an int3 after the copy), or on a branch (the tail call of
    romfs_get_tree+0xc) emulated in the trap; a kretprobe on a function with no ftrace site
    (exit_romfs_fs, in .exit.text) takes its entry as a kprobe would (here a jump).  A region over
    a return thunk's jump makes a breakpoint probe (.return_sites), the jump itself is refused."""
    (tmp_path / "h.c").write_text("#include <linux/kprobes.h>\n"
                                  "static void post(struct kprobe *p, struct pt_regs *regs, unsigned long f) { }\n")
    spec = tmp_path / "probes.toml"
    spec.write_text('handlers = ["h.c"]\n[[kprobe]]\nsymbol_name = "romfs_get_tree"\n'
                    '[[kprobe]]\nsymbol_name = "romfs_get_tree"\noffset = 5\npost_handler = "post"\n'
                    '[[kprobe]]\nsymbol_name = "romfs_get_tree"\noffset = 0xc\npost_handler = "post"\n'
                    '[[kretprobe]]\nsymbol_name = "exit_romfs_fs"\n')
    post = (r"post_handler at 0x[0-9a-f]+: the kernel optimizes no kprobe with a post_handler "
            r"\(optimize_kprobe\(\)\)")
    r = kprewrite("check", romfs, "--spec", spec, check=False)
    assert re.search(r"^romfs_get_tree\+0x0  k  ftrace$", r.stdout, re.M), r.stdout
    assert re.search(rf"^romfs_get_tree\+0x5  k  int3  {post}  \[single-step\]$", r.stdout, re.M), r.stdout
    assert re.search(r"^romfs_get_tree\+0xc  k  int3  post_handler at 0x[0-9a-f]+: a post_handler cannot run after a "
                     r"branch in a detour  \[emulate\]$", r.stdout, re.M), r.stdout
    assert re.search(r"^exit_romfs_fs\+0x0  r  optimized  returns: trampoline  kretprobe_trampoline at 0x[0-9a-f]+: ",
                     r.stdout, re.M), r.stdout
    spec.write_text('[[kprobe]]\nsymbol_name = "romfs_init_fs_context"\noffset = 0xc\n')
    r = kprewrite("check", romfs, "--spec", spec, check=False)
    assert re.search(r"^romfs_init_fs_context\+0xc  k  int3  \.return_sites at 0x\S+: the region .* overlaps a "
                     r"site patched at boot \(\.return_sites\)  \[boost\]$", r.stdout, re.M), r.stdout
    # The return thunk's jump itself takes no breakpoint either (the loader patches it).
    spec.write_text('[[kprobe]]\nsymbol_name = "romfs_init_fs_context"\noffset = 0xe\n')
    r = kprewrite("check", romfs, "--spec", spec, check=False)
    assert re.search(r"^romfs_init_fs_context\+0xe  k  refused  \.return_sites at 0x\S+: the int3 at 0x\S+ would sit "
                     r"on a site patched at boot \(\.return_sites\)$", r.stdout, re.M), r.stdout


def test_int3_refused_where_the_kernel_calls_before_init(modules, tmp_path):
    """loop.ko's max_loop parameter has its own kernel_param_ops (max_loop_param_set_int), which the
    kernel calls at insmod (parse_args()) before the module's init registers our die notifier: no
    breakpoint there, `check` and `instrument` alike (one line, no output).  The probe is on
    `xor %eax,%eax` before the return thunk's jump, which a jump cannot take: elsewhere a
    breakpoint probe (romfs_init_fs_context+0xc)."""
    spec = tmp_path / "probes.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "max_loop_param_set_int"\noffset = 0x15\n')
    r = kprewrite("check", modules["loop"], "--spec", spec, check=False)
    assert re.search(r"^max_loop_param_set_int\+0x15  k  refused  module_int3 at 0x[0-9a-f]+: max_loop_param_set_int "
                     r"is a module parameter's set \(kernel_param_ops\), which the kernel may call at insmod "
                     r"\(parse_args\(\), the parameter's sysfs file\), before the module's init registers the die "
                     r"notifier that takes its breakpoints$", r.stdout, re.M), r.stdout
    out = tmp_path / "loop.ko"
    before = modules["loop"].read_bytes()
    r = kprewrite("instrument", modules["loop"], "--spec", spec, "-o", out, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and not out.exists() and modules["loop"].read_bytes() == before and len(lines) == 1, lines
    assert re.fullmatch(r"kprewrite: probes\.toml: \[\[kprobe\]\] #1 \(max_loop_param_set_int\+0x15\): module_int3 at "
                        r"0x[0-9a-f]+: max_loop_param_set_int is a module parameter's set .*", lines[0]), lines


def _nokprobe(ko: Path) -> list[str]:
    """The functions a module's _kprobe_blacklist names (NOKPROBE_SYMBOL()), sorted: each entry's
    symbol, or the function at its section + addend."""
    syms = subprocess.run(["readelf", "-W", "-s", str(ko)], capture_output=True, text=True, check=True).stdout
    secs = subprocess.run(["readelf", "-W", "-S", str(ko)], capture_output=True, text=True, check=True).stdout
    index = {m.group(2): m.group(1) for m in re.finditer(r"^\s*\[\s*(\d+)\] (\S+)", secs, re.M)}
    funcs = {(m.group(3), int(m.group(1), 16)): m.group(4)
             for m in re.finditer(r"^\s*\d+: ([0-9a-f]+)\s+(\d+) FUNC\s+\w+\s+\w+\s+(\d+) (\S+)$", syms, re.M)}
    names = []
    for _, _, target in _relas(ko)["_kprobe_blacklist"]:
        sym, _, add = target.partition("+")
        names.append(funcs[(index[sym], int(add, 16))] if sym in index else sym)
    return sorted(names)


def _relas(ko: Path) -> dict[str, list[tuple[int, str, str]]]:
    """section -> [(offset, type, symbol + addend as readelf prints them)] of a module's relocations."""
    out = subprocess.run(["readelf", "-W", "-r", str(ko)], capture_output=True, text=True, check=True).stdout
    secs = {}
    for part in re.split(r"^Relocation section '\.rela", out, flags=re.M)[1:]:
        name = part.split("'", 1)[0]
        secs[name] = [(int(m.group(1), 16), m.group(2), m.group(3).replace(" ", ""))
                      for m in re.finditer(r"^([0-9a-f]+)\s+[0-9a-f]+\s+(R_X86_64_\w+)\s+[0-9a-f]*\s*(.*)$", part, re.M)]
    return secs


HANDLER_C = r"""
#include <linux/kprobes.h>
void dump_stack(void);
/* The stacks through the probes (docs/kernel.md): each dumped once a boot, on the real mount
 * (the loop device's, the only one to reach romfs_fill_super()), between two marker lines. */
static void stack(const char *kind)
{
	printk(KERN_INFO "kp-stack-begin %s\n", kind);
	dump_stack();
	printk(KERN_INFO "kp-stack-end %s\n", kind);
}
static int handler_pre(struct kprobe *p, struct pt_regs *regs)
{
	const char *source = *(const char **)(regs->di + FC_SOURCE);	/* fc->source */
	printk(KERN_INFO "kp-module: %s pre ip=%lx di=%lx\n", p->symbol_name, regs->ip, regs->di);
	if (source && source[0] == '/' && source[5] == 'l')		/* "/dev/loop0" */
		stack("ftrace");
	return 0;
}
static int stack_opt(struct kprobe *p, struct pt_regs *regs)
{
	static int done;
	if (!done++)
		stack("optimized");
	return 0;
}
static int stack_int3(struct kprobe *p, struct pt_regs *regs)
{
	static int done;
	if (!done++)
		stack("int3");
	return 0;
}
static void post_quiet(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
}
static int handler_mid(struct kprobe *p, struct pt_regs *regs)
{
	printk(KERN_INFO "kp-module: %s+%#x mid ip=%lx\n", p->symbol_name, p->offset, regs->ip);
	return 0;
}
static int handler_int3(struct kprobe *p, struct pt_regs *regs)
{
	unsigned long flags;
	__asm__ volatile("pushf; pop %0" : "=r"(flags));
	printk(KERN_INFO "kp-module: %s+%#x int3 ip=%lx flags=%lx now=%lx\n", p->symbol_name, p->offset, regs->ip,
	       regs->flags, flags);
	return 0;
}
static void handler_post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
	unsigned long now;
	__asm__ volatile("pushf; pop %0" : "=r"(now));
	printk(KERN_INFO "kp-module: %s+%#x post ip=%lx ax=%lx flags=%lx now=%lx\n", p->symbol_name, p->offset,
	       regs->ip, regs->ax, regs->flags, now);
}
static void handler_call(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
	printk(KERN_INFO "kp-module: %s+%#x called ip=%lx ret=%lx\n", p->symbol_name, p->offset, regs->ip,
	       *(unsigned long *)regs->sp);
}
static void handler_branch(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
	printk(KERN_INFO "kp-module: %s+%#x went ip=%lx\n", p->symbol_name, p->offset, regs->ip);
}
static int ret_handler(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	printk(KERN_INFO "kp-module: %s returned %d\n", ri->rp->kp.symbol_name, (int)regs_return_value(regs));
	if (regs_return_value(regs) == 0)		/* the real mount */
		stack("kretprobe");
	return 0;
}
"""

COMMANDS = """
mkdir -p /mnt
T=/sys/kernel/tracing
D=/sys/kernel/debug/kprewrite-romfs
insmod /romfs.ko; echo insmod1=$?
grep -E ' (romfs_get_tree|romfs_init_fs_context|romfs_fill_super)([[:space:]]|$)' /proc/kallsyms | sed 's/^/ksym: /'
grep -c '^romfs_' $T/available_filter_functions | sed 's/^/ftrace-romfs: /'
grep -E '[[:space:]]kp_[^[:space:]]+ [[]romfs[]]$' /sys/kernel/debug/kprobes/blacklist | sed 's/^/kbl: /'
grep -E '^romfs_(get_tree|init_fs_context)[[:space:]]' $T/available_filter_functions | sed 's/^/ftrace-probed: /'
E=$T/events/kprobes
ls $E | sed 's/^/event: /'
grep -E '^[[:space:]]+field:' $E/kp_mid/format | sed 's/^/format: /'
A=$(grep -E ' romfs_fill_super([[:space:]]|$)' /proc/kallsyms | cut -d' ' -f1)
echo "fill == 0x$A" > $E/kp_mid/filter; echo filter-mid=$?
echo 'fstype == "ext4"' > $E/kp_ctx/filter; echo filter-ctx=$?
echo 0 > $E/kp_get_tree_ret/enable; echo disable-ret=$?
echo 'hist:keys=common_pid' > $E/p_romfs_get_tree_0/trigger; echo hist=$?
for i in 1 2 3; do mount -t romfs /dev/null /mnt 2>/dev/null; done
grep -E '^Totals:|Hits:' $E/p_romfs_get_tree_0/hist | sed 's/^/hist: /'
grep -v '^#' $T/trace | sed 's/^/trace1: /'
for f in $D/*/*; do echo "counter1: ${f#$D/} $(cat $f)"; done
rmmod romfs; echo rmmod1=$?
grep -c romfs /proc/modules | sed 's/^/loaded: /'
ls $E 2>/dev/null | grep -c -E '^(kp_|p_|r_)' | sed 's/^/events-left: /'
ls $D 2>/dev/null | wc -l | sed 's/^/debugfs-left: /'
echo > $T/trace
insmod /romfs.ko; echo insmod2=$?
grep -E ' (romfs_get_tree|romfs_init_fs_context|romfs_fill_super)([[:space:]]|$)' /proc/kallsyms | sed 's/^/ksym2: /'
/perfcount $(cat $E/kp_ctx/id) 'fstype == "romfs"' /bin/mount -t romfs /dev/null /mnt 2>/dev/null
grep -v '^#' $T/trace | sed 's/^/trace2: /'
for f in $D/*/*; do echo "counter2: ${f#$D/} $(cat $f)"; done
rmmod romfs; echo rmmod2=$?
insmod /loop.ko; echo loop=$?
insmod /romfs.ko; echo insmod3=$?
grep -E ' (romfs_get_tree|romfs_init_fs_context|romfs_fill_super|romfs_iget|d_make_root)([[:space:]]|$)' /proc/kallsyms | sed 's/^/ksym3: /'
losetup /dev/loop0 /romfs.img; echo losetup=$?
for o in 0x199 0x1e; do (echo "p:kk_no romfs:romfs_fill_super+$o" >> $T/kprobe_events) 2>&1 | sed "s/^/kk-$o: /"; done
echo 'p:kk_jmp romfs:romfs_fill_super+0x1d' >> $T/kprobe_events; echo kk-jmp=$?
mkdir $T/instances/kk; echo 1 > $T/instances/kk/events/kprobes/kk_jmp/enable; echo kk-enable=$?
mount -t romfs -o ro /dev/loop0 /mnt; echo mount3=$?
grep -E '^ *kk_jmp ' $T/kprobe_profile | sed 's/^ */kk-profile: /'
echo 0 > $T/instances/kk/events/kprobes/kk_jmp/enable; rmdir $T/instances/kk; echo '-:kk_jmp' >> $T/kprobe_events; echo kk-removed=$?
cat /mnt/hello | sed 's/^/file: /'
umount /mnt
rmmod romfs; echo rmmod3=$?
insmod /romfs-all.ko; echo insmod4=$?
mount -t romfs -o ro /dev/loop0 /mnt; echo mount4=$?
cat /mnt/hello | sed 's/^/file4: /'
umount /mnt
rmmod romfs; echo rmmod4=$?
"""

# Each probe's name, in the exit lines' order (kprobes, then kretprobes, in spec order: the
# tables', then the events').
PROBES = ["p_romfs_get_tree_0", "p_romfs_init_fs_context_0", "p_romfs_get_tree_5", "p_romfs_init_fs_context_5",
          "p_romfs_fill_super_29", "p_romfs_fill_super_82", "p_romfs_fill_super_119", "p_romfs_fill_super_168",
          "p_romfs_fill_super_186", "p_romfs_init_fs_context_12", "p_exit_romfs_fs_0",
          "p_romfs_fill_super_409", "p_romfs_fill_super_432", "p_romfs_fill_super_316", "p_romfs_fill_super_449",
          "p_romfs_iget_5", "p_romfs_iget_21",
          "kp_ctx", "kp_mid", "kp_int3", "r_romfs_get_tree_0", "r_exit_romfs_fs_0", "kp_get_tree_ret"]
SITES = ["romfs_get_tree+0x0", "romfs_init_fs_context+0x0", "romfs_get_tree+0x5", "romfs_init_fs_context+0x5",
         "romfs_fill_super+0x1d", "romfs_fill_super+0x52", "romfs_fill_super+0x77", "romfs_fill_super+0xa8",
         "romfs_fill_super+0xba", "romfs_init_fs_context+0xc", "exit_romfs_fs+0x0",
         "romfs_fill_super+0x199", "romfs_fill_super+0x1b0", "romfs_fill_super+0x13c", "romfs_fill_super+0x1c1",
         "romfs_iget+0x5", "romfs_iget+0x15",
         "romfs_init_fs_context+0x0", "romfs_get_tree+0xc", "romfs_init_fs_context+0xc", "romfs_get_tree+0x0",
         "exit_romfs_fs+0x0",
         "romfs_get_tree+0x0"]
# Each load's mounts: 3 that fail (/dev/null), 1 that fails, 1 of a romfs image on a loop device,
# the only one that reaches romfs_fill_super().
MOUNTS = (3, 1, 1)


def hits(probe: str, load: int, exited: bool = True) -> int:
    """A probe's hits in a load: per mount, romfs_fill_super()'s on the real one only, the module
    exit's once, at rmmod (exited: counted by then)."""
    if "exit_romfs_fs" in probe:
        return int(exited)
    if "romfs_iget" in probe:           # the root's inode, and the file's (cat's lookup)
        return 2 * int(load == 2)
    return int(load == 2) if "fill_super" in probe else MOUNTS[load]


def romfs_image(name: bytes, data: bytes) -> bytes:
    """A romfs image (the kernel's Documentation/filesystems/romfs.rst) whose root directory
    holds "." and one file: the superblock ("-rom1fs-", the size, a checksum making the first
    512 bytes' big-endian words sum to 0, the volume name), then each file header (next with
    the type in its low bits, spec.info, size, checksum, name), each 16-byte aligned."""
    import struct

    def pad(b: bytes) -> bytes:
        return b + bytes(-len(b) % 16)

    def header(nxt: int, typ: int, spec: int, size: int, fname: bytes) -> bytes:
        h = bytearray(struct.pack(">IIII", nxt | typ, spec, size, 0) + pad(fname + b"\0"))
        struct.pack_into(">I", h, 12, -sum(struct.unpack(f">{len(h) // 4}I", h)) & 0xFFFFFFFF)
        return bytes(h)
    vol = pad(b"kprewrite\0")
    root = 16 + len(vol)
    file_at = root + 32                 # "." takes a 16-byte header and a 16-byte name
    img = bytearray(b"-rom1fs-" + bytes(8) + vol + header(file_at, 1, root, 0, b".")
                    + header(0, 2, 0, len(data), name) + pad(data))
    img += bytes(-len(img) % 4096)
    struct.pack_into(">I", img, 8, len(img))
    struct.pack_into(">I", img, 12, -sum(struct.unpack(">128I", img[:512])) & 0xFFFFFFFF)
    return bytes(img)


ROMFS_FILE = b"hello from a romfs image\n"


@pytest.fixture(scope="module")
def rewritten_romfs(romfs, symvers, fs_context, tmp_path_factory):
    d = tmp_path_factory.mktemp("module")
    fs_type, source = fs_context["fs_type"], fs_context["source"]
    (d / "h.c").write_text(f"#define FC_SOURCE {source}\n" + HANDLER_C)
    (d / "probes.toml").write_text(
        'handlers = ["h.c"]\n'
        f'events = ["p:kp_ctx romfs_init_fs_context fstype=+0(+0(+{fs_type}(%di))):string comm=$comm",\n'
        '          "p:kp_mid romfs_get_tree+0xc fill=%si:x64",\n'
        '          "p:kp_int3 romfs_init_fs_context+0xc fc=%di:x64",\n'
        '          "r:kp_get_tree_ret romfs_get_tree ret=$retval:s32"]\n'
        '[[kprobe]]\nsymbol_name = "romfs_get_tree"\npre_handler = "handler_pre"\n'
        f'fetch = "fc=$arg1:x64 source=+0(+{source}(%di)):string"\n'
        '[[kprobe]]\nsymbol_name = "romfs_init_fs_context"\n'
        # Inside the functions: optimized (jump) probes whose regions' copies carry the module's
        # relocations (R_X86_64_32S to .text and to .rodata, R_X86_64_PLT32 to a kernel function).
        '[[kprobe]]\nsymbol_name = "romfs_get_tree"\noffset = 5\npre_handler = "handler_mid"\n'
        '[[kprobe]]\nsymbol_name = "romfs_init_fs_context"\noffset = 5\n'
        # Run by the real mount only: a `je` re-encoded (R_X86_64_PC32 to .text made for it), a
        # load of kmalloc_caches (its R_X86_64_PC32 to the kernel carried), a call to the
        # kernel's kmalloc_trace() emulated in the copy (its R_X86_64_PLT32 carried).
        '[[kprobe]]\nsymbol_name = "romfs_fill_super"\noffset = 0x1d\n'
        '[[kprobe]]\nsymbol_name = "romfs_fill_super"\noffset = 0x52\n'
        '[[kprobe]]\nsymbol_name = "romfs_fill_super"\noffset = 0x77\n'
        # `test %eax,%eax; js` and `test %rcx,%rcx; je` (taken: no MTD): rel8 jumps re-encoded
        # with rel32 in the copy (R_X86_64_PC32 to .text made for them).
        '[[kprobe]]\nsymbol_name = "romfs_fill_super"\noffset = 0xa8\n'
        '[[kprobe]]\nsymbol_name = "romfs_fill_super"\noffset = 0xba\n'
        # A breakpoint probe: `xor %eax,%eax`, whose region would cover the return thunk's jump
        # (.return_sites); its pre_handler and post_handler (the copy single-stepped: an int3 after it).
        '[[kprobe]]\nsymbol_name = "romfs_init_fs_context"\noffset = 0xc\npre_handler = "handler_int3"\n'
        'post_handler = "handler_post"\n'
        # The module's exit (exit_romfs_fs, no ftrace site: .exit.text), run by rmmod: a breakpoint
        # (single-stepped: a post_handler) taking a kretprobe's entry too.
        '[[kprobe]]\nsymbol_name = "exit_romfs_fs"\npost_handler = "handler_post"\n'
        # Calls at breakpoints with a post_handler, emulated in the trap (the return address pushed,
        # regs->ip the callee): to romfs_iget() in the module, to the kernel's d_make_root().
        '[[kprobe]]\nsymbol_name = "romfs_fill_super"\noffset = 0x199\npost_handler = "handler_call"\n'
        '[[kprobe]]\nsymbol_name = "romfs_fill_super"\noffset = 0x1b0\npost_handler = "handler_call"\n'
        # A `jne` (not taken: the superblock's checksum is 0) and a `jmp` back into the function.
        '[[kprobe]]\nsymbol_name = "romfs_fill_super"\noffset = 0x13c\npost_handler = "handler_branch"\n'
        '[[kprobe]]\nsymbol_name = "romfs_fill_super"\noffset = 0x1c1\npost_handler = "handler_branch"\n'
        # The stacks (STACKS): in romfs_iget(), which romfs_fill_super() calls, not under the
        # kretprobe's swapped return address (romfs_get_tree() tail-calls get_tree_bdev()): an
        # optimized probe (`push %r15`...) and a breakpoint (`sub $0x18,%rsp`, single-stepped).
        '[[kprobe]]\nsymbol_name = "romfs_iget"\noffset = 5\npre_handler = "stack_opt"\n'
        '[[kprobe]]\nsymbol_name = "romfs_iget"\noffset = 0x15\npre_handler = "stack_int3"\n'
        'post_handler = "post_quiet"\n'
        '[[kretprobe]]\nsymbol_name = "romfs_get_tree"\nhandler = "ret_handler"\n'
        '[[kretprobe]]\nsymbol_name = "exit_romfs_fs"\n')
    out = d / "romfs.ko"
    kprewrite("instrument", romfs, "--spec", d / "probes.toml", "--system-map", symvers, "-o", out)
    again = d / "again.ko"
    kprewrite("instrument", romfs, "--spec", d / "probes.toml", "--system-map", symvers, "-o", again)
    assert out.read_bytes() == again.read_bytes()            # deterministic
    return out


@pytest.fixture(scope="module")
def romfs_every_insn(romfs, symvers, tmp_path_factory) -> tuple[Path, dict[int, str]]:
    """romfs.ko with a counting probe at every instruction of romfs_fill_super() (objdump's) that
    `check` places: jump-optimized ones and breakpoint ones (a region over a jump target, over a
    return thunk's jump, over the next probe: boosted copies, branches and calls run from their
    slots), and a kretprobe on its exit.  (the module, {offset: `check`'s decision and int3 mode})."""
    d = tmp_path_factory.mktemp("module-all")
    _, start, size = _func_syms(romfs)["romfs_fill_super"]
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-j", ".text", f"--start-address={start}",
                          f"--stop-address={start + size}", str(romfs)], capture_output=True, text=True,
                         check=True).stdout
    offsets = [int(a, 16) - start for a in re.findall(r"^\s+([0-9a-f]+):", dis, re.M)]
    spec = d / "all.toml"
    spec.write_text("".join(f'[[kprobe]]\nsymbol_name = "romfs_fill_super"\noffset = {o}\n' for o in offsets if o))
    out = kprewrite("check", romfs, "--spec", spec, check=False).stdout
    placed = {int(m.group(1), 16): m.group(2) + (m.group(3) or "")
              for m in re.finditer(r"^romfs_fill_super\+(0x[0-9a-f]+)  k  (optimized|int3)(?:  .*(  \[\S+\]))?$",
                                   out, re.M)}
    # and a kretprobe on the module's exit (no ftrace site: its entry a jump here).
    spec.write_text("".join(f'[[kprobe]]\nsymbol_name = "romfs_fill_super"\noffset = {o}\n' for o in sorted(placed))
                    + '[[kretprobe]]\nsymbol_name = "exit_romfs_fs"\n')
    assert re.search(r"^exit_romfs_fs\+0x0  r  optimized  returns: trampoline",
                     kprewrite("check", romfs, "--spec", spec).stdout, re.M)
    ko = d / "romfs.ko"
    kprewrite("instrument", romfs, "--spec", spec, "--system-map", symvers, "-o", ko)
    return ko, placed


def _versions(ko: Path) -> dict[str, int]:
    """name -> CRC of a module's __versions (struct modversion_info: 8 bytes of CRC, 56 of name),
    read with readelf's section dump."""
    out = subprocess.run(["readelf", "-W", "-x", "__versions", str(ko)], capture_output=True, text=True,
                         check=True).stdout
    raw = b"".join(bytes.fromhex("".join(m.group(1).split()))
                   for m in re.finditer(r"^\s*0x[0-9a-f]+ ((?:[0-9a-f]{2,8} ){1,4})", out, re.M))
    return {raw[i + 8:i + 64].split(b"\0")[0].decode(): int.from_bytes(raw[i:i + 8], "little")
            for i in range(0, len(raw) - 63, 64)}


def _undefined(obj: Path) -> set[str]:
    out = subprocess.run(["nm", "-u", str(obj)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def test_module_runtime_is_the_cached_runtime(rewritten_romfs):
    """A module's fetch and trace code is the runtime link/runtime.py builds from the module's
    recipe and caches, as every target's: the same objects in both variants, the event_calls one
    (the kernel's BTF read: the events are the kernel's own event calls) calling
    kp_platform_trace_record(), the other not; the rewritten romfs (events, the kernel's BTF)
    holds the variant's code."""
    from rewriter.link import compiler, runtime as lr
    cc = compiler("x86_64")
    plain = lr.compile_runtime(cc, None, "x86_64", "linux_module")
    calls = lr.compile_runtime(cc, None, "x86_64", "linux_module", "event_calls")
    assert [p.name for p in plain] == [p.name for p in calls] == [
        "rt_kp_lib.c.o", "rt_kp_line.c.o", "rt_kp_fetch.c.o", "rt_kp_trace.c.o", "rt_platform_linux_module_platform.c.o"]
    assert plain[0].parent != calls[0].parent and all(p.is_file() for p in plain + calls)
    assert "kp_platform_trace_record" in _undefined(calls[3]) - _undefined(plain[3])
    assert lr.compile_runtime(cc, None, "x86_64", "linux_module", "event_calls") == calls     # built once
    with pytest.raises(Exception, match="no variant 'nope'"):
        lr.compile_runtime(cc, None, "x86_64", "linux_module", "nope")
    # kp_trace.c's record path is in the module: its call of the event calls' kp_platform_trace_record().
    dis = subprocess.run(["objdump", "-dr", "-j", ".text.kprewrite_c", str(rewritten_romfs)], capture_output=True,
                         text=True, check=True).stdout
    assert re.search(r"call.*<kp_platform_trace_record>|R_X86_64_PLT32\s+kp_platform_trace_record", dis), dis[-2000:]


def test_new_imports_get_their_crcs(romfs, rewritten_romfs, symvers):
    """What the module's runtime calls and the module did not (__trace_puts, debugfs...) is in its
    __versions with the kernel's CRC; what it had is kept."""
    crc = {f[1]: int(f[0], 16) for f in (line.split("\t") for line in symvers.read_text().splitlines())}
    before, after = _versions(romfs), _versions(rewritten_romfs)
    new = set(after) - set(before)
    assert {"__trace_puts", "copy_from_kernel_nofault", "debugfs_create_ulong", "__preempt_count",
            "register_die_notifier", "unregister_die_notifier"} <= new, new
    assert all(after[n] == crc[n] for n in after), [n for n in after if after[n] != crc[n]]
    assert all(after[n] == before[n] for n in before)
    undefined = set(re.findall(r"^\s+U (\S+)$", subprocess.run(["nm", str(rewritten_romfs)], capture_output=True,
                                                              text=True, check=True).stdout, re.M))
    assert undefined <= set(after), undefined - set(after)


def _section_size(ko: Path, name: str) -> int | None:
    out = subprocess.run(["readelf", "-W", "-S", str(ko)], capture_output=True, text=True, check=True).stdout
    m = re.search(rf"\]\s+{re.escape(name)}\s+\S+\s+[0-9a-f]+\s+[0-9a-f]+\s+([0-9a-f]+)", out)
    return int(m.group(1), 16) if m else None


def test_event_calls_need_the_kernel_btf(romfs, rewritten_romfs, symvers, tmp_path):
    """With the kernel's vmlinux beside the Module.symvers given, the events are event calls: one
    pointer each in _ftrace_events (the module loader registers them), trace_event_raw_init
    imported; with a Module.symvers alone, no _ftrace_events: lines as trace_printk() writes them."""
    assert (symvers.parent / "vmlinux").is_file()
    # kp_ctx, kp_mid, kp_int3, kp_get_tree_ret, the fetch
    assert _section_size(rewritten_romfs, "_ftrace_events") == 8 * 5
    assert "trace_event_raw_init" in _versions(rewritten_romfs)
    alone = tmp_path / "Module.symvers"
    alone.write_bytes(symvers.read_bytes())
    spec = tmp_path / "probes.toml"
    spec.write_text('events = ["p:kp_mid romfs_get_tree+0xc fill=%si:x64"]\n')
    out = tmp_path / "romfs.ko"
    kprewrite("instrument", romfs, "--spec", spec, "--system-map", alone, "-o", out)
    assert _section_size(out, "_ftrace_events") is None
    assert "__trace_puts" in _versions(out) and "trace_event_raw_init" not in _versions(out)


@pytest.mark.parametrize("vmlinux", ["junk", "damaged", "other_release", "no_btf"])
def test_kernel_btf_that_cannot_be_read(romfs, symvers, tmp_path, vmlinux):
    """A vmlinux beside the Module.symvers that is not an ELF, a damaged ELF, or another release's
    (its `Linux version` banner against the module's vermagic): one line naming it, `check` and
    `instrument` alike, nothing written.  An ELF without .BTF (a kernel built without BTF): the
    trace_printk() lines, and one line on standard error saying so."""
    (tmp_path / "Module.symvers").write_bytes(symvers.read_bytes())
    elf = Path("/bin/true").read_bytes()
    v = tmp_path / "vmlinux"
    v.write_bytes({"junk": b"not a kernel\n", "damaged": elf[:100],
                   "other_release": elf + b"Linux version 9.9.9-other (a@b) #1\0", "no_btf": elf}[vmlinux])
    spec = tmp_path / "probes.toml"
    spec.write_text('events = ["p:kp_mid romfs_get_tree+0xc fill=%si:x64"]\n')
    out = tmp_path / "romfs.ko"
    r = kprewrite("check", romfs, "--spec", spec, "--system-map", tmp_path / "Module.symvers", check=False)
    w = kprewrite("instrument", romfs, "--spec", spec, "--system-map", tmp_path / "Module.symvers", "-o", out,
                  check=False)
    if vmlinux == "no_btf":
        note = [f"kprewrite: {v} has no .BTF (a kernel built without CONFIG_DEBUG_INFO_BTF): the module's events "
                f"are written as trace_printk() lines (no events/kprobes/<EVENT>/)"]
        assert r.returncode == 0 and r.stderr.strip().splitlines() == note, r.stderr
        assert w.returncode == 0 and w.stderr.strip().splitlines() == note, w.stderr
        assert _section_size(out, "_ftrace_events") is None and "__trace_puts" in _versions(out)
        return
    expect = {"junk": "not an ELF file", "damaged": "damaged ELF file",
              "other_release": "the vmlinux of release 9.9.9-other, the module's vermagic says "}[vmlinux]
    for x in (r, w):
        lines = x.stderr.strip().splitlines()
        assert x.returncode != 0 and not x.stdout and len(lines) == 1, x.stderr
        assert lines[0].startswith(f"kprewrite: {v}: {expect}"), lines
    assert not out.exists()


def test_events_without_symvers_are_one_line(romfs, debian_kernel, tmp_path):
    """@SYM in a module's event is not written yet: one line.  Events and breakpoint probes on a
    module need the kernel's CRCs: without Module.symvers, one line naming what and where to find
    it, no output."""
    spec = tmp_path / "probes.toml"
    out = tmp_path / "romfs.ko"
    spec.write_text('events = ["p:kp_at romfs_get_tree v=@romfs_fs_type:u64"]\n')
    r = kprewrite("instrument", romfs, "--spec", spec, "-o", out, check=False)
    c = kprewrite("check", romfs, "--spec", spec, check=False)     # check refuses what instrument refuses
    assert r.returncode != 0 and not out.exists() and c.returncode == r.returncode
    for x in (r, c):
        assert x.stderr.strip().splitlines() == ["kprewrite: probes.toml: event kp_at: @SYM in a module's event "
                                                 "is not written yet (the module's addresses are the loader's)"], x.stderr
    if Path(f"/lib/modules/{debian_kernel.release}/build/Module.symvers").exists():
        pytest.skip("this machine has the kernel's Module.symvers where kbuild finds it")
    spec.write_text('events = ["r:kp_ret romfs_get_tree ret=$retval"]\n')
    r = kprewrite("instrument", romfs, "--spec", spec, "-o", out, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and not out.exists() and len(lines) == 1, r.stderr
    assert "the module's runtime calls kernel symbols the module does not import (" in lines[0]
    assert "__trace_puts" in lines[0] and "Module.symvers: give it with --system-map FILE" in lines[0]
    # A breakpoint probe needs them too (the die notifier's registration).
    spec.write_text('[[kprobe]]\nsymbol_name = "romfs_init_fs_context"\noffset = 0xc\n')
    r = kprewrite("instrument", romfs, "--spec", spec, "-o", out, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and not out.exists() and len(lines) == 1, r.stderr
    assert "does not import (register_die_notifier, unregister_die_notifier)" in lines[0], lines


def test_list_on_rewritten_module(romfs, rewritten_romfs):
    r = kprewrite("diff", romfs, rewritten_romfs, check=False)
    assert r.returncode != 0 and "diff compares ELF files; a kernel module is relinked (ld -r)" in r.stderr
    lines = kprewrite("list", rewritten_romfs).stdout.splitlines()
    assert [line.split("  ", 1)[1] for line in lines] == ["k  romfs_get_tree+0x0 [FTRACE]",
                                                          "k  romfs_init_fs_context+0x0 [FTRACE]",
                                                          "k  romfs_get_tree+0x5 [OPTIMIZED]",
                                                          "k  romfs_init_fs_context+0x5 [OPTIMIZED]",
                                                          "k  romfs_fill_super+0x1d [OPTIMIZED]",
                                                          "k  romfs_fill_super+0x52 [OPTIMIZED]",
                                                          "k  romfs_fill_super+0x77 [OPTIMIZED]",
                                                          "k  romfs_fill_super+0xa8 [OPTIMIZED]",
                                                          "k  romfs_fill_super+0xba [OPTIMIZED]",
                                                          "k  romfs_init_fs_context+0xc [SINGLESTEP]",
                                                          "k  exit_romfs_fs+0x0 [SINGLESTEP]",
                                                          "k  romfs_fill_super+0x199 [EMULATED]",
                                                          "k  romfs_fill_super+0x1b0 [EMULATED]",
                                                          "k  romfs_fill_super+0x13c [EMULATED]",
                                                          "k  romfs_fill_super+0x1c1 [EMULATED]",
                                                          "k  romfs_iget+0x5 [OPTIMIZED]",
                                                          "k  romfs_iget+0x15 [SINGLESTEP]",
                                                          "k  romfs_init_fs_context+0x0 [FTRACE]",
                                                          "k  romfs_get_tree+0xc [OPTIMIZED]",
                                                          "k  romfs_init_fs_context+0xc [SINGLESTEP]",
                                                          "r  romfs_get_tree+0x0 [FTRACE]",
                                                          "r  exit_romfs_fs+0x0 [SINGLESTEP]",
                                                          "r  romfs_get_tree+0x0 [FTRACE]"]


def test_optimized_probe_relocations(romfs, rewritten_romfs):
    """The optimized probes' relocations, as binutils' readelf reads them: at each probed address
    a `jmp` (e9) whose R_X86_64_PC32 names a detour, the original relocation under it made
    R_X86_64_NONE; in the detours, the original's R_X86_64_32S (romfs_fill_super's address,
    &romfs_context_ops in .rodata) and a PC32 back to the region's end."""
    syms = _func_syms(romfs)
    before, after = _relas(romfs)[".text"], _relas(rewritten_romfs)
    text = {o: (t, v) for o, t, v in after[".text"]}
    detours = after[".text.kprewrite"]
    data = subprocess.run(["objcopy", "-O", "binary", "--only-section=.text", str(rewritten_romfs), "/dev/stdout"],
                          capture_output=True, check=True).stdout
    for func in ("romfs_get_tree", "romfs_init_fs_context"):
        at = syms[func][1] + 5        # a 7-byte mov/movq of an R_X86_64_32S immediate at +0x8
        assert data[at:at + 5] == bytes.fromhex("e900000000")
        assert text[at + 1][0] == "R_X86_64_PC32" and re.fullmatch(r"kp_detour_\d+-4", text[at + 1][1]), text[at + 1]
        orig = next((t, v) for o, t, v in before if o == at + 3)
        assert orig[0] == "R_X86_64_32S" and text[at + 3][0] == "R_X86_64_NONE"
        assert ("R_X86_64_32S", orig[1]) in [(t, v) for _, t, v in detours], (orig, detours)
        end = at + 7
        assert ("R_X86_64_PC32", f".text+{end - 4:x}") in [(t, v) for _, t, v in detours], detours
    assert ("R_X86_64_32S", f".text+{syms['romfs_fill_super'][1]:x}") in [(t, v) for _, t, v in detours]
    # kp_mid at romfs_get_tree+0xc: the tail call to the kernel's get_tree_bdev carried to its copy.
    assert ("R_X86_64_PLT32", "get_tree_bdev-4") in [(t, v) for _, t, v in detours], detours
    # The placeholders the writer linked with are gone.
    assert "kp_ph_" not in subprocess.run(["nm", str(rewritten_romfs)], capture_output=True, text=True).stdout



def test_orc_entries_of_the_rewritten_module(romfs, rewritten_romfs):
    """The module's ORC tables (without a boot): its layout read from its own entries (6.1's:
    a function start's call type is 0), as its release says; the rewritten module's
    .orc_unwind holds one 6-byte entry per .orc_unwind_ip slot, each slot an R_X86_64_PC32,
    the module's own entries all kept and ours added for the detours, slots and runtime."""
    from rewriter.targets.linux_module.x86_64 import orc

    def sizes(ko):
        out = subprocess.run(["readelf", "-W", "-S", str(ko)], capture_output=True, text=True, check=True).stdout
        return {m.group(1): int(m.group(2), 16)
                for m in re.finditer(r"\]\s+(\.orc_unwind(?:_ip)?)\s+\S+\s+\S+\s+\S+\s+([0-9a-f]+)", out)}
    _, mod = linux_module.unwrap(romfs.read_bytes(), str(romfs))
    assert orc.orc_format(mod) == "6.1"
    before, after = sizes(romfs), sizes(rewritten_romfs)
    assert before[".orc_unwind"] == 6 * (before[".orc_unwind_ip"] // 4) == 6 * 179
    assert after[".orc_unwind"] == 6 * (after[".orc_unwind_ip"] // 4)
    n = after[".orc_unwind_ip"] // 4
    assert n > 179 + 20, n                  # ours: the detours', the slots', the runtime's
    ips = _relas(rewritten_romfs)[".orc_unwind_ip"]
    assert len(ips) == n and {t for _, t, _ in ips} == {"R_X86_64_PC32"}
    assert sorted(o for o, _, _ in ips) == list(range(0, 4 * n, 4))
    assert sum(v.startswith(".text.kprewrite") for _, _, v in ips) > 20, ips[-10:]

def test_optimized_probes_across_a_module(modules, symvers, tmp_path):
    """Probes every 72 bytes or so (an instruction boundary, regions never overlapping) through
    kvm-amd.ko's .text (decoded by objdump): each one `check` optimizes is written, at each a `jmp`
    (e9, zero displacement) whose R_X86_64_PC32 names a detour; each one it makes a breakpoint
    probe is written, an int3 at it and a slot of its own; no placeholder left; the others are
    refused with a check and an address."""
    ko = modules["kvm-amd"]
    syms = _func_syms(ko)
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-j", ".text", str(ko)], capture_output=True,
                         text=True, check=True).stdout
    starts = {v: n for n, (sec, v, size) in syms.items() if sec == ".text" and size >= 30}
    sites, func, nxt = [], None, 0
    for m in re.finditer(r"^(?:([0-9a-f]+) <(\S+)>:|\s+([0-9a-f]+):)", dis, re.M):
        if m.group(1):
            a = int(m.group(1), 16)
            func = (starts.get(a), a)
            nxt = a + 5
        elif func and func[0]:
            a = int(m.group(3), 16)
            if a >= nxt:
                sites.append((func[0], a - func[1]))
                nxt = a + 24
    sites = sites[::3]                  # some 700 of them: time bounded, every part of the text
    spec = tmp_path / "all.toml"
    spec.write_text("".join(f'[[kprobe]]\nsymbol_name = "{n}"\noffset = {o}\n' for n, o in sites))
    out = kprewrite("check", ko, "--spec", spec, check=False).stdout
    placed = [(m.group(1), int(m.group(2), 16)) for m in re.finditer(r"^(\S+)\+(0x[0-9a-f]+)  k  optimized$", out, re.M)]
    int3 = [(m.group(1), int(m.group(2), 16))
            for m in re.finditer(r"^(\S+)\+(0x[0-9a-f]+)  k  int3  \S+ at 0x[0-9a-f]+: .*  \[\S+\]$", out, re.M)]
    refused = re.findall(r"^\S+  k  refused  (\S+) at 0x[0-9a-f]+: ", out, re.M)
    assert len(placed) + len(int3) + len(refused) == len(sites), (len(placed), len(int3), len(refused), len(sites))
    assert len(placed) > len(sites) // 2, (len(placed), len(sites))
    assert int3, out
    spec.write_text("".join(f'[[kprobe]]\nsymbol_name = "{n}"\noffset = {o}\n' for n, o in placed + int3))
    new = tmp_path / "kvm-amd.ko"
    kprewrite("instrument", ko, "--spec", spec, "--system-map", symvers, "-o", new)
    text = {o: (t, v) for o, t, v in _relas(new)[".text"]}
    data = subprocess.run(["objcopy", "-O", "binary", "--only-section=.text", str(new), "/dev/stdout"],
                          capture_output=True, check=True).stdout
    for n, o in placed:
        at = syms[n][1] + o
        assert data[at:at + 5] == bytes.fromhex("e900000000"), (n, o)
        assert text[at + 1][0] == "R_X86_64_PC32" and re.fullmatch(r"kp_detour_\d+-4", text[at + 1][1]), (n, o)
    # Each breakpoint site: the int3, and a slot (its copy) in the module's code.
    for n, o in int3:
        assert data[syms[n][1] + o] == 0xCC, (n, o)
    dis = subprocess.run(["objdump", "-d", "-j", ".text.kprewrite", str(new)], capture_output=True, text=True).stdout
    slots = re.findall(r"^[0-9a-f]+ <kp_slot_\d+>:$", dis, re.M)
    assert len(slots) == len(int3), (len(slots), len(int3))
    assert "kp_ph_" not in subprocess.run(["nm", str(new)], capture_output=True, text=True).stdout


def _exit_lines(out: str) -> list[tuple]:
    return re.findall(r"kprewrite: romfs: (\S+) (\S+) hits (\d+)(.*)", out)


def _initrd(make_initramfs, rewritten_romfs, modules, every_insn, perfcount):
    return make_initramfs(kernel_env.init_script(COMMANDS), {"romfs.ko": rewritten_romfs, "loop.ko": modules["loop"],
                                                             "romfs.img": romfs_image(b"hello", ROMFS_FILE),
                                                             "romfs-all.ko": every_insn[0],
                                                             "perfcount": perfcount})


@pytest.fixture(scope="module")
def perfcount(tmp_path_factory) -> Path:
    """kernel_env.PERFCOUNT_C, for the initramfs."""
    return kernel_env.perfcount_program(tmp_path_factory.mktemp("perfcount"))


def _expected_exits() -> list[tuple]:
    """Each load's exit lines: every probe's hits (a kretprobe's returns), nmissed 0."""
    return [(p, s, str(hits(p, n)), " nmissed 0" if p.startswith(("p_", "kp_ctx", "kp_mid", "kp_int3"))
             else f" returns {hits(p, n)} nmissed 0") for n in range(len(MOUNTS)) for p, s in zip(PROBES, SITES)]


# A frame dump_stack() prints ("? ": not one the unwinder stepped to) and the pt_regs line of a
# frame the unwinder entered through pt_regs (a trap's, a detour's): the function at regs->ip.
STACK_FRAME = re.compile(r"^\[ *[\d.]+\]  (\? )?([\w.]+)\+0x[0-9a-f]+/0x[0-9a-f]+(?: \[\w+\])?$")
STACK_RIP = re.compile(r"^\[ *[\d.]+\] RIP: 0010:([\w.]+)\+0x[0-9a-f]+/0x[0-9a-f]+")
# Each handler's stack on the real mount, after the handler's own frames: the probed function and
# its callers (the mount's path: path_mount() calls vfs_get_tree(), which calls romfs_get_tree(),
# which tail-calls get_tree_bdev(), which calls romfs_fill_super(), which calls romfs_iget()).  The
# stack ends at get_tree_bdev(): its return address is the kretprobe's trampoline while
# romfs_get_tree() runs.  The return handler's: the caller the function returned to.
STACKS = {"ftrace": ["romfs_get_tree", "vfs_get_tree", "path_mount"],
          "optimized": ["romfs_iget", "romfs_fill_super", "get_tree_bdev"],
          "int3": ["romfs_iget", "romfs_fill_super", "get_tree_bdev"],
          "kretprobe": ["vfs_get_tree", "path_mount", "__x64_sys_mount"]}


def _assert_stacks(r) -> None:
    """dump_stack() from the module's handlers (docs/kernel.md, stacks through probes): at an ftrace
    site, an optimized probe, a breakpoint and a kretprobe's return, the frames the unwinder stepped
    to (no "? ") go through the probed function and two of its callers, and no line of the boot
    says WARNING or speaks of unwinding (the ORC unwinder's complaints)."""
    for kind, want in STACKS.items():
        lines = r.lines_between(f"kp-stack-begin {kind}", f"kp-stack-end {kind}")
        assert any(line.endswith("Call Trace:") for line in lines), r.explain(f"no dump_stack() from {kind}")
        names = []
        for line in lines:
            m, rip = STACK_FRAME.match(line), STACK_RIP.match(line)
            if rip or (m and not m.group(1)):
                names.append(rip.group(1) if rip else m.group(2))
        at = names.index(want[0]) if want[0] in names else -1
        assert at >= 0 and names[at:at + len(want)] == want, \
            r.explain(f"{kind}: the unwound frames {names} do not go {' -> '.join(want)}")
    bad = [line for line in r.lines() if "WARNING" in line or "unwind" in line.lower()]
    assert not bad, r.explain(f"unwinder lines: {bad}")


def test_rewritten_module_loads_counts_and_unloads(debian_kernel, romfs, rewritten_romfs, modules, make_initramfs,
                                                   boot_kernel, romfs_every_insn, perfcount):
    """The unmodified Debian kernel insmods the rewritten romfs.ko (tainted: unsigned), the probes fire
    from mount(2) (romfs_init_fs_context and romfs_get_tree run, then the mount fails: /dev/null is no
    block device), the events' lines are in the trace and the counters in debugfs while it is loaded,
    rmmod prints each probe's hits and removes the counters, and the module loads, traces and counts
    again; loaded a third time, it mounts a romfs image through a loop device (romfs_fill_super() runs,
    through five optimized probes' copies) and the file reads back.  A breakpoint probe (the module's
    die notifier) runs its pre_handler and its post_handler on each hit.  Handlers' dump_stack() at an
    ftrace site, an optimized probe, a breakpoint and a kretprobe's return show the probed function and
    its callers (_assert_stacks(): the module's ORC entries).  Then romfs.ko probed at every instruction
    of romfs_fill_super() `check` places (breakpoints among them) mounts it again."""
    r = boot_kernel("module-romfs", debian_kernel.vmlinux,
                    _initrd(make_initramfs, rewritten_romfs, modules, romfs_every_insn, perfcount), smp=2, timeout=180)
    kernel_env.assert_boot_ok(r, allow=("Call Trace",))        # the handlers' dump_stack()
    _assert_stacks(r)
    out = r.between()
    for line in ("insmod1=0", "rmmod1=0", "loaded: 0", "debugfs-left: 0", "insmod2=0", "rmmod2=0",
                 "loop=0", "insmod3=0", "losetup=0", "mount3=0", "rmmod3=0", "insmod4=0", "mount4=0", "rmmod4=0",
                 "filter-mid=0", "filter-ctx=0", "disable-ret=0", "hist=0", "events-left: 0"):
        assert re.search(rf"^{line}$", out, re.M), r.explain(f"no {line}")
    assert re.findall(r"^file: (.*)$", out, re.M) == [ROMFS_FILE.decode().strip()], r.explain("no file read")
    assert re.findall(r"^file4: (.*)$", out, re.M) == [ROMFS_FILE.decode().strip()], r.explain("no file4 read")
    assert "romfs: module verification failed: signature and/or required key missing - tainting kernel" in out
    assert "disagrees about version" not in out and "no symbol version" not in out
    ksym = {m.group(2): int(m.group(1), 16) for m in re.finditer(r"^ksym: ([0-9a-f]+) t (\S+)", out, re.M)}
    assert set(ksym) == {"romfs_get_tree", "romfs_init_fs_context", "romfs_fill_super"}, r.explain("no kallsyms")
    # ftrace no longer owns the probed entries (their __mcount_loc entries dropped), the others it does.
    assert not re.search(r"^ftrace-probed:", out, re.M), r.explain("a probed site is still ftrace's")
    # The breakpoints' trap path is on the kernel's kprobe blacklist (NOKPROBE_SYMBOL()): every
    # function of ours the module's _kprobe_blacklist names (gcc's clones included), each once: the
    # notifier, the dispatch of the seven breakpoint sites (romfs_init_fs_context+0xc, exit_romfs_fs,
    # romfs_fill_super+0x199, +0x1b0, +0x13c and +0x1c1, romfs_iget+0x15), their post-handler calls
    # and kretprobe entry where gcc did not inline them, the kp_int3 event's pre_handler (at
    # romfs_init_fs_context+0xc), the kretprobe trampoline and its C.
    kbl = sorted(re.findall(r"^kbl: 0x[0-9a-f]+-0x[0-9a-f]+\s+(\S+) \[romfs\]$", out, re.M))
    listed = _nokprobe(rewritten_romfs)
    assert kbl == listed, r.explain(f"kprobe blacklist: {kbl}, the module's: {listed}")
    generic = [re.sub(r"_\d+$", "_N", n) for n in kbl if "." not in n]
    assert generic.count("kp_dispatch_N") == 7 and generic.count("kp_trace_pre_N") == 1, kbl
    assert {"kp_int3_notify", "kp_kret_return", "kp_kret_trampoline"} <= set(kbl), kbl
    assert int(re.search(r"^ftrace-romfs: (\d+)", out, re.M).group(1)) > 5
    # The module may load elsewhere each time: its addresses are ksym, ksym2, ksym3.
    ksym2, ksym3 = ({m.group(2): int(m.group(1), 16)
                     for m in re.finditer(rf"^ksym{n}: ([0-9a-f]+) [tT] (\S+)", out, re.M)}
                    for n in (2, 3))
    # The C handler ran on each hit, with regs->ip the probed address + 1 (as an ftrace kprobe's).
    pre = re.findall(r"kp-module: romfs_get_tree pre ip=([0-9a-f]+) di=([0-9a-f]+)", out)
    assert [int(ip, 16) for ip, _ in pre] == [ksym["romfs_get_tree"] + 1] * 3 + [
        ksym2["romfs_get_tree"] + 1, ksym3["romfs_get_tree"] + 1], out
    # The optimized probe inside it: regs->ip the probed address + 1, as optimized_callback() sets it.
    mid = re.findall(r"kp-module: romfs_get_tree\+0x5 mid ip=([0-9a-f]+)", out)
    assert [int(ip, 16) for ip in mid] == [ksym["romfs_get_tree"] + 6] * 3 + [
        ksym2["romfs_get_tree"] + 6, ksym3["romfs_get_tree"] + 6], out
    # The kretprobe on the same entry (one detour for both): romfs_get_tree() fails with -ENOTBLK,
    # then succeeds on the loop device.
    assert re.findall(r"kp-module: romfs_get_tree returned (-?\d+)", out) == ["-15"] * 4 + ["0"], out
    # Each event is the kernel's own event call (the kernel's BTF beside Module.symvers), registered
    # by the module loader with the module and removed with it: events/kprobes/<EVENT>/ with the
    # fields of a kprobe event (its format), a filter on a number (kp_mid's fill, equal to
    # romfs_fill_super's address: kept) and on a string (kp_ctx's fstype, not "ext4": dropped), an
    # event disabled (kp_get_tree_ret), a hist trigger counting as many hits as the probe's counter.
    events = set(re.findall(r"^event: (\S+)$", out, re.M))
    assert {"kp_ctx", "kp_mid", "kp_get_tree_ret", "p_romfs_get_tree_0", "enable", "filter"} <= events, events
    fmt = [" ".join(line.split()) for line in re.findall(r"^format: (.*)$", out, re.M)]
    assert "field:unsigned long __probe_ip; offset:8; size:8; signed:0;" in fmt, fmt
    assert "field:u64 fill; offset:16; size:8; signed:0;" in fmt, fmt
    assert re.search(r"^hist: +Hits: 3$", out, re.M), r.explain("no hist Hits: 3")
    # The kernel's own kprobes on our sites (docs/kernel.md): on an optimized probe's jump it takes
    # one (the jump is its probed instruction) and both fire, on the third load's mount; at a
    # breakpoint of ours it refuses one with EINVAL (__copy_instruction(): "another subsystem puts a
    # breakpoint"), inside our jump with EILSEQ (can_probe(): not an instruction's start).
    for line in ("kk-jmp=0", "kk-enable=0", "kk-removed=0", r"kk-profile: kk_jmp\s+1\s+0",
                 "kk-0x199: sh: write error: Invalid argument",
                 "kk-0x1e: sh: write error: Invalid or incomplete multibyte or wide character"):
        assert re.search(rf"^{line}$", out, re.M), r.explain(f"no {line}")
    # perf on a module's event (its call's reg takes TRACE_REG_PERF_*): a counter on kp_ctx's id,
    # with a filter on its string field set through perf, counts the one mount of the second load.
    assert re.findall(r"^perf count=(\d+)$", out, re.M) == ["1"], r.explain("perf did not count kp_ctx once")
    # The lines, as the kernel prints a kprobe event's (our output type's .trace): per mount, the
    # `p` event (the file system's name through fc->fs_type, the task's name), the C-handler
    # probe's fetch (its fc the handler's %di, the mount's source string), the event inside the
    # function, the `r` event with the return value and the caller; the first load's filtered.
    size = {f: _func_syms(romfs)[f][2] for f in ("romfs_get_tree", "romfs_init_fs_context")}
    # kp_mid's %si, set by `mov $romfs_fill_super, %rsi` run from +0x5's detour (its R_X86_64_32S
    # carried to the copy): romfs_fill_super's address once loaded.
    for n, mounts, k in (("1", pre[:3], ksym), ("2", pre[3:4], ksym2)):
        lines = re.findall(rf"^trace{n}: +\S+ +\[\d+\] \S+ +[\d.]+: (.*)$", out, re.M)
        lines = [re.sub(r"\(vfs_get_tree\+0x[0-9a-f]+/0x[0-9a-f]+ <- ", "(vfs_get_tree+X <- ", line) for line in lines]
        want = []
        for _, di in mounts:
            want += [f"kp_ctx: (romfs_init_fs_context+0x0/{size['romfs_init_fs_context']:#x}) "
                     "fstype=\"romfs\" comm=\"mount\""] * (n == "2")
            # The event at the breakpoint (with the C handlers there): the same fs_context.
            want += [f"kp_int3: (romfs_init_fs_context+0xc/{size['romfs_init_fs_context']:#x}) fc=0x{di}"]
            want += [f"p_romfs_get_tree_0: (romfs_get_tree+0x0/{size['romfs_get_tree']:#x}) "
                     f"fc=0x{di} source=\"/dev/null\"",
                     f"kp_mid: (romfs_get_tree+0xc/{size['romfs_get_tree']:#x}) fill=0x{k['romfs_fill_super']:x}"]
            want += ["kp_get_tree_ret: (vfs_get_tree+X <- romfs_get_tree) ret=-15"] * (n == "2")
        assert lines == want, r.explain(f"trace{n}: {lines}")
    # The counters in debugfs while loaded: 3 mounts, then 1 after the reload (from zero).
    for n in (0, 1):
        counters = dict(re.findall(rf"^counter{n + 1}: (\S+) (\d+)$", out, re.M))
        want = {f"{p}/{c}": str(0 if c == "nmissed" else hits(p, n, exited=False)) for p in PROBES
                for c in ("hits", "nmissed") + (("returns",) if p.startswith(("r_", "kp_get")) else ())}
        assert counters == want, r.explain(f"counter{n + 1}: {counters}")
    exits = _exit_lines(out)
    assert exits[:len(_expected_exits())] == _expected_exits(), out
    # The breakpoint probe (romfs_init_fs_context+0xc, `xor %eax,%eax`): its pre_handler with regs->ip
    # after the int3 and the probed code's flags (interrupts on), run with interrupts off (the trap's),
    # its post_handler after the copy ran (ax zeroed, regs->ip the next instruction), once per mount.
    loads = [ksym] * 3 + [ksym2, ksym3]
    int3 = re.findall(r"kp-module: romfs_init_fs_context\+0xc int3 ip=([0-9a-f]+) flags=([0-9a-f]+) now=([0-9a-f]+)",
                      out)
    assert [int(ip, 16) for ip, _, _ in int3] == [k["romfs_init_fs_context"] + 0xd for k in loads], out
    assert all(int(f, 16) & 0x200 and not int(now, 16) & 0x200 for _, f, now in int3), int3
    post = re.findall(r"kp-module: romfs_init_fs_context\+0xc post ip=([0-9a-f]+) ax=([0-9a-f]+) flags=([0-9a-f]+) "
                      r"now=([0-9a-f]+)", out)
    assert [(int(ip, 16), ax) for ip, ax, _, _ in post] == [(k["romfs_init_fs_context"] + 0xe, "0") for k in loads], out
    # The single-stepped copy ran with interrupts off (setup_singlestep()), and its closing trap set
    # them back as the probed code had them (resume_singlestep()): the post_handler's regs show IF on,
    # as the pre_handler's did, while it runs with them off.
    assert all(int(f, 16) & 0x200 and not int(now, 16) & 0x200 for _, _, f, now in post), post
    # The calls at breakpoints (the real mount, third load): emulated in the trap, the post_handler
    # sees regs->ip the callee, the return address (the next instruction) pushed on the stack.
    called = re.findall(r"kp-module: romfs_fill_super\+(0x[0-9a-f]+) called ip=([0-9a-f]+) ret=([0-9a-f]+)", out)
    fs = ksym3["romfs_fill_super"]
    assert [(int(o, 16), int(ip, 16), int(ret, 16)) for o, ip, ret in called] == [
        (0x199, ksym3["romfs_iget"], fs + 0x19e), (0x1b0, ksym3["d_make_root"], fs + 0x1b5)], out
    went = re.findall(r"kp-module: romfs_fill_super\+(0x[0-9a-f]+) went ip=([0-9a-f]+)", out)
    assert [(int(o, 16), int(ip, 16)) for o, ip in went] == [(0x13c, fs + 0x142), (0x1c1, fs + 0xf1)], out
    # The module's exit, at each rmmod: the breakpoint's post_handler after its single-stepped copy
    # (`mov $romfs_fs_type, %rdi`, its R_X86_64_32S carried).
    exit_post = re.findall(r"kp-module: exit_romfs_fs\+0x0 post ip=([0-9a-f]+)", out)
    assert len(exit_post) == len(MOUNTS), out
    # Every instruction of romfs_fill_super() probed (the fourth load): one mount, each probe's line,
    # nothing missed (the kretprobe on the exit, entered by a jump: one call, one return); the
    # function's first instructions (up to its first branch, +0x1d) hit once, and so is the
    # breakpoint at +0x128 (a boosted copy: a jump lands inside its region); the inlined
    # romfs_checksum() loop over the superblock's 512 bytes (+0x12b to its `jne` back, run from
    # its slot at +0x138) 128 times, each of its instructions.
    every = exits[len(_expected_exits()):]
    assert every[-1:] == [("r_exit_romfs_fs_0", "exit_romfs_fs+0x0", "1", " returns 1 nmissed 0")], every[-1:]
    every = every[:-1]
    _, placed = romfs_every_insn
    assert [int(site.split("+")[1], 16) for _, site, _, _ in every] == sorted(placed), every
    assert all(rest == " nmissed 0" for _, _, _, rest in every), every
    hit = {int(site.split("+")[1], 16): int(n) for _, site, n, _ in every}
    table = str(sorted((hex(o), placed[o], hit[o]) for o in placed))
    assert all(hit[o] == 1 for o in placed if o < 0x1d), table
    assert placed[0x128] == "int3  [boost]" and hit[0x128] == 1, table
    loop = [o for o in placed if 0x12b <= o <= 0x138]
    assert placed[0x138] == "int3  [emulate]" and len(loop) == 6 and {hit[o] for o in loop} == {128}, table
    assert sum(1 for o, d in placed.items() if d.startswith("int3") and hit[o]) >= 40, table


def test_truncated_module_is_one_line(romfs, tmp_path):
    bad = tmp_path / "cut.ko"
    data = romfs.read_bytes()
    bad.write_bytes(data[:len(data) // 2])
    r = kprewrite("blacklist", bad, check=False)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"kprewrite: {bad}")


def test_oversized_module_is_refused(romfs, tmp_path):
    """A .bss of 1 TiB (a crafted header): refused in one line before anything is laid out."""
    import struct
    from rewriter.targets.linux_module.x86_64 import relocatable
    data = bytearray(romfs.read_bytes())
    bss = next(s for s in relocatable.read_sections(bytes(data), "romfs.ko") if s.name == ".bss")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    struct.pack_into("<Q", data, shoff + bss.index * 64 + 32, 1 << 40)
    bad = tmp_path / "big.ko"
    bad.write_bytes(data)
    r = kprewrite("blacklist", bad, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"kprewrite: {bad}: the module's sections take 0x1000000")
    assert lines[0].endswith("(more than 256 MiB): not a module the loader would take")


def test_module_and_kernel_image_rewritten_in_one_boot(debian_kernel, rewritten_romfs, modules, make_initramfs,
                                                       boot_kernel, tmp_path, romfs_every_insn, perfcount):
    """The rewritten romfs.ko in a rewritten kernel: each image's runtime counts its own probes
    (the module's is its own, with hidden symbols; the kernel's prints its kprobe_profile at power-off)."""
    spec = tmp_path / "k.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "do_sys_openat2"\n')
    vmlinux = tmp_path / "vmlinux"
    kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "-o", vmlinux)
    r = boot_kernel("module-romfs-rewritten-kernel", vmlinux,
                    _initrd(make_initramfs, rewritten_romfs, modules, romfs_every_insn, perfcount), smp=2, timeout=180)
    kernel_env.assert_boot_ok(r, allow=("Call Trace",))        # the handlers' dump_stack()
    _assert_stacks(r)
    out = r.between()
    for line in ("insmod1=0", "rmmod1=0", "insmod2=0", "rmmod2=0", "mount3=0", "rmmod3=0", "mount4=0", "rmmod4=0"):
        assert re.search(rf"^{line}$", out, re.M), r.explain(f"no {line}")
    assert _exit_lines(out)[:len(_expected_exits())] == _expected_exits(), out
    assert len(re.findall(r"^trace2: .* kp_get_tree_ret: .* ret=-15$", out, re.M)) == 1, out
    profile = r.profile()
    # The kernel's profile: its probe (and its own boot hooks), none of the module's.
    assert profile["p_do_sys_openat2_0"][0] > 0, profile
    assert not [e for e in profile if "romfs" in e], profile


def test_module_noinstr_alternatives_ex_table(modules, tmp_path):
    """kvm-amd.ko's .noinstr.text functions refused one by one, its .altinstructions sites reserved
    (one per entry: two relocations each), a probe inside a function with an __ex_table entry refused
    (the function holding its first entry's instruction, read from readelf's relocations)."""
    ko = modules["kvm-amd"]
    lines = kprewrite("blacklist", ko).stdout.splitlines()
    noinstr = {n for n, (sec, _, _) in _func_syms(ko).items() if sec == ".noinstr.text"}
    listed = {m.group(1) for line in lines if (m := re.search(r"  (\S+)  in \.noinstr\.text \(noinstr\)$", line))}
    assert noinstr and listed == noinstr, (listed, noinstr)
    assert sum(line.endswith("alternatives site (alternatives_text_reserved)") for line in lines) \
        == _relocations(ko, ".altinstructions") // 2 > 0
    out = subprocess.run(["readelf", "-W", "-r", str(ko)], capture_output=True, text=True, check=True).stdout
    m = re.search(r"R_X86_64_PC32\s+\S+\s+\.text \+ ([0-9a-f]+)", out[out.index(".rela__ex_table'"):])
    insn = int(m.group(1), 16)
    func, start = next((n, v) for n, (sec, v, size) in _func_syms(ko).items()
                       if sec == ".text" and v + 5 < insn < v + size)
    # A function with a `jmp` through a retpoline thunk (objdump: a jmp whose relocation names
    # __x86_indirect_thunk_*): an indirect jump, which refuses optimizing it (insn_is_indirect_jump()).
    dis = subprocess.run(["objdump", "-dr", "--no-show-raw-insn", str(ko)], capture_output=True, text=True,
                         check=True).stdout
    thunk_jumper = re.search(r"^[0-9a-f]+ <(\w+)>:$(?:\n(?!\n).*)*?\n\s+[0-9a-f]+:\s+jmp\s.*\n\s+[0-9a-f]+: "
                             r"R_X86_64_PLT32\s+__x86_indirect_thunk_", dis, re.M).group(1)
    spec = tmp_path / "probes.toml"
    # Right after the ftrace site (an instruction boundary), so the region check comes first.
    spec.write_text(f'[[kprobe]]\nsymbol_name = "{func}"\noffset = 5\n'
                    f'[[kprobe]]\nsymbol_name = "{sorted(noinstr)[0]}"\n'
                    f'[[kprobe]]\nsymbol_name = "{thunk_jumper}"\noffset = 5\n')
    r = kprewrite("check", ko, "--spec", spec, check=False)
    # Not optimized, so breakpoint probes (the kernel's own would be too).
    assert re.search(rf"^{thunk_jumper}\+0x5  k  int3  indirect_jump at 0x\S+: {thunk_jumper} jumps through a "
                     "retpoline thunk", r.stdout, re.M), r.stdout
    assert re.search(rf"^{func}\+0x5  k  int3  __ex_table at 0x\S+: {func} has an exception "
                     "table entry", r.stdout, re.M), r.stdout
    assert re.search(rf"^{sorted(noinstr)[0]}\+0x0  k  refused  blacklist at .* in \.noinstr\.text", r.stdout, re.M), r.stdout


def test_module_without_exit_refused_by_check_and_instrument(romfs, tmp_path):
    """A module with no exit (its `cleanup_module` symbol renamed in .strtab, the same length)
    could never be unloaded once our probes are in it: `check` and `instrument` refuse it
    with the same line (targets.base.Target.refusals()), and instrument writes nothing."""
    data = romfs.read_bytes()
    assert data.count(b"\0cleanup_module\0") == 1
    bad = tmp_path / "noexit.ko"
    bad.write_bytes(data.replace(b"\0cleanup_module\0", b"\0cleanup_modulX\0"))
    spec = tmp_path / "probes.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "romfs_get_tree"\n')
    want = f"kprewrite: {bad}: the module has no exit (cleanup_module): it could not be unloaded"
    r = kprewrite("check", bad, "--spec", spec, check=False)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [want], r.stderr
    out = tmp_path / "noexit.kp.ko"
    r = kprewrite("instrument", bad, "--spec", spec, "-o", out, check=False)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [want], r.stderr
    assert not out.exists() and bad.read_bytes() == data.replace(b"\0cleanup_module\0", b"\0cleanup_modulX\0")


def _text_sites(ko: Path, every: int) -> list[tuple[str, int]]:
    """(function, offset) of every `every`-th instruction boundary of a module's .text (objdump's),
    in functions of 30 bytes or more."""
    starts = {v: n for n, (sec, v, size) in _func_syms(ko).items() if sec == ".text" and size >= 30}
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-j", ".text", str(ko)], capture_output=True,
                         text=True, check=True).stdout
    sites, func = [], None
    for m in re.finditer(r"^(?:([0-9a-f]+) <(\S+)>:|\s+([0-9a-f]+):)", dis, re.M):
        if m.group(1):
            func = (starts.get(int(m.group(1), 16)), int(m.group(1), 16))
        elif func and func[0]:
            sites.append((func[0], int(m.group(3), 16) - func[1]))
    return sites[::every]


# Each module's spec: a probe placed, and probes refused by the module's rules (romfs: .init.text,
# a kernel function's stand-in, a kretprobe there, a breakpoint on a return thunk's jump; loop: a
# breakpoint in a module parameter's set, before the module's init; kvm-amd: a sample of its .text,
# alternatives, static calls, BUG sites, bytes no function covers), and the checks they must name.
REFUSING = {
    "romfs": ('[[kprobe]]\nsymbol_name = "romfs_get_tree"\n[[kprobe]]\nsymbol_name = "init_romfs_fs"\n'
              '[[kprobe]]\nsymbol_name = "_printk"\n[[kprobe]]\nsymbol_name = "romfs_init_fs_context"\noffset = 0xe\n'
              '[[kretprobe]]\nsymbol_name = "init_romfs_fs"\n', {"blacklist", ".return_sites"}),
    "loop": ('[[kprobe]]\nsymbol_name = "max_loop_param_set_int"\noffset = 0x15\n'
             '[[kprobe]]\nsymbol_name = "max_loop_param_set_int"\n', {"module_int3"}),
    "kvm-amd": (None, {"blacklist", "no_function", ".return_sites"}),
}


@pytest.mark.parametrize("name", list(REFUSING))
def test_check_refuses_what_instrument_refuses(modules, symvers, tmp_path, name):
    """`check` on a module refuses exactly the probes `instrument` refuses, each with the same
    check and address (instrument's error line names them as check's line does), and says so on
    standard error in instrument's own lines; both exit 1 and instrument writes nothing."""
    ko = modules[name]
    text, checks = REFUSING[name]
    if text is None:
        text = "".join(f'[[kprobe]]\nsymbol_name = "{f}"\noffset = {o}\n' for f, o in _text_sites(ko, 9))
    spec = tmp_path / "probes.toml"
    spec.write_text(text)
    c = kprewrite("check", ko, "--spec", spec, check=False)
    out = tmp_path / "out.ko"
    i = kprewrite("instrument", ko, "--spec", spec, "--system-map", symvers, "-o", out, check=False)
    assert c.returncode == 1 and i.returncode == 1 and not out.exists(), (c.returncode, i.returncode, i.stderr)
    refused = re.findall(r"^(\S+)  [kr]  refused  (.+?) at (0x[0-9a-f]+): ", c.stdout, re.M)
    errors = re.findall(r"^kprewrite: probes\.toml: \[\[k(?:ret)?probe\]\] #\d+ \((\S+)\): (.+?) at (0x[0-9a-f]+): ",
                        i.stderr, re.M)
    assert len(errors) == len(i.stderr.strip().splitlines()), i.stderr      # every line names its check
    assert sorted(refused) == sorted(errors) and checks <= {ch for _, ch, _ in refused}, (refused, errors)
    assert c.stderr.strip().splitlines() == i.stderr.strip().splitlines()

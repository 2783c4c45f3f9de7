"""The runtime placed at boot in Debian's arm64 kernel (aarch64/runtime.py): the generic runtime's
debugfs views (runtime/platform/linux_kernel/kp_debugfs.c), linked as one blob kept in the
boot-only data and placed in module memory at console_on_rootfs() (module_alloc(), its
relocations applied where KASLR put the kernel and where the blob landed, set_memory_ro() then
set_memory_x(), the I-cache cleaned), run as the kernel's own debugfs files do:
/sys/kernel/debug/kprewrite/{list,enabled,profile} with the kernel's modes.  One boot
(qemu-system-aarch64 -M virt -cpu max, KASLR) with `kprewrite.enabled=0` on the command line:
`enabled` reads 0 and no probe counts a hit; written 1, each probe counts exactly its calls (the
detours' counters, read by the blob's code), a nested hit counts in nmissed; written 0 again,
nothing more.  `list` gives each probe's address where the kernel runs (its /proc/kallsyms
address + offset) and placement: a jump past the ftrace NOPs [FTRACE], a jump [OPTIMIZED], a
breakpoint (no tag, as the kernel lists its own), a kretprobe `r`, a glob through ftrace_ops.
Without the room for the blob in the boot-only data, instrument refuses in one line."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arm64_env  # noqa: E402
import kernel_env  # noqa: E402

pytestmark = pytest.mark.kernel

HANDLER = r"""#include <linux/kprobes.h>

int getppid_pre(struct kprobe *p, struct pt_regs *regs)
{
	pr_info("kprewrite-dbg: getppid\n");
	return 0;
}

int count_pre(struct kprobe *p, struct pt_regs *regs)
{
	return 0;
}

int glob_pre(struct kprobe *p, struct pt_regs *regs)
{
	return 0;
}

/* Reentry: getppid_pre()'s printk reaches vprintk, which runs no handler and counts in nmissed. */
int vprintk_pre(struct kprobe *p, struct pt_regs *regs)
{
	return 0;
}

int sleep_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	return 0;
}
"""
SPEC = """handlers = ["h.c"]
[[kprobe]]
symbol_name = "__arm64_sys_getppid"
pre_handler = "getppid_pre"
[[kprobe]]
symbol_name = "__arm64_sys_newuname"
offset = 12
pre_handler = "count_pre"
[[kprobe]]
symbol_name = "strncpy_from_user"
offset = 16
pre_handler = "count_pre"
[[kprobe]]
symbol_name = "vprintk"
pre_handler = "vprintk_pre"
[[kprobe]]
symbol_name = "__arm64_sys_get[gpu]*"
pre_handler = "glob_pre"
[[kretprobe]]
symbol_name = "do_nanosleep"
handler = "sleep_ret"
"""
CALLS = 5
D = "/sys/kernel/debug/kprewrite"
INIT = (f"grep -w -e __arm64_sys_getppid -e __arm64_sys_newuname -e strncpy_from_user -e vprintk -e do_nanosleep "
        "/proc/kallsyms\n"
        f"for f in {D}/*; do echo \"MODE $(stat -c '%n %a' $f)\"; done\n"
        f"echo ENABLED0=$(cat {D}/enabled)\n"
        "for i in 1 2 3; do sh -c 'echo $PPID' >/dev/null; done\n"
        f"echo PROFILE-DISARMED; cat {D}/profile\n"
        f"echo 1 > {D}/enabled\n"
        f"echo ENABLED1=$(cat {D}/enabled)\n"
        "echo ARMED\n"
        f"for i in $(seq {CALLS}); do sh -c 'echo $PPID' >/dev/null; done\n"
        "uname -r >/dev/null\n"
        "usleep 10000\n"
        f"echo PROFILE-ARMED; cat {D}/profile\n"
        f"echo 0 > {D}/enabled\n"
        f"echo PROFILE-OFF; cat {D}/profile\n"
        f"for i in $(seq {CALLS}); do sh -c 'echo $PPID' >/dev/null; done\n"
        f"echo PROFILE-AGAIN; cat {D}/profile\n"
        f"echo LIST; cat {D}/list\n"
        "echo DBG-DONE\n")

_env = arm64_env.env


@pytest.fixture(scope="module")
def dbg_boot(arm64_kernel, tmp_path_factory):
    d = tmp_path_factory.mktemp("arm64-dbg")
    (d / "h.c").write_text(HANDLER)
    spec = d / "probes.toml"
    spec.write_text(SPEC)
    out = d / "Image.kp"
    kprewrite("instrument", arm64_kernel.vmlinuz, "--spec", spec, "-o", out)
    rd = _env(arm64_env.build_initramfs, kernel_env.init_script(INIT))
    r = _env(lambda: arm64_env.boot(out, rd, extra_append="kprewrite.enabled=0", log=d / "arm64-dbg.console.txt"))
    assert r.reached() and r.powered_off, r.explain("no clean boot to user space and power-off")
    assert not r.problems(), r.explain("kernel problems")
    assert arm64_env.WX_PASSED in r.console and "DBG-DONE" in r.console, r.explain("W+X check or /init")
    return r


def _profile(console: str, after: str) -> list[tuple[str, int, int]]:
    block = console[console.index(after):]
    rows = []
    for line in block.splitlines()[1:]:
        m = re.match(r"^  (\S+)\s+(\d+)\s+(\d+)$", line)
        if not m:
            if rows:
                break
            continue
        rows.append((m.group(1), int(m.group(2)), int(m.group(3))))
    return rows


# In the spec's order: the glob's probe on getppid, which a named probe also has, is on that
# probe's site (its jump), with its own struct kprobe and the kernel's default name.
NAMES = ["p___arm64_sys_getppid_0", "p___arm64_sys_newuname_12", "p_strncpy_from_user_16", "p_vprintk_0",
         "p___arm64_sys_get_gpu___0", "p___arm64_sys_getppid_0", "r_do_nanosleep_0"]


def test_runtime_placed_in_module_memory(dbg_boot):
    """The loader ran after the initcalls and before the init memory was freed, and said so; the
    files have the kernel's modes (kprobes/list 0400, enabled 0600, kprobe_profile 0440)."""
    r = dbg_boot
    m = re.search(r"kprewrite: the runtime placed in module memory: (\d+) KiB of code, (\d+) KiB of data", r.console)
    assert m and 0 < int(m.group(1)) <= 64, r.explain("the loader's line")
    assert r.console.index(m.group(0)) < r.console.index("Freeing unused kernel memory"), r.explain("order")
    modes = dict(re.findall(r"^MODE (\S+) (\d+)$", r.console, re.M))
    assert modes == {f"{D}/list": "400", f"{D}/enabled": "600", f"{D}/profile": "440"}, modes


def test_enabled_from_the_command_line_and_written(dbg_boot):
    """kprewrite.enabled=0: `enabled` reads 0, no probe counts a hit or runs its handler; written 1,
    it reads 1 and getppid's probe counts exactly the calls (its handler's lines too); written 0,
    the counts stay."""
    r = dbg_boot
    assert "ENABLED0=0" in r.console and "ENABLED1=1" in r.console, r.explain("enabled")
    disarmed = _profile(r.console, "PROFILE-DISARMED")
    assert [n for n, _, _ in disarmed] == NAMES, disarmed
    # vprintk's hits are the kernel's printks before parse_early_param() read the command line.
    assert [(h, m) for n, h, m in disarmed if n != "p_vprintk_0"] == [(0, 0)] * 6 and disarmed[3][2] == 0, disarmed
    rows = _profile(r.console, "PROFILE-ARMED")
    armed = {n: (h - disarmed[i][1], m) for i, (n, h, m) in enumerate(rows) if i != 5}
    assert armed["p___arm64_sys_getppid_0"] == (CALLS, 0) and rows[5][1:] == (CALLS, 0), rows
    lines = r.console[r.console.index("ARMED"):r.console.index("PROFILE-ARMED")]
    assert lines.count("kprewrite-dbg: getppid") == CALLS, r.explain("the handler's lines")
    assert r.console.count("kprewrite-dbg: getppid") == CALLS, r.explain("a handler ran while disarmed")
    # The glob's ftrace_ops counts getppid's calls too (and getpid, getuid...); uname: its own
    # call; strncpy_from_user (a breakpoint): each exec's file name at least; the kretprobe: usleep.
    assert armed["p___arm64_sys_get_gpu___0"][0] >= CALLS, armed
    assert armed["p___arm64_sys_newuname_12"][0] >= 1 and armed["p_strncpy_from_user_16"][0] >= CALLS, armed
    assert armed["r_do_nanosleep_0"][0] >= 1, armed
    # Nested: getppid_pre()'s printk reached vprintk, which ran no handler and counted as missed
    # (while disarmed, the boot's own nested printks counted nothing).
    assert armed["p_vprintk_0"][1] == CALLS, armed
    off = _profile(r.console, "PROFILE-OFF")
    assert _profile(r.console, "PROFILE-AGAIN") == off, r.explain("hits counted after enabled=0")


def test_list_where_the_kernel_runs(dbg_boot):
    """kprobes/list's form: each probe at its address under KASLR (its /proc/kallsyms address + the
    offset), k or r, and its placement."""
    r = dbg_boot
    kall = {m.group(2): int(m.group(1), 16) for m in re.finditer(r"^([0-9a-f]{16}) [tT] (\w+)$", r.console, re.M)}
    assert len(kall) == 5, r.explain("no kallsyms lines")
    block = r.console[r.console.index("\nLIST") + 1:r.console.index("DBG-DONE")]
    rows = [l.split() for l in block.splitlines()[1:] if l.strip()]
    want = [(kall["__arm64_sys_getppid"], "k", "__arm64_sys_getppid+0x0", ["[FTRACE]"]),
            (kall["__arm64_sys_newuname"] + 12, "k", "__arm64_sys_newuname+0xc", ["[OPTIMIZED]"]),
            (kall["strncpy_from_user"] + 16, "k", "strncpy_from_user+0x10", []),
            (kall["vprintk"], "k", "vprintk+0x0", ["[FTRACE]"])]
    assert [(int(a, 16), t, s, tags) for a, t, s, *tags in rows[:4]] == want, rows
    # The glob's struct kprobe through the ftrace_ops: its address the last hit's (a function it
    # matches), no symbol (symbol_name NULL, as its handlers see it); its probe on getppid's jump.
    assert rows[4][1:] == ["k", "+0x0", "[FTRACE]"] and rows[5] == rows[0], rows
    assert rows[6] == [f"{kall['do_nanosleep']:016x}", "r", "do_nanosleep+0x0", "[FTRACE]"], rows
    assert len(rows) == 7, rows


def test_runtime_beyond_the_boot_only_room_refused(arm64_kernel, tmp_path):
    """The blob is kept in the unused .rela.dyn entries below the data kept after boot, with the
    glob probes' sites (and anything the handlers put in .kp_initdata, as here: that room, less
    16 bytes, so that it fits alone).  More than the room is refused in one line saying how much
    the runtime needs, how much in all, and how much there is; no output."""
    def instrument(size: int):
        (tmp_path / "h.c").write_text(
            "#include <linux/kprobes.h>\n"
            f"static const char boot[{size}] __attribute__((used, section(\".kp_initdata\"))) = {{ 1 }};\n"
            "int pre(struct kprobe *k, struct pt_regs *r) { return 0; }\n")
        spec = tmp_path / "probes.toml"
        spec.write_text('handlers = ["h.c"]\n[[kprobe]]\nsymbol_name = "__arm64_sys_getppid"\npre_handler = "pre"\n')
        out = tmp_path / "Image.kp"
        r = kprewrite("instrument", arm64_kernel.vmlinuz, "--spec", spec, "-o", out, check=False)
        assert r.returncode == 1 and not out.exists() and len(r.stderr.splitlines()) == 1, r.stderr
        m = re.search(r"the runtime placed at boot needs (\d+) bytes of boot-only data \(with its relocations\), "
                      r"(\d+) in all with the glob probes' sites; the unused entries of \.rela\.dyn below the "
                      r"probes' data have (\d+)$", r.stderr.strip())
        assert m, r.stderr
        return [int(g) for g in m.groups()]
    runtime, total, room = instrument(1 << 20)
    assert 1024 < runtime < 32768 and total > (1 << 20) > room > 65536, (runtime, total, room)
    runtime2, total2, room2 = instrument(room - 16)
    assert (runtime2, room2) == (runtime, room) and total2 >= room - 16 + runtime > room, (runtime2, total2, room2)

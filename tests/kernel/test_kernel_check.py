"""`check` and `blacklist` on Debian's own stripped vmlinux: symbols from its kallsyms, the
kernel's registration rules, the sites it patches at boot, ftrace-site probes.  The probes are
chosen from the image's own tables, so the test holds for another build of the kernel."""
from __future__ import annotations

import json
import re
from collections import Counter
import sys
from pathlib import Path

import capstone
import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rewriter.elf.image import Image  # noqa: E402
from rewriter.targets import linux_kernel  # noqa: E402
from rewriter.targets.linux_kernel.x86_64 import sites as ks  # noqa: E402

pytestmark = pytest.mark.kernel

_cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)



def write_spec(tmp: Path, text: str) -> Path:
    p = tmp / "probes.toml"
    p.write_text(text)
    return p


@pytest.fixture(scope="module")
def kimage(debian_kernel):
    image = Image(str(debian_kernel.vmlinux))
    linux_kernel.load_symbols(image)
    return image


def _boundaries(image, f):
    return [a for a, *_ in _cs.disasm_lite(image.read(f.start, f.end - f.start), f.start)]


def _examples(image):
    """(symbol, offset, expected words in the check line) for each kernel-only rule."""
    k = linux_kernel.symbols.kernel(image)
    reserved = ks.kernel_sites(image.data, None, image.path, image=k)
    mcount = {m.site for m in ks.mcount_locs(k)}
    out = {}
    by_table = {}
    for r in reserved:
        by_table.setdefault(r.table, []).append(r)
    # A region overlapping a .return_sites entry: the instruction 1-4 bytes before it, in a
    # function whose entry is an ftrace site (so the function is ordinary text).
    for r in by_table[".return_sites"]:
        f = image.function_at(r.start)
        if f is None or f.start not in mcount or f.end - f.start > 4096:
            continue
        before = [a for a in _boundaries(image, f) if r.start - 4 <= a < r.start and a >= f.start + 5]
        if before:
            # Not jump-optimized: a breakpoint probe says why.
            out["return_site"] = (f.name, before[0] - f.start, ["int3", ".return_sites at", "patched at boot"])
            # The return site itself: a breakpoint there would be overwritten at boot (apply_returns()).
            out["int3_on_return_site"] = (f.name, r.start - f.start, ["refused", ".return_sites at",
                                                                      "would sit on a site patched at boot"])
            break
    # An alternatives site itself: refused at registration (alternatives_text_reserved).
    for r in by_table[".altinstructions"]:
        f = image.function_at(r.start)
        if f is not None and f.start in mcount and r.start > f.start + 5 and r.start in _boundaries(image, f):
            out["alternatives"] = (f.name, r.start - f.start, ["refused", "alternatives site"])
            break
    # A function with an exception-table entry: no jump optimization anywhere in it.
    ex = sorted(e.insn for e in ks.ex_table(k))
    for insn in ex:
        f = image.function_at(insn)
        if f is None or f.start not in mcount:
            continue
        b = _boundaries(image, f)
        cands = [a for a in b if a >= f.start + 5 and not any(r.start < a + 5 and a < r.end for r in reserved
                                                               if f.start <= r.start < f.end)]
        if cands:
            out["ex_table"] = (f.name, cands[0] - f.start, ["int3", "__ex_table at"])
            break
    # An instruction with an exception fixup: its out-of-line copy could fault, so no breakpoint.
    for insn in ex:
        f = image.function_at(insn)
        if f is None or f.start not in mcount or insn < f.start + 5 or insn not in _boundaries(image, f):
            continue
        if [r for r in reserved if r.start <= insn < r.end and r.table != "__ex_table"]:
            continue
        out["int3_on_ex_insn"] = (f.name, insn - f.start, ["refused", "__ex_table at", "exception fixup"])
        break
    return out


def test_check_kernel_rules(tmp_path, debian_kernel, kimage):
    ex = _examples(kimage)
    assert set(ex) == {"return_site", "int3_on_return_site", "alternatives", "ex_table", "int3_on_ex_insn"}, ex
    probes = [("do_sys_openat2", 0, ["ftrace"]), ("kernel_clone", 0, ["ftrace"]), ("vfs_read", 0, ["ftrace"]),
              ("do_sys_openat2", 5, ["optimized"]),
              ("kprobe_int3_handler", 0, ["refused", "NOKPROBE_SYMBOL"]),
              ("do_syscall_64", 0, ["refused", ".noinstr.text"]),
              # .head.text runs before %gs (the per-CPU base) is set: a detour there would crash.
              ("secondary_startup_64", 0, ["refused", ".head.text"]),
              *ex.values()]
    spec = write_spec(tmp_path, "".join(f'[[kprobe]]\nsymbol_name = "{s}"\noffset = {o:#x}\n' for s, o, _ in probes)
                      + '[[kretprobe]]\nsymbol_name = "kernel_clone"\n'
                      + '[[kretprobe]]\nsymbol_name = "strncpy_from_user"\n')
    r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec, check=False)
    lines = r.stdout.splitlines()
    assert len(lines) == len(probes) + 2, r.stdout + r.stderr
    for (sym, off, words), line in zip(probes, lines):
        assert line.startswith(f"{sym}+{off:#x}  k  "), (line, sym, off)
        for w in words:
            assert w in line, (line, words)
    # A kernel's kretprobes hook every exit, as in user space: kernel_clone's one return is its
    # `jmp __x86_return_thunk` at a .return_sites entry.  strncpy_from_user()'s exits cannot take
    # a jump (an exception-table entry): it keeps the trampoline, and the check is named.
    m = re.fullmatch(r"kernel_clone\+0x0  r  ftrace  returns: (0x[0-9a-f]+) ret", lines[-2])
    assert m and int(m.group(1), 16) in {r.start for r in ks.return_sites(linux_kernel.symbols.kernel(kimage))}, lines[-2]
    # Its entry, as written: a breakpoint (the same check refuses a jump there), boosted.
    assert re.fullmatch(r"strncpy_from_user\+0x0  r  int3  __ex_table at 0x[0-9a-f]+: strncpy_from_user has an exception "
                        r"table entry: its fixup may jump back into the function  \[boost\]  "
                        r"returns: trampoline  __ex_table at 0x[0-9a-f]+: the exit at "
                        r"0x[0-9a-f]+ cannot take a jump: .*\(the return address is swapped at entry\)", lines[-1]), lines[-1]
    # Every refused probe is named on standard error, one line each, and check fails.
    refused = sum("refused" in w for _, _, w in probes)
    assert r.returncode == 1 and len(r.stderr.splitlines()) == refused, r.stderr
    # --format json: the same plan; kernel addresses as "0x..." strings (beyond a double's 53 bits).
    j = kprewrite("check", debian_kernel.vmlinux, "--spec", spec, "--format", "json", check=False)
    doc = json.loads(j.stdout)
    assert j.returncode == 1 and j.stderr == r.stderr and len(doc["errors"]) == refused
    for (sym, off, words), p, line in zip(probes, doc["probes"], lines):
        assert (p["symbol"], p["offset"], p["kind"]) == (sym, off, "k") and p["decision"] == words[0]
        assert int(p["address"], 16) == kimage.symbols[sym][0] + off and int(p["address"], 16) > 2**53
        if p["decision"] == "refused":
            assert p["reason"]["message"] in line and p["reason"]["check"] and int(p["reason"]["address"], 16)
    kc, sfu = doc["probes"][-2:]
    assert kc["kind"] == "r" and kc["decision"] == "ftrace" and kc["returns"]["mode"] == "hooks", kc
    assert [(e["kind"], e["hook"], e["int3"]) for e in kc["returns"]["sites"]] == [("ret", "ret", False)], kc
    assert sfu["returns"]["mode"] == "trampoline" and sfu["returns"]["reason"]["check"] == "__ex_table", sfu


def test_instrument_is_all_or_nothing_and_says_what_is_missing(tmp_path, debian_kernel, kimage):
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "do_sys_openat2"\n'
                                '[[kprobe]]\nsymbol_name = "kprobe_int3_handler"\n')
    out = tmp_path / "vmlinux.kp"
    r = kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "-o", out, check=False)
    assert r.returncode == 1 and not out.exists()
    assert r.stderr.splitlines() == [
        "kprewrite: probes.toml: [[kprobe]] #2 (kprobe_int3_handler+0x0): "
        f"blacklist at {kimage.symbols['kprobe_int3_handler'][0]:#x}: "
        f"{kimage.symbols['kprobe_int3_handler'][0]:#x} is blacklisted: NOKPROBE_SYMBOL (kprobe_int3_handler)"]
    # Without the refused probe, the same image is written (test_kernel_probes.py boots such images).
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "do_sys_openat2"\n')
    r = kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "-o", out, check=False)
    assert r.returncode == 0 and out.exists() and r.stderr == "", r.stderr
    # kprewrite diff explains every changed byte: the jump after the ftrace site (the site and
    # its __mcount_loc entry stay ftrace's), our code and data in the text/rodata gap (and the
    # boot hooks' probes).
    doc = json.loads(kprewrite("diff", debian_kernel.vmlinux, out, "--format", "json").stdout)
    site = kimage.symbols["do_sys_openat2"][0]
    what = {c["what"] for c in doc["changes"]}
    assert {"kprobe", "added_section", "elf_header"} <= what and doc["unattributed"] == []
    assert [c for c in doc["changes"] if c["address"] == hex(site)] == []
    (entry,) = [c for c in doc["changes"] if c["address"] == hex(site + 5)]
    assert entry["probes"] == ["p_do_sys_openat2_0"] and entry["changed"] == 5, entry
    assert "after its ftrace site" in entry["detail"], entry
    assert not any("__mcount_loc" in c["detail"] for c in doc["changes"]), doc["changes"]
    assert all(g["segment"] == "LOAD" and g["filesz"][1] > g["filesz"][0] for g in doc["grown"])
    assert doc["added_segments"] == [] and [s["name"] for s in doc["added_sections"]] == [
        ".kprewrite.text", ".kprewrite.data", ".kprewrite.meta"]


def test_blacklist_lists_every_table(debian_kernel):
    r = kprewrite("blacklist", debian_kernel.vmlinux)
    lines = r.stdout.splitlines()
    reasons = {}
    for l in lines:
        start_end, sym, reason = l.split("  ", 2)
        lo, hi = (int(x, 16) for x in start_end.split("-"))
        assert lo < hi
        reasons.setdefault(reason, []).append(sym)
    assert "kprobe_int3_handler" in reasons["NOKPROBE_SYMBOL"]
    assert "do_syscall_64" in reasons["in .noinstr.text (noinstr)"]
    head = reasons["in .head.text (runs before per-CPU setup, on the early identity mapping)"]
    assert {"startup_64", "secondary_startup_64", "verify_cpu", "pvh_start_xen"} <= set(head)
    assert "x86_64_start_kernel" not in head and "start_kernel" not in head
    for table in (".altinstructions", ".parainstructions", ".retpoline_sites", ".return_sites", ".smp_locks",
                  "__jump_table", ".static_call_sites", "__mcount_loc", "__ex_table", "__bug_table"):
        assert reasons.get(f"boot-patched site ({table})"), table
    for why in ("alternatives site (alternatives_text_reserved)", "jump label site (jump_label_text_reserved)",
                "static call site (static_call_text_reserved)", "BUG/WARN site (find_bug)", "inside an ftrace site"):
        assert reasons.get(why), why


def test_system_map_stub_is_refused(tmp_path, debian_kernel, kimage):
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "do_sys_openat2"\n')
    r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec, "--system-map", debian_kernel.system_map, check=False)
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and "stub System.map" in r.stderr
    # A System.map in the kernel's format (here: from /proc/kallsyms's view of the image) is used.
    sm = tmp_path / "System.map"
    sm.write_text("".join(f"{s.addr:016x} {s.type} {s.name}\n" for s in kimage.kernel_symbols))
    r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec, "--system-map", sm)
    assert r.stdout == "do_sys_openat2+0x0  k  ftrace\n"
    r = kprewrite("check", debian_kernel.vmlinux, "--spec", spec, "--system-map", tmp_path / "missing.map", check=False)
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and "missing.map" in r.stderr


def test_check_reads_the_bzimage_too(tmp_path, debian_kernel):
    """A bzImage is detected and read through its payload: the same plan as its vmlinux."""
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "do_sys_openat2"\n'
                                '[[kprobe]]\nsymbol_name = "do_sys_openat2"\noffset = 5\n')
    a = kprewrite("check", debian_kernel.vmlinux, "--spec", spec)
    b = kprewrite("check", debian_kernel.vmlinuz, "--spec", spec)
    assert a.stdout == b.stdout
    entry, inside = a.stdout.splitlines()
    # The probe at +5 keeps the entry's jump from following the ftrace site: the site is taken, and `check` says why.
    assert entry.startswith("do_sys_openat2+0x0  k  ftrace  site taken, not shared with ftrace: probe_in_region at ")
    assert inside == "do_sys_openat2+0x5  k  optimized"


def test_funcs_on_the_kernel(debian_kernel):
    """`funcs` on Debian's bzImage: every function (some 46,000, in seconds), each decision
    seen; a sample of every 997th function, far apart so that no two plans meet, says in
    one `check` what funcs says of each."""
    lines = kprewrite("funcs", debian_kernel.vmlinuz).stdout.splitlines()
    assert len(lines) > 30000, len(lines)
    decisions = {}
    for line in lines:
        decisions[line.split("  ")[2].split()[0]] = decisions.get(line.split("  ")[2].split()[0], 0) + 1
    assert set(decisions) == {"ftrace", "optimized", "int3", "refused"}, decisions
    assert decisions["ftrace"] > len(lines) // 2, decisions
    names = [line.split("+0x")[0] for line in lines]
    once = {n for n, c in Counter(names).items() if c == 1}
    # (a name several static functions have is ambiguous to --kprobe: funcs lists each)
    sample = [line for line in lines[::997] if not line.startswith("sub_") and line.split("+0x")[0] in once]
    args = [a for line in sample for a in ("--kprobe", line.split("+0x")[0])]
    r = kprewrite("check", debian_kernel.vmlinuz, *args, check=False)
    assert r.stdout.splitlines() == sample, (r.stdout, sample)
    assert kprewrite("funcs", debian_kernel.vmlinuz, "do_sys_openat2").stdout == "do_sys_openat2+0x0  k  ftrace\n"

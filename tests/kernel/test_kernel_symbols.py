"""The kernel readers on Debian's real cloud kernel: kallsyms, System.map, boot-patched sites.

The vmlinux comes from the kernel harness (kernel_env.obtain_kernel: the current Debian cloud
kernel, downloaded once into the cache).  Checks hold for any such kernel; exact counts are
checked too for the release they were recorded on.  Every address is cross-checked against
something independent of the reader: the ELF section headers the linker wrote, the export
table (__ksymtab), and the bytes of the code.
"""
from __future__ import annotations

import struct
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rewriter.errors import KprewriteError  # noqa: E402
from rewriter.targets.linux_kernel import kallsyms, sysmap  # noqa: E402
from rewriter.targets.linux_kernel.x86_64 import sites  # noqa: E402
from rewriter.targets.linux_kernel.elfview import ElfView  # noqa: E402

pytestmark = pytest.mark.kernel

# Recorded on linux-image-6.1.0-56-cloud-amd64-unsigned 6.1.192-2; cross-checked with
# vmlinux-to-elf's kallsyms-finder (same 87,347 (address, type, name) entries).
KNOWN = {
    "6.1.0-56-cloud-amd64": {
        "symbols": 87347,
        "_etext": 0xffffffff81e01ef2,
        "do_sys_openat2": 0xffffffff8134a350,
        "tables": {".altinstructions": 4468, ".parainstructions": 3679, ".retpoline_sites": 7861,
                   ".return_sites": 48084, ".smp_locks": 8927, ".static_call_sites": 4276,
                   "__jump_table": 5980, "__mcount_loc": 37697, "__ex_table": 532,
                   "__bug_table": 8016},
    },
}


@pytest.fixture(scope="module")
def kernel():
    import kernel_env
    try:
        return kernel_env.obtain_kernel()
    except kernel_env.KernelEnvError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def image(kernel):
    data = kernel.vmlinux.read_bytes()
    elf = ElfView(data, str(kernel.vmlinux))
    t0 = time.monotonic()
    ks = kallsyms.read_kallsyms(data, str(kernel.vmlinux), elf)
    seconds = time.monotonic() - t0
    return data, elf, ks, seconds


@pytest.fixture(scope="module")
def kimage(image):
    data, elf, ks, _ = image
    return sites.KernelImage(data, ks, "vmlinux", elf)


@pytest.fixture(scope="module")
def known(kernel):
    return KNOWN.get(kernel.release)


def test_kallsyms_found_fast_and_ordered(image, known):
    data, elf, ks, seconds = image
    assert seconds < 10
    assert len(ks) > 50_000
    assert ks.tables.absolute_percpu and ks.tables.relative_base == ks.address("_text")
    addrs = [s.addr for s in ks.symbols]
    assert addrs == sorted(addrs)
    # Per-CPU symbols are absolute offsets into .data..percpu, typed A.
    percpu = elf.section(".data..percpu")
    assert {s.type for s in ks.symbols if s.addr < 1 << 63} == {"A"}
    assert ks.address("__per_cpu_start") == 0 and ks.address("__per_cpu_end") == percpu.size
    assert set("tTdDrRbB") <= {s.type for s in ks.symbols}
    if known:
        assert len(ks) == known["symbols"]
        assert ks.address("do_sys_openat2") == known["do_sys_openat2"]


def test_kallsyms_match_the_section_headers(image, known):
    """Linker-script symbols must sit exactly where the linker put the sections."""
    data, elf, ks, _ = image
    sec = elf.section
    assert ks.address("_text") == ks.address("_stext") == sec(".text").addr
    assert ks.address("_etext") == sec(".text").end
    assert ks.address("__start_rodata") == sec(".rodata").addr
    assert ks.address("_sinittext") == sec(".init.text").addr
    assert ks.address("_einittext") == sec(".init.text").end
    assert ks.address("__start___ex_table") == sec("__ex_table").addr
    assert ks.address("__stop___ex_table") == sec("__ex_table").end
    assert ks.address("__start___bug_table") == sec("__bug_table").addr
    for table, (start, _end) in sites.TABLES.items():
        if sec(table) is not None:
            assert ks.address(start) == sec(table).addr, table
    for name in ("do_sys_openat2", "_printk", "kprobe_int3_handler", "__fentry__",
                 "__x86_return_thunk", "__start_mcount_loc", "__stop_mcount_loc"):
        assert name in ks, name
    if known:
        assert ks.address("_etext") == known["_etext"]


def test_kallsyms_agree_with_the_export_table(image):
    """Every exported symbol (__ksymtab, struct kernel_symbol with PREL32 fields: value,
    name, namespace) is in kallsyms at the same address."""
    data, elf, ks, _ = image
    checked = 0
    for name in ("__ksymtab", "__ksymtab_gpl"):
        sec = elf.section(name)
        buf = data[sec.offset:sec.offset + sec.size]
        for i in range(0, len(buf), 12):
            value, nameoff, _ns = struct.unpack_from("<iii", buf, i)
            addr = (sec.addr + i + value) % (1 << 64)   # per-CPU ones wrap to small offsets
            naddr = sec.addr + i + 4 + nameoff
            off = elf.offset_of(naddr)
            sym = data[off:data.index(b"\0", off)].decode()
            assert addr in ks.addresses(sym), sym
            checked += 1
    assert checked > 5_000


def test_function_bounds(image, kimage):
    data, elf, ks, _ = image
    funcs = kallsyms.functions(ks.symbols, elf)
    assert len(funcs) > 40_000
    execs = [(s.addr, s.end) for s in elf.sections if s.executable]
    prev = None
    for f in funcs:
        assert f.end > f.start
        assert any(a <= f.start and f.end <= e for a, e in execs), f
        if prev is not None and prev.start != f.start:
            assert prev.end <= f.start, (prev, f)   # no overlap between distinct functions
        prev = f
    f = kimage.function_at(ks.address("do_sys_openat2") + 10)
    assert f.name == "do_sys_openat2" and f.start == ks.address("do_sys_openat2")
    # It ends where the next symbol starts.
    nxt = min(s.addr for s in ks.symbols if s.addr > f.start)
    assert f.end == nxt
    # The last function of .text ends at _etext.
    last = max((f for f in funcs if f.start < ks.address("_etext")), key=lambda f: f.start)
    assert last.end == ks.address("_etext")


def test_do_sys_openat2_starts_with_its_ftrace_site(image, kimage):
    data, elf, ks, _ = image
    start = ks.address("do_sys_openat2")
    locs = {m.site: m for m in sites.mcount_locs(kimage)}
    assert start in locs
    code = kimage.code(start, 5)
    assert code[0] == 0xE8 and start + 5 + struct.unpack_from("<i", code, 1)[0] == ks.address("__fentry__")
    # The entry's file offset holds the site's address (what the rewriter zeroes).
    m = locs[start]
    assert struct.unpack_from("<Q", data, m.entry_offset)[0] == start
    assert ks.address("__start_mcount_loc") <= m.entry < ks.address("__stop_mcount_loc")


def test_sites_match_the_code(kimage, known):
    bad = sites.verify_sites(kimage)
    assert bad and not any(bad.values()), bad


def test_site_tables(image, kimage, known):
    data, elf, ks, _ = image
    t0 = time.monotonic()
    reserved = sites.kernel_sites(data, ks, image=kimage)
    assert time.monotonic() - t0 < 10
    counts = {}
    for r in reserved:
        assert r.end > r.start, r
        counts[r.table] = counts.get(r.table, 0) + 1
    for table in (".altinstructions", ".parainstructions", ".retpoline_sites", ".return_sites",
                  ".smp_locks", ".static_call_sites", "__jump_table", "__mcount_loc",
                  "__ex_table", "__ex_table fixup", "__bug_table", "_kprobe_blacklist",
                  ".noinstr.text", ".entry.text"):
        assert counts.get(table, 0) > 0, table
    if known:
        for table, n in known["tables"].items():
            assert counts[table] == n, table
    assert counts["__ex_table"] == counts["__ex_table fixup"]
    # Every patched site lies in code: the executable sections.
    execs = [(s.addr, s.end) for s in elf.sections if s.executable]
    for r in reserved:
        if r.table in ("_kprobe_blacklist", "__cfi_/__pfx_"):
            continue
        assert any(a <= r.start and r.end <= e for a, e in execs), r


def test_exception_and_bug_tables(image, kimage):
    data, elf, ks, _ = image
    ex = sites.ex_table(kimage)
    assert ex and all(elf.section_at(e.insn).executable and elf.section_at(e.fixup).executable for e in ex)
    bugs = sites.bug_table(kimage)
    assert bugs and all(b.file.endswith((".c", ".h")) and b.line > 0 for b in bugs)
    assert any(b.flags & 1 for b in bugs) and any(not b.flags & 1 for b in bugs)  # WARN and BUG


def test_kprobe_blacklist(image, kimage):
    data, elf, ks, _ = image
    bl = sites.kprobe_blacklist(kimage)
    names = {n for _, _, n in bl}
    # NOKPROBE_SYMBOL(kprobe_int3_handler) in arch/x86/kernel/kprobes/core.c; exc_int3 is
    # noinstr; entry_SYSCALL_64 is entry text.
    assert {"kprobe_int3_handler", "exc_int3", "entry_SYSCALL_64"} <= names
    start = ks.address("kprobe_int3_handler")
    (s, e) = next((s, e) for s, e, n in bl if n == "kprobe_int3_handler")
    assert s == start and e == kimage.function_at(start).end
    assert "do_sys_openat2" not in names


def test_system_map_stub(kernel):
    m = sysmap.read_system_map(str(kernel.system_map))
    assert m.stub and len(m) == 0 and "dbg" in m.stub_text
    with pytest.raises(KprewriteError) as e:
        m.require_symbols()
    assert len(str(e.value).splitlines()) == 1 and str(kernel.system_map) in str(e.value)


def test_system_map_round_trip_and_errors(image, tmp_path):
    data, elf, ks, _ = image
    lines = [f"{s.addr:016x} {s.type} {s.name}" for s in ks.symbols]
    p = tmp_path / "System.map"
    p.write_text("\n".join(lines) + "\n")
    m = sysmap.read_system_map(str(p)).require_symbols()
    assert not m.stub and m.symbols == ks.symbols
    assert m.address("do_sys_openat2") == ks.address("do_sys_openat2")
    lines[1234] = "ffffffff81000000 T"          # no name
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(KprewriteError) as e:
        sysmap.read_system_map(str(p))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.startswith(f"{p}:1235:")
    with pytest.raises(KprewriteError) as e:
        sysmap.read_system_map(str(tmp_path / "missing.map"))
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("cut", [4096, 20 << 20])
def test_truncated_vmlinux(image, tmp_path, cut):
    data = image[0][:cut]
    with pytest.raises(KprewriteError) as e:
        kallsyms.read_kallsyms(data, "vmlinux.cut")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.startswith("vmlinux.cut: truncated ELF")


def test_no_kallsyms_tables(image):
    data = bytearray(image[0])
    elf = image[1]
    ro = elf.section(".rodata")
    digits = b"0\x001\x002\x003\x004\x005\x006\x007\x008\x009\x00"
    p = data.find(digits, ro.offset)
    while p >= 0:
        data[p:p + len(digits)] = bytes(len(digits))
        p = data.find(digits, p)
    with pytest.raises(KprewriteError) as e:
        kallsyms.read_kallsyms(bytes(data), "vmlinux.nosyms")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "no kallsyms tables" in msg and "--system-map" in msg


def _relayout(image, order: str) -> bytes:
    """The image with its 6.1 kallsyms tables rewritten in place in a later kernel's order
    (from scripts/kallsyms.c: 6.2 added kallsyms_seqs_of_names before the token table; 6.4
    moved num_syms/names/markers/tokens first, then offsets, relative_base, seqs)."""
    data, elf, ks, _ = image
    t = ks.tables
    ro = elf.section(".rodata")

    def off(va):
        return va - ro.addr + ro.offset

    def pad8(b):
        return b + bytes(-len(b) % 8)

    n = len(ks)
    offsets = pad8(data[off(t.offsets):off(t.offsets) + 4 * n])
    base = struct.pack("<Q", t.relative_base)
    num = struct.pack("<II", n, 0)
    names = data[off(t.names):off(t.markers)]
    markers = data[off(t.markers):off(t.token_table)]
    tokens = data[off(t.token_table):off(t.token_index)]
    index = data[off(t.token_index):off(t.token_index) + 512]
    by_name = sorted(range(n), key=lambda i: ks.symbols[i].name)
    seqs = pad8(b"".join(i.to_bytes(3, "big") for i in by_name))
    if order == "6.2":
        blob = offsets + base + num + names + markers + seqs + tokens + index
        start = off(t.offsets) - len(seqs)
    else:
        blob = num + names + markers + tokens + index + offsets + base + seqs
        start = off(t.offsets)
    out = bytearray(data)
    out[start:start + len(blob)] = blob
    return bytes(out)


@pytest.mark.parametrize("order, layout", [("6.2", "offsets-first (<= 6.3)"),
                                           ("6.4", "names-first (>= 6.4)")])
def test_later_kallsyms_layouts(image, order, layout):
    ks = kallsyms.read_kallsyms(_relayout(image, order), f"vmlinux-{order}-layout")
    assert ks.tables.layout == layout
    assert ks.symbols == image[2].symbols

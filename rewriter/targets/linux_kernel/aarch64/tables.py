"""The arm64 kernel's tables of relative entries, found in an Image whose kallsyms lacks their
bounds (KALLSYMS_ALL off: no ``__start___ex_table`` ...).  Each is found as the longest run
of well-formed entries in the part of the image where the linker script puts it, a run
allowed to step over single entries whose instruction lies where the check does not look:

=====================  =====================================  ==========================================
table                  where (6.1, arch/arm64/kernel/vmlinux.lds.S)  an entry is well-formed when
=====================  =====================================  ==========================================
__ex_table             rodata (EXCEPTION_TABLE)               12 bytes: s32 insn, s32 fixup, s16 type,
                                                              s16 data; insn and fixup in the text,
                                                              type 1..15
__jump_table           rodata, ro_after_init (JUMP_TABLE_DATA)  16 bytes: s32 code, s32 target, s64 key;
                                                              code holds a NOP or a B, both in the code
__bug_table            data (BUG_TABLE)                       12 bytes: s32 bug_addr, s32 file, u16 line,
                                                              u16 flags; bug_addr holds brk #0x800
.altinstructions       after the init text                    12 bytes: s32 orig, s32 alt, u16 cpufeature,
                                                              u8 orig_len, u8 alt_len; orig_len a multiple
                                                              of 4 and alt_len equal to it (0 for a
                                                              callback, cpufeature bit 15)
=====================  =====================================  ==========================================

The code: [_stext, _etext) and [_sinittext, the relocation table) (the init and exit text, the
alternatives' replacements)."""
from __future__ import annotations

import struct

NOP = 0xD503201F
BRK_BUG = struct.pack("<I", 0xD4210000)
# A table shorter than this is not believed (Debian's 6.1: 778, 6,429, 7,375 and 27,678 entries).
MIN_ENTRIES = 64


def _runs(body: bytes, base: int, lo: int, hi: int, size: int, fmt: str, ok, align: int = 4):
    """The longest run of entries ok(entry address, fields) in [lo, hi) (addresses), over
    every phase; a single bad entry between two good ones is stepped over."""
    best = (0, 0, 0)
    for phase in range(0, size, align):
        start = lo + phase
        n = (hi - start) // size
        if n <= 0:
            continue
        o = start - base
        good = [ok(start + size * k, f) for k, f in enumerate(struct.iter_unpack(fmt, body[o:o + n * size]))]
        k = 0
        while k < n:
            if not good[k]:
                k += 1
                continue
            j = k
            while j + 1 < n and (good[j + 1] or (j + 2 < n and good[j + 2])):
                j += 1
            count = j - k + 1
            if count > best[0]:
                best = (count, start + size * k, start + size * (j + 1))
            k = j + 1
    return (best[1], best[2]) if best[0] >= MIN_ENTRIES else None


def find(img, body: bytes) -> dict[str, tuple[int, int]]:
    """{table: [start, end)} of those found; body: the Image's bytes, relocations applied."""
    T, s = img.text, img.syms
    st, et, si, ei = s["_stext"], s["_etext"], s["_sinittext"], s["_einittext"]
    rela_lo, rela_hi = T + img.rela_span[0], T + img.rela_span[1]
    end = T + len(body)

    def code(a):
        return (st <= a < et or si <= a < rela_lo) and not a & 3

    def word(a):
        return struct.unpack_from("<I", body, a - T)[0]

    out = {}

    def ex_ok(e, f):
        insn, fixup, typ, _ = f
        return code(e + insn) and code(e + 4 + fixup) and 0 < typ < 16

    r = _runs(body, T, et, si, 12, "<iihh", ex_ok)
    if r:
        out["__ex_table"] = r

    def jump_ok(e, f):
        c, t, _ = f
        a = e + c
        if not (code(a) and code(e + 4 + t)):
            return False
        w = word(a)
        return w == NOP or w >> 26 == 0b000101

    r = _runs(body, T, et, si, 16, "<iiq", jump_ok, align=8)
    if r:
        out["__jump_table"] = r

    def bug_ok(e, f):
        a = e + f[0]
        return code(a) and body[a - T:a - T + 4] == BRK_BUG

    r = _runs(body, T, rela_hi, end - 12, 12, "<iiHH", bug_ok)
    if r:
        out["__bug_table"] = r

    def alt_ok(e, f):
        orig, alt, feat, olen, alen = f
        o, a = e + orig, e + 4 + alt
        if not (T <= o < rela_lo and not o & 3 and olen and not olen & 3 and olen <= 128):
            return False
        if feat & 0x8000:               # ALTERNATIVE_CB: the callback patches the site
            return alen == 0 and code(a)
        return alen == olen and T <= a < rela_lo
    r = _runs(body, T, ei, rela_lo, 12, "<iiHBB", alt_ok)
    if r:
        out[".altinstructions"] = r
    return out

"""CFA rules: what .eh_frame's call frame programs say the CFA is at an instruction."""
from __future__ import annotations

import bisect
import io
import struct

from .encoding import _Malformed, _raw, _sleb, _uleb

UNDEFINED, SAME_VALUE, OFFSET, VAL_OFFSET, REGISTER, EXPRESSION, VAL_EXPRESSION = (
    "UNDEFINED", "SAME_VALUE", "OFFSET", "VAL_OFFSET", "REGISTER", "EXPRESSION", "VAL_EXPRESSION")


class _Unsupported(Exception):
    """Something the fast reader leaves to pyelftools (which reads it, or fails on it)."""


class _Undecodable(Exception):
    """A call frame program pyelftools parses but cannot decode: that FDE has no rows."""


class CfaRules:
    """The CFA rule of each instruction, from .eh_frame's call frame programs,
    read once, and only when asked.

    What it is for: a jump does not move the stack pointer, and a compiler's
    asynchronous unwind tables give every instruction one CFA rule, so a jump
    from an instruction whose CFA is the stack pointer + a (x86-64: ``%rsp + a``)
    can only land on one whose CFA is the stack pointer + a too
    (optprobe.can_optimize(): targets of an indirect jump that cannot be bounded).

    The programs are read as pyelftools (0.33) reads and decodes them, quirks
    included: the same FDEs, the same rows, the same images with no rule at all
    (pyelftools fails on the whole section).  Its construct-based parser takes
    some 6 s for libpython's 6,000 FDEs on a loaded 2-core machine, so this
    module reads the common shapes itself (32-bit records, CIE versions 1 and 3,
    augmentations of z, R, L, P, S, little-endian ELF64) and hands anything
    else to pyelftools."""

    def __init__(self, data: bytes):
        self.data = data
        self._fdes = None      # sorted [(start, end, FDE)]: a _FastFde, or pyelftools' FDE
        self._rows: dict[int, list] = {}
        self._found: dict[int, tuple | None] = {}     # addr -> _row()

    def _load(self):
        plain = _plain_eh_frame(self.data)
        if plain is not None:     # the common case, read without importing pyelftools
            try:
                fdes = _read(*plain)
            except (_Unsupported, _Malformed, struct.error, IndexError):
                fdes = None
            if fdes is not None:
                fdes.sort(key=lambda t: t[0])
                self._fdes = fdes
                self._starts = [f[0] for f in fdes]
                return
        from elftools.elf.elffile import ELFFile
        try:
            dwarf = ELFFile(io.BytesIO(self.data)).get_dwarf_info()
            sec = dwarf.eh_frame_sec if dwarf.has_EH_CFI() else None
        except Exception:            # malformed CFI: no rule known, nothing is proven by it
            dwarf, sec = None, None
        fdes = None
        if sec is not None and dwarf.config.little_endian and dwarf.config.default_address_size == 8:
            try:
                fdes = _read(sec.stream.getvalue()[:sec.size], sec.address)
            except (_Unsupported, _Malformed, struct.error, IndexError):
                fdes = None
        if fdes is None:
            fdes = _read_slow(dwarf, sec)
        fdes.sort(key=lambda t: t[0])
        self._fdes = fdes
        self._starts = [f[0] for f in fdes]

    def at(self, addr: int) -> tuple[int, int] | None:
        """(register, offset) of the CFA rule at addr, None where no FDE covers
        it or the rule is an expression."""
        if self._fdes is None:
            self._load()
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr >= self._fdes[i][1]:
            return None
        row = self._row(i, addr)
        rule = row[1] if row else None
        if rule is None or rule[2] is not None or rule[0] is None:
            return None
        return rule[0], rule[1]

    def return_address(self, addr: int) -> int | None:
        """Where the return address is at addr: its offset from the CFA (the
        FDE's rule for the CIE's return-address column, DW_CFA_offset), None
        where no FDE covers addr or the rule is not an offset from the CFA."""
        if self._fdes is None:
            self._load()
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr >= self._fdes[i][1]:
            return None
        row = self._row(i, addr)
        rule = row[2] if row else None
        if rule is None or rule[0] != OFFSET:
            return None
        return rule[1]

    def _row(self, i: int, addr: int):
        """(pc, CFA rule, return-address rule) of the row in force at addr, of the i-th FDE.
        A CFA rule is (register, offset, expression), a register rule (type, argument).
        Each address's answer is kept (the planner and the emitter ask about each
        probe's several times); a plain FDE not decoded whole yet is decoded only up
        to addr (_FastFde.rows(upto))."""
        found = self._found.get(addr, self)
        if found is not self:
            return found
        lo, _, fde = self._fdes[i]
        rows = self._rows.get(lo)
        if rows is None and isinstance(fde, _FastFde) and fde.plain:
            try:
                rows = fde.rows(addr)
            except Exception:
                rows = None
        if rows is None:
            try:
                rows = fde.rows() if isinstance(fde, _FastFde) else _slow_rows(fde)
            except Exception:
                rows = []
            self._rows[lo] = rows
        found = None
        for row in rows:
            if row[0] > addr:
                break
            found = row
        self._found[addr] = found
        return found


# --- pyelftools: anything the fast reader does not take -----------------------------
def _plain_eh_frame(data: bytes):
    """(.eh_frame's bytes, its address) where pyelftools would find the same and no
    more (section headers read cleanly, an uncompressed .eh_frame, no DWARF
    section whose reading could fail first); else None, and pyelftools reads it."""
    from ..view import SHT_NOBITS, ElfView
    try:
        view = ElfView(data)
        secs = view.sections
    except Exception:
        return None
    if any(s.name.startswith((".debug", ".zdebug")) for s in secs):
        return None
    found = [s for s in secs if s.name == ".eh_frame"]
    sec = found[0] if len(found) == 1 else None     # pyelftools takes the last of several
    if sec is None or sec.type == SHT_NOBITS or sec.flags & 0x800:          # SHF_COMPRESSED
        return None
    return data[sec.offset:sec.offset + sec.size], sec.addr


def _read_slow(dwarf, sec) -> list:
    from elftools.dwarf.callframe import FDE
    try:
        entries = dwarf.EH_CFI_entries() if sec is not None else []
    except Exception:            # malformed CFI: no rule known, nothing is proven by it
        entries = []
    fdes = []
    for e in entries:
        if isinstance(e, FDE):
            lo = e.header["initial_location"]
            fdes.append((lo, lo + e.header["address_range"], e))
    return fdes


def _slow_rows(fde) -> list:
    ra = fde.cie.header["return_address_register"]
    out = []
    for r in fde.get_decoded().table:
        c = r["cfa"]
        rule = r.get(ra)
        out.append((r["pc"], (c.reg, c.offset, c.expr), None if rule is None else (rule.type, rule.arg)))
    return out


# --- the fast reader ---------------------------------------------------------------
_U8, _U16, _U32, _U64 = struct.Struct("<B"), struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<Q")
# A value in a pointer encoding's basic format: encoding._raw() (absptr is 8 bytes; an
# unknown format raises _Malformed, which sends the section to pyelftools, as any other).
_enc = _raw


class _Cie:
    __slots__ = ("caf", "daf", "ra", "fenc", "lenc", "d", "ins", "end", "_last")

    def last_line(self):
        """The CIE's decoded table's last line (pyelftools' last_line_in_CIE), or None;
        raises, for each FDE, where the CIE's program does not decode."""
        if not hasattr(self, "_last"):
            try:
                table = _decode(self, self.d, self.ins, self.end, 0, None, True)
                self._last = (table[-1] if table else None, None)
            except Exception as e:
                self._last = (None, e)
        if self._last[1] is not None:
            raise self._last[1]
        return self._last[0]


class _FastFde:
    __slots__ = ("cie", "start", "ins", "end", "plain")

    def __init__(self, cie, start, ins, end, plain=False):
        self.cie, self.start, self.ins, self.end = cie, start, ins, end
        self.plain = plain           # _check(): its decoding cannot fail

    def rows(self, upto: int | None = None) -> list:
        """Its rows; with upto, of a plain program, only those up to the first row
        past upto (CfaRules._row() stops there: the rows a function's entry needs
        are the first few)."""
        cie = self.cie
        return _decode(cie, cie.d, self.ins, self.end, self.start, cie.last_line(), False, cie.ra,
                       upto if self.plain else None)


def _read(d: bytes, address: int) -> list:
    """[(start, end, _FastFde)] of every FDE, in section order, as pyelftools reads them;
    _Unsupported where its reading may differ (then pyelftools reads it)."""
    cies: dict[int, _Cie] = {}
    out = []
    size = len(d)
    p = 0
    while p < size:
        length = _U32.unpack_from(d, p)[0]
        if length == 0:              # a zero terminator: pyelftools reads on past it
            p += 4
            continue
        if length == 0xFFFFFFFF:
            raise _Unsupported("64-bit record")
        end = p + 4 + length
        if end > size or length < 4:
            raise _Unsupported("record past the section")
        cie_id = _U32.unpack_from(d, p + 4)[0]
        if cie_id == 0:
            if p not in cies:
                cies[p] = _cie(d, p, end)
        else:
            cp = p + 4 - cie_id
            cie = cies.get(cp)
            if cie is None:
                if cp < 0 or cp + 8 > size or _U32.unpack_from(d, cp + 4)[0] != 0:
                    raise _Unsupported("CIE pointer")
                clen = _U32.unpack_from(d, cp)[0]
                if clen in (0, 0xFFFFFFFF) or cp + 4 + clen > size:
                    raise _Unsupported("CIE pointer")
                cie = cies[cp] = _cie(d, cp, cp + 4 + clen)
            if cie.fenc is None:
                raise _Unsupported("no FDE encoding")
            q = p + 8
            basic, mod = cie.fenc & 0x0F, cie.fenc & 0xF0
            lo, q = _enc(d, q, basic)
            rng, q = _enc(d, q, basic)
            if mod == 0x10:
                lo += address + p + 8
            elif mod != 0:
                raise _Unsupported("FDE encoding")
            alen, q = _uleb(d, q)    # augmentation data, always read for .eh_frame
            if cie.lenc is not None:
                if cie.lenc & 0xF0 not in (0, 0x10):
                    raise _Unsupported("LSDA encoding")
                _enc(d, q, cie.lenc & 0x0F)
            q += alen
            if q > end:
                raise _Unsupported("FDE past its length")
            plain = _check(d, q, end)
            out.append((lo, lo + rng, _FastFde(cie, lo, q, end, plain)))
        p = end
    return out


def _cie(d: bytes, p: int, end: int) -> _Cie:
    version = d[p + 8]
    if version not in (1, 3):
        raise _Unsupported(f"CIE version {version}")
    z = d.find(b"\0", p + 9, end)
    if z < 0:
        raise _Unsupported("augmentation string")
    aug = d[p + 9:z]
    if not aug.startswith(b"z") or any(c not in b"zRLPS" for c in aug):
        raise _Unsupported("augmentation")
    c = _Cie()
    q = z + 1
    c.caf, q = _uleb(d, q)
    c.daf, q = _sleb(d, q)
    if version == 1:
        c.ra = d[q]
        q += 1
    else:
        c.ra, q = _uleb(d, q)
    alen, q = _uleb(d, q)
    a, aend = q, q + alen
    c.fenc = c.lenc = None
    for ch in aug[1:]:
        if ch == 0x52:               # 'R'
            c.fenc = d[a]
            a += 1
        elif ch == 0x4C:             # 'L'
            c.lenc = d[a]
            a += 1
            if c.lenc == 0xFF:       # DW_EH_PE_omit
                c.lenc = None
        elif ch == 0x50:             # 'P'
            penc = d[a]
            _, a = _enc(d, a + 1, penc & 0x0F)
    if aend > end:
        raise _Unsupported("CIE past its length")
    c.d, c.ins, c.end = d, aend, end
    _check(d, aend, end)
    return c


# Operand shapes of the extended opcodes, as pyelftools' _parse_instructions reads them:
# u uleb128, s sleb128, b a block (uleb128 length), 1/2/4/8 fixed unsigned sizes.
_ARGS = {0x00: "", 0x01: "8", 0x02: "1", 0x03: "2", 0x04: "4", 0x05: "uu", 0x06: "u", 0x07: "u",
         0x08: "u", 0x09: "uu", 0x0A: "", 0x0B: "", 0x0C: "uu", 0x0D: "u", 0x0E: "u", 0x0F: "b",
         0x10: "ub", 0x11: "us", 0x12: "us", 0x13: "s", 0x14: "uu", 0x15: "us", 0x16: "ub",
         0x2D: "", 0x2E: "u"}
_FIX = {"1": _U8, "2": _U16, "4": _U32, "8": _U64}


def _args(d: bytes, q: int, shape: str) -> tuple[list, int]:
    out = []
    for k in shape:
        if k == "u":
            v, q = _uleb(d, q)
        elif k == "s":
            v, q = _sleb(d, q)
        elif k == "b":
            n, q = _uleb(d, q)
            v = list(d[q:q + n])
            if q + n > len(d):
                raise IndexError("block")
            q += n
        else:
            s = _FIX[k]
            v = s.unpack_from(d, q)[0]
            q += s.size
        out.append(v)
    return out, q


def _skip_leb(d: bytes, q: int) -> int:
    """Past the LEB128 at d[q], failing where encoding._uleb()/_sleb() fail (IndexError
    past the data, _Malformed after 11 bytes that all continue)."""
    for p in range(q, q + 11):
        if d[p] < 0x80:
            return p + 1
    raise _Malformed("over-long LEB128")


# _ARGS with each fixed size as its byte count.
_SKIP = {op: tuple(_FIX[k].size if k in _FIX else k for k in shape) for op, shape in _ARGS.items()}


def _check(d: bytes, q: int, end: int) -> bool:
    """Parse a call frame program as pyelftools does (an unknown opcode fails the
    whole section there): _Unsupported where it would fail.  Every program of the
    section is parsed before any is decoded, so this only skips operands (_args()'s
    reading, without the values).  Returns whether _decode() cannot fail on it
    (no restore, no GNU_args_size, no restore_state without a remembered state):
    then its rows up to an address are those of the whole program (_FastFde.rows())."""
    size = len(d)
    plain, depth = True, 0
    while q < end:
        op = d[q]
        q += 1
        if op & 0xC0:
            if op & 0xC0 == 0x80:        # offset: a uleb128
                q = q + 1 if d[q] < 0x80 else _skip_leb(d, q)
            elif op & 0xC0 == 0xC0:      # restore
                plain = False
            continue
        shape = _SKIP.get(op)
        if shape is None:
            raise _Unsupported(f"opcode {op:#x}")
        if op == 0x0A:
            depth += 1
        elif op == 0x0B:
            plain, depth = plain and depth > 0, depth - 1
        elif op in (0x06, 0x2E):
            plain = False
        for k in shape:
            if k == "b":
                n, q = _uleb(d, q)
                q += n
                if q > size:
                    raise IndexError("block")
            elif k.__class__ is int:
                q += k
                if q > size:
                    raise IndexError("fixed-size operand")
            else:
                q = q + 1 if d[q] < 0x80 else _skip_leb(d, q)
    if q > end:                      # pyelftools reads an instruction's operands past the record
        raise _Unsupported("program past its record")
    return plain


def _decode(cie: _Cie, d: bytes, q: int, end: int, pc: int, last, is_cie: bool, ra: int | None = None,
            upto: int | None = None) -> list:
    """pyelftools' _decode_CFI_table: lines (pc, CFA rule, {register: rule}); the
    CIE's last line starts an FDE's.  _Undecodable where it raises.  With ra, a
    line holds that register's rule alone, not a copy of them all (what rows() keeps);
    with upto, the lines end with the first one past upto."""
    if last is not None:
        cfa, regs = last[1], dict(last[2])
    else:
        cfa, regs = (None, 0, None), {}
    caf, daf = cie.caf, cie.daf
    table = []
    stack = []
    while q < end:
        op = d[q]
        q += 1
        hi = op & 0xC0
        if hi == 0x40:               # advance_loc
            table.append((pc, cfa, dict(regs) if ra is None else regs.get(ra)))
            if upto is not None and pc > upto:
                return table
            pc += (op & 0x3F) * caf
            continue
        if hi == 0x80:               # offset
            v, q = _uleb(d, q)
            regs[op & 0x3F] = (OFFSET, v * daf)
            continue
        if hi == 0xC0:               # restore
            _restore(regs, op & 0x3F, last, is_cie)
            continue
        a, q = _args(d, q, _ARGS[op])
        if op in (0x01, 0x02, 0x03, 0x04):  # set_loc, advance_loc1/2/4
            table.append((pc, cfa, dict(regs) if ra is None else regs.get(ra)))
            if upto is not None and pc > upto:
                return table
            pc = a[0] if op == 0x01 else pc + a[0] * caf
        elif op == 0x0C:
            cfa = (a[0], a[1], None)
        elif op == 0x12:             # def_cfa_sf: pyelftools scales by the code alignment factor
            cfa = (a[0], a[1] * caf, None)
        elif op == 0x0D:
            cfa = (a[0], cfa[1], None)
        elif op == 0x0E:
            cfa = (cfa[0], a[0], None)
        elif op == 0x13:
            cfa = (cfa[0], a[0] * daf, None)
        elif op == 0x0F:
            cfa = (None, None, a[0])
        elif op == 0x07:
            regs[a[0]] = (UNDEFINED, None)
        elif op == 0x08:
            regs[a[0]] = (SAME_VALUE, None)
        elif op in (0x05, 0x11):
            regs[a[0]] = (OFFSET, a[1] * daf)
        elif op in (0x14, 0x15):
            regs[a[0]] = (VAL_OFFSET, a[1] * daf)
        elif op == 0x09:
            regs[a[0]] = (REGISTER, a[1])
        elif op == 0x10:
            regs[a[0]] = (EXPRESSION, a[1])
        elif op == 0x16:
            regs[a[0]] = (VAL_EXPRESSION, a[1])
        elif op == 0x06:
            _restore(regs, a[0], last, is_cie)
        elif op == 0x0A:
            stack.append((cfa, dict(regs)))
        elif op == 0x0B:
            if not stack:
                raise _Undecodable("restore_state with no state")
            cfa, regs = stack.pop()
        elif op in (0x00, 0x2D):
            pass
        else:                        # GNU_args_size: parsed, not decoded
            raise _Undecodable(f"opcode {op:#x}")
    if cfa[0] is not None or regs:
        table.append((pc, cfa, regs if ra is None else regs.get(ra)))
    return table


def _restore(regs: dict, reg: int, last, is_cie: bool) -> None:
    if is_cie or last is None:
        raise _Undecodable("restore outside an FDE")
    if reg in last[2]:
        regs[reg] = last[2][reg]
    else:
        regs.pop(reg, None)

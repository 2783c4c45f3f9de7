"""CFA rules from .debug_frame, for a frame base of DW_OP_call_frame_cfa where the image
has no .eh_frame (a kernel)."""
from __future__ import annotations

import bisect
import struct

class DebugFrame:
    """CFA rules from .debug_frame (a kernel has no .eh_frame): the records' address
    ranges are indexed with struct, and only the FDE covering an address is decoded,
    by pyelftools (the whole section of a kernel is 50,000 FDEs)."""

    def __init__(self, dwarf):
        self.dwarf = dwarf
        self.sec = dwarf.debug_frame_sec
        self._index = None
        self._rows: dict[int, list] = {}

    def _scan(self):
        d = self.sec.stream.getvalue()[:self.sec.size]
        out, p, n = [], 0, len(d)
        while p + 4 <= n:
            length, = struct.unpack_from("<I", d, p)
            if length == 0xFFFFFFFF:                  # 64-bit DWARF
                length, = struct.unpack_from("<Q", d, p + 4)
                hdr, cie, idw = 12, 0xFFFFFFFFFFFFFFFF, "<Q"
            else:
                hdr, cie, idw = 4, 0xFFFFFFFF, "<I"
            if length == 0:
                p += hdr
                continue
            body = p + hdr
            ident, = struct.unpack_from(idw, d, body)
            if ident != cie:
                at = body + struct.calcsize(idw)
                lo, size = struct.unpack_from("<QQ", d, at)
                if size:
                    out.append((lo, lo + size, p))
            p = body + length
        out.sort()
        self._index = out
        self._starts = [o[0] for o in out]

    def at(self, addr: int) -> tuple[int, int] | None:
        """(register, offset) of the CFA rule at addr, None where no FDE covers it or the
        rule is an expression (as CfaRules.at())."""
        if self._index is None:
            self._scan()
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr >= self._index[i][1]:
            return None
        lo, _, off = self._index[i]
        rows = self._rows.get(off)
        if rows is None:
            from elftools.dwarf.callframe import CallFrameInfo
            cfi = CallFrameInfo(self.sec.stream, self.sec.size, self.sec.address, self.dwarf.structs,
                                for_eh_frame=False)
            try:
                rows = [(r["pc"], r.get("cfa")) for r in cfi._parse_entry_at(off).get_decoded().table]
            except Exception:          # a program pyelftools cannot decode: no rule known
                rows = []
            self._rows[off] = rows
        rule = None
        for pc, cfa in rows:
            if pc > addr:
                break
            rule = cfa
        if rule is None or rule.expr is not None or rule.reg is None:
            return None
        return rule.reg, rule.offset

"""CFA rules: what .eh_frame's call frame programs say the CFA is at an instruction."""
from __future__ import annotations

import bisect
import io


class CfaRules:
    """The CFA rule of each instruction, from .eh_frame's call frame programs
    (pyelftools decodes them; read once, and only when asked: decoding
    libpython's 5,000 FDEs takes about a second).

    What it is for: a jump does not move the stack pointer, and a compiler's
    asynchronous unwind tables give every instruction one CFA rule, so a jump
    from an instruction whose CFA is the stack pointer + a (x86-64: ``%rsp + a``)
    can only land on one whose CFA is the stack pointer + a too
    (optprobe.can_optimize(): targets of an indirect jump that cannot be bounded)."""

    def __init__(self, data: bytes):
        self.data = data
        self._fdes = None      # sorted [(start, end, FDE)]
        self._rows: dict[int, list] = {}

    def _load(self):
        from elftools.dwarf.callframe import FDE
        from elftools.elf.elffile import ELFFile
        try:
            dwarf = ELFFile(io.BytesIO(self.data)).get_dwarf_info()
            entries = dwarf.EH_CFI_entries() if dwarf.has_EH_CFI() else []
        except Exception:            # malformed CFI: no rule known, nothing is proven by it
            entries = []
        fdes = []
        for e in entries:
            if isinstance(e, FDE):
                lo = e.header["initial_location"]
                fdes.append((lo, lo + e.header["address_range"], e))
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
        if rule is None or rule.expr is not None or rule.reg is None:
            return None
        return rule.reg, rule.offset

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
        if rule is None or rule.type != "OFFSET":
            return None
        return rule.arg

    def _row(self, i: int, addr: int):
        """(pc, CFA rule, return-address rule) of the row in force at addr, of the i-th FDE."""
        lo, _, fde = self._fdes[i]
        rows = self._rows.get(lo)
        if rows is None:
            try:
                ra = fde.cie.header["return_address_register"]
                rows = [(r["pc"], r["cfa"], r.get(ra)) for r in fde.get_decoded().table]
            except Exception:
                rows = []
            self._rows[lo] = rows
        found = None
        for row in rows:
            if row[0] > addr:
                break
            found = row
        return found

"""The x86-64 Capstone decoders, one of each kind for the whole back end:
LITE for boundaries and mnemonics (disasm_lite), DETAIL for operands and
register/flag access.  records() is LITE's cs_disasm() without a Python tuple
per instruction, for decode.py's sweep over whole images."""
import ctypes

import capstone

LITE = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
LITE.detail = False
LITE.skipdata = False

DETAIL = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
DETAIL.detail = True


def _layout():
    """(record size, offset of size, mnemonic, op_str) of the binding's cs_insn, or
    None when the binding does not expose it as capstone 5's does (then records() is
    unavailable and decode.py iterates disasm_lite()).  None too for a diet engine: its
    records hold no mnemonic (read as none, every branch and exit would be missed), and
    disasm_lite() says so (CS_ERR_DIET)."""
    try:
        insn = capstone._cs_insn
        if not (hasattr(capstone, "_cs") and hasattr(LITE, "csh")) or getattr(LITE, "diet", True):
            return None
        size, mnem, ops = insn.size, insn.mnemonic, insn.op_str
        rec = ctypes.sizeof(insn)
        if size.size != 2 or size.offset % 2 or rec % 2 or mnem.size < 2 or ops.size < 2:
            return None
        return rec, size.offset, mnem.offset, mnem.size, ops.offset, ops.size
    except (AttributeError, TypeError):
        return None


LAYOUT = _layout()


def records(code: bytes, start: int) -> tuple[int, bytes]:
    """(count, the raw cs_insn records) of LITE decoding `code` at `start` until the
    first byte it cannot decode: what disasm_lite() yields, as one bytes object read
    with LAYOUT's offsets (copied before cs_free())."""
    if not isinstance(code, bytes):     # the binding's argument type takes bytes only
        code = bytes(code)              # (disasm_lite() takes a bytearray, a memoryview too)
    p = ctypes.POINTER(capstone._cs_insn)()
    n = capstone._cs.cs_disasm(LITE.csh, code, len(code), start, 0, ctypes.byref(p))
    if n <= 0:
        status = capstone._cs.cs_errno(LITE.csh)
        if status != capstone.CS_ERR_OK:
            raise capstone.CsError(status)
        return 0, b""
    try:
        return n, ctypes.string_at(p, n * LAYOUT[0])
    finally:
        capstone._cs.cs_free(p, n)

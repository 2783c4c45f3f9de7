"""The x86-64 Capstone decoders, one of each kind for the whole back end:
LITE for boundaries and mnemonics (disasm_lite), DETAIL for operands and
register/flag access.  records() is LITE's cs_disasm() without a Python tuple
per instruction, record_chunks() the same a bounded run at a time, for decode.py's
sweep over whole images; length() one
instruction's size, for insn.py's classification.  The raw Capstone calls are here."""
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
        if size.size != 2 or size.offset % 2 or rec % 2 or mnem.size < 3 or ops.size < 2:
            return None
        return rec, size.offset, mnem.offset, mnem.size, ops.offset, ops.size
    except (AttributeError, TypeError):
        return None


LAYOUT = _layout()


def _disasm(cs, code, start: int, count: int = 0, size: int | None = None):
    """(count, the cs_insn array to cs_free()) of cs_disasm() with handle `cs` over
    `code` at `start` (at most `count` instructions, 0: all; `size` bytes of code, by
    default all: code may be a ctypes pointer into a longer buffer); (0, None) when
    nothing decodes; CsError for Capstone's errors."""
    if size is None:
        if not isinstance(code, bytes):     # the binding's argument type takes bytes only
            code = bytes(code)              # (disasm_lite() takes a bytearray, a memoryview too)
        size = len(code)
    p = ctypes.POINTER(capstone._cs_insn)()
    n = capstone._cs.cs_disasm(cs.csh, code, size, start, count, ctypes.byref(p))
    if n <= 0:
        status = capstone._cs.cs_errno(cs.csh)
        if status != capstone.CS_ERR_OK:
            raise capstone.CsError(status)
        return 0, None
    return n, p


def records(code: bytes, start: int) -> tuple[int, bytes]:
    """(count, the raw cs_insn records) of LITE decoding `code` at `start` until the
    first byte it cannot decode: what disasm_lite() yields, as one bytes object read
    with LAYOUT's offsets (copied before cs_free())."""
    n, p = _disasm(LITE, code, start)
    if n == 0:
        return 0, b""
    try:
        return n, ctypes.string_at(p, n * LAYOUT[0])
    finally:
        capstone._cs.cs_free(p, n)


def record_chunks(code: bytes, start: int, count: int):
    """records() of `code` at `start`, `count` instructions at a time: (count, records)
    of each run of cs_disasm() until the end of code or the first byte it cannot decode
    (the records of a whole function at once are a fresh mapping each time: paged in)."""
    if not isinstance(code, bytes):
        code = bytes(code)
    n, p = _disasm(LITE, code, start, count)
    if n < count or n == 0:             # all of it in one run (most functions)
        if n == 0:
            return
        try:
            yield n, ctypes.string_at(p, n * LAYOUT[0])
        finally:
            capstone._cs.cs_free(p, n)
        return
    buf = ctypes.create_string_buffer(code, len(code))     # (one copy) to point into
    off = 0
    rec, o_size = LAYOUT[0], LAYOUT[1]
    while True:
        try:
            got = ctypes.string_at(p, n * rec)
        finally:
            capstone._cs.cs_free(p, n)
        yield n, got
        off += sum(memoryview(got).cast("H")[o_size // 2::rec // 2])
        if n < count or off >= len(code):
            return
        at = ctypes.cast(ctypes.addressof(buf) + off, ctypes.POINTER(ctypes.c_char))
        n, p = _disasm(LITE, at, start + off, count, len(code) - off)
        if n == 0:
            return


def _detail_layout():
    """(cs_insn's offset of its detail pointer, how many bytes of a cs_detail hold
    its x86 part up to the last operand, and the offsets detail_records()' readers
    use) of the binding, or None where records() is unavailable."""
    if LAYOUT is None:
        return None
    try:
        from capstone import x86
        insn, det, cx, op, mem = capstone._cs_insn, capstone._cs_detail, x86.CsX86, x86.X86Op, x86.X86OpMem
        arch = det.arch.offset
        ops = arch + cx.operands.offset
        n_ops = cx.operands.size // ctypes.sizeof(op)
        size = ops + n_ops * ctypes.sizeof(op)
        value = op.value.offset
        offs = dict(address=insn.address.offset, detail=insn.detail.offset, regs_write=det.regs_write.offset,
                    regs_write_count=det.regs_write_count.offset, groups=det.groups.offset,
                    groups_count=det.groups_count.offset, op_count=arch + cx.op_count.offset, ops=ops,
                    op_size=ctypes.sizeof(op), op_type=op.type.offset, op_value=value, op_opsize=op.size.offset,
                    op_access=op.access.offset, mem_base=value + mem.base.offset,
                    mem_index=value + mem.index.offset, mem_disp=value + mem.disp.offset)
        ok = (insn.address.size == 8 and insn.detail.size == 8 and det.regs_write.size // 2 >= 1
              and op.type.size == 4 and op.size.size == 1 and op.access.size == 1 and mem.base.size == 4
              and mem.index.size == 4 and mem.disp.size == 8 and LAYOUT[0] % 8 == 0 and size % 8 == 0
              and offs["detail"] % 8 == 0)
        return (size, offs) if ok else None
    except (AttributeError, TypeError, ImportError):
        return None


DETAIL_LAYOUT = _detail_layout()


def detail_records(code: bytes, start: int) -> tuple[int, bytes, bytes]:
    """(count, the raw cs_insn records, and each one's cs_detail up to its last x86
    operand, DETAIL_LAYOUT[0] bytes a record) of DETAIL decoding `code` at `start`
    until the first byte it cannot decode: what DETAIL.disasm() yields, without the
    CsInsn (and its copy of the whole detail) that the binding makes of each."""
    n, p = _disasm(DETAIL, code, start)
    if n == 0:
        return 0, b"", b""
    try:
        rec = LAYOUT[0]
        buf = ctypes.string_at(p, n * rec)
        size, offs = DETAIL_LAYOUT
        ptrs = memoryview(buf).cast("Q")[offs["detail"] // 8::rec // 8]
        string_at = ctypes.string_at
        return n, buf, b"".join([string_at(d, size) for d in ptrs])
    finally:
        capstone._cs.cs_free(p, n)


def _length_decoder():
    """The length of the instruction at the start of code, decoded at address (0 if
    none), through Capstone's cs_disasm_iter() into one cs_insn allocated once: what
    disasm_lite(code, address, 1) yields first, without its allocation, generator and
    strings per call (a rewrite classifies some 15,000 instructions).  disasm_lite()
    itself where the binding does not offer it as capstone 5 does."""
    def lite(code: bytes, address: int) -> int:
        for _addr, n, _mn, _ops in LITE.disasm_lite(code, address, 1):
            return n
        return 0
    try:
        lib, insn_t = capstone._cs, capstone._cs_insn
        if getattr(LITE, "diet", True) or not hasattr(LITE, "csh"):
            return lite
        malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(("cs_malloc", lib))
        step = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p),
                                ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_uint64),
                                ctypes.c_void_p)(("cs_disasm_iter", lib))
        errno = lib.cs_errno
        handle = LITE.csh
        buf = malloc(handle)
        if not buf:
            return lite
        insn = ctypes.cast(buf, ctypes.POINTER(insn_t)).contents
    except (AttributeError, TypeError, ValueError, OSError):
        return lite
    ptr, size, addr = ctypes.c_char_p(), ctypes.c_size_t(), ctypes.c_uint64()
    args = (handle, ctypes.byref(ptr), ctypes.byref(size), ctypes.byref(addr), buf)

    def length(code: bytes, address: int) -> int:
        ptr.value, size.value, addr.value = code, len(code), address
        if step(*args):
            return insn.size
        status = errno(handle)
        if status != capstone.CS_ERR_OK:       # as disasm_lite() raises
            raise capstone.CsError(status)
        return 0
    return length


# The length of the instruction at the start of code (0 if none): LITE's, one at a time.
length = _length_decoder()

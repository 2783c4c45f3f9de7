"""Call-frame information: .eh_frame FDEs and C++ LSDA landing pads.

One module per job: fde.py (finding .eh_frame, CIEs, FDEs), lsda.py (landing
pads), cfa.py (CFA rules: the call frame programs, read as pyelftools reads
them), encoding.py (pointer encodings and LEB128); the ELF headers are read
through rewriter.elf.view.

fde.py parses only the CIE/FDE headers (the CFA programs are cfa.py's, read
when first asked), straight from the file bytes with `struct`, so the whole
.eh_frame of a large library (the 23 MB libpython3.11, ~5,400 FDEs) reads in
about 15 ms.

Finding .eh_frame: by section name; without section headers (sstrip), through
PT_GNU_EH_FRAME -> .eh_frame_hdr's eh_frame_ptr, the walk ending at the last
FDE of the binary-search table, else at the zero terminator.  gcc links
-static executables without --eh-frame-hdr: with their section headers gone
nothing locates .eh_frame any more, and read_fdes returns [].

Records: 32-bit lengths, or 0xffffffff + a 64-bit length (the CIE id / CIE
pointer stays 4 bytes in .eh_frame, as the LSB and LLVM read it); a zero
length ends the section, as in libgcc.  CIE versions 1 and 3, augmentations
"" and "z" + any of P, L, R, S (and AArch64's B, G), ancient "eh".

Addresses are link-time virtual addresses, as written in the file (no load
bias).  Pointer decoding follows libgcc's read_encoded_value_with_base:

* formats absptr, udata2/4/8, sdata2/4/8, uleb128, sleb128;
* applications pcrel (address of the field), datarel (the GOT,
  DT_PLTGOT/_GLOBAL_OFFSET_TABLE_, as the LSB specifies; in .eh_frame_hdr the
  start of .eh_frame_hdr), funcrel (the function start), textrel (start of
  .text), aligned (absptr aligned to 8);
* a raw value of 0 is a null pointer: no base is added (so a pcrel LSDA
  pointer of 0 means "no LSDA");
* DW_EH_PE_indirect: the personality pointer is skipped, never followed; for
  the LSDA pointer and LPStart the pointed-to 8 bytes are read from the file;
* 0xff (DW_EH_PE_omit) means the field is absent.

FDEs whose pc_begin is 0 (discarded link-once code, which libgcc skips too)
and FDEs covering zero bytes are dropped.  Malformed input raises
KprewriteError("<path>: <what>: malformed .eh_frame at 0x<record address>") (or
"... malformed LSDA at ...", "... malformed .eh_frame_hdr at ..."), never
an IndexError.
"""

from __future__ import annotations

from .cfa import CfaRules
from .encoding import _Bases, _ptr  # noqa: F401  (the tests decode pointers directly)
from .fde import Fde, read_fdes
from .lsda import landing_pads

__all__ = ["Fde", "read_fdes", "landing_pads", "CfaRules"]

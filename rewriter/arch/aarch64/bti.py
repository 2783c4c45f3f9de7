"""Branch Target Identification: whether an image's code pages are guarded
(its GNU property note claims BTI), and which instructions are landing pads.

The kernel (and ld.so, for a shared object) maps the executable segments of an
ELF whose NT_GNU_PROPERTY_TYPE_0 note has GNU_PROPERTY_AARCH64_FEATURE_1_BTI
with PROT_BTI: an indirect branch (`br`, `blr`) must land on a compatible
landing pad or the program dies with SIGILL.  A `B` written over a landing pad
breaks every indirect branch to it, so such a site is not jump-optimized; a
`brk` may stand there (BRK is compatible with every PSTATE.BTYPE, so the
breakpoint probe is taken first)."""
from __future__ import annotations

import struct

PT_GNU_PROPERTY = 0x6474E553
NT_GNU_PROPERTY_TYPE_0 = 5
GNU_PROPERTY_AARCH64_FEATURE_1_AND = 0xC0000000
FEATURE_1_BTI = 1
FEATURE_1_PAC = 2

# What an indirect branch may land on (BTI c/j/jc; PACIASP and PACIBSP are
# implicit `bti c` for a `blr` and a `br x16/x17`).
LANDING_PADS = {0xD503245F: "bti c", 0xD503249F: "bti j", 0xD50324DF: "bti jc",
                0xD503233F: "paciasp", 0xD503237F: "pacibsp"}


def features(image) -> int:
    """GNU_PROPERTY_AARCH64_FEATURE_1_AND of the image's property note (0: none)."""
    cached = getattr(image, "_aarch64_features", None)
    if cached is not None:
        return cached
    seg = image.elf.segment(PT_GNU_PROPERTY)
    out = note_features(image.data[seg.offset:seg.offset + seg.filesz]) if seg is not None else 0
    image._aarch64_features = out
    return out


def note_features(note: bytes) -> int:
    """GNU_PROPERTY_AARCH64_FEATURE_1_AND of a GNU property note's bytes (a PT_GNU_PROPERTY
    segment's, or a relocatable object's .note.gnu.property section), 0 if none."""
    out = 0
    if len(note) >= 16:
        namesz, descsz, ntype = struct.unpack_from("<III", note, 0)
        desc = 12 + ((namesz + 3) & ~3)
        if ntype == NT_GNU_PROPERTY_TYPE_0 and note[12:12 + namesz].rstrip(b"\0") == b"GNU":
            end = min(len(note), desc + descsz)
            p = desc
            while p + 8 <= end:
                pr_type, pr_size = struct.unpack_from("<II", note, p)
                if pr_type == GNU_PROPERTY_AARCH64_FEATURE_1_AND and pr_size >= 4 and p + 12 <= end:
                    out = struct.unpack_from("<I", note, p + 8)[0]
                p += 8 + ((pr_size + 7) & ~7)
    return out


def guarded(image) -> bool:
    """The image's code pages are BTI-guarded when it runs."""
    return bool(features(image) & FEATURE_1_BTI)


def landing_pad(word: int) -> str | None:
    """The landing pad `word` is (its name), or None."""
    return LANDING_PADS.get(word)

"""The kernel readers' ELF view: rewriter.elf.view's, under the names they import.

kallsyms and sites read a vmlinux (a file, or the ELF just decompressed from a
bzImage) through it: section and program headers, address-to-file-offset
translation and bounds-checked reads, every malformed input a one-line
KprewriteError naming the file.
"""

from __future__ import annotations

from ...elf.view import (PT_LOAD, SHF_ALLOC, SHF_EXECINSTR, SHT_NOBITS,  # noqa: F401
                         ElfView as _ElfView, Section, Segment)

KERNEL_HALF = 1 << 63


class ElfView(_ElfView):
    """rewriter.elf.view.ElfView, the file named "vmlinux" unless told."""

    def __init__(self, data: bytes, path: str = "vmlinux"):
        super().__init__(data, path)
        self.segments, self.sections        # checked now, as the kernel readers expect  # noqa: B018

    def kernel_segments(self) -> list[Segment]:
        """PT_LOAD segments linked in the kernel's half (not the per-CPU one at 0)."""
        return [s for s in self.loads if s.vaddr >= KERNEL_HALF]

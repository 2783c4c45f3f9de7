/*
 * Included first in every C file of the runtime, tables and handlers on AArch64
 * (rewriter/arch/aarch64/toolchain.py: -include): every declaration hidden,
 * extern ones too.  The blob is linked -pie and relocates itself
 * (kp_relocate()); GNU ld for AArch64 does not relax a GOT load of a symbol it
 * finds local into adrp + add as ld for x86-64 does, so an extern declared
 * with default visibility (the linker script's __kp_rela_start...) would be
 * read from a GOT slot that kp_relocate() has not relocated yet.
 */
#pragma GCC visibility push(hidden)

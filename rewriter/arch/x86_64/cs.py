"""The x86-64 Capstone decoders, one of each kind for the whole back end:
LITE for boundaries and mnemonics (disasm_lite), DETAIL for operands and
register/flag access."""
import capstone

LITE = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
LITE.detail = False
LITE.skipdata = False

DETAIL = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
DETAIL.detail = True

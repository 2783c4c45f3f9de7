"""x86-64: decode, optimizer checks and emission (the arch/x86/kernel/kprobes/ of kprewrite)."""
from . import emit, handler_abi, kprobe_xol, optprobe, retprobe
from .decode import decode_function

name = "x86_64"

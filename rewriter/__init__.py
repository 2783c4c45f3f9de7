"""kprewrite: Linux-style kprobes compiled ahead of time into ELF images."""
__version__ = "0.1.0"

"""`python -m rewriter`: the CLI of this tree (tests run it, not whatever `kprewrite` is on PATH)."""
from .cli import command

command(prog_name="kprewrite")

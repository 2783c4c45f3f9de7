"""The interface every target answers (a module with these members), as
arch.base.Arch is for architectures: what differs between kinds of image.
linux_user/ and linux_kernel/ are the two; a third is a folder beside them
with these members, and one line in targets.for_image()."""
from __future__ import annotations

from typing import Any, Protocol


class Target(Protocol):
    name: str                          # also the runtime's folder: runtime/platform/<name>
    RUNTIME_HANDLERS: frozenset        # handler names the runtime itself defines (boot hooks...)

    # --- reading the image ---
    def load_symbols(self, image, system_map: str | None = None) -> None:
        """Function symbols and bounds beyond the ELF's own (a kernel's kallsyms)."""

    def rules(self, image, arch) -> Any:
        """rules.Rules: the blacklist, reserved ranges, ftrace sites, function refusals."""

    def runtime_probes(self, spec) -> None:
        """Add the probes the runtime needs (a kernel's boot and shutdown hooks)."""

    # --- where new code and data go ---
    def plan_layout(self, image) -> Any:
        """Where the new code starts (rx_vaddr, after_phdrs) and the data (data_vaddr, None: after the code)."""

    def reserve_stubs(self, image, pos: int) -> tuple[dict[str, int], int]:
        """Start-up stubs' addresses from pos, and the position after them."""

    def thread_key(self, image) -> Any:
        """arch.base.ThreadKey: how detours find the running thread (or CPU)."""

    # --- the runtime, handlers and tables ---
    def handler_headers(self, image) -> dict[str, str]:
        """Headers made from the image for the handlers (path -> text): a kernel's types."""

    def link_symbols(self, image) -> dict[str, int | None] | None:
        """The image's symbols the runtime and handlers may use (None: self-contained)."""

    def tables_c(self, image, arch, any_int3: bool) -> str:
        """The target's part of the generated C tables."""

    TABLES_AT_BOOT: bool               # build/tables.py writes compact records the runtime builds from
    RUNTIME_KALLSYMS: bool             # trace events name addresses from the running image's own
                                       # symbols (a kernel's kallsyms), not a table compiled in

    def table_base(self, image) -> int:
        """With TABLES_AT_BOOT: the link address the records' 32-bit offsets count from."""

    def derived_symbol(self, image, addr: int) -> str | None:
        """With TABLES_AT_BOOT: the symbol name the running image gives addr itself, so the
        records leave it out (None: always written)."""

    def address_c(self, image, addr: int) -> str:
        """An address of the image as a C constant in the generated tables: a number, or an
        expression the linker relocates (a kernel moved by KASLR)."""

    # --- the output ---
    def before_link(self, image, arch, layout, plan) -> Any:
        """What write() needs that the linked runtime does not change, started before the
        compiler and linker run (pipeline.build): an object whose result() is read while
        they do (write() gets it as `early`) and whose close() ends what it started (a
        user image's detour unwind programs, in worker processes); None when there is
        nothing."""

    def write(self, image, arch, layout, rx: bytearray, patches, blob, metadata: bytes, plan,
              early=None) -> bytes:
        """The output image's bytes (early: before_link()'s)."""

    def diff_expected(self, image, meta: dict) -> list[tuple[int, int, str]]:
        """Changes `kprewrite diff` may find besides the probe sites: (start, end, why)."""

"""The arch half of kretprobes on AArch64: not implemented yet.

find_exits() names no exit and refuses, so the planner falls back to the
return-address trampoline, whose entry body kret_entry_body() refuses with a
clear error: a kretprobe in an aarch64 image is an error, not a wrong output."""
from __future__ import annotations

from ..base import Exits, Refusal

KRET_ENTRY_USES: tuple[str, ...] = ()
_WHY = "kretprobes are not supported on aarch64 yet"


class NotYet(Exception):
    pass


def _refuse():
    from .emit import EmitError
    raise EmitError(_WHY)


def find_exits(image, analysis, func) -> Exits:
    return Exits([], Refusal("kretprobe", func.start, _WHY), [func])


def exit_region(image, analysis, part, exit, busy):
    return Refusal("kretprobe", exit.addr, _WHY)


def hook_then_exit(exit, hook, at: int) -> bytes:
    _refuse()


def ret_detour(dcr, hook, at: int) -> bytes:
    _refuse()


def hook_copy(hooks):
    _refuse()


def kret_entry_body(*, rp: int, tramp: int, entry_handler: int | None, enter_c: int,
                    aligned: bool, inline: bool = True, regs: bool = False) -> bytes:
    _refuse()


def clean_ret_hook(exit, at: int, *, fast: int, table: int, key, rp: int,
                   handler: int | None, return_c: int, full_hook, aligned: bool, handler_clobbers) -> bytes:
    _refuse()


def full_ret_hook(exit, at: int, *, fast: int, table: int, key, rp: int,
                  handler: int | None, return_c: int, aligned: bool) -> bytes:
    _refuse()

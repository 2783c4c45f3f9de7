"""gdb helper for programs rewritten by kprewrite with breakpoint (int3) probes.

gdb did not plant those int3s, so it stops with "Program received signal
SIGTRAP" at each hit (and after each single-stepped copy).  These commands pass
such SIGTRAPs on to the program, where kprewrite's runtime handles them, and
stop only for what gdb itself asked for (its breakpoints, steps, other signals):

    gdb -x tools/kprewrite-gdb.py --args ./program.kp ...
    (gdb) kp-run            # run, passing kprewrite's SIGTRAPs on
    (gdb) kp-continue       # continue, likewise

Do not put a gdb breakpoint on a probed instruction's own address: gdb would
step over it with our int3 in place (use the next instruction).
"""
import gdb


_last = [None]


def _on_stop(event):
    _last[0] = event


gdb.events.stop.connect(_on_stop)


def _last_stop_was_sigtrap() -> bool:
    """A SIGTRAP stop gdb did not ask for while continuing: not one of its
    breakpoints (BreakpointEvent); gdb reports our traps as plain stops."""
    ev = _last[0]
    if ev is None or isinstance(ev, gdb.BreakpointEvent):
        return False
    if isinstance(ev, gdb.SignalEvent):
        return ev.stop_signal == "SIGTRAP"
    try:
        return int(gdb.parse_and_eval("$_siginfo.si_signo")) == 5
    except gdb.error:
        return False


def _alive() -> bool:
    return any(t.is_valid() for inf in gdb.inferiors() for t in inf.threads())


def _pass_traps():
    while _alive() and _last_stop_was_sigtrap():
        _last[0] = None
        gdb.execute("signal SIGTRAP")


class KpRun(gdb.Command):
    """Run the program, passing kprewrite's SIGTRAPs on to it."""
    def __init__(self):
        super().__init__("kp-run", gdb.COMMAND_RUNNING)

    def invoke(self, arg, from_tty):
        _last[0] = None
        gdb.execute("run " + arg)
        _pass_traps()


class KpContinue(gdb.Command):
    """Continue, passing kprewrite's SIGTRAPs on to the program."""
    def __init__(self):
        super().__init__("kp-continue", gdb.COMMAND_RUNNING)

    def invoke(self, arg, from_tty):
        if _alive() and _last_stop_was_sigtrap():
            _last[0] = None
            gdb.execute("signal SIGTRAP")
        else:
            gdb.execute("continue")
        _pass_traps()


KpRun()
KpContinue()

"""Prints how many fuzz cases ran (harness.COUNTS) at the end of the session."""
from harness import COUNTS


def pytest_terminal_summary(terminalreporter):
    if COUNTS:
        parts = ", ".join(f"{k} {v}" for k, v in sorted(COUNTS.items()))
        terminalreporter.write_line(f"fuzz: {sum(COUNTS.values())} cases run ({parts})")

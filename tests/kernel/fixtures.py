"""Fixtures of the kernel-image tests (imported by tests/conftest.py: a second conftest.py
here would shadow that one's helpers, which test files import as `conftest`): the Debian cloud kernel, busybox initramfs, QEMU boots.

Everything costly is session-scoped: the kernel is fetched and extracted once per version into the
cache (kernel_env.cache_dir()), initramfs images are cached by content, and the boot of the
unmodified kernel that several tests read is made once.  Every boot's time is listed at the end
of the run.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_env  # noqa: E402

BOOTS: list[tuple[str, kernel_env.BootResult]] = []


def _env_fail(e: Exception):
    pytest.fail(f"kernel test environment: {e}", pytrace=False)


@pytest.fixture(scope="session")
def debian_kernel() -> kernel_env.DebianKernel:
    """The current Debian cloud kernel (vmlinuz, vmlinux, relocs, config, System.map stub)."""
    try:
        return kernel_env.obtain_kernel()
    except kernel_env.KernelEnvError as e:
        _env_fail(e)


@pytest.fixture(scope="session")
def arm64_kernel():
    """Debian's current arm64 cloud kernel (arm64_env.Arm64Kernel: its Image, config, System.map)."""
    import arm64_env
    return arm64_env.env(arm64_env.obtain_arm64_kernel)


@pytest.fixture(scope="session")
def make_initramfs():
    """make_initramfs(init_text, extra=None) -> Path of a cached gzip'd cpio."""
    def make(init: str, extra=None) -> Path:
        try:
            return kernel_env.build_initramfs(init, extra)
        except kernel_env.KernelEnvError as e:
            _env_fail(e)
    return make


@pytest.fixture(scope="session")
def boot_kernel(tmp_path_factory):
    """boot_kernel(name, kernel, initrd, **boot_kwargs) -> BootResult; the console is kept in a
    log file named after ``name`` (shown by the assertion helpers) and the time listed at the end."""
    logs = tmp_path_factory.mktemp("boots")

    def run(name: str, kernel, initrd, **kw) -> kernel_env.BootResult:
        try:
            r = kernel_env.boot(kernel, initrd, log=logs / f"{name}.console.txt", **kw)
        except kernel_env.KernelEnvError as e:
            _env_fail(e)
        BOOTS.append((name, r))
        return r
    return run


def pytest_terminal_summary(terminalreporter):
    if not BOOTS:
        return
    terminalreporter.section("kernel boots")
    for name, r in BOOTS:
        state = "powered off" if r.powered_off else ("timed out" if r.timed_out else f"exit {r.returncode}")
        terminalreporter.write_line(f"{name}: {r.seconds:.2f} s ({r.accel}, {state})")

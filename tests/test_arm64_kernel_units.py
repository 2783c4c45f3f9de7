"""The arm64 kernel target's pieces that need no kernel: the Image header's refusals, the
detour's and dispatcher's generated code (assembled and compiled by the cross toolchain when it
is there)."""
from __future__ import annotations

import shutil
import struct
import subprocess

import pytest

from rewriter.errors import KprewriteError
from rewriter.targets.linux_kernel.aarch64 import build, image
from conftest import ALL_ARCHES

ARCHES = ALL_ARCHES


def _header(flags=0b1010, image_size=0x200000, size=0x1000):
    h = struct.pack("<IIQQQQQQII", 0x5A4D, 0, 0, image_size, flags, 0, 0, 0, 0x644D5241, 0x40)
    return h + bytes(size - len(h))


def test_image_header_refusals():
    assert image.is_image(_header()) and not image.is_image(b"\x7fELF" + bytes(100))
    with pytest.raises(KprewriteError, match="big-endian"):
        image.parse(_header(flags=0b1011), "Image")
    with pytest.raises(KprewriteError, match="16 KiB pages"):
        image.parse(_header(flags=0b0100), "Image")
    with pytest.raises(KprewriteError, match="image_size"):
        image.parse(_header(image_size=0x10), "Image")
    with pytest.raises(KprewriteError, match="R_AARCH64_RELATIVE table"):
        image.parse(_header(), "Image")


def test_detour_and_dispatch_compile(tmp_path):
    """One site with a post_handler and a change of path: the detour assembles, the dispatcher
    compiles, and neither has an absolute relocation."""
    gcc = shutil.which("aarch64-linux-gnu-gcc")
    if gcc is None:
        pytest.skip("no aarch64-linux-gnu-gcc")
    (tmp_path / "d.S").write_text(build.detour_asm(0, True))
    subprocess.run([gcc, "-c", str(tmp_path / "d.S"), "-o", str(tmp_path / "d.o")], check=True)

    class P:
        symbol, offset, index, addr, event_name = "f", 0, 0, 0, "p_f_0"
    (tmp_path / "c.c").write_text(build.dispatch_c([(None, [(P, "pre", "post")])], [True]))
    from rewriter.arch import get_arch
    from rewriter.link.runtime import _includes, cflags
    arch = get_arch("aarch64")
    subprocess.run([gcc, *cflags(arch, "linux_kernel"), *_includes(arch, "linux_kernel"), "-c",
                    str(tmp_path / "c.c"), "-o", str(tmp_path / "c.o")], check=True)
    build._check_relocs([tmp_path / "d.o", tmp_path / "c.o"], "Image")
    text = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(tmp_path / "d.o")], capture_output=True,
                          text=True).stdout
    assert "cbnz" in text and "br\tx16" in text and "msr\tdaifset, #0x3" in text


def test_runtime_placed_at_boot_is_the_cached_runtime():
    """The blob's part of the generic runtime (the debugfs views, the trace events) is
    link/runtime.py's, built and cached as every target's runtime is: the kernel recipe's
    "placed_at_boot" variant, its own sources only (no .S, no asm-offsets), each function in a
    section of its own, naming none of the data kallsyms lacks (event_mutex, global_trace,
    tracing_disabled, cpu_number: the Image has no KALLSYMS_ALL)."""
    gcc = shutil.which("aarch64-linux-gnu-gcc")
    if gcc is None:
        pytest.skip("no aarch64-linux-gnu-gcc")
    from rewriter.link.runtime import compile_runtime
    from rewriter.targets.linux_kernel.aarch64 import runtime as rt
    objs = compile_runtime(gcc, arch="aarch64", platform="linux_kernel", variant=rt.RUNTIME_VARIANT)
    assert [o.name for o in objs] == ["rt_platform_linux_kernel_kp_debugfs.c.o", "rt_kp_lib.c.o", "rt_kp_line.c.o",
                                      "rt_kp_fetch.c.o", "rt_kp_trace.c.o",
                                      "rt_platform_linux_kernel_kp_trace_buffer.c.o"]
    undefined = subprocess.run(["aarch64-linux-gnu-nm", "-u", *map(str, objs)], capture_output=True, text=True).stdout
    assert not {"event_mutex", "global_trace", "tracing_disabled", "cpu_number"} & set(undefined.split()), undefined
    assert objs[0].parent.name.startswith("runtime-aarch64-linux_kernel-placed_at_boot-")
    assert compile_runtime(gcc, arch="aarch64", platform="linux_kernel", variant=rt.RUNTIME_VARIANT) == objs
    sections = subprocess.run(["aarch64-linux-gnu-objdump", "-h", str(objs[0])], capture_output=True,
                              text=True).stdout
    assert ".text.kp_" in sections

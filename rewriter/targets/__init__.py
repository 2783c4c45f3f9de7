"""Targets: what differs between kinds of image, one answer per target.

A target answers, for its kind of image: which ranges are reserved, where new
code and data go and how the output is written, how the output starts the
runtime, and which platform folder of the runtime it links
(runtime/platform/<name>).  linux_user/ is Linux user processes (executables,
static and PIE, and shared objects); linux_kernel/ is kernel images (vmlinux,
and a bzImage's payload).  base.Target declares what each one answers.

Loading comes in this order: load() reads the file, asks the targets whether it is
a container they open (unwrap()), builds the image.Image from the ELF bytes and
detects its target once (image.target); the later stages take it from there.
"""
from __future__ import annotations

import struct


def load(path: str):
    """The image.Image of the file at `path` (the ELF inside it when it is a
    container a target knows), its target detected (image.target)."""
    from ..errors import file_error
    from ..elf.image import Image
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise file_error(path, e) from None
    unwrapped = unwrap(data, path)
    image = Image(path, data) if unwrapped is None else Image(path, *unwrapped)
    image.target = for_image(image)
    return image


def for_image(image):
    """The target of a loaded image: the one load() detected, else detected now (from
    the image, never flagged)."""
    if getattr(image, "target", None) is not None:
        return image.target
    if getattr(image, "container", None) is not None:     # unwrapped: a .ko, a bzImage's vmlinux
        from . import linux_module
        if linux_module.detect(image):
            return linux_module
    # A kernel is linked in the upper half of the address space (linux_kernel.detect()
    # decides): a user image does not import the kernel targets (some 40 ms).
    if any(s.vaddr >= 1 << 63 for s in image.segments):
        from . import linux_kernel
        if linux_kernel.detect(image):
            return linux_kernel.for_arch(image)
    from . import linux_user
    return linux_user


def unwrap(data: bytes, path: str):
    """(ELF bytes, container) when `data` is an image inside a container a target
    knows (a bzImage holds a vmlinux; a .ko's view is unwrapped from it), else None."""
    # A module is an ELF relocatable object, and the containers the kernel target opens
    # (a bzImage) are not ELF files: an ELF executable or shared object imports neither.
    # An ELF kernel (linked in the upper half) may still be read through its boot image (arm64's
    # vmlinux as its Image: the kernel target's arch folder says).
    if data[:4] == b"\x7fELF" and data[16:18] not in (b"\x01\x00", b"\x00\x01"):   # e_type ET_REL
        if len(data) < 32 or data[4] != 2 or struct.unpack_from("<Q", data, 24)[0] < 1 << 63:
            return None
        from . import linux_kernel
        return linux_kernel.unwrap(data, path)
    from . import linux_kernel, linux_module
    found = linux_module.unwrap(data, path)
    return found if found is not None else linux_kernel.unwrap(data, path)

"""Targets: what differs between kinds of image, one answer per target.

A target answers, for its kind of image: which ranges are reserved, where new
code and data go and how the output is written, how the output starts the
runtime, and which platform folder of the runtime it links
(runtime/platform/<name>).  linux_user/ is Linux user processes (executables,
static and PIE, and shared objects); linux_kernel/ is kernel images (vmlinux,
and a bzImage's payload).  base.Target declares what each one answers.
"""
from __future__ import annotations


def for_image(image):
    """The target of a loaded image: detected, never flagged."""
    from . import linux_kernel, linux_user
    return linux_kernel if linux_kernel.detect(image) else linux_user


def unwrap(data: bytes, path: str):
    """(ELF bytes, container) when `data` is an image inside a container a target
    knows (a bzImage holds a vmlinux), else None."""
    from . import linux_kernel
    return linux_kernel.unwrap(data, path)

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


def load(path: str):
    """The image.Image of the file at `path` (the ELF inside it when it is a
    container a target knows), its target detected (image.target)."""
    from ..errors import KprewriteError
    from ..image import Image
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise KprewriteError(f"{path}: cannot read: {e.strerror}")
    unwrapped = unwrap(data, path)
    image = Image(path, data) if unwrapped is None else Image(path, *unwrapped)
    image.target = for_image(image)
    return image


def for_image(image):
    """The target of a loaded image: the one load() detected, else detected now (from
    the image, never flagged)."""
    if getattr(image, "target", None) is not None:
        return image.target
    from . import linux_kernel, linux_module, linux_user
    if linux_module.detect(image):
        return linux_module
    return linux_kernel if linux_kernel.detect(image) else linux_user


def unwrap(data: bytes, path: str):
    """(ELF bytes, container) when `data` is an image inside a container a target
    knows (a bzImage holds a vmlinux; a .ko's view is unwrapped from it), else None."""
    from . import linux_kernel, linux_module
    found = linux_module.unwrap(data, path)
    return found if found is not None else linux_kernel.unwrap(data, path)

"""The kernel target for arm64 images (linux_kernel.for_arch() picks it by the image's arch): the
kernel target's reading, rules and planning as they are, and its own output (build.py) until
the generic back half (the runtime's tables, boot hooks, per-CPU data, KASLR table) knows arm64.

What differs from the x86-64 kernel target:
- no boot or shutdown hooks (the runtime is not linked: build.py links the handlers alone);
- build(): the handlers and a detour per jump-optimized site, linked into the Image's own
  text padding and init-data tail (build.py says where and why), Image in, Image out."""
from __future__ import annotations

import rewriter.targets.linux_kernel as _base

globals().update({k: v for k, v in vars(_base).items() if not k.startswith("__") and k != "for_arch"})

RUNTIME_HANDLERS = frozenset()


def runtime_probes(spec) -> None:
    """None: the runtime is not linked into an arm64 image yet."""
    return None


def handler_headers(image) -> dict[str, str]:
    return {}


def build(s, objs, workdir, progress):
    from .build import build as _build
    return _build(s, objs, workdir)

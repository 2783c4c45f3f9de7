"""The back half's link step for a target laid out in place (targets.base.Target.link's
default): the probe table compiled and linked with the runtime and the handlers' objects at
the layout's addresses (ld.py), in a thread beside the main one, and kprewrite's cache of the
linked blob.  A target linked otherwise (a kernel module: `ld -r`) answers with Linked(its
result)."""
from __future__ import annotations

import threading
from pathlib import Path

from . import compile as _compile, ld
from .toolchain import linker


class Linked:
    """A link already done: result() is its output (what the target's emit() and write() read)."""

    def __init__(self, blob):
        self.blob = blob

    def join(self) -> None:
        pass

    def result(self):
        return self.blob


class Linking:
    """A link running in a thread (waiting on the compiler and the linker, it holds the
    interpreter's lock little): the pipeline makes the metadata and the code that does not
    reach the runtime meanwhile (emission.unlinked); join() waits, result() is the blob
    or raises what the link raised."""

    def __init__(self, run):
        self.out: dict = {}

        def body():
            try:
                self.out["blob"] = run()
            except BaseException as e:      # raised by result()
                self.out["error"] = e
        self.thread = threading.Thread(target=body, name="kprewrite-link")
        self.thread.start()

    def join(self) -> None:
        self.thread.join()

    def result(self):
        self.join()
        if "error" in self.out:
            raise self.out["error"]
        return self.out["blob"]


def start(s, lay, table, runtime: list[Path], objs: list[Path], workdir: Path, cc: str):
    """The blob of session s at layout lay: from the cache (Linked), else linked in a thread
    (Linking) and put in the cache."""
    platform = s.target.name
    externs = s.target.link_symbols(s.image)
    k = _blob_key(cc, s.arch, platform, table, runtime, objs, lay, externs)
    blob = _cached_blob(k, workdir)
    if blob is not None:
        return Linked(blob)

    def run():
        blob = _link(s, lay, objs, workdir, cc, table, runtime, platform, externs)
        _cache_blob(k, workdir, blob)
        return blob
    return Linking(run)


def _link(s, lay, objs: list[Path], workdir: Path, cc: str, table, runtime: list[Path],
          platform: str, externs):
    """The probe table compiled and linked with the runtime and the handlers' objects."""
    table_objs = _compile.compile_table(cc, workdir, table, platform, s.arch)
    # A target whose runtime and handlers call into the image (a kernel's printk...)
    # resolves them from the image's symbols.
    origin = {o: h.name for o, h in zip(objs, s.spec.handlers)}
    origin.update((o, "probe table") for o in table_objs)
    return ld.link(workdir, runtime + objs + table_objs, lay.text_addr, platform,
                   externs, origin, Path(s.image.path).name, lay.data_addr, s.arch)


# The linked blob (the probe table compiled, linked with the runtime and the handlers'
# objects) is the same for the same inputs: kprewrite's cache keeps it, keyed by
# everything the compile and the link read, so a second rewrite of an image with the
# same spec runs neither gcc nor ld.  workdir/blob.elf is written either way
# (KPREWRITE_KEEP keeps it for gdb).
def _blob_key(cc, arch, platform, table, runtime: list[Path], objs: list[Path], lay, externs) -> str:
    from .. import cache
    from .runtime import runtime_key
    from .toolchain import compiler_identity, tool_identity
    parts = [b"blob", cache.code_version(), arch.name.encode(), platform.encode(), *map(str.encode, compiler_identity(cc)),
             tool_identity(linker(arch)).encode(), runtime_key(cc, arch.name, platform).encode(), table.c.encode(), table.asm.encode(),
             f"{lay.text_addr:#x} {lay.data_addr!r}".encode(), repr(sorted(externs.items()) if externs else externs).encode()]
    parts += [p.read_bytes() for p in runtime + objs]
    return cache.key(*parts)


def _cached_blob(k: str, workdir: Path):
    import pickle
    from .. import cache
    got = cache.get("blob", k)
    if got is None:
        return None
    try:
        blob, elf = pickle.loads(got)
    except Exception:
        return None
    (workdir / "blob.elf").write_bytes(elf)
    return blob


def _cache_blob(k: str, workdir: Path, blob) -> None:
    import pickle
    from .. import cache
    cache.put("blob", k, pickle.dumps((blob, (workdir / "blob.elf").read_bytes()), protocol=pickle.HIGHEST_PROTOCOL))

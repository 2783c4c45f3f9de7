"""What the commands print, and the metadata a rewritten image carries:
`check` (each probe's decision and why), `list` (debugfs kprobes/list form,
read back from the output), `blacklist` (debugfs kprobes/blacklist)."""
from __future__ import annotations

import json

from .errors import KprewriteError
from .image import Image
from .planner import FTRACE, HOOK_PENDING, INT3, JUMPS, OPTIMIZED, TRAMPOLINE, Plan

META_SECTION = ".kprewrite.meta"


def check_lines(plan: Plan) -> list[str]:
    rows = []
    for site, p in plan.kprobes:
        if site.decision == INT3:   # breakpoint probe: why not optimized, and how it runs out of line
            rows.append((p.index, f"{p.label}  k  {INT3}  {site.reason}  [{site.xol.mode}]"))
        else:
            rows.append((p.index, f"{p.label}  k  {site.decision}"))
    rows += [(p.index, f"{p.label}  r  {describe_returns(g)}") for _, p, g in plan.kretprobes]
    for p, decision, reason in plan.rejected:
        rows.append((p.index, f"{p.label}  {getattr(p, 'kind', 'k')}  {decision}  {reason}"))
    return [r for _, r in sorted(rows)]


def describe_returns(g) -> str:
    # The decision word is the entry's (interface.md: optimized, ftrace, int3,
    # refused); how the returns are caught follows it.
    word = FTRACE if g.site.decision == FTRACE else OPTIMIZED
    if g.mode == TRAMPOLINE:
        return f"{word}  returns: {TRAMPOLINE}  {g.reason}"
    int3 = {e.addr for e, _ in g.int3_exits}
    parts = []
    for e in g.exits:
        what = "ret" if e.kind == "ret" else f"tail->{e.target:#x}" + (" (pending)" if g.hooks[e.addr] == HOOK_PENDING else " (trampoline)")
        parts.append(f"{e.addr:#x} {what}" + (" (int3)" if e.addr in int3 else ""))
    return f"{word}  returns: {', '.join(parts)}"


def skipped_summary(plan: Plan) -> list[str]:
    if not plan.skipped:
        return []
    n = sum(len(v) for v in plan.skipped.values())
    placed = sum(len(site.probes) for site in plan.sites)
    lines = [f"{placed} probes placed, {n} from globs skipped:"]
    for check, ps in sorted(plan.skipped.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"  {len(ps):6d}  {check}")
    return lines


def metadata(plan: Plan, label: str) -> bytes:
    """What `list` reads back: every placed probe, its decision and where its code went."""
    probes = []
    for site, p in plan.kprobes:
        d = {"index": p.index, "addr": p.addr, "kind": "k", "symbol": p.symbol, "offset": p.offset,
             "name": p.event_name, "optimized": site.decision == OPTIMIZED, "disabled": p.spec.disabled,
             "detour": site.detour, "region": [site.addr, site.region_end]}
        if site.decision == FTRACE:
            d["ftrace"] = True
        if site.decision in JUMPS:
            d.update({"call": "clean" if site.clean else "pt_regs", "inline_dispatch": site.template})
        if site.decision == INT3:
            d.update({"int3": site.xol.mode, "reason": str(site.reason)})
        probes.append(d)
    for site, p, g in plan.kretprobes:
        probes.append({"index": p.index, "addr": p.addr, "kind": "r", "symbol": p.symbol, "offset": p.offset,
                       "name": p.event_name, "optimized": site.decision != FTRACE, "disabled": p.kret.disabled,
                       "detour": site.detour, "region": [site.addr, site.region_end], "returns": g.mode,
                       "call": "clean" if site.clean else "pt_regs",
                       "inline_dispatch": site.template,
                       "return_hook": ("inline " if g.ret_template and any(e.kind == "ret" for e in g.exits) else "")
                       + ("clean" if g.ret_clean else "pt_regs"),
                       "return_sites": [[rs.addr, rs.region_end, rs.exit.addr] for rs in g.sites]
                       + [[h.addr, h.region_end, e.addr] for h, e in g.embedded],
                       "int3_exits": [e.addr for e, _ in g.int3_exits]})
        if site.decision == FTRACE:
            probes[-1]["ftrace"] = True
    probes.sort(key=lambda d: d["index"])
    doc = {"format": "kprewrite-1", "input": label, "probes": probes}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def read_metadata(path: str) -> dict:
    from elftools.elf.elffile import ELFFile
    import io
    from .targets import unwrap
    try:
        with open(path, "rb") as f:
            data = f.read()
        unwrapped = unwrap(data, path)      # an image inside a container (a kernel's bzImage)
        if unwrapped is not None:
            data = unwrapped[0]
        if data[:4] != b"\x7fELF":
            raise KprewriteError(f"{path}: not an ELF file")
        sec = ELFFile(io.BytesIO(data)).get_section_by_name(META_SECTION)
        if sec is None:
            raise KprewriteError(f"{path}: not rewritten by kprewrite (no {META_SECTION} section)")
        return json.loads(sec.data())
    except OSError as e:
        raise KprewriteError(f"{path}: cannot read: {e.strerror}")
    except (ValueError, KeyError):
        raise KprewriteError(f"{path}: malformed {META_SECTION} section or ELF file")


def list_lines(path: str) -> list[str]:
    """debugfs kprobes/list: ADDRESS  k|r  SYMBOL+0xOFF  [DISABLED] [OPTIMIZED] [FTRACE]."""
    out = []
    for p in read_metadata(path)["probes"]:
        flags = (" [DISABLED]" if p["disabled"] else "") + (" [OPTIMIZED]" if p["optimized"] else "")
        flags += " [FTRACE]" if p.get("ftrace") else ""
        flags += {"emulate": " [EMULATED]", "boost": " [BOOSTED]", "single-step": " [SINGLESTEP]"}.get(p.get("int3"), "")
        out.append(f"{p['addr']:016x}  {p['kind']}  {p['symbol']}+{p['offset']:#x}{flags}")
    return out


def blacklist_lines(path: str, system_map: str | None = None) -> list[str]:
    """Registration refusals (debugfs kprobes/blacklist), then the sites a detour
    must not overlap (for a kernel: everything it patches at boot)."""
    from . import targets
    from .arch import get_arch
    image = Image(path)
    target = targets.for_image(image)
    target.load_symbols(image, system_map)
    rules = target.rules(image, get_arch(image.machine))
    return ([f"{e.start:#x}-{e.end:#x}  {e.symbol}  {e.reason}" for e in rules.blacklist.entries]
            + [f"{e.start:#x}-{e.end:#x}  {e.symbol}  boot-patched site ({e.reason})" for e in rules.reserved.entries])

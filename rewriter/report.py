"""What the commands print, and the metadata a rewritten image carries:
`check` (each probe's decision and why), `list` (debugfs kprobes/list form,
read back from the output), `blacklist` (debugfs kprobes/blacklist)."""
from __future__ import annotations

import json

from .arch.base import BOOST, EMULATE, SINGLESTEP
from .emit.meta import META_SECTION
from .errors import KprewriteError, file_error
from .planner import FTRACE, HOOK_PENDING, HOOK_POINTER, BREAKPOINT, OPTIMIZED, TRAMPOLINE, Plan



# --- machine-readable forms (--format json, and the Python API) ------------------------------
# Addresses are "0x..." strings: a kernel address does not fit the 53 bits a JSON
# number keeps in JavaScript or jq.  Offsets and counts are numbers.

CHECK_FORMAT, LIST_FORMAT, BLACKLIST_FORMAT = "kprewrite-check-1", "kprewrite-list-1", "kprewrite-blacklist-1"


# A tail call through a pointer: pending when its target is a hooked entry, else the
# trampoline, decided at each call (kp_kretprobe_tail_pointer()).
POINTER_HOOK = "pending or trampoline"

def hexaddr(a: int | None) -> str | None:
    return None if a is None else f"{a:#x}"


def refusal(reason, default_addr: int, check: str | None = None, addr: int | None = None) -> dict:
    """A refusal as {check, address, message}: an arch Refusal carries both; a
    plain reason "check: message" names its check first, at the probe's address."""
    text = str(reason)
    if hasattr(reason, "check"):
        return {"check": reason.check, "address": hexaddr(reason.addr), "message": text}
    if check is None:
        head, sep, _ = text.partition(": ")
        check = head if sep and head.isidentifier() else "unknown"
    return {"check": check, "address": hexaddr(default_addr if addr is None else addr), "message": text}


def _probe_record(p, kind: str, decision: str) -> dict:
    return {"index": p.index, "name": p.event_name, "kind": kind, "symbol": p.symbol, "offset": p.offset,
            "address": hexaddr(p.addr), "decision": decision, "from_glob": p.from_glob,
            "reason": None, "int3": None, "returns": None}


def _site_record(p, kind: str, site) -> dict:
    """A placed probe's record: its site's decision, and for a breakpoint why and how it runs."""
    r = _probe_record(p, kind, site.decision)
    if site.decision == BREAKPOINT:
        r["reason"], r["int3"] = refusal(site.reason, site.addr), site.xol.mode
    if site.decision == FTRACE:
        # Shared with the kernel's ftrace (the jump after the site), or taken; why taken where
        # sharing was tried (Rules.share_ftrace).
        r["ftrace_site"] = "shared" if site.jump_at else "taken"
        if not site.jump_at and site.reason is not None:
            r["reason"] = refusal(site.reason, site.addr)
    return r


def returns_record(g) -> dict:
    """How a kretprobe's returns are caught: every exit hooked, or the trampoline."""
    if g.mode == TRAMPOLINE:
        return {"mode": TRAMPOLINE, "reason": refusal(g.reason, g.entry), "sites": []}
    if g.light:     # nothing runs at its returns: each exit is left as it is (planner.forms.light_kretprobes)
        return {"mode": "light", "reason": None, "sites": [
            {"address": hexaddr(e.addr), "kind": "ret" if e.kind == "ret" else "tail",
             "target": hexaddr(e.target) if e.kind != "ret" else None, "hook": "light", "int3": False,
             "int3_reason": None, "branches": []} for e in g.exits]}
    bp = {e.addr: why for e, why in g.breakpoint_exits}
    sites = []
    for e in g.exits:
        hook = "ret" if e.kind == "ret" else ("pending" if g.hooks[e.addr] == HOOK_PENDING else
                                              POINTER_HOOK if g.hooks[e.addr] == HOOK_POINTER else TRAMPOLINE)
        sites.append({"address": hexaddr(e.addr), "kind": "ret" if e.kind == "ret" else "tail",
                      "target": hexaddr(e.target) if e.kind != "ret" else None, "hook": hook,
                      "int3": e.addr in bp,
                      "int3_reason": refusal(bp[e.addr], e.addr) if e.addr in bp else None,
                      # jumps landing in the exit's region, each hooked as an exit of its own
                      "branches": [hexaddr(a) for a in g.branch_exits.get(e.addr, ())]})
    return {"mode": "hooks", "reason": None, "sites": sites}


def check_records(plan: Plan) -> list[dict]:
    """`check`'s lines as records, in spec order (the `probes` of `check --format json`)."""
    rows = []
    for site, p in plan.kprobes:
        rows.append(_site_record(p, "k", site))
    for site, p, g in plan.kretprobes:
        r = _site_record(p, "r", site)     # the entry's form: a kretprobe's entry is a kprobe
        r["returns"] = returns_record(g)
        rows.append(r)
    for p, decision, reason, check, addr in plan.rejected:
        r = _probe_record(p, getattr(p, "kind", "k"), decision)
        r["reason"] = refusal(reason, p.addr, check, addr)
        rows.append(r)
    return sorted(rows, key=lambda r: r["index"])


def check_line(r: dict) -> str:
    """One line of `check`: SYMBOL+0xOFF  k|r  DECISION  [why] ...; for a kretprobe,
    how its returns are caught."""
    head = f"{r['symbol']}+{r['offset']:#x}  {r['kind']}  {r['decision']}"
    if r["reason"] is not None:         # a refusal, or why a (kretprobe's entry) probe is a breakpoint
        why = r["reason"]
        # Every refusal names its check and address (a breakpoint's reason's message already does).
        named = why["message"].startswith(why["check"]) or why["check"] == "unknown"
        text = why["message"] if named else f"{why['check']} at {why['address']}: {why['message']}"
        # An ftrace site taken rather than shared: ftrace loses the function.
        head += f"  site taken, not shared with ftrace: {text}" if r.get("ftrace_site") == "taken" else f"  {text}"
    head += f"  [{r['int3']}]" if r["int3"] else ""
    if r["returns"] is not None:
        ret = r["returns"]
        if ret["mode"] == TRAMPOLINE:
            return f"{head}  returns: {TRAMPOLINE}  {ret['reason']['message']}"
        if ret["mode"] == "light":
            exits = ", ".join(f"{e['address']} {e['kind']}" for e in ret["sites"])
            return (f"{head}  returns: light ({exits or 'no exit'} left as they are: no handler, "
                    "no instance, the hit counted at the entry)")
        parts = [f"{e['address']} ret" if e["kind"] == "ret" else f"{e['address']} tail->{e['target'] or '*pointer'} ({e['hook']})"
                 for e in ret["sites"]]
        parts = [t + (" (int3)" if e["int3"] else "")
                 + (f" (and the jumps at {', '.join(e['branches'])})" if e.get("branches") else "")
                 for t, e in zip(parts, ret["sites"])]
        # Why each breakpoint return hook: no jump fits, and the trampoline is unsafe.
        why = [e["int3_reason"]["message"] for e in ret["sites"] if e["int3"] and e["int3_reason"]]
        return f"{head}  returns: {', '.join(parts)}" + (f"  {' | '.join(why)}" if why else "")
    return head


def check_lines(plan: Plan) -> list[str]:
    return [check_line(r) for r in check_records(plan)]


def skipped_counts(plan: Plan) -> dict[str, int]:
    return {check: len(ps) for check, ps in sorted(plan.skipped.items())}


def check_doc(plan: Plan, label: str) -> dict:
    """`check --format json`: the plan, what globs skipped, and the errors that fail it."""
    return {"format": CHECK_FORMAT, "input": label, "probes": check_records(plan),
            "skipped": skipped_counts(plan), "errors": list(plan.errors)}


def instrument_summary(plan: Plan, output: str) -> dict:
    """`instrument --format json`'s last line."""
    decisions = {d: 0 for d in (OPTIMIZED, FTRACE, BREAKPOINT)}
    for site, _ in plan.kprobes:
        decisions[site.decision] += 1
    return {"type": "summary", "output": output, "kprobes": len(plan.kprobes),
            "kretprobes": len(plan.kretprobes), **decisions,
            "skipped": sum(len(v) for v in plan.skipped.values())}


def skipped_summary(plan: Plan) -> list[str]:
    return skipped_text(skipped_counts(plan), sum(len(site.probes) for site in plan.sites))


def skipped_text(counts: dict[str, int], placed: int) -> list[str]:
    """The summary of what globs skipped, grouped by reason, most frequent first."""
    if not counts:
        return []
    lines = [f"{placed} probes placed, {sum(counts.values())} from globs skipped:"]
    for check, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  {n:6d}  {check}")
    return lines


def read_metadata(path: str) -> dict:
    from .elf.view import ElfView
    from .targets import unwrap
    try:
        with open(path, "rb") as f:
            data = f.read()
        unwrapped = unwrap(data, path)      # an image inside a container (a kernel's bzImage)
        if unwrapped is not None:
            data = unwrapped[0]
        if data[:4] != b"\x7fELF":
            raise KprewriteError(f"{path}: not an ELF file")
        try:
            view = ElfView(data, path)
            sec = view.section(META_SECTION)
        except KprewriteError as e:       # a bad header or section table: elf.view's one line
            raise KprewriteError(f"{path}: malformed {META_SECTION} section or ELF file ({e.args[0]})")
        if sec is None:
            raise KprewriteError(f"{path}: not rewritten by kprewrite (no {META_SECTION} section)")
        doc = json.loads(view.section_bytes(sec))
        if not isinstance(doc, dict) or not isinstance(doc.get("probes"), list):
            raise ValueError
        return doc
    except OSError as e:
        raise file_error(path, e) from None
    except (ValueError, KeyError, TypeError):
        raise KprewriteError(f"{path}: malformed {META_SECTION} section or ELF file")


BREAKPOINT_FLAGS = {EMULATE: "EMULATED", BOOST: "BOOSTED", SINGLESTEP: "SINGLESTEP"}


def _list_flags(p: dict) -> list[str]:
    return ((["DISABLED"] if p["disabled"] else []) + (["OPTIMIZED"] if p["optimized"] else [])
            + (["FTRACE"] if p.get("ftrace") else []) + ([BREAKPOINT_FLAGS[p["int3"]]] if p.get("int3") in BREAKPOINT_FLAGS else []))


def list_records(path: str, meta: dict | None = None) -> list[dict]:
    """The probes compiled into a rewritten image, from its .kprewrite.meta
    (the `probes` of `list --format json`)."""
    out = []
    for p in (meta or read_metadata(path))["probes"]:
        try:
            r = {"index": p["index"], "name": p["name"], "kind": p["kind"], "symbol": p["symbol"], "offset": p["offset"],
                 "address": hexaddr(p["addr"]), "flags": _list_flags(p), "disabled": p["disabled"],
                 "optimized": p["optimized"], "ftrace": bool(p.get("ftrace")), "int3": p.get("int3"),
                 "reason": p.get("reason"), "call": p.get("call"), "detour": hexaddr(p["detour"]) if p.get("detour") else None,
                 "region": [hexaddr(a) for a in p["region"]], "returns": p.get("returns"), "return_sites": None, "int3_exits": None,
                 "shared_with": hexaddr(p["shared_with"]) if p.get("shared_with") is not None else None}
            if p.get("regs_fields") is not None:     # a partial pt_regs (only these byte offsets saved)
                r["regs_fields"] = [int(o) for o in p["regs_fields"]]
            if p["kind"] == "r":
                r["return_sites"] = [{"address": hexaddr(a), "end": hexaddr(e), "exit": hexaddr(x)} for a, e, x in p["return_sites"]]
                r["int3_exits"] = [hexaddr(a) for a in p["int3_exits"]]
            out.append(r)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise KprewriteError(f"{path}: malformed {META_SECTION} section (probe entry {str(p)[:60]})") from None
    return out


def list_doc(path: str) -> dict:
    meta = read_metadata(path)
    return {"format": LIST_FORMAT, "input": meta.get("input"), "probes": list_records(path, meta)}


def list_lines(path: str) -> list[str]:
    """debugfs kprobes/list: ADDRESS  k|r  SYMBOL+0xOFF  [DISABLED] [OPTIMIZED] [FTRACE]."""
    return [f"{int(r['address'], 16):016x}  {r['kind']}  {r['symbol']}+{r['offset']:#x}"
            + "".join(f" [{f}]" for f in r["flags"]) for r in list_records(path)]


def blacklist_records(path: str, system_map: str | None = None) -> list[dict]:
    """Registration refusals (debugfs kprobes/blacklist, kind "blacklist"), then the
    sites a detour must not overlap (kind "reserved"; for a kernel: everything it
    patches at boot)."""
    from . import targets
    from .arch import get_arch
    image = targets.load(path)
    target = image.target
    target.load_symbols(image, system_map)
    rules = target.rules(image, get_arch(image.machine))
    return ([{"start": hexaddr(e.start), "end": hexaddr(e.end), "symbol": e.symbol, "kind": "blacklist", "reason": e.reason}
             for e in rules.blacklist.entries]
            + [{"start": hexaddr(e.start), "end": hexaddr(e.end), "symbol": e.symbol, "kind": "reserved", "reason": e.reason}
               for e in rules.reserved.entries])


def blacklist_doc(path: str, system_map: str | None = None) -> dict:
    import os
    return {"format": BLACKLIST_FORMAT, "input": os.path.basename(path), "entries": blacklist_records(path, system_map)}


def blacklist_lines(path: str, system_map: str | None = None) -> list[str]:
    return [f"{e['start']}-{e['end']}  {e['symbol']}  "
            + (e["reason"] if e["kind"] == "blacklist" else f"boot-patched site ({e['reason']})")
            for e in blacklist_records(path, system_map)]

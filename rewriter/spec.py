"""The probe spec (interface.md, "The spec (TOML)"): load and validate."""
from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import KprewriteError


@dataclass
class KprobeSpec:
    table: str
    symbol_name: str | None
    addr: int | None
    offset: int = 0
    pre_handler: str | None = None
    post_handler: str | None = None
    disabled: bool = False
    name: str | None = None
    fetch: str | None = None
    is_glob: bool = False


@dataclass
class KretprobeSpec:
    table: str
    symbol_name: str | None
    addr: int | None
    offset: int = 0
    handler: str | None = None
    entry_handler: str | None = None
    maxactive: int = 0
    data_size: int = 0
    disabled: bool = False
    name: str | None = None
    fetch: str | None = None
    is_glob: bool = False


@dataclass
class Spec:
    path: Path
    handlers: list[Path]
    optimize: bool
    kprobes: list[KprobeSpec]
    kretprobes: list[KretprobeSpec]
    events: list[str]


TOP_KEYS = {"handlers", "optimize", "kprobe", "kretprobe", "events"}
KPROBE_KEYS = {"symbol_name": str, "addr": int, "offset": int, "pre_handler": str, "post_handler": str,
               "disabled": bool, "name": str, "fetch": str}
KRETPROBE_KEYS = {"symbol_name": str, "addr": int, "offset": int, "handler": str, "entry_handler": str,
                  "maxactive": int, "data_size": int, "disabled": bool, "name": str, "fetch": str}
TYPE_NAMES = {str: "a non-empty string", int: "an integer", bool: "a boolean (true or false)"}


def _unknown(where: str, key: str, known) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{where}: unknown key '{key}'{hint}"


def _typed(value, typ) -> bool:
    if typ is bool:
        return isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, str) and value != ""


def _show(v) -> str:
    return f'"{v}"' if isinstance(v, str) else repr(v).lower() if isinstance(v, bool) else repr(v)


def _table(name, where, raw, keys, cls, errors):
    ok = True
    for k, v in raw.items():
        if k not in keys:
            errors.append(_unknown(where, k, keys))
            ok = False
        elif not _typed(v, keys[k]):
            errors.append(f"{where}: '{k}' must be {TYPE_NAMES[keys[k]]}, got {_show(v)}")
            ok = False
        elif keys[k] is int and k in ("offset", "addr", "data_size") and v < 0:
            errors.append(f"{where}: '{k}' must be a non-negative integer, got {v}")
            ok = False
    if ("symbol_name" in raw) == ("addr" in raw):
        errors.append(f"{where}: needs exactly one of 'symbol_name' or 'addr'")
        ok = False
    if not ok:
        return None
    fields = {k: raw[k] for k in keys if k in raw}
    sym = fields.get("symbol_name")
    return cls(table=name, symbol_name=sym, addr=fields.pop("addr", None),
               **{k: v for k, v in fields.items() if k != "symbol_name"},
               is_glob=bool(sym) and any(c in sym for c in "*?["))


def load_spec(path) -> Spec:
    path = Path(path)
    label = path.name
    try:
        raw_text = path.read_bytes()
    except FileNotFoundError:
        raise KprewriteError(f"{label}: no such file")
    except OSError as e:
        raise KprewriteError(f"{label}: cannot read: {e.strerror}")
    try:
        doc = tomllib.loads(raw_text.decode("utf-8"))
    except UnicodeDecodeError:
        raise KprewriteError(f"{label}: not UTF-8 text")
    except tomllib.TOMLDecodeError as e:
        raise KprewriteError(f"{label}: {str(e).splitlines()[0]}")
    errors: list[str] = []
    for k in doc:
        if k not in TOP_KEYS:
            errors.append(_unknown(label, k, TOP_KEYS))
    base = path.resolve().parent
    handlers: list[Path] = []
    hs = doc.get("handlers", [])
    if not isinstance(hs, list) or not all(isinstance(h, str) and h for h in hs):
        errors.append(f"{label}: 'handlers' must be a list of file paths")
    else:
        for h in hs:
            p = (base / h).resolve()
            if p.suffix not in (".c", ".o"):
                errors.append(f"{label}: handler file '{h}' must be a C source (.c) or a relocatable object (.o)")
            elif not p.is_file():
                errors.append(f"{label}: handler file '{h}' not found ({p})")
            else:
                handlers.append(p)
    optimize = doc.get("optimize", True)
    if not isinstance(optimize, bool):
        errors.append(f"{label}: 'optimize' must be a boolean (true or false), got {_show(optimize)}")
    events = doc.get("events", [])
    if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
        errors.append(f"{label}: 'events' must be a list of strings")
        events = []
    kprobes, kretprobes = [], []
    for key, keys, cls, out in (("kprobe", KPROBE_KEYS, KprobeSpec, kprobes),
                                ("kretprobe", KRETPROBE_KEYS, KretprobeSpec, kretprobes)):
        tables = doc.get(key, [])
        if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
            errors.append(f"{label}: '{key}' must be an array of tables ([[{key}]])")
            continue
        for i, t in enumerate(tables, 1):
            name = f"[[{key}]] #{i}"
            r = _table(name, f"{label}: {name}", t, keys, cls, errors)
            if r is not None:
                out.append(r)
    if errors:
        raise KprewriteError(*errors)
    return Spec(path.resolve(), handlers, optimize, kprobes, kretprobes, list(events))

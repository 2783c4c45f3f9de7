"""Reading a binary trace: the file a rewritten program writes with
KPREWRITE_TRACE_FORMAT=binary (runtime/kp_trace.c, "Binary records"), formatted into
exactly the trace lines the program would have written as text.

The kernel's shape: a hit stores its record (the fetched args in binary, kp_trace.h) in
the ftrace ring buffer and print_kprobe_event()/print_kretprobe_event() (the runtime's
kp_trace_format()) print it only when the trace is read.  Here the buffer is the file,
and the printing is this module's: the events' names, fetch-arg layouts and the image's
symbols are in the file (each image's descriptor chunk), so the file alone is enough.

Layout (all little-endian, as the writer's CPU stores it; KP_BT_CHUNK-byte chunks):
  chunk 0           "KPTRACEB", version, state, chunk size, window size, 0x01020304, next
  an image          u32 kind=1, u32 its own index, u64 length; then u64 time base (ns),
                    u64 load bias, u32 pid, #events, #symbols, bytes of symbol names;
                    per event u16 is_return, u16 nargs, str name, str where, per arg
                    str name, u8 print, u8 size, u16 count (str: u16 length, bytes);
                    per symbol u64 addr, u64 size, u32 name offset; the names
  a thread's chunk  u32 kind=2, u32 image, u64 0; then 8-byte words: records, up to a
                    zero word or the chunk's end
  a record          (ns << 16 | id): id = event index + 1, or 0xffff: a context record
                    (tid | pid << 32, cpu, comm[16]); a return event adds the address
                    returned to; an event with args the record's length and its bytes,
                    padded to a word
"""
from __future__ import annotations

import bisect
import mmap
import struct
from dataclasses import dataclass

from ..errors import KprewriteError
from .record import LINE, Record, parse_line

MAGIC = b"KPTRACEB"
VERSION = 1
KIND_IMAGE, KIND_RECORDS = 1, 2
CTX = 0xFFFF
MASK64 = (1 << 64) - 1

# enum { KP_PRINT_U, KP_PRINT_S, KP_PRINT_X, KP_PRINT_CHAR, KP_PRINT_SYMBOL, KP_PRINT_STRING, KP_PRINT_SYMSTR }
P_U, P_S, P_X, P_CHAR, P_SYMBOL, P_STRING, P_SYMSTR = range(7)
# enum { KP_REC_VAL = 1, KP_REC_FAULT, KP_REC_STR, KP_REC_ARG_FAULT }
R_VAL, R_FAULT, R_STR, R_ARG_FAULT = 1, 2, 3, 4
# kp_trace_write(): a line's body (after 64 bytes of context) ends 1 byte before KP_TRACE_LINE (2048).
BODY_MAX = 2048 - 1 - 64


def is_binary(head: bytes) -> bool:
    return head[:8] == MAGIC


@dataclass
class Arg:
    name: bytes
    print: int
    size: int
    count: int


@dataclass
class Event:
    name: bytes
    where: bytes
    is_return: bool
    args: list


class Image:
    """One image's descriptor: its events and kp_syms[] (for `CALLER+off/size` and the
    symbol fetch types), its load bias and time base."""

    def __init__(self, data: bytes, at: int, length: int, where: str):
        end = at + length
        if end > len(data):
            raise KprewriteError(f"{where}: damaged binary trace: the image descriptor at offset 0x{at - 16:x} "
                                 f"runs past the end of the file")
        try:
            self._parse(data, at, end)
        except (struct.error, IndexError, ValueError):
            raise KprewriteError(f"{where}: damaged binary trace: the image descriptor at offset 0x{at - 16:x} "
                                 f"does not parse") from None

    def _parse(self, data: bytes, at: int, end: int) -> None:
        # Bounded by the descriptor's own length: a damaged count never reads another chunk.
        data = memoryview(data)[:end]
        self.base, self.bias, self.pid, nev, nsyms, nnames = struct.unpack_from("<QQIIII", data, at)
        p = at + 32

        def string():
            nonlocal p
            (n,) = struct.unpack_from("<H", data, p)
            if p + 2 + n > end:
                raise ValueError
            s = bytes(data[p + 2:p + 2 + n])
            p += 2 + n
            return s
        self.events = []
        for _ in range(nev):
            is_ret, nargs = struct.unpack_from("<HH", data, p)
            p += 4
            name, loc = string(), string()
            args = []
            for _ in range(nargs):
                an = string()
                pr, size, count = struct.unpack_from("<BBH", data, p)
                if pr > P_SYMSTR:
                    raise ValueError
                p += 4
                args.append(Arg(an, pr, size, count))
            self.events.append(Event(name, loc, bool(is_ret), args))
        if p + 20 * nsyms + nnames != end:
            raise ValueError
        syms = [struct.unpack_from("<QQI", data, p + 20 * i) for i in range(nsyms)]
        p += 20 * nsyms
        names = bytes(data[p:p + nnames])
        self.addrs = [a for a, _, _ in syms]
        self.syms = []
        for a, s, n in syms:
            e = names.find(b"\0", n)
            self.syms.append((a, s, names[n:e if e >= 0 else len(names)]))

    def sym(self, addr: int, with_offset: bool = True) -> bytes:
        """kp_line_sym(): "sym+0xoff/0xsize" of the image's symbols, else the address."""
        a = (addr - self.bias) & MASK64
        lo = bisect.bisect_right(self.addrs, a)
        if lo:
            s_addr, s_size, name = self.syms[lo - 1]
            if a - s_addr < s_size:
                return name + (f"+0x{a - s_addr:x}/0x{s_size:x}".encode() if with_offset else b"")
        return f"0x{addr:x}".encode()


def _string(s: bytes) -> bytes:
    """kp_print_string(): quoted, control characters escaped."""
    out = bytearray(b'"')
    for ch in s:
        if ch in (0x5C, 0x22):
            out += bytes((0x5C, ch))
        elif ch < 0x20 or ch == 0x7F:
            out += b"\\n" if ch == 10 else b"\\t" if ch == 9 else f"\\x{ch:02x}".encode()
        else:
            out.append(ch)
    return bytes(out + b'"')


def _value(img: Image, a: Arg, v: int) -> bytes:
    """kp_print_value()."""
    bits = a.size * 8
    mask = MASK64 if bits >= 64 else (1 << bits) - 1
    if a.print == P_U:
        return str(v & mask).encode()
    if a.print == P_S:
        if bits < 64 and bits:
            v &= mask
            if v >> (bits - 1):
                v -= 1 << bits
        elif v >> 63:
            v -= 1 << 64
        return str(v).encode()
    if a.print == P_X:
        return f"0x{v & mask:x}".encode()
    if a.print == P_CHAR:
        return b"'" + bytes((v & 0xFF,)) + b"'"
    if a.print == P_SYMBOL:
        return img.sym(v)
    if a.print == P_SYMSTR:
        return b'"' + img.sym(v) + b'"'
    return b""


def _arg(out: bytearray, img: Image, a: Arg, rec: bytes, p: int) -> int:
    """kp_print_arg(): one argument's text from the record at p; its end, or -1 when the
    record ended first (the line is cut)."""
    end = len(rec)
    if p >= end:
        return -1
    if rec[p] == R_ARG_FAULT:
        out += b"(fault)"
        return p + 1
    n = a.count or 1
    size = a.size if 0 < a.size < 8 else 8
    if a.count:
        out += b"{"
    for i in range(n):
        if i:
            out += b","
        if p >= end:
            return -1
        tag = rec[p]
        p += 1
        if tag == R_VAL:
            if end - p < size:
                return -1
            out += _value(img, a, int.from_bytes(rec[p:p + size], "little"))
            p += size
        elif tag == R_FAULT:
            out += b"(fault)"
        elif tag == R_STR:
            if end - p < 2:
                return -1
            ln = rec[p] | rec[p + 1] << 8
            p += 2
            if end - p < ln:
                return -1
            out += _string(rec[p:p + ln])
            p += ln
        else:
            return -1
    if a.count:
        out += b"}"
    return p


def body(img: Image, ev: Event, ret_addr: int, rec: bytes) -> bytes:
    """kp_trace_format(): "EVENT: (SYM+off/size) name=value ..." or
    "EVENT: (CALLER+off/size <- FUNC) ...", cut with "..." as a line of the runtime is."""
    out = bytearray(ev.name)
    if ev.is_return:
        out += b": (" + img.sym(ret_addr) + b" <- " + ev.where + b")"
    else:
        out += b": " + ev.where
    p, cut = 0, False
    for a in ev.args:
        out += b" " + a.name + b"="
        p = _arg(out, img, a, rec, p)
        if p < 0:
            cut = True
            break
    if cut or len(out) >= BODY_MAX:
        return bytes(out[:min(len(out), BODY_MAX - 3)]) + b"..."
    return bytes(out)


def scan(data, where: str) -> tuple[int, dict, list]:
    """The header checked, and the chunks: (chunk size, {chunk index: Image}, [(chunk
    index, image index)] of the records chunks in file order)."""
    if not is_binary(data):
        raise KprewriteError(f"{where}: not a binary trace")
    if len(data) < 64:
        raise KprewriteError(f"{where}: a binary trace truncated ({len(data)} bytes: its header is 64)")
    version, state, chunk, window, endian = struct.unpack_from("<IIIII", data, 8)
    if endian != 0x01020304:
        raise KprewriteError(f"{where}: a binary trace of a big-endian CPU (not supported)")
    if version != VERSION:
        raise KprewriteError(f"{where}: binary trace version {version}; this kprewrite reads version {VERSION}")
    if chunk < 4096 or chunk & (chunk - 1) or window < chunk or window % chunk:
        raise KprewriteError(f"{where}: binary trace header damaged (chunk size {chunk}, window {window})")
    # The runtime grows the file a window at a time from its first (an image's descriptor
    # by whole chunks): any other size is a file cut short.
    if len(data) < window or len(data) % chunk:
        raise KprewriteError(f"{where}: a binary trace truncated ({len(data)} bytes: not a whole number of "
                             f"{chunk}-byte chunks of at least one {window}-byte window)")

    images: dict[int, Image] = {}
    pending = []
    nchunks, i = len(data) // chunk, 1
    while i < nchunks:
        at = i * chunk
        kind, image, length = struct.unpack_from("<IIQ", data, at)
        if kind == KIND_IMAGE:
            images[i] = Image(data, at + 16, length, where)
            i += max(1, (16 + length + chunk - 1) // chunk)
            continue
        # Any other kind is not claimed yet, or the continuation of a descriptor whose
        # header was never written (a process killed between its two pwrite()s).
        if kind == KIND_RECORDS:
            pending.append((i, image))
        if isinstance(data, mmap.mmap):     # the pages its read mapped let go of (trace/stream.py)
            data.madvise(mmap.MADV_DONTNEED, at, chunk)
        i += 1
    return chunk, images, pending


def records(data: bytes, where: str) -> list:
    """The records of a binary trace as Records of the lines the program would
    have written as text, in time order (a thread's in the order written).  A line is
    parsed by tracefmt.parse_line() as a text line is, except where it is known to parse
    as its parts (a context, an event without args: checked once, then cached)."""
    chunk, images, pending = scan(data, where)

    def damaged(i: int, k: int, what: str) -> KprewriteError:
        return KprewriteError(f"{where}: damaged binary trace: {what} at offset 0x{i * chunk + 16 + 8 * k:x}")
    out: list = []
    bodies: dict = {}           # (image, event, return address) -> (body, (event, loc) or None: parse the line)
    seq = 0
    for i, image in pending:
        img = images.get(image)
        if img is None:                 # written after its image's descriptor, always
            raise damaged(i, -2, f"a records chunk of image {image}, which is not an image descriptor")
        at, end = i * chunk + 16, (i + 1) * chunk
        words = memoryview(data)[at:end].cast("Q")
        k, n = 0, len(words)
        ctx = None                      # (prefix, comm, pid, cpu); comm None: parse each line
        while k < n:
            w0 = words[k]
            if not w0:
                break
            ident, rel = w0 & 0xFFFF, w0 >> 16
            if ident == CTX:
                if k + 5 > n:
                    raise damaged(i, k, "a context record past the end of its chunk")
                tid, cpu = words[k + 1] & 0xFFFFFFFF, words[k + 2]
                comm = bytes(data[at + 8 * (k + 3):at + 8 * (k + 5)]).split(b"\0", 1)[0]
                prefix = (comm.rjust(16) + b"-" + str(tid).encode().ljust(7) +
                          f" [{cpu % 1000:03d}] ".encode()).decode("utf-8", errors="replace")
                m = LINE.match(prefix + "0.000000000: e: (x)")
                ctx = (prefix, m.group("comm"), int(m.group("pid")), int(m.group("cpu"))) if m else (prefix, None, 0, 0)
                k += 5
                continue
            if ident - 1 >= len(img.events):
                raise damaged(i, k, f"a record of event {ident}, of {len(img.events)} in its image")
            if ctx is None:             # a chunk starts with one, always
                raise damaged(i, k, "a record before its chunk's context record")
            ev = img.events[ident - 1]
            k0 = k
            k += 1
            ret = 0
            if ev.is_return:
                ret = words[k] if k < n else 0
                k += 1
            rec = b""
            if ev.args:
                ln = words[k] if k < n else 0
                k += 1
                rec = bytes(data[at + 8 * k:at + 8 * k + ln])
                k += (ln + 7) // 8
            if k > n:
                raise damaged(i, k0, "a record past the end of its chunk")
            ns = img.base + rel
            sec, frac = divmod(ns, 1_000_000_000)
            ts = f"{sec}.{frac:09d}"
            line_head = f"{ctx[0]}{sec:5d}.{frac:09d}: "
            if ev.args or ctx[1] is None:
                text, parts = body(img, ev, ret, rec).decode("utf-8", errors="replace"), None
            else:
                key = (image, ident, ret)
                if key not in bodies:
                    t = body(img, ev, ret, rec).decode("utf-8", errors="replace")
                    m = LINE.match("x-1 [000] 0.0: " + t)
                    if m and not m.group("ip") and not m.group("args"):
                        # What Record derives from (event, loc), once per key.
                        probe = Record("", 0, 0, "0.0", m.group("event"), m.group("loc"), {})
                        bodies[key] = (t, (probe.event, probe.loc, {"is_return": probe.is_return,
                                                                    "func": probe.func,
                                                                    "is_entry": probe.is_entry}))
                    else:
                        bodies[key] = (t, None)
                text, parts = bodies[key]
            if parts is None:
                r = parse_line(line_head + text)
            else:
                r = Record(ctx[1], ctx[2], ctx[3], ts, parts[0], parts[1], {}, line_head + text)
                r.__dict__.update(parts[2], ts_ns=ns)
            if r is not None:
                out.append((ns, seq, r))
                seq += 1
    out.sort(key=lambda t: (t[0], t[1]))
    return [r for _, _, r in out]

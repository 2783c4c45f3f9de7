"""Call-frame information: .eh_frame FDEs and C++ LSDA landing pads.

Only headers are parsed (no CFA programs), straight from the bytes, so the
whole .eh_frame of a large library reads in a fraction of a second."""
from __future__ import annotations

import struct
from dataclasses import dataclass

from .errors import KprewriteError


@dataclass(frozen=True)
class Fde:
    start: int
    end: int
    lsda: int | None


class _Mem:
    """Link-time virtual address -> bytes of the file, through PT_LOAD segments."""

    def __init__(self, data: bytes):
        self.data = data
        phoff, = struct.unpack_from("<Q", data, 32)
        phnum, = struct.unpack_from("<H", data, 56)
        self.loads = []
        for i in range(phnum):
            t, _, off, va, _, fsz, _, _ = struct.unpack_from("<IIQQQQQQ", data, phoff + i * 56)
            if t == 1:
                self.loads.append((va, va + fsz, off))

    def off(self, addr: int) -> int | None:
        for lo, hi, off in self.loads:
            if lo <= addr < hi:
                return off + addr - lo
        return None


def _uleb(d, p):
    r = s = 0
    while True:
        b = d[p]
        p += 1
        r |= (b & 0x7F) << s
        s += 7
        if b < 0x80:
            return r, p


def _sleb(d, p):
    r = s = 0
    while True:
        b = d[p]
        p += 1
        r |= (b & 0x7F) << s
        s += 7
        if b < 0x80:
            if b & 0x40:
                r -= 1 << s
            return r, p


def _ptr(d, p, enc, vaddr_of_p):
    """Read a DW_EH_PE-encoded pointer at d[p]; returns (value, new p)."""
    if enc == 0xFF:
        return None, p
    fmt = enc & 0x0F
    if fmt == 0x00:
        v, = struct.unpack_from("<Q", d, p); n = 8
    elif fmt == 0x01:
        v, p2 = _uleb(d, p); n = p2 - p
    elif fmt == 0x02:
        v, = struct.unpack_from("<H", d, p); n = 2
    elif fmt == 0x03:
        v, = struct.unpack_from("<I", d, p); n = 4
    elif fmt == 0x04:
        v, = struct.unpack_from("<Q", d, p); n = 8
    elif fmt == 0x09:
        v, p2 = _sleb(d, p); n = p2 - p
    elif fmt == 0x0A:
        v, = struct.unpack_from("<h", d, p); n = 2
    elif fmt == 0x0B:
        v, = struct.unpack_from("<i", d, p); n = 4
    elif fmt == 0x0C:
        v, = struct.unpack_from("<q", d, p); n = 8
    else:
        raise ValueError(f"pointer encoding {enc:#x}")
    app = enc & 0x70
    if app == 0x10:
        v += vaddr_of_p
    elif app not in (0x00, 0x30):
        pass   # textrel/funcrel/aligned: not emitted by gcc for x86-64 here
    return v & (2**64 - 1), p + n


def _eh_frame(data: bytes, mem: _Mem):
    shoff, = struct.unpack_from("<Q", data, 40)
    shnum, shstrndx = struct.unpack_from("<HH", data, 60)
    if shoff and shnum and shoff + shnum * 64 <= len(data):
        stroff, = struct.unpack_from("<Q", data, shoff + shstrndx * 64 + 24)
        for i in range(shnum):
            name, typ, _, addr, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * 64)
            end = data.find(b"\0", stroff + name)
            if data[stroff + name:end] == b".eh_frame" and typ != 8:
                return addr, off, size
    return None


def read_fdes(data: bytes) -> list[Fde]:
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise KprewriteError("not an ELF file")
    mem = _Mem(data)
    sec = _eh_frame(data, mem)
    if sec is None:
        return []
    base, off0, size = sec
    d = data
    cies: dict[int, tuple[int, int]] = {}    # cie offset -> (fde ptr encoding, lsda encoding)
    out = []
    p = off0
    end = off0 + size
    try:
        while p + 4 <= end:
            length, = struct.unpack_from("<I", d, p)
            if length == 0:
                break
            hdr = 4
            if length == 0xFFFFFFFF:
                length, = struct.unpack_from("<Q", d, p + 4)
                hdr = 12
            body = p + hdr
            nxt = body + length
            cie_id, = struct.unpack_from("<I", d, body)
            if cie_id == 0:
                q = body + 5          # id, version
                zend = d.index(b"\0", q)
                aug = d[q:zend].decode("latin-1")
                q = zend + 1
                _, q = _uleb(d, q)   # code align
                _, q = _sleb(d, q)   # data align
                q += 1 if d[body + 4] == 1 else 0
                if d[body + 4] != 1:
                    _, q = _uleb(d, q)
                fenc, lenc = 0, 0xFF
                if aug.startswith("z"):
                    _, q = _uleb(d, q)
                    for c in aug[1:]:
                        if c == "R":
                            fenc = d[q]; q += 1
                        elif c == "L":
                            lenc = d[q]; q += 1
                        elif c == "P":
                            penc = d[q]; q += 1
                            _, q = _ptr(d, q, penc & 0x7F, base + q - off0)
                cies[p] = (fenc, lenc)
            else:
                cie = body - cie_id
                fenc, lenc = cies.get(cie, (0, 0xFF))
                q = body + 4
                start, q = _ptr(d, q, fenc, base + q - off0)
                rng, q = _ptr(d, q, fenc & 0x0F, 0)
                lsda = None
                if lenc != 0xFF:
                    _, q2 = _uleb(d, q)
                    q = q2
                    lsda, q = _ptr(d, q, lenc, base + q - off0)
                    lsda = lsda or None
                if rng:
                    out.append(Fde(start, start + rng, lsda))
            p = nxt
    except (struct.error, IndexError, ValueError):
        raise KprewriteError(f"malformed .eh_frame at {base + p - off0:#x}")
    out.sort(key=lambda f: f.start)
    return out


def landing_pads(data: bytes, fdes: list[Fde]) -> dict[int, list[int]]:
    mem = _Mem(data)
    out: dict[int, list[int]] = {}
    for f in fdes:
        if f.lsda is None:
            continue
        p = mem.off(f.lsda)
        if p is None:
            continue
        vbase = f.lsda - p
        d = data
        try:
            lpenc = d[p]; p += 1
            lpstart = f.start
            if lpenc != 0xFF:
                lpstart, p = _ptr(d, p, lpenc, vbase + p)
            ttenc = d[p]; p += 1
            if ttenc != 0xFF:
                _, p = _uleb(d, p)
            csenc = d[p]; p += 1
            cslen, p = _uleb(d, p)
            csend = p + cslen
            pads = set()
            while p < csend:
                _, p = _ptr(d, p, csenc, vbase + p)
                _, p = _ptr(d, p, csenc, vbase + p)
                lp, p = _ptr(d, p, csenc, vbase + p)
                _, p = _uleb(d, p)
                if lp:
                    pads.add(lpstart + lp)
            if pads:
                out[f.start] = sorted(pads)
        except (struct.error, IndexError, ValueError):
            raise KprewriteError(f"malformed LSDA at {f.lsda:#x}")
    return out

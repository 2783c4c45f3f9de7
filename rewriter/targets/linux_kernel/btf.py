"""The kernel's types, from the image's own BTF (.BTF): what a handler written as
module code needs to read `current->comm`, `current->pid` or a `struct file *`
argument, with no headers package.

`bpftool btf dump file vmlinux format c` writes every type as C; this module
writes the same types in a form that cannot clash with the handler API's own
headers: every named struct and union, each member at its BTF offset (a union of
packed structs, each a padding array and one member), typedefs and enums
resolved to the integer they are, and the handler API's own tags (struct kprobe,
struct pt_regs, ...) either reused (pt_regs: the same layout) or renamed.  The
result is linux/sched.h for kernel handlers, with `current` read as the kernel's
get_current() does, which the architecture's part of the target says (x86-64: the
per-CPU `current_task`, or `pcpu_hot.current_task` in Linux 6.2+; x86_64/percpu.py).
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

from ... import cache
from ...errors import KprewriteError

BTF_MAGIC = 0xEB9F
(INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FUNC_PROTO,
 VAR, DATASEC, FLOAT, DECL_TAG, TYPE_TAG, ENUM64) = range(1, 20)
QUALIFIERS = (TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG)
# Tags the handler API defines itself (runtime/include/kprewrite/kprobes.h):
# pt_regs has the kernel's layout and is reused; the others are renamed.
OWN_TAGS = {"pt_regs": None, "kprobe": "kp_btf_kprobe", "kretprobe": "kp_btf_kretprobe",
            "kretprobe_instance": "kp_btf_kretprobe_instance",
            # arm64's pt_regs holds a user_pt_regs, which the handler API defines too.
            "user_pt_regs": "kp_btf_user_pt_regs"}
GENERATOR = b"kprewrite-btf-sched-h-7-bpf"


@dataclass
class BtfType:
    kind: int
    name: str
    size_or_type: int
    kind_flag: bool
    members: list          # STRUCT/UNION: (name, type, bit offset, bitfield size)
    array: tuple = ()      # ARRAY: (element type, nelems)
    nr_bits: int = 0       # INT
    values: tuple = ()     # ENUM: (name, value) of each enumerator
    encoding: int = 0      # INT: BTF_INT_SIGNED (1), BTF_INT_CHAR (2), BTF_INT_BOOL (4)
    params: tuple = ()     # FUNC_PROTO: (name, type) of each parameter (perfprobe reads them)


_PARSED: dict[bytes, list] = {}        # the last parse, by the BTF's digest (several readers per run)


def parse(data: bytes, where: str) -> list[BtfType | None]:
    """Types by id (0: void), from a .BTF section's bytes (include/uapi/linux/btf.h), parsed
    once per process (a kernel's 5 MB take seconds; the handlers' types, the unwinder's layout
    and the events' each read them).  The list is shared: not to be changed."""
    digest = hashlib.blake2b(data, digest_size=16).digest()
    got = _PARSED.get(digest)
    if got is None:
        _PARSED.clear()
        got = _PARSED[digest] = _parse(data, where)
    return got


def _parse(data: bytes, where: str) -> list[BtfType | None]:
    if len(data) < 24:
        raise KprewriteError(f"{where}: .BTF is truncated")
    magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", data)
    if magic != BTF_MAGIC:
        raise KprewriteError(f"{where}: .BTF has magic {magic:#x}, not {BTF_MAGIC:#x}")
    types_at, strs_at = hdr_len + type_off, hdr_len + str_off
    if types_at + type_len > len(data) or strs_at + str_len > len(data):
        raise KprewriteError(f"{where}: .BTF's type or string section runs past its end")
    strs = data[strs_at:strs_at + str_len]

    def name(off: int) -> str:
        end = strs.find(b"\0", off)
        return strs[off:end if end >= 0 else len(strs)].decode("ascii", "replace")

    out: list[BtfType | None] = [None]
    p, end = types_at, types_at + type_len
    try:
        while p < end:
            name_off, info, st = struct.unpack_from("<III", data, p)
            p += 12
            kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, bool(info >> 31)
            t = BtfType(kind, name(name_off), st, kflag, [])
            if kind == INT:
                word = struct.unpack_from("<I", data, p)[0]
                t.nr_bits, t.encoding = word & 0xFF, (word >> 24) & 0x0F
                p += 4
            elif kind == ARRAY:
                elem, _index, nelems = struct.unpack_from("<III", data, p)
                t.array = (elem, nelems)
                p += 12
            elif kind in (STRUCT, UNION):
                for i in range(vlen):
                    m_name, m_type, m_off = struct.unpack_from("<III", data, p + 12 * i)
                    bits = m_off >> 24 if kflag else 0
                    t.members.append((name(m_name), m_type, m_off & 0xFFFFFF if kflag else m_off, bits))
                p += 12 * vlen
            elif kind == ENUM:
                t.values = tuple((name(struct.unpack_from("<I", data, p + 8 * i)[0]),
                                  struct.unpack_from("<i" if kflag else "<I", data, p + 8 * i + 4)[0])
                                 for i in range(vlen))
                p += 8 * vlen
            elif kind == ENUM64:
                p += 12 * vlen
            elif kind == FUNC_PROTO:
                t.params = tuple((name(struct.unpack_from("<I", data, p + 8 * i)[0]),
                                  struct.unpack_from("<I", data, p + 8 * i + 4)[0]) for i in range(vlen))
                p += 8 * vlen
            elif kind == VAR:
                p += 4
            elif kind == DATASEC:
                p += 12 * vlen
            elif kind == DECL_TAG:
                p += 4
            elif kind not in (PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FLOAT, TYPE_TAG):
                raise KprewriteError(f"{where}: .BTF type {len(out)} has unknown kind {kind}")
            out.append(t)
    except struct.error:
        raise KprewriteError(f"{where}: .BTF's type section is truncated at type {len(out)}") from None
    return out


class _Writer:
    """C for the types, each aggregate as a union of packed (padding, member) structs."""

    def __init__(self, types: list[BtfType | None]):
        self.t = types
        self.tags: dict[int, str] = {}      # aggregate id -> its C tag
        taken: dict[str, int] = {}
        for i, t in enumerate(types):
            if t is not None and t.kind in (STRUCT, UNION) and t.name:
                base = OWN_TAGS.get(t.name, t.name) or t.name
                n = taken.get(base, 0)
                taken[base] = n + 1
                self.tags[i] = base if n == 0 else f"{base}___{n + 1}"
        self.done: set[int] = set()
        self.out: list[str] = []
        self.serial = 0

    def strip(self, tid: int) -> int:
        while tid and self.t[tid].kind in QUALIFIERS:
            tid = self.t[tid].size_or_type
        return tid

    def keyword(self, tid: int) -> str:
        return "union" if self.t[tid].kind == UNION else "struct"

    def decl(self, tid: int, name: str) -> str:
        """A declaration of `name` with type tid (typedefs and qualifiers dropped)."""
        tid = self.strip(tid)
        if tid == 0:
            return f"void {name}"
        t = self.t[tid]
        if t.kind in (INT, FLOAT):
            return f"{t.name} {name}"
        if t.kind in (ENUM, ENUM64):
            return f"{ {1: 'unsigned char', 2: 'unsigned short', 8: 'unsigned long long'}.get(t.size_or_type, 'int')} {name}"
        if t.kind == PTR:
            to = self.strip(t.size_or_type)
            if to == 0 or self.t[to].kind in (INT, FLOAT, ENUM, ENUM64, STRUCT, UNION, FWD, PTR):
                return self.decl(to, f"*{name}")
            return f"void *{name}"         # pointers to functions and arrays
        if t.kind == ARRAY:
            return self.decl(t.array[0], f"{name}[{t.array[1]}]")
        if t.kind in (STRUCT, UNION):
            if tid in self.tags:
                if self.t[tid].name == "pt_regs":
                    return f"struct pt_regs {name}"
                return f"{self.keyword(tid)} {self.tags[tid]} {name}"
            return f"{self.keyword(tid)} {{ {self.body(tid)} }} {name}"
        if t.kind == FWD:
            return f"{'union' if t.kind_flag else 'struct'} {OWN_TAGS.get(t.name) or t.name} {name}"
        return f"void *{name}"

    def body(self, tid: int) -> str:
        """Members at their offsets; bitfields as packed bitfields after their padding."""
        t = self.t[tid]
        self.serial += 1
        parts = [f"char __kp_size{self.serial}[{t.size_or_type}];"]
        for name, mtype, bit_off, bits in t.members:
            m = self.strip(mtype)
            if not name and not (m and self.t[m].kind in (STRUCT, UNION) and m not in self.tags):
                continue
            self.serial += 1
            pad = f"char __kp_pad{self.serial}[{bit_off // 8}]; " if bit_off >= 8 else ""
            if bits or (m and self.t[m].kind == INT and self.t[m].nr_bits not in (0, 8 * self.t[m].size_or_type)):
                width = bits or self.t[m].nr_bits
                base = self.t[m].name if m and self.t[m].kind == INT else "unsigned int"
                lead = f"unsigned long long : {bit_off % 8}; " if bit_off % 8 else ""
                parts.append(f"struct __attribute__((packed)) {{ {pad}{lead}{base} {name} : {width}; }};")
            else:
                parts.append(f"struct __attribute__((packed)) {{ {pad}{self.decl(mtype, name)}; }};")
        return "union { " + " ".join(parts) + " };"

    def need(self, tid: int) -> None:
        """Define tid's tag after every aggregate it holds by value."""
        if tid in self.done or tid not in self.tags or self.t[tid].name == "pt_regs":
            return
        self.done.add(tid)
        self.by_value(tid)
        self.out.append(f"{self.keyword(tid)} {self.tags[tid]} {{ {self.body(tid)} }};")

    def by_value(self, tid: int) -> None:
        for _, mtype, _, _ in self.t[tid].members:
            m = self.strip(mtype)
            while m and self.t[m].kind == ARRAY:
                m = self.strip(self.t[m].array[0])
            if m and self.t[m].kind in (STRUCT, UNION):
                if m in self.tags:
                    self.need(m)
                else:
                    self.by_value(m)       # an anonymous aggregate, written inline

    def header(self, get_current: str) -> str:
        for tid in sorted(self.tags):
            self.need(tid)
        fwd = [f"{self.keyword(i)} {n};" for i, n in sorted(self.tags.items()) if self.t[i].name != "pt_regs"]
        return "\n".join([
            "/* Generated by kprewrite from the kernel image's BTF: the kernel's structs and unions,",
            " * each member at its offset (typedefs and enums as their integers). */",
            "#ifndef _KPREWRITE_SCHED_H", "#define _KPREWRITE_SCHED_H", "#include <kprewrite/kprobes.h>",
            *fwd, *self.out,
            "/* get_current(): the CPU's current task, a per-CPU variable. */",
            get_current.rstrip("\n"),
            "#define current kp_get_current()", "#endif", ""])


def member_offset(types: list[BtfType | None], struct_name: str, member: str) -> int | None:
    """A member's byte offset in a named struct (anonymous members searched)."""
    def find(tid: int, base: int) -> int | None:
        for name, mtype, bit_off, _ in types[tid].members:
            m = mtype
            while m and types[m].kind in QUALIFIERS:
                m = types[m].size_or_type
            if name == member:
                return base + bit_off // 8
            if not name and m and types[m].kind in (STRUCT, UNION):
                r = find(m, base + bit_off // 8)
                if r is not None:
                    return r
        return None
    for i, t in enumerate(types):
        if t is not None and t.kind == STRUCT and t.name == struct_name:
            return find(i, 0)
    return None


@dataclass(frozen=True)
class KernelTypes:
    sched_h: str              # linux/sched.h for handlers
    current: str              # the per-CPU variable holding the current task (+ offset)
    comm: int | None          # offsetof(struct task_struct, comm)
    pid: int | None           # offsetof(struct task_struct, pid)
    # struct file_operations: [sizeof, offsetof llseek, read, write], for the runtime's
    # debugfs files (runtime/platform/linux_kernel/kp_debugfs.c); None if BTF lacks it.
    fops: list | None = None
    # The tracing structures our trace events' own output types need (runtime/platform/
    # linux_kernel/kp_trace_buffer.c): [sizeof struct trace_entry, sizeof struct trace_event,
    # offsetof its type, funcs; offsetof struct trace_iterator's seq, ent, ent_size; offsetof
    # struct trace_array's array_buffer.buffer]; None if BTF lacks any of them.  Then what
    # their trace_event_call (events/kprobes/<EVENT>/) needs (_CALL_LAYOUT), -1 for each if
    # BTF lacks any of it.
    trace: list | None = None


def _sizeof(types, name: str) -> int | None:
    return next((t.size_or_type for t in types if t is not None and t.kind == STRUCT and t.name == name), None)


def enum_value(types, name: str) -> int | None:
    """An enumerator's value (anonymous enums included)."""
    for t in types:
        if t is not None and t.kind == ENUM:
            for n, v in t.values:
                if n == name:
                    return v
    return None


# What register_kprobe_event() fills in and __kprobe_trace_func() uses, for our events'
# trace_event_call (runtime/platform/linux_kernel/kp_trace_buffer.c, KP_TR_CALL_SIZE on):
# ("struct", member) an offset, ("struct", None) a size, (None, "NAME") an enumerator.
_CALL_LAYOUT = (
    ("trace_event_call", None), ("trace_event_call", "class"), ("trace_event_call", "name"),
    ("trace_event_call", "event"), ("trace_event_call", "print_fmt"),
    ("trace_event_class", None), ("trace_event_class", "system"), ("trace_event_class", "reg"),
    ("trace_event_class", "fields_array"), ("trace_event_class", "fields"),
    ("trace_event_fields", None), ("trace_event_fields", "define_fields"),
    ("trace_event_buffer", None), ("trace_event_buffer", "entry"), ("trace_event_buffer", "regs"),
    ("trace_event_file", "flags"),
    (None, "EVENT_FILE_FL_TRIGGER_MODE_BIT"), (None, "EVENT_FILE_FL_SOFT_DISABLED_BIT"),
    (None, "EVENT_FILE_FL_PID_FILTER_BIT"), (None, "TRACE_REG_REGISTER"), (None, "TRACE_REG_UNREGISTER"),
    (None, "FILTER_OTHER"),
)

# What perf's side of the events needs (kprobe_register()'s TRACE_REG_PERF_* cases,
# kprobe_perf_func()'s call->perf_events), after the call's: each -1 on its own when BTF
# lacks it (a kernel without CONFIG_PERF_EVENTS: perf stays refused, the rest works).
_PERF_LAYOUT = (
    ("trace_event_call", "perf_events"), (None, "TRACE_REG_PERF_REGISTER"), (None, "TRACE_REG_PERF_UNREGISTER"),
    (None, "TRACE_REG_PERF_OPEN"), (None, "TRACE_REG_PERF_CLOSE"), (None, "TRACE_REG_PERF_ADD"),
    (None, "TRACE_REG_PERF_DEL"),
)

# What BPF programs on the events need (perf_event_set_bpf_prog() takes a BPF_PROG_TYPE_KPROBE
# program on a call flagged TRACE_EVENT_FL_KPROBE, perf_event_attach_bpf_prog() puts it in
# call->prog_array, kprobe_perf_func() runs it), then where a trace_probe_event's `probes`
# list lies from its call (the kernel reads it through container_of() on such a call:
# trace_kprobe_primary_from_call(), which our empty list answers with NULL).  -1: no BPF.
_BPF_LAYOUT = (
    ("trace_event_call", "flags"), ("trace_event_call", "prog_array"), (None, "TRACE_EVENT_FL_KPROBE"),
)

# The entries every event call needs; the perf ones follow, then BPF's.
TRACE_CALL_LEN = 8 + len(_CALL_LAYOUT)
TRACE_LAYOUT_LEN = TRACE_CALL_LEN + len(_PERF_LAYOUT) + len(_BPF_LAYOUT) + 1


def _layout_values(types, layout) -> list:
    return [enum_value(types, m) if s is None else _sizeof(types, s) if m is None else member_offset(types, s, m)
            for s, m in layout]


def _trace_layout(types) -> list | None:
    buf = [member_offset(types, "trace_array", "array_buffer"), member_offset(types, "array_buffer", "buffer")]
    out = [_sizeof(types, "trace_entry"), _sizeof(types, "trace_event"),
           member_offset(types, "trace_event", "type"), member_offset(types, "trace_event", "funcs"),
           member_offset(types, "trace_iterator", "seq"), member_offset(types, "trace_iterator", "ent"),
           member_offset(types, "trace_iterator", "ent_size"), None if None in buf else sum(buf)]
    if None in out:
        return None
    call = _layout_values(types, _CALL_LAYOUT)
    perf = _layout_values(types, _PERF_LAYOUT)
    tpe = [member_offset(types, "trace_probe_event", m) for m in ("call", "probes")]
    bpf = _layout_values(types, _BPF_LAYOUT) + [None if None in tpe else tpe[1] - tpe[0]]
    if None in bpf:
        bpf = [None] * len(bpf)
    if None in call:
        call, perf, bpf = [-1] * len(call), [None] * len(perf), [None] * len(bpf)
    return out + call + [-1 if v is None else v for v in perf + bpf]


def kernel_types(btf: bytes, symbols: dict, where: str, kern) -> KernelTypes:
    """The image's types for handlers and the runtime's trace lines, cached by the BTF's
    contents.  kern: the architecture's part of the target (where the current task is
    and how it is read)."""
    currents = kern.current_tasks(symbols)
    k = cache.key(GENERATOR, btf, currents[0][0].encode(), kern.__name__.encode())
    hit = cache.get("btf-types", k)
    if hit is not None:
        d = json.loads(hit)
        return KernelTypes(d["sched_h"], d["current"], d["comm"], d["pid"], d["fops"], d["trace"])
    types = parse(btf, where)
    for var, member in currents:            # the first that BTF has
        off = 0 if member is None else member_offset(types, var, member)
        if off is not None:
            current = var if member is None else f"{var}+{off}"
            break
    get_current = kern.current_c("static inline __attribute__((always_inline)) "
                                 "struct task_struct *kp_get_current(void)", "struct task_struct", current)
    fops = [_sizeof(types, "file_operations")] + [member_offset(types, "file_operations", m)
                                                  for m in ("llseek", "read", "write")]
    kt = KernelTypes(_Writer(types).header(get_current), current, member_offset(types, "task_struct", "comm"),
                     member_offset(types, "task_struct", "pid"), None if None in fops else fops,
                     _trace_layout(types))
    cache.put("btf-types", k, json.dumps(kt.__dict__).encode())
    return kt


def layout(image, items: tuple, what: str) -> list:
    """_layout_values() of the image's own BTF for `items` ((struct, member) an offset, (struct,
    None) a size, (None, NAME) an enumerator), cached by the BTF's contents; refused in one line
    when the image has no BTF or BTF lacks one of them (`what` says who needs them)."""
    sec = image.section_named(".BTF")
    if sec is None:
        raise KprewriteError(f"{image.path}: no .BTF section: {what} needs the kernel's types")
    data = image.data[sec.offset:sec.offset + sec.size]
    k = cache.key(GENERATOR, data, json.dumps(items).encode())
    hit = cache.get("btf-layout", k)
    if hit is not None:
        return json.loads(hit)
    vals = _layout_values(parse(data, image.path), items)
    missing = [f"{s or ''}{'.' if s and m else ''}{m or ''}" for (s, m), v in zip(items, vals) if v is None]
    if missing:
        raise KprewriteError(f"{image.path}: the image's BTF lacks {', '.join(missing)}: {what} needs them")
    cache.put("btf-layout", k, json.dumps(vals).encode())
    return vals

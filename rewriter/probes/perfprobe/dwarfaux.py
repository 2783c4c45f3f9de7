"""DWARF helpers on DIEs and types (tools/perf/util/dwarf-aux.c's part): an attribute
through abstract origins and specifications, names, and what a type is (its size, array
count, encoding, members, printed name)."""
from __future__ import annotations

_QUALIFIERS = ("DW_TAG_typedef", "DW_TAG_const_type", "DW_TAG_volatile_type", "DW_TAG_restrict_type",
               "DW_TAG_atomic_type")


def _attr(die, name, follow=True):
    """An attribute of the DIE, or of its abstract origin / specification."""
    seen = 0
    while die is not None and seen < 8:
        a = die.attributes.get(name)
        if a is not None:
            return a
        if not follow:
            return None
        nxt = None
        for ref in ("DW_AT_abstract_origin", "DW_AT_specification"):
            if ref in die.attributes:
                nxt = die.get_DIE_from_attribute(ref)
                break
        die, seen = nxt, seen + 1
    return None


def die_name(die) -> str | None:
    a = _attr(die, "DW_AT_name")
    if a is None:
        return None
    v = a.value
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def _origin_type(die):
    """The DW_AT_type DIE of a DIE or of its abstract origin / specification."""
    for _ in range(8):
        if "DW_AT_type" in die.attributes:
            return die.get_DIE_from_attribute("DW_AT_type")
        for ref in ("DW_AT_abstract_origin", "DW_AT_specification"):
            if ref in die.attributes:
                die = die.get_DIE_from_attribute(ref)
                break
        else:
            return None
    return None


def strip(t):
    """The type under typedefs and qualifiers."""
    for _ in range(32):
        if t is None or t.tag not in _QUALIFIERS:
            return t
        t = t.get_DIE_from_attribute("DW_AT_type") if "DW_AT_type" in t.attributes else None
    return t


def target(t):
    return t.get_DIE_from_attribute("DW_AT_type") if t is not None and "DW_AT_type" in t.attributes else None


def byte_size(t) -> int | None:
    t = strip(t)
    if t is None:
        return None
    a = t.attributes.get("DW_AT_byte_size")
    if a is not None:
        return a.value
    if t.tag == "DW_TAG_pointer_type" or t.tag in ("DW_TAG_reference_type", "DW_TAG_rvalue_reference_type"):
        return 8
    if t.tag == "DW_TAG_array_type":
        n, e = array_count(t), byte_size(target(t))
        return n * e if n is not None and e is not None else None
    if t.tag == "DW_TAG_enumeration_type":
        return byte_size(target(t))
    return None


def array_count(t) -> int | None:
    for c in t.iter_children():
        if c.tag == "DW_TAG_subrange_type":
            if "DW_AT_count" in c.attributes and isinstance(c.attributes["DW_AT_count"].value, int):
                return c.attributes["DW_AT_count"].value
            if "DW_AT_upper_bound" in c.attributes and isinstance(c.attributes["DW_AT_upper_bound"].value, int):
                return c.attributes["DW_AT_upper_bound"].value + 1
            return None
    return None


def encoding(t) -> str | None:
    """DW_ATE_* name of a base type (an enum: its underlying type's, else unsigned)."""
    t = strip(t)
    if t is None:
        return None
    if t.tag == "DW_TAG_enumeration_type":
        u = target(t)
        return encoding(u) if u is not None else "DW_ATE_unsigned"
    if t.tag != "DW_TAG_base_type":
        return None
    from elftools.dwarf.enums import ENUM_DW_ATE
    v = t.attributes["DW_AT_encoding"].value if "DW_AT_encoding" in t.attributes else None
    for k, n in ENUM_DW_ATE.items():
        if n == v:
            return k
    return None


def member(t, name: str):
    """(member DIE, byte offset) of a field of a struct/union, looking through
    anonymous members."""
    for c in t.iter_children():
        if c.tag != "DW_TAG_member":
            continue
        off = _member_offset(c)
        cname = die_name(c)
        if cname == name:
            return c, off
        if cname is None:
            sub = strip(target(c))
            if sub is not None and sub.tag in ("DW_TAG_structure_type", "DW_TAG_union_type", "DW_TAG_class_type"):
                found = member(sub, name)
                if found is not None:
                    return found[0], off + found[1]
    return None


def _member_offset(m) -> int:
    a = m.attributes.get("DW_AT_data_member_location")
    if a is None:
        return 0
    if isinstance(a.value, int):
        return a.value
    if isinstance(a.value, list) and len(a.value) >= 2 and a.value[0] == 0x23:   # DW_OP_plus_uconst
        v, shift = 0, 0
        for b in a.value[1:]:
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        return v
    return 0


def type_name(t) -> str:
    """A C spelling of a type, for listings."""
    if t is None:
        return "void"
    tag = t.tag
    n = die_name(t)
    if tag == "DW_TAG_base_type" or tag == "DW_TAG_typedef":
        return n or "?"
    if tag == "DW_TAG_pointer_type":
        return type_name(target(t)) + "*"
    if tag in ("DW_TAG_const_type", "DW_TAG_volatile_type", "DW_TAG_restrict_type", "DW_TAG_atomic_type"):
        q = tag[7:-5]
        return f"{q} {type_name(target(t))}"
    if tag == "DW_TAG_structure_type":
        return f"struct {n or '(anon)'}"
    if tag == "DW_TAG_union_type":
        return f"union {n or '(anon)'}"
    if tag == "DW_TAG_enumeration_type":
        return f"enum {n or '(anon)'}"
    if tag == "DW_TAG_array_type":
        c = array_count(t)
        return f"{type_name(target(t))}[{'' if c is None else c}]"
    if tag == "DW_TAG_subroutine_type":
        return "func"
    return n or tag[7:]

"""rewriter.probes.spec: loading and validating the TOML spec (docs/reference/spec.md)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import ALL_ARCHES, write_spec
from rewriter.errors import KprewriteError
from rewriter.probes.spec import KprobeSpec, KretprobeSpec, Spec, load_spec

ARCHES = ALL_ARCHES


def errors(tmp: Path, text: str, *files: str) -> list[str]:
    for f in files:
        (tmp / f).write_text("int x;\n")
    with pytest.raises(KprewriteError) as e:
        load_spec(write_spec(tmp, text))
    assert str(e.value) == "\n".join(e.value.lines)
    return e.value.lines


FULL = '''\
handlers = ["handlers.c", "sub/extra.o"]
optimize = false

[[kprobe]]
symbol_name = "work"
offset = 4
pre_handler = "handler_pre"
post_handler = "handler_post"
disabled = true
name = "work_entry"
fetch = "x=%di:s64"

[[kprobe]]
addr = 0x401136
offset = 2

[[kretprobe]]
symbol_name = "work"
offset = 0
handler = "ret_handler"
entry_handler = "entry_handler"
maxactive = 20
data_size = 16
disabled = true
name = "work_ret"
fetch = "ret=$retval"

events = [
  "p:grp/work_entry work x=%di",
  "r20:work_ret work $retval",
]
'''


def test_every_key_round_trips(tmp_path):
    (tmp_path / "handlers.c").write_text("int x;\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "extra.o").write_bytes(b"\x7fELF")
    # `events` after [[kretprobe]] would belong to that table: move it to the top.
    text = 'events = [\n  "p:grp/work_entry work x=%di",\n  "r20:work_ret work $retval",\n]\n' + \
        FULL[:FULL.index("events = [")]
    spec = load_spec(str(write_spec(tmp_path, text)))
    assert spec == Spec(
        path=tmp_path / "probes.toml",
        handlers=[tmp_path / "handlers.c", tmp_path / "sub" / "extra.o"],
        optimize=False,
        kprobes=[
            KprobeSpec(table="[[kprobe]] #1", symbol_name="work", addr=None, offset=4,
                       pre_handler="handler_pre", post_handler="handler_post", disabled=True,
                       name="work_entry", fetch="x=%di:s64", is_glob=False),
            KprobeSpec(table="[[kprobe]] #2", symbol_name=None, addr=0x401136, offset=2),
        ],
        kretprobes=[
            KretprobeSpec(table="[[kretprobe]] #1", symbol_name="work", addr=None, offset=0,
                          handler="ret_handler", entry_handler="entry_handler", maxactive=20,
                          data_size=16, disabled=True, name="work_ret", fetch="ret=$retval"),
        ],
        events=["p:grp/work_entry work x=%di", "r20:work_ret work $retval"],
    )
    assert spec.path.is_absolute() and all(h.is_absolute() for h in spec.handlers)


def test_top_level_key_after_a_table_is_explained(tmp_path):
    (tmp_path / "handlers.c").write_text("int x;\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "extra.o").write_bytes(b"\x7fELF")
    assert errors(tmp_path, FULL) == [
        "probes.toml: [[kretprobe]] #1: unknown key 'events' "
        "(top-level keys go before the first [[...]] table)"]


def test_defaults(tmp_path):
    spec = load_spec(write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n'))
    assert spec.optimize is True
    assert spec.handlers == [] and spec.events == [] and spec.kretprobes == []
    assert spec.kprobes == [KprobeSpec("[[kprobe]] #1", "work", None)]
    k = spec.kprobes[0]
    assert (k.offset, k.pre_handler, k.post_handler, k.disabled, k.name, k.fetch, k.is_glob) == \
        (0, None, None, False, None, None, False)
    spec = load_spec(write_spec(tmp_path, '[[kretprobe]]\naddr = 4096\n'))
    assert spec.kretprobes == [KretprobeSpec("[[kretprobe]] #1", None, 4096)]
    r = spec.kretprobes[0]
    assert (r.maxactive, r.data_size, r.handler, r.entry_handler) == (0, 0, None, None)


def test_empty_spec_and_inline_array_of_tables(tmp_path):
    assert load_spec(write_spec(tmp_path, "")).kprobes == []
    spec = load_spec(write_spec(tmp_path, 'kprobe = [{symbol_name = "a"}, {addr = 1}]\n'))
    assert [(k.table, k.symbol_name, k.addr) for k in spec.kprobes] == \
        [("[[kprobe]] #1", "a", None), ("[[kprobe]] #2", None, 1)]


def test_tables_numbered_per_kind_in_file_order(tmp_path):
    spec = load_spec(write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "a"\n[[kretprobe]]\nsymbol_name = "b"\n'
                                     '[[kprobe]]\nsymbol_name = "c"\n'))
    assert [(k.table, k.symbol_name) for k in spec.kprobes] == [("[[kprobe]] #1", "a"), ("[[kprobe]] #2", "c")]
    assert [(k.table, k.symbol_name) for k in spec.kretprobes] == [("[[kretprobe]] #1", "b")]


@pytest.mark.parametrize("sym,glob", [
    ("work", False), ("*", True), ("work_*", True), ("wor?", True), ("[ab]work", True),
    ("_Z4workv", False), ("work.cold", False), ("operator]", False),
])
def test_glob_detection(tmp_path, sym, glob):
    spec = load_spec(write_spec(tmp_path, f'[[kprobe]]\nsymbol_name = "{sym}"\n'
                                     f'[[kretprobe]]\nsymbol_name = "{sym}"\n'))
    assert spec.kprobes[0].is_glob is glob and spec.kretprobes[0].is_glob is glob


def test_offset_with_addr_is_allowed(tmp_path):
    k = load_spec(write_spec(tmp_path, "[[kprobe]]\naddr = 0x1000\noffset = 3\n")).kprobes[0]
    assert (k.addr, k.offset, k.symbol_name) == (0x1000, 3, None)


def test_negative_maxactive_is_the_default_rule(tmp_path):
    r = load_spec(write_spec(tmp_path, '[[kretprobe]]\nsymbol_name = "f"\nmaxactive = -1\n')).kretprobes[0]
    assert r.maxactive == -1


def test_empty_fetch_and_event_strings_are_strings(tmp_path):
    spec = load_spec(write_spec(tmp_path, 'events = [""]\n[[kprobe]]\nsymbol_name = "f"\nfetch = ""\n'))
    assert spec.kprobes[0].fetch == "" and spec.events == [""]


def test_handler_paths_relative_to_spec_dir_not_cwd(tmp_path, monkeypatch):
    d = tmp_path / "conf"
    d.mkdir()
    (d / "h.c").write_text("int x;\n")
    (tmp_path / "abs.o").write_bytes(b"")
    write_spec(d, f'handlers = ["h.c", "../conf/./h2.c", "{tmp_path / "abs.o"}"]\n')
    (d / "h2.c").write_text("")
    monkeypatch.chdir(tmp_path)
    spec = load_spec("conf/probes.toml")
    assert spec.path == d / "probes.toml"
    assert spec.handlers == [d / "h.c", d / "h2.c", tmp_path / "abs.o"]


# --- errors: exactly one line per problem -----------------------------------------------------

@pytest.mark.parametrize("text,expect", [
    ('[[kprobe]]\nsymbol_name = "work"\noffest = 0\n',
     "probes.toml: [[kprobe]] #1: unknown key 'offest' (did you mean 'offset'?)"),
    ('[[kretprobe]]\nsymbol_name = "work"\nmax_active = 4\n',
     "probes.toml: [[kretprobe]] #1: unknown key 'max_active' (did you mean 'maxactive'?)"),
    ('[[kprobe]]\nsymbol_name = "work"\nhandler = "h"\n',
     "probes.toml: [[kprobe]] #1: unknown key 'handler' (did you mean 'pre_handler'?)"),
    ('[[kprobe]]\nsymbol_name = "work"\nzzz = 1\n',
     "probes.toml: [[kprobe]] #1: unknown key 'zzz'"),
    ('[[kprobe]]\n', "probes.toml: [[kprobe]] #1: needs exactly one of 'symbol_name' or 'addr'"),
    ('[[kprobe]]\nsymbol_name = "a"\naddr = 1\n',
     "probes.toml: [[kprobe]] #1: needs exactly one of 'symbol_name' or 'addr'"),
    ('[[kretprobe]]\noffset = 1\n',
     "probes.toml: [[kretprobe]] #1: needs exactly one of 'symbol_name' or 'addr'"),
    ('[[kprobe]]\nsymbol_name = "work"\noffset = "4"\n',
     "probes.toml: [[kprobe]] #1: 'offset' must be a non-negative integer, got \"4\""),
    ('[[kprobe]]\nsymbol_name = "work"\noffset = -1\n',
     "probes.toml: [[kprobe]] #1: 'offset' must be a non-negative integer, got -1"),
    ('[[kprobe]]\nsymbol_name = "work"\noffset = true\n',
     "probes.toml: [[kprobe]] #1: 'offset' must be a non-negative integer, got true"),
    ('[[kprobe]]\nsymbol_name = "work"\noffset = 1.5\n',
     "probes.toml: [[kprobe]] #1: 'offset' must be a non-negative integer, got 1.5"),
    ('[[kprobe]]\nsymbol_name = "work"\noffset = 0x100000000\n',
     "probes.toml: [[kprobe]] #1: 'offset' must be at most 0xffffffff, got 4294967296"),
    ('[[kprobe]]\naddr = -4096\n',
     "probes.toml: [[kprobe]] #1: 'addr' must be a non-negative integer, got -4096"),
    ('[[kprobe]]\naddr = "0x401136"\n',
     "probes.toml: [[kprobe]] #1: 'addr' must be a non-negative integer, got \"0x401136\""),
    ('[[kprobe]]\naddr = 0x1_0000_0000_0000_0000\n',
     "probes.toml: [[kprobe]] #1: 'addr' must be at most 0xffffffffffffffff, got 0x10000000000000000"),
    ('[[kprobe]]\nsymbol_name = ""\n',
     "probes.toml: [[kprobe]] #1: 'symbol_name' must be a non-empty string, got \"\""),
    ('[[kprobe]]\nsymbol_name = 4\n',
     "probes.toml: [[kprobe]] #1: 'symbol_name' must be a non-empty string, got 4"),
    ('[[kprobe]]\nsymbol_name = "w"\npre_handler = ["a"]\n',
     "probes.toml: [[kprobe]] #1: 'pre_handler' must be a non-empty string, got [\"a\"]"),
    ('[[kprobe]]\nsymbol_name = "w"\npost_handler = ""\n',
     "probes.toml: [[kprobe]] #1: 'post_handler' must be a non-empty string, got \"\""),
    ('[[kprobe]]\nsymbol_name = "w"\nname = ""\n',
     "probes.toml: [[kprobe]] #1: 'name' must be a non-empty string, got \"\""),
    ('[[kprobe]]\nsymbol_name = "w"\nfetch = 1\n',
     "probes.toml: [[kprobe]] #1: 'fetch' must be a string, got 1"),
    ('[[kprobe]]\nsymbol_name = "w"\ndisabled = 1\n',
     "probes.toml: [[kprobe]] #1: 'disabled' must be a boolean (true or false), got 1"),
    ('[[kprobe]]\nsymbol_name = "w"\ndisabled = "yes"\n',
     "probes.toml: [[kprobe]] #1: 'disabled' must be a boolean (true or false), got \"yes\""),
    ('[[kretprobe]]\nsymbol_name = "w"\nmaxactive = "20"\n',
     "probes.toml: [[kretprobe]] #1: 'maxactive' must be an integer, got \"20\""),
    ('[[kretprobe]]\nsymbol_name = "w"\nmaxactive = false\n',
     "probes.toml: [[kretprobe]] #1: 'maxactive' must be an integer, got false"),
    ('[[kretprobe]]\nsymbol_name = "w"\nmaxactive = 0x80000000\n',
     "probes.toml: [[kretprobe]] #1: 'maxactive' must be an integer between -2147483648 and "
     "2147483647, got 2147483648"),
    ('[[kretprobe]]\nsymbol_name = "w"\ndata_size = -1\n',
     "probes.toml: [[kretprobe]] #1: 'data_size' must be a non-negative integer, got -1"),
    ('[[kretprobe]]\nsymbol_name = "w"\ndata_size = 1.0\n',
     "probes.toml: [[kretprobe]] #1: 'data_size' must be a non-negative integer, got 1.0"),
    ('[[kretprobe]]\nsymbol_name = "w"\nhandler = ""\n',
     "probes.toml: [[kretprobe]] #1: 'handler' must be a non-empty string, got \"\""),
    ('[[kretprobe]]\nsymbol_name = "w"\nentry_handler = true\n',
     "probes.toml: [[kretprobe]] #1: 'entry_handler' must be a non-empty string, got true"),
    ('optimise = false\n', "probes.toml: unknown key 'optimise' (did you mean 'optimize'?)"),
    ('[[kprobes]]\nsymbol_name = "w"\n', "probes.toml: unknown key 'kprobes' (did you mean 'kprobe'?)"),
    ('handler = ["h.c"]\n', "probes.toml: unknown key 'handler' (did you mean 'handlers'?)"),
    ('frobnicate = 1\n', "probes.toml: unknown key 'frobnicate'"),
    ('optimize = 1\n', "probes.toml: 'optimize' must be a boolean (true or false), got 1"),
    ('optimize = "false"\n', "probes.toml: 'optimize' must be a boolean (true or false), got \"false\""),
    ('handlers = "h.c"\n', "probes.toml: 'handlers' must be a list of file paths"),
    ('handlers = [1]\n', "probes.toml: 'handlers' must be a list of file paths"),
    ('handlers = [""]\n', "probes.toml: 'handlers' must be a list of file paths"),
    ('events = "p:work work"\n', "probes.toml: 'events' must be a list of strings"),
    ('events = [1, "x"]\n', "probes.toml: 'events' must be a list of strings"),
    ('[kprobe]\nsymbol_name = "w"\n',
     "probes.toml: 'kprobe' must be an array of tables ([[kprobe]]), got {symbol_name = \"w\"}"),
    ('kretprobe = ["w"]\n',
     "probes.toml: 'kretprobe' must be an array of tables ([[kretprobe]]), got [\"w\"]"),
])
def test_one_problem_one_line(tmp_path, text, expect):
    assert errors(tmp_path, text) == [expect]


def test_handler_files(tmp_path):
    (tmp_path / "ok.c").write_text("")
    (tmp_path / "dir.c").mkdir()
    lines = errors(tmp_path, 'handlers = ["ok.c", "h.c", "lib/x.o", "h.txt", "h", "dir.c", "ok.c", "./ok.c"]\n',
                   "h.txt", "h")
    assert lines == [
        "probes.toml: handler file 'h.c': no such file",
        "probes.toml: handler file 'lib/x.o': no such file",
        "probes.toml: handler file 'h.txt' must be a C source (.c) or a relocatable object (.o)",
        "probes.toml: handler file 'h' must be a C source (.c) or a relocatable object (.o)",
        "probes.toml: handler file 'dir.c': is a directory",
        "probes.toml: handler file 'ok.c' is listed more than once",
        "probes.toml: handler file './ok.c' is listed more than once",
    ]


def test_handler_extension_is_the_name_given_not_a_symlink_target(tmp_path):
    (tmp_path / "real.txt").write_text("")
    os.symlink(tmp_path / "real.txt", tmp_path / "h.c")
    assert load_spec(write_spec(tmp_path, 'handlers = ["h.c"]\n')).handlers == [tmp_path / "h.c"]


def test_missing_spec_file(tmp_path):
    with pytest.raises(KprewriteError) as e:
        load_spec(tmp_path / "probes.toml")
    assert e.value.lines == [f"{tmp_path / 'probes.toml'}: no such file"]     # the path as given


def test_spec_is_a_directory(tmp_path):
    (tmp_path / "probes.toml").mkdir()
    with pytest.raises(KprewriteError) as e:
        load_spec(tmp_path / "probes.toml")
    assert e.value.lines == [f"{tmp_path / 'probes.toml'}: is a directory"]


@pytest.mark.parametrize("text,expect", [
    ('[[kprobe]]\nsymbol_name = "work\n', "probes.toml: line 2, column 20: Illegal character '\\n'"),
    ('optimize = true\n\n[[kprobe]]\nsymbol_name "work"\n',
     "probes.toml: line 4, column 13: Expected '=' after a key in a key/value pair"),
    ('a = 1\na = 2\n', "probes.toml: line 2, column 6: Cannot overwrite a value"),
    ('events = [\n  "x",\n', "probes.toml: line 3, column 1: Invalid value"),
])
def test_malformed_toml(tmp_path, text, expect):
    assert errors(tmp_path, text) == [expect]


def test_not_utf8(tmp_path):
    p = tmp_path / "probes.toml"
    p.write_bytes(b'[[kprobe]]\nsymbol_name = "w\xff"\n')
    with pytest.raises(KprewriteError) as e:
        load_spec(p)
    assert e.value.lines == ["probes.toml: not UTF-8 text (byte 27)"]


@pytest.mark.parametrize("text", ["a = " + "[" * 5000 + "]" * 5000 + "\n", "a = 1" + "0" * 5000 + "\n"])
def test_pathological_toml_is_one_line_not_a_crash(tmp_path, text):
    lines = errors(tmp_path, text)
    assert len(lines) == 1 and lines[0].startswith("probes.toml: ")


def test_values_and_keys_are_shown_on_one_line(tmp_path):
    lines = errors(tmp_path, '[[kprobe]]\nsymbol_name = "w"\noffset = "a\\nb"\n"x\\ny" = 1\n'
                             f'name = {"[" + ", ".join(["1"] * 50) + "]"}\n')
    assert lines == [
        "probes.toml: [[kprobe]] #1: 'offset' must be a non-negative integer, got \"a\\nb\"",
        "probes.toml: [[kprobe]] #1: unknown key 'x\\ny'",
        "probes.toml: [[kprobe]] #1: 'name' must be a non-empty string, got "
        "[1, 1, 1, 1, 1, 1, 1, 1, ...]",
    ]


def test_all_problems_reported_at_once(tmp_path):
    text = '''\
handlers = ["nothere.c"]
optimize = "yes"
verbose = true

[[kprobe]]
symbol_name = "a"
offest = 4

[[kprobe]]
symbol_name = "b"
addr = 0x1000
offset = "4"
disabled = 0

[[kretprobe]]
maxactive = "many"
data_size = -8
'''
    assert errors(tmp_path, text) == [
        "probes.toml: handler file 'nothere.c': no such file",
        "probes.toml: 'optimize' must be a boolean (true or false), got \"yes\"",
        "probes.toml: unknown key 'verbose'",
        "probes.toml: [[kprobe]] #1: unknown key 'offest' (did you mean 'offset'?)",
        "probes.toml: [[kprobe]] #2: 'offset' must be a non-negative integer, got \"4\"",
        "probes.toml: [[kprobe]] #2: 'disabled' must be a boolean (true or false), got 0",
        "probes.toml: [[kprobe]] #2: needs exactly one of 'symbol_name' or 'addr'",
        "probes.toml: [[kretprobe]] #1: 'maxactive' must be an integer, got \"many\"",
        "probes.toml: [[kretprobe]] #1: 'data_size' must be a non-negative integer, got -8",
        "probes.toml: [[kretprobe]] #1: needs exactly one of 'symbol_name' or 'addr'",
    ]


def test_label_is_the_spec_file_name(tmp_path):
    p = write_spec(tmp_path, "[[kprobe]]\n", name="mine.toml")
    with pytest.raises(KprewriteError) as e:
        load_spec(p)
    assert e.value.lines == ["mine.toml: [[kprobe]] #1: needs exactly one of 'symbol_name' or 'addr'"]

"""Manual pages, made from the click program itself (its usage, help, options and
examples), so that they cannot drift from `--help`: kprewrite.1 and one
kprewrite-COMMAND.1 per command, as git and perf name theirs.  `kprewrite man` prints
or writes them; setup.py writes them at build time into the wheel's
share/man/man1, so that `man kprewrite` works in the environment the package is
installed into.  No date in the pages: the same version gives the same bytes."""
from __future__ import annotations

import os

import click

from . import __version__

ENVIRONMENT = [
    ("KPREWRITE_ENABLED=0", "a rewritten program starts with every probe disarmed (debugfs kprobes/enabled)."),
    ("KPREWRITE_PROFILE=FILE", "a rewritten program writes kprobe_profile rows (event, hits, nmissed) to FILE at "
                               "exit; - is standard error."),
    ("KPREWRITE_TRACE=FILE", "a rewritten program appends its trace lines to FILE (default: standard error)."),
    ("KPREWRITE_TRACE_FORMAT=binary", "with KPREWRITE_TRACE: binary records, read by kprewrite trace, report "
                                      "and replay."),
    ("KPREWRITE_CACHE=DIR", "where the compiled runtime and the rewrites of kprewrite record are cached "
                            "(default: $XDG_CACHE_HOME/kprewrite or ~/.cache/kprewrite)."),
    ("KPREWRITE_DEBUG=1", "let an internal error's Python traceback through."),
]


def _esc(text: str) -> str:
    """roff text: backslashes and leading dots or quotes escaped, hyphens as minus signs
    (so that options can be searched and copied)."""
    out = []
    for line in text.replace("\\", "\\e").replace("-", "\\-").split("\n"):
        out.append("\\&" + line if line.startswith((".", "'")) else line)
    return "\n".join(out)


def _paragraphs(text: str) -> list[str]:
    """click's help text: blank-line paragraphs; a paragraph after a \\b line keeps its lines."""
    out = []
    for para in click.unstyle(text or "").strip().split("\n\n"):
        if para.startswith("\b\n"):
            out.append(".nf\n" + _esc(para[2:]) + "\n.fi")
        elif para.strip():
            out.append(_esc(" ".join(para.split())))
    return out


def _header(name: str, summary: str) -> list[str]:
    title = name.upper().replace("-", "\\-")
    return [f'.TH {title} 1 "" "kprewrite {__version__}" "User Commands"',
            ".SH NAME", f"{_esc(name)} \\- {_esc(summary)}"]


def _options(cmd: click.Command, ctx: click.Context) -> list[str]:
    out = []
    for p in cmd.get_params(ctx):
        if not isinstance(p, click.Option):
            continue
        rec = p.get_help_record(ctx)
        if rec is None:
            continue
        opts, text = rec
        out += [".TP", f"\\fB{_esc(opts)}\\fR", _esc(" ".join(click.unstyle(text).split()))]
    return out


def command_page(group: click.Group, name: str, prog: str = "kprewrite") -> str:
    cmd = group.commands[name]
    parent = click.Context(group, info_name=prog, **group.context_settings)
    ctx = click.Context(cmd, info_name=name, parent=parent)
    lines = _header(f"{prog}-{name}", cmd.get_short_help_str(limit=200).rstrip("."))
    lines += [".SH SYNOPSIS", f"\\fB{prog} {_esc(name)}\\fR {_esc(' '.join(cmd.collect_usage_pieces(ctx)))}"]
    lines += [".SH DESCRIPTION"] + "\n.PP\n".join(_paragraphs(cmd.help)).split("\n")
    opts = _options(cmd, ctx)
    if opts:
        lines += [".SH OPTIONS"] + opts
    if cmd.epilog:
        epilog = cmd.epilog.removeprefix("Examples:").lstrip("\n")
        lines += [".SH EXAMPLES"] + "\n.PP\n".join(_paragraphs(epilog)).split("\n")
    lines += [".SH SEE ALSO", f"\\fB{prog}\\fR(1)"]
    return "\n".join(lines) + "\n"


def main_page(group: click.Group, prog: str = "kprewrite") -> str:
    ctx = click.Context(group, info_name=prog, **group.context_settings)
    lines = _header(prog, "Linux-style kprobes compiled ahead of time into ELF images")
    lines += [".SH SYNOPSIS", f"\\fB{prog}\\fR \\fICOMMAND\\fR [\\fIOPTIONS\\fR] [\\fIARGS\\fR]...",
              ".br", f"\\fB{prog} \\-\\-version\\fR", ".SH DESCRIPTION"]
    lines += "\n.PP\n".join(_paragraphs(group.help)[1:]).split("\n")      # the first is NAME's
    lines += [".SH COMMANDS"]
    for name in group.list_commands(ctx):
        cmd = group.commands[name]
        lines += [".TP", f"\\fB{prog}\\-{_esc(name)}\\fR(1)", _esc(cmd.get_short_help_str(limit=200))]
    lines += [".SH OPTIONS"] + _options(group, ctx)
    lines += [".SH ENVIRONMENT"]
    for var, text in ENVIRONMENT:
        lines += [".TP", f"\\fB{_esc(var)}\\fR", _esc(text)]
    lines += [".SH SHELL COMPLETION", "Bash, zsh and fish complete commands and options through click:",
              ".PP", ".nf", _esc(f'eval "$(_KPREWRITE_COMPLETE=bash_source {prog})"     # in ~/.bashrc'),
              _esc(f'eval "$(_KPREWRITE_COMPLETE=zsh_source {prog})"      # in ~/.zshrc'),
              _esc(f"_KPREWRITE_COMPLETE=fish_source {prog} | source     # in ~/.config/fish/completions/{prog}.fish"),
              ".fi"]
    lines += [".SH SEE ALSO", ", ".join(f"\\fB{prog}\\-{_esc(n)}\\fR(1)" for n in group.list_commands(ctx))]
    return "\n".join(lines) + "\n"


def pages(group: click.Group, prog: str = "kprewrite") -> dict[str, str]:
    """{file name: roff text}: kprewrite.1 and kprewrite-COMMAND.1 for each command."""
    out = {f"{prog}.1": main_page(group, prog)}
    for name in group.list_commands(click.Context(group, info_name=prog)):
        out[f"{prog}-{name}.1"] = command_page(group, name, prog)
    return out


def write(directory: str, group: click.Group) -> list[str]:
    """Writes every page of `group` (cli.main) into `directory` (made if missing); returns
    their paths."""
    os.makedirs(directory, exist_ok=True)
    out = []
    for name, text in pages(group).items():
        path = os.path.join(directory, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        out.append(path)
    return out

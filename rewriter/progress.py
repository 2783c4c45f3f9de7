"""What a long rewrite shows while it runs: one bar over the pipeline's stages
(click's progress bar), labelled with the current stage and its counts.  Only on
a terminal: when standard error is a pipe or a file (CI logs), nothing at all."""
from __future__ import annotations

import sys

STAGES = ("loading", "resolving", "analysing", "planning", "compiling", "emitting", "linking", "writing")


class Progress:
    """stage(name, detail) starts a pipeline stage; done() ends the display."""

    def __init__(self, stream=None):
        self.bar = None
        self.started = False
        stream = stream if stream is not None else sys.stderr
        if stream.isatty():
            import click
            self.bar = click.progressbar(length=len(STAGES), label="kprewrite", file=stream, show_eta=False,
                                         show_percent=False, show_pos=True, width=len(STAGES) * 2)

    def stage(self, name: str, detail: str = "") -> None:
        if self.bar is None:
            return
        self.bar.label = f"kprewrite: {name} {detail}".rstrip()
        if self.started:
            self.bar.update(1)      # the stage before is done; renders the new label
        else:
            self.bar.render_progress()
        self.started = True

    def done(self) -> None:
        if self.bar is not None and self.started:
            self.bar.update(len(STAGES) - self.bar.pos)
            self.bar.render_finish()
            self.bar = None


class NoProgress(Progress):
    def __init__(self):
        self.bar = None
        self.started = False

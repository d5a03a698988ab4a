"""The console during `resilient run`: one readable line per event on stderr, never the ranks' logs."""

from __future__ import annotations

import contextlib
import errno
import os
import time

from rich.console import Console


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """Rich's own answer to a reader gone away is SystemExit(1): the supervisor's end, and the run's."""
        go_quiet(self)


class EventConsole:
    """The supervisor's voice. Its output is a courtesy: a reader that goes away (`| grep -m1`, a closed ssh
    session) or a full disk under `2> file` must never end the supervision, which would stop the training."""

    def __init__(self, name: str, console: Console | None = None):
        self.name = name
        self.console = console or _Console(stderr=True, highlight=False, soft_wrap=True)

    def event(self, text: str, style: str | None = None) -> None:
        stamp = time.strftime("%H:%M:%S")
        self._print((f"[dim]{stamp}[/] [bold]{self.name}[/] ", None, True, ""), (text, style, False, "\n"))

    def paragraph(self, text: str, style: str | None = "red") -> None:
        self._print((text, style, False, "\n"))

    def _print(self, *parts: tuple[str, str | None, bool, str]) -> None:
        if self.console.quiet:  # nobody reads us any more: the stream leads to /dev/null
            return
        try:
            for text, style, markup, end in parts:
                self.console.print(text, style=style, markup=markup, end=end)
        except (OSError, ValueError) as e:  # ValueError: a closed file
            if isinstance(e, OSError) and e.errno not in (errno.EPIPE, errno.EIO):
                return  # this line is lost (a full disk); the next may be written again
            go_quiet(self.console)


def go_quiet(console: Console) -> None:
    """Nobody reads `console` any more: it prints nothing, and its stream's descriptor leads to /dev/null, so that
    every later write to it (the interpreter's at exit too) succeeds and goes nowhere."""
    console.quiet = True
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = console.file.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)

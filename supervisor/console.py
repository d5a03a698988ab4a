"""The console during `resilient run`: one readable line per event on stderr, never the ranks' logs."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """Rich's own answer to a reader gone away is SystemExit(1): the supervisor's end, and the run's."""
        go_quiet(self)


class EventConsole:
    """The supervisor's voice. Its output is a courtesy: a reader that goes away (`| grep -m1`, a closed ssh
    session) or a full disk under `2> file` must never end the supervision, which would stop the training."""

    def __init__(self, name: str, console: Console | None = None):
        self.name = name
        self.console = console or _Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
        # One line's parts together: the replicator's thread speaks too. Re-entrant: Ctrl-Z's handler speaks from
        # the main thread, maybe in the middle of a line; a plain Lock would block it there for good.
        self._lock = threading.RLock()

    def event(self, text: str, style: str | None = None) -> None:
        stamp = time.strftime("%H:%M:%S")
        self._print((f"[dim]{stamp}[/] [bold]{escape(self.name)}[/] ", None, True, ""), (text, style, False, "\n"))

    @contextlib.contextmanager
    def library_warnings(self) -> Iterator[None]:
        """The library's warnings (the "resilient" logger: the replicator, the prewarm client) as events, stamped
        like every other line; without this, Python's last-resort handler printed them bare. The records still
        propagate: a caller's own logging (`resilient run` called in-process) gets them as it configured."""
        logger, handler = logging.getLogger("resilient"), _AsEvents(self)
        logger.addHandler(handler)
        try:
            yield
        finally:
            logger.removeHandler(handler)

    def paragraph(self, text: str, style: str | None = "red") -> None:
        self._print((text, style, False, "\n"))

    def _print(self, *parts: tuple[str, str | None, bool, str]) -> None:
        if self.console.quiet:  # nobody reads us any more: the stream leads to /dev/null
            return
        try:
            with self._lock:
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


class _AsEvents(logging.Handler):
    def __init__(self, console: EventConsole):
        super().__init__(logging.WARNING)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except (TypeError, ValueError):
            self.handleError(record)
            return
        self.console.event(text, style="yellow" if record.levelno < logging.ERROR else "red")

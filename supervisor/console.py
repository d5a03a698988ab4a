"""The console during `resilient run`: one readable line per event on stderr, never the ranks' logs."""

from __future__ import annotations

import time

from rich.console import Console


class EventConsole:
    def __init__(self, name: str, console: Console | None = None):
        self.name = name
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)

    def event(self, text: str, style: str | None = None) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.console.print(f"[dim]{stamp}[/] [bold]{self.name}[/] ", end="")
        self.console.print(text, style=style, markup=False)

    def paragraph(self, text: str, style: str | None = "red") -> None:
        self.console.print(text, style=style, markup=False)

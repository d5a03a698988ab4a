"""Output: one console for humans on stderr/stdout, JSON to stdout only, and the small formatters."""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.text import Text

PIPED_WIDTH = 10_000  # piped or redirected output is never wrapped mid-phrase; a terminal wraps at its width


def _console(stderr: bool = False) -> Console:
    # Plain text unless a part asks for style (`styled`, rich Text): a path, a node or a reason printed here is the
    # user's, and `[red]` in a folder's name or `:b:` in "local:b: ..." must come out as written, never as a style
    # or an emoji.
    console = Console(stderr=stderr, highlight=False, markup=False, emoji=False)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = PIPED_WIDTH  # rich would assume 80 columns
    return console


err = _console(stderr=True)
out = _console()

STATUS_STYLE = {"valid": "green", "incomplete": "yellow", "corrupt": "red", "unreadable": "magenta",
                "succeeded": "green", "finished": "green",
                "running": "cyan", "restarting": "yellow", "failed": "red", "stopped": "magenta",
                "pending": "dim"}


def emit(result: Any, as_json: bool) -> None:
    """A command's result: its JSON on stdout, or its own rendering for people."""
    if as_json:
        print_json(result.to_json())
    else:
        result.render()


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
    sys.stdout.flush()


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def local_time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def clock(ts: float | None) -> str:
    """HH:MM:SS for today, else the date too."""
    if ts is None:
        return "-"
    d = dt.datetime.fromtimestamp(ts)
    return d.strftime("%H:%M:%S") if d.date() == dt.date.today() else d.strftime("%Y-%m-%d %H:%M")


def styled(word: str) -> Text:
    """A status word in its colour."""
    return Text(word, style=STATUS_STYLE.get(word, ""))

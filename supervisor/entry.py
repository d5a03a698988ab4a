"""The `resilient` console script. The CLI's imports (typer, rich) take a tenth of a second; a Ctrl-C inside them
was a traceback, and leaves now as any other Ctrl-C does: exit 130, nothing printed, nothing started."""

from __future__ import annotations

import sys

SIGINT_EXIT = 130  # errors.ExitCode.SIGINT, not imported: that import is part of the window


def main() -> None:
    try:
        from supervisor import cli
    except KeyboardInterrupt:
        sys.exit(SIGINT_EXIT)
    cli.main()

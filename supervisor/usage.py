"""click's own errors in the contract's form: a usage error (an unknown option, a value of the wrong type, a
missing argument, an unknown command) is one sentence on stderr, or the error JSON under --json, with exit 2,
where click prints three lines of usage, hint and error. typer carries its own copy of click in newer releases
and imports click in older ones, so its exceptions are recognised by name, not by class."""

from __future__ import annotations

import sys
from typing import Any

from typer.core import TyperGroup

from supervisor import render
from supervisor.errors import ExitCode


def _named(e: BaseException, name: str) -> bool:
    return any(c.__name__ == name for c in type(e).__mro__)


def _speaks_json(command: Any) -> bool:
    """Whether the command that failed has a --json mode: `logs --json` is an unknown option, told in words."""
    return any("--json" in getattr(p, "opts", ()) for p in getattr(command, "params", ()))


def _command(ctx: Any) -> str:
    """`resilient run`, however the program was started (`python -m supervisor` too)."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["resilient", *reversed(names)])


class OneSentenceErrors(TyperGroup):
    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        argv = kwargs.get("args", args[0] if args else None)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except Exception as e:
            if _named(e, "Abort"):  # Ctrl-C or an EOF at a prompt, as click reports them
                if isinstance(e.__cause__ or e.__context__, KeyboardInterrupt):
                    sys.exit(ExitCode.SIGINT)
                render.err.print("Aborted!", markup=False)
                sys.exit(ExitCode.FAILED)
            if not _named(e, "UsageError") or _named(e, "NoArgsIsHelpError") or not hasattr(e, "format_message"):
                if hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):
                    e.show()  # click's other errors (no arguments at all: the help) as click prints them
                    sys.exit(e.exit_code)
                raise
            words = list(sys.argv[1:] if argv is None else argv)
            ctx = getattr(e, "ctx", None)
            failed = getattr(ctx, "command", None)
            command = _command(ctx)
            if ctx is None:  # click names no context for some option errors (`--watch=x`): the command is in argv
                name = next((w for w in words if w in self.commands), None)
                failed = self.commands.get(name) if name else None
                command = f"resilient {name}" if name else "resilient"
            what = " ".join(e.format_message().split()).rstrip(".")
            message = f"{command}: {what}; see `{command} --help`."
            if "--json" in words and _speaks_json(failed):
                render.print_json({"error": message, "exit_code": int(ExitCode.USAGE)})
            else:
                render.err.print(message, markup=False, soft_wrap=True)
            sys.exit(ExitCode.USAGE)
        sys.exit(code if isinstance(code, int) else 0)

"""Exit codes and the exceptions that carry them to the CLI edge.

Library code raises a `ResilientError`; `supervisor.cli` prints its one-line message to stderr and exits
with its code. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Exit codes shared by every command (CONTRACT.md, "Exit codes")."""

    OK = 0
    FAILED = 1  # the work failed: restart budget spent, crash loop, no valid checkpoint, ...
    USAGE = 2  # usage or configuration error: nothing launched, nothing deleted
    LOCKED = 3  # the run dir is held by another live supervisor
    SIGINT = 130
    SIGTERM = 143


class ResilientError(Exception):
    """An expected failure with a one-sentence message for the user."""

    exit_code: ExitCode = ExitCode.FAILED

    def __init__(self, message: str, exit_code: ExitCode | None = None):
        super().__init__(message)
        self.message = message
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(ResilientError):
    """Bad arguments or a bad target: nothing was launched or deleted."""

    exit_code = ExitCode.USAGE


class NotYetError(UsageError):
    """The run is not there yet: no such path, no state file, a folder still empty (`status --wait-ranks` waits
    these out; every other usage error it says at once)."""


class ConfigError(UsageError):
    """A job file or `--set` override that does not validate."""


class RunLockedError(ResilientError):
    """Another live supervisor holds the run dir."""

    exit_code = ExitCode.LOCKED

"""The `resilient` command: one short function per subcommand; the work lives in supervisor.commands.

Errors the user can fix arrive as ResilientError and leave as one line on stderr with the contract's exit
code (or as JSON on stdout under --json). RESILIENT_DEBUG=1 prints the traceback on stderr too.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import traceback
from collections.abc import Callable
from typing import Optional

import typer

from supervisor import __version__, render
from supervisor.errors import ExitCode, ResilientError, UsageError
from supervisor.usage import OneSentenceErrors

app = typer.Typer(
    cls=OneSentenceErrors,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Keep long distributed PyTorch training jobs alive.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"resilient {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(  # noqa: UP045 (typer needs Optional on 3.10)
        None, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Keep long distributed PyTorch training jobs alive."""


def _guard(as_json: bool, fn: Callable[[], int], *, reads_files: bool = False) -> None:
    """Run a command body; turn ResilientError into its exit code and one clear line. With `reads_files` (the
    light commands), a file or folder they cannot read is such an error too, named with the system's reason."""
    try:
        try:
            code = fn()
        except OSError as e:
            if not reads_files:
                raise
            raise _unreadable(e) from e
    except ResilientError as e:
        if os.environ.get("RESILIENT_DEBUG") == "1":  # the traceback as well, and the same exit code and output
            traceback.print_exc()
        if as_json:
            render.print_json({"error": e.message, "exit_code": int(e.exit_code)})
        else:
            render.err.print(f"resilient: {e.message}", markup=False, soft_wrap=True)
        raise typer.Exit(int(e.exit_code)) from None
    raise typer.Exit(int(code))


def _unreadable(e: OSError) -> ResilientError:
    where = e.filename if e.filename is not None else "a file it needed"
    reason = e.strerror or e.__class__.__name__
    if isinstance(e, PermissionError) and e.filename is not None:
        # The folder that shuts this user out, not a file inside it that may not even exist (`u/job.json` of a
        # checkpoint root of mode 000).
        folder = os.path.dirname(os.path.abspath(e.filename))
        while os.path.dirname(folder) != folder:  # the outermost one wins: nothing below it can be entered
            if not os.access(folder, os.X_OK):
                where = folder
            folder = os.path.dirname(folder)
    if isinstance(e, PermissionError):
        return UsageError(f"{where}: cannot be read ({reason}); give this user access to it (or run as its "
                          "owner) and run the command again.")
    return ResilientError(f"{where}: cannot be read ({reason}); check the filesystem and run the command again.")


WAIT_RANKS_S = 300.0  # status --wait-ranks, without --wait-timeout
TARGET = typer.Argument(None, metavar="TARGET",
                        help="A job file, run dir or checkpoint root (default: the current folder).")
JSON = typer.Option(False, "--json", help="Print JSON on stdout.")


def _with_run_dir(sets: list[str], run_dir: str | None) -> list[str]:
    """--set overrides plus --run-dir, which is `--set run_dir=DIR`: both at once is ambiguous, and refused."""
    if run_dir is None:
        return list(sets)
    given = [s for s in sets if s.split("=", 1)[0].strip() == "run_dir"]
    if given:
        raise UsageError(f"--run-dir {run_dir} and --set {given[0]} both name the run dir; pass one of them.")
    return [*sets, f"run_dir={run_dir}"]


@app.command()
def run(
    job: str = typer.Argument(..., metavar="JOB.yaml", help="The job file (YAML)."),
    run_dir: Optional[str] = typer.Option(None, "--run-dir", metavar="DIR", help="Same as --set run_dir=DIR."),  # noqa: UP045
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                   help="Override a job key: --set checkpoint.keep=5."),
    node: Optional[str] = typer.Option(  # noqa: UP045
        None, "--node", metavar="NAME",
        help="This node's name when several nodes share the run dir (default: host name)."),
) -> None:
    """Start the job, or resume it if its run dir already holds progress; supervise it to the end."""

    def body() -> int:
        from supervisor.commands import run as run_cmd

        return run_cmd.main(job, _with_run_dir(set_, run_dir), node)

    _guard(False, body)


@app.command()
def status(
    target: Optional[str] = TARGET,  # noqa: UP045
    as_json: bool = JSON,
    watch: bool = typer.Option(False, "--watch", help="Keep refreshing until the run ends (Ctrl-C to leave); into "
                               "a file or pipe, or with --json (a document a line), a snapshot a second."),
    plot: Optional[str] = typer.Option(  # noqa: UP045
        None, "--plot", metavar="FILE.png", help="Also draw the run's timeline to this PNG."),
    wait_ranks: bool = typer.Option(
        False, "--wait-ranks", help="First wait until every rank of the current attempt is alive and training "
        "(the run dir may not exist yet); exit 1 if the run ends or --wait-timeout passes first."),
    wait_timeout: Optional[float] = typer.Option(  # noqa: UP045
        None, "--wait-timeout", metavar="S", help="Seconds --wait-ranks waits at most (default 300)."),
    run_dir: Optional[str] = typer.Option(  # noqa: UP045
        None, "--run-dir", metavar="DIR", help="With a job file as TARGET: the run dir `run JOB --run-dir DIR` uses."),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                   help="With a job file as TARGET: the job keys `run` was given (its run_dir)."),
) -> None:
    """The state of a run: live or finished."""

    def body() -> int:
        from supervisor.commands import status as status_cmd

        if wait_timeout is not None and not wait_ranks:
            raise UsageError(f"--wait-timeout {wait_timeout:g} is how long --wait-ranks waits; add --wait-ranks, or "
                             "drop --wait-timeout.")
        timeout = WAIT_RANKS_S if wait_timeout is None else wait_timeout
        if not (math.isfinite(timeout) and timeout >= 0):  # nan waited for ever, -1 not at all
            raise UsageError(f"--wait-timeout {timeout:g}: seconds to wait, a number from 0 up.")
        where = target
        if run_dir is not None or set_:
            where = status_cmd.run_dir_of(target, _with_run_dir(set_, run_dir), must_exist=not wait_ranks)
        return status_cmd.main(where, as_json, watch, plot=plot, wait_ranks_s=timeout if wait_ranks else None)

    _guard(as_json, body, reads_files=True)


@app.command("inspect-checkpoint")
def inspect_checkpoint(
    target: Optional[str] = typer.Argument(  # noqa: UP045
        None, metavar="TARGET",
        help="A job file, run dir, checkpoint root or one checkpoint folder (default: here)."),
    step: Optional[int] = typer.Option(None, "--step", metavar="N", help="Only this step."),  # noqa: UP045
    verify: bool = typer.Option(False, "--verify", help="Re-read every byte against the recorded checksums."),
    as_json: bool = JSON,
) -> None:
    """List checkpoints, each valid / incomplete / corrupt / unreadable with the reason (exit 0: one a run
    resumes from is valid)."""

    def body() -> int:
        from supervisor.commands import inspect as inspect_cmd

        return inspect_cmd.main(target, step, verify, as_json)

    _guard(as_json, body, reads_files=True)


@app.command()
def gc(
    target: Optional[str] = TARGET,  # noqa: UP045
    keep: Optional[int] = typer.Option(  # noqa: UP045  # required: checked in the body, so --json reports it
        None, "--keep", metavar="N", help="How many of the newest valid checkpoints to keep (≥ 1; required)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be removed; remove nothing."),
    as_json: bool = JSON,
    keep_local: Optional[int] = typer.Option(  # noqa: UP045
        None, "--keep-local", metavar="N",
        help="In each node-local tier: how many to keep (default: the job's keep_local)."),
    verify: bool = typer.Option(False, "--verify", help="First re-read every byte of the checkpoints it would "
                                "keep; one that does not match its checksums is not kept in place of older ones."),
) -> None:
    """Keep the N newest valid checkpoints; delete the rest and abandoned partial saves."""

    def body() -> int:
        from supervisor.commands import gc as gc_cmd

        if keep is None:
            raise UsageError("gc needs --keep N: how many of the newest valid checkpoints to keep (at least 1).")
        if keep_local is not None and keep_local < 1:
            raise UsageError(f"--keep-local {keep_local}: keep at least 1.")
        return gc_cmd.main(target, keep, dry_run, as_json, keep_local, verify)

    _guard(as_json, body, reads_files=True)


@app.command()
def logs(
    target: Optional[str] = typer.Argument(  # noqa: UP045
        None, metavar="TARGET", help="A job file or run dir (default: the current folder)."),
    rank: Optional[int] = typer.Option(None, "--rank", metavar="R", help="Only this rank."),  # noqa: UP045
    attempt: Optional[int] = typer.Option(None, "--attempt", metavar="K", help="This attempt (default: the latest)."),  # noqa: UP045
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines, into each new attempt, "
                                "until the run is over (Ctrl-C to leave)."),
) -> None:
    """A rank's output (default: the latest attempt, every rank, prefixed)."""

    def body() -> int:
        from supervisor.commands import logs as logs_cmd

        return logs_cmd.main(target, rank, attempt, follow)

    _guard(False, body, reads_files=True)


@app.command("rdzv-store")
def rdzv_store(
    host: str = typer.Option("0.0.0.0", "--host", metavar="H",
                             help="The address it says it listens on; torch's TCPStore "
                             "listens on every interface of this machine whatever it is: keep the port behind the "
                             "cluster's firewall (the store has no authentication)."),
    port: int = typer.Option(29400, "--port", metavar="P", help="The port (rdzv.endpoint's)."),
) -> None:
    """Run a rendezvous store on a machine that is not a training node (rdzv.conf.is_host: false)."""

    def body() -> int:
        from supervisor.commands import rdzv_store as store_cmd

        if not 0 < port < 65536:
            raise UsageError(f"--port {port}: a TCP port is 1 to 65535.")

        return store_cmd.main(host, port)

    _guard(False, body)


def main() -> None:
    """Console-script entry point."""
    # A name no encoding can print (a lone surrogate a marker may carry, an undecodable byte in a file name read
    # back as one) is shown escaped (\udcff), not a UnicodeEncodeError halfway through a table.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):  # replaced or closed by a caller
            stream.reconfigure(errors="backslashreplace")
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(ExitCode.SIGINT)

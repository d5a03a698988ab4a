"""Why did an attempt end? Read torchrun's failure summary, the ranks' last heartbeats and their logs.

torchrun exits 1 for every worker failure, so the cause comes from elsewhere: the "Root Cause" block of its
summary (rank, exit code, signal, error file), the exit code and reason each rank wrote in its last
heartbeat when it ended on its own, and signatures in the failed rank's log (collective timeouts, OOM,
import errors). Pure functions over text and records: unit-tested on captured output.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass, replace
from pathlib import Path

from supervisor import api
from supervisor.api import AttemptOutcome
from supervisor.fsutil import open_regular, parse_json, read_regular
from supervisor.protocol import EXIT_CHECKPOINT_LOAD, EXIT_CONFIG, EXIT_NAN, EXIT_PREEMPTED, NO_FINISH, Heartbeat

_BLOCK = re.compile(
    r"rank\s*:\s*(?P<rank>-?\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)[^\n]*\n"
    r"\s*error_file\s*:\s*(?P<error_file>[^\n]*)\n"
    r"\s*traceback\s*:\s*(?P<traceback>[^\n]*)"
)
ROOT_CAUSE = "Root Cause (first observed failure):"

COLLECTIVE_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout|Timed out waiting \d+ms for (?:recv|send)|"
    r"ProcessGroupNCCL.*[Tt]imeout|DistBackendError.*[Tt]imed? ?out|NCCL communicator was aborted|"
    r"collective operation timeout"
)
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|\bMemoryError\b|Cannot allocate memory")
CONFIG = re.compile(
    r"ModuleNotFoundError|ImportError|SyntaxError|IndentationError|TabError|No module named|can't open file|"
    r"error: (?:unrecognized arguments|argument|the following arguments are required)"
)
NO_GPU = re.compile(r"ValueError: Cuda is not available")  # torchrun's determine_local_world_size, 2.7 to 2.15
RENDEZVOUS = re.compile(r"RendezvousConnectionError|RendezvousClosedError|RendezvousTimeoutError|"
                        r"RendezvousStateError|DistStoreError|The connection to the C10d store has failed")
NODE_LOST = re.compile(r"Connection closed by peer|Broken pipe|Connection reset by peer|Connection refused|"
                       r"RendezvousConnectionError|DistStoreError|"
                       r"remote process exited or there was a network error|ncclRemoteError")  # NCCL's words
CHECKPOINT = re.compile(r"checkpoint save failed|No space left on device")


@dataclass(frozen=True)
class Failure:
    """One entry of torchrun's failure summary."""

    rank: int
    local_rank: int
    exit_code: int
    pid: int
    error_file: str | None
    traceback: str


def parse_summary(text: str) -> tuple[Failure | None, list[Failure]]:
    """(root cause, all failures) from torchrun's output; (None, []) if it printed no summary."""

    def parse(chunk: str) -> list[Failure]:
        out = []
        for m in _BLOCK.finditer(chunk):
            ef = m["error_file"].strip()
            out.append(Failure(int(m["rank"]), int(m["local"]), int(m["code"]), int(m["pid"]),
                               None if ef in ("", "<N/A>") else ef, m["traceback"].strip()))
        return out

    head, sep, tail = text.rpartition(ROOT_CAUSE)
    if not sep:
        return None, parse(text)
    roots = parse(tail)
    return (roots[0] if roots else None), parse(head) + roots


def error_message(path: str | None) -> str | None:
    """The exception message @record wrote in a rank's error.json."""
    if not path:
        return None
    try:
        doc = parse_json(read_regular(path, follow=True))
        msg = doc.get("message", {})
        if isinstance(msg, dict):
            msg = msg.get("message", "")
        return str(msg).strip() or None
    except (OSError, ValueError, AttributeError):  # UnicodeDecodeError is a ValueError
        return None


def signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def tail(path: Path | None, limit: int = 20_000) -> str:
    if path is None:
        return ""
    try:
        with os.fdopen(open_regular(path, follow=True), "rb") as f:  # a FIFO would hang the supervisor
            f.seek(0, 2)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


DETAIL_CHARS = 600  # of a rank's last log line, in the console and status: a refusal's whole sentence fits


# The library's own log prefix (train_entry.session's format): the detail already names the rank (audit 12:
# "config — rank 0: 23:30:42 [rank 0] ERROR cannot run ...").
LOG_PREFIX = re.compile(r"^\d\d:\d\d:\d\d \[rank \d+\] (?:ERROR|WARNING|INFO|CRITICAL) ")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    line = LOG_PREFIX.sub("", lines[-1])
    return line if len(line) <= DETAIL_CHARS else line[:DETAIL_CHARS].rsplit(" ", 1)[0] + " …"


def classify(rc: int, torchrun_output: str, heartbeats: dict[int, Heartbeat],
             rank_log: dict[int, str] | None = None, oom_killed: bool = False) -> AttemptOutcome:
    """The outcome of an attempt that ended on its own (not stopped by the supervisor).

    Args:
        rc: torchrun's exit code.
        torchrun_output: torchrun's own stdout/stderr (with its failure summary).
        heartbeats: every rank's last heartbeat.
        rank_log: the tail of each rank's stderr, by global rank.
        oom_killed: the kernel's OOM killer fired in our cgroup during the attempt.
    """
    rank_log = rank_log or {}
    step = max((hb.step for hb in heartbeats.values()), default=None)
    root, failures = parse_summary(torchrun_output)
    root, failures, after_exit = _by_last_word(root, failures, heartbeats)
    finished = bool(heartbeats) and all(hb.phase == "exited" and hb.exit_code == 0 for hb in heartbeats.values())
    if rc != 0 and after_exit and finished and all(f.exit_code == 0 for f in failures):
        rc = 0  # every rank had finished; those torchrun saw fail were dying on their way out
    if root is not None and root.exit_code == 0:  # finished, then died: not the cause of what failed
        root = next((f for f in failures if f.exit_code != 0), None)
    if rc == 0:
        stopped = [hb for hb in heartbeats.values() if hb.exit_code == EXIT_PREEMPTED]
        if stopped:  # finish() returned 75 for a stop, and the script exited 0 all the same
            return AttemptOutcome(api.PREEMPTED, f"the ranks checkpointed and stopped at step {step} for a stop that "
                                  f"reached the group (session.finish() returned {EXIT_PREEMPTED}), but the script "
                                  "exited 0: end it with sys.exit(session.finish(step, state)), or a stop is taken "
                                  "for the end of the job", stopped[0].rank, 0, step)
        if any(hb.exit_reason == NO_FINISH for hb in heartbeats.values()):
            return AttemptOutcome(api.FINISHED, f"the ranks exited 0 without session.finish() at step {step}: the "
                                  "steps after the last checkpoint were not saved (call finish(step, state) at the "
                                  "end of the script)", exit_code=0, step=step, unsaved_end=True)
        return AttemptOutcome(api.FINISHED, f"all ranks finished{after_exit}", exit_code=0, step=step)
    # A rank that ended on its own said why in its last heartbeat; the first such exit is the cause.
    said = sorted((hb for hb in heartbeats.values() if hb.exit_code not in (None, 0)), key=lambda hb: hb.time)
    if root is None and said:
        hb = said[0]
        root = Failure(hb.rank, hb.local_rank, hb.exit_code, hb.pid, None, "")
    if root is None:
        if rc < 0 or rc == 137:
            what = signal_name(rc) if rc < 0 else "SIGKILL"
            return AttemptOutcome(api.LAUNCHER_DIED, f"torchrun itself was killed ({what})", exit_code=rc, step=step)
        text = torchrun_output[-20_000:]
        if RENDEZVOUS.search(text) and not any(hb.first_step_at for hb in heartbeats.values()):
            m = RENDEZVOUS.search(text)
            return AttemptOutcome(api.RENDEZVOUS, f"torchrun could not form the group ({m.group(0)})",
                                  exit_code=rc, step=step)
        if NODE_LOST.search(text):
            return AttemptOutcome(api.NODE_LOST, f"lost the rendezvous: {_last_line(text)}", exit_code=rc, step=step)
        if NO_GPU.search(text):  # torchrun's own `--nproc-per-node gpu` on a node without one: every retry alike
            return AttemptOutcome(api.CONFIG, "nproc_per_node is gpu, but torch sees no CUDA device on this node "
                                  "(torchrun: Cuda is not available); set nproc_per_node to a number of ranks",
                                  exit_code=rc, step=step)
        if CONFIG.search(text):
            return AttemptOutcome(api.CONFIG, _last_line(text), exit_code=rc, step=step)
        return AttemptOutcome(api.WORKER_EXIT, f"torchrun exited with code {rc}: {_last_line(text)}",
                              exit_code=rc, step=step)

    # Peers of a killed rank fail moments later with "connection reset"; torchrun may see them first.
    killed = [f for f in failures if f.exit_code < 0]
    if killed and root.exit_code >= 0 and NODE_LOST.search(
            (error_message(root.error_file) or "") + root.traceback + rank_log.get(root.rank, "")):
        root = killed[0]
    root = _own_error_first(root, failures, said, rank_log)
    rank, code = root.rank, root.exit_code
    message = error_message(root.error_file) or ""
    log_text = rank_log.get(rank, "")
    evidence = "\n".join((message, root.traceback, log_text))
    where = f"rank {rank}"
    if code == EXIT_PREEMPTED:
        # A stop reached the group: a SIGTERM to this node's ranks, or to another node's, whose ranks told the rest.
        return AttemptOutcome(api.PREEMPTED, f"{where} exited with code {code}, a rank's code for a stop that "
                              "reached the group (a SIGTERM, to this node or another)", rank, code, step)
    if code == EXIT_NAN:  # the rank names the step whose loss it was; an older one said only "nan"
        hb = heartbeats.get(rank)
        said = re.search(r"at step (\d+)", hb.exit_reason or "") if hb is not None else None
        at = f"at step {said.group(1)}" if said else f"near step {step}"
        return AttemptOutcome(api.NAN, f"{where} saw a non-finite loss {at}", rank, code, step)
    if code == EXIT_CHECKPOINT_LOAD:
        hb = heartbeats.get(rank)
        why = (hb.exit_reason if hb and hb.exit_reason else _last_line(log_text)).removeprefix("checkpoint_load: ")
        # DCP raises one rank's read error on every rank ("step 30: rank 1: PieceMismatch: ..."): the rank that
        # read the bad bytes is the one to name, and to look at, when it is one of this node's.
        culprit = re.match(r"(step \d+: )rank (\d+): (.*)", why, re.S)
        if culprit and int(culprit.group(2)) in heartbeats:
            rank, where = int(culprit.group(2)), f"rank {culprit.group(2)}"
            why = culprit.group(1) + culprit.group(3)
        return AttemptOutcome(api.CHECKPOINT_LOAD, f"{where} could not load the checkpoint: {why}", rank, code, step,
                              checkpoint_step=hb.loading_step if hb else None,
                              checkpoint_tier=hb.loading_tier if hb else None)
    trained = any(hb.first_step_at is not None for hb in heartbeats.values())
    if code == EXIT_CONFIG or (not trained and CONFIG.search(evidence)):
        detail = _last_line(message or log_text) or f"exit code {code}"
        return AttemptOutcome(api.CONFIG, f"{where}: {detail}", rank, code, step)
    if code < 0:
        if code == -signal.SIGKILL and oom_killed:
            return AttemptOutcome(api.OOM, f"{where} was killed by the kernel's OOM killer", rank, code, step)
        return AttemptOutcome(api.WORKER_SIGNAL, f"{where} killed by {signal_name(code)}", rank, code, step)
    if COLLECTIVE_TIMEOUT.search(evidence):
        return AttemptOutcome(api.COLLECTIVE_TIMEOUT,
                              f"{where}: collective timed out: {_last_line(message) or _last_line(log_text)}",
                              rank, code, step)
    if OOM.search(evidence):
        return AttemptOutcome(api.OOM, f"{where} ran out of memory: {_last_line(message)}", rank, code, step)
    if (m := NODE_LOST.search(evidence)) and not CHECKPOINT.search(evidence):
        return AttemptOutcome(api.NODE_LOST, f"{where} lost a peer ({m.group(0)}): another node or rank went away",
                              rank, code, step)
    if CHECKPOINT.search(evidence):
        return AttemptOutcome(api.CHECKPOINT_FAILED, f"{where}: {_last_line(message or log_text)}", rank, code,
                              step)
    detail = _last_line(message) or _last_line(log_text) or "no message"
    return AttemptOutcome(api.WORKER_EXIT, f"{where} exited with code {code}: {detail}", rank, code, step)


def _own_error_first(root: Failure, failures: list[Failure], said: list[Heartbeat], rank_log: dict[int, str]
                     ) -> Failure:
    """A rank that raised an error of its own takes its peers down a moment later with "Connection closed by
    peer", and torchrun's root cause is whichever exit it saw first: the first rank whose last heartbeat gives an
    error that is not a lost peer is the cause (audit 8: a RuntimeError of rank 1 was reported, on one node, as
    rank 0 losing a peer, with rank 0's log to read)."""
    if root.exit_code <= 0 or not NODE_LOST.search((error_message(root.error_file) or "") + root.traceback
                                                   + rank_log.get(root.rank, "")):
        return root
    own = [hb for hb in said if hb.rank != root.rank and hb.exit_code and hb.exit_code > 0
           and not NODE_LOST.search(hb.exit_reason or "")]
    if not own:  # every rank here lost a peer: another node went away
        return root
    first = own[0]
    return next((f for f in failures if f.rank == first.rank), None) or Failure(
        first.rank, first.local_rank, first.exit_code, first.pid, None, "")


def _by_last_word(root: Failure | None, failures: list[Failure], heartbeats: dict[int, Heartbeat]
                  ) -> tuple[Failure | None, list[Failure], str]:
    """A rank whose last heartbeat gives its exit code, yet that torchrun saw die of a signal, died after its exit
    call, in the interpreter's teardown (SIGABRT, "terminate called without an active exception": likely gloo's
    threads, which can abort a process being torn down; pytorch/pytorch PR 179291, unmerged, describes it for a
    process that skips destroy_process_group, which finish() calls). Its own word is the outcome (finished, preempted, a
    config error); the death is noted. Returns the failures with those codes replaced, and the note."""
    died = []

    def word(f: Failure) -> Failure:
        hb = heartbeats.get(f.rank)
        if f.exit_code >= 0 or hb is None or hb.phase != "exited" or hb.exit_code is None:
            return f
        died.append(f"rank {f.rank} ({signal_name(f.exit_code)})")
        return replace(f, exit_code=hb.exit_code)

    failures = [word(f) for f in failures]
    if root is not None:  # the summary lists the root among the failures: the same entry, replaced once
        root = next((f for f in failures if f.rank == root.rank), None) or word(root)
    note = (f"; {', '.join(sorted(set(died)))} then died in Python's teardown, after its exit: not a failure "
            "of training") if died else ""
    return root, failures, note

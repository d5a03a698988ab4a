"""`resilient logs`: what the ranks printed, from `logs/attempt_<k>/rank_<r>/` (supervisor/ranklogs.py).

Each line goes to stdout prefixed with its rank and stream (`[rank 1 out] `, `[rank 1 err] `): by default the
latest attempt, every rank, stdout then stderr. `--follow` prints lines as the ranks write them and moves on
to each new attempt (unless `--attempt` pins one) until the run is over; headers go to stderr.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from supervisor import layout, ranklogs, render, state, targets
from supervisor.console import go_quiet
from supervisor.errors import ExitCode, UsageError
from supervisor.fsutil import open_regular
from supervisor.protocol import pid_alive, read_heartbeats

POLL_S = 0.2
CHUNK = 1 << 20  # bytes read at a time
SKIPPED = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EINVAL, errno.ELOOP})  # not yet there; a FIFO, a link
ORPHAN_BEAT_S = 60.0  # a rank that beat this recently, still alive, may still write (a kill -9'd supervisor's)


@dataclass
class Tail:
    """One log file read incrementally, a chunk at a time: a line is printed once it is complete (or at the end),
    and a line longer than a chunk (a progress bar redrawn with \\r) in pieces, so nothing big is held."""

    path: Path
    prefix: str
    offset: int = 0
    pending: bytes = b""  # the start of an unfinished line: under CHUNK bytes
    mid_line: bool = False  # part of the current line was printed already, with its prefix
    identity: tuple[int, int] | None = None  # the file read so far (device, inode)

    def read(self, final: bool = False) -> Iterator[str]:
        try:
            f = os.fdopen(open_regular(self.path), "rb")  # a FIFO would hang the reader
        except OSError as e:
            if e.errno not in SKIPPED:  # a file this user may not read is said (exit 2), not passed over in silence
                raise
            f = None
        if f is not None:
            with f:
                st = os.fstat(f.fileno())
                now = (st.st_dev, st.st_ino)
                if self.identity not in (None, now) or st.st_size < self.offset:
                    self.offset = 0  # replaced or truncated under --follow: read the new one from its start
                self.identity = now
                f.seek(self.offset)
                while data := f.read(CHUNK):
                    self.offset += len(data)
                    yield from self._take(data)
        if final and (self.pending or self.mid_line):
            yield self._head() + self.pending.decode(errors="replace") + "\n"
            self.pending, self.mid_line = b"", False

    def _take(self, data: bytes) -> Iterator[str]:
        *done, rest = data.split(b"\n")
        if done:
            first = self._head() + (self.pending + done[0]).decode(errors="replace") + "\n"
            yield first + "".join(self.prefix + line.decode(errors="replace") + "\n" for line in done[1:])
            self.pending, self.mid_line = rest, False
        else:
            self.pending += rest
        if len(self.pending) >= CHUNK:
            cut = _whole_characters(self.pending)
            yield self._head() + self.pending[:cut].decode(errors="replace")
            self.pending, self.mid_line = self.pending[cut:], True

    def _head(self) -> str:
        return "" if self.mid_line else self.prefix


def _whole_characters(data: bytes) -> int:
    """How much of `data` ends on a whole UTF-8 character (a character cut between chunks waits for the rest)."""
    cut = len(data)
    while cut > len(data) - 4 and cut > 0 and data[cut - 1] & 0xC0 == 0x80:  # continuation bytes
        cut -= 1
    if cut > 0 and data[cut - 1] >= 0xC0:  # a lead byte whose character may be incomplete
        cut -= 1
    return cut or len(data)


@dataclass
class NodeLogs:
    """The attempt shown for one node dir, and the files of its ranks."""

    node_dir: Path
    attempt: int
    tails: dict[str, Tail] = field(default_factory=dict)  # by the file's real path: a link and its target are one

    @property
    def logs_dir(self) -> Path:
        return layout.RunLayout(self.node_dir).logs_dir(self.attempt)

    def discover(self, rank: int | None) -> None:
        _listable(self.logs_dir)
        real_logs = Path(os.path.realpath(self.logs_dir))
        for r, folder in ranklogs.rank_folders(self.logs_dir).items():
            if rank is not None and r != rank:
                continue
            for stream in ranklogs.STREAMS:
                path = folder / f"{stream}.log"
                real = os.path.realpath(path)
                # A link out of the attempt's logs (planted, or left by a copy) is never read through.
                # The file itself is read, not the link: a link moved on (torchrun re-formed the group in place)
                # would bring the new file under the old tail as well as under its own, printed twice.
                if real not in self.tails and layout.inside(Path(real), real_logs):
                    self.tails[real] = Tail(Path(real), f"[rank {r} {stream[3:]}] ")

    def read(self, final: bool = False) -> Iterator[str]:
        for tail in self.tails.values():
            yield from tail.read(final)


def _listable(logs_dir: Path) -> None:
    """The attempt's folders that hold the ranks' files can be listed, or the OSError that says why not: where
    they cannot (another user's run dir, mode 700), the ranks were passed over as if they had printed nothing."""
    folders = [logs_dir, logs_dir / ranklogs.RANKS_DIR]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(folder) as entries:
                depth = len(folder.relative_to(logs_dir).parts)
                folders += [Path(e.path) for e in entries if 1 <= depth <= 2 and e.is_dir(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            continue


def _write(chunks: Iterable[str]) -> None:
    wrote = False
    for chunk in chunks:
        sys.stdout.write(chunk)
        wrote = True
    if wrote:
        sys.stdout.flush()


def _header(nl: NodeLogs) -> None:
    render.err.print(f"==> attempt {nl.attempt}: {nl.logs_dir} <==", markup=False, soft_wrap=True)


def _ending(nodes: list[state.NodeRead], nl: NodeLogs) -> None:
    """How the supervisor judged the attempt `nl` followed, between its lines and the next attempt's: the last
    traceback shown is often a peer's that lost its connection, not the failed rank's (audit 16)."""
    for n in nodes:
        if n.node_dir == nl.node_dir and n.record is not None:
            if not n.alive:  # its supervisor died with the attempt open: as status and the next run close it
                state.close_lost_attempt(n.record, n.node_dir)  # (audit 17: --follow ended without a word)
            ended = [h for h in n.record.history if h.attempt == nl.attempt and h.ended_at is not None and h.reason]
            if ended:
                h = ended[-1]
                who = f" (rank {h.failed_rank})" if h.failed_rank is not None else ""
                render.err.print(f"==> attempt {nl.attempt} ended: {h.reason}{who} — {h.detail or ''} <==",
                                 markup=False, soft_wrap=True)


def _current(nodes: list[state.NodeRead]) -> list[Path]:
    """The node dirs the run is made of now: not those of nodes it went on without (state.retired)."""
    readable = [(n.record, n.alive) for n in nodes if n.record is not None]
    gone = iter(state.retired(readable))
    return [n.node_dir for n in nodes if n.record is None or not next(gone)]


def _latest(node_dir: Path) -> int | None:
    found = ranklogs.attempts(node_dir)
    return found[-1] if found else None


def _over(files: list[Path], attempt: int | None) -> bool:
    """The run (or the pinned attempt) is over: its ranks will write nothing more."""
    return _ended(state.read_nodes(files), attempt)


def _ended(nodes: list[state.NodeRead], attempt: int | None) -> bool:
    for n in nodes:
        if n.record is None:  # gone or unreadable: over unless a live supervisor still holds that node
            if n.alive:
                return False
            continue
        rec = n.record
        live = not rec.state.final and n.alive
        if not rec.state.final and not n.alive and _orphans_write(n.node_dir, rec.attempt):
            return False  # a supervisor killed -9: its ranks checkpoint and log their last lines without it
        if attempt is None and live:
            return False
        if attempt is not None and live and (any(h.attempt == attempt and h.ended_at is None for h in rec.history)
                                             or all(h.attempt < attempt for h in rec.history)):
            return False  # the pinned attempt runs, or may still come
    return True


def _orphans_write(node_dir: Path, attempt: int) -> bool:
    """A rank of `attempt` is still running (alive, not exited, beating in the last minute)."""
    now = time.time()
    return any(hb.phase != "exited" and now - hb.time < ORPHAN_BEAT_S and pid_alive(hb.pid)
               for hb in read_heartbeats(layout.RunLayout(node_dir).heartbeat_dir(attempt)).values())


def _no_attempt(run_dir: Path, attempt: int) -> UsageError:
    have = sorted({a for d in layout.node_dirs(run_dir) for a in ranklogs.attempts(d)})
    return UsageError(f"{run_dir}: no attempt {attempt} (attempts: {', '.join(map(str, have)) or 'none'}).")


def _no_rank(run_dir: Path, nodes: list[NodeLogs], rank: int) -> UsageError:
    seen = sorted({r for nl in nodes for r in ranklogs.rank_folders(nl.logs_dir)})
    return UsageError(f"{run_dir}: attempt {nodes[0].attempt} has no output for rank {rank} "
                      f"(ranks: {', '.join(map(str, seen)) or 'none yet'}).")


def main(target: str | None, rank: int | None, attempt: int | None, follow: bool, *,
         poll_s: float = POLL_S) -> int:
    try:
        return _logs(target, rank, attempt, follow, poll_s)
    except BrokenPipeError:  # `| head -1`: the reader has what it wanted (it said "cannot be read", exit 1)
        go_quiet(render.out)
        return ExitCode.OK


def _logs(target: str | None, rank: int | None, attempt: int | None, follow: bool, poll_s: float) -> int:
    def there() -> tuple[targets.Target, list[Path]]:
        t = targets.resolve(target, reads_only=True)
        return t, targets.state_files(t)

    t, files = targets.once_there(there, poll_s) if follow else there()
    run_dir = t.run_dir
    assert run_dir is not None
    for node_dir in layout.node_dirs(run_dir):  # audit 15: "no attempt has started yet", or nothing and exit 0
        if (node_dir / layout.LOGS_DIR).is_symlink():
            raise UsageError(f"{node_dir / layout.LOGS_DIR} is a link, which resilient does not follow out of a run "
                             "dir; put the logs folder itself back there.")
    nodes = []
    for node_dir in (layout.node_dirs(run_dir) if attempt is not None else _current(state.read_nodes(files))):
        k = attempt if attempt is not None else _latest(node_dir)
        if k is not None and (attempt is None or k in ranklogs.attempts(node_dir)):
            nodes.append(NodeLogs(node_dir, k))
    if not nodes and not follow:
        if attempt is not None:
            raise _no_attempt(run_dir, attempt)
        raise UsageError(f"{run_dir}: no attempt has started yet; `resilient logs {t.given} --follow` waits for one.")
    for nl in nodes:
        nl.discover(rank)
    if not follow:
        if rank is not None and not any(nl.tails for nl in nodes):
            raise _no_rank(run_dir, nodes, rank)
        for nl in nodes:
            if len(nodes) > 1:
                _header(nl)
            _write(nl.read(final=True))
        return ExitCode.OK
    return _follow(run_dir, files, nodes, rank, attempt, poll_s)


def _follow(run_dir: Path, files: list[Path], nodes: list[NodeLogs], rank: int | None, attempt: int | None,
            poll_s: float) -> int:
    by_dir = {nl.node_dir: nl for nl in nodes}
    seen_rank = False  # --rank R: R had output in some attempt followed
    for nl in nodes:
        _header(nl)
    while True:
        read = state.read_nodes(files)
        over = _ended(read, attempt)  # decided before the last read, so nothing written before it is missed
        for node_dir in (layout.node_dirs(run_dir) if attempt is not None else _current(read)):
            k = attempt if attempt is not None else _latest(node_dir)
            nl = by_dir.get(node_dir)
            if k is None or (nl is not None and nl.attempt == k):
                continue
            if attempt is not None and k not in ranklogs.attempts(node_dir):
                continue  # not begun (yet) on this node
            if nl is not None:  # a relaunch: finish the old attempt's files, say how it ended, follow the new one
                _write(nl.read(final=True))
                _ending(read, nl)
            by_dir[node_dir] = nl = NodeLogs(node_dir, k)
            _header(nl)
        for nl in by_dir.values():
            nl.discover(rank)
            seen_rank = seen_rank or bool(nl.tails)
            _write(nl.read(final=over))
        if over:
            for nl in by_dir.values():  # the last attempt's verdict too (review 14): the one people follow for
                _ending(state.read_nodes(files), nl)
            if attempt is not None and not by_dir:  # the run ended (or never ran) without it
                raise _no_attempt(run_dir, attempt)
            if rank is not None and by_dir and not seen_rank:
                raise _no_rank(run_dir, list(by_dir.values()), rank)  # after all that waiting, say why nothing came
            return ExitCode.OK
        time.sleep(poll_s)
        files = layout.state_files(run_dir) or files

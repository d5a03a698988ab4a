"""Each rank's output in a stable place: `logs/attempt_<k>/rank_<r>/` (stdout.log, stderr.log, error.json).

torchrun (`--log-dir … --redirects 3`) writes a rank's output to
`logs/attempt_<k>/ranks/<run id>_<random>/attempt_<n>/<local rank>/`, a path nobody can guess. While an
attempt runs, the supervisor links `rank_<r>` to the folder of global rank r: a relative symbolic link, so a
copied or moved run dir keeps working. A link is replaced when torchrun re-forms the group in place (its
`attempt_<n>` moves on). Readers follow a link only to a folder inside the same attempt's logs.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

from supervisor.layout import LOGS_DIR, NODES_DIR, inside
from supervisor.protocol import Heartbeat

LINK_RE = re.compile(r"^rank_(\d+)\Z")
STREAMS = ("stdout", "stderr")
RANKS_DIR = "ranks"  # torchrun's --log-dir inside an attempt's logs


def link_name(rank: int) -> str:
    return f"rank_{rank}"


def _single_node(logs_dir: Path) -> bool:
    """On one node torchrun's local rank is the global rank; nodes of a shared run dir live under nodes/."""
    return logs_dir.parent.parent.parent.name != NODES_DIR


def torchrun_folders(logs_dir: Path) -> dict[int, Path]:
    """Local rank → torchrun's newest folder for it (the highest `attempt_<n>` of its in-place restarts)."""
    best: dict[int, tuple[int, float, Path]] = {}
    for d in (logs_dir / RANKS_DIR).glob("*/attempt_*/*"):
        try:
            local, n = int(d.name), int(d.parent.name.removeprefix("attempt_"))
            key = (n, d.stat().st_mtime, d)
        except (ValueError, OSError):
            continue
        if local not in best or key[:2] > best[local][:2]:
            best[local] = key
    return {local: key[2] for local, key in best.items()}


def _targets(logs_dir: Path, heartbeats: Mapping[int, Heartbeat]) -> dict[int, Path]:
    out: dict[int, Path] = {}
    for rank, hb in heartbeats.items():
        if hb.log_dir and inside(Path(hb.log_dir), logs_dir):
            out[rank] = Path(hb.log_dir)
    if _single_node(logs_dir):  # ranks that have not beaten yet (or never will: they died starting)
        for local, folder in torchrun_folders(logs_dir).items():
            out.setdefault(local, folder)
    return out


def link(logs_dir: Path, heartbeats: Mapping[int, Heartbeat]) -> None:
    """Create or refresh `rank_<r>` for every rank whose folder is known. Never raises: the watch loop
    calls it every poll, and a missing link must not stop a supervisor."""
    for rank, folder in _targets(logs_dir, heartbeats).items():
        path = logs_dir / link_name(rank)
        target = os.path.relpath(folder, logs_dir)
        with contextlib.suppress(OSError):
            if os.readlink(path) == target:
                continue
        tmp = logs_dir / f".{link_name(rank)}.tmp"
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
            os.symlink(target, tmp)
            os.replace(tmp, path)  # replaces an older link atomically, never a real folder


def rank_folders(logs_dir: Path) -> dict[int, Path]:
    """Rank → its output folder for one attempt: the links (followed only inside `logs_dir`), else, on one
    node, torchrun's folders by local rank (run dirs from before the links, or a rank that died first)."""
    found: dict[int, Path] = {}
    real_logs = Path(os.path.realpath(logs_dir))
    with contextlib.suppress(OSError):
        for entry in os.scandir(logs_dir):
            m = LINK_RE.match(entry.name)
            if m and inside(Path(os.path.realpath(entry.path)), real_logs) and entry.is_dir():
                found[int(m.group(1))] = Path(entry.path)
    if _single_node(logs_dir):
        for local, folder in torchrun_folders(logs_dir).items():
            found.setdefault(local, folder)
    return dict(sorted(found.items()))


def attempts(node_dir: Path) -> list[int]:
    """The attempts that have a log folder under `node_dir`, oldest first."""
    out = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(node_dir / LOGS_DIR):
            m = re.match(r"^attempt_(\d+)\Z", entry.name)
            if m and entry.is_dir():
                out.append(int(m.group(1)))
    return sorted(out)

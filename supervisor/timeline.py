"""The run's timeline: a compact text view for the terminal, and a PNG (step against wall time) with
failures, relaunches and checkpoints marked. matplotlib is optional (`pip install 'resilient[plot]'`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from supervisor.errors import UsageError
from supervisor.layout import RunLayout
from supervisor.protocol import CommitRecord, StepRecord, read_step_log
from supervisor.state import RunRecord


def _span(record: RunRecord) -> tuple[float, float] | None:
    starts = [h.started_at for h in record.history]
    ends = [h.ended_at or record.updated_at for h in record.history]
    if not starts:
        return None
    return min(starts), max(max(ends), record.updated_at if not record.state.final else max(ends))


def text_timeline(record: RunRecord, width: int = 60) -> list[str]:
    """One line per attempt: `s` starting up, `█` training, `x` the failure, scaled to the whole run."""
    span = _span(record)
    if span is None:
        return []
    t0, t1 = span
    scale = width / max(t1 - t0, 1e-9)

    def col(t: float) -> int:
        return min(width - 1, max(0, int((t - t0) * scale)))

    lines = []
    for h in record.history:
        row = [" "] * width
        end = h.ended_at or t1
        first = h.first_step_at or end
        for i in range(col(h.started_at), col(first) + 1):
            row[i] = "s"
        if h.first_step_at is not None:  # an attempt that ended in its startup trained not at all
            for i in range(col(first), col(end) + 1):
                row[i] = "█"
        if h.reason not in (None, "finished", "stopped"):
            row[col(end)] = "x"
        what = h.reason or "running"
        at = f" @{h.step_at_failure}" if h.step_at_failure is not None else ""
        lines.append(f"{h.attempt:>3} |{''.join(row)}| {what}{at}")
    return lines


def _attempt_series(node_dir: Path, attempt: int) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    steps, commits = [], []
    for r in read_step_log(RunLayout(node_dir).step_log(attempt)):
        if isinstance(r, StepRecord):
            steps.append((r.t, r.step))
        elif isinstance(r, CommitRecord):
            commits.append((r.t, r.step))
    return steps, commits


def plot(record: RunRecord, node_dir: Path, out: Path) -> Path:
    """Draw step against wall time for every attempt to `out` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'resilient[plot]' (or matplotlib).") from None
    span = _span(record)
    if span is None:
        raise UsageError(f"{record.run_dir}: the run has no attempts to draw yet.")
    t0 = span[0]
    fig, ax = plt.subplots(figsize=(10, 5), dpi=110)
    labelled: set[str] = set()

    def once(label: str) -> str | None:
        if label in labelled:
            return None
        labelled.add(label)
        return label

    series = {h.attempt: _attempt_series(node_dir, h.attempt) for h in record.history}
    n_commits = sum(len(commits) for _, commits in series.values())
    # Dozens of checkpoints would bury the attempts' lines: then they are small and drawn beneath them.
    commit_size = 28 if n_commits <= 40 else 8
    last_label: tuple[float, int] | None = None  # (x, vertical offset) of the last failure's label
    for h in record.history:
        steps, commits = series[h.attempt]
        if steps:
            ax.plot([t - t0 for t, _ in steps], [s for _, s in steps], lw=1.6, zorder=3,
                    label=f"attempt {h.attempt}")
        if commits:
            ax.scatter([t - t0 for t, _ in commits], [s for _, s in commits], marker="^", s=commit_size,
                       color="green", zorder=2, label=once("checkpoint committed"))
        ax.axvline(h.started_at - t0, color="grey", ls="--", lw=0.8, label=once("launch / relaunch"))
        if h.reason not in (None, "finished", "stopped") and h.ended_at is not None:
            x = h.ended_at - t0
            y = h.step_at_failure if h.step_at_failure is not None else (steps[-1][1] if steps else 0)
            ax.scatter([x], [y], marker="x", s=80, color="red", zorder=4, label=once("failure"))
            # Failures close together get their labels above and below in turn, so they do not overprint.
            near = last_label is not None and x - last_label[0] < 0.06 * (span[1] - t0)
            dy = -14 if near and last_label[1] > 0 else 6
            last_label = (x, dy)
            rank = f" r{h.failed_rank}" if h.failed_rank is not None else ""
            ax.annotate(f"{h.reason}{rank}", (x, y), textcoords="offset points", xytext=(4, dy), fontsize=8,
                        color="red")
    gp = record.goodput
    title = f"{record.name}: {record.state.value}, goodput {gp:.1%}" if gp is not None else record.name
    lost = (record.accounting.get("summary") or {}).get("lost_steps")
    if lost is not None:
        relaunches = max(0, len(record.history) - 1)
        title += f", {lost} steps lost, {relaunches} relaunch{'es' if relaunches != 1 else ''}"
    ax.set_title(title)
    ax.set_xlabel("wall time since the first launch (s)")
    ax.set_ylabel("training step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out


def summary_line(summary: dict[str, Any]) -> str:
    """The goodput line of `status`; each figure carries the name of its `status --json` field ("tail" is
    `tail_s`: last step → end of each attempt, the final checkpoint and exit as much as a failure's handling)."""
    if not summary:
        return "-"
    gp = summary.get("goodput")
    head = f"{gp:.1%}" if gp is not None else "-"
    return (f"{head} of {summary['wall_s']:.1f}s wall: useful {summary['useful_s']:.1f}s, startup "
            f"{summary['startup_s']:.1f}s, checkpoint blocking {summary['checkpoint_blocking_s']:.2f}s, "
            f"{'hung ' + format(summary['stalled_s'], '.1f') + 's, ' if summary.get('stalled_s') else ''}lost "
            f"{summary['lost_steps']} steps ({summary['lost_s']:.1f}s), tail {summary['tail_s']:.1f}s, "
            f"down {summary['down_s']:.1f}s"
            + (f", since the last step {summary['open_s']:.1f}s" if (summary.get("open_s") or 0) >= 5.0 else ""))

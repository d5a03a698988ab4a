"""Which checkpoint the next attempt resumes from, in each tier, and what is set aside on the way.

Before every launch the newest valid checkpoint is chosen, checked as the job says (sizes, or every byte);
a committed one found corrupt on the way is renamed aside with its reason (never deleted), so that a rerun
does not trip over it again. A whole checkpoint the ranks failed to load twice is passed over, and set aside
only once an older one loads: then the fault was the checkpoint's, not the machine's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor import api, store
from supervisor.api import AttemptOutcome, Decision, ResumeChoice
from supervisor.config import CheckpointConfig
from supervisor.console import EventConsole
from supervisor.policy import LoadFailure


def choose_resume(root: Path, verify: str, below: int | None = None, below_why: str | None = None) -> ResumeChoice:
    """The newest valid checkpoint (strictly below `below` if given, for `below_why`), and why newer folders were
    skipped."""
    skipped: list[tuple[str, str]] = []
    corrupt: list[store.CheckpointInfo] = []
    if not root.is_dir():
        return ResumeChoice(None, None, skipped)
    for path in reversed(store.checkpoint_dirs(root)):
        info = store.inspect(path, deep=verify == "checksum" and not path.name.endswith(store.PARTIAL_SUFFIX))
        if below is not None and info.step >= below:
            if info.valid:
                skipped.append((path.name, below_why or f"rolled back past it (a non-finite loss followed step "
                                                        f"{below})"))
            continue
        if info.valid:
            return ResumeChoice(info.step, info.path, skipped, corrupt)
        skipped.append((path.name, f"{info.status.value}: {info.reason}"))
        # set aside, but not a folder of someone else's that holds no checkpoint file (review 14)
        if info.status is store.Status.CORRUPT and not info.partial and \
                (info.manifest is not None or store.holds_checkpoint_files(info.path)):
            corrupt.append(info)
    return ResumeChoice(None, None, skipped, corrupt)


class ResumeChooser:
    """The resume point of each attempt of one run, on one node.

    Args:
        ckpt: the job's checkpoint section (the durable tier, and how to check it).
        local_root: this node's local tier, if the job has one.
        console: where what is skipped and set aside is said.
        quarantined: told of each folder set aside (the run's record keeps them).
        next_attempt: the number of the attempt about to be chosen for (named in a set-aside folder's reason).
    """

    def __init__(self, ckpt: CheckpointConfig, local_root: Path | None, console: EventConsole,
                 quarantined: Callable[[dict[str, Any]], None], next_attempt: Callable[[], int]):
        self.ckpt, self.local_root, self.console = ckpt, local_root, console
        self._quarantined, self._next_attempt = quarantined, next_attempt
        self.local_step: int | None = None  # the local tier's newest valid step, offered beside the durable choice
        # A whole checkpoint the ranks failed to load twice: passed over, set aside once an older one loads.
        self.suspect: tuple[int, str] | None = None
        self.set_aside_now: list[str] = []  # the folders the last choice set aside, as they are now named

    def choose(self, below: int | None) -> ResumeChoice:
        """The newest valid checkpoint; a committed one found corrupt on the way is set aside for good (a
        rerun must not trip over it again), the older ones are left to retention."""
        self.set_aside_now = []
        why = None
        if self.suspect is not None:
            below = min(below, self.suspect[0]) if below is not None else self.suspect[0]
            if below == self.suspect[0]:
                why = f"passed over: {self.suspect[1]}"
        choice = self._choose_in(self.ckpt.dir, below, why)
        if self.local_root is not None:  # the node's local tier: the ranks take it if every node has the step
            local = self._choose_in(self.local_root, below, why)
            self.local_step = local.step
            choice.skipped += [(f"local {n}", w) for n, w in local.skipped]
        return choice

    def _choose_in(self, root: Path, below: int | None, below_why: str | None) -> ResumeChoice:
        choice = choose_resume(root, self.ckpt.verify, below, below_why)
        for info in choice.corrupt:
            # said once, by the attempt's "skipping <folder>: <why>; set aside as <name>" line
            moved = self.quarantine(info.path, f"{info.reason} (found before attempt {self._next_attempt()})",
                                    say=False)
            if moved is not None:
                self.set_aside_now.append(moved.name if root == self.ckpt.dir else f"{moved.name} (local)")
                choice.skipped = [(n, f"{w}; set aside as {moved.name}" if n == info.path.name else w)
                                  for n, w in choice.skipped]
        return choice

    def progress(self, choice: ResumeChoice) -> tuple[bool, int | None, int | None]:
        """After an attempt that resumed from `choice`: is there a newer valid checkpoint in either tier, and the
        newest valid one in either tier with the one below it (a NaN's rollback target). A checkpoint passed over
        (it failed to load) is no progress.

        Both tiers: with the local tier ahead of the durable one by the replication lag, the newest durable step
        as the rollback's "newest" rolled back two intervals, set a good step aside, and left the local step the
        loss went non-finite after to a later relaunch, which handed it to the ranks again.
        """
        below = self.suspect[0] if self.suspect is not None else None
        newest = self._newest_valid(below)
        older = self._newest_valid(newest) if newest is not None else None
        started = max((s for s in (choice.step, self.local_step) if s is not None), default=None)
        progressed = newest is not None and (started is None or newest > started)
        return progressed, newest, older

    def _newest_valid(self, below: int | None) -> int | None:
        """The newest valid step below `below` (if given) in either tier."""
        found = (store.latest_valid(root, below=below) for root in (self.ckpt.dir, self.local_root)
                 if root is not None)
        return max((i.step for i in found if i is not None), default=None)

    def newest_step(self) -> int | None:
        """The newest valid checkpoint in either tier."""
        return self._newest_valid(None)

    def load_failure(self, outcome: AttemptOutcome, choice: ResumeChoice) -> LoadFailure | None:
        """The ranks could not load their checkpoint: is it bad (a full check), and what is older?"""
        if outcome.reason != api.CHECKPOINT_LOAD:
            return None
        step = outcome.checkpoint_step if outcome.checkpoint_step is not None else choice.step
        if step is None:
            return None
        local = outcome.checkpoint_tier == "local" and self.local_root is not None
        root = self.local_root if local and self.local_root is not None else self.ckpt.dir
        path = root / store.step_dirname(step)
        tier = "this node's local copy of " if local else ""
        self.console.event(f"checking every byte of {tier}{path.name}, which the ranks could not load",
                           style="yellow")
        info = store.inspect(path, deep=True) if path.is_dir() else None
        older = self._newest_valid(step)
        # Unreadable here says nothing of its bytes: it is set aside only as whole yet failing to load twice.
        whole = info is not None and (info.valid or info.status is store.Status.UNREADABLE)
        corrupt = None if whole else (info.reason if info else "the folder is gone")
        return LoadFailure(step, corrupt, older, local=local)

    def set_aside(self, decision: Decision) -> None:
        """What a relaunch decision says to set aside: now, or (a whole checkpoint that failed to load twice)
        once an older one loads."""
        if decision.quarantine_once_older_loads and decision.quarantine_step is not None:
            self.suspect = (decision.quarantine_step, decision.quarantine)
            self.console.event(f"passing over step {decision.quarantine_step}: {decision.quarantine}; it is set "
                               "aside once an older checkpoint loads", style="yellow")
        elif decision.quarantine_step is not None:
            root = self.local_root if decision.quarantine_local and self.local_root else self.ckpt.dir
            self.quarantine(root / store.step_dirname(decision.quarantine_step), decision.quarantine)

    def resumed(self, step: int | None) -> None:
        """The ranks loaded `step` (None: a fresh start): a suspect newer than it was the checkpoint's fault."""
        if self.suspect is None:
            return
        suspect, why = self.suspect
        self.suspect = None  # the ranks are past loading: the next relaunch chooses afresh
        if step is not None and step < suspect:  # an older one loads where it did not
            # In each tier that holds it: a local copy left behind was whole to the next relaunch's choice, which
            # handed it to the ranks again.
            for root in (self.ckpt.dir, self.local_root):
                if root is not None and (root / store.step_dirname(suspect)).is_dir():
                    self.quarantine(root / store.step_dirname(suspect), f"{why}; step {step} loads")

    def quarantine(self, path: Path, reason: str, say: bool = True) -> Path | None:
        """Rename a checkpoint aside with its reason (never delete it); None if another node did it first."""
        try:
            moved = store.quarantine(path, reason)
        except FileNotFoundError:  # another node's supervisor set it aside first (review 15: "it stays where it is")
            return None
        except OSError as e:
            self.console.event(f"could not set {path.name} aside ({e.strerror}); it stays where it is", style="red")
            return None
        if say:
            self.console.event(f"set {path.name} aside as {moved.name}: {reason}", style="yellow")
        self._quarantined({"step": int(path.name[5:14]), "path": moved.name, "reason": reason, "at": time.time()})
        return moved

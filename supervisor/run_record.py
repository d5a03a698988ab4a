"""The run's record as a new supervision takes it up (state.py owns its format): kept from the run dir's state
file, set aside when damaged, or carried over from the nodes before this one."""

from __future__ import annotations

import contextlib
import os
import socket
import time

from supervisor import __version__, state, store
from supervisor.config import JobConfig
from supervisor.console import EventConsole
from supervisor.errors import ConfigError
from supervisor.layout import RunLayout, recorded, state_files
from supervisor.state import RunRecord


def open_record(cfg: JobConfig, layout: RunLayout, console: EventConsole) -> tuple[RunRecord, float | None]:
    """The record a new supervision of the run starts: the run's history, steps and books from its state file
    (or, for a node new to the run dir, from the newest record of the nodes before it), this supervisor's
    identity; and when the record it goes on from was last written."""
    prev: RunRecord | None = None
    own = layout.state_file.is_file()  # this node's own record, not a predecessor's
    if own:
        try:
            prev = state.read(layout.state_file)
        except state.StateFileError as e:
            if not e.damaged:  # another resilient's record, or one the filesystem would not give: kept whole
                fix = e.fix or "run it with the resilient that wrote it"
                raise ConfigError(f"{e}; nothing was launched. {fix[0].upper() + fix[1:]}, or move it aside "
                                  f"(mv {layout.state_file} {layout.state_file}.old) to start this run dir's record "
                                  "afresh.") from None
            kept = layout.state_file.with_name(f"{layout.state_file.name}.unreadable.{int(time.time())}")
            os.replace(layout.state_file, kept)  # damaged (a crash of the machine): kept, not overwritten
            console.event(f"{e}: kept as {kept.name}; this run's history starts afresh (the checkpoints are read "
                          "as always)", style="red")
    else:
        prev = _predecessor(cfg, layout, console)
    rec = RunRecord(name=cfg.name, run_dir=".",  # paths relative to the run dir: layout.recorded
                    checkpoint_dir=recorded(cfg.checkpoint.dir, cfg.run_dir), node=layout.node,
                    max_restarts=cfg.restart.max_restarts, min_nodes=cfg.nnodes_range[0])
    if prev is not None:  # a rerun keeps the history, so status tells the whole story
        rec.history, rec.step, rec.last_checkpoint_step = prev.history, prev.step, prev.last_checkpoint_step
        rec.quarantined, rec.attempt = prev.quarantined, prev.attempt
        # Its supervisor died (kill -9, a lost node): the attempt it left open is closed from its own node's files,
        # and the step and checkpoint are where its ranks went on to (audit 17: for the start-up's first second
        # status showed the dead supervisor's last word, 264/250, where 280/280 was the truth)
        was_open = bool(prev.history) and prev.history[-1].ended_at is None
        state.close_lost_attempt(prev, RunLayout(cfg.run_dir, prev.node).node_dir)
        if was_open:
            logged = prev.history[-1].step_at_failure
            rec.step = max((s for s in (rec.step, logged) if s is not None), default=None)
            # in either tier: with a local tier, its newest step went unreplicated with the supervisor
            roots = (cfg.checkpoint.dir, cfg.checkpoint.local_root(layout.node_name))
            newest = None
            with contextlib.suppress(OSError):  # a root that cannot be read now: the launch's choice says it
                newest = max((i.step for root in roots if root is not None and root.is_dir()
                              if (i := store.latest_valid(root)) is not None), default=None)
            if newest is not None and (rec.last_checkpoint_step is None or newest > rec.last_checkpoint_step):
                rec.last_checkpoint_step = newest
        rec.accounting, rec.restarts = prev.accounting, prev.restarts
        if own:  # this node's own tiers (a predecessor's were another node's): a failing durable tier's outage
            rec.replication = prev.replication  # goes on being timed (review 12: it was never carried)
    rec.supervisor = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time(),
                      "version": __version__}
    return rec, prev.updated_at if prev else None


def _predecessor(cfg: JobConfig, layout: RunLayout, console: EventConsole) -> RunRecord | None:
    """For a node new to this run dir (a Slurm requeue onto other hosts, a replaced node): the record of the
    run as the nodes before it left it, the newest whose supervisor is gone, so that attempts, history and
    goodput go on from there rather than start again (`status` retires the old nodes: state.retired)."""
    found = [n.record for n in state.read_nodes(state_files(cfg.run_dir))
             if n.node_dir != layout.node_dir and not n.alive and n.record is not None]
    if not found:
        return None
    rec = max(found, key=lambda r: r.updated_at)
    console.event(f"node {layout.node_name} is new to this run dir: its history and goodput go on from "
                  f"{'node ' + rec.node if rec.node else 'the single-node record'} (attempt {rec.attempt})")
    return rec

"""`resilient status`: the state of a run, live or finished, from the state files in its run dir."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from rich.console import Group
from rich.table import Table
from rich.text import Text

from supervisor import layout, protocol, render, state, store, targets, timeline
from supervisor.console import go_quiet
from supervisor.errors import ExitCode, NotYetError, ResilientError, UsageError
from supervisor.state import ReplicationState, RunRecord, RunState

ENDED_GRACE_S = 10.0


@dataclass
class NodeStatus:
    record: RunRecord
    node_dir: Path
    supervisor_alive: bool
    retired: bool = False  # the run went on without this node (state.retired): shown, not counted

    @property
    def effective_state(self) -> RunState:
        # A supervisor killed with -9 never writes its final state; its lock says it is gone.
        if not self.record.state.final and not self.supervisor_alive:
            return RunState.STOPPED
        return self.record.state

    def ranks(self, now: float) -> list[dict[str, Any]]:
        out = []
        for r in self.record.ranks:
            r = dict(r)
            if r.get("heartbeat_at") is not None:
                r["heartbeat_age_s"] = round(max(0.0, now - r["heartbeat_at"]), 2)
            if not self.supervisor_alive:  # its record is old: asked again (audit 16: an orphaned rank showed `no`)
                r["alive"] = self.on_this_host and protocol.rank_process(r.get("pid"), r.get("started_at")) is not None
            out.append(r)
        return out

    @property
    def on_this_host(self) -> bool:
        return on_this_host(self.record.supervisor)


@dataclass
class StatusResult:
    run_dir: Path
    nodes: list[NodeStatus]
    now: float
    target: targets.Target  # its checkpoint root as inspect-checkpoint and gc resolve it (job.json's, not state's)

    def __post_init__(self) -> None:
        for n in self.nodes:  # a recorded path out of the run dir is refused by the text view too, which shows none
            self._history(n.record)
            self._replication(n.record)

    @property
    def current(self) -> list[NodeStatus]:
        """The nodes the run is made of now: not those it went on without."""
        return [n for n in self.nodes if not n.retired] or self.nodes

    def ranks_ready(self) -> bool:
        """Every rank of the current attempt is listed, alive and training (what --wait-ranks waits for)."""
        if self.state is not RunState.RUNNING:
            return False
        ranks = [r for n in self.current for r in n.ranks(self.now)]
        if not ranks or not all(r.get("alive") and r.get("phase") == "train" for r in ranks):
            return False
        world = max((r.get("world_size") or 0 for r in ranks), default=0)
        return {r.get("rank") for r in ranks} >= set(range(world))

    @property
    def primary(self) -> NodeStatus:
        return max(self.current, key=lambda n: n.record.updated_at)

    @property
    def state(self) -> RunState:
        """The run's state over its current nodes: running while any node runs; succeeded only if all did. What
        --watch and --wait-ranks wait on (audit 18: on the node that wrote last, a node's killed supervisor ended
        `--watch --json` with exit 0 while the other node relaunched and the run went on)."""
        states = [n.effective_state for n in self.current]
        for candidate in (RunState.RUNNING, RunState.RESTARTING, RunState.PENDING, RunState.FAILED):
            if candidate in states:
                return candidate
        return RunState.SUCCEEDED if all(s is RunState.SUCCEEDED for s in states) else RunState.STOPPED

    def supervisor_stale(self) -> str | None:
        """Why a live supervisor's record does not show the present (stopped, or not written for a minute)."""
        rec = self.primary.record
        if not self.primary.supervisor_alive or rec.state.final:
            return None
        return _stale(rec.supervisor, self.now - rec.updated_at)

    def next_launch_in(self) -> float | None:
        """Seconds until a live supervisor's backoff ends and it launches the next attempt; None otherwise."""
        p = self.primary
        at = p.record.next_launch_at
        if at is None or not p.supervisor_alive or p.effective_state is not RunState.RESTARTING:
            return None
        return max(0.0, at - self.now)

    def to_json(self) -> dict[str, Any]:
        p = self.primary
        rec = p.record
        d = rec.to_dict()
        d.pop("schema_version", None)
        d.update(
            state=self.state.value,
            recorded_state=rec.state.value,
            supervisor_alive=p.supervisor_alive,
            supervisor_stale=self.supervisor_stale(),
            record_age_s=round(max(0.0, self.now - rec.updated_at), 1),
            next_launch_at=rec.next_launch_at if self.next_launch_in() is not None else None,
            # only while a live supervisor runs it (review 15: a killed one's stop was reported as under way)
            stopping=rec.stopping if p.supervisor_alive and p.effective_state is RunState.RUNNING else None,
            ranks=[r for n in self.current for r in n.ranks(self.now)],
            run_dir=str(self.run_dir),
            checkpoint_dir=str(self.checkpoint_root),
            history=self._history(rec),
            replication=self._replication(rec),
        )
        if (gone := self.recorded_checkpoint_gone()) is not None:
            d["last_checkpoint_problem"] = gone
        d["quarantined"] = self.quarantined()
        if len(self.nodes) > 1 or rec.node is not None:
            d["nodes"] = [{"node": n.record.node, "state": n.effective_state.value,
                           "supervisor_alive": n.supervisor_alive, "attempt": n.record.attempt,
                           "restarts": n.record.restarts, "step": n.record.step,
                           "goodput": n.record.goodput, "accounting": n.record.accounting,  # its own books
                           "replication": self._replication(n.record), "retired": n.retired,
                           "history": self._history(n.record)} for n in self.nodes]
        return d

    def _replication(self, rec: RunRecord) -> dict[str, Any]:
        """The tiers' record with its folders absolute, as checkpoint_dir is (audit 6: `durable_root` read
        "checkpoints", which a script would resolve against its own folder; a `..` path was echoed)."""
        out = dict(rec.replication or {})
        for key in ("local_root", "durable_root"):
            if isinstance(out.get(key), str) and out[key]:
                out[key] = str(layout.resolved(out[key], self.run_dir,
                                               what=f"{self.run_dir}'s state file (replication.{key})"))
        return out

    def _history(self, rec: RunRecord) -> list[dict[str, Any]]:
        out = []
        for h in rec.history:
            h = h.to_dict()
            if rec.node is not None:  # which node's attempt: the top level is one node's view (audit 7)
                h["node"] = rec.node
            if h.get("log_dir"):
                h["log_dir"] = str(layout.resolved(h["log_dir"], self.run_dir,
                                                   what=f"{self.run_dir}'s state file (history log_dir)"))
            out.append(h)
        return out

    @property
    def checkpoint_root(self) -> Path:
        """The root every light command reads (targets.resolve): a state file that records another one (a hand edit,
        a copied file) must not make `status` read a folder that inspect-checkpoint and gc do not (audit 6)."""
        return self.target.checkpoint_root

    def quarantined(self) -> list[dict[str, Any]]:
        """Checkpoints set aside: those the supervisor records, then folders in the root it did not set aside
        itself (a rank that saved a step again set an unreadable folder of that step aside)."""
        listed = list(self.primary.record.quarantined)
        names = {q.get("path") for q in listed}
        try:
            found = [p for p in store.checkpoint_dirs(self.checkpoint_root, quarantined=True)
                     if store.QUARANTINE_RE.match(p.name) and p.name not in names]
        except OSError:  # a root not mounted here: recorded_checkpoint_gone says so
            return listed
        return listed + [{"step": int(p.name[5:14]), "path": p.name, "reason": store.quarantine_reason(p)}
                         for p in found]

    def recorded_checkpoint_gone(self) -> str | None:
        """Why the recorded last checkpoint is not valid on disk now (deleted, damaged since), with the newest
        valid one; None when it is, or cannot be judged here (a local tier holds steps the durable root lacks)."""
        rec = self.primary.record
        if rec.last_checkpoint_step is None:
            return None
        root = self.checkpoint_root
        roots = [root]
        if rec.replication:  # judged only on that node's own machine, where its local tier is
            local = own_local_tier(rec, self.run_dir)
            try:
                if local is None or not local.is_dir():
                    return None
            except OSError:  # under a folder this user cannot search: nothing to say of it
                return None
            roots.append(local)
        if not root.is_dir():
            return f"its root {root} cannot be seen from here (not mounted, or gone)"
        name = store.step_dirname(rec.last_checkpoint_step)
        try:
            infos = [store.inspect(r / name) for r in roots if (r / name).is_dir()]
            if any(info.valid for info in infos):
                return None
            newest = max((n.step for r in roots if (n := store.latest_valid(r)) is not None), default=None)
        except OSError:  # a tier this user cannot read: nothing to say of it
            return None
        return (f"{infos[0].status.value}: {infos[0].reason}" if infos else "gone") + \
            f"; newest valid: {'none' if newest is None else newest}"

    def renderable(self) -> Group:
        p = self.primary
        rec = p.record
        st = self.state.value
        sup = rec.supervisor
        alive = Text("alive") if p.supervisor_alive else Text("not running", style="red")
        if (stale := self.supervisor_stale()) is not None:
            alive = Text(stale, style="yellow")
        ckpt = rec.last_checkpoint_step if rec.last_checkpoint_step is not None else "-"
        gone = self.recorded_checkpoint_gone()
        # Several nodes: the lines below are one node's record, the last written (audit 18: its goodput and restarts
        # jumped from node to node, unnamed); `nodes` lists each one's.
        view = f"node {rec.node}'s view: " if len(self.nodes) > 1 else ""
        lines: list[str | Text] = [
            Text.assemble((rec.name, "bold"), " — ", render.styled(st), f"   {view}attempt {rec.attempt} · "
                          f"{rec.restarts} restart(s), {rec.max_restarts} allowed per run"),
            Text.assemble(f"run dir   {self.run_dir} · supervisor pid {sup.get('pid', '-')} on "
                          f"{sup.get('host', '-')} (", alive, ")"),
            Text.assemble(f"progress  step {rec.step if rec.step is not None else '-'} · last valid checkpoint {ckpt}",
                          (f" (not valid on disk now: {gone})" if gone is not None else "", "yellow")),
            f"goodput   {timeline.summary_line((rec.accounting or {}).get('summary') or {})}",
        ]
        if (note := self.target.root_note()) is not None:  # outside the run dir, or reached through a link
            lines.append(note)
        if rec.stopping and p.supervisor_alive and p.effective_state is RunState.RUNNING:
            lines.append(Text(f"stopping  {rec.stopping}", style="yellow"))
        if (due := self.next_launch_in()) is not None:
            lines.append(f"restart   attempt {rec.attempt + 1} launches in {due:.0f}s (the backoff after attempt "
                         f"{rec.attempt})")
        ci = rec.checkpoint_interval
        if ci:
            # A choice not taken (within 10 % and 2 steps of the one in force) is named as such, not left to
            # contradict the interval shown (audit 8: "7 steps (auto: … = 6 steps of 131.5ms)").
            kept = f"; {ci['proposed_steps']} proposed, not taken yet" if ci.get("proposed_steps") else ""
            lines.append(f"interval  {ci.get('steps')} steps ({ci.get('mode')}: {ci.get('why', '')}{kept})")
        if len(self.nodes) > 1:
            nodes: list[str | Text] = ["nodes     "]
            for i, n in enumerate(self.nodes):
                books = f", goodput {n.record.goodput:.1%}" if isinstance(n.record.goodput, (int, float)) else ""
                nodes += [" · " if i else "", f"{n.record.node}: ", render.styled(n.effective_state.value),
                          f", attempt {n.record.attempt}, {n.record.restarts} restart(s){books}{self._node_note(n)}"]
            lines.append(Text.assemble(*nodes))
        current = rec.history[-1] if rec.history else None
        for n in self.current:  # audit 18: a node waiting for its peers read as plain "running", no word of why
            if (waiting := _forming(n, self.now)) is not None:
                named = f"node {n.record.node}: " if len(self.nodes) > 1 else ""
                lines.append(Text(f"waiting   {named}{waiting}", style="yellow"))
        parts: list[Any] = [Text(line) if isinstance(line, str) else line for line in lines]
        if current is not None and current.resumed_tier:
            parts.append(Text(f"resumed   step {current.resumed_from_step} from the {current.resumed_tier} tier"
                              + (f" ({current.resumed_why})" if current.resumed_why else "")))
        for n in self.current:
            parts.extend(replication_lines(n, self.now, named=len(self.nodes) > 1))
        for q in self.quarantined():  # set aside: the user should know, and may delete them
            parts.append(Text(f"set aside step {q.get('step')} as {q.get('path')}: {q.get('reason')}", style="yellow"))
        for note in rec.notes:  # rank 0's warnings: a restarted loader is silent in the numbers
            parts.append(Text(f"warning   attempt {note.get('attempt')}: {note.get('text')}", style="yellow"))
        if rec.message and p.effective_state in (RunState.FAILED, RunState.STOPPED):
            parts.append(Text(rec.message, style="red" if p.effective_state is RunState.FAILED else "yellow"))
        if any(n.record.ranks for n in self.current):
            ranks = Table(box=None, pad_edge=False, title="ranks", title_justify="left", title_style="bold")
            for col in ("NODE", "RANK", "PID", "STEP", "PHASE", "HEARTBEAT", "HUNG AFTER", "ALIVE", "STEPS/S", "NOTE"):
                ranks.add_column(col, no_wrap=col != "NOTE")
            for n in self.current:
                watching = n.supervisor_alive and n.effective_state is RunState.RUNNING
                # this node's supervisor not writing (stopped): its ranks' own beat files say how long each has been
                # silent (review 15: the record's frozen view painted healthy ranks red; another node's staleness
                # was asked)
                stale = watching and _stale(n.record.supervisor, self.now - n.record.updated_at) is not None
                beats = protocol.read_heartbeats(layout.RunLayout(n.node_dir).heartbeat_dir(n.record.attempt)) \
                    if stale and n.on_this_host else {}
                for seen, r in zip(n.record.ranks, n.ranks(self.now), strict=True):
                    exited = r.get("phase") == "exited"  # audit 16: an ended rank's age beside a hang limit was noise
                    age, limit = r.get("heartbeat_age_s"), r.get("hang_limit_s")
                    note = r.get("note") or ""
                    # Past its limit and not judged yet: by the age its supervisor saw (its own clock, as of its last
                    # look; review 14: by this clock a stop's frozen rows and a backoff's dead ranks turned red), or,
                    # its supervisor stopped, by the beat's age here on its own machine (audit 17: never shown then)
                    hb = beats.get(r.get("rank"))
                    silent = seen.get("heartbeat_age_s") if not stale else \
                        max(0.0, self.now - hb.time) if hb is not None and hb.time else None
                    if not note and not exited and watching and r.get("alive") and isinstance(silent, (int, float)) \
                            and isinstance(limit, (int, float)) and silent > limit:
                        unjudged = ", and nothing watches it" if stale else ""
                        note = Text(f"silent {render.human_duration(silent)} (limit {render.human_duration(limit)})"
                                    f"{unjudged}", style="red")
                    ranks.add_row(str(r.get("node") or n.record.node or "-"), str(r.get("rank")), str(r.get("pid")),
                                  str(r.get("step", "-")), str(r.get("phase", "-")),
                                  render.human_duration(age) + " ago", "-" if exited else render.human_duration(limit),
                                  "yes" if r.get("alive") else Text("no", style="red"),
                                  "-" if r.get("steps_per_s") is None else f"{r['steps_per_s']:.1f}", note)
            parts.append(ranks)
        if any(n.record.history for n in self.current):  # a retired node's: in the new nodes' (supervise.py)
            hist = Table(box=None, pad_edge=False, title="history", title_justify="left", title_style="bold")
            multinode = any(n.record.node for n in self.nodes)
            for col in ("#", "NODE", "STARTED", "TOOK", "REASON", "RANK", "AT STEP", "RESUMED", "LOST", "DETAIL"):
                if col != "NODE" or multinode:
                    hist.add_column(col, no_wrap=col != "DETAIL", overflow="fold")
            for n in self.current:
                for h in n.record.history:
                    took = (h.ended_at or self.now) - h.started_at
                    dash = "-"
                    node = [n.record.node or "-"] if multinode else []
                    hist.add_row(str(h.attempt), *node, render.clock(h.started_at),
                                 render.human_duration(took), render.styled(h.reason or "running"),
                                 dash if h.failed_rank is None else str(h.failed_rank),
                                 dash if h.step_at_failure is None else str(h.step_at_failure),
                                 dash if h.resumed_from_step is None else str(h.resumed_from_step),
                                 dash if not h.lost_steps else str(h.lost_steps), h.detail or "")
            parts.append(hist)
            parts.append(Text("timeline (s starting, █ training, x failure)", style="bold"))
            # The bar narrows with the terminal so that a line and its "worker_signal @12345" fit on one row.
            bar = max(20, min(60, render.out.width - 32))
            for n in self.current:
                prefix = f"{n.record.node} " if multinode else ""
                parts.extend(Text(prefix + line) for line in timeline.text_timeline(n.record, width=bar))
        return Group(*parts)


    def _node_note(self, n: NodeStatus) -> str:
        if n.supervisor_alive:
            return ""
        if n.retired:
            return " (supervisor not running; retired: the run went on without it)"
        need = max((m.record.min_nodes or 1 for m in self.nodes), default=1)
        if need > 1 and not n.record.state.final:  # a fixed-size group cannot form without it
            return f" (supervisor not running: the run needs {need} nodes, and cannot go on without it)"
        return " (supervisor not running)"


def replication_lines(node: NodeStatus, now: float, *, named: bool) -> list[Text]:
    """The two tiers of one node: newest local and durable step, the lag between them, a failing durable tier."""
    r = node.record.replication
    if not r:
        return []
    who = f" ({node.record.node})" if named else ""
    local, durable = r.get("newest_local"), r.get("newest_durable")
    lag = ""
    if r.get("lag_steps"):
        lag = f" · lag {r['lag_steps']} steps" + (f", {render.human_duration(r['lag_s'])}" if r.get("lag_s") else "")
    elif local is not None:
        lag = " · up to date"
    deleted = set(r.get("deleted_unreplicated") or [])
    waiting = [s for s in r.get("pending") or [] if s not in deleted]
    # Newest first: an older one still waiting when a newer one lands is superseded, never copied (audit 13:
    # "copying [60, 80, 100]" while only 100 would be)
    pending = "" if not waiting else (f" · copying {waiting[0]}" if len(waiting) == 1 else
                                      f" · not yet durable {waiting}, the newest copied first") \
        if node.supervisor_alive else \
        (f" · not copied yet {waiting} (`resilient run` again copies "
         + ("it)" if len(waiting) == 1 else f"the newest, {waiting[-1]}; the rest are superseded)"))
    # The durable tier could not keep up with the saves: the replicator copied newer ones instead of these.
    skipped = f" · {r['superseded']} not copied (superseded)" if r.get("superseded") else ""
    out = [Text(f"tiers{who}  local step {'-' if local is None else local} · durable step "
                f"{'-' if durable is None else durable}{lag}{pending}{skipped}")]
    if r.get("failing_since") and node.supervisor_alive:
        out.append(Text(f"the durable tier is FAILING for {render.human_duration(now - r['failing_since'])}: "
                        f"{r.get('last_error')}; checkpoints exist only on this node's local tier", style="bold red"))
    elif r.get("failing_since"):
        out.append(Text(f"the durable tier was FAILING when the supervisor stopped: {r.get('last_error')}; the steps "
                        "it lacks exist only on this node's local tier", style="bold red"))
    if r.get("deleted_unreplicated"):
        out.append(Text(f"deleted local step(s) {r['deleted_unreplicated']} that had no durable copy (the durable "
                        "tier failed longer than checkpoint.durable_outage_s)", style="bold red"))
    return out


FORMING_NOTE_S = 10.0  # a launch whose ranks have not begun after this long is said to be waiting for its group


def _forming(n: NodeStatus, now: float) -> str | None:
    """A live supervisor's attempt whose torchrun has started no rank for a while: it waits in the rendezvous for
    the group to form (the other nodes), or its ranks are slow to start; said with the job's node count."""
    rec = n.record
    last = rec.history[-1] if rec.history else None
    if not n.supervisor_alive or n.effective_state is not RunState.RUNNING or rec.ranks or last is None \
            or last.ended_at is not None or last.world_size is not None or now - last.started_at < FORMING_NOTE_S:
        return None
    need = f"at least {rec.min_nodes} node(s)" if (rec.min_nodes or 1) > 1 else "its ranks"
    return (f"attempt {last.attempt}'s torchrun has started no rank for {render.human_duration(now - last.started_at)}"
            f": it waits in the rendezvous for {need} (up to rdzv.conf.join_timeout), or its ranks are starting")


def settle_orphan(rec: RunRecord, node_dir: Path, root: Path, run_dir: Path) -> None:
    """A supervisor killed with -9 never wrote its last word, and its ranks went on without it (torchrun's SIGTERM:
    they checkpoint and exit). What they left says where the run is: their last heartbeats and step log, the
    newest valid checkpoint on disk, in the durable tier or this node's local one. Shown, not written: `resilient
    run` again records the same."""
    state.close_lost_attempt(rec, node_dir)
    beats = protocol.read_heartbeats(layout.RunLayout(node_dir).heartbeat_dir(rec.attempt))
    rec.take_last_beats(beats)
    last = rec.history[-1] if rec.history else None
    steps = [s for s in (rec.step, last.step_at_failure if last else None, *(hb.step for hb in beats.values()))
             if s is not None]
    rec.step = max(steps, default=None)
    newest = store.latest_valid(root)
    local = _settle_local_tier(rec, run_dir)
    for found in (newest, local):
        if found is not None and (rec.last_checkpoint_step is None or found.step > rec.last_checkpoint_step):
            rec.last_checkpoint_step = found.step
    _settle_books(rec, last)
    rec.message = rec.message or (f"the supervisor (pid {rec.supervisor.get('pid')}) is gone; `resilient run` "
                                  "again resumes from the newest valid checkpoint")


def _settle_books(rec: RunRecord, last: Any) -> None:
    """Goodput as the next `resilient run` will book it: the steps the ranks ran beyond the newest valid checkpoint
    charged as lost at once, as for any run that stops (audit 16: "lost 0 steps" at step 163 with checkpoint 100,
    63 after the rerun)."""
    from supervisor.goodput import Accounting

    ledger = (rec.accounting or {}).get("ledger")
    if not isinstance(ledger, dict):
        return
    with contextlib.suppress(Exception):  # a ledger this version cannot redo: the recorded books stand
        acc = Accounting.from_dict(ledger, last_seen=rec.updated_at)
        if last is not None and rec.step is not None:
            acc.ranks_went_on(last.attempt, rec.step)
        acc.settle(rec.last_checkpoint_step)
        summary = acc.summary(rec.updated_at)
        rec.accounting = {**rec.accounting, "summary": summary}
        rec.goodput = summary["goodput"]


def _settle_local_tier(rec: RunRecord, run_dir: Path) -> store.CheckpointInfo | None:
    """The newest valid step of the node's local tier, where the ranks of a killed supervisor commit their stop
    checkpoint; the tiers line is brought up to it (newest local step, lag, the steps not copied yet)."""
    lroot = own_local_tier(rec, run_dir)
    if lroot is None:
        return None
    try:
        valid = [i for i in store.scan(lroot) if i.valid] if lroot.is_dir() else []
    except OSError:  # one this user cannot read
        return None
    if not valid:
        return None
    fields = {k: v for k, v in rec.replication.items() if k in ReplicationState.__dataclass_fields__}
    rep = ReplicationState(**fields)
    if rep.newest_local is None or valid[-1].step > rep.newest_local:
        rep.newest_local, rep.newest_local_at = valid[-1].step, valid[-1].created_at
    durable = -1 if rep.newest_durable is None else rep.newest_durable
    there = {i.step for i in valid}  # a step the record lists that the tier no longer holds is not to be copied
    rep.pending = sorted(s for s in set(rep.pending) | there if s in there and s > durable)
    rec.replication = rep.to_dict()
    return valid[-1]


def own_local_tier(rec: RunRecord, run_dir: Path) -> Path | None:
    """The node's recorded local tier, where it can be read from here: only on the node's own machine (another
    machine's tier is not a folder of the same name here)."""
    recorded = (rec.replication or {}).get("local_root")
    if not isinstance(recorded, str) or not recorded or not on_this_host(rec.supervisor):
        return None
    return layout.resolved(recorded, run_dir, what=f"{run_dir}'s state file (replication.local_root)")


def on_this_host(supervisor: dict) -> bool:
    """Whether a record's supervisor ran on this machine: only there is its pid a process here, and its recorded
    local tier its own (a `local_dir` without {node} names a folder on every host; review 11)."""
    return supervisor.get("host") == socket.gethostname()


def _settle_durable_tier(rec: RunRecord, root: Path, run_dir: Path) -> None:
    """With no supervisor to say it, the tiers line's durable step is the newest valid one on disk, not the one last
    recorded (audit 7: after `gc --verify` removed a corrupt durable step 120, status still said `durable step 120 ·
    up to date`), and the steps not copied yet are those the local tier still holds above it, where that tier can
    be seen from here (audit 13: "durable step 160 · not copied yet [160, 172]")."""
    if not rec.replication or not root.is_dir():
        return
    newest = store.latest_valid(root)
    step = newest.step if newest is not None else None
    fields = {k: v for k, v in rec.replication.items() if k in ReplicationState.__dataclass_fields__}
    tiers = ReplicationState(**fields)
    pending = [s for s in tiers.pending if step is None or s > step]
    local = own_local_tier(rec, run_dir)  # another machine's tier: its record says
    with contextlib.suppress(OSError):  # one this user cannot read: the record says
        if pending and local is not None and local.is_dir():
            there = {i.step for i in store.scan(local) if i.valid}
            pending = [s for s in pending if s in there]
    if step == tiers.newest_durable and pending == tiers.pending:
        return
    tiers.pending = pending
    if step != tiers.newest_durable:
        tiers.newest_durable = step
        tiers.newest_durable_at = None if newest is None else \
            store.saved_time(newest.created_at, newest.manifest.extra if newest.manifest else {})
    rec.replication = tiers.to_dict()


def run_dir_of(target: str | None, overrides: list[str], *, must_exist: bool = True) -> str:
    """The run dir `resilient run TARGET` with these `--set`s (and `--run-dir`) uses: what a batch script that
    started the run asks about afterwards, without resolving the job file itself."""
    if target is None or not Path(target).is_file():
        raise UsageError(f"status {target or '.'}: --run-dir and --set apply to a job file as TARGET; pass the "
                         "job file `resilient run` was given, or the run dir alone.")
    from supervisor.config import load_job  # only here: status otherwise never validates YAML

    run_dir = load_job(target, overrides, to_launch=False).run_dir
    if must_exist and not layout.looks_like_run_dir(run_dir):
        raise UsageError(f"{target}: no run of this job in {run_dir} yet; start it with `resilient run {target}` "
                         "and the same options.")
    return str(run_dir)


def collect(target: str | None) -> StatusResult:
    t = targets.resolve(target, reads_only=True)
    files = targets.state_files(t)
    run_dir = t.run_dir
    assert run_dir is not None
    nodes = []
    for n in state.read_nodes(files):
        if n.record is None:
            damaged = n.error is not None and n.error.damaged
            why = ("it is damaged (a machine that crashed mid-write, or a hand edit); `resilient run` sets it aside "
                   "and starts the run's record afresh, its checkpoints read as always (`resilient inspect-checkpoint "
                   f"{run_dir}` lists them meanwhile)" if damaged else
                   n.error.fix if n.error is not None and n.error.fix else "was it written by a newer resilient?")
            raise (NotYetError if damaged else UsageError)(f"{n.error}; {why}")  # --wait-ranks waits out a damaged one
        if not n.alive and not n.record.state.final:
            settle_orphan(n.record, n.node_dir, t.checkpoint_root, run_dir)
        if not n.alive:
            _settle_durable_tier(n.record, t.checkpoint_root, run_dir)
        nodes.append(NodeStatus(n.record, n.node_dir, n.alive))
    for n, gone in zip(nodes, state.retired([(n.record, n.supervisor_alive) for n in nodes]), strict=True):
        n.retired = gone
    return StatusResult(run_dir, nodes, time.time(), t)


def wait_for_ranks(target: str | None, timeout_s: float, poll_s: float = 0.2) -> StatusResult:
    """Wait until every rank of the run's current attempt is listed, alive and training (the run dir may not
    exist yet: a run just started in another shell). Raises ResilientError (exit 1) if the run ends first
    or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    where = target or "."
    ended_since: float | None = None
    said = False
    while True:
        try:
            result = collect(target)
        except NotYetError as e:  # not created yet, or no state file yet (a bad job file is said at once)
            result = None
            if not said:  # once on stderr, as --watch and --follow say it (audit 14: it waited without a word)
                said = True
                render.err.print(f"{str(e).rstrip('.')}; waiting for it (up to {timeout_s:g}s; Ctrl-C to leave)",
                                 highlight=False, soft_wrap=True, markup=False)
        if result is not None and result.ranks_ready():
            return result
        now = time.monotonic()
        ended = result is not None and result.state.final
        ended_since = (ended_since or now) if ended else None
        # A finished run dir about to be resumed reads "succeeded" until its new supervisor starts: give it time.
        if ended_since is not None and (now - ended_since >= ENDED_GRACE_S or now > deadline):
            assert result is not None
            raise ResilientError(f"{where}: the run has ended ({result.state.value}) and no ranks are training; "
                                 "start one with `resilient run JOB.yaml --run-dir DIR` (a fresh DIR starts over).")
        if now > deadline:
            raise ResilientError(f"{where}: no run with all ranks training after {timeout_s:g}s; "
                                 f"`resilient status {where}` shows where it is.")
        time.sleep(poll_s)


def _plot_path(plot: str) -> Path:
    """--plot's file, checked before anything is read: a folder, or a file in a folder that is not there, is a
    usage error (the plot never creates folders)."""
    path = Path(plot).expanduser()
    if path.is_dir():
        raise UsageError(f"--plot {plot}: that is a folder; pass a file name, e.g. {path / 'timeline.png'}.")
    if not path.parent.is_dir():
        raise UsageError(f"--plot {plot}: the folder {path.parent} does not exist; create it or pick another.")
    return path


STALE_RECORD_S = 60.0  # a live supervisor writes its record every second while it watches, and between attempts


def _stale(sup: dict, age: float) -> str | None:
    """Why a live supervisor's record is old, if it is (audit 8: a stopped supervisor's record was shown as the
    present, ranks 23 s silent against a 10 s limit and still `running`)."""
    stopped = False
    if on_this_host(sup) and isinstance(sup.get("pid"), int):
        with contextlib.suppress(psutil.Error, ValueError):
            stopped = psutil.Process(sup["pid"]).status() == psutil.STATUS_STOPPED
    if stopped:
        return (f"alive but stopped (Ctrl-Z or SIGSTOP): nothing watches the ranks; what follows is {age:.0f}s old; "
                "`fg` or `kill -CONT` it")
    if age > STALE_RECORD_S:
        return f"alive, but what follows is {age:.0f}s old: it is busy (a long check of a checkpoint) or starved"
    return None


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _refuse_plot_over_the_run(plot: str, path: Path, t: targets.Target) -> None:
    """`status` reads; its plot must not write over what it reads (audit 6: `--plot` into a checkpoint folder made
    the newest checkpoint corrupt, and gc would then have deleted it; over state.json it destroyed the record). A
    file may be replaced only if it is a PNG already (an earlier plot); nothing goes inside a checkpoint root."""
    real = Path(os.path.realpath(path))
    for root in [t.checkpoint_root, *(r for _, r in targets.local_tiers(t))]:
        if layout.inside(real, Path(os.path.realpath(root))):
            raise UsageError(f"--plot {plot}: that is inside the run's checkpoint root {root}, where a file of its "
                             "own would make a checkpoint corrupt; write the plot elsewhere.")
    if path.exists():
        try:
            with open(path, "rb") as f:
                png = f.read(len(PNG_MAGIC)) == PNG_MAGIC
        except OSError:
            png = False
        if not png:
            raise UsageError(f"--plot {plot}: that file exists and is not a PNG, so status does not write over it; "
                             "pass a new file name.")


def main(target: str | None, as_json: bool, watch: bool, *, plot: str | None = None,
         interval_s: float = 1.0, wait_ranks_s: float | None = None) -> int:
    plot_path = _plot_path(plot) if plot is not None else None
    if wait_ranks_s is not None:
        result = wait_for_ranks(target, wait_ranks_s)
    else:
        result = targets.once_there(lambda: collect(target), interval_s) if watch else collect(target)
    if plot_path is not None:
        _refuse_plot_over_the_run(plot, plot_path, result.target)
        try:
            out = timeline.plot(result.primary.record, result.primary.node_dir, plot_path)
        except OSError as e:
            raise UsageError(f"--plot {plot}: cannot write it ({e.strerror or e}); pass a PNG path you can "
                             "write.") from None
        render.err.print(f"timeline written to {out}")
    if watch and (as_json or not render.out.is_terminal):
        return _watch_lines(target, result, as_json, interval_s)
    if as_json:
        render.print_json(result.to_json())
        return ExitCode.OK
    if not watch:
        render.out.print(result.renderable())
        return ExitCode.OK
    from rich.live import Live

    with Live(result.renderable(), console=render.out, refresh_per_second=4) as live:
        while not result.state.final:
            time.sleep(interval_s)
            result = collect(target)
            live.update(result.renderable())
    return ExitCode.OK


def _watch_lines(target: str | None, result: StatusResult, as_json: bool, interval_s: float) -> int:
    """--watch into a file or a pipe (rich's live view draws nothing there until the end), or with --json: one
    snapshot per interval until the run ends, a JSON document per line with --json."""
    try:
        while True:
            if as_json:
                text = json.dumps(result.to_json()) + "\n"
            else:
                with render.out.capture() as shown:
                    render.out.print(result.renderable())
                text = shown.get() + "\n"
            sys.stdout.write(text)
            sys.stdout.flush()
            if result.state.final:
                return ExitCode.OK
            time.sleep(interval_s)
            result = collect(target)
    except BrokenPipeError:  # `| head -1`: the reader has what it wanted; Python's own exit flush must not fail
        go_quiet(render.out)
        return ExitCode.OK

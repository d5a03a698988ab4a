"""`resilient run JOB.yaml`: validate, lock the run dir, reap leftovers of a dead supervisor, supervise."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from supervisor import lock, prewarm, slurm, state, targets
from supervisor.config import NAME_RE, RDZV_CONF_KEYS, JobConfig, load_job
from supervisor.console import EventConsole
from supervisor.errors import ConfigError, ResilientError, UsageError
from supervisor.fsutil import NO_ROOM, how_to_make_writable, node_local_locks, read_json, write_problem
from supervisor.layout import (
    HEARTBEATS_DIR,
    LOCK_FILE,
    LOGS_DIR,
    RUN_DIR_NAMES,
    STATE_FILE,
    STEPS_DIR,
    RunLayout,
    inside,
    looks_like_run_dir,
    node_dirs,
)
from supervisor.lock import OWNERS_DIR, RootClaim, RunLock
from supervisor.protocol import rank_process

OWN_PACKAGES = ("supervisor", "train_entry")


def check_cwd(cfg: JobConfig) -> None:
    """The current folder is where torchrun's `-m` processes (resilient's own helpers among them) import from first,
    and PYTHONPATH's folders (the job's env, else this shell's) come before the installed packages: a folder that is
    gone, or one holding a module named like one of resilient's packages, which every helper and rank would import
    in place of it (a run that failed as a `config` error on every attempt), is refused."""
    try:
        cwd = Path(os.getcwd())
    except OSError as e:
        raise ConfigError(f"the current folder cannot be read ({e.strerror}): it was deleted or moved; cd into an "
                          "existing folder and run again.") from None
    installed = Path(__file__).resolve().parents[2]  # where both packages are (site-packages, or the checkout)
    path = cfg.env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    folders = [(cwd, None)] + [(cwd / p, p) for p in path.split(os.pathsep) if p]
    for folder, entry in folders:
        for name in OWN_PACKAGES:
            ours = installed / name
            for shadow in (folder / name, folder / f"{name}.py"):
                try:  # a folder this user cannot enter (or a link loop) shadows nothing: Python skips it too
                    if not shadow.exists() or shadow.resolve() == ours:
                        continue
                except (OSError, RuntimeError):
                    continue
                if entry is None:
                    raise ConfigError(f"{shadow} shadows resilient's own `{name}` package: every process of the run "
                                      f"starts in {cwd} and would import it instead; run from another folder (the "
                                      "job file and --run-dir may stay where they are).")
                raise ConfigError(f"{shadow} shadows resilient's own `{name}` package: PYTHONPATH's {entry} (from "
                                  f"{'the job' if 'PYTHONPATH' in cfg.env else 'this shell'}) puts it first for "
                                  "every process of the run; take that folder out of PYTHONPATH or rename the "
                                  "module.")


def check_entrypoint(cfg: JobConfig) -> None:
    """An entry module that cannot be imported is a configuration error: exit 2, nothing launched."""
    module = cfg.entrypoint.module
    if not module:
        return
    sys.path.insert(0, os.getcwd())  # torchrun's `-m` workers see the current folder too
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path.pop(0)
    if not found:
        raise ConfigError(f"{cfg.located('entrypoint.module')}: entrypoint.module {module!r} cannot be imported by "
                          f"{sys.executable}; install it or fix the name.")


def local_tier(cfg: JobConfig, layout: RunLayout) -> Path | None:
    """This node's local tier, or the job file's line when this node's name brings it onto checkpoint.dir."""
    try:
        return cfg.checkpoint.local_root(layout.node_name)
    except ConfigError as e:
        raise ConfigError(f"{cfg.located('checkpoint.local_dir')}: {e.message}") from None


def check_writable(cfg: JobConfig, layout: RunLayout, local: Path | None) -> None:
    """A run dir or checkpoint root that cannot be written is a configuration error: one sentence, exit 2,
    before anything is created or launched (a read-only mount stops root too; chmod does not)."""
    for folder, what, fix in ((layout.run_dir, "the run dir", "pick another --run-dir"),
                              (layout.node_dir, "the run dir", "pick another --run-dir"),
                              (cfg.checkpoint.dir, "the checkpoint root", "set checkpoint.dir to a writable folder"),
                              (local, "the local checkpoint tier", "set checkpoint.local_dir to a writable folder")):
        problem = write_problem(folder) if folder is not None else None
        if problem is not None:
            todo = fix[0].upper() + fix[1:] if "not a folder" in problem else \
                f"{how_to_make_writable(problem)}, or {fix}"
            raise ConfigError(f"{folder}: {what} cannot be written ({problem}); nothing was launched. {todo}.")


def check_same_job(cfg: JobConfig, layout: RunLayout) -> None:
    """A run dir holds one job's run: another job's would resume from checkpoints of another model (each attempt
    failing to load them, the restart budget spent) and mix two histories. Exit 2 before anything runs."""
    try:
        recorded = read_json(layout.job_file)["job"]["name"]
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or damaged: the supervisor writes it afresh
        return
    if isinstance(recorded, str) and recorded != cfg.name:
        raise ConfigError(f"{layout.run_dir} holds the run of job {recorded!r} (its {layout.job_file.name}), not "
                          f"{cfg.name!r}; nothing was launched. Give this job a run dir of its own (--run-dir), or, "
                          f"if it is the same job renamed, run it with --set name={recorded}.")


# What every node of a run must run alike: ranks of nodes that differ in one wait for each other in different
# collectives (audit 18: another checkpoint interval on one node, a crash loop of hangs with no word of the cause).
# (Not rdzv.endpoint nor checkpoint.local_dir's path: one host may be spelled by name on one node, by address on
# another, and a node's local tier may be given per node; whether there is a local tier must agree.)
SAME_ON_EVERY_NODE = (("entrypoint", "module"), ("entrypoint", "script"), ("entrypoint", "args"), ("nnodes",),
                      ("rdzv", "id"), ("checkpoint", "dir"), ("checkpoint", "interval_steps"),
                      ("checkpoint", "async_save"), ("checkpoint", "local_dir"))


def check_same_job_as_live_nodes(cfg: JobConfig, layout: RunLayout) -> None:
    """A node started with another job file (or other --set's) than the nodes that run now: refused, naming the
    key. The run's job record is the one the last node to start wrote; it stands for the live nodes'."""
    if layout.node is None:
        return
    holders = {d.name: h for d in node_dirs(layout.run_dir) if d != layout.node_dir and (h := lock.holder(d))}
    live = sorted(holders)
    try:  # written by a live node only once it holds its lock: an older record is a past job's (review 17: nodes
        written = layout.job_file.stat().st_mtime  # started together with a changed job refused each other)
    except OSError:
        return
    # (a second's slack: a file's time comes from the kernel's coarser clock, which may lag time.time())
    if not live or all(written < float(h.get("since") or 0) - 1.0 for h in holders.values()):
        return
    differs = _differing_key(cfg, layout)
    if differs is not None:
        dotted, here, there = differs
        raise ConfigError(f"{dotted} is {here!r} here but {there!r} in the job of the running node(s) "
                          f"{', '.join(live)} ({layout.job_file}); nothing was launched. Start every node with "
                          "the same job file and the same --set options.")


def _differing_key(cfg: JobConfig, layout: RunLayout) -> tuple[str, Any, Any] | None:
    """The first key every node must share where this job differs from the run's recorded one (key, here, there);
    None when they agree or no job is recorded."""
    try:
        theirs = read_json(layout.job_file)["job"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    mine = cfg.to_dict(relative_to=cfg.run_dir)
    for key in SAME_ON_EVERY_NODE:
        here, there = mine, theirs
        for part in key:
            here = here.get(part) if isinstance(here, dict) else None
            there = there.get(part) if isinstance(there, dict) else None
        if key == ("entrypoint", "script") and here and there:  # each node's checkout may lie elsewhere
            here, there = Path(here).name, Path(there).name
        if key == ("checkpoint", "local_dir"):  # a tier or none, not its path
            here, there = here is not None, there is not None
        if here != there:
            return ".".join(key), here, there
    return None


# What a user keeps beside a run (the job file, notes), besides layout.RUN_DIR_NAMES: anything else means the folder
# is not a run dir (`/`, a home, a project).
JOB_SUFFIXES = (".yaml", ".yml", ".json", ".md", ".txt", ".log")


def check_run_dir_is_a_run_dir(cfg: JobConfig, layout: RunLayout, local: Path | None) -> None:
    """A folder that already holds other things than a run (`run_dir: /`, `.` in a project, a home) is refused
    before resilient writes its state, logs and checkpoints among them: one sentence, exit 2."""
    run_dir = layout.run_dir
    if looks_like_run_dir(run_dir):
        return
    try:
        names = os.listdir(run_dir)
    except OSError:  # none yet (made afresh), or check_writable names what is wrong with it
        return
    roots = {r.relative_to(run_dir).parts[0] for r in (cfg.checkpoint.dir, local)
             if r is not None and r != run_dir and inside(r, run_dir)}
    foreign = sorted(n for n in names if not (n in RUN_DIR_NAMES or n in roots or n.startswith(".")
                                               or n.endswith(JOB_SUFFIXES) or n.startswith(STATE_FILE)))
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(f"{run_dir}: the run dir already holds things that are not a run's ({shown}); nothing was "
                          "launched. A run dir is resilient's own folder: give the job a new or empty one (--run-dir, "
                          "or run_dir in the job file).")


def check_no_links_out(cfg: JobConfig, layout: RunLayout, local: Path | None) -> None:
    """The folders resilient writes a run's own files into are the run dir's, never another place a link leads
    (audit 6: a `logs` link took the new attempt's logs into another run's, a `.resilient-owners` link took the
    locks elsewhere). A linked checkpoint root is the user's choice of disk, and is named at the start."""
    node_dir = layout.node_dir
    own = [*((node_dir, node_dir.parent) if layout.node else ()), node_dir / LOGS_DIR, node_dir / HEARTBEATS_DIR,
           node_dir / STEPS_DIR, *(root / OWNERS_DIR for root in (cfg.checkpoint.dir, local) if root is not None),
           node_dir / LOCK_FILE, layout.run_dir / LOCK_FILE]  # written in place: a link's target was overwritten
    for path in own:
        if path.is_symlink():
            raise ConfigError(f"{path} is a link to {os.path.realpath(path)}: resilient writes a run's own files only "
                              "inside its run dir and checkpoint roots; remove the link (resilient makes its own "
                              "there), or give the run a run dir where you want them; nothing was launched.")


def node_name(cfg: JobConfig, node: str | None) -> str | None:
    """None for a single-node job (files directly in the run dir); else this node's name."""
    if node == "":  # audit 6: taken for "no name given"; an empty RESILIENT_NODE is unset, as shells have it
        raise UsageError("--node '': a node name is 1 to 100 letters, digits, '.', '_' or '-' (not only dots): it "
                         "names the node's folder in the run dir; pass such a name, or leave --node out.")
    name = node or os.environ.get("RESILIENT_NODE")
    if name is None and cfg.nnodes == "1":
        return None
    name = name or socket.gethostname()
    if not NAME_RE.fullmatch(name) or name.startswith("-"):  # audit 18: `--node -x`, a folder shells trip over
        given = f"--node {name}" if node else f"RESILIENT_NODE={name}" if os.environ.get("RESILIENT_NODE") else \
            f"the host name {name!r}"
        raise UsageError(f"{given}: a node name is 1 to 100 letters, digits, '.', '_' or '-' (not only dots, not "
                         "starting with '-'): it names the node's folder in the run dir; pass --node with such a name.")
    return name




def reap_orphans(layout: RunLayout, cfg: JobConfig, console: EventConsole) -> None:
    """Ranks left running by a supervisor that died (its lock is ours now): stop them before relaunching."""
    try:
        prev = state.read(layout.state_file)
    except state.StateFileError:
        return
    markers = [m for m in (cfg.entrypoint.module, str(cfg.entrypoint.script or ""), "supervisor.torchrun",
                           "torch.distributed.run") if m]
    procs = []
    for r in prev.ranks:
        with contextlib.suppress(psutil.Error):
            p = rank_process(r.get("pid"), r.get("started_at"))  # not a pid another process took since
            # A relaunched attempt's ranks are forks of the prewarm server: their command line is the server's.
            if p is not None and (prewarm.forked_by_server(p) or any(m in " ".join(p.cmdline()) for m in markers)):
                procs.append(p)
    if not procs:
        return
    console.event(f"stopping {len(procs)} rank(s) left by a previous supervisor: {[p.pid for p in procs]}",
                  style="yellow")
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
            p.resume()  # a stopped rank (SIGSTOP, a debugger) acts on the SIGTERM only once continued
    _, alive = psutil.wait_procs(procs, timeout=cfg.stop_timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop `resilient run` gracefully (the ranks checkpoint; exit 143, or 130 for SIGINT).
    SIGUSR1 is Slurm's usual "about to be preempted" warning; SIGHUP a closed terminal (a dropped ssh session,
    which otherwise killed the supervisor outright, its record left saying running, its ranks dying with it) —
    unless SIGHUP is ignored: `nohup resilient run …` asks to outlive the terminal, and does."""
    hangup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, *hangup)


def on_suspend(console: EventConsole) -> Callable[[int, Any], None]:
    """Ctrl-Z (SIGTSTP) suspends the supervisor alone: the ranks run in their own session and train on. Say so
    before stopping. Only the foreground job of a terminal is suspended: elsewhere (nohup &, setsid, systemd)
    no shell could continue it, and the kernel itself would have dropped the SIGTSTP."""

    def handler(_signum: int, _frame: Any) -> None:
        if not foreground():
            console.event("SIGTSTP ignored: no terminal's job control could continue resilient; it goes on "
                          "watching the ranks", style="yellow")
            return
        console.event("Ctrl-Z: resilient is suspended; the ranks train on unwatched (no hang detection, no "
                      "retention) until `fg`, after which Ctrl-C stops the run with a checkpoint", style="yellow")
        os.kill(os.getpid(), signal.SIGSTOP)  # SIGTSTP's own stop, which this handler took over
        console.event("continued: watching the ranks again")

    return handler


def foreground() -> bool:
    """This process is in the foreground job of its controlling terminal (whatever its streams are redirected
    to): a shell's `fg` can continue it."""
    try:
        tty = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal
        return False
    try:
        return os.tcgetpgrp(tty) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(tty)


def make_launcher():  # tests replace this to capture the argv without starting torchrun
    from supervisor.launch import TorchrunLauncher

    return TorchrunLauncher()


def main(job: str, overrides: list[str], node: str | None) -> int:
    try:
        return _run(job, overrides, node)
    except OSError as e:  # the system's refusal before any launch (a full disk at the lock, a folder shut to us)
        what, fix = _refusal(e)
        raise ConfigError(f"{what}; nothing was launched. {fix} and run again.") from e


def _refusal(e: OSError) -> tuple[str, str]:
    """A system error in words: what was refused, and the fix."""
    where = f"{e.filename}: " if e.filename is not None else ""
    if e.errno in NO_ROOM:
        fix = "Free space there (or make it writable)"
    elif isinstance(e, PermissionError):
        fix = "Give this user access to it"
    else:
        fix = "Check that filesystem"
    return f"{where}{e.strerror or e.__class__.__name__}", fix


def _run(job: str, overrides: list[str], node: str | None) -> int:
    from supervisor.supervise import Supervisor

    cfg = load_job(job, overrides)
    check_cwd(cfg)
    check_entrypoint(cfg)
    layout = RunLayout(cfg.run_dir, node_name(cfg, node))
    local = local_tier(cfg, layout)
    check_writable(cfg, layout, local)
    check_run_dir_is_a_run_dir(cfg, layout, local)
    check_no_links_out(cfg, layout, local)
    check_same_job(cfg, layout)
    check_same_job_as_live_nodes(cfg, layout)
    claims = [RootClaim(cfg.checkpoint.dir, cfg.run_dir, job=cfg.name)]
    if local is not None:  # a node's own: two nodes on one host (or a shared folder) must not take one local_dir
        claims.insert(0, RootClaim(local, cfg.run_dir, "checkpoint.local_dir", node=layout.node_name, job=cfg.name,
                                   durable=cfg.checkpoint.dir))
    for claim in claims:  # another live run's root: refused before a new run dir is made for nothing
        claim.refuse_if_taken()
    for claim in claims:  # a root the filesystem refuses (a FUSE mount): before the run dir's lock is made
        claim.prepare()
    # A single-node job given a node name (--node, RESILIENT_NODE) holds the run dir too: another one there, named
    # or not, would be a second job writing the same checkpoints, not a second node of this one.
    whole_run = RunLock(layout.run_dir) if cfg.nnodes == "1" and layout.node_dir != layout.run_dir else None
    with whole_run or contextlib.nullcontext(), RunLock(layout.node_dir), contextlib.ExitStack() as held:
        for claim in claims:
            held.enter_context(claim)
        # Several nodes' supervisors often write into one file (a Slurm job's .out): each line names its node.
        console = EventConsole(cfg.name if layout.node is None else f"{cfg.name}@{layout.node}")
        if cfg.nnodes == "1" and cfg.rdzv.endpoint is None and cfg.rdzv.backend != "c10d":
            console.event(f"rdzv.backend {cfg.rdzv.backend} is not used: one node without rdzv.endpoint runs "
                          "torchrun --standalone", style="yellow")
        # Retention deletes there: a root outside the run dir, or a link, is named as every light command names it.
        if (note := targets.Target(job, cfg.run_dir, cfg.checkpoint.dir).root_note()) is not None:
            console.event(note)
        if cfg.nnodes != "1" and (why := node_local_locks(cfg.checkpoint.dir)) is not None:
            console.event(f"{cfg.checkpoint.dir} is on a {why} mount, where flock() holds on this node only: the locks "
                          "resilient takes between nodes there (a save's writer, the durable tier's copies, the "
                          "run's claim) exclude nothing across hosts; mount it with coherent locks (Lustre: flock; "
                          "NFS: without nolock or local_lock)", style="yellow")
        for claim in claims:  # audit 15: another job's checkpoints, their owner record lost, were taken in silence
            if claim.adopted:
                console.event(f"{claim.root} holds checkpoints with no record of the job that wrote them (made "
                              f"before resilient kept one, or copied without its {OWNERS_DIR}): taken as job "
                              f"{cfg.name}'s, and resumed from; if they are another job's, stop this run and give "
                              f"it its own {claim.key}", style="yellow")
        if cfg.rdzv.conf and cfg.rdzv.endpoint is None:
            console.event("rdzv.conf is not used: one node without rdzv.endpoint runs torchrun --standalone",
                          style="yellow")
        for key in sorted(set(cfg.rdzv.conf) - RDZV_CONF_KEYS) if cfg.rdzv.endpoint is not None else ():
            console.event(f"rdzv.conf.{key} is not a key torch's rendezvous reads ({', '.join(sorted(RDZV_CONF_KEYS))}"
                          "): passed to torchrun as given, where it does nothing unless your torch reads it",
                          style="yellow")
        too_long = slurm.stop_outlasts_kill_wait(cfg.stop_timeout_s, slurm.kill_wait_s())
        if too_long:
            console.event(too_long, style="yellow")
        reap_orphans(layout, cfg, console)
        sup = Supervisor(cfg, layout, console=console, launcher=make_launcher(),
                         keep_claims=lambda: [claim.reassert() for claim in claims],
                         adopted_root=any(claim.adopted for claim in claims))
        stopping = stop_signals()
        previous = {sig: signal.signal(sig, lambda signum, _frame: sup.request_stop(signum)) for sig in stopping}
        if signal.getsignal(signal.SIGTSTP) is not signal.SIG_IGN:
            previous[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, on_suspend(console))
        started = time.monotonic()
        try:
            with console.library_warnings():
                code = sup.run()
        except OSError as e:  # past the supervisor's own handling (its ranks are stopped by then)
            what, fix = _refusal(e)
            raise ResilientError(f"{what}; the supervisor stopped. {fix}; `resilient run` again resumes.") from e
        finally:  # called in-process (tests, a user's own Python), the caller's handlers come back
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        console.event(f"supervisor exiting with code {int(code)} after {time.monotonic() - started:.1f}s")
        return code

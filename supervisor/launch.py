"""Launching torchrun for one attempt, and stopping it so that no process outlives the attempt.

torchrun runs in its own session (one process group for it and its workers) with a parent-death signal,
so a supervisor killed with -9 still takes its job down: torchrun gets SIGTERM, forwards it, and the ranks
checkpoint and exit. Stopping is SIGTERM to the group → a deadline → SIGKILL to the group and to every
descendant ever seen (psutil), then a check that none is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

from supervisor import prewarm, ranklogs
from supervisor.api import AttemptSpec
from supervisor.config import JobConfig
from supervisor.prewarm import TORCHRUN as TORCHRUN_MODULE
from supervisor.protocol import Handover
from supervisor.zygote import Zygote
from supervisor.zygote import enabled as zygote_enabled

log = logging.getLogger("resilient")

# The first launch waits this long at most for the prewarm server's imports (about 2.5 s here) before starting
# torchrun and its workers cold: a ready server makes both forks, which skip those imports.
FIRST_LAUNCH_WAIT_S = 30.0


def torchrun_argv(cfg: JobConfig, spec: AttemptSpec, *, python: str | None = None,
                  max_restarts: int = 0, prewarmed: bool = False) -> list[str]:
    """The exact torchrun command line for one attempt.

    Args:
        cfg: the job.
        spec: the attempt (its log folder).
        python: the interpreter that runs torchrun and the workers (default: this one).
        max_restarts: torchrun's own restarts. 0 where the supervisor owns restarts; elastic jobs pass more,
            because only torchrun can re-form the group in place when a node leaves or joins.
        prewarmed: start each worker through the prewarm client (`supervisor.prewarm`).
    """
    argv = [python or sys.executable, "-m", TORCHRUN_MODULE,
            "--nnodes", cfg.nnodes, "--nproc-per-node", cfg.nproc_per_node]
    if cfg.rdzv.endpoint is None:
        argv += ["--standalone"]  # one node, a free port chosen by torchrun's own store
    else:
        argv += ["--rdzv-backend", cfg.rdzv.backend, "--rdzv-endpoint", cfg.rdzv.endpoint,
                 "--rdzv-id", spec.rdzv_id or cfg.rdzv.id]
        if cfg.rdzv.conf:
            argv += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in cfg.rdzv.conf.items())]
        if cfg.rdzv.local_addr:
            argv += ["--local-addr", cfg.rdzv.local_addr]
    argv += ["--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
             "--shutdown-timeout", str(int(cfg.stop_timeout_s)),
             "--log-dir", str(spec.logs_dir / ranklogs.RANKS_DIR), "--redirects", "3"]
    entry = ["-m", cfg.entrypoint.module] if cfg.entrypoint.module else [str(cfg.entrypoint.script)]
    entry += list(cfg.entrypoint.args)
    if prewarmed:
        entry = prewarm.client_argv(entry)
    # `--` ends torchrun's options: argparse classifies every token, the entry point's own included, and refuses
    # one that abbreviates two of torchrun's options (`--local`, `--node`, `--rdzv`…) before it looks at the script.
    return argv + (["-m", "--", *entry[1:]] if entry[0] == "-m" else ["--", *entry])


def worker_env(cfg: JobConfig, handover: Handover, base: dict[str, str] | None = None) -> dict[str, str]:
    """torchrun's environment: ours, the job's `env`, and the handover (which wins)."""
    env = dict(os.environ if base is None else base)
    env.update(cfg.env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Stale keys in a shared rendezvous store made torchrun's in-place restarts hang (pytorch#135712).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.update(handover.to_env())
    return env


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6").prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    # SIGUSR1 asks ranks for stack dumps (and Slurm sends it to every process of a job step without B:);
    # torchrun's default action would be to die of it. Ranks install their own handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class TorchrunProcess:
    """One running torchrun and everything under it."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path | None = None,
                 zygote: Zygote | None = None, forked: prewarm.ForkedProcess | None = None):
        self.argv = argv
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = None
        self.popen: subprocess.Popen | prewarm.ForkedProcess
        if forked is not None:  # the prewarm server forked this attempt's torchrun (see prewarm.py)
            self.popen = forked
        elif zygote is not None:  # a torchrun that already imported torch becomes this attempt's
            self.popen = zygote.launch(argv[3:], env, cwd, log_path)
        else:
            self._log = open(log_path, "ab")  # noqa: SIM115 (closed in close())
            self.popen = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=self._log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=_die_with_parent)
        self.pid = self.popen.pid
        self.started = time.monotonic()
        self._known: dict[int, psutil.Process] = {}
        self.track()

    # ---- watching -----------------------------------------------------------------------------------

    def track(self, extra_pids: Iterable[int] = ()) -> None:
        """Remember every descendant (and the ranks' pids from their heartbeats): after torchrun dies its
        workers are reparented, and we must still be able to find and end them."""
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.pid)
            for p in [root, *root.children(recursive=True)]:
                self._known.setdefault(p.pid, p)
        for pid in extra_pids:
            if pid not in self._known:
                with contextlib.suppress(psutil.Error):
                    p = psutil.Process(pid)
                    if p.create_time() >= root_create_time(self) - 1:
                        self._known[pid] = p

    def wait(self, timeout: float) -> int | None:
        """torchrun's exit code, or None if it is still running after `timeout` seconds."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def workers(self) -> list[int]:
        """torchrun's live children (its workers, or their prewarm clients): none while it is in the rendezvous."""
        try:
            children = psutil.Process(self.pid).children()
        except psutil.Error:
            return []
        alive = []
        for p in children:
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
        return alive

    def poll(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> list[psutil.Process]:
        """Known processes still running (zombies excluded)."""
        out = []
        for p in self._known.values():
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    # ---- stopping -----------------------------------------------------------------------------------

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
        for p in self.alive():  # anything that left the group (a prewarmed rank: through its proxy, but SIGKILL)
            # A process may end between alive() and here: os.getpgid then raises ProcessLookupError, which is not a
            # psutil.Error (CI once ended a stop that way, with a traceback, exit 1 and the ranks left unkilled).
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(p.pid) != self.pid and (sig == signal.SIGKILL or not prewarm.forked_by_server(p)):
                    p.send_signal(sig)

    def signal_ranks(self, sig: int) -> None:
        """Signal torchrun's workers but not torchrun: a torchrun signalled twice (by Slurm, then by us)
        aborts its own orderly shutdown. Before any worker exists, torchrun itself is signalled.

        Each rank once: a prewarmed rank is reached through its proxy, which forwards (and without which it ends
        itself), not also straight from its heartbeat's pid. Training scripts often take a second SIGTERM as
        "quit now, no checkpoint"; ours hung on it once."""
        self.track()
        workers = [p for p in self.alive() if p.pid != self.pid and not prewarm.forked_by_server(p)]
        if not workers:
            self.signal_group(sig)
        for p in workers:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)

    def stop(self, grace_s: float) -> list[int]:
        """SIGTERM everything, wait up to `grace_s` for torchrun to exit (the ranks checkpoint meanwhile),
        then SIGKILL whatever is left. Returns the pids that survived even SIGKILL (should be none)."""
        self.track()
        if self.poll() is None or self.alive():
            self.signal_group(signal.SIGTERM)
            self.signal_group(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and (self.poll() is None or self.alive()):
                self.wait(0.1)
                self.track()
        survivors = self.alive()
        if survivors:
            self.signal_group(signal.SIGKILL)
            for p in survivors:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            _, survivors = psutil.wait_procs(survivors, timeout=10)
        self.wait(5)
        return [p.pid for p in survivors]

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
        if isinstance(self.popen, prewarm.ForkedProcess):
            self.popen.close()


class TorchrunLauncher:
    """Launches each attempt's torchrun as a fork of the prewarm server, and its workers too: the server is
    started with the first launch (it needs the workers' environment) and that launch waits for its imports,
    which is what the workers would have spent themselves. With prewarming off (or the server unavailable)
    torchrun comes from a zygote started with the supervisor, or is started cold."""

    def __init__(self) -> None:
        self._zygote: Zygote | None = None
        self._prewarm: prewarm.PrewarmServer | None = None
        self._worker_env: dict[str, str] | None = None
        self._launched = False
        self.spare()

    def spare(self) -> None:
        """Get the next launch ready: the prewarm server if it is not running, and a zygote only when there is
        no server. A zygote importing beside the server took CPU from both it and the training ranks: on 2
        cores the server was still importing 4 s after the first step, and a failure then relaunched cold
        (median 4.4 s to the next step); without the zygote the server was ready and it took 1.2-2.3 s."""
        if prewarm.enabled() and self._worker_env is not None and (self._prewarm is None or
                                                                  not self._prewarm.alive()):
            if self._prewarm is not None:
                self._prewarm.close()
                self._prewarm = None
            # No process to spare, or no interpreter to run: torchrun is started cold, which says why if it
            # cannot start either.
            with contextlib.suppress(OSError):
                self._prewarm = prewarm.PrewarmServer(self._worker_env, preexec_fn=_die_with_parent)
        server_up = self._prewarm is not None and self._prewarm.alive()
        if server_up and self._zygote is not None:
            self._zygote.discard()
            self._zygote = None
        elif zygote_enabled() and self._zygote is None and not server_up and not prewarm.enabled():
            with contextlib.suppress(OSError):  # as the server's: a cold start says why
                self._zygote = Zygote(preexec_fn=_die_with_parent)

    def prepare(self, cfg: JobConfig) -> None:
        """Start the prewarm server now, under the environment the workers will get, so its imports overlap
        whatever the supervisor does before the first launch (checking checkpoints, reaping leftovers)."""
        if self._worker_env is None:
            handover_keys = Handover().to_env()
            self._worker_env = {k: v for k, v in worker_env(cfg, Handover()).items() if k not in handover_keys}
            self.spare()

    def __call__(self, cfg: JobConfig, spec: AttemptSpec, handover: Handover) -> TorchrunProcess:
        env = worker_env(cfg, handover)
        first = not self._launched
        self._launched = True
        self.prepare(cfg)
        log_path = spec.logs_dir / "torchrun.log"
        ready = self._prewarm is not None and self._prewarm.ready(FIRST_LAUNCH_WAIT_S if first else 0.0)
        server = self._prewarm if ready else None
        argv = torchrun_argv(cfg, spec, prewarmed=server is not None)
        if server is not None:
            env[prewarm.ENV_SOCKET] = server.socket
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(os.devnull, "rb") as stdin, open(log_path, "ab") as log_file:
                forked = server.launch(argv[1:], env, os.getcwd(), [stdin.fileno(), log_file.fileno(),
                                                                     log_file.fileno()])
            if forked is not None:
                return TorchrunProcess(argv, env, log_path, forked=forked)
        z, self._zygote = self._zygote, None
        if z is not None and not z.alive():
            z = None
        return TorchrunProcess(argv, env, log_path, zygote=z)

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.discard()
            self._zygote = None
        if self._prewarm is not None:
            self._prewarm.close()
            self._prewarm = None


def root_create_time(proc: TorchrunProcess) -> float:
    try:
        return psutil.Process(proc.pid).create_time()
    except psutil.Error:
        return time.time() - (time.monotonic() - proc.started)

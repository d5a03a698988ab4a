"""Real processes in tests: launch in a new session, wait on conditions with deadlines, and always clean up.

Every process a test starts is in its own process group (start_new_session), so one killpg reaches torchrun
and all its workers; anything that escaped the group is found through psutil and killed too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    for k in [k for k in env if k.startswith("RESILIENT_")]:
        del env[k]
    env.update(extra)
    return env


class Proc:
    """A process (and its group) started by a test."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None, log: Path | None = None):
        self.argv = argv
        self.log_path = log or cwd / f"proc-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.popen = subprocess.Popen(argv, cwd=cwd, env=env or child_env(), stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.popen.pid
        self._seen: dict[int, psutil.Process] = {}
        self._remember()

    def _remember(self) -> None:
        try:
            me = psutil.Process(self.pid)
            for p in [me, *me.children(recursive=True)]:
                self._seen.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        finally:
            self._remember()

    def poll(self) -> int | None:
        self._remember()
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        self._remember()
        self.popen.send_signal(sig)

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive_descendants(self) -> list[psutil.Process]:
        self._remember()
        alive = []
        for p in self._seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                pass
        return alive

    def kill_all(self) -> None:
        """SIGKILL the group and every process ever seen under it (they may have left the group)."""
        self._remember()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for p in self._seen.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        psutil.wait_procs(list(self._seen.values()), timeout=10)
        if not self._log.closed:
            self._log.close()


@contextlib.contextmanager
def started(argv: list[str], cwd: Path, env: dict[str, str] | None = None, log: Path | None = None) -> Iterator[Proc]:
    proc = Proc(argv, cwd, env, log)
    try:
        yield proc
    finally:
        proc.kill_all()


def torchrun(nproc: int, entry_args: list[str], *, module: str = "train_entry", port: int | None = None,
             device: str = "cpu") -> list[str]:
    """A single-node torchrun command line on a free loopback port. The device is always explicit, so a test
    means the same on a CPU box and on a GPU box (`--device auto` would pick NCCL on one)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port or free_port()}",
            "--max-restarts", "0", "-m", module, "--device", device, *entry_args]


def heartbeat(folder: Path, rank: int) -> dict[str, Any] | None:
    try:
        return json.loads((folder / f"rank_{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def step_of(folder: Path, rank: int) -> int:
    hb = heartbeat(folder, rank)
    return hb["step"] if hb else -1


def readonly(path: Path, argv: list[str]) -> list[str]:
    """`argv` run with `path` bind-mounted read-only onto itself, in a mount namespace of its own. Root ignores
    chmod, a read-only mount stops it too; the mount lives and dies with the command (nothing to unmount,
    even when a test fails) and no other process sees it."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(path), *map(str, argv)]

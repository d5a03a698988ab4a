"""Rendezvous generations: a fresh c10d run id each time the nodes form the group from scratch.

torchrun closes its rendezvous when it exits, and a closed rendezvous stays closed for as long as its store
lives. The supervisors own failure restarts (every torchrun exits, every node relaunches), so with a store
that outlives torchrun (a separately started one: `rdzv.conf.is_host: false`, or etcd) a relaunch under the
same run id would be refused. Each formation of the group therefore gets its own run id, `<rdzv.id>-g<k>`,
agreed through the shared run dir: a supervisor whose torchrun used generation k moves to k+1 (created with
O_EXCL, so the nodes that relaunch together meet in the same one); a node joining late takes the newest.

A torchrun that has started no workers long after launch is still in its rendezvous; `stalled` says what this
host shows of the endpoint's port (who holds it), so a foreign program on the port is named instead of being
taken for a hang.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path

import psutil

from supervisor import prewarm
from supervisor.layout import RDZV_DIR

GEN_RE = re.compile(r"^gen_(\d+)\Z")


class Generations:
    def __init__(self, run_dir: Path):
        self.folder = run_dir / RDZV_DIR

    def _existing(self) -> list[int]:
        try:
            return [int(m.group(1)) for n in os.listdir(self.folder) if (m := GEN_RE.match(n))]
        except FileNotFoundError:
            return []

    def _claim(self, k: int) -> int:
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.folder / f"gen_{k}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            pass  # another node got there first: the same generation, which is the point
        return k

    def current(self) -> int:
        """The newest generation (a node starting or rejoining meets the others there)."""
        existing = self._existing()
        return max(existing) if existing else self._claim(0)

    def after(self, used: int) -> int:
        """The generation to relaunch in after using `used`, which torchrun has closed on exiting."""
        return self._claim(max(used + 1, self.current()))


def run_id(base: str, generation: int) -> str:
    return f"{base}-g{generation}"


def stalled(endpoint: str | None, launcher_pids: set[int]) -> str:
    """Why a torchrun that started no workers may still be in its rendezvous, from what this host shows of
    the endpoint's port: held by the launcher itself (it hosts the store and waits for the other nodes), by
    another process (named: a program that is not a rendezvous store makes torchrun wait forever), or by
    nobody here."""
    if endpoint is None:
        return "see torchrun's log"
    host, _, port_text = endpoint.rpartition(":")
    port = int(port_text)
    if not _is_this_host(host):
        return f"the rendezvous at {endpoint}, on another host, has not formed (are the other nodes started?)"
    holders = _listeners(port)
    if holders & launcher_pids:
        return (f"this node hosts the rendezvous store at {endpoint} and the other nodes have not joined (start "
                "them with this endpoint)")
    if not holders:
        return (f"nothing on this host listens on port {port} of the rendezvous endpoint {endpoint} now (a node "
                "here that hosts the store may be relaunching it)")
    ours = [pid for pid in sorted(holders) if pid > 0 and _is_torchrun(pid)]
    if ours:
        return (f"a torchrun (pid {ours[0]}) hosts the rendezvous store at {endpoint} and the group has not formed: "
                "another node's of this job (are all the nodes started?), or another job's on the same port")
    named = ", ".join(_describe(pid) for pid in sorted(holders) if pid > 0) or "a process of another user"
    return (f"port {port} of the rendezvous endpoint {endpoint} is held by {named}; if that is not another "
            "node's torchrun or a rendezvous store, free the port or choose another rdzv.endpoint")


def _is_this_host(host: str) -> bool:
    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):  # UnicodeError: a name IDNA cannot encode
        return False
    mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a.split("%")[0] in mine for a in wanted)


def _listeners(port: int) -> set[int]:
    """Pids listening on `port` on any address (0: a socket whose owner this user cannot see)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return set()
    return {c.pid or 0 for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}


def _is_torchrun(pid: int) -> bool:
    """torchrun, started as itself or by resilient (a zygote's, or a fork of the prewarm server, which keeps the
    server's command line)."""
    try:
        p = psutil.Process(pid)
        command = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return prewarm.forked_by_server(p) or any(m in command for m in ("torch.distributed.run", "supervisor.torchrun",
                                                                       "supervisor.zygote", "bin/torchrun"))


def _describe(pid: int) -> str:
    try:
        words = psutil.Process(pid).cmdline()
    except psutil.Error:
        return f"pid {pid}"
    command = " ".join(words)
    return f"pid {pid} ({command[:117] + '...' if len(command) > 120 else command})"

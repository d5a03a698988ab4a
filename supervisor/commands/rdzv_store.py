"""`resilient rdzv-store`: a c10d rendezvous store that is not one of the training nodes.

Run it on a machine that outlives the nodes (a login node, the Slurm batch host) and give the job
`rdzv: {endpoint: THAT_HOST:PORT, conf: {is_host: false}}`: every torchrun is then a client, so losing any
training node loses no store. The supervisors give each formation of the group its own run id
(supervisor/rdzv.py), since torchrun leaves a rendezvous closed when it exits.
"""

from __future__ import annotations

import datetime as dt
import signal
import socket
import time

from supervisor import render
from supervisor.errors import ExitCode, UsageError


def _local(host: str) -> bool:
    """`host` resolves (UsageError if not) to an address of this machine."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:  # UnicodeError: a name IDNA cannot encode (an empty label, a long one)
        why = getattr(e, "strerror", None) or e
        raise UsageError(f"--host {host!r} does not resolve ({why}); give this machine's name or "
                         "address.") from None
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((addr[0], 0, *addr[2:]))  # an IPv6 address keeps its flow info and scope (fe80::…%eth0)
                return True
        except OSError:  # not ours, or a family this kernel lacks (IPv6 turned off)
            continue
    return False


def main(host: str, port: int) -> int:
    # The store listens on every interface; its own client connects through --host, which must lead back here.
    local = _local(host)
    if not local:
        render.err.print(f"--host {host} is not an address of this machine: the store's own client connects "
                         "through it, which works only where it leads back here (a Service, a NAT)", markup=False)
    from torch.distributed import TCPStore  # only this command and `run` need torch

    try:
        store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))
    except (RuntimeError, OSError) as e:
        if not local:
            raise UsageError(f"cannot start the store: {host}:{port} did not lead back to this machine ({e}); run "
                             "rdzv-store on the machine --host names, or give this machine's name or address.") \
                from None
        raise UsageError(f"cannot listen on {host}:{port} ({e}); pick another --port.") from None
    got: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:  # takes no lock: see Supervisor.request_stop
        got.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    render.err.print(f"rendezvous store listening on {host}:{store.port} (Ctrl-C to stop)")
    while not got:
        time.sleep(0.1)
    del store
    return ExitCode.SIGINT if got[0] == signal.SIGINT else ExitCode.SIGTERM  # as the exit code table says

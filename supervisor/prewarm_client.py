"""What torchrun starts as each worker when workers are prewarmed: a stand-in that asks the prewarm server
(`supervisor.prewarm`) for a fork that has already imported torch, then lives as that worker's proxy.

    python -m supervisor.prewarm_client -m train_entry ARGS...     (or: SCRIPT.py ARGS...)

torchrun sees this process: it forwards torchrun's signals to the worker and leaves with the worker's exit
status (dying of the same signal if the worker died of one), so torchrun's failure reports stay true. If it
dies itself, the worker notices its socket close and ends too. With no server (not started yet, gone, or
refusing), it simply becomes the entry point with `exec`, as if torchrun had started it directly.

Standard library only: this runs once per worker before anything is imported.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from typing import NoReturn

ENV_SOCKET = "RESILIENT_PREWARM_SOCKET"
# True in a worker the prewarm server forked: its parent is that server, not torchrun, so it must not ask to die
# with its parent (train_entry.dist.die_with_parent reads this): its proxy, torchrun's child, does that for it.
IN_FORK = False
STATUS_WAIT_S = 5.0  # after the worker's own exit line, how long the server's status may take (supervisor.prewarm's)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCONT, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: list[str]) -> NoReturn:
    parent = os.getppid()  # torchrun
    path = os.environ.pop(ENV_SOCKET, None)
    if path:
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect("\0" + path[1:] if path.startswith("@") else path)  # see prewarm.address
        except OSError as e:  # the server is gone: say so, and start the way torchrun would have
            print(f"resilient: prewarmed start unavailable ({e.strerror or e}); starting normally", file=sys.stderr)
        else:
            _proxy(conn, argv, parent)
    _exec(argv)


def _exec(argv: list[str]) -> NoReturn:
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *argv])


def request(conn: socket.socket, argv: list[str], env: dict[str, str], cwd: str, stdio: list[int],
            role: str = "worker") -> dict:
    """Ask the server for a fork that runs `argv` (`-m MODULE ARGS` or `SCRIPT ARGS`) with this environment,
    folder and stdin/stdout/stderr. Returns its first answer: {"pid": N}, {"refused": why}, {"unanswered": True}
    if `conn` has a timeout and it ran out, or {} if the server failed. When the fork ends it says {"exit": code}
    itself (unless killed), and the server's {"status": waitstatus} follows: the last line on `conn`."""
    req = json.dumps({"argv": argv, "env": env, "cwd": cwd, "role": role}).encode() + b"\n"
    try:
        socket.send_fds(conn, [req[:1]], stdio)
        conn.sendall(req[1:])
        return json.loads(read_line(conn) or b"{}")
    except TimeoutError:
        return {"unanswered": True}
    except (OSError, ValueError):
        return {}


def read_line(conn: socket.socket) -> bytes:
    """One line from the server, read a byte at a time so nothing after it is left in a buffer (the
    supervisor waits for the next line with select)."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            break
        line += byte
    return bytes(line)


def _proxy(conn: socket.socket, argv: list[str], parent: int) -> None:
    """Hand our argv, environment and stdio to the server; returns only if no worker was forked."""
    first = request(conn, argv, dict(os.environ), os.getcwd(), [0, 1, 2])
    if "pid" not in first:  # refused, or the server died before forking: nobody runs this rank yet
        if first.get("refused"):
            print(f"resilient: prewarmed start refused ({first['refused']}); starting normally", file=sys.stderr)
        conn.close()
        return
    pid = int(first["pid"])
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
    die_with_parent(signal.SIGTERM, parent)  # torchrun gone: the worker is asked to stop, as a cold rank is
    said: int | None = None  # the worker's own exit code, said as it left: all there is if the server is gone
    while True:
        try:
            last = json.loads(read_line(conn) or b"{}")
        except TimeoutError:  # after the worker's own line: a stopped server, or a worker still tearing down
            if _running(pid):  # (a large GPU process frees its memory for seconds): only its end is waited for
                continue
            last = {"error": "no status from the server"}
        except (OSError, ValueError) as e:
            last = {"error": str(e)}
        if not isinstance(last, dict):
            last = {"error": "an answer that is not an object"}
        if not isinstance(last.get("exit"), int):
            break
        said = last["exit"]
        conn.settimeout(STATUS_WAIT_S)  # the server's status follows in ms; a stopped server must not hold us
    if last.get("status") is None and said is not None:  # the server died; the worker told us itself
        _leave_like(said << 8)  # as a wait status: exited with `said`
    if last.get("status") is None:
        print(f"resilient: lost the prewarm server's answer for worker pid {pid} ({last.get('error', 'closed')}); "
              "leaving with exit 1", file=sys.stderr)
    _leave_like(last.get("status"))


def _running(pid: int) -> bool:
    """Whether `pid` still runs: neither gone nor a zombie (ended, its parent not reaping it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def die_with_parent(sig: int, parent: int) -> None:
    """Have Linux send `sig` when our parent dies (PR_SET_PDEATHSIG); sent now if it died already, so that ours is
    no longer `parent` (read before, not "is it pid 1": torchrun is pid 1 as a container's command). Here, standard
    library only, for the rank proxy and for train_entry's ranks alike."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, int(sig), 0, 0, 0)
    except OSError:  # not Linux: the ranks' watch of the supervisor's pid still covers them
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _forward(pid: int, signum: int) -> None:
    # Runs inside the wait for the server's last line: anything raised here would end that wait, and this
    # proxy, and with it the worker.
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def _leave_like(status: int | None) -> NoReturn:
    """Exit the way the worker did: the same code, or death by the same signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if status is None:  # the server is gone: the worker has ended, how is unknown
        os._exit(1)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal we cannot die of
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1:])

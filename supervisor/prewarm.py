"""Prewarmed workers: a fork server that has imported torch, so a relaunched rank does not wait for it.

A new worker spends most of its start importing torch (1.5 s of the ~2.7 s from spawn to first step on
these 2-core machines), and torchrun's in-place restart pays that as much as we do. So the supervisor keeps
one server per node: a child (its own session, parent-death signal) that imports torch and its distributed
packages once, with the job's worker environment, and then waits on an abstract Unix socket that serves
only our own uid.

torchrun starts `python -m supervisor.prewarm_client ENTRY...` instead of `ENTRY...`. The client hands the
server its argv, environment, working folder and stdin/stdout/stderr; the server forks; the fork takes on
all of that, reseeds what a fresh process would have seeded differently, and runs the entry point with
`runpy` as `__main__`. The fork reports its own pid to the client (so nobody ever holds a forked rank
without knowing it), the server reports its exit status, and the client exits the same way. The fork ends
itself if the client dies (its socket closes), so torchrun's kill of a worker still ends the rank.

The supervisor asks the same server for each relaunch's torchrun (`PrewarmServer.launch`, role
"launcher"): a fork that runs `torch.distributed.run` in a session of its own, so the launcher handles it
as it would a torchrun it had started, except that its exit status arrives from the server. The
alternative, a fresh zygote importing torchrun during every attempt, took 1.5-2 s of CPU from the ranks
each time on a node whose cores they keep busy (the first 100 steps of each attempt ran ~40% slower on 2
cores); a fork costs milliseconds. A launcher fork is tied to the supervisor's connection, not to the
server: when the supervisor dies it gets one SIGTERM, as a torchrun gets from its parent-death signal.

Forking a process that has imported torch but never started a parallel region or touched CUDA is what
DataLoader workers do; the server never does either. `RESILIENT_PREWARM=0` turns this off. The first
attempt starts its workers normally while the server is importing (they would not wait for it anyway).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import json
import logging
import os
import random
import runpy
import secrets
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, NoReturn

from supervisor import prewarm_client

if TYPE_CHECKING:
    import psutil
from supervisor.prewarm_client import ENV_SOCKET  # noqa: F401 (the launcher sets it)

log = logging.getLogger("resilient")

ENV_SWITCH = "RESILIENT_PREWARM"
CLIENT_MODULE = "supervisor.prewarm_client"
SERVER_MODULE = "supervisor.prewarm"  # its forks (ranks, torchruns) keep its command line
LAUNCHER = "launcher"  # the role of a fork that becomes an attempt's torchrun (see PrewarmServer.launch)
TORCHRUN = "supervisor.torchrun"  # torchrun, given only the options this torch knows
# torch._dynamo: FSDP2's fully_shard reaches DTensor.from_local, which imports it lazily on first use
# (0.4-0.7 s here, half of a prewarmed rank's start before this was preloaded).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.elastic.multiprocessing.errors", "numpy", "torch._dynamo")
# Read once when torch (or Python) starts, so a fork would keep the server's value: if the worker's differ,
# the server refuses and the worker starts normally. OMP_NUM_THREADS is the exception: torchrun sets it per
# worker and the fork applies it with torch.set_num_threads.
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "MKL_", "KMP_", "GOMP_", "TORCH_CPP_", "TORCH_SHOW_", "CUDA_",
                        "TORCH_LOGS", "TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE_")
NOT_IMPORT_TIME = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES"})


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


class PrewarmServer:
    """Supervisor side: start the server with the job's worker environment; `socket` goes to the workers."""

    def __init__(self, env: dict[str, str], preexec_fn: object = None):
        # An abstract socket: nothing on disk to leave behind when the server is killed; only processes of
        # our own uid are served (SO_PEERCRED), and those could ptrace us anyway.
        self.socket = f"@resilient-prewarm-{os.getpid()}-{secrets.token_hex(8)}"
        self._ready = False
        self.popen = subprocess.Popen(
            [sys.executable, "-m", SERVER_MODULE, self.socket], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=preexec_fn)  # type: ignore[arg-type]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def ready(self, wait_s: float = 0.0) -> bool:
        """Imported and accepting (it says so on stdout): only then are workers routed through it. Waits up to
        `wait_s` for that."""
        if not self._ready and self.alive():
            assert self.popen.stdout is not None
            readable, _, _ = select.select([self.popen.stdout], [], [], wait_s)
            self._ready = bool(readable) and self.popen.stdout.readline() == b"ready\n"
        return self._ready and self.alive()

    def launch(self, argv: list[str], env: dict[str, str], cwd: str, stdio: list[int]) -> ForkedProcess | None:
        """A fork that runs `argv` (an attempt's torchrun: `-m supervisor.torchrun ...`) in a session of its
        own, with this environment, folder and stdin/stdout/stderr; None if the server is not ready, is gone,
        or refuses (the caller then starts torchrun itself)."""
        if not self.ready():
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(address(self.socket))
        except OSError as e:
            conn.close()
            log.warning("prewarm server unreachable (%s): starting torchrun normally", e)
            return None
        conn.settimeout(ANSWER_S)  # audit 8: a stopped server held the relaunch, and every signal, for good
        first = prewarm_client.request(conn, argv, env, cwd, stdio, role=LAUNCHER)
        if "pid" not in first:
            conn.close()
            why = first.get("refused") or (f"no answer in {ANSWER_S:.0f}s" if first.get("unanswered") else "no answer")
            log.warning("prewarm server did not fork torchrun (%s): starting it normally", why)
            if first.get("unanswered"):  # stuck (stopped): no later launch is routed through it
                self.popen.kill()
                self.popen.wait()
            return None
        conn.settimeout(None)
        return ForkedProcess(int(first["pid"]), conn)

    def close(self) -> None:
        """Stop the server; workers it forked live on (their clients own them)."""
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


ANSWER_S = 10.0  # the server answers a launch with the fork's pid in milliseconds; one that does not is stuck
# A process the server forked has ended: how long the server may take to send its status (a busy machine's
# scheduler can keep an idle server waiting; one that is stopped costs this once per attempt).
STATUS_WAIT_S = prewarm_client.STATUS_WAIT_S


class ForkedProcess:
    """A process the server forked for us, with the part of `subprocess.Popen` the launcher uses. It is the
    server's child, not ours: its exit status comes from the server on `conn`; if the server is gone, a pidfd
    still tells when it has ended, and its code is the one it said on `conn` as it left (unknown, 1, if it was
    killed). Closing `conn` while it runs asks it to
    stop (a launcher fork SIGTERMs itself)."""

    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self.returncode = pid, None
        self._conn: socket.socket | None = conn
        self._exit: int | None = None  # the code the fork said it was leaving with (for a server gone since)
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # already ended (and reaped by the server): its status is on its way on `conn`
            self._pidfd = None

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            sources = [s for s in (self._conn, self._pidfd) if s is not None]
            if not sources:
                self.returncode = 1 if self._exit is None else self._exit
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = select.select(sources, [], [], left)[0]
            if not ready:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            if self._conn is None or (self._conn not in ready
                                      and not select.select([self._conn], [], [], STATUS_WAIT_S)[0]):
                # It ended, and the server that reaps it is gone or does not answer (stopped: audit 8, where each
                # wait on it ran out its whole timeout): its own last word, or unknown.
                self.returncode = 1 if self._exit is None else self._exit
                break
            try:
                answer = json.loads(prewarm_client.read_line(self._conn) or b"{}")
            except (OSError, ValueError):
                answer = {}
            status = answer.get("status") if isinstance(answer, dict) else None
            if isinstance(answer, dict) and isinstance(answer.get("exit"), int):  # the fork's own, before its end
                self._exit = answer["exit"]
            elif status is not None:
                self.returncode = os.waitstatus_to_exitcode(status)
            else:  # the server died: from now on, wait for the process itself
                self._conn.close()
                self._conn = None
        return self.returncode

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def forked_by_server(p: psutil.Process) -> bool:
    """A process this module's server forked (a rank or a torchrun: each keeps the server's command line), not the
    proxy torchrun started for a rank."""
    return _runs_module(p, SERVER_MODULE)


def is_proxy(p: psutil.Process) -> bool:
    """The proxy torchrun started for a prewarmed rank (`-m supervisor.prewarm_client ENTRY...`)."""
    return _runs_module(p, CLIENT_MODULE)


def _runs_module(p: psutil.Process, module: str) -> bool:
    import psutil  # the supervisor's side only: the server itself never needs it

    try:
        argv = p.cmdline()
    except psutil.Error:
        return False
    return "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == [module]


def address(name: str) -> str:
    """`@name` (environment variables cannot hold the NUL byte) → the abstract socket address."""
    return "\0" + name[1:] if name.startswith("@") else name


def client_argv(entry: list[str]) -> list[str]:
    """torchrun's `-m MODULE ARGS` / `SCRIPT ARGS`, routed through the client."""
    return ["-m", CLIENT_MODULE, *entry]


# ---- the server ------------------------------------------------------------------------------------------

def serve(path: str) -> NoReturn:
    baseline = _import_time_env(os.environ)  # before the imports: torch._dynamo sets TORCHINDUCTOR_CACHE_DIR
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the forks' collections then never walk (and copy-on-write) the objects imported here
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address(path))
    listener.listen(64)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd → (pid, the client's connection)
    while True:
        for key, _ in sel.select():
            if key.data is None:
                conn, _addr = listener.accept()
                with contextlib.suppress(OSError, ValueError):
                    child = _fork_for(conn, baseline, listener, sel, children)
                    if child is not None:
                        fd = os.pidfd_open(child)
                        children[fd] = (child, conn)
                        sel.register(fd, selectors.EVENT_READ, "child")
                        continue
                conn.close()
            else:  # a fork ended: tell its client how
                pid, conn = children.pop(key.fd)
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                conn.close()


def _import_time_env(env: dict[str, str] | os._Environ) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in NOT_IMPORT_TIME}


def _fork_for(conn: socket.socket, baseline: dict[str, str], listener: socket.socket,
              sel: selectors.BaseSelector, children: dict) -> int | None:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    if int.from_bytes(creds[4:8], sys.byteorder) != os.getuid():
        return None
    first, fds, _flags, _addr = socket.recv_fds(conn, 1, 3)
    rest = bytearray(first)
    while not rest.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        rest += chunk
    try:
        req = json.loads(rest)
        differ = sorted(k for k in set(baseline) | set(_import_time_env(req["env"]))
                        if baseline.get(k) != req["env"].get(k))
        if differ or len(fds) != 3:
            why = f"the worker's {', '.join(differ)} differ from the server's" if differ else "no stdio"
            conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
            return None
        pid = os.fork()
        if pid == 0:
            listener.close()
            sel.close()
            for fd, (_, other) in children.items():
                os.close(fd)
                other.close()
            _become_worker(conn, req, fds)
        return pid
    finally:
        for fd in fds:
            os.close(fd)


def _become_worker(conn: socket.socket, req: dict, fds: list[int]) -> NoReturn:
    """In the fork: take on the client's process state, then run the entry point as `__main__`."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        launcher = req.get("role") == LAUNCHER
        prewarm_client.IN_FORK = True  # our parent is this server, which may die (an OOM kill) while we run on
        if launcher:  # SIGUSR1 asks ranks for stack dumps (Slurm sends it to every process): not torchrun's
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        else:  # a rank dumps its stacks from birth: one stuck before its entry point beats can be seen too
            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        argv = list(req["argv"])
        if argv[0] == "-m":
            module, args = argv[1], argv[2:]
            sys.argv, path0 = [module, *args], os.getcwd()
        else:
            script, args = argv[0], argv[1:]
            sys.argv, path0 = [script, *args], os.path.dirname(os.path.abspath(script))
            module = None
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[:1] = [path0, *extra]
        _reseed()
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        # A rank ends at once with its proxy; a torchrun is asked to stop its ranks, as a parent-death signal
        # would. Either way only the client's death does it, never the server's (Slurm signals the server
        # too, and a torchrun signalled twice abandons its orderly shutdown).
        ending = signal.SIGTERM if launcher else signal.SIGKILL
        threading.Thread(target=_end_with_client, args=(conn, ending), name="prewarm-client", daemon=True).start()
        try:
            if launcher and module == TORCHRUN:
                # Called, as a zygote does, not run as __main__: runpy would replace this server's __main__,
                # and torchrun's rendezvous (inspect.stack() per event) would then rescan all of sys.modules
                # for each of our frames it could not place: +0.3 s per launch, measured.
                importlib.import_module(TORCHRUN).main(args)
            elif module is not None:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else _print_exit(e.code))
        except BaseException:
            sys.excepthook(*sys.exc_info())  # as an uncaught exception would: the rank's hook notes it, then prints
            code = 1
        if not launcher:  # torchrun, like a zygote's, leaves at once: its teardown has nothing left to do
            threading._shutdown()  # as at interpreter exit: wait for non-daemon threads, then atexit
            import atexit

            atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        # Our own code, in case the server that reaps us is gone (an OOM kill, a stray SIGKILL): a rank that
        # finished was otherwise reported exit 1, a failed attempt and a restart spent on a run that had ended.
        # The server's status line, which also knows a death by signal, still comes after it when it can.
        with contextlib.suppress(Exception):
            conn.settimeout(1.0)
            conn.sendall(json.dumps({"exit": code % 256}).encode() + b"\n")
        os._exit(code)


def _print_exit(message: object) -> int:
    print(message, file=sys.stderr)
    return 1


def _reseed() -> None:
    """What a fresh interpreter would have made different per process: the random modules' seeds and
    torch's intra-op thread count (torchrun sets OMP_NUM_THREADS per worker)."""
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _end_with_client(conn: socket.socket, sig: int) -> None:
    """The client never writes again: a read returns only when it has died. Then this fork ends too, saying so
    first in its own log: a rank ended this way leaves no heartbeat and no traceback, and this line is all that
    tells why."""
    how = "has ended"
    try:
        while conn.recv(1 << 10):
            pass
    except OSError as e:
        how = f"is unreachable ({e})"
    peer = "?"
    with contextlib.suppress(OSError):
        peer = str(int.from_bytes(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)[:4], sys.byteorder))
    with contextlib.suppress(OSError):
        os.write(2, f"resilient: pid {os.getpid()}: the process it was started for (pid {peer}) {how}; ending with "
                    f"{signal.Signals(sig).name}\n".encode())
    os.kill(os.getpid(), sig)


if __name__ == "__main__":
    serve(sys.argv[1])

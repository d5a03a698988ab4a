"""The prewarm server and client as real processes: a forked worker is indistinguishable, to torchrun, from
one it started itself (argv, environment, stdio, exit codes, signals both ways), and never outlives its
client."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from supervisor import prewarm
from tests.proc import child_env, started, wait_for

WORKER = textwrap.dedent("""\
    import gc, json, os, signal, sys, time
    preloaded = "torch" in sys.modules  # before this script imports anything
    def on_term(signum, frame):
        print("got SIGTERM", flush=True)
        sys.exit(5)
    signal.signal(signal.SIGTERM, on_term)
    print(json.dumps({"pid": os.getpid(), "preloaded": preloaded, "argv": sys.argv, "cwd": os.getcwd(),
                      "color": os.environ.get("COLOR"), "stdin": sys.stdin.readline().strip(),
                      "path0": sys.path[0], "frozen": gc.get_freeze_count()}), flush=True)
    mode = sys.argv[1]
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    if mode == "raise":
        raise RuntimeError("boom from the worker")
    if mode == "wait":  # until the file argv[2] exists, then exit argv[3]
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.05)
        sys.exit(int(sys.argv[3]))
    time.sleep(120)
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = prewarm.PrewarmServer(child_env())
    try:
        wait_for(srv.ready, 60, "the prewarm server to import torch")
        yield srv
    finally:
        srv.close()
    assert not srv.alive()


def client(tmp_path: Path, server: prewarm.PrewarmServer | None, *args: str, **env: str) -> list[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return [sys.executable, "-m", prewarm.CLIENT_MODULE, str(script), *args]


def client_env(server: prewarm.PrewarmServer | None, **extra: str) -> dict[str, str]:
    env = child_env(COLOR="teal", **extra)
    if server is not None:
        env[prewarm.ENV_SOCKET] = server.socket
    return env


def report(output: str) -> dict:
    return json.loads(next(line for line in output.splitlines() if line.startswith("{")))


def run_client(tmp_path: Path, server, *args: str, **extra: str) -> tuple[int, str]:
    import subprocess

    out = subprocess.run(client(tmp_path, server, *args), input="hello\n", capture_output=True, text=True,
                         cwd=tmp_path, env=client_env(server, **extra), timeout=60)
    return out.returncode, out.stdout + out.stderr


def test_a_forked_worker_gets_argv_env_cwd_stdio_and_exit_code(tmp_path, server):
    rc, out = run_client(tmp_path, server, "exit", "7")
    doc = report(out)
    assert rc == 7, out
    assert doc["preloaded"] is True, "the worker was not forked from the prewarmed server"
    assert doc["argv"] == [str(tmp_path / "worker.py"), "exit", "7"]
    assert doc["cwd"] == str(tmp_path) and doc["color"] == "teal" and doc["stdin"] == "hello"
    assert doc["path0"] == str(tmp_path), "a script's folder comes first on sys.path, as with `python script`"
    assert doc["frozen"] > 10_000, "the server's imports are frozen: the fork's collections never walk them"


def test_an_uncaught_exception_is_a_traceback_and_exit_1(tmp_path, server):
    rc, out = run_client(tmp_path, server, "raise")
    assert rc == 1 and "RuntimeError: boom from the worker" in out and report(out)["preloaded"] is True


def test_without_a_server_or_when_refused_the_client_starts_the_entry_itself(tmp_path, server):
    rc, out = run_client(tmp_path, None, "exit", "3")
    assert rc == 3 and report(out)["preloaded"] is False
    # A variable read when Python starts differs from the server's: a fork would not honour it.
    rc, out = run_client(tmp_path, server, "exit", "4", PYTHONHASHSEED="123")
    assert rc == 4 and report(out)["preloaded"] is False
    assert "prewarmed start refused (the worker's PYTHONHASHSEED differ" in out


def test_signals_pass_both_ways_and_the_worker_never_outlives_its_client(tmp_path, server):
    def forked_worker(p) -> psutil.Process:
        pid = wait_for(lambda: "{" in p.output() and report(p.output())["pid"], 30, "the worker to start")
        return psutil.Process(pid)

    # SIGTERM to the client (what torchrun sends) reaches the worker, and its exit code comes back.
    with started(client(tmp_path, server, "sleep"), tmp_path, env=client_env(server)) as p:
        worker = forked_worker(p)
        assert worker.pid != p.pid and worker.ppid() == server.popen.pid
        p.signal(signal.SIGTERM)
        assert p.wait(30) == 5 and "got SIGTERM" in p.output()
    # The worker SIGKILLed (a lost rank): the client dies of SIGKILL too, as torchrun expects of a worker.
    with started(client(tmp_path, server, "sleep"), tmp_path, env=client_env(server)) as p:
        worker = forked_worker(p)
        worker.kill()
        assert p.wait(30) == -signal.SIGKILL
    # The client SIGKILLed (torchrun's last resort): the worker ends too.
    with started(client(tmp_path, server, "sleep"), tmp_path, env=client_env(server)) as p:
        worker = forked_worker(p)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        _, alive = psutil.wait_procs([worker], timeout=30)
        with contextlib.suppress(psutil.Error):
            for w in alive:
                w.kill()
        assert alive == [], "a forked worker outlived its client"
        # It says why in the rank's log: nothing else (no heartbeat, no traceback) would.
        assert f"the process it was started for (pid {p.pid}) has ended; ending with SIGKILL" in p.output()


# ---- a fork that becomes an attempt's torchrun (role "launcher") -------------------------------------------

LAUNCHED = textwrap.dedent("""\
    import os, pathlib, signal, sys, time
    out = pathlib.Path(sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: (out.write_text("SIGTERM"), os._exit(5)))
    os.kill(os.getpid(), signal.SIGUSR1)  # Slurm's warning reaches torchrun too: it must not die of it
    out.write_text(f"{os.getpgid(0)} {os.getpid()}")
    if sys.argv[2] == "exit":
        sys.exit(int(sys.argv[3]))
    if sys.argv[2] == "wait":  # until the file argv[4] exists, then exit argv[3]
        while not os.path.exists(sys.argv[4]):
            time.sleep(0.05)
        sys.exit(int(sys.argv[3]))
    time.sleep(120)
""")


def launch(server: prewarm.PrewarmServer, tmp_path: Path, marker: Path, *args: str) -> prewarm.ForkedProcess:
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED)
    with open(os.devnull, "rb") as stdin, open(tmp_path / "launched.log", "ab") as out:
        forked = server.launch([str(script), str(marker), *args], child_env(), str(tmp_path),
                               [stdin.fileno(), out.fileno(), out.fileno()])
    assert forked is not None
    return forked


def test_a_launcher_fork_reports_its_exit_and_stops_when_its_supervisor_goes(tmp_path, server):
    import subprocess

    marker = tmp_path / "exit"
    forked = launch(server, tmp_path, marker, "exit", "7")
    try:
        assert forked.wait(30) == 7, (tmp_path / "launched.log").read_text()
        assert marker.read_text() == f"{forked.pid} {forked.pid}", "a session of its own, SIGUSR1 ignored"
    finally:
        forked.close()
    # The supervisor's end of the connection closes (it died): the fork gets SIGTERM, once.
    marker = tmp_path / "stopped"
    forked = launch(server, tmp_path, marker, "sleep")
    try:
        wait_for(lambda: marker.exists() and marker.read_text() == f"{forked.pid} {forked.pid}", 30, "the fork")
        with pytest.raises(subprocess.TimeoutExpired):
            forked.wait(0.2)
        assert psutil.Process(forked.pid).ppid() == server.popen.pid
    finally:
        forked.close()
    wait_for(lambda: marker.read_text() == "SIGTERM", 30, "the fork to be asked to stop")
    assert f"pid {forked.pid}: the process it was started for (pid {os.getpid()}) has ended; ending with SIGTERM" \
        in (tmp_path / "launched.log").read_text()


@contextlib.contextmanager
def server_and_fork(tmp_path: Path) -> Iterator[tuple[prewarm.PrewarmServer, prewarm.ForkedProcess]]:
    """A server of the test's own (it is killed or stopped) and a launcher fork of it that sleeps."""
    srv = prewarm.PrewarmServer(child_env())
    forked = None
    try:
        wait_for(srv.ready, 60, "a second prewarm server")
        marker = tmp_path / "orphan"
        forked = launch(srv, tmp_path, marker, "sleep")
        wait_for(marker.exists, 30, "the fork")
        yield srv, forked
    finally:
        if forked is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(forked.pid, signal.SIGKILL)
            forked.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(srv.popen.pid, signal.SIGCONT)
        srv.close()


def test_a_launcher_fork_outlives_the_server_and_its_end_is_still_seen(tmp_path):
    with server_and_fork(tmp_path) as (srv, forked):
        srv.popen.kill()  # a Slurm SIGTERM or an OOM kill ends the server, not the attempt's torchrun
        srv.popen.wait(10)
        assert forked.poll() is None and psutil.Process(forked.pid).is_running()
        os.kill(forked.pid, signal.SIGKILL)
        assert forked.wait(30) == 1, "ended, with a code nobody could read"


def test_forks_that_outlive_their_server_end_with_their_own_codes(tmp_path):
    """The server killed mid-attempt (an OOM kill): every rank then ended "exit 1", their status lost with it, so
    a run whose ranks all finished was a failed attempt and a restart spent."""
    srv = prewarm.PrewarmServer(child_env())
    forked = None
    try:
        wait_for(srv.ready, 60, "a prewarm server of the test's own")
        go = tmp_path / "go"
        forked = launch(srv, tmp_path, tmp_path / "marker", "wait", "7", str(go))  # an attempt's torchrun
        with started(client(tmp_path, srv, "wait", str(go), "0"), tmp_path, env=client_env(srv)) as p:  # a rank
            worker = wait_for(lambda: "{" in p.output() and report(p.output())["pid"], 30, "the worker to start")
            srv.popen.kill()
            srv.popen.wait(10)
            assert psutil.Process(worker).is_running() and forked.poll() is None
            go.touch()
            assert p.wait(30) == 0, p.output()
            assert forked.wait(30) == 7, (tmp_path / "launched.log").read_text()
    finally:
        if forked is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(forked.pid, signal.SIGKILL)
            forked.close()
        srv.close()


def test_a_ranks_proxy_leaves_with_the_workers_own_code_when_the_server_is_stopped(tmp_path):
    """Review 11: with the server stopped (SIGSTOP), the proxy had the worker's own exit line and still waited for
    good on the server's status; torchrun never saw the worker end."""
    srv = prewarm.PrewarmServer(child_env())
    try:
        wait_for(srv.ready, 60, "a prewarm server of the test's own")
        go = tmp_path / "go"
        with started(client(tmp_path, srv, "wait", str(go), "3"), tmp_path, env=client_env(srv)) as p:
            wait_for(lambda: "{" in p.output(), 30, "the worker to start")
            os.kill(srv.popen.pid, signal.SIGSTOP)
            go.touch()
            started_at = time.monotonic()
            assert p.wait(30) == 3, p.output()
            assert time.monotonic() - started_at < prewarm.STATUS_WAIT_S + 5
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(srv.popen.pid, signal.SIGCONT)
        srv.close()


def test_a_stopped_server_neither_hides_a_forks_end_nor_holds_a_launch(tmp_path, monkeypatch):
    """Audit 8: with the server SIGSTOPped, a relaunch waited on its answer for good (no torchrun, no timeout, no
    stop), and a fork's end was waited on until each wait's whole timeout ran out."""
    with server_and_fork(tmp_path) as (srv, forked):
        os.kill(srv.popen.pid, signal.SIGSTOP)
        os.kill(forked.pid, signal.SIGKILL)  # a zombie its stopped parent cannot reap
        monkeypatch.setattr(prewarm, "STATUS_WAIT_S", 1.0)
        started = time.monotonic()
        assert forked.wait(30) == 1 and time.monotonic() - started < 5, "ended, with a code nobody could read"
        monkeypatch.setattr(prewarm, "ANSWER_S", 1.0)
        started = time.monotonic()
        with open(os.devnull, "rb") as null:
            assert srv.launch(["-c", "pass"], child_env(), str(tmp_path), [null.fileno()] * 3) is None
        assert time.monotonic() - started < 5 and not srv.alive(), "a server that does not answer is let go"


# ---- the supervisor's stop reaches a prewarmed rank once ----------------------------------------------------

RECORDER = textwrap.dedent("""\
    import pathlib, signal, sys, time
    out = pathlib.Path(sys.argv[-1])
    signal.signal(signal.SIGTERM, lambda *_: out.open("a").write("TERM\\n"))
    out.write_text("")
    while True:
        time.sleep(0.05)
""")

STAND_IN_TORCHRUN = textwrap.dedent("""\
    import subprocess, sys, time
    recorder, out = sys.argv[1:]
    subprocess.Popen([sys.executable, recorder, "-m", "supervisor.prewarm_client", out], start_new_session=True)
    time.sleep(120)
""")


def test_a_stop_reaches_a_prewarmed_rank_once_through_its_proxy(tmp_path):
    """The supervisor knows a prewarmed rank twice: torchrun's child (the proxy, which forwards) and the pid in
    its heartbeat (the fork, whose command line is the server's). The stop's SIGTERM goes to the proxy alone:
    a script that takes a second SIGTERM as "quit now" would otherwise lose its stop checkpoint."""
    import subprocess

    from supervisor.launch import TorchrunProcess

    (tmp_path / "recorder.py").write_text(RECORDER)
    (tmp_path / "torchrun.py").write_text(STAND_IN_TORCHRUN)
    proxy_out, fork_out = tmp_path / "proxy", tmp_path / "fork"
    handle = TorchrunProcess([sys.executable, str(tmp_path / "torchrun.py"), str(tmp_path / "recorder.py"),
                              str(proxy_out)], child_env(), tmp_path / "torchrun.log")
    fork = subprocess.Popen([sys.executable, str(tmp_path / "recorder.py"), "-m", prewarm.SERVER_MODULE,
                             str(fork_out)], start_new_session=True)
    try:
        wait_for(lambda: proxy_out.exists() and fork_out.exists(), 30, "the stand-ins")
        handle.track([fork.pid])
        handle.signal_ranks(signal.SIGTERM)
        wait_for(lambda: proxy_out.read_text() == "TERM\n", 10, "the proxy's SIGTERM")
        with pytest.raises(subprocess.TimeoutExpired):
            fork.wait(0.5)  # time for a stray signal to land
        assert fork_out.read_text() == "" and handle.poll() is None, "the fork and torchrun get nothing"
    finally:
        assert handle.stop(grace_s=1) == []
        handle.close()
        fork.kill()
        fork.wait(10)

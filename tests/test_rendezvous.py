"""A torchrun that never leaves its rendezvous is no hung rank: what holds the endpoint's port is named, the
restart budget is not spent, and no hang evidence is taken from ranks that do not exist."""

from __future__ import annotations

import os
import socket

import pytest

from supervisor import rdzv
from tests.proc import Proc, free_port
from tests.runs import JOB, resilient, status


@pytest.fixture
def held_port():
    """A port this test process listens on (and accepts nothing on), as a foreign program would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def test_a_port_held_by_the_launcher_itself_means_waiting_for_the_other_nodes(held_port):
    assert "this node hosts the rendezvous store" in rdzv.stalled(f"127.0.0.1:{held_port}", {os.getpid()})


def test_a_port_held_by_another_process_names_it(held_port):
    said = rdzv.stalled(f"localhost:{held_port}", {os.getppid()})
    assert f"is held by pid {os.getpid()} (" in said and "free the port" in said, said


def test_a_free_port_and_a_remote_endpoint_say_so():
    port = free_port()
    assert rdzv.stalled(f"127.0.0.1:{port}", {os.getpid()}).startswith("nothing on this host listens")
    assert "on another host" in rdzv.stalled("192.0.2.1:29400", {os.getpid()})  # TEST-NET-1: nobody's


@pytest.mark.slow
def test_a_foreign_program_on_the_rendezvous_port_is_named_not_taken_for_a_hang(tmp_path, held_port):
    run_dir = tmp_path / "run"
    argv = resilient("run", JOB, "--run-dir", run_dir, "--node", "a", "--set", "nnodes=1:2",
                     "--set", f"rdzv.endpoint=127.0.0.1:{held_port}", "--set", "rdzv.conf.join_timeout=10",
                     "--set", "heartbeat.startup_timeout_s=3s")
    proc = Proc(argv, tmp_path)
    try:
        rc = proc.wait(120)
        out = proc.output()
        assert rc == 1, out
        assert f"held by pid {os.getpid()}" in out and "hang" not in out, out
        assert "resilient stopped the run: the group could not be formed in" in out, out
        node = run_dir / "nodes" / "a"
        st = status(node)
        reasons = {a["reason"] for a in st["history"]}
        assert reasons == {"rendezvous"} and len(st["history"]) >= 2, st["history"]
        assert st["restarts"] == 0, st  # the budget is not spent
        assert not list(node.rglob("hang_evidence.json"))
        assert not proc.alive_descendants()
    finally:
        proc.kill_all()

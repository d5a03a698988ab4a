"""Two supervisors as two nodes on 127.0.0.1 (`nnodes: "1:2"`, one rank each, c10d rendezvous, a shared run
dir): node loss, loss of the node that hosts the rendezvous store, a node rejoining, and agreement on the
resume step. Each "node" is a real `resilient run --node NAME` with its own torchrun."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from supervisor import store
from tests.ckpt_helpers import flip_byte
from tests.proc import Proc, child_env, free_port, wait_for
from tests.runs import resilient, status

pytestmark = pytest.mark.slow

STEPS, BATCH = 120, 12
FINISH_TIMEOUT = 300


def job_file(tmp_path: Path, port: int, *, sleep: float = 0.05, width: int = 64, steps: int = STEPS,
             local: bool = False) -> Path:
    samples = tmp_path / "samples"
    job = tmp_path / "mn.yaml"
    job.write_text(textwrap.dedent(f"""\
        name: mn
        run_dir: run
        entrypoint:
          module: train_entry
          args: [--steps, "{steps}", --batch, "{BATCH}", --n-embd, "{width}", --device, cpu,
                 --test-sleep-per-step, "{sleep}",
                 --test-log-samples, "{samples}"]
        nnodes: "1:2"
        nproc_per_node: 1
        rdzv: {{endpoint: "127.0.0.1:{port}", conf: {{last_call_timeout: 3, jion_timeout: 9}}}}  # a typo: warned of
        checkpoint: {{interval_steps: 20, keep: 4{', local_dir: "local/{node}"' if local else ''}}}
        restart: {{backoff_s: 0.5, crash_loop_attempts: 5}}
        heartbeat: {{timeout_s: 30, startup_timeout_s: 180}}
        collective_timeout_s: 60
        stop_timeout_s: 15
    """))
    return job


class Node:
    """One node: its supervisor (and, through it, torchrun and the rank)."""

    def __init__(self, tmp_path: Path, job: Path, name: str, *extra: str, env: dict[str, str] | None = None):
        self.tmp_path, self.name = tmp_path, name
        self.dir = tmp_path / "run" / "nodes" / name
        self.proc = Proc(resilient("run", job, "--node", name, *extra), tmp_path, env=env,
                         log=tmp_path / f"{name}-{time.monotonic_ns()}.log")

    def state(self) -> dict:
        try:
            return json.loads((self.dir / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def rank(self) -> dict | None:
        ranks = [r for r in self.state().get("ranks", []) if r.get("alive") and r.get("phase") == "train"]
        return ranks[0] if ranks else None

    def launchers(self) -> list[psutil.Process]:
        """The supervisor's children: its first torchrun (a zygote, see supervisor/zygote.py) and the
        prewarm server (relaunched torchruns are its forks)."""
        try:
            return psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return []

    def hosts_store(self, port: int) -> bool:
        torchruns = []
        for p in self.launchers():
            with contextlib.suppress(psutil.Error):
                torchruns += [p, *p.children()]
        for p in torchruns:
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp")):
                    return True
            except psutil.Error:
                pass
        return False

    def kill(self) -> None:
        """The node dies: its supervisor, torchrun and rank, all at once."""
        victims = [psutil.Process(self.proc.pid)]
        for p in self.launchers():
            try:
                victims += [p, *p.children(recursive=True)]
            except psutil.Error:
                pass
        for p in victims:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(victims, timeout=10)
        self.proc.kill_all()


def training_together(a: Node, b: Node, min_step: int) -> bool:
    ra, rb = a.rank(), b.rank()
    return bool(ra and rb and min(ra["step"], rb["step"]) >= min_step and
                json.loads((a.dir / "heartbeats" / f"attempt_{a.state()['attempt']}" /
                            f"rank_{ra['rank']}.json").read_text())["world_size"] == 2)


def world_of(node: Node) -> int | None:
    r = node.rank()
    if r is None:
        return None
    hb = node.dir / "heartbeats" / f"attempt_{node.state()['attempt']}" / f"rank_{r['rank']}.json"
    try:
        return json.loads(hb.read_text())["world_size"]
    except (OSError, ValueError):
        return None


def consumed_ids(samples: Path) -> collections.Counter:
    """The sample ids behind the final model: for each step, only its last execution (steps after the last
    checkpoint of a failed attempt run again)."""
    rows = [json.loads(line) for f in samples.glob("*.jsonl") for line in f.read_text().splitlines() if line]
    last = {}
    for r in rows:
        last[r["step"]] = max(last.get(r["step"], 0.0), r["t"])
    ids: collections.Counter = collections.Counter()
    for r in rows:
        if r["t"] >= last[r["step"]] - 1.0:  # the ranks of one execution log within a second of each other
            ids.update(range(*r["ids"]))
    return ids


@contextlib.contextmanager
def cluster() -> Iterator[list[Node]]:
    """Collects the nodes a test starts; every one is killed on the way out, however the test ends."""
    nodes: list[Node] = []
    try:
        yield nodes
    finally:
        for n in nodes:
            n.proc.kill_all()


def start(nodes: list[Node], tmp_path: Path, job: Path, name: str, *extra: str,
          env: dict[str, str] | None = None) -> Node:
    node = Node(tmp_path, job, name, *extra, env=env)
    nodes.append(node)
    return node


def start_pair(nodes: list[Node], tmp_path: Path, port: int, *extra_b: str, sleep: float = 0.05,
               width: int = 64, steps: int = STEPS) -> tuple[Node, Node, Path]:
    job = job_file(tmp_path, port, sleep=sleep, width=width, steps=steps)
    a = start(nodes, tmp_path, job, "a")
    wait_for(lambda: a.hosts_store(port), 60, "node a's torchrun to host the store")
    b = start(nodes, tmp_path, job, "b", *extra_b)
    return a, b, job


@pytest.mark.parametrize("victim", ["b", "a"], ids=["non_host_node_lost", "store_host_node_lost"])
def test_a_node_dies_and_the_other_finishes_alone(tmp_path, victim):
    port, steps = free_port(), 100
    with cluster() as nodes:
        a, b, _ = start_pair(nodes, tmp_path, port, steps=steps)
        wait_for(lambda: training_together(a, b, 25), 120, "both nodes training together")
        dead, survivor = (b, a) if victim == "b" else (a, b)
        assert dead.hosts_store(port) == (victim == "a")
        # A node that starts first may train alone until the other joins (nnodes 1:2), and the checkpoint taken
        # at that regroup is a 1-rank one: wait for one the two nodes saved, so the resume must reshard 2 → 1.
        before = wait_for(lambda: (i := store.latest_valid(tmp_path / "run" / "checkpoints")) and i.world_size == 2
                          and i, 120, "a checkpoint saved by both nodes")
        dead.kill()
        assert survivor.proc.wait(FINISH_TIMEOUT) == 0, survivor.proc.output()[-3000:]
        console = survivor.proc.output()
    st = survivor.state()
    assert st["state"] == "succeeded"
    failure, resumed = st["history"][0], st["history"][1]
    assert failure["reason"] == "node_lost", failure
    if victim == "b":  # the survivor's rank loses its peer; torchrun and its store (node a's) are fine
        assert "lost a peer" in failure["detail"], failure
    else:  # the survivor's torchrun loses the store, or its rank the peer first: a race, both node_lost
        assert "lost the rendezvous" in failure["detail"] or "lost a peer" in failure["detail"], failure
    assert resumed["resumed_from_step"] is not None and resumed["resumed_from_step"] >= before.step
    logs = tmp_path / "run" / resumed["log_dir"]  # state.json records it relative to the run dir
    assert any("resharded from 2 ranks" in p.read_text() for p in logs.rglob("stderr.log"))
    assert f"finished at step {steps}" in console
    assert consumed_ids(tmp_path / "samples") == collections.Counter(range(steps * BATCH))
    # The run finished without the dead node: it reads succeeded (it read "stopped", for good), the node retired.
    doc = status(tmp_path / "run")
    assert doc["state"] == "succeeded", doc["state"]
    assert {n["node"]: n["retired"] for n in doc["nodes"]} == {victim: True, survivor.name: False}
    assert {r["node"] for r in doc["ranks"]} == {survivor.name}


def test_a_run_resumed_on_other_nodes_goes_on_where_the_old_ones_left_it(tmp_path):
    """A Slurm requeue onto other hosts: nodes a and b stop (SIGTERM), c and d resume the run dir. `status` mixed
    the four: --wait-ranks waited on a's and b's dead ranks, the finished run read "stopped", attempts started
    again at 1 with goodput over the new session only, and `logs` showed the old nodes' output as the latest."""
    port, steps = free_port(), 100
    with cluster() as nodes:
        a, b, job = start_pair(nodes, tmp_path, port, steps=steps)
        wait_for(lambda: training_together(a, b, 15), 120, "both nodes training together")
        for n in (a, b):
            n.proc.signal(signal.SIGTERM)
        assert a.proc.wait(60) == 143 and b.proc.wait(60) == 143
        attempts_before = a.state()["attempt"]
        c = start(nodes, tmp_path, job, "c")
        wait_for(lambda: c.hosts_store(port), 60, "node c's torchrun to host the store")
        d = start(nodes, tmp_path, job, "d")
        waited = subprocess.run(resilient("status", tmp_path / "run", "--wait-ranks", "--wait-timeout", "120",
                                          "--json"), capture_output=True, text=True, env=child_env(), timeout=180)
        assert waited.returncode == 0, waited.stderr
        assert {r["node"] for r in json.loads(waited.stdout)["ranks"]} <= {"c", "d"}
        assert c.proc.wait(FINISH_TIMEOUT) == 0, c.proc.output()[-3000:]
        assert d.proc.wait(60) == 0, d.proc.output()[-3000:]
    assert "is new to this run dir: its history and goodput go on from node" in c.proc.output()
    assert "rdzv.conf.jion_timeout is not a key torch's rendezvous reads" in c.proc.output()
    doc = status(tmp_path / "run")
    assert doc["state"] == "succeeded" and doc["attempt"] > attempts_before, (doc["state"], doc["attempt"])
    assert {n["node"]: n["retired"] for n in doc["nodes"]} == {"a": True, "b": True, "c": False, "d": False}
    assert doc["history"][0]["attempt"] == 1 and doc["history"][-1]["reason"] == "finished"
    assert doc["accounting"]["summary"]["wall_s"] > doc["history"][-1]["ended_at"] - doc["history"][-1]["started_at"]
    logs = subprocess.run(resilient("logs", tmp_path / "run"), capture_output=True, text=True, env=child_env(),
                          timeout=60)
    assert logs.returncode == 0 and "nodes/c/" in logs.stderr and "nodes/d/" in logs.stderr, logs.stderr
    assert "nodes/a/" not in logs.stderr and "nodes/b/" not in logs.stderr, logs.stderr
    assert consumed_ids(tmp_path / "samples") == collections.Counter(range(steps * BATCH))


def test_a_killed_node_rejoins_and_the_world_grows_back(tmp_path):
    port = free_port()
    with cluster() as nodes:
        a, b, job = start_pair(nodes, tmp_path, port, sleep=0.08)
        wait_for(lambda: training_together(a, b, 15), 120, "both nodes training together")
        b.kill()
        wait_for(lambda: world_of(a) == 1 and (a.rank() or {}).get("step", 0) > 0, 120, "node a training alone")
        step_alone = a.rank()["step"]
        b2 = start(nodes, tmp_path, job, "b")
        wait_for(lambda: world_of(a) == 2 and world_of(b2) == 2, 120, "the world to grow back to 2")
        assert a.proc.wait(FINISH_TIMEOUT) == 0, a.proc.output()[-3000:]
        assert b2.proc.wait(60) == 0, b2.proc.output()[-3000:]
        console_a = a.proc.output()
    assert "torchrun re-formed the group in place" in console_a
    regroups = a.state()["history"][-1]["regroups"]
    assert regroups and regroups[-1]["world_size"] == 2 and regroups[-1]["resumed_from"] >= step_alone
    assert consumed_ids(tmp_path / "samples") == collections.Counter(range(STEPS * BATCH))


def test_with_a_local_tier_a_joining_node_resumes_the_larger_group_from_the_regroups_own_save(tmp_path):
    """Review 16: at a regroup the ranks checkpoint to their nodes' local tiers, which the larger group cannot read
    (the world changed): it resumed from an older durable step, losing the steps since. Rank 0 now waits for the
    durable copy of that save. Node a's copies take 4 s each (a test hook), as a large checkpoint's would."""
    from supervisor.replicate import PAUSE_ENV

    port = free_port()
    with cluster() as nodes:
        job = job_file(tmp_path, port, sleep=0.08, local=True)
        a = start(nodes, tmp_path, job, "a", env={**child_env(), PAUSE_ENV: "4"})
        wait_for(lambda: world_of(a) == 1 and (a.rank() or {}).get("step", 0) >= 30, 120, "node a training alone")
        b = start(nodes, tmp_path, job, "b")
        wait_for(lambda: world_of(a) == 2 and world_of(b) == 2, 120, "the world to grow to 2")
        assert a.proc.wait(FINISH_TIMEOUT) == 0, a.proc.output()[-3000:]
        assert b.proc.wait(60) == 0, b.proc.output()[-3000:]
        console_a = a.proc.output()
    assert "torchrun re-formed the group in place" in console_a
    before, _, _ = console_a.partition("torchrun re-formed the group in place")
    saved = [int(m) for m in re.findall(r"checkpoint step (\d+) committed to the local tier", before)]
    regroups = a.state()["history"][-1]["regroups"]
    assert regroups and regroups[-1]["world_size"] == 2, regroups
    assert regroups[-1]["resumed_from"] == saved[-1], (regroups, saved)
    assert consumed_ids(tmp_path / "samples") == collections.Counter(range(STEPS * BATCH))


def test_nodes_agree_on_the_resume_step_when_they_judge_the_newest_differently(tmp_path):
    port = free_port()
    with cluster() as nodes:
        # Wide enough that each rank's file is past SMALL_FILE_BYTES, which every check reads in full.
        a, b, job = start_pair(nodes, tmp_path, port, "--set", "checkpoint.verify=checksum", width=256, steps=60)
        # Past step 20's save (the stop waits for it, and saves its own), with 35+ steps left to be seen in.
        wait_for(lambda: training_together(a, b, 25), 120, "both nodes training together")
        for n in (a, b):
            n.proc.signal(signal.SIGTERM)
        assert a.proc.wait(60) == 143 and b.proc.wait(60) == 143
    root = tmp_path / "run" / "checkpoints"
    newest = store.latest_valid(root)
    older = store.latest_valid(root, below=newest.step)
    flip_byte(newest.path / "__0_0.distcp", offset=4096)  # node a checks sizes (passes), node b checksums
    with cluster() as nodes:
        # Both nodes or none: with 1:2, node a could start alone while node b still checksums, and b would then
        # join a group that has already resumed (the agreement under test is never made).
        a2 = start(nodes, tmp_path, job, "a", "--set", "nnodes=2")
        wait_for(lambda: a2.hosts_store(port) or a2.proc.poll() is not None, 60, "node a's store")
        b2 = start(nodes, tmp_path, job, "b", "--set", "checkpoint.verify=checksum", "--set", "nnodes=2")
        assert a2.proc.wait(FINISH_TIMEOUT) == 0, a2.proc.output()[-3000:]
        assert b2.proc.wait(60) == 0, b2.proc.output()[-3000:]
    assert f"resuming from step {newest.step}" in a2.proc.output()
    assert " mn@a attempt " in a2.proc.output() and " mn@b attempt " in b2.proc.output()  # nodes share a Slurm .out
    assert f"skipping {newest.path.name}: corrupt" in b2.proc.output() and "checksum mismatch" in b2.proc.output()
    assert f"the ranks resumed from step {older.step} (agreed across nodes" in a2.proc.output()
    resumed = {n.name: n.state()["history"][-1]["resumed_from_step"] for n in (a2, b2)}
    assert resumed == {"a": older.step, "b": older.step}
    assert os.path.exists(root / store.step_dirname(60))


def test_a_separately_started_store_outlives_a_lost_node(tmp_path):
    """`resilient rdzv-store` on a "third machine"; both nodes are clients (`is_host: false`). Losing a node
    loses no store, and the survivor re-forms the group under the next generation's run id."""
    port, steps = free_port(), 100
    store_proc = Proc(resilient("rdzv-store", "--host", "127.0.0.1", "--port", port), tmp_path,
                      log=tmp_path / "store.log")
    job = job_file(tmp_path, port, steps=steps)
    job.write_text(job.read_text().replace("conf: {last_call_timeout: 3}",
                                           "conf: {last_call_timeout: 3, is_host: false}"))
    with cluster() as nodes:
        try:
            wait_for(lambda: "listening" in store_proc.output(), 60, "the store")
            a, b = start(nodes, tmp_path, job, "a"), start(nodes, tmp_path, job, "b")
            wait_for(lambda: training_together(a, b, 20), 120, "both nodes training together")
            assert not a.hosts_store(port) and not b.hosts_store(port)
            b.kill()
            assert a.proc.wait(FINISH_TIMEOUT) == 0, a.proc.output()[-3000:]
            assert store_proc.poll() is None, "the store must outlive the nodes"
        finally:
            store_proc.kill_all()
    logs = sorted((tmp_path / "run" / "nodes" / "a" / "logs").glob("attempt_*/torchrun.log"))
    assert len(logs) >= 2
    assert a.state()["state"] == "succeeded"
    assert sorted(p.name for p in (tmp_path / "run" / "rdzv").iterdir())[:2] == ["gen_0", "gen_1"]
    assert consumed_ids(tmp_path / "samples") == collections.Counter(range(steps * BATCH))

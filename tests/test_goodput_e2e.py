"""Goodput on a real run with two injected failures: lost steps equal the steps actually re-executed."""

from __future__ import annotations

import collections
import os
import signal
import subprocess

import pytest

from supervisor.protocol import StepRecord, read_step_log
from tests.proc import child_env, started, wait_for
from tests.runs import live_ranks, resilient, run_job, status

pytestmark = pytest.mark.slow


def test_two_failures_lost_steps_match_the_step_logs(tmp_path):
    run_dir = tmp_path / "run"
    with started(run_job(run_dir, steps=160, sleep=0.02), tmp_path, log=tmp_path / "sup.log") as sup:
        for n, at_step in enumerate((35, 75)):
            ranks = wait_for(lambda at=at_step: live_ranks(run_dir, min_step=at), 120, f"step {at_step}")
            os.kill(ranks[n % 2]["pid"], signal.SIGKILL)
            wait_for(lambda k=n: len(status(run_dir)["history"]) >= k + 2, 60, "the relaunch")
        assert sup.wait(240) == 0, sup.output()[-3000:]
    doc = status(run_dir)
    assert [h["reason"] for h in doc["history"]] == ["worker_signal", "worker_signal", "finished"]
    executed: collections.Counter = collections.Counter()
    last_logged = []
    for k in (1, 2, 3):
        steps = [r.step for r in read_step_log(run_dir / "steps" / f"attempt_{k}.jsonl") if isinstance(r, StepRecord)]
        executed.update(steps)
        last_logged.append(max(steps))
    re_executed = sum(n - 1 for n in executed.values())
    assert set(executed) == set(range(1, 161))
    summary = doc["accounting"]["summary"]
    assert re_executed > 0 and summary["lost_steps"] == re_executed, (summary, re_executed)
    resumed = [h["resumed_from_step"] for h in doc["history"]]
    assert [h["lost_steps"] for h in doc["history"][:2]] == [last_logged[0] - resumed[1], last_logged[1] - resumed[2]]
    assert [h["step_at_failure"] for h in doc["history"][:2]] == last_logged[:2]
    assert 0 < doc["goodput"] < 1 and summary["lost_s"] > 0

    # The picture and the text timeline show the two failures.
    png = tmp_path / "timeline.png"
    out = subprocess.run(resilient("status", run_dir, "--plot", png), capture_output=True, text=True,
                         env=child_env(COLUMNS="160"), timeout=120)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    timeline_rows = [line for line in out.stdout.splitlines() if line.lstrip()[:1].isdigit() and "|" in line]
    assert len(timeline_rows) == 3 and sum(row.count("x") for row in timeline_rows[:2]) == 2, out.stdout
    assert f"lost {summary['lost_steps']} steps" in out.stdout

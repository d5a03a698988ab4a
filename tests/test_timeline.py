"""The text timeline draws what each attempt did: startup `s`, training `█`, the failure `x`."""

from supervisor.state import AttemptRecord, RunRecord, RunState
from supervisor.timeline import text_timeline


def _record(*history: AttemptRecord) -> RunRecord:
    return RunRecord(name="t", run_dir=".", checkpoint_dir="ckpt", state=RunState.STOPPED,
                     history=list(history), updated_at=history[-1].ended_at or 0.0)


def test_an_attempt_stopped_in_its_startup_shows_no_training():
    rows = text_timeline(_record(AttemptRecord(attempt=1, started_at=0.0, resumed_from_step=None,
                                               ended_at=10.0, reason="stopped")), width=20)
    assert len(rows) == 1 and "█" not in rows[0] and rows[0].count("s") >= 20, rows


def test_an_attempt_that_trained_shows_startup_training_and_its_failure():
    first = AttemptRecord(attempt=1, started_at=0.0, resumed_from_step=None, first_step_at=5.0, ended_at=10.0,
                          reason="worker_signal", step_at_failure=42)
    second = AttemptRecord(attempt=2, started_at=12.0, resumed_from_step=40, first_step_at=14.0, ended_at=20.0,
                           reason="finished")
    rows = text_timeline(_record(first, second), width=20)
    bar = rows[0].split("|")[1]
    assert bar.startswith("s" * 5) and "█" in bar and bar.rstrip().endswith("x"), rows
    assert rows[0].endswith("worker_signal @42") and rows[1].endswith("finished"), rows
    assert "x" not in rows[1].split("|")[1], rows

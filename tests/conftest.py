"""Shared fixtures. Rich's width is pinned so rendered tables do not depend on the terminal."""

from __future__ import annotations

import os

os.environ["COLUMNS"] = "200"
os.environ["LINES"] = "50"
os.environ.setdefault("TERM", "dumb")

import pytest
from typer.testing import CliRunner

from supervisor.cli import app


@pytest.fixture
def cli():
    """Invoke the CLI in-process: cli("gc", root, "--keep", "1") -> click Result."""
    runner = CliRunner()

    def invoke(*args: object):
        return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)

    return invoke


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Every test must end every process it started; a leftover fails the test (and is killed)."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    left = [p for p in me.children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(left, timeout=5)
    for p in alive:
        p.kill()
    assert not alive, f"processes left behind: {[(p.pid, p.name()) for p in alive]}"

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

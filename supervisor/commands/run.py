"""`resilient run JOB.yaml`: placeholder until the supervisor lands."""

from __future__ import annotations

from supervisor.config import load_job
from supervisor.errors import ResilientError


def main(job: str, overrides: list[str], node: str | None) -> int:
    load_job(job, overrides)
    raise ResilientError("resilient run is not implemented yet.")

"""The torch matrix: resilient's core real-process scenarios on every torch release at the ends of the range
pyproject.toml declares, on CPU with gloo.

    nox                      # every session below
    nox -s torch-2.7.0       # one release (the floor)
    nox -s torch-2.15.0 -- -x -k sigterm     # pytest arguments after --

Each session has its own virtual environment, kept outside the repo (RESILIENT_MATRIX_DIR, default
~/.cache/resilient/nox) and reused, so only the first run of a release downloads it (a CUDA build of several
GB that runs on the CPU; 2.13.0 is the local CPU build). The session installs that torch first, then the
project beside it and checks that the torch is still the same release (the range must admit it, and pip must
never replace a user's torch), then runs the tests marked `matrix` (README, "Supported torch").
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

FLOOR = "2.7.0"
NEWEST = "2.15.0"
RELEASES = (FLOOR, "2.13.0", "2.14.1", NEWEST)

nox.options.envdir = os.environ.get("RESILIENT_MATRIX_DIR", str(Path.home() / ".cache" / "resilient" / "nox"))
nox.options.reuse_venv = "yes"
nox.options.sessions = [f"torch-{v}" for v in (FLOOR, "2.14.1", NEWEST)]


def _matrix_session(version: str):
    def session(s: nox.Session) -> None:
        # Some machines cap pip's torch below the newest release (a pip.conf constraint file): a session asks
        # for exactly its release, so that cap does not apply here.
        env = {"PIP_CONSTRAINT": os.devnull}
        s.install(f"torch=={version}", "numpy", env=env)
        s.install("-e", ".[dev]", env=env)
        s.run("python", "-c", f"import torch, sys; v = torch.__version__.split('+')[0]; "
                              f"sys.exit(0 if v == '{version}' else f'torch {{v}} replaced {version}')")
        s.run("python", "-m", "pytest", "-m", "matrix", "-p", "no:cacheprovider", *s.posargs)

    session.__doc__ = f"core scenarios on torch {version}" + (" (the floor)" if version == FLOOR else
                                                              " (the newest release)" if version == NEWEST else "")
    return session


for _version in RELEASES:
    nox.session(name=f"torch-{_version}", venv_backend="venv")(_matrix_session(_version))

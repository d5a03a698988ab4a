"""Shared fixtures. Rich's width is pinned so rendered tables do not depend on the terminal."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
from pathlib import Path

os.environ["COLUMNS"] = "200"
os.environ["LINES"] = "50"
os.environ.setdefault("TERM", "dumb")

import pytest
from typer.testing import CliRunner

from supervisor import store
from supervisor.cli import app
from tests.ckpt_helpers import flip_byte, truncate, write_checkpoint
from tests.proc import readonly


def _ignore(signum: int, frame: object) -> None:
    pass


# The tests send SIGHUP and SIGINT to the processes they start and expect them to act (`resilient run` checkpoints
# and exits 143, `logs --follow` exits 130). A pytest started under `nohup`, or as a background job of a script,
# ignores those signals, and an ignored signal stays ignored through exec: its children did not act (and `nohup
# resilient run` keeps SIGHUP ignored on purpose). A handler does not pass through exec: the children start with
# the defaults, and this process still ignores them.
for _sig in (signal.SIGHUP, signal.SIGINT):
    if signal.getsignal(_sig) is signal.SIG_IGN:
        signal.signal(_sig, _ignore)


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


@pytest.fixture(autouse=True, scope="session")
def children_tmpdir(tmp_path_factory):
    """The processes tests start keep their temporary files in one folder, removed at the end: a torchrun
    without --log-dir makes a /tmp/torchelastic_* folder per launch, which the suite used to leave behind."""
    folder = tmp_path_factory.mktemp("children-tmp")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)  # child_env copies os.environ
    yield folder
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def readonly_mounts(tmp_path_factory) -> None:
    """Skip where read-only bind mounts cannot be made (not root, no unshare): tests.proc.readonly needs them."""
    probe = tmp_path_factory.mktemp("ro-probe")
    try:
        made = subprocess.run(readonly(probe, ["touch", probe / "x"]), capture_output=True, timeout=30)
    except OSError as e:
        pytest.skip(f"no read-only mounts here: {e}")
    if made.returncode == 0 or (probe / "x").exists():
        pytest.skip(f"read-only bind mounts do not work here: {made.stderr.decode(errors='replace')[-200:]}")
    if b"Read-only file system" not in made.stderr:
        pytest.skip(f"read-only bind mounts do not work here: {made.stderr.decode(errors='replace')[-200:]}")


@pytest.fixture
def rng() -> random.Random:
    """A seeded random source for tests that pick random moments or victims. The seed is printed (pytest
    shows it with a failure): RESILIENT_TEST_SEED=<seed> replays the same choices."""
    seed = int(os.environ.get("RESILIENT_TEST_SEED") or random.randrange(1 << 30))
    print(f"RESILIENT_TEST_SEED={seed}")
    return random.Random(seed)


@pytest.fixture
def zoo(tmp_path) -> Path:
    """Every kind of folder the acceptance line names, each made by the writer API then damaged."""
    root = tmp_path / "ckpt"
    write_checkpoint(root, 10)                                   # valid
    no_marker = write_checkpoint(root, 20)                       # valid until its marker goes
    os.unlink(no_marker / store.MARKER)
    truncate(write_checkpoint(root, 30) / "__1_0.distcp")        # truncated shard
    flip_byte(write_checkpoint(root, 35) / ".metadata", 3)       # flipped byte in a small file: always found
    big = write_checkpoint(root, 40, size=store.SMALL_FILE_BYTES + 1)
    flip_byte(big / "__0_0.distcp")                              # flipped byte in a big file: valid unless verified
    (write_checkpoint(root, 50) / store.MARKER).write_text("{not json")  # garbage marker
    (write_checkpoint(root, 60) / "notes.txt").write_text("x")   # unlisted extra file
    write_checkpoint(root, 70, commit=False)                     # abandoned partial save
    return root


@pytest.fixture
def small_disk(tmp_path):
    """A 5 MiB tmpfs: room for two checkpoints of the tiny model, not three."""
    disk = tmp_path / "disk"
    disk.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)], capture_output=True, text=True,
                         timeout=30)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {out.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False, timeout=30)

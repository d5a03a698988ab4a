"""A torchrun started ahead of need, so a relaunch does not wait for Python and torch to import.

`python -m torch.distributed.run` spends seconds importing torch before it spawns a single worker; torchrun's
own in-place restart does not pay that, so neither should ours. The supervisor keeps one *zygote*: a child
process (its own session, parent-death signal) that has imported torchrun and blocks reading one JSON line —
the attempt's arguments, environment, folder and log file. It then becomes that attempt's torchrun: it
applies the environment, points stdout/stderr at the log, runs torchrun's `main`, and leaves with `os._exit`
(torch's interpreter teardown is slow and has nothing left to do). Every attempt's torchrun is a fork of the
prewarm server (supervisor/prewarm.py) when prewarming is on; a zygote is kept only when it is off
(`RESILIENT_PREWARM=0`), or a server could not be had.

Workers are unaffected: torchrun starts them as fresh processes with the environment it was handed.
`RESILIENT_ZYGOTE=0` turns this off (each attempt then runs `python -m supervisor.torchrun`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import NoReturn

ENV_SWITCH = "RESILIENT_ZYGOTE"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


class Zygote:
    """Supervisor side: one pre-started torchrun, used once."""

    def __init__(self, preexec_fn: object = None):
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "supervisor.zygote"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec_fn)  # type: ignore[arg-type]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def launch(self, args: list[str], env: dict[str, str], cwd: Path | None, log: Path) -> subprocess.Popen:
        """Hand over the attempt: from here on the zygote is that attempt's torchrun."""
        req = {"args": args, "env": env, "cwd": str(cwd or os.getcwd()), "log": str(log)}
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps(req) + "\n").encode())
        self.popen.stdin.close()
        return self.popen

    def discard(self) -> None:
        """Not needed after all: closing its stdin makes it exit once its import is done; one still importing
        is killed (it has started nothing), so the supervisor's loop never waits on it."""
        try:
            if self.popen.stdin is not None and not self.popen.stdin.closed:
                self.popen.stdin.close()
            self.popen.wait(timeout=0.5)
        except (OSError, subprocess.TimeoutExpired):
            self.popen.kill()
            self.popen.wait(timeout=5)


def serve() -> NoReturn:
    """Child side: import torchrun now, become the attempt's torchrun when asked."""
    import torch.distributed.run  # noqa: F401 (the slow part, done before anyone waits for it)

    from supervisor import torchrun

    line = sys.stdin.buffer.readline()
    if not line:  # the supervisor does not need us
        os._exit(0)
    req = json.loads(line)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)  # never through a link
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = ["torchrun", *req["args"]]
    code = 0
    try:
        torchrun.main(req["args"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    serve()

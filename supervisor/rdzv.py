"""Rendezvous generations: a fresh c10d run id each time the nodes form the group from scratch.

torchrun closes its rendezvous when it exits, and a closed rendezvous stays closed for as long as its store
lives. The supervisors own failure restarts (every torchrun exits, every node relaunches), so with a store
that outlives torchrun (a separately started one: `rdzv.conf.is_host: false`, or etcd) a relaunch under the
same run id would be refused. Each formation of the group therefore gets its own run id, `<rdzv.id>-g<k>`,
agreed through the shared run dir: a supervisor whose torchrun used generation k moves to k+1 (created with
O_EXCL, so the nodes that relaunch together meet in the same one); a node joining late takes the newest.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

GEN_RE = re.compile(r"^gen_(\d+)$")


class Generations:
    def __init__(self, run_dir: Path):
        self.folder = run_dir / "rdzv"

    def _existing(self) -> list[int]:
        try:
            return [int(m.group(1)) for n in os.listdir(self.folder) if (m := GEN_RE.match(n))]
        except FileNotFoundError:
            return []

    def _claim(self, k: int) -> int:
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.folder / f"gen_{k}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            pass  # another node got there first: the same generation, which is the point
        return k

    def current(self) -> int:
        """The newest generation (a node starting or rejoining meets the others there)."""
        existing = self._existing()
        return max(existing) if existing else self._claim(0)

    def after(self, used: int) -> int:
        """The generation to relaunch in after using `used`, which torchrun has closed on exiting."""
        return self._claim(max(used + 1, self.current()))


def run_id(base: str, generation: int) -> str:
    return f"{base}-g{generation}"

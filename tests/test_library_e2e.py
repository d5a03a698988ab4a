"""The library as a user's own script uses it, under real torchrun (2 CPU ranks, gloo, real DCP files): the
slips a careful user still makes, found by a reviewer writing such scripts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.proc import child_env, free_port, started

pytestmark = pytest.mark.slow

# A plain DDP model with BatchNorm (buffers each rank updates on its own batch; DDP broadcasts rank 0's at each
# forward) and two 2 MiB layers, a counter dict the script keeps, a per-rank token count, and `state.step = step`
# forgotten.
SCRIPT = '''
import sys
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from train_entry import Session, TrainState

total, out = int(sys.argv[1]), sys.argv[2]
session = Session.start(ckpt_dir="ckpt", ckpt_interval=5, async_save=False)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(4, 512), nn.BatchNorm1d(512), nn.Linear(512, 1024), nn.Linear(1024, 512),
                          nn.Linear(512, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.001)
counters = {"batches": 0}
state = TrainState(model, opt, extra=counters)
step = session.resume(state)
while step < total:
    g = torch.Generator().manual_seed(step * 10 + session.rank)
    loss = model(torch.randn(16, 4, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    counters["batches"] += 1
    state.tokens_seen += 16 * (session.rank + 1)
    session.beat(step, loss)
    if session.should_save(step):
        session.save(step, state)
code = session.finish(step, state)
assert session.finish(step, state) == code
sd = {k: v.clone() for k, v in model.module.state_dict().items()}
torch.save({"sd": sd, "counters": dict(counters)}, f"{out}.rank{session.rank}.pt")
sys.exit(code)
'''


def run(cwd: Path, script: Path, total: int, out: str) -> str:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0",
            str(script), str(total), out]
    with started(argv, cwd, log=cwd / f"{out}.log") as p:
        rc = p.wait(120)
        text = p.output()
    assert rc == 0, text[-3000:]
    return text


@pytest.mark.matrix
def test_a_users_ddp_script_with_its_slips_resumes_bitwise(tmp_path):
    """Before: the forgotten `state.step` made every checkpoint fail to load (exit 74: 'it holds step 0'), the
    counter dict the script held was cut off from the checkpoint after a resume, and DCP kept whichever rank's
    BatchNorm buffers balanced its writes best, so the resumed run left the uninterrupted one."""
    script = tmp_path / "my_ddp.py"
    script.write_text(SCRIPT)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    run(straight, script, 20, "end")
    first = run(resumed, script, 10, "half")
    assert first.count("the training position") == 1 and "save(5) with state.step 0" in first
    # The small values every rank holds are written by rank 0; the big ones are still spread over the ranks.
    saved = resumed / "ckpt" / "step_000000010"
    assert (saved / "__1_1.distcp").stat().st_size > 2 << 20 and (saved / "__0_1.distcp").stat().st_size > 2 << 20
    second = run(resumed, script, 20, "end")
    assert "resumed from step 10" in second
    for rank in (0, 1):
        a = torch.load(straight / f"end.rank{rank}.pt")
        b = torch.load(resumed / f"end.rank{rank}.pt")
        assert b["counters"] == {"batches": 20}, b["counters"]
        assert a["sd"].keys() == b["sd"].keys()
        for k in a["sd"]:
            assert torch.equal(a["sd"][k], b["sd"][k]), (rank, k)


def test_a_script_started_without_torchrun_says_so_in_one_sentence(tmp_path):
    script = tmp_path / "my_ddp.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in child_env().items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, str(script), "10", "x"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 78 and "Traceback" not in r.stderr, r.stderr  # EXIT_CONFIG: the environment
    assert r.stderr.strip().startswith("resilient: RANK and WORLD_SIZE and MASTER_ADDR and MASTER_PORT not set")
    assert "torchrun" in r.stderr and not (tmp_path / "ckpt").exists()

"""The real path on CUDA with NCCL. Skipped where CUDA is absent; the only tests that use a GPU.
Also mixed precision (bf16, fp16 with its GradScaler) with an EMA and the stateful loader, resumed bitwise.

On a CUDA machine whose Python already has a CUDA torch: `bash bench/gpu_check.sh` (prints the GPU, torch,
CUDA and NCCL versions, runs these, then the GPT-2-small job), or `python -m pytest -m gpu`. One rank on one
GPU; two ranks where two GPUs exist (NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from supervisor import store
from supervisor.protocol import CommitRecord, SaveRecord, read_step_log
from tests.ckpt_helpers import assert_same_training_state, stateful_entries
from tests.proc import child_env, started, wait_for
from tests.runs import RUN_TIMEOUT, live_ranks, rank_log, resilient, run_job, state, status

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU tests)")]

NPROC = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def gpu_job(run_dir, steps: int, *extra: str, sleep: float = 0.0) -> list[str]:
    """The killed runs sleep per step (a GPU step of this model takes milliseconds, shorter than the heartbeats
    through which the test sees a step); the numbers they compute are the same."""
    return run_job(run_dir, f"nproc_per_node={NPROC}", "checkpoint.verify=checksum", steps=steps, sleep=sleep,
                   device="cuda", extra_args=("--n-layer", "4", "--n-embd", "256", "--batch", "32", *extra))


def test_host_staging_is_pinned_allocated_once_and_a_snapshot():
    from train_entry.staging import HostStager

    live = {"w": torch.randn(1024, 256, device="cuda"), "opt": [{"m": torch.ones(7, device="cuda")}], "n": 3}
    stager = HostStager(pin_memory=True)
    first = stager.stage(live)
    assert first["w"].device.type == "cpu" and first["w"].is_pinned() and first["n"] == 3
    assert torch.equal(first["w"], live["w"].cpu()) and torch.equal(first["opt"][0]["m"], live["opt"][0]["m"].cpu())
    buffer = first["w"].data_ptr()
    live["w"].add_(1.0)  # training goes on: the staged copy must not move until the next stage()
    assert not torch.equal(first["w"], live["w"].cpu())
    second = stager.stage(live)
    assert second["w"].data_ptr() == buffer and stager.allocations == 1
    assert torch.equal(second["w"], live["w"].cpu())
    live["w"] = torch.randn(512, 256, device="cuda")  # a new layout reallocates
    stager.stage(live)
    assert stager.allocations == 2


def test_a_refused_host_registration_leaves_no_cuda_error_behind(monkeypatch):
    """cudaHostRegister refused (a locked-memory limit): the arena falls back to torch's pinned allocator, and the
    refusal's error must not stay with the training thread (its next kernel failed with it: invalid argument)."""
    from train_entry import staging

    real = torch.cuda.cudart()

    class Refusing:
        def cudaHostRegister(self, ptr, nbytes, flags):
            return real.cudaHostRegister(0, nbytes, flags)  # a real call that CUDA refuses: an invalid pointer

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    stager = staging.HostStager(pin_memory=True, device=torch.device("cuda", 0))
    staged = stager.stage({"w": torch.randn(256, 256, device="cuda")})
    assert staged["w"].is_pinned() and not stager._registered
    x = torch.ones(1024, device="cuda") * 2  # a kernel in this thread, after the refusal
    torch.cuda.synchronize()
    assert float(x.sum()) == 2048.0


def test_a_replicated_states_bytes_do_not_name_its_gpu():
    """torch.save writes each tensor's device: the same EMA on cuda:0 and cuda:1 were different bytes, and every
    multi-GPU run with a Replicated object holding CUDA tensors stopped at its start (exit 78)."""
    from train_entry.stateful import pack

    t = torch.arange(12.0)
    assert pack({"w": t.cuda()}) == pack({"w": t}) and b"cuda" not in pack({"w": t.cuda()})


def test_nccl_run_survives_two_sigkills_resumes_bitwise_exact_and_verifies(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    with started(gpu_job(straight, 160), tmp_path, log=tmp_path / "straight.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    log0 = rank_log(straight, 1, 0)
    assert "(nccl)" in log0 and "on cuda:0" in log0, log0[-2000:]
    # Every save of the uninterrupted run came from one process per rank, async, into pinned buffers
    # allocated once.
    records = read_step_log(straight / "steps" / "attempt_1.jsonl")
    saves = [r.step for r in records if isinstance(r, SaveRecord)]
    assert saves == [r.step for r in records if isinstance(r, CommitRecord)] == list(range(20, 161, 20))
    assert log0.count("staging arena allocated") == 1 and "of pinned host memory" in log0

    def attempt_ranks(attempt: int, min_step: int = 0) -> list[dict]:
        return live_ranks(killed, min_step, nproc=NPROC) if state(killed).get("attempt") == attempt else []

    with started(gpu_job(killed, 160, sleep=0.05), tmp_path, log=tmp_path / "killed.log") as sup:
        for attempt, at_step in ((1, 30), (2, 70)):
            ranks = wait_for(lambda a=attempt, s=at_step: attempt_ranks(a, s), 180, f"attempt {attempt} training")
            os.kill(ranks[-1]["pid"], signal.SIGKILL)
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    assert [h["reason"] for h in status(killed)["history"]] == ["worker_signal", "worker_signal", "finished"]
    a, b = store.latest_valid(straight / "checkpoints"), store.latest_valid(killed / "checkpoints")
    assert a.step == b.step == 160
    assert_same_training_state(a.path, b.path)
    verify = subprocess.run(resilient("inspect-checkpoint", killed, "--verify", "--json"), capture_output=True,
                            text=True, env=child_env(), timeout=120)
    doc = json.loads(verify.stdout)
    assert verify.returncode == 0 and doc["verified"] and {c["status"] for c in doc["checkpoints"]} == {"valid"}


def test_a_bit_flipped_in_a_shard_is_caught_by_a_load_onto_the_gpu(tmp_path):
    """The load onto a GPU reads through pinned host buffers, each piece checked against its checksum by the
    thread that read it, before its copy to the device: a flipped bit that `verify: size` passes fails the load,
    and the run resumes from the checkpoint before."""
    from train_entry import storage

    run_dir = tmp_path / "run"
    sets = (f"nproc_per_node={NPROC}", "checkpoint.interval_steps=10", "checkpoint.verify=size")
    model = ("--n-layer", "4", "--n-embd", "256", "--batch", "32")
    with started(run_job(run_dir, *sets, steps=20, sleep=0.0, device="cuda", extra_args=model), tmp_path,
                 log=tmp_path / "first.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    newest = store.latest_valid(run_dir / "checkpoints")
    items = storage.RawReader(newest.path).read_metadata().storage_data
    index, info = max(((i, v) for i, v in items.items() if v.relative_path == "__0_0.distcp"),
                      key=lambda kv: kv[1].length)
    with open(newest.path / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)[0]
        f.seek(info.offset + info.length // 2)
        f.write(bytes([byte ^ 0x04]))
    assert newest.step == 20 and store.inspect(newest.path).valid
    with started(run_job(run_dir, *sets, steps=30, sleep=0.0, device="cuda", extra_args=model), tmp_path,
                 log=tmp_path / "second.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    history = status(run_dir)["history"][1:]
    assert [(h["reason"], h["resumed_from_step"]) for h in history] == [("checkpoint_load", 20), ("finished", 10)]
    assert f"__0_0.distcp ({index.fqn}, from byte {info.offset} of the file): its bytes" in history[0]["detail"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_with_ema_and_stateful_loader_resumes_bitwise_after_two_sigkills(tmp_path, precision):
    """FSDP2's MixedPrecisionPolicy (and fp16's GradScaler), a sharded EMA and the per-rank loader on CUDA: the
    final checkpoint, stateful objects included, equals an uninterrupted run's."""
    # Deterministic algorithms: flash attention's backward (bf16/fp16) is not reproducible by default.
    extra = ("--precision", precision, "--ema", "0.99", "--loader", "stateful", "--deterministic")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    with started(gpu_job(straight, 120, *extra), tmp_path, log=tmp_path / "straight.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    log0 = rank_log(straight, 1, 0)
    assert f"precision {precision} (FSDP2 MixedPrecisionPolicy" in log0, log0[-2000:]

    def attempt_ranks(attempt: int, min_step: int) -> list[dict]:
        return live_ranks(killed, min_step, nproc=NPROC) if state(killed).get("attempt") == attempt else []

    with started(gpu_job(killed, 120, *extra, sleep=0.05), tmp_path, log=tmp_path / "killed.log") as sup:
        for attempt, at_step in ((1, 30), (2, 50)):
            ranks = wait_for(lambda a=attempt, s=at_step: attempt_ranks(a, s), 180, f"attempt {attempt} training")
            os.kill(ranks[-1]["pid"], signal.SIGKILL)
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    assert [h["reason"] for h in status(killed)["history"]] == ["worker_signal", "worker_signal", "finished"]
    a, b = store.latest_valid(straight / "checkpoints"), store.latest_valid(killed / "checkpoints")
    assert a.step == b.step == 120
    assert_same_training_state(a.path, b.path)
    entries = stateful_entries(b.path)
    assert sum(k.startswith("sharded.ema.") for k in entries) > 20
    assert ("replicated.scaler" in entries) == (precision == "fp16")


def test_a_cuda_out_of_memory_is_classified_oom_and_recovered(tmp_path):
    """The hook asks the GPU's allocator for 1 PiB (review 10: it asked the CPU's, so CUDA's own error, the one
    users meet, was never produced): classified `oom` from its text, relaunched, finished."""
    run_dir = tmp_path / "run"
    argv = gpu_job(run_dir, 40, "--test-oom-at-step", "15", "--test-attempts", "1")
    with started(argv, tmp_path, log=tmp_path / "sup.log") as sup:
        assert sup.wait(RUN_TIMEOUT) == 0, sup.output()[-3000:]
    history = status(run_dir)["history"]
    assert [h["reason"] for h in history] == ["oom", "finished"], history
    assert "CUDA out of memory" in history[0]["detail"], history[0]

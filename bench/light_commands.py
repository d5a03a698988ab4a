"""Benchmark of the torch-free side: `inspect-checkpoint --verify` throughput and light-command latency.

What it measures, in one run:

1. Builds a checkpoint root in a temp folder with the store's own writer API (`store.begin` → write and
   fsync → `store.describe_files` → `PartialCheckpoint.commit`): `--checkpoints` checkpoints of
   `--ranks` data files each (plus a small `.metadata`), `--gb` GB in all.
2. Verify throughput: `resilient inspect-checkpoint ROOT --verify --json` (a fresh process: bytes verified /
   wall s) versus a plain sequential read of the same files in this process (same chunk size,
   `readinto`, no hashing) and `store.checksum_file` alone in this process (to separate the process
   start from the hashing), each with a warm page cache and a cold one. Cold = each file fsynced, then
   `posix_fadvise(DONTNEED)`; whether that worked is reported from `mincore` (pages still resident) and
   from the timing (a cold pass much slower than a warm one).
3. Latency of the light commands, each a fresh process, `--runs` times, interleaved round-robin:
   `status RUN_DIR`, `inspect-checkpoint ROOT`, `gc ROOT --keep 2 --dry-run` and `--version`, through both
   `python -m supervisor` and the `resilient` console script, against `python -c pass`. `-X importtime`
   says what each form imports (and that none imports torch).

Prints markdown tables and writes bench/results/light_commands.json. Run it with:

    python bench/light_commands.py                 # 2 GB over 4 checkpoints, 20 runs per command
    python bench/light_commands.py --gb 0.2 --runs 5 --repeat 1    # a quick look

Timings on a shared machine are noisy: compare numbers from the same run only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from argtypes import folder, positive_float, positive_int

from supervisor import lock, state, store
from supervisor.state import AttemptRecord, RunRecord, RunState

RESULTS = Path(__file__).resolve().parent / "results"
CHUNK = store.CHUNK  # what checksum_file reads per call
PAGE = os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------------------------------
# Building the checkpoint root and the run dir


def _write_file(path: Path, size: int, pool: bytes, salt: int) -> None:
    """`size` bytes that differ from file to file and chunk to chunk (no block repeats), then fsync."""
    with open(path, "wb", buffering=0) as f:
        done, i = 0, 0
        while done < size:
            start = (salt * 7919 + i * 4099) % (len(pool) - CHUNK)  # an odd shift: no 4 KiB block repeats
            n = min(CHUNK, size - done)
            f.write(memoryview(pool)[start:start + n])
            done, i = done + n, i + 1
        os.fsync(f.fileno())


def build_root(root: Path, total: int, checkpoints: int, ranks: int) -> list[Path]:
    """Committed checkpoints at steps 100, 200, ...; returns every file a deep verify reads."""
    pool = os.urandom(64 << 20)
    per_file = total // (checkpoints * ranks)
    files = []
    for c in range(checkpoints):
        partial = store.begin(root, (c + 1) * 100)
        records = []
        for rank in range(ranks):  # what each rank does: write its file, fsync, checksum it
            name = f"__{rank}_0.distcp"
            _write_file(partial.path / name, per_file, pool, c * ranks + rank)
            records += store.describe_files(partial.path, [name])
        (partial.path / ".metadata").write_bytes(os.urandom(64 << 10))
        records += store.describe_files(partial.path, [".metadata"])
        final = partial.commit(ranks, records, extra={"tokens_seen": (c + 1) * 100 * 4096})
        files += [final / r.name for r in records]
    return files


def write_run_dir(run_dir: Path, root: Path, ranks: int) -> None:
    """A state.json like a live supervisor's after two restarts (the caller holds the run lock)."""
    now = time.time()
    history = [AttemptRecord(attempt=k, started_at=now - 3600 + 600 * k, resumed_from_step=100 * k or None,
                             world_size=ranks, first_step_at=now - 3590 + 600 * k, ended_at=now - 3100 + 600 * k,
                             reason="worker_signal", detail=f"rank 1 was killed by SIGKILL at step {100 * k + 50}",
                             failed_rank=1, exit_code=-9, step_at_failure=100 * k + 50,
                             last_checkpoint_step=100 * (k + 1), lost_steps=50) for k in range(2)]
    history.append(AttemptRecord(attempt=2, started_at=now - 2400, resumed_from_step=200, world_size=ranks,
                                 first_step_at=now - 2390))
    ranks_now = [{"rank": r, "node": "bench", "pid": 10_000 + r, "step": 412, "phase": "train",
                  "heartbeat_at": now - 0.4, "heartbeat_age_s": 0.4, "alive": True, "steps_per_s": 3.1,
                  "own_steps_per_s": 3.3, "note": None} for r in range(ranks)]
    rec = RunRecord(name="bench", run_dir=str(run_dir), checkpoint_dir=str(root), state=RunState.RUNNING,
                    supervisor={"pid": os.getpid(), "host": "bench"}, attempt=2, restarts=2, max_restarts=10,
                    step=412, last_checkpoint_step=400, ranks=ranks_now, history=history, goodput=0.93,
                    checkpoint_interval={"mode": "fixed", "steps": 100, "why": "job file"})
    state.write(run_dir / "state.json", rec)


# --------------------------------------------------------------------------------------------------
# Page cache


def evict(files: list[Path]) -> None:
    """Drop the files from the page cache (no root needed): fsync, then POSIX_FADV_DONTNEED."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)


def resident_fraction(files: list[Path]) -> float:
    """Share of the files' pages in the page cache, from mincore(2) on a private mapping."""
    total = resident = 0
    for p in files:
        size = p.stat().st_size
        if size == 0:
            continue
        with open(p, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            buf = ctypes.c_char.from_buffer(mm)  # never touched: nothing is faulted in
            try:
                if _libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) != 0:
                    raise OSError(ctypes.get_errno(), "mincore failed")
            finally:
                del buf
            total += pages
            resident += sum(v & 1 for v in vec)
    return resident / total if total else 0.0


def warm(files: list[Path]) -> None:
    plain_read(files)


# --------------------------------------------------------------------------------------------------
# The three ways to read the files


def plain_read(files: list[Path]) -> int:
    """Read every byte like checksum_file does (same chunk, readinto), without hashing."""
    buf = bytearray(CHUNK)
    total = 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := f.readinto(buf):
                total += n
    return total


def checksum_all(files: list[Path]) -> int:
    for p in files:
        store.checksum_file(p)
    return sum(p.stat().st_size for p in files)


def verify_cli(cli: list[str], root: Path) -> int:
    out = run([*cli, "inspect-checkpoint", str(root), "--verify", "--json"])
    doc = json.loads(out)
    bad = [c for c in doc["checkpoints"] if c["status"] != "valid"]
    if not doc["verified"] or bad:
        raise RuntimeError(f"verify did not pass: {bad}")
    return sum(c["size_bytes"] for c in doc["checkpoints"])  # includes the small COMPLETE.json


def run(argv: list[str]) -> str:
    """Run a command to completion (killed on any error or timeout); its stdout."""
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r.stdout


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def measure_verify(files: list[Path], root: Path, cli: list[str], repeat: int) -> dict[str, Any]:
    """GB/s of the three readers, warm and cold, interleaved so drifting load hits all of them."""
    nbytes = sum(p.stat().st_size for p in files)
    readers = {
        "inspect --verify (process)": lambda: verify_cli(cli, root),
        "checksum_file (in-process)": lambda: checksum_all(files),
        "plain read (in-process)": lambda: plain_read(files),
    }
    out: dict[str, Any] = {"bytes": nbytes, "warm": {k: [] for k in readers}, "cold": {k: [] for k in readers},
                           "resident_after_evict": [], "resident_when_warm": []}
    for _ in range(repeat):
        for name, fn in readers.items():
            warm(files)
            out["resident_when_warm"].append(resident_fraction(files))
            out["warm"][name].append(timed(fn)[0])
            evict(files)
            out["resident_after_evict"].append(resident_fraction(files))
            out["cold"][name].append(timed(fn)[0])
    for cache in ("warm", "cold"):
        out[cache] = {k: {"s": v, "gb_per_s": nbytes / 1e9 / statistics.median(v)} for k, v in out[cache].items()}
    return out


# --------------------------------------------------------------------------------------------------
# Light-command latency


def stats_ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(x * 1e3 for x in xs)
    p90 = xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]
    return {"min": xs[0], "median": statistics.median(xs), "p90": p90, "n": len(xs)}


def measure_latency(forms: dict[str, list[str]], run_dir: Path, root: Path, runs: int) -> dict[str, Any]:
    commands = {"--version": ["--version"], "status RUN_DIR": ["status", str(run_dir)],
                "inspect-checkpoint ROOT": ["inspect-checkpoint", str(root)],
                "gc ROOT --keep 2 --dry-run": ["gc", str(root), "--keep", "2", "--dry-run"]}
    cases = {"python -c pass": [sys.executable, "-c", "pass"]}
    for cmd, args in commands.items():
        for form, prefix in forms.items():
            cases[f"{form} {cmd}"] = prefix + args
    for argv in cases.values():  # once untimed: bytecode caches, and a failure shows up before the loop
        run(argv)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(runs):
        for name, argv in cases.items():
            times[name].append(timed(run, argv)[0])
    return {name: stats_ms(xs) for name, xs in times.items()}


def import_profile(argv: list[str]) -> dict[str, Any]:
    """Total import time (sum of self times) and the biggest top-level imports, from -X importtime."""
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    rows = []
    for line in r.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "self [us]" not in line:
            self_us, cum_us, name = line[len("import time:"):].split("|")
            rows.append((int(self_us), int(cum_us), name.rstrip()))
    top = sorted(((cum, name.strip()) for _, cum, name in rows if not name.startswith("  ")), reverse=True)[:6]
    return {"total_ms": sum(s for s, _, _ in rows) / 1e3, "modules": len(rows),
            "imports_torch": any(name.strip() == "torch" for _, _, name in rows),
            "top": [f"{name} {cum / 1e3:.1f} ms" for cum, name in top],
            "names": sorted({name.strip() for _, _, name in rows})}


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=positive_float, default=2.0, help="total checkpoint data, GB (1e9 bytes)")
    p.add_argument("--checkpoints", type=positive_int, default=4, help="checkpoints in the root")
    p.add_argument("--ranks", type=positive_int, default=2, help="data files ('ranks') per checkpoint")
    p.add_argument("--repeat", type=positive_int, default=2, help="passes of each reader, warm and cold")
    p.add_argument("--runs", type=positive_int, default=20, help="fresh processes per light command")
    p.add_argument("--tmp", type=folder, default=None, help="parent of the temp folder (default: the system's)")
    p.add_argument("--out", type=Path, default=RESULTS / "light_commands.json")
    args = p.parse_args(argv)

    script = Path(sys.executable).parent / "resilient"
    if not script.exists():
        p.error(f"{script}: the console script is missing; `pip install -e .` first")
    forms = {"python -m supervisor": [sys.executable, "-m", "supervisor"], "resilient": [str(script)]}

    tmp = Path(tempfile.mkdtemp(prefix="resilient-bench-", dir=args.tmp))
    run_lock = None
    try:
        run_dir = tmp / "run"
        root = run_dir / "checkpoints"
        t_build, files = timed(build_root, root, int(args.gb * 1e9), args.checkpoints, args.ranks)
        run_lock = lock.RunLock(run_dir).acquire()  # status then sees a live supervisor
        write_run_dir(run_dir, root, args.ranks)
        print(f"built {len(files)} files, {sum(f.stat().st_size for f in files) / 1e9:.2f} GB in {t_build:.1f}s "
              f"(write + fsync + checksum) under {tmp}", file=sys.stderr)
        verify = measure_verify(files, root, forms["python -m supervisor"], args.repeat)
        latency = measure_latency(forms, run_dir, root, args.runs)
        imports = {f"{form} {cmd}": import_profile(prefix + extra)
                   for form, prefix in forms.items()
                   for cmd, extra in (("--version", ["--version"]), ("status", ["status", str(run_dir)]))}
    finally:
        if run_lock is not None:
            run_lock.release()
        shutil.rmtree(tmp, ignore_errors=True)

    result = {"args": {k: str(v) for k, v in vars(args).items()}, "python": sys.version.split()[0],
              "cpus": os.cpu_count(), "build_s": t_build, "verify": verify, "latency_ms": latency,
              "imports": {k: {kk: vv for kk, vv in v.items() if kk != "names"} for k, v in imports.items()}}
    startup_s = latency["python -m supervisor inspect-checkpoint ROOT"]["median"] / 1e3
    for cache in ("warm", "cold"):  # the verify process less what the same command costs without --verify
        t = statistics.median(verify[cache]["inspect --verify (process)"]["s"]) - startup_s
        verify[cache]["inspect --verify less process start"] = {"s": [t], "gb_per_s": verify["bytes"] / 1e9 / t}
    a, b = (set(imports[f"{f} --version"]["names"]) for f in forms)
    result["imports_only_in"] = {"python -m supervisor": sorted(a - b), "resilient": sorted(b - a)}
    report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


def report(r: dict[str, Any]) -> None:
    v = r["verify"]
    print(f"\n### Verify throughput ({v['bytes'] / 1e9:.2f} GB, median of {r['args']['repeat']} "
          f"passes; page cache resident after eviction: {max(v['resident_after_evict']):.1%} at most, "
          f"when warm: {min(v['resident_when_warm']):.1%} at least)\n")
    print("| reader | warm GB/s | cold GB/s | warm ÷ plain read | cold ÷ plain read |")
    print("|---|---:|---:|---:|---:|")
    plain = "plain read (in-process)"
    for name in v["warm"]:
        w, c = v["warm"][name]["gb_per_s"], v["cold"][name]["gb_per_s"]
        print(f"| {name} | {w:.2f} | {c:.2f} | {w / v['warm'][plain]['gb_per_s']:.0%} | "
              f"{c / v['cold'][plain]['gb_per_s']:.0%} |")
    lat = r["latency_ms"]
    print(f"\n### Light commands, fresh process each (ms, {next(iter(lat.values()))['n']} runs)\n")
    print("| command | min | median | p90 |")
    print("|---|---:|---:|---:|")
    for name, s in lat.items():
        print(f"| {name} | {s['min']:.0f} | {s['median']:.0f} | {s['p90']:.0f} |")
    print("\n### Imports (-X importtime, one run)\n")
    print("| process | import ms | modules | torch? | biggest top-level imports |")
    print("|---|---:|---:|---|---|")
    for name, s in r["imports"].items():
        print(f"| {name} | {s['total_ms']:.0f} | {s['modules']} | {'yes' if s['imports_torch'] else 'no'} | "
              f"{', '.join(s['top'][:4])} |")
    for form, names in r["imports_only_in"].items():
        print(f"\nonly `{form} --version` imports: {', '.join(names) or 'nothing extra'}")


if __name__ == "__main__":
    sys.exit(main())

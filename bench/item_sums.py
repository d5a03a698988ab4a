"""What the per-item checksums cost (train_entry/storage.py, store.PieceSums): a save sums each item's pieces
beside the file's own hash, a load checks each piece it reads.

    python bench/item_sums.py [--mib 512] [--items-mib 4] [--repeat 5] [--dir /dev/shm]

- write: one rank's file written and hashed as the writer does (fsutil.HashedFile into `--dir`), without and
  with the items' sums fed from the same bytes; CPU seconds of the writing thread (it is the persist thread);
- load: the same bytes read back into a tensor by the loader's readers (storage._Reads, READERS threads), without
  and with each piece checked; wall seconds (several threads), from the page cache / tmpfs, which is where the
  check shows most (a disk's read is slower than the hash).

Best of `--repeat`, interleaved. Prints one table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from argtypes import folder, positive_int


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=positive_int, default=512, help="the rank's file, MiB")
    p.add_argument("--items-mib", type=positive_int, default=4, help="size of each item in it, MiB")
    p.add_argument("--repeat", type=positive_int, default=5)
    p.add_argument("--dir", type=folder, default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = p.parse_args()

    import torch

    from supervisor import store
    from supervisor.fsutil import HashedFile
    from train_entry import storage

    n, item = args.mib << 20, args.items_mib << 20
    data = torch.randint(0, 255, (n,), dtype=torch.uint8)
    view = memoryview(data.numpy())
    items = [(o, min(item, n - o)) for o in range(0, n, item)]
    work = Path(tempfile.mkdtemp(dir=args.dir))
    path = work / "__0_0.distcp"

    def write(summed: bool) -> tuple[float, list[store.PieceSums]]:
        summer = store.PieceSummer(items, storage.PIECE) if summed else None
        f = HashedFile(path, store.hasher())
        cpu = time.thread_time()
        f.write(view, tap=summer.feed if summer else None)
        cpu = time.thread_time() - cpu
        f.close()
        return cpu, summer.sums() if summer else []

    target = torch.empty(n, dtype=torch.uint8)

    def load(sums: list[store.PieceSums] | None) -> float:
        with open(path, "rb", buffering=0) as f:
            reads = storage._Reads()
            t0 = time.perf_counter()
            for k, (offset, length) in enumerate(items):
                reads.read(f, offset, target[offset:offset + length], sums[k] if sums else None, "bench")
            reads.close()
            return time.perf_counter() - t0

    best: dict[str, float] = {}
    try:
        for i in range(args.repeat):
            for summed in (False, True):
                cpu, sums = write(summed)
                best[f"write {summed}"] = min(best.get(f"write {summed}", 1e9), cpu)
            # Alternated: the first load after the write was the slow one (audit 11), which favoured the checked
            # load when it always came second.
            for checked in (False, True) if i % 2 else (True, False):
                wall = load(sums if checked else None)
                best[f"load {checked}"] = min(best.get(f"load {checked}", 1e9), wall)
        assert torch.equal(target, data)
    finally:
        path.unlink(missing_ok=True)
        work.rmdir()
    gib = n / (1 << 30)
    print(f"### Per-item checksums: one rank's file of {args.mib} MiB, items of {args.items_mib} MiB, in "
          f"{work.parent}, {os.cpu_count()} CPUs, best of {args.repeat}\n")
    print("| measure | without | with | cost |\n|---|---:|---:|---:|")
    w0, w1 = best["write False"], best["write True"]
    print(f"| save: the writing thread's CPU | {w0:.3f} s | {w1:.3f} s | {(w1 - w0) / gib:+.3f} s per GiB |")
    r0, r1 = best["load False"], best["load True"]
    print(f"| load: {storage.READERS} readers, wall | {r0:.3f} s ({n / r0 / 1e9:.1f} GB/s) | {r1:.3f} s "
          f"({n / r1 / 1e9:.1f} GB/s) | {(r1 - r0) / gib:+.3f} s per GiB |")


if __name__ == "__main__":
    main()

"""Which checksum for the manifest: throughput of the candidates on one in-memory buffer, best of N
interleaved rounds.

    python bench/checksums.py [--mib 64] [--repeat 5]

Only xxhash is a dependency; crc32c and google-crc32c are measured when installed (pip install crc32c
google-crc32c). The store records the algorithm in each manifest, so a later change stays verifiable.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
import zlib
from collections.abc import Callable

from argtypes import positive_int


def candidates() -> dict[str, Callable[[bytes], object]]:
    import xxhash

    out: dict[str, Callable[[bytes], object]] = {
        "xxh3_128": xxhash.xxh3_128_intdigest,
        "xxh3_64": xxhash.xxh3_64_intdigest,
        "xxh64": xxhash.xxh64_intdigest,
        "zlib.crc32": zlib.crc32,
        "blake2b": lambda b: hashlib.blake2b(b).digest(),
        "sha256": lambda b: hashlib.sha256(b).digest(),
    }
    try:
        import crc32c

        out["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import google_crc32c

        out["google-crc32c"] = google_crc32c.value
    except ImportError:
        pass
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=positive_int, default=64)
    p.add_argument("--repeat", type=positive_int, default=5)
    args = p.parse_args()
    buf = os.urandom(args.mib << 20)
    fns = candidates()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(args.repeat):  # interleaved rounds: a change in machine load hits every candidate alike
        for name, fn in fns.items():
            best[name] = min(best[name], _timed(fn, buf))
    rows = [(len(buf) / t / 1e9, name) for name, t in best.items()]
    print("| checksum | GB/s |\n| --- | --- |")
    for gbs, name in sorted(rows, reverse=True):
        print(f"| {name} | {gbs:.1f} |")


def _timed(fn: Callable[[bytes], object], buf: bytes) -> float:
    t = time.perf_counter()
    fn(buf)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""`python bench/gil_probe.py [BYTES] [DIR]` (1 GiB, the temp folder): which part of a background persist slows a
launch-bound training thread? The main-thread rate of a loop (pure Python, and where CUDA is there, small kernel
launches) alone and beside each job on another thread: hashing 64 MiB chunks (xxhash), writing them with O_DIRECT /
buffered, both. 1.00 = not slowed. On an H100 node (16 cores, xxhash 4.0.1) none of them held the interpreter:
0.91-1.26 for the Python loop and 0.82-0.99 for kernel launches, against 1.12 and 0.76 for the loop alone measured
again after."""
import argparse
import mmap
import os
import sys
import tempfile
import threading
import time

import xxhash

CH = 64 << 20


def _size(text: str) -> int:
    n = int(text)
    if n <= 0 or n % 4096:
        raise argparse.ArgumentTypeError(f"{text}: give a positive multiple of 4096 (O_DIRECT writes whole blocks)")
    return n


p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("bytes", nargs="?", type=_size, default=1 << 30, help="bytes each job hashes or writes (1 GiB)")
p.add_argument("dir", nargs="?", default=tempfile.gettempdir(), help="folder the write jobs write into")
args = p.parse_args()
if not os.path.isdir(args.dir) or not os.access(args.dir, os.W_OK):
    p.error(f"{args.dir}: not a folder this user can write into")
N, d = args.bytes, args.dir
m = mmap.mmap(-1, N)
mv = memoryview(m)
for o in range(0, N, CH):
    mv[o:o + CH] = b"\x01" * min(CH, N - o)
try:
    import torch
    cuda = torch.cuda.is_available()
except ImportError:
    cuda = False
print("xxhash", xxhash.VERSION, "python", sys.version.split()[0], "cuda", cuda, "cores", os.cpu_count(), "dir", d)

def py_loop(stop):
    n = 0
    t = time.perf_counter()
    while not stop.is_set():
        for _ in range(1000):
            n += 1
    return n / (time.perf_counter() - t)

def cuda_loop(stop):
    x = torch.zeros(16, device="cuda")
    n = 0
    torch.cuda.synchronize()
    t = time.perf_counter()
    while not stop.is_set():
        for _ in range(200):
            x.add_(1.0)
        torch.cuda.synchronize()
        n += 200
    return n / (time.perf_counter() - t)

def hash_job():
    h = xxhash.xxh3_128()
    for o in range(0, N, CH):
        h.update(mv[o:o + CH])

def write_job(direct):
    path = os.path.join(d, "gilprobe.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
    try:
        for o in range(0, N, CH):
            os.write(fd, mv[o:o + CH])
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(path)

def both():
    h = xxhash.xxh3_128()
    path = os.path.join(d, "gilprobe.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        for o in range(0, N, CH):
            h.update(mv[o:o + CH])
            os.write(fd, mv[o:o + CH])
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(path)

def measure(loop, job):
    stop = threading.Event()
    rate = []
    t = threading.Thread(target=lambda: rate.append(loop(stop)), daemon=True)
    t.start()
    t0 = time.perf_counter()
    try:
        if job:
            job()
        else:
            time.sleep(1.0)
    finally:  # a failed job stops the loop too (it spun on, a core taken, after an O_DIRECT refusal)
        el = time.perf_counter() - t0
        stop.set()
        t.join()
    return rate[0], el


jobs = [("hash", hash_job), ("write O_DIRECT", lambda: write_job(True)), ("write buffered", lambda: write_job(False)),
        ("hash+write", both)]
for lname, loop in [("python", py_loop)] + ([("cuda launches", cuda_loop)] if cuda else []):
    base, _ = measure(loop, None)
    for name, job in jobs:
        try:
            r, el = measure(loop, job)
        except OSError as e:  # O_DIRECT on tmpfs, a full disk: that job's row says so, the others still run
            print(f"{lname:14s} beside {name:15s} job refused: {e.strerror or e}")
            continue
        print(f"{lname:14s} beside {name:15s} job {el:.3f} s  loop rate {r / base:.2f} of alone")
    again, _ = measure(loop, None)
    print(f"{lname:14s} alone again {again / base:.2f}")

"""argparse types the benchmarks share: a count or size of zero, or a folder that is not there, is a usage line
naming the option, not a ZeroDivisionError or a worker's traceback after minutes of setup."""
from __future__ import annotations

import argparse
import os


def _whole(text: str, least: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"{text} must be ≥ {least}")
    return n


def positive_int(text: str) -> int:
    return _whole(text, 1)


def count(text: str) -> int:
    """A whole number ≥ 0 (0 turning a phase off)."""
    return _whole(text, 0)


def positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not x > 0 or x == float("inf"):  # NaN fails `> 0` too
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return x


def folder(text: str) -> str:
    """A folder that exists and this user can write into (the benchmark makes its temp folders under it)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: no such folder; create it or pick another")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: this user cannot write into it")
    return text

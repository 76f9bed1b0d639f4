"""Argument types shared by the lab's programs: a bad value is argparse's one-line error and exit 2."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An int >= 1 (``--repeats``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def int_list(text: str) -> list[int]:
    """A comma list of ints >= 1 (``--batch 1,8,64``)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints like 1,2,4, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"batch sizes must be ints >= 1, got {text!r}")
    return values

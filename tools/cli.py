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
    """A comma list of ints >= 1 (``--batch 1,8,64``): every item an int (none empty: ``1,,8`` is a typo)."""
    items = [item.strip() for item in text.split(",")]
    for number, item in enumerate(items, 1):
        if not item:
            raise argparse.ArgumentTypeError(f"expected a comma list of ints like 1,2,4, got {text!r} "
                                             f"(item {number} is empty)")
        try:
            int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of ints like 1,2,4, got {text!r} "
                                             f"({item!r} is not an int)") from None
    values = [int(item) for item in items]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"batch sizes must be ints >= 1, got {text!r}")
    return values


def examples(*commands: str) -> str:
    """An argparse ``epilog`` listing example commands (with ``formatter_class=argparse.RawDescriptionHelpFormatter``,
    which keeps its lines as written)."""
    return "examples:\n" + "\n".join(f"  {command}" for command in commands)

"""Argument types and helpers shared by the ``forebay`` command's groups: numbers in
range (one line naming what is wrong), size lists, the progress bar."""

from __future__ import annotations

import argparse
from typing import Any

from .._units import parse_size

__all__ = ["positive_int", "count_int", "positive_float", "nonneg_float", "fraction",
           "sizes_list", "progress"]


def progress():
    from ..progress import TqdmProgress

    return TqdmProgress()


def _number(kind: type, low: float, inclusive: bool, what: str) -> Any:
    """An argparse type: a ``kind`` number above ``low`` (or at it, ``inclusive``)."""
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if v < low or (v == low and not inclusive) or v != v:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return v
    parse.__name__ = what
    return parse


positive_int = _number(int, 0, False, "a positive integer")
count_int = _number(int, 0, True, "an integer >= 0")
positive_float = _number(float, 0.0, False, "a positive number")
nonneg_float = _number(float, 0.0, True, "a number >= 0")


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def sizes_list(text: str) -> list[int]:
    from ..errors import InvalidArgumentError

    out = []
    for t in text.split(","):
        t = t.strip()
        try:
            out.append(0 if t in ("0", "0B") else parse_size(t))
        except argparse.ArgumentTypeError as e:
            raise InvalidArgumentError(f"in {text!r}: {e}") from None
    return out

"""Argument types and helpers shared by the ``forebay`` command's groups: numbers in
range (one line naming what is wrong), size lists, the progress bar."""

from __future__ import annotations

import argparse
from typing import Any

from .._units import parse_size

__all__ = ["positive_int", "count_int", "positive_float", "nonneg_float", "fraction",
           "sizes_list", "progress", "mix_source", "add_mix_args", "mixture_of"]


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


def mix_source(text: str) -> tuple[str, float]:
    """An argparse type: ``SOURCE=WEIGHT`` (the weight a number >= 0)."""
    source, eq, weight = text.rpartition("=")
    if not eq or not source:
        raise argparse.ArgumentTypeError(f"give SOURCE=WEIGHT, got {text!r}")
    try:
        w = float(weight)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the weight {weight!r} is not a number") \
            from None
    if not w >= 0 or w == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the weight must be a number >= 0")
    return source, w


def add_mix_args(p: Any, what: str) -> None:
    """``--mix SOURCE=WEIGHT`` (repeated), ``--mix-policy``, ``--samples-per-epoch``."""
    p.add_argument("--mix", action="append", type=mix_source, metavar="SOURCE=WEIGHT",
                   help=f"a weighted mixture instead of one dataset (repeat per source; "
                        f"{what}); see forebay.Mixture")
    p.add_argument("--mix-policy", default="cycle", choices=["cycle", "stop", "sample"],
                   help="cycle: exact shares, small sources repeat (default); stop: the "
                        "epoch ends at the first exhausted source; sample: by weight, with "
                        "replacement")
    p.add_argument("--samples-per-epoch", type=positive_int, default=None,
                   help="positions per epoch of the mixture (default by policy)")


def mixture_of(a: argparse.Namespace) -> Any:
    """The :class:`~forebay.Mixture` of ``--mix``, or None."""
    if not a.mix:
        if a.samples_per_epoch is not None:
            from ..errors import UsageError

            raise UsageError("--samples-per-epoch is for a mixture (--mix SOURCE=WEIGHT ...)")
        return None
    from ..mixture import Mixture

    return Mixture(a.mix, policy=a.mix_policy, samples_per_epoch=a.samples_per_epoch)


def token_refused(token: "str | None", no_token: bool, command: str) -> bool:
    """A server command without a token (and without ``--no-token``): says why on
    stderr and returns True (the command exits 2)."""
    import sys

    if token or no_token:
        return False
    print(f"{command}: a token is required, even on 127.0.0.1, which every user of this "
          f"node can reach (--token-file or FOREBAY_TOKEN; --no-token to serve anyone)",
          file=sys.stderr)
    return True

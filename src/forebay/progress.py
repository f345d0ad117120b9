"""Progress reporting through a hook (as fsspec's ``Callback``).

Library code never prints: long operations accept ``progress=`` and call it.  The
CLI passes a :class:`TqdmProgress`, which draws a bar only when stderr is a TTY.
"""

from __future__ import annotations

import sys
from typing import Optional

__all__ = ["Progress", "NullProgress", "TqdmProgress", "as_progress"]


class Progress:
    """Base hook: ``start(total, desc)``, ``update(n)``, ``close()``.  Does nothing."""

    def start(self, total: Optional[float], desc: str = "", unit: str = "it") -> None:
        pass

    def update(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


NullProgress = Progress


class TqdmProgress(Progress):
    """Draw a tqdm bar on stderr; silent when stderr is not a terminal unless ``force``."""

    def __init__(self, force: bool = False, unit_scale: bool = True) -> None:
        self._bar = None
        self._enabled = force or sys.stderr.isatty()
        self._unit_scale = unit_scale

    def start(self, total: Optional[float], desc: str = "", unit: str = "it") -> None:
        self.close()
        if self._enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=self._unit_scale,
                             dynamic_ncols=True, leave=False)

    def update(self, n: float = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def as_progress(progress: "Progress | bool | None") -> Progress:
    """Normalize a ``progress=`` argument: a hook, ``True`` (tqdm on a TTY) or ``None``."""
    if progress is None or progress is False:
        return Progress()
    if progress is True:
        return TqdmProgress()
    return progress

"""How transform workers run: ``Pipeline(worker_start=)``'s rule for ``"auto"``
(threads, a fork, or a fork server) and the mark a transform carries when it releases
the GIL."""

from __future__ import annotations

import re
import sys
import threading
from typing import Any, Callable, Optional

from ..errors import InvalidArgumentError
from ._threads import ThreadWorkers
from ._workers import DEFAULT_TIMEOUT_S, WorkerPool, _picklable

__all__ = ["START_METHODS", "choose_start", "fork_hazards", "gil_enabled", "make_workers",
           "releases_gil"]

#: ``Pipeline(worker_start=)``'s choices: ``"auto"`` picks one of the others
START_METHODS = ("auto", "thread", "fork", "forkserver", "spawn")


def releases_gil(fn: Callable) -> Callable:
    """Mark a transform (function or callable object) as spending its time in code
    that releases the GIL (Pillow/libjpeg-turbo decode, numpy, torch tensor ops, zstd):
    ``worker_start="auto"`` then runs it on threads of the training process, which
    start at once and hand batches over without shared memory.  Returns ``fn``;
    forebay's own :class:`DecodeCropFlip` is marked.  A transform whose time goes to
    Python code is better left unmarked (processes)."""
    try:
        fn.releases_gil = True      # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        raise InvalidArgumentError(f"cannot mark {fn!r} (no attributes can be set on it): "
                                   f"wrap it in a function, or pass "
                                   f"Pipeline(worker_start='thread')") from None
    return fn


#: multiprocessing's own helper threads (a Queue's feeder; the resource sharer that
#: hands shared memory's file descriptors to workers, which runs from a process's first
#: such hand-over to its end): both re-initialise their locks in a forked child
_FORK_AWARE = re.compile(r"QueueFeederThread|Thread-\d+ \(_serve\)")


def fork_hazards() -> list[str]:
    """Why forking this process now could leave a worker with a lock another thread
    held at the fork, or a state it cannot use: other Python threads running, a CUDA
    context, MPI initialised.  Empty when a fork is safe.  (Native libraries' thread
    pools, OpenBLAS's and OpenMP's, reset themselves in a forked child.)"""
    out = []
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()
              and not _FORK_AWARE.fullmatch(t.name)]
    if others:
        out.append(f"{len(others)} other Python thread(s) running ({', '.join(others)})")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        out.append("CUDA is initialised")
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        out.append("MPI is initialised")
    return out


def gil_enabled() -> bool:
    """Whether this interpreter runs with the GIL: False only on a free-threaded
    CPython (3.13t and later) that has not turned it back on (``PYTHON_GIL=1``, or a
    module that needs it)."""
    return bool(getattr(sys, "_is_gil_enabled", lambda: True)())


def choose_start(start: str, transform: Optional[Callable], batch_transform: Optional[Callable],
                 collate_fn: Optional[Callable], *, gil: Optional[bool] = None
                 ) -> tuple[str, str]:
    """The workers' start method ``start`` stands for here, and why.  ``"auto"``:
    threads when the transform is marked :func:`releases_gil` or the interpreter runs
    without the GIL (``gil``: None asks it, :func:`gil_enabled`); else processes forked
    from this one when :func:`fork_hazards` finds none (or when the transform cannot
    be pickled: forked anyway, as torch's DataLoader always does); else started from a
    fork server (a clean process that imported torch once, started with the loader)."""
    if start not in START_METHODS:
        raise InvalidArgumentError(f"worker_start must be one of {', '.join(START_METHODS)}; "
                                   f"got {start!r}")
    if start != "auto":
        return start, "asked for"
    stage = transform if transform is not None else batch_transform
    if getattr(stage, "releases_gil", False) is True:
        return "thread", "the transform releases the GIL"
    if not (gil_enabled() if gil is None else gil):
        return "thread", "this Python runs without the GIL (free-threaded)"
    hazards = fork_hazards()
    if not hazards:
        return "fork", "no other thread, CUDA context or MPI in this process"
    stages = (transform, batch_transform, collate_fn)
    if any(f is not None and _picklable(f) is not None for f in stages):
        return "fork", (f"the transform cannot be pickled for a fork server, forked "
                        f"although {'; '.join(hazards)}")
    return "forkserver", "; ".join(hazards)


def make_workers(start: str, workers: int, schema: Any, transform: Optional[Callable],
                 batch_transform: Optional[Callable], collate_fn: Optional[Callable],
                 seed: int, timeout: Optional[float] = DEFAULT_TIMEOUT_S,
                 verify_on_read: bool = False) -> "WorkerPool | ThreadWorkers":
    """The workers of a start method :func:`choose_start` returned."""
    if start == "thread":
        return ThreadWorkers(workers, transform, batch_transform, collate_fn, seed, timeout)
    return WorkerPool(workers, schema, transform, batch_transform, collate_fn, seed,
                      start, timeout=timeout, verify_on_read=verify_on_read)

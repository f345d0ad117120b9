"""Transform workers on threads of the training process (``worker_start="thread"``):
for transforms whose time goes to C code that releases the GIL."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable, Optional

import numpy as np

from ..dataset import SampleBatch
from ._collate import collate_samples
from ._workers import (DEFAULT_TIMEOUT_S, _POLL_S, TransformError, _check_pool_args, _Pending,
                       transform_batch, transform_samples)

__all__ = ["ThreadWorkers"]


class _Parts:
    """One batch transformed in parts, each on the next free thread: the thread that
    finishes the last part collates the samples (in the batch's order) and completes
    :attr:`future`.  ``done``: each part's samples, or a whole batch's result
    (``whole``: a ``batch_transform``); ``running``: the threads on a part now (named
    if it hangs)."""

    def __init__(self, parts: int, whole: bool) -> None:
        self.future: "Future[Any]" = Future()
        self.whole = whole
        self.done: list[Any] = [None] * parts
        self.left = parts
        self.error: Optional[BaseException] = None
        self.running: dict[int, str] = {}
        self.lock = threading.Lock()

    def started(self, part: int) -> None:
        with self.lock:
            self.running[part] = threading.current_thread().name

    def finished(self, part: int, done: Any, error: Optional[BaseException]) -> bool:
        """Record a part; True for the caller that finished the last one."""
        with self.lock:
            self.running.pop(part, None)
            self.done[part] = done
            if error is not None and self.error is None:
                self.error = error
            self.left -= 1
            return self.left == 0


class _ThreadPending(_Pending):
    """A batch on the transform threads (in one part or several)."""

    def __init__(self, pool: "ThreadWorkers", key: tuple[int, int, int], ids: np.ndarray,
                 parts: _Parts) -> None:
        super().__init__(pool, key, -1, ids)
        self.parts = parts

    def result(self) -> Any:
        from concurrent.futures import TimeoutError as FutureTimeout

        timeout = self.pool.timeout
        t0 = None
        while True:
            try:
                return self.parts.future.result(timeout=_POLL_S)
            except FutureTimeout:
                with self.parts.lock:
                    names = sorted(self.parts.running.values())
                if not names:
                    continue          # still queued behind other batches: not its time
                t0 = t0 if t0 is not None else time.monotonic()
                if timeout is not None and time.monotonic() - t0 > timeout:
                    ids = self.ids
                    raise TransformError(
                        f"transform thread {', '.join(names)} returned nothing for "
                        f"{timeout:g} s on the batch of epoch {self.key[1]} step "
                        f"{self.key[2]} (samples {ids[:8].tolist()}"
                        f"{'...' if len(ids) > 8 else ''}): a transform that deadlocked; "
                        f"a thread cannot be stopped, so it is left running; a transform "
                        f"that needs longer: worker_timeout=SECONDS (None: wait forever)"
                    ) from None


class ThreadWorkers:
    """``workers`` threads of the training process applying the transform (or
    ``batch_transform``) and the collation: for transforms that release the GIL
    (:func:`releases_gil`).  They start at once, receive the store's batch as it is
    (no shared memory, no pickling) and hand back what the transform returns.  A
    per-sample ``transform`` runs each batch in ``workers`` parts, one per thread, so
    that a batch is ready as soon as the threads together can make it (the first one
    of an epoch too, with the pipeline empty); the samples and their seeds are the
    same, and a ``batch_transform`` runs whole.  Python's, NumPy's and torch's global
    generators are the training's, left alone, as with ``workers=0``;
    :func:`sample_rng` gives each sample its own (thread-local)."""

    def __init__(self, workers: int, transform: Optional[Callable],
                 batch_transform: Optional[Callable], collate_fn: Optional[Callable],
                 seed: int, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> None:
        from concurrent.futures import ThreadPoolExecutor

        _check_pool_args(workers, timeout)
        self.timeout = timeout
        self.workers = workers
        self._stages = (transform, batch_transform, collate_fn)
        self.seed = seed
        self._ex = ThreadPoolExecutor(workers, thread_name_prefix="forebay-transform")
        self._futures: set[Any] = set()      # of the current pass, not done yet
        self.generation = 0
        self._closed = False

    def _run(self, parts: _Parts, part: int, batch: SampleBatch, start: int, stop: int,
             epoch: int, step: int) -> None:
        parts.started(part)
        done, error = None, None
        try:
            done = transform_batch(batch, *self._stages, self.seed, epoch) if parts.whole \
                else transform_samples(batch, self._stages[0], self.seed, epoch, start, stop)
        except Exception as e:
            error = e
        if parts.finished(part, done, error):
            self._complete(parts, epoch, step)

    def _dropped(self, parts: _Parts, part: int, fut: Any, *, epoch: int, step: int) -> None:
        """A part cancelled before it ran (a new pass, or the workers closed): its
        batch fails, so that nothing waits for it for ever."""
        if fut.cancelled() and parts.finished(part, None, TransformError(
                f"the batch of epoch {epoch} step {step} was dropped before it was made: "
                f"the transform workers were closed, or a new pass began")):
            self._complete(parts, epoch, step)

    def _complete(self, parts: _Parts, epoch: int, step: int) -> None:
        """Collate a batch whose parts are all done (in the thread of the last one)."""
        try:
            if parts.error is not None:
                raise parts.error
            out = parts.done[0] if parts.whole else collate_samples(
                [x for p in parts.done for x in p], self._stages[2])
        except TransformError as e:
            parts.future.set_exception(e)
        except Exception as e:
            err = TransformError(f"batch of epoch {epoch} step {step}: {type(e).__name__}: "
                                 f"{e} (in transform thread "
                                 f"{threading.current_thread().name})")
            err.__cause__ = e
            parts.future.set_exception(err)
        else:
            parts.future.set_result(out)

    def submit(self, epoch: int, step: int, batch: SampleBatch) -> _ThreadPending:
        """Hand a batch to the threads: its parts to the next free ones."""
        if self._closed:
            raise TransformError("the transform workers are closed")
        n, whole = len(batch.ids), self._stages[1] is not None
        k = 1 if whole else max(1, min(self.workers, n))
        parts = _Parts(k, whole)
        bounds = [n * i // k for i in range(k + 1)]
        for i in range(k):
            fut = self._ex.submit(self._run, parts, i, batch, bounds[i], bounds[i + 1],
                                  epoch, step)
            self._futures.add(fut)
            fut.add_done_callback(self._futures.discard)
            fut.add_done_callback(partial(self._dropped, parts, i, epoch=epoch, step=step))
        return _ThreadPending(self, (self.generation, epoch, step), batch.ids, parts)

    def new_pass(self) -> None:
        """A new pass over an epoch: batches of earlier passes not started yet are
        dropped (those running finish, unread)."""
        for f in list(self._futures):
            f.cancel()
        self._futures = set()
        self.generation += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ex.shutdown(wait=False, cancel_futures=True)

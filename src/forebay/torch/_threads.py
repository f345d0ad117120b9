"""Transform workers on threads of the training process (``worker_start="thread"``):
for transforms whose time goes to C code that releases the GIL."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from ..dataset import SampleBatch
from ._workers import (DEFAULT_TIMEOUT_S, _POLL_S, TransformError, _check_pool_args, _Pending,
                       transform_batch)

__all__ = ["ThreadWorkers"]


class _ThreadPending(_Pending):
    """A batch on a transform thread (a future of the pool's executor)."""

    def __init__(self, pool: "ThreadWorkers", key: tuple[int, int, int], ids: np.ndarray,
                 future: Any, where: dict[str, str]) -> None:
        super().__init__(pool, key, -1, ids)
        self.future, self.where = future, where

    def result(self) -> Any:
        from concurrent.futures import TimeoutError as FutureTimeout

        timeout = self.pool.timeout
        t0 = None
        while True:
            try:
                return self.future.result(timeout=_POLL_S)
            except FutureTimeout:
                if "thread" not in self.where:
                    continue          # still queued behind other batches: not its time
                t0 = t0 if t0 is not None else time.monotonic()
                if timeout is not None and time.monotonic() - t0 > timeout:
                    ids = self.ids
                    raise TransformError(
                        f"transform thread {self.where['thread']} returned nothing for "
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
    (no shared memory, no pickling) and hand back what the transform returns.  Python's,
    NumPy's and torch's global generators are the training's, left alone, as with
    ``workers=0``; :func:`sample_rng` gives each sample its own (thread-local)."""

    def __init__(self, workers: int, transform: Optional[Callable],
                 batch_transform: Optional[Callable], collate_fn: Optional[Callable],
                 seed: int, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> None:
        from concurrent.futures import ThreadPoolExecutor

        _check_pool_args(workers, timeout)
        self.timeout = timeout
        self._stages = (transform, batch_transform, collate_fn)
        self.seed = seed
        self._ex = ThreadPoolExecutor(workers, thread_name_prefix="forebay-transform")
        self._futures: set[Any] = set()      # of the current pass, not done yet
        self.generation = 0
        self._closed = False

    def _run(self, batch: SampleBatch, epoch: int, step: int, where: dict[str, str]) -> Any:
        where["thread"] = threading.current_thread().name
        try:
            return transform_batch(batch, *self._stages, self.seed, epoch)
        except TransformError:
            raise
        except Exception as e:
            raise TransformError(f"batch of epoch {epoch} step {step}: {type(e).__name__}: "
                                 f"{e} (in transform thread {where['thread']})") from e

    def submit(self, epoch: int, step: int, batch: SampleBatch) -> _ThreadPending:
        """Hand a batch to the next free thread."""
        if self._closed:
            raise TransformError("the transform workers are closed")
        where: dict[str, str] = {}
        fut = self._ex.submit(self._run, batch, epoch, step, where)
        self._futures.add(fut)
        fut.add_done_callback(self._futures.discard)
        return _ThreadPending(self, (self.generation, epoch, step), batch.ids, fut, where)

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

"""The loader's prefetch thread: batches fetched ahead, in the plan's order, and on into
the next epochs while the training loop is between two (the plan knows them)."""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Any, Callable, Optional

import numpy as np

from ..errors import UsageError

__all__ = ["Prefetcher"]

#: an item handed to the loop: (epoch, step, batch, the fetch's error, staged bytes)
Item = tuple[int, int, Any, Optional[BaseException], int]

#: prefetchers still running: stopped at the interpreter's exit, before MPI finalizes
#: (mpi4py's finalize runs after every atexit function) and before the stores' memory
#: goes, so that a fetch under way, or one going on into an epoch the loop never
#: asked for, does not meet either
_LIVE: "weakref.WeakSet[Prefetcher]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for pf in list(_LIVE):
        pf.stop()


class Prefetcher:
    """One thread fetching ``fetch(ids, epoch, step)`` for the plan's batches
    (``batches_of(epoch)``, ``steps`` each) from
    ``(epoch, start)``: at most ``depth`` batches and (if set) ``budget`` bytes of
    samples wait at a time (always one, however large); a batch leaves the staging area
    when the loop :meth:`take`\\ s it.  With ``last_epoch`` past ``epoch`` it goes on
    into the next epochs' first batches when an epoch's are all fetched, so that the
    loop's next epoch starts with its batches ready; :meth:`next_key` says where the
    loop would pick up, and the owner stops it (:meth:`stop`) when the loop goes
    elsewhere.  A fetch that raises ends the thread; the error reaches the loop with
    its batch."""

    def __init__(self, fetch: Callable[[np.ndarray, int, int], Any],
                 batches_of: Callable[[int], np.ndarray], sample_nbytes: np.ndarray,
                 steps: int, epoch: int, start: int, last_epoch: int, depth: int,
                 budget: Optional[int]) -> None:
        self._fetch, self._batches_of, self._steps = fetch, batches_of, steps
        self._sizes = sample_nbytes
        self._q: "queue.Queue[Item]" = queue.Queue(depth)
        self._stop = threading.Event()
        self._room = threading.Condition()
        self._staged = 0              # bytes of samples fetched and not yet taken
        self._budget = budget
        self.peak = 0
        self.last_epoch = last_epoch
        self._next = (epoch, start)   # the loop's next batch
        self._thread = threading.Thread(target=self._produce, args=(epoch, start),
                                        name="forebay-prefetch", daemon=True)
        _LIVE.add(self)
        self._thread.start()

    def next_key(self) -> tuple[int, int]:
        """(epoch, step) of the batch :meth:`take` returns next (after an epoch's
        last, the next epoch's first)."""
        epoch, step = self._next
        return (epoch + 1, 0) if step >= self._steps else (epoch, step)

    def _produce(self, epoch: int, start: int) -> None:
        while epoch <= self.last_epoch:
            try:
                batches = self._batches_of(epoch)
            except BaseException as e:    # the loop's, at the epoch's first batch
                self._hand(epoch, start, None, e, 0)
                return
            for step in range(start, len(batches)):
                if not self._put(epoch, step, batches[step]):
                    return
            epoch, start = epoch + 1, 0

    def _put(self, epoch: int, step: int, ids: np.ndarray) -> bool:
        """Fetch one batch and queue it; False: stop here."""
        need = int(self._sizes[ids].sum())
        with self._room:  # wait for room, but always let one batch in
            while self._budget is not None and self._staged and \
                    self._staged + need > self._budget and not self._stop.is_set():
                self._room.wait(0.1)
            self._staged += need
            self.peak = max(self.peak, self._staged)
        if self._stop.is_set():
            return False
        try:
            out, err = self._fetch(ids, epoch, step), None
        except BaseException as e:  # handed to the consumer
            out, err = None, e
        self._hand(epoch, step, out, err, need)
        return err is None and not self._stop.is_set()

    def _hand(self, epoch: int, step: int, out: Any, err: Optional[BaseException],
              need: int) -> None:
        """Queue an item for the loop (waiting for room unless stopped)."""
        while not self._stop.is_set():
            try:
                self._q.put((epoch, step, out, err, need), timeout=0.1)
                return
            except queue.Full:
                continue

    def take(self) -> tuple[int, int, Any, Optional[BaseException]]:
        """The next batch (waiting for it): (epoch, step, batch, error).  Raises
        :class:`UsageError` once stopped (the loader closed meanwhile)."""
        while True:
            if self._stop.is_set():
                raise UsageError("the loader was closed while this iteration was paused")
            try:
                epoch, step, out, err, need = self._q.get(timeout=0.1)
                break
            except queue.Empty:
                continue
        with self._room:
            self._staged -= need
            self._room.notify()
        self._next = (epoch, step + 1)
        return epoch, step, out, err

    def stop(self) -> None:
        """Stop fetching (a fetch under way finishes) and drop what waits."""
        self._stop.set()
        self._thread.join()
        _LIVE.discard(self)

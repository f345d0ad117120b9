"""Large reads of the dataset files into memory: pieces of 16 MiB, several in flight
(the device works on a queue), in order of arrival for a caller that publishes how far
it has got.  Used by the distributed store's preload and the clairvoyant store's fill."""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Any, Callable, Optional

import numpy as np

from ..progress import Progress
from ._base import StoreError

__all__ = ["PAR_BLOCK", "read_parallel", "in_pieces"]

#: preload reads: pieces of this size, several in flight (the device works on a queue)
PAR_BLOCK = 16 << 20


def read_parallel(fd: int, dst: np.ndarray, offset: int, path: Any, prog: Progress,
                  threads: int, on_piece: Optional[Callable[[int, int], None]] = None,
                  stop: Optional[threading.Event] = None,
                  wait_turn: Optional[Callable[[int, int], bool]] = None,
                  block: int = PAR_BLOCK) -> None:
    """Read ``len(dst)`` bytes of file ``fd`` from ``offset`` into ``dst``: pieces of
    16 MiB by ``threads`` threads at once (``preadv`` releases the GIL), so the device
    has several requests in flight rather than one sequential stream.  The other
    arguments: :func:`in_pieces`."""
    def read(a: int, k: int) -> None:
        done = 0
        while done < k:
            got = os.preadv(fd, [dst[a + done:a + k].data], offset + a + done)
            if got <= 0:
                raise StoreError(f"{path}: unexpected end of file at byte "
                                 f"{offset + a + done} while preloading")
            done += got

    in_pieces(len(dst), read, prog, threads, on_piece, stop, wait_turn, block)


def in_pieces(n: int, read: Callable[[int, int], None], prog: Progress, threads: int,
              on_piece: Optional[Callable[[int, int], None]] = None,
              stop: Optional[threading.Event] = None,
              wait_turn: Optional[Callable[[int, int], bool]] = None,
              block: int = PAR_BLOCK) -> None:
    """Bytes ``[0, n)`` of something read by ``read(a, k)`` (bytes ``[a, a + k)``;
    a call that releases the GIL) in pieces of ``block`` bytes, ``threads`` at once.
    ``on_piece(a, b)``: called in order as bytes ``[0, b)`` have all arrived (``a``:
    the previous call's ``b``); ``stop``: set, no further piece is started;
    ``wait_turn(a, bytes)``: called before the piece at ``a`` is queued (it may block;
    True: the piece is there already, skip reading it)."""
    from concurrent.futures import ThreadPoolExecutor

    lock = threading.Lock()

    def piece(a: int) -> None:
        k = min(block, n - a)
        read(a, k)
        with lock:
            prog.update(k)

    def landed(a: int) -> None:
        if on_piece is not None:
            on_piece(a, min(a + block, n))

    def there(a: int) -> bool:
        return wait_turn is not None and wait_turn(a, min(block, n - a))

    starts = range(0, n, block)
    if threads <= 1 or n <= block:
        for a in starts:
            skip = there(a)
            if stop is not None and stop.is_set():
                return
            if not skip:
                piece(a)
            landed(a)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="forebay-preload") as ex:
        flight: deque = deque()
        for a in starts:
            skip = there(a)
            if stop is not None and stop.is_set():
                break
            flight.append((a, None if skip else ex.submit(piece, a)))
            if len(flight) >= (threads if wait_turn else 2 * threads):  # a short queue
                a0, f = flight.popleft()
                if f is not None:
                    f.result()
                landed(a0)
        while flight:
            a0, f = flight.popleft()
            if f is not None:
                f.result()
            landed(a0)

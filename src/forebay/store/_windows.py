"""MPI windows as the stores use them: one-sided gets of many byte ranges (one
``MPI_Get`` per target, an hindexed datatype over its ranges), one shared-memory
segment viewed whole, and a window freed only when no view still holds its memory."""

from __future__ import annotations

from typing import Any, Optional

import threading

import numpy as np

from .._liveness import waiting

__all__ = ["rma_get", "rma_get_one", "shared_segment", "free_window", "TargetProgress",
           "target_progress"]

#: MPI windows closed while a view (get_views) still held their memory: never freed
_LENT_WINDOWS: list[Any] = []


def shared_segment(win: Any, comm: Any) -> "Optional[tuple[np.ndarray, np.ndarray]]":
    """View a shared-memory window's whole segment in this process.

    MPI_Win_allocate_shared places the ranks' memory contiguously by default, so one
    uint8 view spans all of it and every byte of every rank has one position in it (a
    batch is then a single gather, whoever owns its samples).  Returns the view and
    where each rank's memory starts in it, or None (on every rank) if some rank's
    memory is not contiguous with the next.  Collective over ``comm``."""
    import ctypes

    from mpi4py import MPI

    bufs = [np.frombuffer(win.Shared_query(m)[0], dtype=np.uint8)
            for m in range(comm.Get_size())]
    addrs = np.array([b.ctypes.data for b in bufs], dtype=np.int64)
    ok = all(addrs[m + 1] == addrs[m] + len(bufs[m]) for m in range(len(bufs) - 1))
    if not comm.allreduce(ok, op=MPI.LAND):
        return None
    total = int(addrs[-1] + len(bufs[-1]) - addrs[0])
    view = np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(int(addrs[0])))
    return view, addrs - addrs[0]


def free_window(win: Any, comm: Any, lent: bool) -> None:
    """End the access epoch and free window ``win`` (collective over ``comm``) unless
    some rank's views still hold its memory (``lent`` on any rank): Free would unmap
    it under them, so the window then stays until MPI_Finalize."""
    from mpi4py import MPI

    win.Unlock_all()
    with waiting("closing a store"):
        lent = comm.allreduce(bool(lent), op=MPI.LOR)
    if lent:
        _LENT_WINDOWS.append(win)
    else:
        win.Free()


_MPI_BYTE: list[Any] = []     # MPI.BYTE, once mpi4py is imported (a one-sample get's cost)


def rma_get_one(win: Any, stage: np.ndarray, target: int, disp: int) -> None:
    """Fetch ``len(stage)`` bytes at ``disp`` of rank ``target``'s window into ``stage``:
    one ``MPI_Get`` and a flush of that target."""
    if not _MPI_BYTE:
        from mpi4py import MPI

        _MPI_BYTE.append(MPI.BYTE)
    nbytes, byte = len(stage), _MPI_BYTE[0]
    if nbytes:
        with waiting("a one-sided get from a peer"):
            win.Get([stage, nbytes, byte], target, (disp, nbytes, byte))
            win.Flush(target)


def rma_get(win: Any, stage: np.ndarray, target: np.ndarray, disp: np.ndarray,
            length: np.ndarray, pos: np.ndarray) -> None:
    """Fetch byte ranges of other ranks' windows into ``stage`` with one ``MPI_Get`` per
    target rank (an hindexed datatype covering all its ranges) and one flush.

    ``target``, ``disp``, ``length``, ``pos``: per range, sorted by target: the rank,
    the displacement in its window, the byte count and where it goes in ``stage``
    (each target's ranges are contiguous in ``stage``, in order)."""
    from mpi4py import MPI

    if len(target) == 1:        # one range (a single-sample read): no grouping, no type
        p0, nbytes = int(pos[0]), int(length[0])
        rma_get_one(win, stage[p0:p0 + nbytes], int(target[0]), int(disp[0]))
        return
    owners, first = np.unique(target, return_index=True)
    ends = np.append(first[1:], len(target))
    types = []
    try:
        for t, a, b in zip(owners.tolist(), first.tolist(), ends.tolist()):
            nbytes = int(length[a:b].sum())
            if nbytes == 0:
                continue
            p0 = int(pos[a])
            if b - a == 1:      # one range: a contiguous get, no datatype to build
                win.Get([stage[p0:p0 + nbytes], nbytes, MPI.BYTE], t,
                        (int(disp[a]), nbytes, MPI.BYTE))
                continue
            dtype = MPI.BYTE.Create_hindexed(length[a:b].tolist(), disp[a:b].tolist()).Commit()
            types.append(dtype)
            win.Get([stage[p0:p0 + nbytes], nbytes, MPI.BYTE], t, [0, 1, dtype])
        with waiting("one-sided gets from peers"):
            win.Flush_all()
    finally:
        for dtype in types:
            dtype.Free()


class TargetProgress:
    """Lets MPI complete other ranks' one-sided gets from this rank's window while this
    rank is busy outside MPI.

    Over a network without hardware RMA (MPICH's OFI tcp provider, for one) a get
    completes only when the target's MPI library makes progress, that is, while the
    target is inside some MPI call.  A rank waiting in a gloo or NCCL all-reduce, or
    computing, makes none: a peer's get from it then waits until it next calls MPI,
    and if that peer's batch is what the all-reduce waits for, forever (seen across
    emulated nodes: one rank in the benchmark's gloo all-reduce after its last batch,
    its peer's RMA get of that batch never completing).  This thread calls
    ``MPI_Iprobe`` on a private duplicate of ``comm`` every millisecond, which drives
    the progress engine (it matches nothing: nobody sends on that communicator).
    Needs MPI_THREAD_MULTIPLE; ``comm.Dup`` and :meth:`close` are collective."""

    def __init__(self, comm: Any, interval: float = 0.001) -> None:
        self._comm = comm.Dup()
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name="forebay-rma-progress",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from mpi4py import MPI

        comm, stop, dt = self._comm, self._stop, self._interval
        while not stop.wait(dt):
            comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)

    def close(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            self._comm.Free()


def target_progress(comm: Any, spans_nodes: bool) -> Optional[TargetProgress]:
    """A :class:`TargetProgress` for an RMA window over ``comm`` when it spans nodes
    (``spans_nodes``, the same on every rank) and MPI lets a thread call it; else None.
    Collective when it makes one."""
    from ..comm import mpi_thread_multiple

    return TargetProgress(comm) if spans_nodes and mpi_thread_multiple() else None

"""A distributed store's background load (``overlap``): each member loads its chunk in
order in a thread and announces how far it has got in a header of its memory; a batch
reads what has arrived from memory and the rest from the dataset files, keeps what it
read for the load to skip, and the load yields to batches reading the files."""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator, Optional

import numpy as np

from ..dataset import IndexLayout, SampleBatch, assemble_batch, gather_ranges
from ..progress import Progress
from ..comm import fence
from ..vocab import Backoff
from .._liveness import waiting
from ._base import StoreError, raise_background_error
from ._pread import PAR_BLOCK, in_pieces, read_parallel
from ._windows import rma_get
from .. import trace as _trace
from . import _tracing as _hooks
from ._dist_state import (_FAILED, _H_LOADED, _H_READ_BYTES, _H_READING, _H_STATE, _HEADER,
                          _LOADED, _LOADING, _QUIET_NS, _READING, _YIELD_BLOCK, StoreState,
                          mask_of)

__all__ = ["BackgroundLoad"]


class BackgroundLoad(StoreState):
    """The overlapped preload of :class:`~forebay.store.DistributedStore`."""

    def _header(self, member: int) -> np.ndarray:
        """Member ``member``'s header (uint8): its own memory, the shared segment, or
        (rma) fetched from the member's window."""
        if member == self.member:
            return self._raw[:_HEADER]
        if self.transport == "rma":
            out = np.zeros(_HEADER, dtype=np.uint8)
            rma_get(self._win, out, np.array([member]), np.zeros(1, dtype=np.int64),
                    np.array([_HEADER]), np.zeros(1, dtype=np.int64))
            return out
        at = int(self._seg_hdr[member])
        return self._segment[at:at + _HEADER]

    def _word(self, member: int, k: int) -> int:
        """Int64 word ``k`` (_H_*) of member ``member``'s header."""
        if self.transport == "rma" and member != self.member:
            from mpi4py import MPI

            out = np.zeros(1, dtype=np.int64)
            with waiting("a read of a peer's load counter"):
                self._win.Fetch_and_op([np.zeros(1, dtype=np.int64), MPI.INT64_T],
                                       [out, MPI.INT64_T], member, 8 * k, MPI.NO_OP)
                self._win.Flush(member)
            self._win.Sync()   # later loads of the member's data see what preceded it
            return int(out[0])
        return int(self._header(member)[8 * k:8 * k + 8].view(np.int64)[0])

    def _start_load(self) -> None:
        """Open the memory to readers (every header says 'nothing loaded'), then load
        this rank's chunk in a thread; readers go to the files for what is missing."""
        if self._win is not None:
            from mpi4py import MPI

            self._win.Lock_all(MPI.MODE_NOCHECK)
            self._win.Sync()
        fence()
        if self.group_comm is not None:
            self.group_comm.Barrier()    # no member reads a header before it is zeroed
        self._known = np.zeros(self.width, dtype=np.int64)
        self._loader = threading.Thread(target=self._load_loop, daemon=True,
                                        name=f"forebay-preload-r{self.rank}")
        self._loader.start()

    def _load_loop(self) -> None:
        state = _LOADED
        try:
            self._load_chunk()
            if self._stop.is_set():
                return                   # closed: nobody reads this memory any more
            self._publish(int(self.layout.nbytes[self.member]))
        except BaseException as e:       # every member's next get_many raises it
            self._load_error = e
            state = _FAILED
            msg = f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:_HEADER - 65]
            self._raw[64:64 + len(msg)] = np.frombuffer(msg, dtype=np.uint8)
        self._set_word(_H_STATE, state)
        self.preload_seconds = time.perf_counter() - self._t0
        if state == _LOADED and self._pages is not None:
            threading.Thread(target=self._map_when_loaded, daemon=True,
                             name=f"forebay-map-r{self.rank}").start()

    def _map_when_loaded(self) -> None:
        """Transport "pages" with an overlapped load: once every member's chunk is
        locked, map the whole dataset into this process here, in the background,
        rather than in the first batch that finds them all loaded (a failed or
        stopped load leaves it to that batch, which raises)."""
        poll = Backoff(first=0.001, cap=0.02)
        while not self._stop.is_set():
            states = [self._word(m, _H_STATE) for m in range(self.width)]
            if _FAILED in states:
                return
            if _LOADING not in states:
                try:
                    self._map_dataset()
                except Exception:  # noqa: BLE001 - a batch maps (and raises) itself
                    pass
                return
            poll.sleep()

    def _publish(self, nbytes: int) -> None:
        """Announce that bytes ``[0, nbytes)`` of this rank's chunk are loaded (and
        checked): the data is visible before the counter that announces it."""
        self._set_word(_H_LOADED, nbytes)

    def _set_word(self, k: int, value: int) -> None:
        """Set this member's header word ``k`` after everything written before it is
        visible (rma: MPI_Win_sync, then an atomic replace readers fetch atomically)."""
        if self.transport != "rma":
            fence()
            self._hdr[k] = value
            return
        from mpi4py import MPI

        self._win.Sync()
        self._win.Accumulate([np.array([value], dtype=np.int64), MPI.INT64_T], self.member,
                             [8 * k, 1, MPI.INT64_T], MPI.REPLACE)
        self._win.Flush(self.member)

    def _load_chunk(self) -> None:
        """Read this rank's chunk in order (pieces of 16 MiB, or 4 MiB when yielding;
        ``read_threads`` in flight), checking the records each piece completes
        (``verify_on_read``) before announcing them."""
        runs = self.layout.runs
        mine = np.flatnonzero(self._mine)
        ends = self.layout.offset[mine] + self.ds.record_nbytes[mine]
        order = np.argsort(ends, kind="stable")
        mine, ends = mine[order], ends[order]
        done = {"checked": 0, "t": 0.0}  # records of ``mine`` announced; piece start
        for k in np.flatnonzero(runs["member"] == self.member).tolist():
            shard, start, length, base = (int(runs["shard"][k]), int(runs["start"][k]),
                                          int(runs["len"][k]), int(runs["base"][k]))
            path = self.ds.path / self.ds.manifest.shards[shard].data
            along = dict(stop=self._stop,
                         on_piece=partial(self._landed, mine, ends, done, path, start, base),
                         wait_turn=partial(self._wait_turn, shard, start, base, mine, ends)
                         if self.yields else None,
                         block=_YIELD_BLOCK if self.yields else PAR_BLOCK)
            done["t"] = time.perf_counter()
            if self._pages is not None:
                in_pieces(length, partial(self._pin_piece, shard, start), Progress(),
                          self.read_threads, **along)   # type: ignore[arg-type]
            else:
                fd = os.open(path, os.O_RDONLY)
                try:
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, start, length, os.POSIX_FADV_SEQUENTIAL)
                    read_parallel(fd, self._buf[base:base + length], start, path,
                                  Progress(), self.read_threads,
                                  **along)   # type: ignore[arg-type]
                finally:
                    os.close(fd)
            if self._stop.is_set():
                return

    def _landed(self, mine: np.ndarray, ends: np.ndarray, done: dict, path: Any, start: int,
                base: int, a: int, b: int) -> None:
        """Bytes ``[a, b)`` of the run at ``base`` (file offset ``start``) arrived, and
        all before them: check the records they complete, report, announce."""
        now = time.perf_counter()
        upto = int(np.searchsorted(ends, base + b, side="right"))
        ids = mine[done["checked"]:upto]
        if self.ds.verify_on_read and len(ids):
            self._check_held(ids)
        if self.on_pfs_read is not None:
            self.on_pfs_read(b - a, len(ids), now - done["t"])
        rec = _trace.active()
        if rec is not None:
            rec.file_reads(path, np.array([start + a]), np.array([b - a]),
                           np.array([done["t"]]), np.array([now - done["t"]]),
                           samples=len(ids))
            rec.span("memstore", "preload", done["t"], now, count=len(ids), nbytes=b - a)
        done["checked"] = upto
        self._publish(base + b)
        done["t"] = time.perf_counter()

    def _wait_turn(self, shard: int, start: int, base: int, mine: np.ndarray,
                   ends: np.ndarray, a: int, length: int) -> bool:
        """Yielding, before the piece ``[a, a + length)`` of the run at ``base`` (file
        offset ``start`` of ``shard``): True if batches have kept all its records
        (nothing to read); else wait until no member's batch has read the files for
        _QUIET_NS, unless the piece is in the page cache (a memory copy, nothing taken
        from the batches)."""
        lo = int(np.searchsorted(ends, base + a, side="right"))
        hi = int(np.searchsorted(ends, base + a + length, side="left")) + 1
        ids = mine[lo:hi]
        ids = ids[self.layout.offset[ids] < base + a + length]
        if len(ids) and (self._kept_flags(ids, np.full(len(ids), self.member)) == 1).all():
            self._kept_skipped += length
            return True
        if not self._yielding or self.ds.cached(shard, start + a, length):
            return False
        poll = Backoff(first=0.001, cap=0.005)
        # over the exchange a member sees (and reads for) its own records only
        members = [self.member] if self.transport in ("exchange", "rma") else \
            range(self.width)
        held = int(self.layout.nbytes[members].sum())
        while not self._stop.is_set():
            # once the batches have read as many bytes from the files as the members
            # watched hold, they are reading again what the load would have brought
            # for good (a first epoch is over): the load stops giving way
            if sum(self._word(m, _H_READ_BYTES) for m in members) >= held:
                self._yielding = False
                return False
            quiet = time.monotonic_ns() - _QUIET_NS
            if all(self._word(m, _H_READING) <= quiet for m in members):
                return False
            poll.sleep()
        return False

    def _ready(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray) -> np.ndarray:
        """Which of samples ``ids`` are in their owners' memory now (overlap), from
        what the members' headers said when :meth:`_loaded_all` just read them."""
        ends = self.layout.offset[ids] + rows[:, IndexLayout.REC_LEN]
        ready = ends <= self._known[member]
        if self.yields and not ready.all():     # what batches read and kept
            late = np.flatnonzero(~ready)
            if self.transport == "rma":         # only this member's flags in reach
                late = late[member[late] == self.member]
            ready[late] = self._kept_flags(ids[late], member[late]) == 1
            fence()   # later loads of those records see what preceded their flags
        return ready

    def _kept_at(self, ids: np.ndarray, member: np.ndarray) -> "tuple[np.ndarray, np.ndarray]":
        """(array, positions) of samples ``ids``' kept flags (their owners' headers)."""
        rel = ids - self.layout.bounds[member] + _HEADER
        if self._segment is not None:           # shm, pages: every member's flags
            return self._segment, self._seg_hdr[member] + rel
        return self._raw, rel

    def _kept_flags(self, ids: np.ndarray, member: np.ndarray) -> np.ndarray:
        buf, pos = self._kept_at(ids, member)
        return buf[pos]

    def _keep(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray,
              dst: np.ndarray, pos: np.ndarray, files: list) -> None:
        """Copy the records a batch read from the files (``files``: its parts, a map,
        record starts and a mask each) to ``dst`` at ``pos``, their owners' chunks (the
        pages are in memory now), and flag them, so the load does not read them again
        and later batches find them there.  Over rma only this member's records: its
        own chunk is ``dst``; a peer's is out of reach (and ``pos`` would be the peer's
        offsets)."""
        kept = []
        for src, rec, m in files:
            if self.transport == "rma":
                own = member[m] == self.member
                rec, m = rec[own], mask_of(len(ids), np.flatnonzero(m)[own])
            gather_ranges(src, rec, rows[m, IndexLayout.REC_LEN], dst, pos[m])
            kept.append(m)
        fence()       # the bytes are visible before the flags that announce them
        sub = np.flatnonzero(np.logical_or.reduce(kept))
        buf, at = self._kept_at(ids[sub], member[sub])
        buf[at] = 1

    def _pin_kept(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray) -> None:
        """Transport "pages": lock the records a batch just read from the files (in the
        page cache now) and flag them in their owners' headers, so their loads skip
        them and later batches count them as held: by the end of a first epoch that
        read every sample the loads have nothing left to read."""
        assert self._pages is not None
        self._pages.pin(ids, rows, advise=np.zeros(len(ids), dtype=bool))
        if self._pages.error:   # not lockable here (a peer's shards: RLIMIT_MEMLOCK):
            return              # their owners' loads lock them
        fence()       # (the flags announce pages that are locked)
        buf, at = self._kept_at(ids, member)
        buf[at] = 1

    def _raise_load_error(self) -> None:
        raise_background_error(self._load_error,
                               f"the background preload of rank {self.rank}")

    def wait_filled(self, timeout: Optional[float] = None) -> bool:
        """With ``overlap``: block until this rank's chunk is loaded (True) or
        ``timeout`` passes (False); a failed load raises its error.  Else True."""
        if self._loader is not None:
            self._loader.join(timeout)
            if self._loader.is_alive():
                return False
        self._raise_load_error()
        return True

    def _loaded_all(self) -> bool:
        """Whether every member's chunk is loaded (overlap), from their headers."""
        if (self._known < self.layout.nbytes).any():
            self._refresh_known()
            if (self._known < self.layout.nbytes).any():
                return False
        self._raise_load_error()
        return True

    def _refresh_known(self) -> None:
        """Read how far the members still loading have got (a failed one fails every
        reader)."""
        if self._load_error is not None:
            self._raise_load_error()
        for m in np.flatnonzero(self._known < self.layout.nbytes).tolist():
            loaded, state = self._word(m, _H_LOADED), self._word(m, _H_STATE)
            fence()   # later loads of the member's data see what preceded its counter
            if state == _FAILED:
                msg = bytes(self._header(m)[64:]).rstrip(b"\0").decode("utf-8", "replace")
                raise StoreError(f"rank {int(self.group_ranks[m])}'s background preload "
                                 f"failed: {msg}")
            self._known[m] = loaded

    def _get_loading(self, ids: np.ndarray, rows: np.ndarray, local: np.ndarray,
                     member: np.ndarray, alloc: Any) -> SampleBatch:
        """get_many while the background preload runs: what has arrived from memory,
        the rest from the dataset files."""
        ready = self._ready(ids, rows, member)
        sub = np.flatnonzero(~ready)
        keep: Callable[[], None]         # what a batch that read the files keeps
        if self._pages is not None:      # every record through the files' maps
            if self.ds.verify_on_read:   # (as a loaded store's batches are)
                self.ds.check_records(ids)
            parts = self.ds.record_parts(ids, rows, advise=~ready)
            keep = partial(self._pin_kept, ids[sub], rows[sub], member[sub])
        else:
            parts, files, src, pos = self._loading_parts(ids, rows, member, local, ready, sub)
            keep = partial(self._keep, ids, rows, member, src, pos, files)
        rec = _trace.active()
        timings: Optional[list[Any]] = [] if rec is not None else None
        reading = self.yields and len(sub) > 0
        nbytes = int(rows[sub, IndexLayout.REC_LEN].sum())
        with self._reading(reading, nbytes):
            batch = assemble_batch(ids, rows, self.ds.schema, self.ds.layout, parts, alloc,
                                   timings=timings)
        if reading:
            keep()
        if len(sub) and self._pages is None:
            # copied out: the map's pages leave this process (the page cache keeps them)
            self.ds.release(ids[sub], rows[sub])
        nlocal = int((local & ready).sum())
        self._fetches["local"] += nlocal
        self._fetches["peer"] += len(ids) - nlocal - len(sub)
        self._fetches["pfs"] += len(sub)
        self._file_bytes += nbytes
        if rec is not None:
            srcs = np.where(local, _hooks.SRC["local"], _hooks.SRC["peer"])
            srcs[sub] = _hooks.SRC["pfs"]
            tiers = np.full(len(ids), _hooks.TIER["memory"])
            tiers[sub] = _hooks.TIER["pfs"]
            owner = np.where(ready, self.group_ranks[member], self.rank)
            tagged = [(sel, t0, t1, srcs, tiers, owner)
                      for (_, _, sel), (t0, t1) in zip(parts, timings or [])]
            _hooks.record_parts(rec, ids, rows[:, IndexLayout.REC_LEN], tagged)
            for (_, _, sel), (t0, t1) in zip(parts, timings or []):
                if not ready[sel].any():          # a part read from the files
                    _hooks.record_pfs(rec, self.ds, ids[sel], rows[sel], t0, t1)
        return batch

    def _loading_parts(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray,
                       local: np.ndarray, ready: np.ndarray, sub: np.ndarray
                       ) -> "tuple[list, list, np.ndarray, np.ndarray]":
        """A batch's parts while the background preload runs (not "pages"): what has
        arrived from the members' memory, ``sub`` (not ready) from the files.  Returns
        the parts, those of them read from the files, and where the records go in
        their owners' memory (source, positions)."""
        if self.transport == "shm":
            src, pos = self._segment, self._seg_pos[ids]
        else:
            src, pos = self._buf, self.layout.offset[ids]
        parts: list = []
        if (local & ready).any():
            parts.append((src, pos[local & ready], local & ready))
        peer = ~local & ready
        if peer.any():       # rma: one MPI_Get per owner; else the memory in reach
            parts.append(self._staged(ids, rows, member, peer) if self.transport == "rma"
                         else (src, pos[peer], peer))
        files = []                       # the parts read from the dataset files
        if len(sub):
            if self.ds.verify_on_read:
                self.ds.check_records(ids[sub])
            for buf, starts, sel in self.ds.record_parts(ids[sub], rows[sub]):
                files.append((buf, starts, mask_of(len(ids), sub[sel])))
        return parts + files, files, src, pos

    @contextmanager
    def _reading(self, active: bool, nbytes: int) -> Iterator[None]:
        """While a batch of this member reads ``nbytes`` from the files (``active``:
        when the load yields), its header says so: the background load waits."""
        if not active:
            yield
            return
        self._hdr[_H_READING] = _READING
        try:
            yield
        finally:
            self._hdr[_H_READING] = time.monotonic_ns()
        self._hdr[_H_READ_BYTES] += nbytes

    def _own_ready(self, want: np.ndarray) -> np.ndarray:
        """Which of this member's samples ``want`` are in its chunk now (exchange with
        an overlapped load): announced by its load, or kept there by a batch."""
        loaded = int(self._hdr[_H_LOADED])
        fence()                # later loads of the chunk see what preceded the counter
        ready = self.layout.offset[want] + self.ds.record_nbytes[want] <= loaded
        if self.yields and not ready.all():
            late = np.flatnonzero(~ready)
            ready[late] = self._kept_flags(want[late], np.full(len(late), self.member)) == 1
            fence()            # later loads of those records see what preceded their flags
        return ready

    def _file_reads(self, want: np.ndarray):
        """Samples ``want`` read from the dataset files (checked with verify_on_read):
        (source, record starts, lengths, positions in ``want``) per shard."""
        if not len(want):
            return
        if self.ds.verify_on_read:
            self.ds.check_records(want)
        rows = self.ds.rows(want)
        every = np.arange(len(want))
        for buf, starts, sel in self.ds.record_parts(want, rows):
            yield buf, starts, rows[sel, IndexLayout.REC_LEN], every[sel]

    def _stop_loading(self) -> None:
        """End the background preload (after the piece it is reading)."""
        self._stop.set()
        if self._loader is not None and self._loader is not threading.current_thread():
            self._loader.join()

"""A clairvoyant store's fill and exact presence: threads fill this rank's tiers in
the placement's order, in chunks claimed position by position (a batch that needs a
position first loads it itself), publish a fill counter after each, and a reader knows
from its owner's counter (and state bytes) exactly which samples are there."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, Optional

import numpy as np

from .._liveness import waiting
from ..dataset import IndexLayout, PackedDataset, gather_ranges, prefix_fingerprint
from ..errors import InvalidArgumentError
from ..vocab import Backoff
from ..comm import fence
from ._base import raise_background_error
from ._placement import RAM
from ._windows import rma_get
from .. import trace as _trace
from . import _tracing as _hooks
from ._clair_state import (ClairState, _CHUNK_BYTES, _CHUNK_SAMPLES, _DONE, _EMPTY, _HEADER,
                          _PAGES_CHUNK_BYTES, _PAGES_CHUNK_SAMPLES, _WRITING)

__all__ = ["ClairFill"]


class ClairFill(ClairState):
    """The fill threads and presence of :class:`~forebay.store.ClairvoyantStore`."""

    def _files_for(self, ids: np.ndarray) -> PackedDataset:
        """The dataset whose files give samples ``ids`` now: with a node cache, its
        copy once the records are there (kept by an earlier job, or read from the
        dataset's files and kept now; each checked), else the dataset's own files
        (the cache's cap reached)."""
        if self.cache is not None and self.cache.ensure(np.asarray(ids, dtype=np.int64)):
            return self.cache.dataset
        return self.ds

    def _record_parts(self, ids: np.ndarray, rows: np.ndarray, populate: bool = False,
                      advise: Optional[np.ndarray] = None):
        """Parts for assemble_batch / gathers that read records from the dataset."""
        return self._files_for(ids).record_parts(ids, rows, populate=populate, advise=advise)

    def _done_at(self, lpos: np.ndarray) -> np.ndarray:
        if len(self._state) == 0:
            return np.zeros(len(lpos), dtype=bool)
        return (lpos >= 0) & (self._state[np.maximum(lpos, 0)] == _DONE)

    def _with_cache(self, ram_tier: str, warm_files: Any) -> "tuple[str, Any]":
        """``ram_tier`` and ``warm_files`` as a node cache leaves them: the RAM tier a
        copy (the files' pages would be the dataset's, not the cache's), nothing warmed
        (the cache is node-local already)."""
        if self.cache is None:
            return ram_tier, warm_files
        if ram_tier == "pages":
            raise InvalidArgumentError("ram_tier='pages' holds the dataset files' pages; "
                                       "with a node cache the tier is a copy")
        return "copy", False

    def _check_grown_from(self, old: Any) -> None:
        """``grown_from`` is an open store of the same ranks over the first generations
        of this store's dataset."""
        if old is None:
            return
        k = len(old.ds.manifest.shards)
        if old._closed or old.world != self.world or len(old.ds) >= len(self.ds) or \
                prefix_fingerprint(old.ds.manifest.shards) != \
                prefix_fingerprint(self.ds.manifest.shards[:k]):
            raise InvalidArgumentError(f"grown_from must be an open store over the first "
                                       f"generations of {self.ds.path} on the same ranks "
                                       f"({old!r})")

    def _keep_from(self, old: Any) -> int:
        """Copy into this rank's tiers, before any fill, the samples it will hold that
        ``old`` (the store over the dataset's first generations this one grows from)
        holds in its own tiers, and mark them done: the fill threads then read only the
        rest.  Tiers held in the files' pages are left to the fill (the page cache has
        them).  Returns the samples copied."""
        ids = self.fill_order
        if not len(ids) or old is None:
            return 0
        pos = np.arange(len(ids))
        lpos = np.full(len(ids), -1, dtype=np.int64)
        inside = ids < len(old.local_pos)
        lpos[inside] = old.local_pos[ids[inside]]
        held = old._done_at(lpos)
        sizes = self.ds.record_nbytes[ids]
        copied = np.zeros(len(ids), dtype=bool)
        for dbuf, dsel in self._dest(pos):
            for sbuf, ssel in old._dest(np.maximum(lpos, 0)):
                m = dsel & ssel & held
                if dbuf is None or sbuf is None or not m.any():
                    continue
                gather_ranges(sbuf, old.local_off[ids[m]], sizes[m], dbuf,
                              self.local_off[ids[m]])
                copied |= m
        self._sync()      # the data is visible before its state says done
        with self._done_cv:
            self._state[pos[copied]] = _DONE
            self._done_cv.notify_all()
        self._advance()
        return int(copied.sum())

    def _claim(self, pos: np.ndarray) -> np.ndarray:
        """Claim tier positions for writing; returns which ones this caller got."""
        with self._lock:
            free = self._state[pos] == _EMPTY
            self._state[pos[free]] = _WRITING
        return free

    def _read_into_tier(self, ids: np.ndarray, rows: np.ndarray, pos: np.ndarray,
                        mapped: bool = False) -> None:
        """Copy records from the dataset files to positions ``pos`` of this rank's
        tiers, or read them into the page cache and lock them there (a PFS read)."""
        t0 = time.perf_counter()
        dst = self.local_off[ids]
        for buf, tsel in self._dest(pos):
            if buf is None:
                self._pin(ids[tsel], rows[tsel], mapped)
                continue
            # pread: the kernel copies from its page cache into the tier; mapping the
            # files instead cost a page fault per 64 KiB read and an unmap after (so the
            # node did not hold each filled sample twice): 2-3x the CPU of the copy
            files_ds = self._files_for(ids[tsel])
            if int(np.count_nonzero(tsel)) > 1:
                # every record asked for at once (WILLNEED) before the preads: one
                # pread at a time waited, record by record, behind the fill's read-ahead
                # in the file system's queue (a cold batch the reader loaded itself took
                # 1.5 s on a throttled file system, 64 reads of 20-30 ms each).  The
                # fill's chunks too: _read_ahead asked for the next chunk in order, not
                # for one the fill jumped to ahead of a reader (asking only for the
                # batches' loads here: cold epoch 2.40-2.47 s against 2.26-2.36)
                files_ds.record_parts(ids[tsel], rows[tsel])
            files_ds.read_records(ids[tsel], rows[tsel], buf, dst[tsel])
            if files_ds.verify_on_read:   # checked once, as it enters the tier
                files_ds.check_records(ids[tsel], buf, dst[tsel],
                                       where=f"(read into rank {self.rank}'s tier)")
        nbytes = int(rows[:, IndexLayout.REC_LEN].sum())
        t1 = time.perf_counter()
        if self.on_pfs_read is not None and len(ids):
            self.on_pfs_read(nbytes, len(ids), t1 - t0)
        rec = _trace.active()
        if rec is not None:
            _hooks.record_pfs(rec, self.ds, ids, rows, t0, t1)
        with self._lock:
            self.pfs_reads += len(ids)
            self.pfs_bytes += nbytes

    def _pin(self, ids: np.ndarray, rows: np.ndarray, mapped: bool = False) -> None:
        """Read samples ``ids`` into the page cache and lock them there (the RAM tier
        held in the files' pages).  Pages that cannot be locked stay cached unlocked,
        with one warning: the data is the files' either way, only its presence in
        memory is no longer certain."""
        assert self._pages is not None
        self._pages.pin(ids, rows, advise=np.zeros(len(ids), dtype=bool) if mapped else None)
        if self._pages.error and not self._pin_warned:
            self._pin_warned = True
            warnings.warn(f"rank {self.rank}: the RAM tier's pages could not be locked in "
                          f"memory ({os.strerror(self._pages.error)}): they stay in the page "
                          f"cache unlocked, where the kernel may drop them and a later read "
                          f"goes to the files again (raise `ulimit -l`, or "
                          f"ram_tier='copy')", RuntimeWarning, stacklevel=2)

    def _load(self, ids: np.ndarray, pos: np.ndarray, wait: float,
              rows: Optional[np.ndarray] = None, mapped: bool = False) -> None:
        """Write claimed positions ``pos`` (samples ``ids``, index rows ``rows``) of this
        rank's tiers, then mark them done.  Extra copies come from their owner's tier
        when it has them (waiting up to ``wait`` s for an owner still filling), so the
        PFS serves each sample once; everything else is read from the dataset files.
        ``mapped``: a batch has just read them (cached: not asked for again)."""
        rows = self.ds.rows(ids) if rows is None else rows
        extra = self._is_extra[pos]
        paged = self._paged(ids)
        if paged is not None:   # (a peer's RAM tier is the files' pages: read from them)
            extra &= ~paged
        from_peer = np.zeros(len(ids), dtype=bool)
        if extra.any():
            from_peer[extra] = self._present(ids[extra], wait=wait)
        if from_peer.any():
            dst = self.local_off[ids]
            for src, rec, sel in self._peer_parts(ids, rows, from_peer):
                for buf, tsel in self._dest(pos[sel]):
                    idx = np.flatnonzero(sel)[tsel]
                    gather_ranges(src, rec[tsel], rows[idx, IndexLayout.REC_LEN], buf, dst[idx])
        rest = ~from_peer
        self._read_into_tier(ids[rest], rows[rest], pos[rest], mapped)
        self._sync()  # the data is visible before its state says done
        with self._done_cv:
            self._state[pos] = _DONE
            self._fill_from_peers += int(from_peer.sum())
            self._done_cv.notify_all()

    def _next_chunk(self, key: str, hi: int) -> Optional[tuple[int, int]]:
        """The next chunk [a, b) of the fill order below ``hi`` for cursor ``key``
        (``_chunk_end``)."""
        with self._lock:
            a = self._cursor[key]
            # a reader that caught up loads what it needs itself: the fill jumps ahead
            # of it (two batches) rather than race it for the same chunk; whatever it
            # jumped over that no reader took is filled at the end (_fill_holes)
            ahead = self._need_front + 2 * self.plan.batch_size
            if key != "now" and a <= self._need_front < hi:
                a = min(hi, max(a, ahead))
            if a >= hi:
                self._cursor[key] = a
                return None
            b = self._cursor[key] = self._chunk_end(a, hi)
        return a, b

    def _chunk_limits(self, a: int) -> tuple[int, int]:
        """(samples, bytes) a fill chunk starting at fill position ``a`` holds at most."""
        if self._pages is not None and a < self._R:
            return _PAGES_CHUNK_SAMPLES, _PAGES_CHUNK_BYTES
        return _CHUNK_SAMPLES, _CHUNK_BYTES

    def _chunk_end(self, a: int, hi: int) -> int:
        """Where a chunk of the fill order starting at ``a`` ends (below ``hi``, within
        ``_chunk_limits``, never mixing tiers or coverage and extra copies)."""
        most, nbytes = self._chunk_limits(a)
        b = min(hi, a + most)
        cum = np.cumsum(self._sizes[self.fill_order[a:b]])
        b = a + max(1, int(np.searchsorted(cum, nbytes, side="right")))
        return min(b, int(self._bounds[np.searchsorted(self._bounds, a, side="right")]))

    def _fill_chunks(self, key: str, hi: int) -> None:
        """Fill chunks from cursor ``key`` until ``hi`` (one of possibly several
        threads on the same cursor)."""
        order = self.fill_order
        while not self._stop.is_set():
            chunk = self._next_chunk(key, hi)
            if chunk is None:
                return
            a, b = chunk
            self._read_ahead(b, hi)
            t0 = time.perf_counter()
            peers0 = self._fill_from_peers
            got = self._fill_positions(np.arange(a, b))
            if got is None:
                return
            rec = _trace.active()
            if rec is not None:
                rec.span("cache", "fill", t0, time.perf_counter(), count=int(got.sum()),
                         nbytes=int(self._sizes[order[a:b][got]].sum()),
                         args={"tier": "ram" if a < self._R else "ssd",
                               "from_peers": self._fill_from_peers - peers0, "filled": b})

    def _read_ahead(self, b: int, hi: int) -> None:
        """Ask the kernel for the records of the chunk after this one now (WILLNEED),
        so the files' reads stay in flight while this chunk is read and written: a fill
        thread otherwise left the device idle between its chunks (a cold epoch 0.85-0.9x
        of direct reads', which keep their next batch's reads in flight).  Extra copies
        (read from their owner's tier) are not asked for; a chunk a batch takes instead
        is read either way."""
        if b >= hi or self._is_extra[b]:
            return
        ids = self.fill_order[b:self._chunk_end(b, hi)]
        self.ds.record_parts(ids, self.ds.rows(ids))

    def _wait_done(self, pos: np.ndarray, timeout: Optional[float] = None) -> bool:
        """Wait until positions ``pos`` of this rank's tiers are done (written by this
        rank's reader or fill threads); False if the store stops or ``timeout`` passes."""
        with self._done_cv:
            return self._done_cv.wait_for(
                lambda: self._stop.is_set() or bool((self._state[pos] == _DONE).all()),
                timeout) and not self._stop.is_set()

    def _fill_positions(self, pos: np.ndarray) -> Optional[np.ndarray]:
        """Load the fill positions ``pos`` nobody claimed yet, wait for those a reader
        is writing, publish the prefix; which ones this thread loaded (None: the store
        stopped)."""
        got = self._claim(pos)
        self._load(self.fill_order[pos[got]], pos[got], wait=self.peer_wait)
        if not self._wait_done(pos):
            return None
        self._advance()
        return got

    def _fill_holes(self, lo: int, hi: int) -> None:
        """Fill positions in [lo, hi) the fill jumped over and no reader took, wait
        for those a reader is still writing, and publish the whole prefix."""
        while not self._stop.is_set():
            with self._lock:
                holes = np.flatnonzero(self._state[lo:hi] != _DONE) + lo
            if not len(holes):
                self._advance()
                return
            if self._fill_positions(holes[:self._chunk_limits(int(holes[0]))[0]]) is None:
                return

    def _advance(self) -> None:
        """Publish the longest complete prefix of the fill order (chunks finish out of
        order when several threads fill)."""
        with self._publish_lock:
            a = count = self._filled
            n = len(self._state)
            while count < n:  # in windows: each call costs the new prefix plus 4 KiB
                todo = self._state[count:count + 4096] != _DONE
                if todo.any():
                    count += int(np.argmax(todo))
                    break
                count += len(todo)
            if count > a:
                self._publish(count)

    def fill_now(self, limit: Optional[int] = None) -> int:
        """Fill (more of) this rank's tiers in the calling thread; returns samples filled.

        Positions a reader already cached (it needed them first) are skipped; positions
        a reader is writing are waited for, so the published counter never covers a
        sample that is not fully written."""
        start = self._filled
        end = len(self.fill_order) if limit is None else min(len(self.fill_order),
                                                               start + limit)
        with self._lock:
            self._cursor["now"] = start
        self._fill_chunks("now", end)
        return self._filled - start

    def _sync(self) -> None:
        if self._win is not None:
            self._win.Sync()
        elif self._node_seg is not None:
            fence()

    def _publish(self, count: int) -> None:
        """Make the filled bytes visible, then move the counter (never the reverse)."""
        if self._win is not None:
            from mpi4py import MPI

            self._win.Sync()
            self._win.Accumulate([np.array([count], dtype=np.int64), MPI.INT64_T], self.rank,
                                 [0, 1, MPI.INT64_T], MPI.REPLACE)
            self._win.Flush(self.rank)
        else:
            fence()     # the data is visible before the counter that announces it
            self._counter[0] = count
        self._filled = count

    def _fill_loop(self, tier: str, hi: int) -> None:
        try:
            if tier == "ram" and self._pages is not None and self._warm is not None:
                # the batches read from the files either way: the fill's reads wait for
                # the warm-up's sequential ones instead of competing with them, one
                # small request per sample, on a file system bound by requests per second
                self._warm.join()
            self._fill_chunks(tier, hi)
            self._fill_holes(0 if tier == "ram" else self._R, hi)
        except BaseException as e:  # surfaced by the next get_many
            self._fill_error = e

    @property
    def filled(self) -> int:
        """Samples of this rank's fill order already in its tier."""
        return self._filled

    def wait_filled(self, timeout: Optional[float] = None) -> bool:
        """Block until this rank's tiers are full (True) or ``timeout`` passes (False);
        a fill thread that died raises :class:`StoreError` naming its error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._raise_fill_error()
        if any(t.is_alive() for t in self._threads):
            return False
        return self._filled == len(self.fill_order) or bool(self._threads)

    def _raise_fill_error(self) -> None:
        if self._warm is not None:
            self._warm.check()
        raise_background_error(self._fill_error, f"the fill thread (after filling "
                               f"{self._filled} of {len(self.fill_order)} samples)")

    def _peer_parts(self, ids: np.ndarray, rows: np.ndarray, sel: np.ndarray,
                    lend: bool = False):
        """[(src, record starts, mask)]: where the selected samples' records are in
        their owners' tiers: RAM through the mapped shared segment or staged with
        MPI_Get, SSD through the owner's file mapped here."""
        p = self.placement
        parts = []
        ram = sel & (p.tier[ids] == RAM)
        if ram.any():
            o = p.owner[ids[ram]].astype(np.int64)
            disp = self._base[o] + self.cov_off[ids[ram]]
            if self.transport == "shm" and self._segment is not None:
                seg = self._lent("segment") if lend else self._segment
                parts.append((seg, self._seg_base[o] + disp, ram))
            else:
                ln = rows[ram, IndexLayout.REC_LEN]
                srt = np.argsort(o, kind="stable")
                pos = np.empty(len(o), dtype=np.int64)
                pos[srt] = np.cumsum(ln[srt]) - ln[srt]
                stage = np.empty(int(ln.sum()), dtype=np.uint8)
                t0 = time.perf_counter()
                rma_get(self._win, stage, o[srt], disp[srt], ln[srt], pos[srt])
                rec = _trace.active()
                if rec is not None:
                    rec.span("memstore", "get", t0, time.perf_counter(), count=len(o),
                             nbytes=len(stage), args={"owners": len(np.unique(o))})
                stage.flags.writeable = not lend        # views own it
                parts.append((stage, pos, ram))
        ssd = sel & ~ram
        for o in np.unique(p.owner[ids[ssd]]).tolist():
            m = ssd & (p.owner[ids] == o)
            parts.append((self._peer_ssd(o), self.cov_off[ids[m]], m))
        return parts

    def _present(self, ids: np.ndarray, wait: float = 0.0) -> np.ndarray:
        """Which ids are complete in their owner's tier (owner != this rank), refreshing
        a cached counter only when it no longer suffices; polls up to ``wait`` s."""
        if self._win is None and self._node_seg is None:
            return np.zeros(len(ids), dtype=bool)
        p = self.placement
        owner, tier = p.owner[ids], p.tier[ids]
        # position in the owner's fill order: its RAM order, then its SSD order
        slots = p.slot[ids] + np.where(tier == RAM, 0, self._R_all[np.maximum(owner, 0)])
        # a peer's SSD tier is readable only on its node (the file, mapped here)
        cand = (owner >= 0) & (owner != self.rank) & ((tier == RAM) | (self.transport == "shm"))
        if not cand.any():
            return np.zeros(len(ids), dtype=bool)
        deadline = time.perf_counter() + wait
        poll = Backoff(first=0.001, cap=0.004)
        while True:
            for o in np.unique(owner[cand]).tolist():
                sel = cand & (owner == o)
                if self._known[o] <= slots[sel].max():
                    self._known[o] = self._peer_counter(o)
            ok = cand & (slots < self._known[np.maximum(owner, 0)])
            late = cand & ~ok
            if late.any() and self._segment is not None:
                # shm: an owner's reader may have cached it ahead of the fill; its state
                # byte says so (set only after the data was written and synced)
                o = owner[late].astype(np.int64)
                flags = self._segment[self._seg_base[o] + _HEADER + slots[late]]
                ok[np.flatnonzero(late)[flags == _DONE]] = True
                self._sync()
            if ok.sum() == cand.sum() or time.perf_counter() >= deadline or self._stop.is_set():
                return ok
            poll.sleep()

    def _peer_counter(self, rank: int) -> int:
        if self._node_seg is not None:
            at = int(self._seg_base[rank])
            count = int(self._segment[at:at + 8].view(np.int64)[0])
            fence()     # later loads of the peer's data see what preceded the counter
            return count
        from mpi4py import MPI

        result = np.zeros(1, dtype=np.int64)
        with waiting("a read of a peer's fill counter"):
            self._win.Fetch_and_op([np.zeros(1, dtype=np.int64), MPI.INT64_T],
                                   [result, MPI.INT64_T], rank, 0, MPI.NO_OP)
            self._win.Flush(rank)
        self._win.Sync()  # later loads of the peer's data see what preceded the counter
        return int(result[0])

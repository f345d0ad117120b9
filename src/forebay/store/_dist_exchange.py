"""The ``exchange`` transport of a distributed store: each batch is one collective of the
replica group (an all-gather of the ids, skipped when the plan says what every member
asks, and one all-to-all of the records), so it runs on any communicator,
torch.distributed included."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..dataset import gather_ranges
from ..comm import allgather_array, alltoall_bytes
from .._liveness import waiting
from ._base import StoreError
from ._dist_state import StoreState, mask_of

__all__ = ["ExchangeTransport"]


class ExchangeTransport(StoreState):
    """The exchange transport of :class:`~forebay.store.DistributedStore`."""

    def _exchange(self, ids: np.ndarray, rows: np.ndarray, member: np.ndarray,
                  local: np.ndarray, requests: "Optional[list[np.ndarray]]"
                  ) -> "tuple[list, Optional[np.ndarray]]":
        """The ``exchange`` transport's collective: every member of the replica group
        sends each other member the records of its request that it owns (in the order
        asked), with one all-gather of the ids (skipped when ``requests`` says what
        every member asks) and one all-to-all whose sizes both ends compute from the
        index.  While an overlapped preload runs, a member reads from the files what
        it has not loaded yet (to send, or for itself), and the members agree on how
        the loads stand before sending.  Returns assemble_batch parts and which of
        ``ids`` were read from the files (None: none could be).  ``rows``: the ids'
        index rows."""
        gc = self.group_comm
        reclen = self.ds.record_nbytes
        asked = allgather_array(gc, ids) if requests is None else requests
        cat = np.concatenate(asked)
        by = np.repeat(np.arange(self.width), [len(a) for a in asked])
        if len(cat) and (cat.min() < 0 or cat.max() >= len(self.ds)):
            raise StoreError("a peer asked for a sample id outside the dataset")
        mine = (self.layout.member[cat] == self.member) & (by != self.member)
        sids, to = cat[mine], by[mine]
        slen = reclen[sids]
        send = np.empty(int(slen.sum()), dtype=np.uint8)
        sent_at = np.cumsum(slen) - slen
        parts: list = []
        files = None
        if self._group_loaded:
            gather_ranges(self._buf, self.layout.offset[sids], slen, send, sent_at)
            if local.any():
                parts.append((self._buf, self.layout.offset[ids[local]], local))
        else:
            parts, files = self._exchange_loading(ids, rows, local, sids, slen, send,
                                                  sent_at)
        send_counts = np.bincount(to, weights=slen, minlength=self.width).astype(np.int64)
        remote = ~local
        rlen, rmember = reclen[ids[remote]], member[remote]
        order = np.argsort(rmember, kind="stable")
        stage_pos = np.empty(len(rlen), dtype=np.int64)
        stage_pos[order] = np.cumsum(rlen[order]) - rlen[order]
        recv_counts = np.bincount(rmember, weights=rlen, minlength=self.width).astype(np.int64)
        stage = alltoall_bytes(gc, send, send_counts, recv_counts)
        if remote.any():
            parts.append((stage, stage_pos, remote))
        return parts, files

    def _exchange_loading(self, ids: np.ndarray, rows: np.ndarray, local: np.ndarray,
                          sids: np.ndarray, slen: np.ndarray, send: np.ndarray,
                          sent_at: np.ndarray) -> "tuple[list, np.ndarray]":
        """The exchange's reads while overlapped loads run: this member's records that
        its load has announced from memory, the rest from the files (checked with
        ``verify_on_read``), into ``send`` and the local parts; then one all-gather of
        every member's state, so a failed load (or a failed read) raises on every member
        before anyone waits in the all-to-all, and once every load is done later
        batches skip all this.  Returns the local parts and which of ``ids`` were read
        from the files."""
        err: Optional[BaseException] = None
        parts: list = []
        files_mask = np.zeros(len(ids), dtype=bool)
        try:
            self._raise_load_error()
            off, nb = self.layout.offset, self.ds.record_nbytes
            mine = np.flatnonzero(local)
            ready_s, ready_l = self._own_ready(sids), self._own_ready(ids[mine])
            late_s, late_l = np.flatnonzero(~ready_s), mine[~ready_l]
            gather_ranges(self._buf, off[sids[ready_s]], slen[ready_s], send, sent_at[ready_s])
            if ready_l.any():
                m = mask_of(len(ids), mine[ready_l])
                parts.append((self._buf, off[ids[m]], m))
            nbytes_s, nbytes_l = int(slen[late_s].sum()), int(nb[ids[late_l]].sum())
            reading = self.yields and (len(late_s) + len(late_l)) > 0
            with self._reading(reading, nbytes_s + nbytes_l):
                for buf, starts, lens, k in self._file_reads(sids[late_s]):
                    gather_ranges(buf, starts, lens, send, sent_at[late_s[k]])
                files = [(buf, starts, mask_of(len(ids), late_l[k]))
                         for buf, starts, _, k in self._file_reads(ids[late_l])]
            if reading:        # kept in this member's chunk: the load skips them
                own = np.full(len(sids), self.member)
                self._keep(sids, self.ds.rows(sids), own, self._buf, off[sids],
                           [(send, sent_at[late_s], mask_of(len(sids), late_s))])
                if files:
                    self._keep(ids, rows, np.full(len(ids), self.member), self._buf,
                               off[ids], files)
            parts += files
            files_mask[late_l] = True
            self._served_from_files[0] += len(late_s)
            self._served_from_files[1] += nbytes_s
            self._fetches["local"] -= len(late_l)
            self._fetches["pfs"] += len(late_l)
            self._file_bytes += nbytes_l
        except Exception as e:  # noqa: BLE001 - raised below, on every member
            err = e
        done = err is None and self._loader is not None and not self._loader.is_alive()
        with waiting("the exchange's agreement on the loads"):
            states = self.group_comm.allgather(
                [bool(done), None if err is None else f"{type(err).__name__}: {err}"])
        if err is not None:
            raise err
        failed = [(r, msg) for r, (_, msg) in enumerate(states) if msg]
        if failed:
            r, msg = failed[0]
            raise StoreError(f"rank {int(self.group_ranks[r])}'s background preload (or a "
                             f"read of its records from the files) failed: {msg}")
        self._group_loaded = all(d for d, _ in states)
        return parts, files_mask

"""A clairvoyant store's ``exchange`` transport: each batch one collective in which
owners say what they hold, requesters what they still want, and the owners send the
records both said yes to; the collective ends once every rank's tiers hold what it
will read."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..dataset import gather_ranges
from ..comm import allgather_array, alltoall_bytes
from .._intervals import positions_in_runs
from ._base import StoreError
from ._clair_state import ClairState

__all__ = ["ClairExchange"]


class ClairExchange(ClairState):
    """The exchange transport of :class:`~forebay.store.ClairvoyantStore`."""

    def _exchange(self, ids: np.ndarray, want: np.ndarray,
                  requests: "Optional[list[np.ndarray]]") -> tuple[np.ndarray, list]:
        """The ``exchange`` transport's collective (every rank, every call).  First one
        small all-to-all both ways: an owner tells each requester which of the samples
        it asked for (and the owner holds) its tiers hold now, and a requester tells
        each owner which of them it still wants (not those its own tiers hold as extra
        copies); then the owners send the records both said yes to (one all-to-all).
        Returns which of ``ids`` arrived, and the assemble_batch part holding them."""
        comm, world, p = self.comm, self.world, self.placement
        reclen = self.ds.record_nbytes
        if requests is None:
            requests = allgather_array(comm, ids)
        cat = np.concatenate(requests)
        by = np.repeat(np.arange(world), [len(r) for r in requests])
        if len(cat) and (cat.min() < 0 or cat.max() >= len(self.ds)):
            raise StoreError("a peer asked for a sample id outside the dataset")
        # asked of this rank (grouped by requester, as ``cat`` is)
        mine = (p.owner[cat] == self.rank) & (by != self.rank)
        sids, to = cat[mine], by[mine]
        lp = self.local_pos[sids]
        have = (lp >= 0) & ((lp < self._filled) | self._done_at(lp))
        # asked by this rank, grouped by owner, in request order
        owner = p.owner[ids].astype(np.int64)
        ask = np.flatnonzero((owner >= 0) & (owner != self.rank))
        ask = ask[np.argsort(owner[ask], kind="stable")]
        n_to = np.bincount(to, minlength=world)             # peers' asks of this rank
        n_ask = np.bincount(owner[ask], minlength=world)    # this rank's asks of each
        # to rank r: whether this rank is self-sufficient, r's asks' presence bytes,
        # then this rank's want bytes for its asks of r; from r: the same, reversed
        peers = np.flatnonzero(np.arange(world) != self.rank)
        count = n_to + n_ask
        count[peers] += 1
        start = np.cumsum(count) - count
        # where each ask of this rank's and each ask of a peer's is, in either message
        to_at = start[to] + 1 + positions_in_runs(n_to)
        oa = owner[ask]
        ask_at = start[oa] + 1 + positions_in_runs(n_ask)
        flags = np.empty(int(count.sum()), dtype=np.uint8)
        alone = self._self_sufficient()
        flags[start[peers]] = alone
        flags[to_at] = have
        wanted = want[ask]
        flags[ask_at + n_to[oa]] = wanted
        back = alltoall_bytes(comm, flags, count, count)
        held = back[ask_at].astype(bool)
        sent = have & back[to_at + n_ask[to]].astype(bool)
        # the records both sides said yes to, in the same order
        send_ids, send_lp = sids[sent], lp[sent]
        slen = reclen[send_ids]
        send = np.empty(int(slen.sum()), dtype=np.uint8)
        dst = np.cumsum(slen) - slen
        off = self.local_off[send_ids]
        ram = send_lp < self._R
        tiers = [(self._ssd, ~ram)]
        if self._pages is None:
            tiers.append((self._buf, ram))
        elif ram.any():
            # the RAM tier is the files' pages (locked): sent from the dataset's maps
            at = np.flatnonzero(ram)
            for src, rec, sel in self._record_parts(send_ids[at], self.ds.rows(send_ids[at]),
                                                    advise=np.zeros(len(at), dtype=bool)):
                gather_ranges(src, rec, slen[at][sel], send, dst[at][sel])
        for buf, tier in tiers:
            if tier.any():
                gather_ranges(buf, off[tier], slen[tier], send, dst[tier])
        got = ask[held & wanted]
        glen = reclen[ids[got]]
        stage = alltoall_bytes(comm, send,
                               np.bincount(to[sent], weights=slen, minlength=world),
                               np.bincount(owner[got], weights=glen, minlength=world))
        pos = np.full(len(ids), -1, dtype=np.int64)
        pos[got] = np.cumsum(glen) - glen
        use = pos >= 0
        with self._lock:
            self._exchange_sent += int(len(send_ids))
            self._exchange_rounds += 1
            # every rank said so in this same round: none calls the exchange again
            self._exchange_ended = alone and bool(back[start[peers]].all())
        return use, ([(stage, pos[use], use)] if use.any() else [])

    def _self_sufficient(self) -> bool:
        """Whether this rank's tiers are full and hold every sample its plan reads (it
        will never want a peer's record again)."""
        if self._filled < len(self.fill_order):
            return False
        if self._covers_plan is None:
            reads = np.flatnonzero(self.plan.frequencies(self.rank) > 0)
            self._covers_plan = bool((self.local_pos[reads] >= 0).all())
        return self._covers_plan

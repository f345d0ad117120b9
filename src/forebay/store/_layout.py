"""Where every record of a distributed store lives: the replica group's chunks, balanced
by bytes, and each record's offset in its owner's memory.  A pure function of the
dataset index and the width, computed alike on every rank (and by the simulator)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dataset import ALIGNMENT, IndexLayout, PackedDataset
from ..errors import InvalidArgumentError

__all__ = ["StoreLayout", "chunk_members", "align_up"]


def align_up(n: np.ndarray | int) -> Any:
    return n + (-n) % ALIGNMENT


def chunk_members(span: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous chunks of samples balanced by bytes: member p of a replica group holds
    samples ``[bounds[p], bounds[p+1])``.  Returns ``(bounds, member of each sample)``.
    Shared by the store and the simulator (forebay-preload)."""
    n = len(span)
    cum = np.concatenate([[0], np.cumsum(span)])
    targets = cum[-1] * np.arange(width + 1) / width
    bounds = np.searchsorted(cum, targets, side="left").astype(np.int64)
    bounds[0], bounds[-1] = 0, n
    bounds = np.maximum.accumulate(bounds)
    member = (np.searchsorted(bounds, np.arange(n), side="right") - 1).astype(np.int64)
    return bounds, member


class StoreLayout:
    """Where every record lives: chunk (group member) and byte offset in its buffer.

    Computed identically on every rank from the dataset index and ``width``.  Records
    keep their 64-byte alignment: the bytes of each run of consecutive samples of one
    shard are copied verbatim (padding included), runs placed at aligned offsets.

    ``segments`` (a dataset that grew, issue U): the sample counts at which the store
    grew, ascending, the last the dataset's size; each segment's samples are chunked
    over the members on their own, and a member's buffer holds its chunk of each
    segment after those of the earlier ones.  So the layout of the first segments is
    the layout the store had before it grew: what a member held stays where it was.
    """

    def __init__(self, ds: PackedDataset, width: int,
                 segments: "tuple[int, ...] | None" = None) -> None:
        idx = ds.index
        n = len(ds)
        self.segments = tuple(segments) if segments else (n,)
        if list(self.segments) != sorted(set(self.segments)) or self.segments[-1] != n or \
                self.segments[0] <= 0:
            raise InvalidArgumentError(f"segments {self.segments} must grow to the "
                                       f"dataset's {n} samples")
        rec_off = idx[:, IndexLayout.REC_OFF]
        rec_len = idx[:, IndexLayout.REC_LEN]
        shard = ds.shard_of.astype(np.int64)
        span = align_up(rec_len)
        self.width = width
        self.member = np.empty(n, dtype=np.int64)
        #: member p holds samples [bounds[p], bounds[p+1]) of the last segment (of the
        #: only one, for a store that never grew)
        self.bounds = np.zeros(width + 1, dtype=np.int64)
        first = 0
        for end in self.segments:
            bounds, member = chunk_members(span[first:end], width)
            self.member[first:end] = member
            self.bounds = bounds + first
            first = end
        segment = np.searchsorted(np.asarray(self.segments), np.arange(n), side="right")
        # runs: consecutive samples with the same (segment, member, shard)
        change = np.ones(n, dtype=bool)
        if n > 1:
            change[1:] = (self.member[1:] != self.member[:-1]) | (shard[1:] != shard[:-1]) | \
                (segment[1:] != segment[:-1])
        run_first = np.flatnonzero(change)
        run_last = np.append(run_first[1:], n) - 1
        run_of = np.cumsum(change) - 1
        run_start = rec_off[run_first]
        run_len = rec_off[run_last] + rec_len[run_last] - run_start
        run_member = self.member[run_first]
        run_span = align_up(run_len)
        # base of each run within its member's buffer: exclusive cumsum per member, the
        # runs in (member, segment) order
        order = np.argsort(run_member, kind="stable")
        spans = run_span[order]
        cum = np.cumsum(spans) - spans
        sm = run_member[order]
        run_base = np.empty_like(run_span)
        run_base[order] = cum - cum[np.searchsorted(sm, sm, side="left")]
        #: byte offset of each record in its owner's buffer
        self.offset = run_base[run_of] + rec_off - run_start[run_of]
        self.nbytes = np.bincount(run_member, weights=run_span, minlength=width).astype(np.int64)
        #: each member's bytes of the segments before the last (what it held before the
        #: store grew: the first bytes of its buffer)
        before = segment[run_first] < len(self.segments) - 1
        self.held_before = np.bincount(run_member[before], weights=run_span[before],
                                       minlength=width).astype(np.int64)
        self.runs = {"member": run_member, "shard": shard[run_first], "start": run_start,
                     "len": run_len, "base": run_base, "count": run_last - run_first + 1,
                     "segment": segment[run_first]}

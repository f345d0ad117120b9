"""The recorder's event rows: their layout, kinds and the names of sources and tiers,
shared by the recorder that fills them and the writer that turns them into DFTracer
lines."""

from __future__ import annotations

import numpy as np

from ..vocab import Source

__all__ = ["EVENT", "NCOLS", "SOURCES", "TIERS", "K_SPAN", "K_ITEM", "K_FILE", "K_META",
           "KIND", "NAME", "CAT", "TID", "TS", "DUR", "A"]

#: one recorded event: a row of 12 int64 (kind, name, cat, tid, ts, dur, a0..a5); ts and
#: dur hold the bits of float64 perf_counter seconds (converted when written); ``a``
#: holds kind-specific integers (-1: absent)
NCOLS = 12
KIND, NAME, CAT, TID, TS, DUR, A = 0, 1, 2, 3, 4, 5, 6
EVENT = np.dtype("<i8")

#: a span: a = (args index, epoch, step, count, bytes, -1)
K_SPAN = 0
#: a sample fetched (``data/item``): a = (image_idx, image_size, epoch, step, owner_rank,
#: source | tier << 4 | hit << 8)
K_ITEM = 1
#: a read of a dataset file (``reader/read``): a = (file, offset, size, epoch, step,
#: records covered)
K_FILE = 2
#: a metadata record written with the events (``dataset``): a = (args index, ...)
K_META = 3

#: where a sample came from, as the loader's ``stats()["fetches_by_source"]`` names it
SOURCES = tuple(s.value for s in Source)
#: which storage held it
TIERS = ("ram", "ssd", "pfs", "memory")

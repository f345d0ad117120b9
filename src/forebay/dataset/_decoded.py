"""A decompressed copy of a dataset with compressed fields, made once per node: what
the stores' tiers hold is the form of the dataset they are given, so a job that
would rather spend memory than CPU gives them this copy (issue S, item 2).

The copy is an ordinary forebay dataset (format version 1, its own checksums, over
the decompressed records) under ``INTO/decompressed-<source fingerprint>``: made by
the first process of a node that asks for it, while the others wait on a lock; the
others, and later jobs, open it.  A changed source has another fingerprint, so
another copy: a stale one is never read.  Every record of the source is checked
against its checksum while it is copied."""

from __future__ import annotations

import os
from pathlib import Path
import numpy as np

from .._fs import Flock
from ..errors import CorruptDatasetError, UsageError
from ..progress import Progress, as_progress
from ._concat import ConcatDataset
from ._reader import PackedDataset, open_dataset
from ._schema import KIND_BYTES
from ._writer import DatasetWriter

__all__ = ["decompressed", "value_nbytes"]

#: records decompressed per batch while copying
_BATCH_BYTES = 64 << 20
#: what the copy's manifest says it was made from
FROM_KEY = "decompressed_from"


def decompressed(dataset: "PackedDataset | str | os.PathLike[str]",
                 into: "str | os.PathLike[str]", *,
                 progress: "Progress | bool | None" = None) -> PackedDataset:
    """``dataset`` with its compressed fields decompressed, as a copy under the
    directory ``into`` (node-local storage: a node's SSD or scratch), made there once
    and reused by every later call, in this job or another, while the source is
    unchanged.  A store given the copy holds decompressed records in its tiers (more
    memory, no decompression per batch); given the source, it holds the compressed
    ones.  A dataset without compressed fields is returned as is.

    Safe to call from every rank of a job at once: on each node the first makes the
    copy and the others wait for it (an ``flock``, released by the kernel if the
    process dies; a copy is whole or absent).  Every record is checked against its
    checksum as it is read; the copy has checksums of its own.  A mixture's sources are
    decompressed one by one (``Mixture({decompressed(p, into).path: w, ...})``).
    """
    if isinstance(dataset, ConcatDataset):
        raise UsageError("decompressed() takes one dataset: decompress a mixture's sources "
                         "one by one, Mixture({str(decompressed(path, into).path): weight})")
    src = dataset if isinstance(dataset, PackedDataset) else open_dataset(dataset)
    if not src.layout.coded:
        return src
    root = Path(into)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"decompressed-{src.fingerprint}"
    with Flock(root / f".decompressed-{src.fingerprint}.lock"):
        if not target.exists():
            _write_copy(src, target, as_progress(progress))
        copy = open_dataset(target)
    _check_copy(src, copy)
    return copy


def _write_copy(src: PackedDataset, target: Path, progress: Progress) -> None:
    """Every sample of ``src``, checked and decompressed, written to ``target``."""
    checked = src if src.verify_on_read else src.reopened(verify_on_read=True)
    # batches of about _BATCH_BYTES decompressed (a larger sample: a batch of its own)
    cum = np.cumsum(value_nbytes(src) + 1)
    ends = np.searchsorted(cum, np.arange(_BATCH_BYTES, int(cum[-1]), _BATCH_BYTES),
                           side="right")
    ends = np.unique(np.append(ends[ends > 0], len(src)))
    as_bytes = [f.name for f in src.schema.fields if f.kind == KIND_BYTES]
    progress.start(len(src), "decompress", unit="samples")
    with DatasetWriter(target, metadata={**src.metadata, FROM_KEY: {
            "path": str(src.path), "fingerprint": src.fingerprint}}) as w:
        first = 0
        for end in ends.tolist():
            for sample in checked.get_many(np.arange(first, end)):
                w.add({k: v.data if k in as_bytes else v for k, v in sample.items()})
            progress.update(end - first)
            first = end
    progress.close()


def _check_copy(src: PackedDataset, copy: PackedDataset) -> None:
    """The copy at the source's fingerprint is that source's, decompressed (the
    directory is the user's: something else may have been put there)."""
    made = copy.metadata.get(FROM_KEY)
    want = tuple(f.name for f in src.schema.fields), tuple(f.dtype for f in src.schema.fields)
    got = tuple(f.name for f in copy.schema.fields), tuple(f.dtype for f in copy.schema.fields)
    if not isinstance(made, dict) or made.get("fingerprint") != src.fingerprint or \
            len(copy) != len(src) or got != want or copy.layout.coded or \
            not np.array_equal(copy.sample_nbytes, value_nbytes(src)):
        raise CorruptDatasetError(f"{copy.path} is not a decompressed copy of {src.path} "
                                  f"(fingerprint {src.fingerprint}): remove it and call "
                                  f"again")


def value_nbytes(ds: PackedDataset) -> np.ndarray:
    """Each sample's bytes as its values hold them (a compressed field's decompressed
    size: its shape's product times its itemsize), int64."""
    lay, idx = ds.layout, ds.index
    total = np.zeros(len(ds), dtype=np.int64)
    for k, (_, dtype, shape) in enumerate(lay.fields):
        total += (np.prod(idx[:, shape], axis=1) * dtype.itemsize if k in lay.coded
                  else idx[:, int(lay.nbytes_cols[k])])
    return total

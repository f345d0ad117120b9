"""The first generations of a dataset that grows, read as a dataset of their own: what
every rank of a job agreed to read (issue U: a distributed store that follows appends
holds exactly these samples on every rank, whatever later generations some rank
already sees)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Sequence

from ..errors import InvalidArgumentError
from ._format import Manifest, ShardInfo, checksum
from ._reader import PackedDataset

__all__ = ["PrefixDataset", "prefix_fingerprint"]


def prefix_fingerprint(shards: Sequence[ShardInfo]) -> str:
    """The fingerprint of a dataset's first ``shards``: the same in every later
    generation (appends add shards and never change one)."""
    return checksum(json.dumps([[s.data_checksum, s.index_checksum, s.num_samples]
                                for s in shards]).encode())


class PrefixDataset(PackedDataset):
    """The first ``samples`` of the dataset at ``path``, which must end a generation
    (a shard boundary); its :attr:`fingerprint` is the prefix's, the same whichever
    later generations the directory holds when it is opened."""

    def __init__(self, path: "str | os.PathLike[str]", samples: int, *,
                 verify_on_read: bool = False, readahead: str = "record") -> None:
        self.path = Path(path)
        full = Manifest.read(self.path)
        count, k = 0, 0
        while count < samples and k < len(full.shards):
            count += full.shards[k].num_samples
            k += 1
        if count != samples or samples <= 0:
            raise InvalidArgumentError(f"{self.path}: its first {samples} samples do not end "
                                       f"a generation (it holds {full.num_samples})")
        shards = full.shards[:k]
        manifest = dataclasses.replace(full, num_samples=samples, shards=shards,
                                       fingerprint=prefix_fingerprint(shards))
        self._open(manifest, verify_on_read, readahead)
        self.manifest = dataclasses.replace(manifest,
                                            payload_nbytes=int(self.sample_nbytes.sum()))

    @property
    def locator(self) -> Any:
        return str(self.path)          # ids below len(self) are the same samples there

    def reopened(self, *, verify_on_read: bool) -> "PrefixDataset":
        return PrefixDataset(self.path, len(self), verify_on_read=verify_on_read,
                             readahead=self.readahead)

    def __repr__(self) -> str:
        return (f"PrefixDataset({str(self.path)!r}, samples={len(self)} of a growing "
                f"dataset, fields=[{self.schema.describe()}])")

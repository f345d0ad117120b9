"""Several packed datasets read as one, without copying: a mixture's sources."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Sequence

from ..errors import InvalidArgumentError, SchemaError
from ._format import Manifest, checksum
from ._reader import PackedDataset, open_dataset

__all__ = ["ConcatDataset", "open_locator"]


class ConcatDataset(PackedDataset):
    """Several packed datasets with one schema read as one (a :class:`forebay.Mixture`'s
    sources): ids ``0 .. n0-1`` are the first source's samples, ``n0 ..`` the second's,
    and so on.  Nothing is copied: the sources' shards are mapped where they are.

    :attr:`path` is the first source's directory (messages about a shard name the
    shard's own file); :attr:`paths` all of them; :attr:`fingerprint` changes when any
    source or their order does."""

    def __init__(self, paths: "Sequence[str | os.PathLike[str]]", *,
                 verify_on_read: bool = False, readahead: str = "record") -> None:
        if isinstance(paths, (str, os.PathLike)) or not len(paths):
            raise InvalidArgumentError("a concatenation needs a list of dataset directories")
        self.paths = tuple(Path(p) for p in paths)
        manifests = [Manifest.read(p) for p in self.paths]
        first = manifests[0].schema
        for p, m in zip(self.paths[1:], manifests[1:]):
            if m.schema != first:
                raise SchemaError(f"{p} has fields [{m.schema.describe()}], "
                                  f"{self.paths[0]} [{first.describe()}]: the sources of a "
                                  f"mixture must have the same fields, dtypes and ranks")
        shards = tuple(dataclasses.replace(s, data=str((p / s.data).absolute()),
                                           index=str((p / s.index).absolute()))
                       for p, m in zip(self.paths, manifests) for s in m.shards)
        self.part_sizes = tuple(m.num_samples for m in manifests)
        self.part_fingerprints = tuple(m.fingerprint for m in manifests)
        combined = Manifest(
            num_samples=sum(self.part_sizes), schema=first, shards=shards,
            payload_nbytes=sum(m.payload_nbytes for m in manifests),
            metadata={"sources": [str(p) for p in self.paths]}, created_by="forebay concat",
            fingerprint=checksum(json.dumps(self.part_fingerprints).encode()))
        self.path = self.paths[0]
        self._open(combined, verify_on_read, readahead)

    @property
    def locator(self) -> Any:
        return tuple(str(p) for p in self.paths)

    def reopened(self, *, verify_on_read: bool) -> "ConcatDataset":
        return ConcatDataset(self.paths, verify_on_read=verify_on_read,
                             readahead=self.readahead)

    def __repr__(self) -> str:
        return (f"ConcatDataset({[str(p) for p in self.paths]!r}, samples={len(self)}, "
                f"fields=[{self.schema.describe()}])")


def open_locator(locator: Any, *, verify_on_read: bool = False,
                 readahead: str = "record") -> PackedDataset:
    """A dataset from its :attr:`PackedDataset.locator`: a directory, or a tuple of
    them (a :class:`ConcatDataset`)."""
    if isinstance(locator, tuple):
        return ConcatDataset(locator, verify_on_read=verify_on_read, readahead=readahead)
    return open_dataset(locator, verify_on_read=verify_on_read, readahead=readahead)

"""WebDataset tar shards: members grouped into samples by key, as webdataset does."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ...errors import SourceError
from ._base import Source, check_keys, list_files, register_source

__all__ = ["WebDatasetSource"]

#: webdataset's own decoders for these extensions give an integer (ASCII text)
INT_EXTENSIONS = ("cls", "cls2", "index", "inx", "id")


def split_name(name: str) -> tuple[str, str]:
    """webdataset's rule: the key is the path up to the first dot of its last
    component, the field the rest ("a/b/x.seg.png" -> ("a/b/x", "seg.png"))."""
    d, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{d}/{stem}" if d else stem), ext.lower() if dot else ""


def _value(ext: str, data: bytes, where: str) -> Any:
    if ext in INT_EXTENSIONS:
        try:
            return np.int64(int(data.decode("ascii").strip()))
        except (UnicodeDecodeError, ValueError, OverflowError):
            raise SourceError(f"{where}: .{ext} should hold an integer as text (webdataset's "
                              f"convention), got {data[:20]!r}") from None
    if ext == "npy":
        try:
            return np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise SourceError(f"{where}: not a NumPy array without pickles ({e})") from None
    return data


@register_source
class WebDatasetSource(Source):
    """WebDataset shards: one ``.tar`` (``.tar.gz``, ``.tgz``) or a directory of them
    (sorted by path), each shard a unit read in parallel.  Consecutive members sharing
    a key (``dir/name`` before the first dot of the file name) form a sample, each
    member a field named by the rest of its name (``jpg``, ``seg.png``, ``json``).
    Fields keep their bytes (images stay encoded), except what webdataset itself
    decodes to a number (``cls``, ``cls2``, ``index``, ``inx``, ``id``: int64) and
    ``npy`` (the array; pickles refused).  Every sample must have every field
    (``keys`` selects some); members that are not regular files are refused."""

    kind = "webdataset"
    unit_name = "shard"

    def __init__(self, root: "str | os.PathLike[str]", *, keys: Optional[Sequence[str]] = None,
                 follow_links: bool = False, **unused: Any) -> None:
        self.files = [p for p in list_files(root, [".tar", ".tgz", ".gz"], "WebDataset tar",
                                            follow_links)
                      if p.name.endswith((".tar", ".tar.gz", ".tgz"))]
        if not self.files:
            raise SourceError(f"{root}: no .tar shards")
        self.keys = list(keys) if keys else None
        # the fields: those of the first shard's first sample (checked for every sample)
        first = self._samples(self.files[0], limit=1)
        if not first:
            raise SourceError(f"{self.files[0]}: no samples")
        self.fields = check_keys(sorted(first[0]), self.keys, str(self.files[0]))

    def _samples(self, path: Path, limit: Optional[int] = None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        key: Optional[str] = None
        cur: dict[str, Any] = {}
        try:
            with tarfile.open(path, "r:*") as tar:
                for m in tar:
                    if m.isdir():
                        continue
                    where = f"{path}: member {m.name!r}"
                    if not m.isfile():
                        raise SourceError(f"{where} is a link or a device, not a file "
                                          f"(refused)")
                    k, ext = split_name(m.name)
                    if k != key:
                        if cur:
                            out.append(cur)
                            if limit is not None and len(out) >= limit:
                                return out
                        key, cur = k, {}
                    if ext in cur:
                        raise SourceError(f"{where}: sample {k!r} has two .{ext} members")
                    fh = tar.extractfile(m)
                    assert fh is not None
                    cur[ext] = _value(ext, fh.read(), where)
        except (tarfile.TarError, OSError, EOFError) as e:
            raise SourceError(f"{path}: cannot read as a tar shard ({type(e).__name__}: "
                              f"{e})") from None
        if cur:
            out.append(cur)
        return out

    def units(self) -> list[Path]:
        return self.files

    def read_unit(self, path: Path) -> list[dict[str, Any]]:
        out = []
        for s in self._samples(path):
            missing = [f for f in self.fields if f not in s]
            if missing:
                raise SourceError(f"{path}: a sample lacks .{', .'.join(missing)} (has "
                                  f".{', .'.join(sorted(s))}); every sample needs the same "
                                  f"fields (--keys selects some)")
            out.append({f: s[f] for f in self.fields})
        return out

    def metadata(self) -> dict[str, Any]:
        return {"source_kind": self.kind, "fields": self.fields}

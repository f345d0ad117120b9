"""mosaicml-streaming's MDS directories (``forebay ingest DIR OUT --from mds``): read
with MDS's own index format, without the library, so that a user switching brings
the data over in one command.

A directory holds ``index.json`` (version 2) listing shards; a shard file is
``[n: uint32][n + 1 offsets: uint32][the writer's config][samples]``, a sample the
uint32 sizes of its variable-size columns then every column's bytes, in the index's
column order.  Shards may be compressed whole (``zstd``, ``gz``, ``bz2``); their hashes,
when the index gives them (sha*, md5, xxh*), are checked.  Everything read is checked
against what the index and the shard claim: a file cut short, an offset past its end,
a size that does not add up is an error naming the shard and the sample.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ...errors import SourceError
from ._base import Source, check_keys, confine, register_source

__all__ = ["MdsSource"]

#: the largest index.json read (a dataset of millions of shards stays far below)
_MAX_INDEX = 256 << 20
#: NDArray's value dtypes and shape dtypes by their codes (MDS's encodings.py)
_VALUE = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32",
          33: "int32", 34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_SHAPE = {0: np.uint8, 1: np.uint16, 2: np.uint32, 3: np.uint64}
_SCALARS = {"uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
            "float16", "float32", "float64"}
#: encodings kept as their bytes (text, JSON, encoded images)
_AS_BYTES = {"bytes", "str", "json", "jpeg", "png", "str_decimal"}
#: encodings not taken, and why
_REFUSED = {"pkl": "pickled objects run code when read",
            "pil": "raw PIL images: re-encode them (jpeg or png) or use ndarray",
            "list[pil]": "lists of images", "list[jpeg]": "lists of images",
            "list[png]": "lists of images", "jpeg_array": "lists of images",
            "jpegarray": "lists of images"}


def _size_of(encoding: str) -> Optional[int]:
    """The fixed size of a column's values, or None (a size per sample)."""
    if encoding == "int":
        return 8
    if encoding in _SCALARS:
        return int(np.dtype(encoding).itemsize)
    if encoding.startswith("ndarray:"):
        parts = encoding.split(":")
        if len(parts) == 3:
            shape = [int(x) for x in parts[2].split(",")]
            return int(np.prod(shape)) * int(np.dtype(parts[1]).itemsize)
    return None


def _check_encoding(name: str, encoding: str, where: str) -> None:
    if encoding in _REFUSED:
        raise SourceError(f"{where}: column {name!r} is MDS {encoding!r} ({_REFUSED[encoding]}); "
                          f"leave it out with --keys")
    ok = encoding in _AS_BYTES or encoding in _SCALARS or encoding in (
        "int", "str_int", "str_float", "ndarray")
    if encoding.startswith("ndarray:"):
        parts = encoding.split(":")
        ok = len(parts) in (2, 3) and parts[1] in _VALUE.values()
        if ok and len(parts) == 3:
            ok = all(x.isdigit() for x in parts[2].split(","))
    if not ok:
        raise SourceError(f"{where}: column {name!r} has an MDS encoding forebay does not "
                          f"read: {encoding!r}")


def _decode(encoding: str, raw: bytes, where: str) -> Any:
    """One column's value as stored in a forebay sample."""
    try:
        if encoding in _AS_BYTES:
            return np.frombuffer(raw, dtype=np.uint8)
        if encoding == "int":
            return np.frombuffer(raw, dtype=np.int64)[0]
        if encoding in _SCALARS:
            return np.frombuffer(raw, dtype=encoding)[0]
        if encoding == "str_int":
            return np.int64(int(raw.decode("utf-8")))
        if encoding == "str_float":
            return np.float64(float(raw.decode("utf-8")))
        parts = encoding.split(":")                          # ndarray[:dtype[:shape]]
        at = 0
        if len(parts) >= 2:
            dtype = parts[1]
        else:
            dtype = _VALUE[raw[0]]
            at = 1
        if len(parts) == 3:
            shape = tuple(int(x) for x in parts[2].split(","))
        else:
            byte = raw[at]
            ndim, sdt = byte >> 2, np.dtype(_SHAPE[byte & 3])
            shape = tuple(int(x) for x in np.frombuffer(raw, sdt, ndim, at + 1))
            at += 1 + ndim * sdt.itemsize
        itemsize = np.dtype(dtype).itemsize
        if len(raw) - at != int(np.prod(shape)) * itemsize:
            raise SourceError(f"{where}: its {encoding!r} value holds {len(raw) - at} bytes "
                              f"for shape {shape} of {dtype}")
        return np.frombuffer(raw, dtype, offset=at).reshape(shape)
    except SourceError:
        raise
    except (IndexError, KeyError, ValueError, UnicodeDecodeError) as e:
        raise SourceError(f"{where}: its {encoding!r} value cannot be read ({e})") from None


def _hash(algo: str, data: bytes) -> Optional[str]:
    """``data``'s digest by MDS's name for the algorithm, or None for one not known."""
    if algo.startswith("xxh"):
        import xxhash

        fn = getattr(xxhash, f"{algo}_hexdigest", None)
        return fn(data) if fn is not None else None
    if algo in hashlib.algorithms_available:
        return hashlib.new(algo, data).hexdigest()
    return None


@register_source
class MdsSource(Source):
    """An MDS directory (``index.json`` and its shards); a shard per parallel unit."""

    kind = "mds"
    unit_name = "shard"

    def __init__(self, root: "str | os.PathLike[str]", *, keys: Optional[Sequence[str]] = None,
                 follow_links: bool = False, **unused: Any) -> None:
        self.root = Path(root)
        index = self.root / "index.json"
        if not index.is_file():
            raise SourceError(f"{self.root}: not an MDS directory (no index.json)")
        confine(self.root, [index], follow_links)
        if index.stat().st_size > _MAX_INDEX:
            raise SourceError(f"{index}: {index.stat().st_size:,} bytes, more than an index "
                              f"holds ({_MAX_INDEX:,})")
        try:
            doc = json.loads(index.read_text())
            shards = doc["shards"]
            if doc.get("version") != 2 or not isinstance(shards, list):
                raise SourceError(f"{index}: not an MDS index (version "
                                  f"{doc.get('version')!r}, expected 2)")
        except SourceError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise SourceError(f"{index}: not an MDS index ({e})") from None
        self.units_: list[dict[str, Any]] = []
        names: Optional[list[str]] = None
        encodings: list[str] = []
        for k, sh in enumerate(shards):
            where = f"{index} shard {k}"
            try:
                if sh["format"] != "mds" or sh["version"] != 2:
                    raise SourceError(f"{where}: not an MDS shard entry (format "
                                      f"{sh['format']!r} version {sh['version']!r})")
                these = (list(sh["column_names"]), list(sh["column_encodings"]))
                n = int(sh["samples"])
                info = sh["raw_data"]
                str(info["basename"])                  # a shard entry names its file
                zipped = sh.get("zip_data") or None
                comp = sh.get("compression") or None
            except SourceError:
                raise
            except (KeyError, TypeError, ValueError) as e:
                raise SourceError(f"{where}: not an MDS shard entry ({e})") from None
            if names is None:
                names, encodings = these
            elif these != (names, encodings):
                raise SourceError(f"{where}: its columns differ from shard 0's")
            kind = None if comp is None else str(comp).split(":")[0]
            if kind not in (None, "zstd", "gz", "bz2"):
                raise SourceError(f"{where}: compression {comp!r} is not read (zstd, gz, "
                                  f"bz2 are)")
            if kind is not None:
                if not isinstance(zipped, dict):
                    raise SourceError(f"{where}: compressed ({comp!r}) but no zip_data")
                info = zipped
            path = self.root / str(info["basename"])
            if not path.is_file():
                raise SourceError(f"{where}: {path} is missing")
            confine(self.root, [path], follow_links)
            self.units_.append({"path": str(path), "samples": n, "compression": kind,
                                "hashes": dict(info.get("hashes") or {}),
                                "bytes": info.get("bytes")})
        if names is None:
            raise SourceError(f"{index}: lists no shards")
        self.names: list[str] = names
        self.encodings: list[str] = encodings
        self.keys = check_keys(names, keys, str(self.root))
        for name in self.keys:
            _check_encoding(name, encodings[names.index(name)], str(index))
        self.sizes = [_size_of(e) for e in encodings]

    def units(self) -> Sequence[Any]:
        return self.units_

    def metadata(self) -> dict[str, Any]:
        return {"source_kind": self.kind, "fields": self.keys,
                "mds_encodings": {n: e for n, e in zip(self.names, self.encodings)
                                  if n in self.keys}}

    def read_unit(self, unit: dict[str, Any]) -> Sequence[dict[str, Any]]:
        where = unit["path"]
        data = Path(where).read_bytes()
        if unit["bytes"] is not None and len(data) != unit["bytes"]:
            raise SourceError(f"{where}: {len(data):,} bytes, the index says {unit['bytes']:,}")
        for algo, want in unit["hashes"].items():
            got = _hash(algo, data)
            if got is not None and got != want:
                raise SourceError(f"{where}: its {algo} is {got}, the index says {want}: "
                                  f"the shard is damaged")
        data = self._decompress(unit["compression"], data, where)
        n = unit["samples"]
        if len(data) < 4 * (n + 2) or int(np.frombuffer(data, np.uint32, 1)[0]) != n:
            raise SourceError(f"{where}: does not begin with its {n} samples' offsets")
        offs = np.frombuffer(data, np.uint32, n + 1, 4).astype(np.int64)
        if n and (offs[0] < 4 * (n + 2) or (np.diff(offs) < 0).any() or offs[-1] > len(data)):
            raise SourceError(f"{where}: its sample offsets lie outside the file")
        var = [k for k, s in enumerate(self.sizes) if s is None]
        wanted = [self.names.index(k) for k in self.keys]
        out = []
        for i in range(n):
            a, b = int(offs[i]), int(offs[i + 1])
            at = a + 4 * len(var)
            if at > b:
                raise SourceError(f"{where}: sample {i} is shorter than its column sizes")
            sizes = [0 if s is None else s for s in self.sizes]
            for j, k in enumerate(var):
                sizes[k] = int(np.frombuffer(data, np.uint32, 1, a + 4 * j)[0])
            if at + sum(sizes) != b:
                raise SourceError(f"{where}: sample {i}'s column sizes add up to "
                                  f"{sum(sizes):,} bytes, it holds {b - at:,}")
            starts = [at]
            for size in sizes[:-1]:
                starts.append(starts[-1] + size)
            out.append({self.names[k]: _decode(self.encodings[k],
                                               data[starts[k]:starts[k] + sizes[k]],
                                               f"{where}: sample {i} column {self.names[k]!r}")
                        for k in wanted})
        return out

    @staticmethod
    def _decompress(kind: Optional[str], data: bytes, where: str) -> bytes:
        try:
            if kind == "zstd":
                import zstandard

                return zstandard.ZstdDecompressor().decompress(data,
                                                               max_output_size=1 << 34)
            if kind == "gz":
                return gzip.decompress(data)
            if kind == "bz2":
                return bz2.decompress(data)
        except ImportError:
            raise SourceError(f"{where}: zstd shards need the zstandard package (the "
                              f"'sources' extra)") from None
        except Exception as e:  # noqa: BLE001 - any codec's error on damaged data
            raise SourceError(f"{where}: cannot decompress it ({type(e).__name__}: {e})") \
                from None
        return data

"""litdata's optimized directories (``forebay ingest DIR OUT --from litdata``): read
with litdata's own chunk format, without the library, so that a user switching from
``litdata.optimize`` brings the data over in one command.

A directory holds ``index.json`` (its ``config``: each leaf's serializer in
``data_format``, the samples' structure as a pytree spec in ``data_spec``, the chunks'
``compression``; its ``chunks``: file name, samples, bytes) and the chunk files. A
chunk is ``[n: uint32][n + 1 offsets: uint32][samples]``, a sample the uint32 sizes of
its leaves then each leaf's bytes; a chunk may be compressed whole (``zstd``). A
sample's structure (a dict, nested dicts, lists or tuples) becomes its field names
(``a.b``, ``x.0``). Leaves: ``int``, ``float``, ``bool`` as numbers; ``numpy``,
``tensor`` and their header-less 1-d forms as arrays; ``str``, ``text``, ``bytes``,
``jpeg`` and ``file`` as bytes; ``pickle`` and litdata's private encodings (``pil``,
``json``, media) are refused by name. Everything read is checked against what the
index and the chunk claim: a file cut short, an offset past its end, a size that does
not add up is an error naming the chunk and the sample.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ...errors import SourceError
from ._base import Source, check_keys, confine, register_source

__all__ = ["LitdataSource"]

_MAX_INDEX = 256 << 20
#: litdata's NumPy dtype codes (its constants._NUMPY_SCTYPES, in order); 14+ are
#: object, bytes, str and void arrays, which forebay does not store
_NUMPY = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128", "bool"]
#: litdata's torch dtype codes (its constants._TORCH_DTYPES_MAPPING); 10 is bfloat16
_TORCH = {0: "float32", 1: "float32", 2: "float64", 3: "float64", 4: "complex64",
          5: "complex64", 6: "complex128", 7: "complex128", 8: "float16", 9: "float16",
          11: "uint8", 12: "int8", 13: "int16", 14: "int16", 15: "int32", 16: "int32",
          17: "int64", 18: "int64", 19: "bool", 20: "uint16"}
_AS_BYTES = {"str", "text", "bytes", "jpeg", "file"}
_REFUSED = {"pickle": "pickled objects run code when read",
            "pil": "raw PIL images: re-encode them (jpeg) or store arrays",
            "json": "litdata's own binary encoding of JSON values",
            "jpeg_array": "lists of images", "graph": "litdata's own graph encoding"}
_SIZE = {"int": 8, "float": 8, "bool": 1}
_FOOTER_MAGIC = b"LDARW01\0"       # a chunk whose rows are an Arrow footer


def _leaf_kind(fmt: str, where: str) -> str:
    base = fmt.split(":")[0]
    if base in _REFUSED:
        raise SourceError(f"{where}: leaf format {fmt!r} ({_REFUSED[base]}); leave it out "
                          f"with --keys")
    if base in _AS_BYTES or base in _SIZE or base in ("numpy", "tensor"):
        return base
    if base in ("no_header_numpy", "no_header_tensor"):
        table = _NUMPY if base == "no_header_numpy" else _TORCH
        try:
            code = int(fmt.split(":")[1])
            (table[code] if isinstance(table, list) else table[code])
        except (IndexError, KeyError, ValueError):
            raise SourceError(f"{where}: leaf format {fmt!r} names a dtype forebay does "
                              f"not store") from None
        return base
    raise SourceError(f"{where}: leaf format {fmt!r} is not one forebay reads")


def _field_names(spec: Any, where: str) -> list[str]:
    """The leaves' names from litdata's serialized pytree spec (``[1, node]``)."""
    try:
        version, root = json.loads(spec) if isinstance(spec, str) else spec
        if version != 1:
            raise SourceError(f"{where}: data_spec protocol {version!r} (1 is read)")
    except SourceError:
        raise
    except (TypeError, ValueError) as e:
        raise SourceError(f"{where}: data_spec is not a pytree spec ({e})") from None
    names: list[str] = []

    def walk(node: Any, prefix: str, depth: int) -> None:
        if depth > 32 or not isinstance(node, dict):
            raise SourceError(f"{where}: data_spec is malformed or nested too deeply")
        typ, children = node.get("type"), node.get("children_spec") or []
        if typ is None:
            names.append(prefix or "value")
            return
        if typ in ("builtins.dict", "collections.OrderedDict"):
            keys = json.loads(node["context"])
            if not isinstance(keys, list) or len(keys) != len(children):
                raise SourceError(f"{where}: data_spec's dict keys do not match its children")
            labels = [str(k) for k in keys]
        elif typ in ("builtins.list", "builtins.tuple"):
            labels = [str(i) for i in range(len(children))]
        else:
            raise SourceError(f"{where}: samples of type {typ} are not read (dicts, lists "
                              f"and tuples are)")
        for label, child in zip(labels, children):
            walk(child, f"{prefix}.{label}" if prefix else label, depth + 1)

    walk(root, "", 0)
    if len(set(names)) != len(names):
        raise SourceError(f"{where}: two leaves have the same name")
    return names


def _decode(kind: str, fmt: str, raw: bytes, where: str) -> Any:
    """One leaf's value as stored in a forebay sample."""
    try:
        if kind in _AS_BYTES:
            return np.frombuffer(raw, dtype=np.uint8)
        if kind in _SIZE and len(raw) != _SIZE[kind]:
            raise SourceError(f"{where}: a {kind} of {len(raw)} bytes")
        if kind == "int":
            return np.frombuffer(raw, "<i8")[0]
        if kind == "float":
            return np.frombuffer(raw, "<f8")[0]
        if kind == "bool":
            return np.bool_(raw[0] != 0)
        if kind.startswith("no_header"):
            code = int(fmt.split(":")[1])
            dtype = np.dtype(_NUMPY[code] if kind == "no_header_numpy"
                             else _TORCH[code]).newbyteorder("<")
            if len(raw) % dtype.itemsize:
                raise SourceError(f"{where}: {len(raw)} bytes are not whole {dtype.name}s")
            return np.frombuffer(raw, dtype)
        if kind == "numpy":     # uint32 dtype code, ndim, dims (native: little-endian)
            code, ndim = struct.unpack_from("<II", raw, 0)
            if code >= len(_NUMPY):
                raise SourceError(f"{where}: numpy dtype code {code} is not stored")
            dtype, at = np.dtype(_NUMPY[code]).newbyteorder("<"), 8
        else:                   # tensor: big-endian dtype code and rank, then shape
            code, ndim = struct.unpack_from(">II", raw, 0)
            if code not in _TORCH:
                raise SourceError(f"{where}: tensor dtype code {code} is not stored")
            dtype, at = np.dtype(_TORCH[code]).newbyteorder("<"), 8
        if ndim > 32:
            raise SourceError(f"{where}: an array of {ndim} dimensions")
        shape = struct.unpack_from(("<" if kind == "numpy" else ">") + f"{ndim}I", raw, at)
        at += 4 * ndim
        if len(raw) - at != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise SourceError(f"{where}: its {kind} value holds {len(raw) - at} bytes for "
                              f"shape {tuple(shape)} of {dtype.name}")
        return np.frombuffer(raw, dtype, offset=at).reshape(shape)
    except SourceError:
        raise
    except (IndexError, KeyError, ValueError, struct.error) as e:
        raise SourceError(f"{where}: its {fmt!r} value cannot be read ({e})") from None


@register_source
class LitdataSource(Source):
    """A litdata optimized directory (``index.json`` and its chunks); a chunk per
    parallel unit."""

    kind = "litdata"
    unit_name = "chunk"

    def __init__(self, root: "str | os.PathLike[str]", *, keys: Optional[Sequence[str]] = None,
                 follow_links: bool = False, **unused: Any) -> None:
        self.root = Path(root)
        index = self.root / "index.json"
        if not index.is_file():
            raise SourceError(f"{self.root}: not a litdata directory (no index.json)")
        confine(self.root, [index], follow_links)
        if index.stat().st_size > _MAX_INDEX:
            raise SourceError(f"{index}: {index.stat().st_size:,} bytes, more than an index "
                              f"holds ({_MAX_INDEX:,})")
        where = str(index)
        try:
            doc = json.loads(index.read_text())
            config, chunks = doc["config"], doc["chunks"]
            formats = list(config["data_format"])
            spec = config["data_spec"]
        except (ValueError, KeyError, TypeError) as e:
            raise SourceError(f"{index}: not a litdata index ({e})") from None
        loader = config.get("item_loader", "PyTreeLoader")
        if loader != "PyTreeLoader":
            raise SourceError(f"{where}: written with litdata's {loader} (only PyTreeLoader "
                              f"directories, litdata.optimize's default, are read)")
        if config.get("encryption"):
            raise SourceError(f"{where}: its chunks are encrypted")
        comp, level = config.get("compression"), config.get("compression_level") or "chunk"
        self.compression = None if comp is None else str(comp).split(":")[0]
        self.level = level
        if self.compression not in (None, "zstd") or level not in ("chunk", "batch", "sample"):
            raise SourceError(f"{where}: compression {comp!r} ({level!r}) is not read (zstd "
                              f"is, per chunk, batch or sample)")
        names = _field_names(spec, where)
        if len(names) != len(formats):
            raise SourceError(f"{where}: {len(names)} leaves in data_spec, "
                              f"{len(formats)} in data_format")
        self.names, self.formats = names, formats
        self.keys = check_keys(names, keys, str(self.root))
        self.kinds = [_leaf_kind(f, f"{where} leaf {n!r}") if n in self.keys else ""
                      for n, f in zip(names, formats)]
        self.units_: list[dict[str, Any]] = []
        if not isinstance(chunks, list) or not chunks:
            raise SourceError(f"{where}: lists no chunks")
        for k, ch in enumerate(chunks):
            try:
                name, n = ch["filename"], int(ch["chunk_size"])
                nbytes = int(ch["chunk_bytes"])
            except (KeyError, TypeError, ValueError) as e:
                raise SourceError(f"{where} chunk {k}: not a chunk entry ({e})") from None
            if not isinstance(name, str) or Path(name).name != name or n < 0:
                raise SourceError(f"{where} chunk {k}: file {name!r}, {n} samples: not a "
                                  f"chunk of this directory")
            path = self.root / name
            if not path.is_file():
                raise SourceError(f"{where} chunk {k}: {path} is missing")
            confine(self.root, [path], follow_links)
            self.units_.append({"path": str(path), "samples": n, "bytes": nbytes})

    def units(self) -> Sequence[Any]:
        return self.units_

    def metadata(self) -> dict[str, Any]:
        return {"source_kind": self.kind, "fields": self.keys,
                "litdata_formats": {n: f for n, f in zip(self.names, self.formats)
                                    if n in self.keys}}

    def read_unit(self, unit: dict[str, Any]) -> Sequence[dict[str, Any]]:
        where = unit["path"]
        data = Path(where).read_bytes()
        n, leaves = unit["samples"], len(self.names)
        if self.compression == "zstd":
            data = _inflate(data, self.level, n, unit["bytes"], where)
        if data.endswith(_FOOTER_MAGIC):
            raise SourceError(f"{where}: its rows are an Arrow footer (litdata's typed "
                              f"schema), which forebay does not read")
        head = 4 * (n + 2)
        if len(data) < head or struct.unpack_from("<I", data, 0)[0] != n:
            raise SourceError(f"{where}: does not begin with its {n} samples' offsets")
        offs = np.frombuffer(data, "<u4", n + 1, 4).astype(np.int64)
        if n and (offs[0] != head or (np.diff(offs) < 0).any() or offs[-1] > len(data)):
            raise SourceError(f"{where}: its sample offsets lie outside the file")
        wanted = [k for k, name in enumerate(self.names) if name in self.keys]
        out = []
        for i in range(n):
            a, b = int(offs[i]), int(offs[i + 1])
            if a + 4 * leaves > b:
                raise SourceError(f"{where}: sample {i} is shorter than its leaf sizes")
            sizes = np.frombuffer(data, "<u4", leaves, a).astype(np.int64)
            at = a + 4 * leaves
            if at + int(sizes.sum()) != b:
                raise SourceError(f"{where}: sample {i}'s leaf sizes add up to "
                                  f"{int(sizes.sum()):,} bytes, it holds {b - at:,}")
            starts = at + np.concatenate([[0], np.cumsum(sizes)[:-1]])
            out.append({self.names[k]: _decode(
                self.kinds[k], self.formats[k],
                data[int(starts[k]):int(starts[k] + sizes[k])],
                f"{where}: sample {i} leaf {self.names[k]!r}") for k in wanted})
        return out


_FRAMED_MAGIC = b"LDFZ01\0\0"
_PREFIX = struct.Struct("<8sHHIII")     # magic, version, flags, items, rows/frame, frames
_FRAME = struct.Struct("<IIQII")        # first item, items, offset, compressed, raw bytes


def _unzstd(data: bytes, raw_bytes: int, where: str) -> bytes:
    try:
        import zstandard

        return zstandard.ZstdDecompressor().decompress(data, max_output_size=max(raw_bytes, 0)
                                                       + (1 << 20))
    except ImportError:
        raise SourceError(f"{where}: zstd chunks need the zstandard package (the "
                          f"'sources' extra)") from None
    except Exception as e:  # noqa: BLE001 - the codec's error on damaged data
        raise SourceError(f"{where}: cannot decompress it ({type(e).__name__}: {e})") \
            from None


def _inflate(data: bytes, level: str, n: int, raw_bytes: int, where: str) -> bytes:
    """A zstd chunk as the classic layout: whole (``chunk``), in frames of rows after a
    table (``batch``, litdata's default) or a frame per sample (``sample``)."""
    if level == "chunk":
        return _unzstd(data, raw_bytes, where)
    head = 4 * (n + 2)
    if level == "sample":
        if len(data) < head or struct.unpack_from("<I", data, 0)[0] != n:
            raise SourceError(f"{where}: does not begin with its {n} samples' offsets")
        offs = np.frombuffer(data, "<u4", n + 1, 4).astype(np.int64)
        if n and (offs[0] != head or (np.diff(offs) < 0).any() or offs[-1] > len(data)):
            raise SourceError(f"{where}: its sample offsets lie outside the file")
        items = [_unzstd(data[int(offs[i]):int(offs[i + 1])], raw_bytes, where)
                 for i in range(n)]
    else:
        if len(data) < _PREFIX.size or data[:8] != _FRAMED_MAGIC:
            raise SourceError(f"{where}: not a framed zstd chunk (no LDFZ01 header)")
        _, version, _, count, _, frames = _PREFIX.unpack_from(data, 0)
        if version != 1 or count != n:
            raise SourceError(f"{where}: framed chunk version {version} of {count} samples "
                              f"(1 and {n} expected)")
        table = _PREFIX.size + 4 * (n + 1)
        if len(data) < table + _FRAME.size * frames or frames > n + 1:
            raise SourceError(f"{where}: its frame table lies outside the file")
        logical = np.frombuffer(data, "<u4", n + 1, _PREFIX.size).astype(np.int64)
        parts = []
        for f in range(frames):
            _, _, at, clen, ulen = _FRAME.unpack_from(data, table + f * _FRAME.size)
            if at + clen > len(data):
                raise SourceError(f"{where}: frame {f} lies outside the file")
            part = _unzstd(data[at:at + clen], ulen, where)
            if len(part) != ulen:
                raise SourceError(f"{where}: frame {f} inflates to {len(part)} bytes, its "
                                  f"table says {ulen}")
            parts.append(part)
        body = b"".join(parts)
        if logical[0] != 0 or (np.diff(logical) < 0).any() or logical[-1] != len(body):
            raise SourceError(f"{where}: its sample offsets do not match its frames")
        items = [body[int(logical[i]):int(logical[i + 1])] for i in range(n)]
    sizes = np.array([len(x) for x in items], dtype=np.int64)
    offsets = head + np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return struct.pack("<I", n) + offsets.astype("<u4").tobytes() + b"".join(items)

"""On-disk constants and manifest handling of the packed format (see docs/format.md)."""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..errors import (ChecksumError, CorruptDatasetError, DatasetNotFoundError,
                      FormatVersionError, InvalidArgumentError, ManifestError)
from ._schema import Schema

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "CODED_FORMAT_VERSION", "ALIGNMENT", "MANIFEST_NAME",
    "IndexLayout", "ShardInfo", "Manifest", "checksum", "load_index", "read_npy_header",
    "replace_problem", "seal_manifest",
]

FORMAT_NAME = "forebay.packed"
FORMAT_VERSION = 1
#: the version of a dataset with compressed fields: a reader of version 1 only would
#: hand out compressed bytes as values, so it must refuse such a dataset
CODED_FORMAT_VERSION = 2
#: Every field array starts at a multiple of this many bytes within its shard.
ALIGNMENT = 64
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGORITHM = "xxh3_64"
#: the manifest's last key: xxh3_64 of the file's bytes before it (see Manifest.to_json)
_SUM_KEY = ' "manifest_checksum": '
#: a larger manifest.json is refused before it is parsed
MAX_MANIFEST_BYTES = 256 << 20
_PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")


def checksum(data: Any) -> str:
    """xxh3_64 of a buffer, as 16 hex digits."""
    return xxhash.xxh3_64(data).hexdigest()


class IndexLayout:
    """Column layout of the flat per-shard index (one int64 row per sample).

    Columns: ``record_offset``, ``record_nbytes``, ``record_checksum`` (xxh3_64 of the
    record's bytes, stored as int64), then for each field ``NAME.offset`` (relative to
    the record), ``NAME.nbytes`` and one ``NAME.shapeK`` per dimension.
    """

    REC_OFF, REC_LEN, REC_SUM = 0, 1, 2

    def __init__(self, schema: Schema) -> None:
        self.columns: list[str] = ["record_offset", "record_nbytes", "record_checksum"]
        self.off: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}
        self.shape: dict[str, slice] = {}
        for f in schema.fields:
            self.off[f.name] = len(self.columns)
            self.nbytes[f.name] = len(self.columns) + 1
            self.columns += [f"{f.name}.offset", f"{f.name}.nbytes"]
            start = len(self.columns)
            self.columns += [f"{f.name}.shape{k}" for k in range(f.ndim)]
            self.shape[f.name] = slice(start, start + f.ndim)
        self.ncols = len(self.columns)
        # int64: numpy indexes with them, the C kernel reads them as int64_t
        self.nbytes_cols = np.array([self.nbytes[f.name] for f in schema.fields], dtype=np.int64)
        self.off_cols = np.array([self.off[f.name] for f in schema.fields], dtype=np.int64)
        self.itemsizes = np.array([f.dtype.itemsize for f in schema.fields], dtype=np.int64)
        #: positions of the fields stored compressed (their nbytes are what is stored;
        #: their values' size is their shape's)
        self.coded = [k for k, f in enumerate(schema.fields) if f.codec]
        #: (name, dtype, shape columns) of each field, in order (a batch's assembly)
        self.fields: list[tuple[str, np.dtype, slice]] = [
            (f.name, f.dtype, self.shape[f.name]) for f in schema.fields]


@dataclass(frozen=True)
class ShardInfo:
    data: str
    index: str
    num_samples: int
    data_nbytes: int
    data_checksum: str
    index_nbytes: int
    index_checksum: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardInfo":
        """A shard entry from a manifest (untrusted): file names must name files inside
        the dataset directory, counts must be non-negative integers."""
        names = {}
        for key in ("data", "index"):
            v = d[key]
            if not isinstance(v, str) or not _PLAIN_NAME.fullmatch(v) or v in (".", ".."):
                raise InvalidArgumentError(f"shard file name {v!r} is not a plain file name "
                                           f"inside the dataset (no directories, no '..')")
            names[key] = v
        counts = {}
        for key in ("num_samples", "data_nbytes", "index_nbytes"):
            v = d[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidArgumentError(f"shard {names['data']}: {key} {v!r} is not a "
                                           f"non-negative integer")
            counts[key] = v
        return cls(data=names["data"], index=names["index"], num_samples=counts["num_samples"],
                   data_nbytes=counts["data_nbytes"], data_checksum=str(d["data_checksum"]),
                   index_nbytes=counts["index_nbytes"], index_checksum=str(d["index_checksum"]))


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of a packed dataset."""

    num_samples: int
    schema: Schema
    shards: tuple[ShardInfo, ...]
    payload_nbytes: int
    metadata: dict[str, Any]
    created_by: str
    fingerprint: str  # checksum of the manifest file's bytes: identifies the dataset

    def to_json(self) -> str:
        layout = IndexLayout(self.schema)
        doc = {
            "format": FORMAT_NAME,
            "version": CODED_FORMAT_VERSION if self.schema.coded else FORMAT_VERSION,
            "num_samples": self.num_samples,
            "payload_nbytes": self.payload_nbytes,
            "alignment": ALIGNMENT,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "schema": self.schema.to_dict(),
            "index_columns": layout.columns,
            "shards": [s.to_dict() for s in self.shards],
            "metadata": self.metadata,
            "created_by": self.created_by,
        }
        return seal_manifest(doc)

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        path = Path(path)
        if not path.exists():
            raise DatasetNotFoundError(f"no dataset at {path}")
        mpath = path / MANIFEST_NAME
        if not path.is_dir() or not mpath.is_file():
            raise ManifestError(f"{path} is not a forebay dataset: {MANIFEST_NAME} is missing")
        raw = mpath.read_bytes()
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{mpath}: {len(raw)} bytes, more than a manifest may hold "
                                f"({MAX_MANIFEST_BYTES})")
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"{mpath}: not valid JSON ({e})") from None
        except RecursionError:
            raise ManifestError(f"{mpath}: nested too deeply to be a manifest") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{mpath}: not a forebay manifest (format is "
                                f"{doc.get('format') if isinstance(doc, dict) else None!r})")
        version = doc.get("version")
        if version not in (FORMAT_VERSION, CODED_FORMAT_VERSION) or isinstance(version, bool):
            raise FormatVersionError(f"{mpath}: format version {version!r} is not supported "
                                     f"(this forebay reads versions {FORMAT_VERSION} and "
                                     f"{CODED_FORMAT_VERSION})")
        at = raw.rfind(b",\n" + _SUM_KEY.encode())
        if at < 0:
            raise ManifestError(f"{mpath}: the manifest carries no checksum (damaged, or "
                                f"written by a forebay before checksummed manifests: "
                                f"ingest it again)")
        want = raw[at + 2 + len(_SUM_KEY) + 1:at + 2 + len(_SUM_KEY) + 17]
        if checksum(raw[:at] + b"\n}").encode() != want:
            raise ChecksumError(f"{mpath}: manifest checksum mismatch (the manifest is "
                                f"damaged or was edited)")
        try:
            if doc.get("alignment", ALIGNMENT) != ALIGNMENT:
                raise InvalidArgumentError(f"alignment {doc['alignment']} (expected {ALIGNMENT})")
            if doc.get("checksum_algorithm", CHECKSUM_ALGORITHM) != CHECKSUM_ALGORITHM:
                raise InvalidArgumentError(f"checksum algorithm {doc['checksum_algorithm']!r}")
            schema = Schema.from_dict(doc["schema"])
            if schema.coded != (version == CODED_FORMAT_VERSION):
                raise InvalidArgumentError(f"format version {version} with "
                                           f"{'' if schema.coded else 'no '}compressed fields")
            shards = tuple(ShardInfo.from_dict(s) for s in doc["shards"])
            m = cls(num_samples=int(doc["num_samples"]), schema=schema, shards=shards,
                    payload_nbytes=int(doc.get("payload_nbytes", 0)),
                    metadata=dict(doc.get("metadata") or {}),
                    created_by=str(doc.get("created_by", "")), fingerprint=checksum(raw))
            if list(doc.get("index_columns", [])) != IndexLayout(schema).columns:
                raise InvalidArgumentError("index_columns do not match the schema")
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise ManifestError(f"{mpath}: malformed manifest: {what}") from None
        if sum(s.num_samples for s in shards) != m.num_samples:
            raise ManifestError(f"{mpath}: shards hold {sum(s.num_samples for s in shards)} "
                                f"samples but num_samples is {m.num_samples}")
        return m


def replace_problem(path: Path) -> "str | None":
    """Why ``overwrite`` must not replace the directory ``path`` (None: it is a forebay
    dataset holding nothing but its manifest and the shard files the manifest names)."""
    mpath = Path(path) / MANIFEST_NAME
    try:
        doc = json.loads(mpath.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return f"it is not a forebay dataset (no readable {MANIFEST_NAME})"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        return f"it is not a forebay dataset ({MANIFEST_NAME} is not a forebay manifest)"
    ours = {MANIFEST_NAME}
    for shard in doc.get("shards") or []:
        if isinstance(shard, dict):
            ours.update(str(shard.get(k)) for k in ("data", "index"))
    extra = sorted(p.name for p in Path(path).iterdir() if p.name not in ours or p.is_dir())
    if extra:
        return (f"it holds {len(extra)} entries the dataset's manifest does not list "
                f"({', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''})")
    return None


def seal_manifest(doc: dict[str, Any]) -> str:
    """The text of ``manifest.json`` for ``doc``, ending with its checksum: xxh3_64 of
    every byte before the checksum's own key, which :meth:`Manifest.read` recomputes from
    the file's bytes (no re-serialisation), so any damaged byte is caught.  For tools
    that write or edit a manifest on purpose."""
    doc = {k: v for k, v in doc.items() if k != "manifest_checksum"}
    head = json.dumps(doc, indent=1)[:-2]          # without the closing "\n}"
    return f"{head},\n{_SUM_KEY}\"{checksum((head + chr(10) + '}').encode())}\"\n}}\n"


def read_npy_header(fh: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
    """``(shape, fortran_order, dtype)`` from the ``.npy`` header at ``fh``'s position,
    which is left at the array's first byte; raises what numpy's parser raises."""
    fmt = np.lib.format
    version = fmt.read_magic(fh)
    read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
    shape, fortran, dtype = read(fh)
    return tuple(shape), bool(fortran), dtype


def load_index(raw: bytes, ipath: Path, shape: tuple[int, int]) -> np.ndarray:
    """A shard's index from its ``.npy`` bytes: the header is read and checked (int64
    of ``shape``) before any array is made, so a crafted one (an object array, a header
    declaring 10^10 rows, a header that is no Python literal) is named, not loaded."""
    f = io.BytesIO(raw)
    try:
        got, fortran, dtype = read_npy_header(f)
    except Exception as e:      # noqa: BLE001 - numpy's header parser raises many kinds
        raise CorruptDatasetError(f"{ipath}: index header unreadable "
                                  f"({type(e).__name__}: {e})") from None
    if dtype != np.dtype("<i8") or got != shape or fortran:
        raise CorruptDatasetError(f"{ipath}: index has shape {got} {dtype}"
                                  f"{' (Fortran order)' if fortran else ''}, expected "
                                  f"{shape} int64")
    body = len(raw) - f.tell()
    if body != shape[0] * shape[1] * 8:
        raise CorruptDatasetError(f"{ipath}: index holds {body} bytes after its header, "
                                  f"{shape[0] * shape[1] * 8} expected")
    return np.frombuffer(raw, dtype="<i8", offset=f.tell()).reshape(shape).copy()

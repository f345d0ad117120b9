"""Schema of a packed dataset: field names, dtypes, ranks and kinds."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..errors import InvalidArgumentError, NameNotFoundError, SchemaError, UnsupportedDtypeError

__all__ = ["CODECS", "Field", "Schema", "as_field_array"]

# numpy dtype kinds we store: bool, signed, unsigned, float, complex.
_STORABLE_KINDS = "biufc"
KIND_ARRAY = "array"
KIND_BYTES = "bytes"


@dataclass(frozen=True)
class Field:
    """One field of every sample.

    Attributes:
        name: the key in each sample mapping.
        dtype: numpy dtype, byte order included (bit-exact round trip).
        ndim: rank of the array in every sample (shapes may differ per sample).
        kind: ``"array"`` for numeric arrays, ``"bytes"`` for raw encoded blobs
            (stored as 1-D ``uint8``; a sample may give ``bytes``).
        codec: ``""`` (stored as is) or ``"zstd"`` (each sample's value compressed on
            its own: read at random without its neighbours).
    """

    name: str
    dtype: np.dtype
    ndim: int
    kind: str = KIND_ARRAY
    codec: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "dtype": self.dtype.str, "ndim": self.ndim, "kind": self.kind}
        if self.codec:        # absent when stored as is: older manifests stay the same
            d["codec"] = self.codec
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Field":
        """A field from a manifest (untrusted: every value is checked, the dtype parsed
        from a whitelist, never handed to numpy's general parser)."""
        kind = d.get("kind", KIND_ARRAY)
        if kind not in (KIND_ARRAY, KIND_BYTES):
            raise InvalidArgumentError(f"unknown field kind {kind!r}")
        name, ndim = d["name"], d["ndim"]
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"field name {name!r} is not a non-empty string")
        if isinstance(ndim, bool) or not isinstance(ndim, int) or not 0 <= ndim <= MAX_NDIM:
            raise InvalidArgumentError(f"field {name!r}: ndim {ndim!r} is not an integer "
                                       f"in [0, {MAX_NDIM}]")
        dtype = parse_dtype(d["dtype"], name)
        if kind == KIND_BYTES and (dtype != np.uint8 or ndim != 1):
            raise InvalidArgumentError(f"field {name!r}: a bytes field is 1-d uint8")
        codec = d.get("codec", "")
        if codec not in CODECS:
            raise InvalidArgumentError(f"field {name!r}: codec {codec!r} is not one forebay "
                                       f"reads ({', '.join(c for c in CODECS if c)})")
        return cls(name=name, dtype=dtype, ndim=ndim, kind=kind, codec=codec)


#: how a field's values may be stored: as they are, or each compressed on its own
CODECS = ("", "zstd")


#: the most dimensions a field may have (numpy's own limit is 64)
MAX_NDIM = 32
_DTYPE_RE = re.compile(r"[<>|][biufc](1|2|4|8|16|32)")


def parse_dtype(text: Any, field: str = "") -> np.dtype:
    """A stored dtype string (``"<f4"``, ``"|u1"``, ``">i8"``...) from the whitelist of
    kinds forebay stores: bool, signed, unsigned, float and complex, with an explicit
    byte order; anything else is an :class:`InvalidArgumentError`."""
    if not isinstance(text, str) or not _DTYPE_RE.fullmatch(text):
        raise InvalidArgumentError(f"field {field!r}: dtype {text!r} is not one forebay "
                                   f"stores (byte order, kind b/i/u/f/c, size)")
    dt = np.dtype(text)
    if dt.str != text and not (dt.itemsize == 1 and text[0] == "|"):
        raise InvalidArgumentError(f"field {field!r}: dtype {text!r} is not canonical "
                                   f"(numpy reads it as {dt.str!r})")
    return dt


@dataclass(frozen=True)
class Schema:
    """Ordered fields of a dataset; ``schema["x"]`` looks one up by name."""

    fields: tuple[Field, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def __getitem__(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise NameNotFoundError(name)

    def __contains__(self, name: object) -> bool:
        return any(f.name == name for f in self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def __iter__(self):
        return iter(self.fields)

    def to_dict(self) -> dict[str, Any]:
        return {"fields": [f.to_dict() for f in self.fields]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Schema":
        fields = d["fields"]
        if not isinstance(fields, list) or not fields:
            raise InvalidArgumentError("schema fields must be a non-empty list")
        out = tuple(Field.from_dict(f) for f in fields)
        if len({f.name for f in out}) != len(out):
            raise InvalidArgumentError("schema field names repeat")
        return cls(fields=out)

    @classmethod
    def infer(cls, sample: Mapping[str, Any], where: str = "sample 0") -> "Schema":
        """Schema of the first sample; every later sample must match it."""
        if not isinstance(sample, Mapping):
            raise SchemaError(f"{where}: a sample must be a mapping of field name to array, "
                              f"got {type(sample).__name__}")
        if not sample:
            raise SchemaError(f"{where}: a sample needs at least one field")
        fields = []
        for name, value in sample.items():
            if not isinstance(name, str) or not name:
                raise SchemaError(f"{where}: field names must be non-empty strings, got {name!r}")
            arr, kind = as_field_array(value, name, where)
            fields.append(Field(name=name, dtype=arr.dtype, ndim=arr.ndim, kind=kind))
        return cls(fields=tuple(fields))

    def describe(self) -> str:
        parts = []
        for f in self.fields:
            parts.append((f"{f.name}: bytes" if f.kind == KIND_BYTES
                          else f"{f.name}: {f.dtype.name}[{f.ndim}d]")
                         + (f" ({f.codec})" if f.codec else ""))
        return ", ".join(parts)

    @property
    def coded(self) -> bool:
        """Whether any field is stored compressed."""
        return any(f.codec for f in self.fields)


def as_field_array(value: Any, name: str, where: str) -> tuple[np.ndarray, str]:
    """Turn one field value into a C-contiguous numpy array and its kind.

    ``bytes``/``bytearray``/``memoryview`` become 1-D ``uint8`` of kind ``"bytes"``;
    anything array-like (numpy arrays, scalars, torch tensors) becomes an array.
    Raises :class:`UnsupportedDtypeError` for object, str, datetime and structured data.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return np.frombuffer(value, dtype=np.uint8), KIND_BYTES
    if not isinstance(value, np.ndarray):
        if hasattr(value, "detach") and hasattr(value, "numpy"):  # torch.Tensor
            value = value.detach().cpu().numpy()
        elif isinstance(value, str):
            raise UnsupportedDtypeError(
                f"{where}, field {name!r}: str values are not stored; encode them to bytes")
        else:
            value = np.asarray(value)
    if value.dtype.kind not in _STORABLE_KINDS:
        raise UnsupportedDtypeError(
            f"{where}, field {name!r}: dtype {value.dtype} is not supported "
            f"(numeric or bool arrays, or bytes blobs only)")
    # asarray(order="C"), not ascontiguousarray: the latter turns 0-d into 1-d.
    return np.asarray(value, order="C"), KIND_ARRAY

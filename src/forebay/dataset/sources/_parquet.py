"""Parquet files and Arrow IPC files (pyarrow): a row is a sample, a column a field; row
groups (Parquet) or files (Arrow) are the units read in parallel."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ...errors import InvalidArgumentError, SourceError, UnsupportedDtypeError
from ._base import Source, check_keys, list_files, register_source
from ._numpy import Stacked

__all__ = ["ArrowSource", "ParquetSource"]

NULLS = ("refuse", "zero")


def _column(col: Any, name: str, n: int, nulls: str, where: str) -> Any:
    """One column of a row group as an array stacked along axis 0 (fixed shapes) or a
    list of per-row arrays (lists of varying length, binary, strings)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = col.type
    if pa.types.is_dictionary(t):
        col = col.dictionary_decode()
        t = col.type
    if col.null_count:
        if nulls == "refuse":
            raise SourceError(f"{where}: column {name!r} has {col.null_count} null value(s); "
                              f"a sample cannot hold a null (nulls='zero', --nulls zero: "
                              f"zero, or empty for lists and bytes)")
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_binary(t) or \
                pa.types.is_large_binary(t) or pa.types.is_string(t) or \
                pa.types.is_large_string(t):
            empty = pa.scalar([], type=t) if pa.types.is_list(t) or pa.types.is_large_list(t) \
                else pa.scalar(b"" if "binary" in str(t) else "", type=t)
            col = pc.fill_null(col, empty)
        elif pa.types.is_fixed_size_list(t):
            raise SourceError(f"{where}: column {name!r}: nulls in fixed-size lists are not "
                              f"filled; clean them first")
        else:
            col = pc.fill_null(col, pa.scalar(0, type=t) if not pa.types.is_boolean(t)
                               else pa.scalar(False))
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t):
        return col.to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_list(t):
        inner = _column(col.flatten(), name, len(col) * t.list_size, nulls, where)
        if isinstance(inner, list):
            raise UnsupportedDtypeError(f"{where}: column {name!r}: a fixed-size list of "
                                        f"{t.value_type} is not stored")
        return inner.reshape(len(col), t.list_size, *inner.shape[1:])
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        values = _column(col.values, name, len(col.values), nulls, where)
        if isinstance(values, list):
            raise UnsupportedDtypeError(f"{where}: column {name!r}: lists of {t.value_type} "
                                        f"(lists of lists, of bytes) are not stored")
        off = col.offsets.to_numpy()
        values = values[off[0]:off[-1]]
        return np.split(values, (off[1:-1] - off[0]).tolist())
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t) or \
            pa.types.is_large_string(t):
        # the bytes (a string's UTF-8), one uint8 array per row over one buffer
        offsets_type = np.int64 if "large" in str(t) else np.int32
        bufs = col.buffers()
        off = np.frombuffer(bufs[1], dtype=offsets_type)[col.offset:col.offset + n + 1]
        data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None \
            else np.zeros(0, np.uint8)
        return np.split(data[off[0]:off[-1]], (off[1:-1] - off[0]).astype(np.int64).tolist())
    raise UnsupportedDtypeError(f"{where}: column {name!r} has type {t}; forebay stores "
                                f"numbers, booleans, lists of them, binary and strings "
                                f"(--keys leaves it out)")


def _storable(t: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or \
            pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t) \
            or pa.types.is_large_string(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        v = t.value_type
        return pa.types.is_boolean(v) or pa.types.is_integer(v) or pa.types.is_floating(v) \
            or (pa.types.is_fixed_size_list(t) and _storable(v) and not pa.types.is_binary(v))
    return False


class _Columnar(Source):
    """What the Parquet and Arrow sources share: the columns chosen and checked the same
    way in every file, a null policy, a table read into samples."""

    keys: Optional[list[str]]

    def _setup(self, keys: Optional[Sequence[str]], nulls: Optional[str]) -> None:
        self.nulls = nulls or "refuse"
        if self.nulls not in NULLS:
            raise InvalidArgumentError(f"nulls must be one of {NULLS}, got {nulls!r}")
        self._asked = keys
        self.keys = None

    def _choose(self, path: Path, schema: Any) -> list[str]:
        """The chosen columns of the file at ``path`` (its Arrow ``schema``): present,
        storable, and the first file's."""
        chosen = check_keys(list(dict.fromkeys(schema.names)), self._asked, str(path))
        for name in chosen:
            if not _storable(schema.field(name).type):
                raise UnsupportedDtypeError(
                    f"{path}: column {name!r} has type {schema.field(name).type}; forebay "
                    f"stores numbers, booleans, lists of them, binary and strings "
                    f"(--keys leaves it out)")
        if self.keys is None:
            self.keys = chosen
        elif chosen != self.keys:
            raise SourceError(f"{path}: columns {chosen} differ from the first file's "
                              f"{self.keys}")
        return chosen

    def _samples(self, table: Any, where: str) -> Stacked:
        n = table.num_rows
        return Stacked({name: _column(table.column(name), name, n, self.nulls, where)
                        for name in table.column_names}, n)

    def metadata(self) -> dict[str, Any]:
        return {"source_kind": self.kind, "columns": self.keys}


@register_source
class ParquetSource(_Columnar):
    """One Parquet file, or a directory of them (sorted by path): each row a sample,
    each column a field (``keys`` selects and orders columns).  Numbers and booleans are
    0-d fields; list columns ragged 1-d fields; fixed-size lists fixed shapes; binary
    and string columns bytes (UTF-8 for strings); dictionary columns decoded.  A null
    is refused unless ``nulls="zero"`` (0, False, or empty).  Row groups are the units
    read in parallel (``workers``)."""

    kind = "parquet"
    unit_name = "row group"

    def __init__(self, root: "str | os.PathLike[str]", *, keys: Optional[Sequence[str]] = None,
                 nulls: Optional[str] = None, follow_links: bool = False,
                 **unused: Any) -> None:
        import pyarrow.parquet as pq

        self._setup(keys, nulls)
        self.files = list_files(root, [".parquet", ".pq"], "Parquet", follow_links)
        self._units: list[tuple[Path, int]] = []
        for path in self.files:
            try:
                pf = pq.ParquetFile(path)
                md, schema = pf.metadata, pf.schema_arrow
            except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
                raise SourceError(f"{path}: cannot read as Parquet ({type(e).__name__}: "
                                  f"{e})") from None
            chosen = self._choose(path, schema)
            if self.nulls == "refuse":
                self._no_nulls(md, path, chosen)
            self._units += [(path, g) for g in range(md.num_row_groups)
                            if md.row_group(g).num_rows]

    @staticmethod
    def _no_nulls(md: Any, path: Path, chosen: list[str]) -> None:
        """Refuse at once a chosen column whose statistics count nulls (the read of a
        row group checks again where a writer kept no statistics)."""
        for c in range(md.num_columns):
            col = md.schema.column(c)
            name = col.path.split(".")[0]
            if name not in chosen or col.max_repetition_level:   # nested: counted per item
                continue
            count = 0
            for g in range(md.num_row_groups):
                st = md.row_group(g).column(c).statistics
                if st is not None and st.has_null_count:
                    count += st.null_count
            if count:
                raise SourceError(f"{path}: column {name!r} has {count} null value(s); a "
                                  f"sample cannot hold a null (nulls='zero', --nulls zero: "
                                  f"zero, or empty for lists and bytes)")

    def units(self) -> list[tuple[Path, int]]:
        return self._units

    def read_unit(self, unit: tuple[Path, int]) -> Stacked:
        import pyarrow.parquet as pq

        path, group = unit
        where = f"{path} (row group {group})"
        try:
            table = pq.ParquetFile(path).read_row_group(group, columns=self.keys)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
            raise SourceError(f"{where}: cannot read ({type(e).__name__}: {e})") from None
        return self._samples(table, where)


def _open_ipc(path: Path) -> Any:
    """An Arrow IPC file (random access) or stream (what Hugging Face ``datasets``'
    ``save_to_disk`` writes) as a reader of record batches."""
    import pyarrow as pa

    try:
        return pa.ipc.open_file(path)
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(path)


@register_source
class ArrowSource(_Columnar):
    """Arrow IPC files or streams (``.arrow``; a Hugging Face ``datasets`` directory
    saved with ``save_to_disk``, or its hub cache): as :class:`ParquetSource`, a file
    being the unit read in parallel."""

    kind = "arrow"

    def __init__(self, root: "str | os.PathLike[str]", *, keys: Optional[Sequence[str]] = None,
                 nulls: Optional[str] = None, follow_links: bool = False,
                 **unused: Any) -> None:
        self._setup(keys, nulls)
        self.files = list_files(root, [".arrow"], "Arrow", follow_links)
        for path in self.files:
            try:
                schema = _open_ipc(path).schema
            except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
                raise SourceError(f"{path}: cannot read as Arrow IPC ({type(e).__name__}: "
                                  f"{e})") from None
            self._choose(path, schema)

    def units(self) -> list[Path]:
        return self.files

    def read_unit(self, path: Path) -> Stacked:
        try:
            table = _open_ipc(path).read_all().select(self.keys)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
            raise SourceError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
        return self._samples(table, str(path))

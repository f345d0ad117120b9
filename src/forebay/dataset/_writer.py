"""Streaming, atomic, checksummed writer of packed datasets."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Mapping, Optional

import numpy as np
import xxhash

from .._version import __version__
from ..errors import EmptySourceError, InvalidArgumentError, SchemaError, UsageError
from ..progress import Progress, as_progress
from .._fs import check_target, commit_dir, new_tmp_dir
from ._format import ALIGNMENT, MANIFEST_NAME, IndexLayout, Manifest, ShardInfo, checksum
from ._format import replace_problem
from ._codec import Compressor, parse_compress
from ._schema import Schema, as_field_array

__all__ = ["DatasetWriter", "write_dataset", "DEFAULT_SHARD_BYTES"]

DEFAULT_SHARD_BYTES = 256 << 20
_ZEROS = bytes(ALIGNMENT)


def _pad(n: int) -> int:
    return (-n) % ALIGNMENT


class DatasetWriter:
    """Write samples one by one into a packed dataset at ``path``.

    Everything goes to a temporary sibling directory, which is fsynced and renamed
    to ``path`` by :meth:`close`; an interrupted or failed write leaves nothing at
    ``path`` (and, with ``overwrite=True``, the previous dataset intact).

    Args:
        path: output directory.
        shard_bytes: a new shard starts when the current one would grow past this.
        overwrite: replace an existing dataset at ``path`` (or an empty directory);
            anything else there is refused with :class:`DatasetExistsError`, never deleted.
        metadata: JSON-serializable mapping stored in the manifest (``ds.metadata``).
        progress: a :class:`forebay.progress.Progress` hook, updated per sample.
        compress: ``"zstd"`` / ``"zstd:LEVEL"`` (every field) or ``{field:
            "zstd[:LEVEL]"}``: those fields stored as one zstd frame per sample (read at
            random without their neighbours; ``docs/format.md``).  Default: as is.

    Use as a context manager: leaving the block by an exception aborts the write.
    """

    def __init__(self, path: "str | os.PathLike[str]", *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 overwrite: bool = False, metadata: Optional[Mapping[str, Any]] = None,
                 progress: "Progress | bool | None" = None, compress: Any = None) -> None:
        self.path = Path(path)
        self._compress_spec = compress
        self._compressors: dict[int, Compressor] = {}
        if shard_bytes <= 0:
            raise InvalidArgumentError(f"shard_bytes must be positive, got {shard_bytes}")
        self.shard_bytes = int(shard_bytes)
        self.overwrite = overwrite
        self.metadata = dict(metadata or {})
        check_target(self.path, self.overwrite, replace_problem)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp, self._live = new_tmp_dir(self.path)
        self._progress = as_progress(progress)
        self.schema: Optional[Schema] = None
        self._layout: Optional[IndexLayout] = None
        self._shards: list[ShardInfo] = []
        self._file: Optional[BinaryIO] = None
        self._shard_hash: Any = None
        self._shard_pos = 0
        self._rows: Optional[np.ndarray] = None
        self._nrows = 0
        self._count = 0
        self._payload = 0
        self._closed = False
        self._buf = bytearray(1 << 16)

    # -- public -----------------------------------------------------------------
    def add(self, sample: Mapping[str, Any]) -> None:
        """Append one sample (a mapping of field name to array or bytes)."""
        if self._closed:
            raise UsageError("writer is closed")
        where = f"sample {self._count}"
        if self.schema is None:
            self._set_schema(Schema.infer(sample, where))
        arrays = self._check(sample, where)
        shapes = [a.shape for a in arrays]
        for k, compressor in self._compressors.items():   # stored: the value's frame
            arrays[k] = compressor(arrays[k])
        layout = self._layout
        assert layout is not None and self.schema is not None
        # Lay the record out: each field at an aligned offset relative to the record start.
        offsets, rel = [], 0
        for a in arrays:
            rel += _pad(rel)
            offsets.append(rel)
            rel += a.nbytes
        rec_len = rel
        start = self._shard_pos + _pad(self._shard_pos)
        if self._file is not None and self._nrows and start + rec_len > self.shard_bytes:
            self._finish_shard()
        if self._file is None:
            self._open_shard()
            start = 0
        # Assemble padding + record in one reused buffer: one write, one hash per sample.
        lead = start - self._shard_pos
        need = lead + rec_len
        if len(self._buf) < need:
            self._buf = bytearray(max(need, 2 * len(self._buf)))
        mv = memoryview(self._buf)
        pos = 0
        for a, off in zip(arrays, offsets):
            off += lead
            if off > pos:
                mv[pos:off] = _ZEROS[: off - pos]
            if a.nbytes:
                mv[off:off + a.nbytes] = a.reshape(-1).view(np.uint8).data
            pos = off + a.nbytes
        chunk = mv[:need]
        assert self._file is not None
        self._file.write(chunk)
        self._shard_hash.update(chunk)
        self._shard_pos += need
        rec_sum = xxhash.xxh3_64_intdigest(mv[lead:need])
        row = self._next_row()
        row[IndexLayout.REC_OFF] = start
        row[IndexLayout.REC_LEN] = rec_len
        row[IndexLayout.REC_SUM] = np.uint64(rec_sum).view(np.int64)
        for f, a, off, shape in zip(self.schema.fields, arrays, offsets, shapes):
            row[layout.off[f.name]] = off
            row[layout.nbytes[f.name]] = a.nbytes
            row[layout.shape[f.name]] = shape
            self._payload += a.nbytes
        self._count += 1
        self._progress.update(1)

    def add_many(self, samples: Iterable[Mapping[str, Any]]) -> None:
        for s in samples:
            self.add(s)

    def close(self) -> Manifest:
        """Finish the last shard, write the manifest and move the dataset into place."""
        if self._closed:
            raise UsageError("writer is closed")
        try:
            if self._count == 0:
                raise EmptySourceError(f"no samples were written to {self.path}")
            self._finish_shard()
            assert self.schema is not None
            manifest = Manifest(num_samples=self._count, schema=self.schema,
                                shards=tuple(self._shards), payload_nbytes=self._payload,
                                metadata=self.metadata, created_by=f"forebay {__version__}",
                                fingerprint="")
            text = manifest.to_json().encode()
            self._write_file(self._tmp / MANIFEST_NAME, text)
            self._commit()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._progress.close()
        return Manifest.read(self.path)

    def abort(self) -> None:
        """Discard everything written so far; nothing is left at ``path``.  Never
        fails on the file it drops: on a full disk closing it flushes into the same
        ENOSPC, and the temporary directory must go all the same."""
        try:
            if self._file is not None:
                f, self._file = self._file, None
                try:
                    f.close()
                except OSError:
                    pass        # what it could not flush is discarded anyway
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._live.release()
            self._closed = True
            self._progress.close()

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._closed:
            return
        if exc_type is None:
            self.close()
        else:
            self.abort()

    @property
    def num_samples(self) -> int:
        return self._count

    # -- internals ----------------------------------------------------------------
    def _set_schema(self, schema: Schema) -> None:
        """The samples' schema, with the codecs ``compress=`` asked for."""
        import dataclasses

        levels = parse_compress(self._compress_spec, schema.names)
        fields = tuple(dataclasses.replace(f, codec="zstd") if f.name in levels else f
                       for f in schema.fields)
        self.schema = Schema(fields=fields)
        self._layout = IndexLayout(self.schema)
        self._compressors = {k: Compressor(levels[f.name])
                             for k, f in enumerate(fields) if f.name in levels}

    def _check(self, sample: Mapping[str, Any], where: str) -> list[np.ndarray]:
        schema = self.schema
        assert schema is not None
        if not isinstance(sample, Mapping):
            raise SchemaError(f"{where}: a sample must be a mapping of field name to array, "
                              f"got {type(sample).__name__}")
        if len(sample) != len(schema) or any(name not in sample for name in schema.names):
            missing = [n for n in schema.names if n not in sample]
            extra = [n for n in sample if n not in schema]
            raise SchemaError(f"{where}: fields differ from the schema ({schema.describe()}): "
                              f"missing {missing}, unexpected {extra}")
        out = []
        for f in schema.fields:
            a, _ = as_field_array(sample[f.name], f.name, where)
            if a.dtype != f.dtype:
                raise SchemaError(f"{where}, field {f.name!r}: dtype {a.dtype.str} differs from "
                                  f"the schema's {f.dtype.str} (set by sample 0)")
            if a.ndim != f.ndim:
                raise SchemaError(f"{where}, field {f.name!r}: {a.ndim}-d array, the schema "
                                  f"has {f.ndim}-d (set by sample 0)")
            out.append(a)
        return out

    def _next_row(self) -> np.ndarray:
        assert self._layout is not None
        if self._rows is None:
            self._rows = np.zeros((1024, self._layout.ncols), dtype=np.int64)
        elif self._nrows == len(self._rows):
            self._rows = np.concatenate([self._rows, np.zeros_like(self._rows)])
        row = self._rows[self._nrows]
        self._nrows += 1
        return row

    def _shard_names(self, k: int) -> tuple[str, str]:
        return f"shard-{k:05d}.bin", f"shard-{k:05d}.idx.npy"

    def _open_shard(self) -> None:
        data_name, _ = self._shard_names(len(self._shards))
        self._file = open(self._tmp / data_name, "wb", buffering=8 << 20)
        self._shard_hash = xxhash.xxh3_64()
        self._shard_pos = 0
        self._nrows = 0

    def _finish_shard(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        data_name, index_name = self._shard_names(len(self._shards))
        assert self._rows is not None
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(self._rows[: self._nrows]).astype("<i8"),
                allow_pickle=False)
        index_bytes = buf.getvalue()
        self._write_file(self._tmp / index_name, index_bytes)
        self._shards.append(ShardInfo(
            data=data_name, index=index_name, num_samples=self._nrows,
            data_nbytes=self._shard_pos, data_checksum=self._shard_hash.hexdigest(),
            index_nbytes=len(index_bytes), index_checksum=checksum(index_bytes)))
        self._rows = None
        self._nrows = 0

    @staticmethod
    def _write_file(path: Path, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def _commit(self) -> None:
        self._live.release()
        commit_dir(self._tmp, self.path, self.overwrite, replace_problem)


def write_dataset(path: "str | os.PathLike[str]", samples: Iterable[Mapping[str, Any]], *,
                  shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                  metadata: Optional[Mapping[str, Any]] = None,
                  progress: "Progress | bool | None" = None,
                  compress: Any = None) -> Manifest:
    """Write an iterable of samples to a packed dataset at ``path``; return its manifest.

    The schema is inferred from the first sample; every later sample must have the
    same fields, dtypes and ranks (shapes may differ) or a :class:`SchemaError` names
    the sample index and field.  The write is atomic: on any error nothing is left
    at ``path``.  Raises :class:`DatasetExistsError` if ``path`` exists and
    ``overwrite`` is false, :class:`EmptySourceError` if ``samples`` is empty.
    ``compress``: fields stored compressed, as :class:`DatasetWriter` says.
    """
    w = DatasetWriter(path, shard_bytes=shard_bytes, overwrite=overwrite, metadata=metadata,
                      progress=progress, compress=compress)
    try:
        w.add_many(samples)
    except BaseException:
        w.abort()
        raise
    return w.close()

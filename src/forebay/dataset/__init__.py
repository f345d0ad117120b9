"""Packed datasets: format, writer, reader and ingest sources."""

from ._batch import (BufferPool, FieldBatch, ReadOnly, SampleBatch, SampleViews, assemble_batch,
                     assemble_views, gather_ranges)
from ._format import (ALIGNMENT, CODED_FORMAT_VERSION, FORMAT_VERSION, IndexLayout, Manifest,
                      checksum, seal_manifest)
from ._pinned import PinnedPages, can_lock
from ._reader import PackedDataset, open_dataset
from ._concat import ConcatDataset, open_locator
from ._verify import VerifyReport
from ._schema import CODECS, KIND_BYTES, Field, Schema
from ._writer import DEFAULT_SHARD_BYTES, DatasetWriter, write_dataset
from ._append import append, generations, wait_for
from ._decoded import decompressed, value_nbytes
from ._prefix import PrefixDataset, prefix_fingerprint
from ._serve import DatasetServer, mirror, serve_dataset

__all__ = [
    "ALIGNMENT", "BufferPool", "CODED_FORMAT_VERSION", "ConcatDataset", "DEFAULT_SHARD_BYTES",
    "FORMAT_VERSION", "KIND_BYTES", "CODECS", "DatasetWriter", "open_locator",
    "Field", "FieldBatch", "IndexLayout", "Manifest", "PackedDataset", "PinnedPages", "ReadOnly",
    "SampleBatch", "SampleViews", "Schema", "VerifyReport", "assemble_batch",
    "assemble_views", "can_lock", "checksum", "gather_ranges", "open_dataset", "seal_manifest",
    "write_dataset", "append", "generations", "wait_for", "decompressed", "value_nbytes",
    "PrefixDataset", "prefix_fingerprint", "DatasetServer", "mirror", "serve_dataset",
]

"""Packed datasets: format, writer, reader and ingest sources."""

from ._batch import FieldBatch, SampleBatch
from ._format import ALIGNMENT, FORMAT_VERSION, Manifest
from ._reader import PackedDataset, VerifyReport, open_dataset
from ._schema import Field, Schema
from ._writer import DEFAULT_SHARD_BYTES, DatasetWriter, write_dataset

__all__ = [
    "ALIGNMENT", "DEFAULT_SHARD_BYTES", "FORMAT_VERSION", "DatasetWriter", "Field",
    "FieldBatch", "Manifest", "PackedDataset", "SampleBatch", "Schema", "VerifyReport",
    "open_dataset", "write_dataset",
]

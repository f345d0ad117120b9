"""Ingest sources: each reads one kind of input into samples (see ``forebay ingest``)."""

from ._base import SOURCES, Source, get_source, ingest, list_files, register_source, units_per_task
from ._dlio import DlioSource, dlio_files, source_fingerprint
from ._hdf5 import Hdf5Source
from ._imagefolder import ImageFolderSource
from ._litdata import LitdataSource
from ._mds import MdsSource
from ._numpy import NpySource, NpzSource, Stacked
from ._parquet import ArrowSource, ParquetSource
from ._pickle import PickleSource
from ._remote import REMOTE_SCHEMES, StagedSource, is_remote
from ._webdataset import WebDatasetSource
from ._zarr import ZarrSource

__all__ = [
    "SOURCES", "Source", "get_source", "ingest", "list_files", "register_source", "units_per_task",
    "DlioSource", "dlio_files", "source_fingerprint", "Hdf5Source", "ImageFolderSource",
    "NpySource", "NpzSource", "ParquetSource", "ArrowSource", "PickleSource", "Stacked",
    "WebDatasetSource", "ZarrSource", "MdsSource", "LitdataSource", "REMOTE_SCHEMES",
    "StagedSource", "is_remote",
]

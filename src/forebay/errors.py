"""One error hierarchy for forebay.

Every error forebay raises on purpose derives from :class:`ForebayError`.  Errors
that mean "this data is damaged or malformed" also derive from :class:`ValueError`,
a missing path also from :class:`FileNotFoundError`, so callers can catch ours or
the builtin they already expect.
"""

from __future__ import annotations

__all__ = [
    "ForebayError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "UsageError",
    "MissingDependencyError",
    "NameNotFoundError",
    "PathNotFoundError",
    "ConnectionClosedError",
    "CorruptDatasetError",
    "ChecksumError",
    "TruncatedShardError",
    "ManifestError",
    "FormatVersionError",
    "SchemaError",
    "UnsupportedDtypeError",
    "DatasetExistsError",
    "DatasetNotFoundError",
    "SampleIndexError",
    "EmptySourceError",
    "SourceError",
    "UntrustedPickleError",
    "ModelRepositoryError",
    "ModelNotFoundError",
    "CorruptModelError",
    "ModelMismatchError",
    "RankMismatchError",
    "LaunchError",
    "WaitTimeoutError",
    "DatasetServerError",
]


class ForebayError(Exception):
    """Base class of every error forebay raises on purpose."""


class InvalidArgumentError(ForebayError, ValueError):
    """An argument is out of range or contradicts another (a negative size, an unknown
    mode, a width that does not divide the world...)."""


class ArgumentTypeError(ForebayError, TypeError):
    """An argument has the wrong type (a float sample id, a list where a module goes)."""


class UsageError(ForebayError, RuntimeError):
    """A call in the wrong state (a closed writer)."""


class MissingDependencyError(ForebayError, ImportError):
    """An optional dependency a feature needs is not installed; the message names the
    pip extra."""


class PathNotFoundError(ForebayError, FileNotFoundError):
    """A path the user named (a trace directory, an input file) does not exist."""


class NameNotFoundError(ForebayError, KeyError):
    """A field or entry name that does not exist."""


class ConnectionClosedError(ForebayError, ConnectionError):
    """The other end of a connection closed it in the middle of a message."""


class CorruptDatasetError(ForebayError, ValueError):
    """A packed dataset on disk is damaged: its bytes do not match what was written."""


class ChecksumError(CorruptDatasetError):
    """A checksum over shard, index or sample bytes does not match the manifest."""


class TruncatedShardError(CorruptDatasetError):
    """A shard or index file is shorter (or longer) than the manifest records."""


class ManifestError(CorruptDatasetError):
    """The manifest is missing a key, is not valid JSON, or contradicts itself."""


class FormatVersionError(ManifestError):
    """The dataset was written in a format version this forebay cannot read."""


class SchemaError(ForebayError, ValueError):
    """A sample does not match the dataset schema (fields, dtypes or ranks)."""


class UnsupportedDtypeError(SchemaError, TypeError):
    """A field has a dtype forebay does not store (object, str, datetime, structured)."""


class DatasetExistsError(ForebayError, FileExistsError):
    """The output path exists and ``overwrite`` was not given, or it holds something
    ``overwrite`` must not replace (anything but what forebay wrote there, or an empty
    directory)."""


class DatasetNotFoundError(ForebayError, FileNotFoundError):
    """A dataset, source or one of its files does not exist."""


class SampleIndexError(ForebayError, IndexError):
    """A sample index is outside ``[-len(ds), len(ds))``."""


class EmptySourceError(ForebayError, ValueError):
    """An ingest source or sample iterable holds no samples."""


class SourceError(ForebayError, ValueError):
    """A source file cannot be read as the chosen kind (missing key, bad layout...)."""


class UntrustedPickleError(ForebayError, PermissionError):
    """Pickle sources run code when read; they need an explicit ``trust_pickle=True``."""


class ModelRepositoryError(ForebayError):
    """A model repository operation failed (bad URL, bad name, unusable store)."""


class ModelNotFoundError(ModelRepositoryError, KeyError):
    """No model of that name, or no such version of it."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CorruptModelError(ModelRepositoryError, ValueError):
    """Stored bytes do not match their hash (the message names model, version, tensor)."""


class ModelMismatchError(ModelRepositoryError, ValueError):
    """A module to load into has other tensor names, shapes or dtypes than the stored
    model (the message lists every mismatch)."""


class ReduceError(ForebayError, RuntimeError):
    """A gradient reduction could not complete (coordinator shut down, a peer rank died or
    timed out, a collective failed); the message names the tensor and the cause."""


class ReduceMismatchError(ReduceError, ValueError):
    """Ranks submitted the same tensor name with different shapes, dtypes, ops or groups
    (the message lists what each side sent)."""


class RankMismatchError(ForebayError, ValueError):
    """The ranks of one job passed different values for something that must be the
    same on every rank (seed, batch size, width, dataset, ...); raised on every rank,
    naming the parameter and each rank's value."""


class LaunchError(ForebayError, RuntimeError):
    """The launcher reports several ranks that forebay's data plane cannot reach (no
    mpi4py, an mpi4py built for another MPI, torchrun without MPI): raised on every
    rank instead of running each as a world of one."""


class WaitTimeoutError(ForebayError, TimeoutError):
    """What a consumer waited for (samples a producer has not published yet) did not
    come within its timeout."""


class DatasetServerError(ForebayError, ConnectionError):
    """A dataset server (a producer's node serving its dataset: ``forebay serve``) does
    not answer, refused the request, or answered something a mirror cannot use."""

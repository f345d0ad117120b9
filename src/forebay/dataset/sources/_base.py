"""The ingest-source interface, the registry of sources, and the ingest driver."""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from itertools import islice
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Sequence

from ...errors import DatasetNotFoundError, EmptySourceError, InvalidArgumentError, SourceError
from ...progress import Progress, as_progress
from .._format import Manifest
from .._writer import DEFAULT_SHARD_BYTES, DatasetWriter

__all__ = ["Source", "SOURCES", "register_source", "get_source", "ingest", "list_files",
           "units_per_task", "confine", "inside"]


class Source:
    """One kind of input: lists picklable work *units* and reads each into samples.

    ``units()`` runs once in the calling process; ``read_unit(unit)`` may run in a
    worker process, so a source holds only paths and options (open files there,
    never before a fork).  Units are read and written in order: ingest is
    deterministic whatever the number of workers.
    """

    kind: ClassVar[str] = ""

    def __init__(self, root: "str | os.PathLike[str]", **options: Any) -> None:
        raise NotImplementedError
    #: what a unit is, for the progress bar
    unit_name: ClassVar[str] = "file"

    def units(self) -> Sequence[Any]:
        raise NotImplementedError

    def read_unit(self, unit: Any) -> Sequence[dict[str, Any]]:
        """The unit's samples, in order (a list, or a lazy sequence that makes each
        sample when iterated; it must pickle, for reader processes)."""
        raise NotImplementedError

    def metadata(self) -> dict[str, Any]:
        """Extra manifest metadata (class names, source kind...)."""
        return {"source_kind": self.kind}

    def close(self) -> None:
        """Release what ``units()`` made (the ingest driver calls it at the end; a
        source at an object-store URL removes its local copy here)."""


SOURCES: dict[str, type[Source]] = {}
#: URL schemes read through an object store (sources/_remote.py)
REMOTE_SCHEMES = ("s3://",)
#: what makes a source at such a URL: set by sources/_remote.py when it is imported
_remote_source: Optional[Callable[..., Source]] = None


def is_remote(root: Any) -> bool:
    """Whether ``root`` is an object-store URL rather than a local path."""
    return isinstance(root, str) and root.startswith(REMOTE_SCHEMES)


def register_remote(factory: Callable[..., Source]) -> None:
    """How :func:`get_source` makes a source at an object-store URL (``factory(kind,
    url, **options)``)."""
    global _remote_source
    _remote_source = factory


def register_source(cls: type[Source]) -> type[Source]:
    """Class decorator adding a source to :data:`SOURCES` under ``cls.kind``."""
    SOURCES[cls.kind] = cls
    return cls


def get_source(kind: str, root: "str | os.PathLike[str]", **options: Any) -> Source:
    """A source of ``kind`` over ``root``: a local path, or an object-store URL
    (``s3://bucket/prefix``: its objects are copied to a local staging directory when
    the ingest lists the units, ``stage_dir=`` says where, and removed at its end)."""
    try:
        cls = SOURCES[kind]
    except KeyError:
        raise InvalidArgumentError(f"unknown source kind {kind!r}; choose one of "
                         f"{', '.join(sorted(SOURCES))}") from None
    if is_remote(root):
        if _remote_source is None:
            raise InvalidArgumentError(f"{root}: object-store sources need "
                                       f"forebay.dataset.sources imported")
        return _remote_source(kind, str(root), **options)
    options.pop("stage_dir", None)
    options.pop("progress", None)
    return cls(root, **options)


#: what the error for a path leading outside the source tells the user to do
OPT_IN = "pass follow_links=True (forebay ingest --follow-links) if you mean it"


def inside(root: "str | os.PathLike[str]", target: "str | os.PathLike[str]") -> bool:
    """Whether ``target``, all links resolved, lies in the source ``root`` (a directory's
    tree, or the one file ``root`` names)."""
    return _within(Path(root).resolve(), Path(target))


def _within(base: Path, target: Path) -> bool:
    """:func:`inside` for a root already resolved."""
    real = target.resolve()
    return real == base if base.is_file() else real.is_relative_to(base)


def confine(root: "str | os.PathLike[str]", paths: Iterable[Path],
            follow_links: bool = False) -> list[Path]:
    """``paths`` (found under ``root``), refused with a :class:`SourceError` naming the
    first whose links lead outside ``root`` (``a.jpeg -> /etc/shadow``, a symlinked
    directory elsewhere): what someone else's dataset points at is not the dataset.
    ``follow_links``: the user opted in; nothing is checked."""
    paths = list(paths)
    if not follow_links:
        base = Path(root).resolve()                 # once, not once per file
        for p in paths:
            if not _within(base, p):
                raise SourceError(f"{p} leads outside the source {root} (to {p.resolve()}): "
                                  f"not read; {OPT_IN}")
    return paths


def list_files(root: "str | os.PathLike[str]", suffixes: Iterable[str], what: str,
               follow_links: bool = False) -> list[Path]:
    """Files under ``root`` (recursively, sorted by path) whose suffix is in ``suffixes``;
    ``root`` may also be one such file.  Links leading outside ``root`` are refused
    (:func:`confine`) unless ``follow_links``."""
    root = Path(root)
    suffixes = tuple(s.lower() for s in suffixes)
    if not root.exists():
        raise DatasetNotFoundError(f"source {root} does not exist")
    if root.is_file():
        return [root]
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in suffixes and p.is_file())
    if not files:
        raise EmptySourceError(f"source {root}: no {what} files ({', '.join(suffixes)}) found")
    return confine(root, files, follow_links)


def _die_with_parent(parent: int) -> None:
    """Worker initializer: the kernel kills this reader when the ingest process dies
    (Linux PR_SET_PDEATHSIG), so a kill -9 of ingest leaves no orphaned workers.  It
    ignores Ctrl-C: the ingest process handles it and ends its workers (one message,
    not a traceback per worker)."""
    import signal as _signal

    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:   # the parent died before the call above
        os._exit(1)


def _read_units(source: Source, units: Sequence[Any]) -> list[Sequence[dict[str, Any]]]:
    return [source.read_unit(u) for u in units]


#: a worker task holds at most this many units (one task per unit costs a pipe round
#: trip each: 10,000 one-sample files took 2.7x longer with 4 workers than with one)
MAX_UNITS_PER_TASK = 64


def units_per_task(n_units: int, workers: int) -> int:
    """Units per worker task: at least 4 tasks per worker in flight over the run (so
    the pool stays balanced), at most :data:`MAX_UNITS_PER_TASK`."""
    return max(1, min(MAX_UNITS_PER_TASK, n_units // (4 * workers)))


def ingest(source: Source, out: "str | os.PathLike[str]", *,
           shard_bytes: int = DEFAULT_SHARD_BYTES, workers: int = 1, overwrite: bool = False,
           metadata: Optional[Mapping[str, Any]] = None,
           progress: "Progress | bool | None" = None, compress: Any = None) -> Manifest:
    """Read every unit of ``source`` (``workers`` processes in parallel) and write them,
    in order, into a packed dataset at ``out``.  Atomic like :func:`write_dataset`.
    ``compress``: fields stored compressed (:class:`~forebay.dataset.DatasetWriter`).
    The source is closed at the end (:meth:`Source.close`)."""
    try:
        return _ingest(source, out, shard_bytes, workers, overwrite, metadata, progress,
                       compress)
    finally:
        source.close()


def _ingest(source: Source, out: "str | os.PathLike[str]", shard_bytes: int, workers: int,
            overwrite: bool, metadata: Optional[Mapping[str, Any]],
            progress: "Progress | bool | None", compress: Any) -> Manifest:
    units = list(source.units())
    if not units:
        raise EmptySourceError(f"{source.kind} source has nothing to ingest")
    meta = dict(source.metadata())
    meta.update(metadata or {})
    prog = as_progress(progress)
    writer = DatasetWriter(out, shard_bytes=shard_bytes, overwrite=overwrite, metadata=meta,
                           compress=compress)
    prog.start(len(units), desc=f"ingest {source.kind}", unit=source.unit_name)
    try:
        if workers <= 1:
            for u in units:
                writer.add_many(source.read_unit(u))
                prog.update(1)
        else:
            ctx = multiprocessing.get_context("spawn")
            per = units_per_task(len(units), workers)
            tasks = (units[i:i + per] for i in range(0, len(units), per))
            with ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                                     initializer=_die_with_parent,
                                     initargs=(os.getpid(),)) as ex:
                # keep 2 tasks per worker in flight, written in order; islice takes
                # exactly that many (zip(it, range(k)) would pull one more and drop it)
                pending: deque = deque(ex.submit(_read_units, source, t)
                                       for t in islice(tasks, 2 * workers))
                while pending:
                    done = pending.popleft().result()
                    for t in islice(tasks, 1):
                        pending.append(ex.submit(_read_units, source, t))
                    for samples in done:
                        writer.add_many(samples)
                        prog.update(1)
    except BaseException:
        writer.abort()
        prog.close()
        raise
    prog.close()
    if writer.num_samples == 0:
        writer.abort()
        raise EmptySourceError(f"{source.kind} source holds no samples")
    return writer.close()


def check_keys(available: Sequence[str], keys: Optional[Sequence[str]], where: str) -> list[str]:
    """The selected keys, in the order asked for; a missing one is a :class:`SourceError`."""
    if not keys:
        return list(available)
    missing = [k for k in keys if k not in available]
    if missing:
        raise SourceError(f"{where}: no {', '.join(map(repr, missing))} "
                          f"(has {', '.join(map(repr, available))})")
    return list(keys)

"""forebay as a data loader of the DLIO benchmark (argonne-lcf/dlio_benchmark).

Name one class in a DLIO workload config and run DLIO as usual::

    reader:
      data_loader: pytorch
      data_loader_classname: forebay.dlio.ForebayPreload   # or ForebayClairvoyant,
                                                           # ForebayDirect, ForebayLoader (auto)

On its first epoch rank 0 packs the files DLIO would read (its ``file_list_train`` /
``file_list_eval``, in DLIO's order) into a forebay dataset, when it is missing or the
files changed since (names, sizes, times; ``check_content`` adds their bytes); the
other ranks wait, and a failure is raised on every rank.  Batches then come from
forebay's loader on DLIO's MPI communicator, with DLIO's batch size, seed, epochs and
shuffle, ``drop_last`` as DLIO's own torch loader.  An epoch DLIO leaves early
(``total_training_steps``) still counts; the store is closed after the last epoch.
With forebay's tracing on (``FOREBAY_TRACE=DIR``) the time DLIO spends between batches
is recorded as ``compute`` (an epoch's last step too, which DLIO leaves by breaking
out of its loop), so ``forebay analyze`` splits overlapped and unoverlapped I/O for
DLIO runs.  A dataset at the target path that was not packed from DLIO files is never
overwritten.

Settings (all optional), from a TOML file named by ``FOREBAY_DLIO_CONFIG`` (a
``[dlio]`` table) and then ``FOREBAY_DLIO_<NAME>`` environment variables:

=============== ==================================================================
dataset         where the packed dataset goes: a path, ``{data_folder}`` and
                ``{split}`` (train, valid) filled in; default
                ``{data_folder}/{split}.forebay``
mode            preload, clairvoyant, direct or auto (default: the class's)
ram_bytes       clairvoyant RAM tier per rank (bytes or "8GiB")
ssd_dir         clairvoyant SSD tier directory; ``ssd_bytes`` its capacity
prefetch        batches fetched ahead (default: DLIO's ``prefetch_size``, at least 2)
width           ranks per replica (preload)
transport       auto, pages, shm, rma or exchange
verify_on_read  check every sample's checksum (true/false)
overlap_preload preload: train while the store loads (true, false or auto, the
                default: on a network file system; the loader's ``overlap_preload``)
check_content   judge the packed dataset stale by the files' bytes too (a full read
                of DLIO's files each run; default false: names, sizes and
                modification times only, which miss an edit that keeps both, as
                ``cp -p``, ``rsync -t`` or a restored backup make)
=============== ==================================================================
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

from . import trace as _trace
from .errors import InvalidArgumentError, MissingDependencyError, SourceError

try:
    from dlio_benchmark.common.enumerations import DataLoaderType, DatasetType, Shuffle
    from dlio_benchmark.data_loader.base_data_loader import BaseDataLoader
    _DLIO_MISSING: Optional[str] = None
except ImportError as e:   # settings() and prepare_dataset() work without DLIO
    BaseDataLoader = object
    _DLIO_MISSING = str(e)

__all__ = ["ForebayLoader", "ForebayPreload", "ForebayClairvoyant", "ForebayDirect",
           "settings", "prepare_dataset", "steps", "SETTINGS"]

#: setting name -> kind
SETTINGS = {"dataset": "str", "mode": "str", "ram_bytes": "size", "ssd_dir": "str",
            "ssd_bytes": "size", "prefetch": "int", "width": "int", "transport": "str",
            "verify_on_read": "bool", "overlap_preload": "bool or auto",
            "check_content": "bool"}


def _convert(name: str, value: Any) -> Any:
    from ._units import parse_size

    kind = SETTINGS[name]
    try:
        if kind == "size":
            return parse_size(value) if isinstance(value, str) else int(value)
        if kind == "int":
            return int(value)
        if kind == "bool or auto" and str(value).lower() == "auto":
            return "auto"
        if kind in ("bool", "bool or auto"):
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
        else:
            return str(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        pass
    raise InvalidArgumentError(f"forebay DLIO setting {name}={value!r} is not a valid {kind}")


def settings(environ: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The plug-in's settings: the ``[dlio]`` table of the TOML file named by
    ``FOREBAY_DLIO_CONFIG``, then ``FOREBAY_DLIO_<NAME>`` variables; unknown names are
    an error (a typo never goes unnoticed)."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    path = env.get("FOREBAY_DLIO_CONFIG")
    if path:
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        with open(path, "rb") as f:
            table = tomllib.load(f).get("dlio", {})
        for k, v in table.items():
            if k not in SETTINGS:
                raise InvalidArgumentError(f"{path}: unknown [dlio] setting {k!r}; known: "
                                           f"{', '.join(SETTINGS)}")
            out[k] = _convert(k, v)
    for k, v in env.items():
        if k.startswith("FOREBAY_DLIO_") and k != "FOREBAY_DLIO_CONFIG":
            name = k[len("FOREBAY_DLIO_"):].lower()
            if name not in SETTINGS:
                raise InvalidArgumentError(f"unknown setting {k}; known: " + ", ".join(
                    "FOREBAY_DLIO_" + s.upper() for s in SETTINGS))
            out[name] = _convert(name, v)
    return out


def prepare_dataset(files: Sequence["str | os.PathLike[str]"],
                    out: "str | os.PathLike[str]", comm: Any, *,
                    check_content: bool = False) -> Path:
    """Rank 0 packs ``files`` into ``out`` when it is missing or stale (its recorded
    source fingerprint differs); every rank waits and raises if rank 0 failed.
    Collective.

    Staleness is judged by the files' names, sizes and modification times
    (:func:`~forebay.dataset.sources.source_fingerprint`); ``check_content=True`` also
    hashes every byte of the files (a full read each run) and repacks when the
    contents differ from those recorded, which catches an edit that kept the size and
    the time.  A dataset at ``out`` that was not packed from DLIO files (its
    ``source_kind`` is not ``dlio``) is never overwritten: the error names it."""
    from .dataset import open_dataset
    from .dataset.sources import DlioSource, ingest, source_fingerprint
    from .errors import ForebayError

    out = Path(out)
    msg = None
    if comm is None or comm.Get_rank() == 0:
        try:
            want = source_fingerprint(files)
            content = source_fingerprint(files, content=True) if check_content else None
            fresh = False
            if out.exists():
                try:
                    meta = open_dataset(out).manifest.metadata
                except ForebayError:
                    meta = None             # damaged or not a dataset: packed again
                if meta is not None and meta.get("source_kind") != "dlio":
                    raise SourceError(
                        f"{out} holds a forebay dataset not packed from DLIO files (source "
                        f"{meta.get('source_kind', 'unknown')}); it is not overwritten: "
                        "name another path with the plug-in's 'dataset' setting "
                        "(FOREBAY_DLIO_DATASET)")
                fresh = meta is not None and meta.get("source_fingerprint") == want and (
                    content is None or meta.get("source_content_fingerprint") == content)
            if not fresh:
                ingest(DlioSource(None, files=files, content_fingerprint=content), out,
                       overwrite=True, progress=True)
        except Exception as e:   # noqa: BLE001 - reported on every rank below
            msg = f"forebay could not pack DLIO's files into {out}: {type(e).__name__}: {e}"
    if comm is not None:
        msg = comm.bcast(msg, root=0)
    if msg:
        raise SourceError(msg)
    return out


def steps(batches: Iterable[Any]) -> Iterator[Any]:
    """``batches``, with the time the consumer spends on each (DLIO's step: compute, its
    barrier, its bookkeeping) recorded as a ``compute`` span when tracing is on.  The
    last step's span is recorded too when the consumer leaves the loop after it without
    asking for another batch (DLIO breaks out after an epoch's last step): the span ends
    when the generator is closed, which is when the consumer's loop lets it go."""
    rec = _trace.active()
    for batch in batches:
        t0 = time.perf_counter()
        try:
            yield batch
        finally:            # resumed for the next batch, or closed by a loop left early
            if rec is not None:
                rec.span("compute", "dlio.step", t0, time.perf_counter())


class ForebayLoader(BaseDataLoader):
    """DLIO data loader backed by :class:`forebay.torch.DataLoader` (``mode`` auto)."""

    mode = "auto"

    def __init__(self, format_type: Any, dataset_type: Any, epoch_number: int) -> None:
        if _DLIO_MISSING is not None:
            raise MissingDependencyError(
                f"forebay.dlio's loaders run inside the DLIO benchmark, which is not "
                f"importable here ({_DLIO_MISSING}); pip install dlio-benchmark")
        super().__init__(format_type, dataset_type, epoch_number, DataLoaderType.CUSTOM)
        self._dl: Any = None
        self._epoch = 0            # epochs started (DLIO may leave one early)

    @property
    def split(self) -> str:
        return "train" if self.dataset_type is DatasetType.TRAIN else "valid"

    def read(self) -> None:
        """Pack the data if needed and build the loader (once)."""
        if self._dl is not None:
            return
        from mpi4py import MPI

        from .torch import DataLoader, Pipeline, store_settings

        a = self._args
        cfg = settings()
        files = a.file_list_train if self.dataset_type is DatasetType.TRAIN else \
            a.file_list_eval
        template = cfg.get("dataset", "{data_folder}/{split}.forebay")
        path = Path(template.format(data_folder=a.data_folder, split=self.split))
        comm = MPI.COMM_WORLD
        prepare_dataset(files, path, comm, check_content=cfg.get("check_content", False))
        prefetch = cfg.get("prefetch", max(2, int(getattr(a, "prefetch_size", 0) or 0)))
        self._dl = DataLoader(path, self.batch_size, comm=comm, seed=int(a.seed or 0),
                              epochs=max(1, int(a.epochs)),
                              shuffle=a.sample_shuffle is not Shuffle.OFF, drop_last=True,
                              verify_on_read=cfg.get("verify_on_read"), progress=False,
                              store=store_settings(
                                  cfg.get("mode", self.mode), width=cfg.get("width"),
                                  transport=cfg.get("transport", "auto"),
                                  ram_bytes=cfg.get("ram_bytes"), ssd_dir=cfg.get("ssd_dir"),
                                  ssd_bytes=cfg.get("ssd_bytes", 0),
                                  overlap=cfg.get("overlap_preload", "auto")),
                              pipeline=Pipeline(prefetch=prefetch))

    def next(self) -> Iterator[Any]:
        """This epoch's batches (the next epoch of forebay's plan each call)."""
        super().next()
        if self._dl is None:
            self.read()
        dl = self._dl
        dl.set_epoch(min(self._epoch, dl.plan.epochs - 1))
        self._epoch += 1
        yield from steps(dl)

    def finalize(self) -> None:
        """End of an epoch (DLIO calls it after each): the store is closed after the
        last one."""
        if self._dl is not None and self._epoch >= self._dl.plan.epochs:
            self._dl.close()
            self._dl = None

    def stats(self) -> dict[str, Any]:
        return {} if self._dl is None else self._dl.stats()


class ForebayPreload(ForebayLoader):
    """The dataset striped over the ranks' memory (DDStore)."""

    mode = "preload"


class ForebayClairvoyant(ForebayLoader):
    """RAM (and SSD) tiers filled ahead of need from the access plan (NoPFS)."""

    mode = "clairvoyant"


class ForebayDirect(ForebayLoader):
    """Every batch read from the packed dataset's memory-mapped shards."""

    mode = "direct"

"""The loader's settings, grouped by concern: where samples come from (a store kind with
its settings, or a store the user built) and what happens to them on the way out (the
pipeline).  Each group is one object, documented and checked here once; a new store
needs a new settings class, not a new loader argument."""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Union

from ..dataset import PrefixDataset, open_dataset
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..store import (ClairvoyantStore, DirectStore, DistributedStore, NodeCache, SampleStore,
                     choose_mode, default_ram_bytes, node_cache_root, node_size, warm_enabled)
from ._start import START_METHODS
from ._workers import DEFAULT_TIMEOUT_S as WORKER_TIMEOUT_S

__all__ = ["Auto", "Clairvoyant", "Direct", "Pipeline", "Preload", "StoreSpec",
           "following_spec", "grown_store", "store_settings"]

PathLike = Union[str, "os.PathLike[str]"]
PfsHook = Optional[Callable[[int, int, float], None]]


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise InvalidArgumentError(f"{name} must be one of {allowed}, got {value!r}")


def _check_count(name: str, value: Any, *, positive: bool = False,
                 optional: bool = True) -> None:
    if value is None and optional:
        return
    low = 1 if positive else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a positive" if positive else "a non-negative"
        raise InvalidArgumentError(f"{name} must be {kind} integer, got {value!r}")


@dataclass(frozen=True)
class Preload:
    """Keep the whole dataset in the ranks' memory: a
    :class:`~forebay.store.DistributedStore` with ``width`` ranks per replica.

    width, node_aware, transport: replica groups and how peers' memory is read (see
        :class:`~forebay.store.DistributedStore`; default one replica over all ranks).
    overlap: start training at once while each rank loads its chunk in the background;
        batches read what has not arrived yet from the files.  ``"auto"`` (default):
        where the dataset is on a network file system or ``on_pfs_read`` is given.
    on_pfs_read: hook called with (bytes, samples, seconds) after each read of the
        dataset files (tracing, emulating a slower file system).
    node_cache: a node-local directory where each rank's chunk is kept for later jobs
        on the node (default ``FOREBAY_NODE_CACHE``; see
        :class:`~forebay.store.NodeCache`): the next job's preload reads it from
        there, checked, instead of the files.  The chunk is then loaded before the
        first batch (no ``overlap``).
    """

    width: Optional[int] = None
    node_aware: bool = False
    transport: str = "auto"
    overlap: "bool | str" = "auto"
    on_pfs_read: PfsHook = None
    node_cache: Optional[PathLike] = None
    mode: ClassVar[str] = "preload"

    def __post_init__(self) -> None:
        _check_count("Preload(width=)", self.width, positive=True)
        _check_choice("Preload(overlap=)", self.overlap, (True, False, "auto"))


@dataclass(frozen=True)
class Clairvoyant:
    """Cache what the access plan says will be needed, filled in the background (NoPFS):
    a :class:`~forebay.store.ClairvoyantStore`; the dataset may exceed memory.

    ram_bytes: this rank's RAM tier (default: half of the node's available memory
        shared by its ranks).
    ssd_dir, ssd_bytes: a node-local directory for this rank's SSD tier and its
        capacity (default: no SSD tier).
    ram_threads, ssd_threads: background fill threads per tier (default 1 each).
    ram_tier: ``"pages"`` holds the RAM tier in the files' pages, locked (one node),
        ``"copy"`` in a buffer of its own; ``"auto"`` (default): pages where they can be.
    transport: how peers' tiers are read (see :class:`~forebay.store.ClairvoyantStore`).
    warm_files: read the extents the node's tiers cover into the page cache ahead,
        with large sequential reads; ``"auto"`` (default): for small records.
    on_pfs_read: as :class:`Preload`'s.
    node_cache: a node-local directory through which the dataset's records are read
        and kept for later jobs on the node (default ``FOREBAY_NODE_CACHE``; see
        :class:`~forebay.store.NodeCache`): the next job fills its tiers from there.
        The RAM tier is then a copy (not the files' pages) and nothing is warmed.

    Fields left None take the loader's ``system=`` file's ``[tiers]`` values.
    """

    ram_bytes: Optional[int] = None
    ssd_dir: Optional[PathLike] = None
    ssd_bytes: Optional[int] = None
    ram_threads: Optional[int] = None
    ssd_threads: Optional[int] = None
    ram_tier: str = "auto"
    transport: str = "auto"
    warm_files: "bool | str" = "auto"
    on_pfs_read: PfsHook = None
    node_cache: Optional[PathLike] = None
    mode: ClassVar[str] = "clairvoyant"

    def __post_init__(self) -> None:
        _check_count("Clairvoyant(ram_bytes=)", self.ram_bytes)
        _check_count("Clairvoyant(ssd_bytes=)", self.ssd_bytes)
        _check_count("Clairvoyant(ram_threads=)", self.ram_threads, positive=True)
        _check_count("Clairvoyant(ssd_threads=)", self.ssd_threads, positive=True)
        _check_choice("Clairvoyant(warm_files=)", self.warm_files, (True, False, "auto"))


@dataclass(frozen=True)
class Direct:
    """Read each batch from the memory-mapped shards (a
    :class:`~forebay.store.DirectStore`).

    warm_files: read this node's extents into the page cache ahead (every rank on one
        node; ``"auto"`` (default): for small records).
    node_cache: a node-local directory where the records read are kept for later jobs
        (default ``FOREBAY_NODE_CACHE``; see :class:`~forebay.store.NodeCache`).
    """

    warm_files: "bool | str" = "auto"
    node_cache: Optional[PathLike] = None
    mode: ClassVar[str] = "direct"

    def __post_init__(self) -> None:
        _check_choice("Direct(warm_files=)", self.warm_files, (True, False, "auto"))


@dataclass(frozen=True)
class Auto:
    """:class:`Preload` when the dataset fits the nodes' memory at ``preload.width``, else
    :class:`Clairvoyant` (decided together by every rank); each with its settings.  With a
    ``FOREBAY_NODE_CACHE`` directory in the environment: :class:`Direct` through it."""

    preload: Preload = field(default_factory=Preload)
    clairvoyant: Clairvoyant = field(default_factory=Clairvoyant)
    mode: ClassVar[str] = "auto"


StoreSpec = Union[str, Preload, Clairvoyant, Direct, Auto, SampleStore]
KINDS: dict[str, type] = {"auto": Auto, "preload": Preload, "clairvoyant": Clairvoyant,
                          "direct": Direct}


def store_spec(store: Any) -> "Preload | Clairvoyant | Direct | Auto | SampleStore":
    """``store=`` as settings: a kind's name gives its defaults."""
    if isinstance(store, (Preload, Clairvoyant, Direct, Auto, SampleStore)):
        return store
    if isinstance(store, str) and store in KINDS:
        return KINDS[store]()
    raise InvalidArgumentError(
        f"store must be one of {tuple(KINDS)}, a Preload/Clairvoyant/Direct/Auto settings "
        f"object, or a SampleStore; got {store!r}")


def describe(spec: Any, prefix: str = "") -> dict[str, Any]:
    """What ranks must agree on in a store's settings, one flat entry each: the kind
    and what shapes the collective layout (a rank's own capacities, threads, paths and
    hooks may differ: placement gathers the capacities)."""
    if isinstance(spec, SampleStore):
        return {"store": type(spec).__name__}
    out: dict[str, Any] = {} if prefix else {"store": spec.mode}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if dataclasses.is_dataclass(value):
            out.update(describe(value, f"{prefix}{f.name}."))
        elif f.name in ("width", "node_aware", "transport", "overlap"):
            out[prefix + f.name] = value
    return out


@dataclass(frozen=True)
class Pipeline:
    """What happens to a batch between the store and the training loop.

    transform: applied to each sample dict; ``collate_fn`` then gets the list of
        transformed samples (torch's ``default_collate`` if None).
    batch_transform: applied to the whole :class:`~forebay.dataset.SampleBatch` instead.
    collate_fn: ``f(SampleBatch) -> batch``; default
        :func:`~forebay.torch.default_collate` (dense fields stacked into tensors,
        graphs batched PyG-style).
    workers: threads or processes running the transform and the collation, as torch's
        ``num_workers``; 0 (default): in the prefetch thread.  Batches reach processes
        and come back through shared memory, in plan order.  Augmentations drawn from
        :func:`forebay.torch.sample_rng` are the same whatever ``workers`` is.  A
        transform that raises or a worker that dies raises
        :class:`~forebay.torch.TransformError` naming the batch.
    worker_start: how the workers run.  ``"auto"`` (default): ``"thread"`` when the
        transform is marked :func:`~forebay.torch.releases_gil` (forebay's
        ``DecodeCropFlip`` is); else ``"fork"`` when this process has no other Python
        thread, no CUDA context and no MPI (or when the transform cannot be pickled, as
        torch's DataLoader always forks); else ``"forkserver"`` (a clean process that
        imported torch once, started with the loader, forks the workers).  ``"spawn"``:
        each worker a fresh Python.  With ``"forkserver"`` and ``"spawn"`` the transform
        must be picklable (defined at module level) and a script must build the loader
        under ``if __name__ == "__main__":``.
    worker_timeout: seconds a worker may take on one batch (default 600; None: no limit).
    prefetch: batches fetched ahead by a background thread while the model computes
        (default 4, at least 4 per worker; 0: fetch in the iterating thread).
    staging_bytes: also bound the samples waiting in that staging area by their bytes
        (one batch is always let in); None: only ``prefetch`` bounds it.
    pin_memory: batches in pinned host memory (CUDA only), for
        ``.to("cuda", non_blocking=True)``.
    views: lend the samples instead of copying them (``workers=0``): the store's
        ``get_views`` gives read-only numpy arrays over the memory that holds them; the
        default collation leaves bytes fields and fields of varying shape as lists of
        them (:func:`~forebay.torch.collate_views`).  Not with graph batches unless
        ``collate_fn`` is given.
    """

    transform: Optional[Callable] = None
    batch_transform: Optional[Callable] = None
    collate_fn: Optional[Callable] = None
    workers: int = 0
    worker_start: str = "auto"
    worker_timeout: Optional[float] = WORKER_TIMEOUT_S
    prefetch: Optional[int] = None
    staging_bytes: Optional[int] = None
    pin_memory: bool = False
    views: bool = False

    def __post_init__(self) -> None:
        _check_count("Pipeline(workers=)", self.workers, optional=False)
        _check_count("Pipeline(prefetch=)", self.prefetch)
        _check_count("Pipeline(staging_bytes=)", self.staging_bytes, positive=True)
        _check_choice("Pipeline(worker_start=)", self.worker_start, START_METHODS)
        if self.transform is not None and self.batch_transform is not None:
            raise InvalidArgumentError("give transform or batch_transform, not both")
        if self.workers and self.transform is None and self.batch_transform is None:
            raise InvalidArgumentError("workers run a transform or batch_transform; give "
                                       "one (without, the store's batch is ready)")


#: the loader's keywords before the grouping: the store kinds' settings (with
#: ``overlap_preload`` for Preload's ``overlap``) and the pipeline's
_STORE_KEYS = {"overlap_preload", *(f.name for cls in (Preload, Clairvoyant, Direct)
                                    for f in dataclasses.fields(cls))} - {"overlap"}
_PIPELINE_KEYS = {f.name for f in dataclasses.fields(Pipeline)}
LEGACY_KEYS = frozenset({"mode", *_STORE_KEYS, *_PIPELINE_KEYS})


def _settings(cls: type, kw: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    renamed = {"overlap" if k == "overlap_preload" else k: v for k, v in kw.items()}
    return cls(**{k: v for k, v in renamed.items() if k in names})


def from_legacy(store: Any, pipeline: Optional[Pipeline], legacy: dict[str, Any],
                stacklevel: int = 3) -> "tuple[Any, Optional[Pipeline]]":
    """``store`` and ``pipeline`` for a call that used the old flat keywords (a
    ``FutureWarning`` names the new spelling); a keyword the loader never had is a
    TypeError, as Python's own."""
    unknown = sorted(set(legacy) - LEGACY_KEYS)
    if unknown:
        raise ArgumentTypeError(f"DataLoader() got an unexpected keyword argument {unknown[0]!r}")
    if not legacy:
        return store, pipeline
    pipe_kw = {k: v for k, v in legacy.items() if k in _PIPELINE_KEYS}
    store_kw = {k: v for k, v in legacy.items() if k not in _PIPELINE_KEYS and k != "mode"}
    hints = []
    if pipe_kw:
        if pipeline is not None:
            raise InvalidArgumentError(f"give pipeline= or the keywords {sorted(pipe_kw)}, "
                                       f"not both")
        pipeline = Pipeline(**pipe_kw)
        hints.append("pipeline=Pipeline(" + ", ".join(f"{k}=..." for k in pipe_kw) + ")")
    if "mode" in legacy or store_kw:
        if store is not None:
            raise InvalidArgumentError(f"give store= or the keywords "
                                       f"{sorted(set(legacy) - set(pipe_kw))}, not both")
        mode = legacy.get("mode", "preload")
        if not isinstance(mode, str) or mode not in KINDS:
            raise InvalidArgumentError(f"mode must be one of {tuple(KINDS)}, got {mode!r}")
        if mode == "auto" and "node_cache" in store_kw:
            mode = "direct"         # as before: a node cache serves direct reads
        if mode == "auto":
            store = Auto(_settings(Preload, store_kw), _settings(Clairvoyant, store_kw))
        else:
            store = _settings(KINDS[mode], store_kw)
        args = ", ".join(f"{'overlap' if k == 'overlap_preload' else k}=..."
                         for k in store_kw)
        hints.append(f"store={type(store).__name__}({args})" if args else f"store={mode!r}")
    warnings.warn(f"DataLoader's keywords {sorted(legacy)} are deprecated and go in the next "
                  f"release: pass {', '.join(hints)} (from forebay.torch)",
                  FutureWarning, stacklevel=stacklevel)
    return store, pipeline


def with_system_tiers(spec: Any, pipe: Pipeline, tiers: dict[str, Any]) -> "tuple[Any, Pipeline]":
    """A system file's ``[tiers]`` in the settings' fields left None (what was given
    wins): the clairvoyant tiers, and the pipeline's ``prefetch`` and ``staging_bytes``."""
    def fill(obj: Any, names: tuple[str, ...]) -> Any:
        given = {k: tiers[k] for k in names if k in tiers and getattr(obj, k) is None}
        return dataclasses.replace(obj, **given) if given else obj

    clair = ("ram_bytes", "ssd_dir", "ssd_bytes", "ram_threads", "ssd_threads")
    if isinstance(spec, Clairvoyant):
        spec = fill(spec, clair)
    elif isinstance(spec, Auto):
        spec = dataclasses.replace(spec, clairvoyant=fill(spec.clairvoyant, clair))
    return spec, fill(pipe, ("prefetch", "staging_bytes"))


def mode_of(store: SampleStore) -> str:
    """The kind of store a loader reads from, by name (a user's own: its class)."""
    for cls, name in ((DistributedStore, "preload"), (ClairvoyantStore, "clairvoyant"),
                      (DirectStore, "direct")):
        if isinstance(store, cls):
            return name
    return type(store).__name__


def following_spec(spec: Any, mixture: bool) -> "Preload | Clairvoyant | Direct":
    """The settings of a loader that follows appends (``follow_appends=True``): direct
    reads and clairvoyant as given; a preload loaded before the first batch (a store
    that grows from the last one needs it whole)."""
    if mixture or not isinstance(spec, (Direct, Preload, Clairvoyant)):
        raise InvalidArgumentError("follow_appends reads a growing dataset with "
                                   "store='direct', 'preload' or 'clairvoyant' (not a "
                                   "mixture, not another store)")
    return dataclasses.replace(spec, overlap=False) if isinstance(spec, Preload) else spec


def grown_store(spec: Any, old: SampleStore, path: Any, samples: int, plan: Any,
                comm: Any, store_comm: Any, verify_on_read: bool) -> SampleStore:
    """The store of a loader that follows appends once the agreed samples changed:
    over the first ``samples`` of the dataset at ``path`` and ``plan``; a preload or
    clairvoyant store that grew keeps what ``old`` holds (its chunks, its tiers'
    samples) instead of reading it again.  ``old`` is left to the caller to close."""
    if isinstance(spec, Direct):
        fresh = open_dataset(path, verify_on_read=verify_on_read)
        if samples > len(fresh):
            raise InvalidArgumentError(f"{path} holds {len(fresh)} samples, fewer than the "
                                       f"{samples} asked: a growing dataset only grows")
        return build_store(spec, fresh, plan, comm, store_comm, None, None)
    fresh = PrefixDataset(path, samples, verify_on_read=verify_on_read)
    return build_store(spec, fresh, plan, comm, store_comm, None, None,
                       grown_from=old if samples > len(old.ds) else None)


def _node_cache(given: Any, ds: Any) -> "NodeCache | None":
    """The node cache a store reads through: the one its settings name, else the
    environment's (``FOREBAY_NODE_CACHE``), which keeps one dataset, not a mixture."""
    root = node_cache_root(given)
    if root is None or (given is None and not isinstance(ds.locator, str)):
        return None
    return NodeCache(root, ds)


def build_store(spec: "Preload | Clairvoyant | Direct | Auto", ds: Any, plan: Any,
                comm: Any, store_comm: Any, progress: Any, fetch_model: Any,
                grown_from: Any = None) -> SampleStore:
    """The store ``spec`` describes, for ``plan`` over ``ds`` (``comm``: the job's, None
    for one process; ``store_comm``: what the store is given; ``grown_from``: a
    preload over the first generations of ``ds``, whose chunks the new one keeps)."""
    if isinstance(spec, (Auto, Direct)):
        cache = _node_cache(spec.node_cache if isinstance(spec, Direct) else None, ds)
        if cache is not None:        # with a node cache, nothing to warm in the files
            return DirectStore(ds, warm=None, node_cache=cache)
    if isinstance(spec, Auto):
        mode = choose_mode(ds, comm, spec.preload.width)
        spec = spec.preload if mode == "preload" else spec.clairvoyant
    if isinstance(spec, Preload):
        return DistributedStore(ds, store_comm, spec.width, node_aware=spec.node_aware,
                                transport=spec.transport, progress=progress,
                                on_pfs_read=spec.on_pfs_read, overlap=spec.overlap,
                                node_cache=_node_cache(spec.node_cache, ds),
                                grown_from=grown_from)
    if isinstance(spec, Clairvoyant):
        warm = spec.on_pfs_read is None and warm_enabled(spec.warm_files, ds)
        ram = default_ram_bytes(comm) if spec.ram_bytes is None else spec.ram_bytes
        return ClairvoyantStore(ds, plan, store_comm, ram_bytes=ram, ssd_dir=spec.ssd_dir,
                                grown_from=grown_from,
                                ssd_bytes=spec.ssd_bytes or 0, transport=spec.transport,
                                on_pfs_read=spec.on_pfs_read, model=fetch_model,
                                ram_threads=spec.ram_threads or 1,
                                ssd_threads=spec.ssd_threads or 1, warm_files=warm,
                                ram_tier=spec.ram_tier,
                                node_cache=_node_cache(spec.node_cache, ds))
    # direct: the node reads every sample when every rank is on it (the store checks
    # that the files fit)
    world = comm.Get_size() if comm is not None else 1
    rank = comm.Get_rank() if comm is not None else 0
    wanted = warm_enabled(spec.warm_files, ds) and node_size(comm) == world
    return DirectStore(ds, warm=(rank, world) if wanted else None)


def store_settings(mode: str, **kw: Any) -> "Preload | Clairvoyant | Direct | Auto":
    """The settings of store kind ``mode`` from the keywords that apply to it, the others
    ignored: for a script with a ``--mode`` flag that passes the same keywords whatever
    the mode (``"auto"`` gives both its kinds theirs)."""
    if not isinstance(mode, str) or mode not in KINDS:
        raise InvalidArgumentError(f"mode must be one of {tuple(KINDS)}, got {mode!r}")
    fields = {f.name for cls in KINDS.values() for f in dataclasses.fields(cls)}
    unknown = sorted(set(kw) - fields)
    if unknown:
        raise InvalidArgumentError(f"no store kind has the setting {unknown[0]!r}")
    if mode == "auto":
        return Auto(_settings(Preload, kw), _settings(Clairvoyant, kw))
    return _settings(KINDS[mode], kw)

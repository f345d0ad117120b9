"""A drop-in PyTorch loader driven by an AccessPlan and served by a DistributedStore."""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any, Iterator, Optional

import numpy as np

from .. import trace as _trace
from ..dataset import (BufferPool, IndexLayout, Manifest, PackedDataset, PrefixDataset,
                       SampleBatch, SampleViews, open_dataset)
from ..mixture import Mixture
from ..plan import AccessPlan, EpochOrder
from ..store import ClairvoyantStore, DirectStore, DistributedStore, SampleStore
from ..comm import is_mpi, mpi_thread_multiple
from .._liveness import join as join_liveness, waiting
from ..world import LOCAL, abort_on_uncaught, resolve_comm
from ..store import agree_on_prefix, check_agreement, prefixes
from ._collate import (collate_views, default_collate, is_graph_batch, pin_tree,
                       pinned_alloc)
from ._options import (Direct, Pipeline, StoreSpec, build_store, describe, following_spec,
                       from_legacy, grown_store, mode_of, store_spec, with_system_tiers)
from ._prefetch import Prefetcher
from ._start import choose_start, make_workers
from ._threads import ThreadWorkers
from ._handover import SharedAlloc
from ._workers import WorkerPool, _Pending, start_forkserver, transform_batch
from ..errors import InvalidArgumentError, UsageError

__all__ = ["DataLoader"]

#: what the watchdog names when the loop's own step (between two batches) hangs
STEP_WAIT = "the training step after batch {} of epoch {} (the loop's code: its all-reduce, a save)"


def resolved(out: Any, pin: bool) -> Any:
    """A fetched batch, waited for if a transform worker has it (pinned when ``pin``)."""
    if isinstance(out, _Pending):
        return pin_tree(out.result()) if pin else out.result()
    return out


class DataLoader:
    """Batches of a packed dataset for data-parallel training, ``len(loader)`` steps an
    epoch on every rank.

    The simple call is ``DataLoader(path, batch_size, seed=, epochs=)``; the rest comes
    in two objects, each documented once: ``store=`` (where samples come from) and
    ``pipeline=`` (what happens to them on the way to the loop).

    What to iterate:
        dataset: a :class:`~forebay.dataset.PackedDataset` or its path, or a
            :class:`~forebay.Mixture` of several (its rule decides which source each
            position of an epoch reads; every store serves it).
        follow_appends: a dataset that grows (:func:`forebay.append`): at each epoch
            fence (:meth:`set_epoch`, called by every rank) the generations appended
            since that every rank sees join the plan; epoch e's order is the plan's for
            the samples agreed at its fence (``state_dict`` records how many).
            ``store="direct"``, ``"preload"`` or ``"clairvoyant"`` (the last two grow:
            each rank keeps what it holds and reads only the new generations' samples).
        batch_size: per-rank batch; the global batch is ``batch_size * world_size``.
        epochs: epochs in the run (the access plan covers them all).
        seed, shuffle, drop_last: as :class:`~forebay.AccessPlan` (same seed and global
            batch give the same global batches at any world size).

    Where samples come from:
        store: ``"preload"`` (default: the dataset in the ranks' memory),
            ``"clairvoyant"`` (what the plan will need, cached in RAM and SSD tiers
            filled in the background; the dataset may exceed memory), ``"direct"``
            (each batch read from the files), ``"auto"`` (preload when the dataset fits
            the nodes' memory, else clairvoyant); or the same with settings:
            :class:`~forebay.torch.Preload`, :class:`~forebay.torch.Clairvoyant`,
            :class:`~forebay.torch.Direct`, :class:`~forebay.torch.Auto`; or a
            :class:`~forebay.store.SampleStore` the caller built over this dataset (and,
            for a store that follows a plan, this loader's plan), which the caller
            closes.
        system: a TOML system file (the ``forebay calibrate`` profile format): its
            ``[tiers]`` table fills the clairvoyant settings and the pipeline's
            ``prefetch`` and ``staging_bytes`` left None (sizes as bytes or "8GiB");
            its ``[pfs] read_MBps`` and ``[rma] get_MBps`` feed NoPFS's performance
            model: a sample a peer holds is read from the file system instead when that
            is predicted faster (``stats()["pfs_by_model"]``).
        comm: the job's communicator (see :func:`forebay.world.resolve_comm`):
            default MPI's COMM_WORLD under mpiexec/srun with MPI, forebay's own gloo
            group under torchrun (initialising torch.distributed if the program has
            not), else one process; a launcher reporting ranks the data plane cannot
            see raises LaunchError; an mpi4py communicator or a torch.distributed
            process group may be given; :data:`forebay.world.LOCAL`: this process
            alone, on purpose.
        progress: a progress bar while the preload loads (default: on a terminal).

    What comes out:
        pipeline: a :class:`~forebay.torch.Pipeline`: transform or batch_transform,
            transform workers, collation, prefetch, pinning, views (default: the
            store's batch collated into tensors by :func:`default_collate`, 4 batches
            fetched ahead by a background thread).

    Integrity:
        verify_on_read: check every sample's checksum (default: the dataset's own
            ``verify_on_read``, False for a path).  Preload checks each rank's chunk
            once while loading (a damaged sample fails the store on every rank);
            clairvoyant checks each sample as it enters a tier or is read from the
            files; direct checks every batch.  A damaged sample raises
            :class:`~forebay.errors.ChecksumError` naming it.

    The keywords of forebay 0.x before this grouping (``mode``, ``ram_bytes``,
    ``transform``, ``workers``, ...) still work for one release, with a
    ``FutureWarning`` that names their new place.

    Resume: :meth:`state_dict` / :meth:`load_state_dict` record (epoch, step); a loader
    at another world size with the same global batch resumes the same global batches.
    """

    def __init__(self, dataset: "PackedDataset | Mixture | str | os.PathLike[str]",
                 batch_size: int, *,
                 seed: int = 0, epochs: int = 1, shuffle: bool = True, drop_last: bool = False,
                 store: "Optional[StoreSpec]" = None, pipeline: Optional[Pipeline] = None,
                 comm: Any = None, system: "Optional[str | os.PathLike[str]]" = None,
                 verify_on_read: Optional[bool] = None, progress: Any = None,
                 follow_appends: bool = False, **legacy: Any) -> None:
        store, pipeline = from_legacy(store, pipeline, legacy)
        spec = store_spec("preload" if store is None else store)
        pipe = Pipeline() if pipeline is None else pipeline
        if not isinstance(pipe, Pipeline):
            raise InvalidArgumentError(f"pipeline must be a forebay.torch.Pipeline, got "
                                       f"{type(pipe).__name__}")
        fetch_model = None
        if system is not None:  # a system file's [tiers]; what the settings give wins
            from ..store import FetchModel, load_profile

            profile = load_profile(system)
            # its [pfs] and [rma] bandwidths choose between a peer and the file system
            fetch_model = FetchModel.from_profile(profile)
            spec, pipe = with_system_tiers(spec, pipe, profile.get("tiers", {}))
        self.comm = resolve_comm(comm)
        abort_on_uncaught(self.comm)   # a rank that raises ends the job, not a hang
        order: Optional[EpochOrder] = None
        if isinstance(dataset, Mixture):   # its sources read as one, in proportions
            self.ds = dataset.open(verify_on_read=bool(verify_on_read))
            order = dataset.order(self.ds.part_sizes)
        else:
            self.ds = dataset if isinstance(dataset, PackedDataset) else \
                open_dataset(dataset, verify_on_read=bool(verify_on_read))
        if verify_on_read and not self.ds.verify_on_read:   # the caller's object unchanged
            self.ds = self.ds.reopened(verify_on_read=True)
        # the stores get this process alone as LOCAL (None would mean 'find the job')
        self._store_comm = LOCAL if self.comm is None else self.comm
        self.rank = self.comm.Get_rank() if self.comm is not None else 0
        self.world = self.comm.Get_size() if self.comm is not None else 1
        # ranks that disagree on what shapes the plan or the store fail here, together
        self.follow_appends = bool(follow_appends)
        if self.follow_appends:
            spec = following_spec(spec, order is not None)
        check_agreement(self.comm, "DataLoader's arguments", self.ds, {
            "batch_size": batch_size, "epochs": epochs, "seed": seed, "shuffle": shuffle,
            "drop_last": drop_last, "verify_on_read": self.ds.verify_on_read,
            "follow_appends": self.follow_appends,
            "mixture": None if order is None else order.describe(), **describe(spec)},
            dataset_id=("grows", 0, str(self.ds.path)) if self.follow_appends else None)
        # a growing dataset: the generations every rank sees (one allgather)
        samples = agree_on_prefix(self.comm, self.ds) if self.follow_appends else len(self.ds)
        if self.follow_appends and not isinstance(spec, Direct):   # what every rank holds
            self.ds = PrefixDataset(self.ds.path, samples, verify_on_read=self.ds.verify_on_read)
        # the loop's own step between two batches (DDP's all-reduce, a checkpoint's
        # save) is watched too: a peer node gone mid-step ends the job by name
        join_liveness(self.comm)
        self.plan = AccessPlan(samples, self.world, batch_size, epochs, seed,
                               drop_last=drop_last, shuffle=shuffle, order=order)
        self._spec = spec
        self.collate_fn = pipe.collate_fn
        self.transform = pipe.transform
        self.batch_transform = pipe.batch_transform
        self.views = pipe.views
        if self.views and self.collate_fn is None and self.transform is None and \
                self.batch_transform is None and is_graph_batch(self.ds):
            raise InvalidArgumentError("views=True lends per-sample arrays; graph batches are "
                                       "concatenated (a copy) by the default collation: "
                                       "leave views off, or give a collate_fn")
        self.prefetch = 4 if pipe.prefetch is None else pipe.prefetch
        # the transform workers start before the store's set-up (which they overlap):
        # forked while this process has no thread of the store's yet, or from a fork
        # server started now
        self._pool: "Optional[WorkerPool | ThreadWorkers]" = None
        self.worker_start: Optional[str] = None
        self.worker_start_reason = ""
        if pipe.workers:
            self.worker_start, self.worker_start_reason = choose_start(
                pipe.worker_start, self.transform, self.batch_transform, self.collate_fn)
            if self.worker_start == "forkserver":
                start_forkserver()
            else:
                self._pool = self._make_workers(pipe, seed)
        # a store the caller built is checked against this loader and left to them
        self._own_store = not isinstance(spec, SampleStore)
        self.store: SampleStore
        try:
            if isinstance(spec, SampleStore):
                self._check_given_store(spec)
                self.store = spec
            else:
                self.store = build_store(spec, self.ds, self.plan, self.comm,
                                         self._store_comm, progress, fetch_model)
            self.mode = mode_of(self.store)
            if pipe.workers and self._pool is None:
                self._pool = self._make_workers(pipe, seed)
        except BaseException:
            if self._pool is not None:
                self._pool.close()
            raise
        if self._pool is not None:
            self.prefetch = max(self.prefetch, 4 * pipe.workers)   # keep them all busy
        if self.prefetch and is_mpi(self.comm):
            if not mpi_thread_multiple():
                warnings.warn("MPI was not initialised with MPI_THREAD_MULTIPLE; forebay "
                              "fetches batches in the iterating thread (prefetch=0)",
                              RuntimeWarning, stacklevel=2)
                self.prefetch = 0
        #: batch buffers recycled once the consumer dropped every tensor of a batch
        #: (the batches in flight: the staging area's, the one being used, one more)
        self._buffers = BufferPool(keep=self.prefetch + 2)
        self.pin_memory = pipe.pin_memory
        if self.pin_memory and not _cuda_available():
            warnings.warn("pin_memory=True but no CUDA device is available; batches stay in "
                          "pageable memory", RuntimeWarning, stacklevel=2)
            self.pin_memory = False
        self.epoch = 0
        self._step = 0  # batches handed out in the current epoch
        self._resumed = False  # load_state_dict set the position; set_epoch keeps it
        self._requests: list[Any] = []
        self._requests_epoch = -1
        self._stall = 0.0  # seconds the iterating thread waited for a batch
        self.staging_bytes = pipe.staging_bytes
        self._staging_peak = 0
        self._prefetcher: Optional[Prefetcher] = None
        self._prefetch_owner: object = None      # the iteration taking its batches
        self._train_t0: Optional[float] = None
        self._trace_dataset()

    def _trace_dataset(self) -> None:
        """The dataset read, in the trace (again when a growing one grew: the analysis
        compares the reads with the last)."""
        rec = _trace.active()
        if rec is not None:
            rec.world = self.world
            rec.meta("dataset", {"path": str(self.ds.path), "samples": len(self.ds),
                                 "bytes": int(self.ds.sample_nbytes.sum()),
                                 "record_bytes": int(self.ds.record_nbytes.sum()),
                                 "file_bytes": sum(sh.data_nbytes
                                                   for sh in self.ds.manifest.shards),
                                 "mode": self.mode, "world": self.world,
                                 "transport": self.store.stats().get("transport", "local"),
                                 "batch_size": self.plan.batch_size,
                                 "epochs": self.plan.epochs})

    # -- sizes and state ----------------------------------------------------------------
    def __len__(self) -> int:
        return self.plan.steps_per_epoch

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch (as ``DistributedSampler.set_epoch``),
        whatever was iterated before; only right after :meth:`load_state_dict` placed
        the loader in the middle of ``epoch`` does it keep that position (the usual
        resume loop calls ``set_epoch`` for the saved epoch)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or \
                not 0 <= epoch < self.plan.epochs:
            raise InvalidArgumentError(
                f"epoch {epoch!r} out of range for a {self.plan.epochs}-epoch plan")
        if not (self._resumed and epoch == self.epoch):
            self._step = 0
            if self.follow_appends:
                # the manifest alone: the dataset is opened again only if it grew
                self._follow(agree_on_prefix(self.comm, Manifest.read(self.ds.path),
                                             str(self.ds.path)))
        self._resumed = False
        self.epoch = int(epoch)

    def _follow(self, samples: int) -> None:
        """Read the first ``samples`` of the dataset from now on (a growing dataset's
        generations that every rank sees, or a resumed run's count)."""
        import dataclasses

        if samples == self.plan.num_samples:
            return
        plan = dataclasses.replace(self.plan, num_samples=samples)
        old = self.store
        self.store = grown_store(self._spec, old, self.ds.path, samples, plan, self.comm,
                                 self._store_comm, self.ds.verify_on_read)
        self.ds = self.store.ds
        old.close()
        self.plan = plan
        self._requests_epoch = -1
        self._trace_dataset()

    def state_dict(self) -> dict[str, Any]:
        """Position in the run: the next batch to hand out is ``(epoch, step)`` (after
        the last batch of an epoch, the next epoch's first)."""
        epoch, step = self.epoch, self._step
        if step >= len(self) and epoch + 1 < self.plan.epochs:
            epoch, step = epoch + 1, 0
        return {"epoch": epoch, "step": step, "seed": self.plan.seed,
                "num_samples": self.plan.num_samples, "global_batch": self.plan.global_batch,
                "epochs": self.plan.epochs, "drop_last": self.plan.drop_last,
                "shuffle": self.plan.shuffle,
                "mixture": None if self.plan.order is None else self.plan.order.describe(),
                **({"prefix": dict(prefixes(self.ds)).get(self.plan.num_samples)}
                   if self.follow_appends else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position; its plan must give the same global batches."""
        mine = self.state_dict()
        if self.follow_appends and isinstance(state.get("num_samples"), int):
            self._follow(state["num_samples"])      # the samples its epoch had
            if state.get("prefix") != dict(prefixes(self.ds)).get(state["num_samples"]):
                raise InvalidArgumentError(
                    f"cannot resume: the first {state['num_samples']} samples of "
                    f"{self.ds.path} are not the ones the run had (replaced, not appended)")
        for key in ("seed", "num_samples", "global_batch", "drop_last", "shuffle",
                    "mixture"):
            if state.get(key) != mine[key] and not (key == "num_samples" and
                                                     self.follow_appends):
                raise InvalidArgumentError(
                    f"cannot resume: saved {key}={state.get(key)!r} but this "
                    f"loader has {key}={mine[key]!r} (global batch = batch_size x "
                    f"world size must match)")
        epoch, step = int(state["epoch"]), int(state["step"])
        if not 0 <= epoch < self.plan.epochs or not 0 <= step <= len(self):
            raise InvalidArgumentError(f"cannot resume at epoch {epoch} step {step}")
        self.epoch, self._step = epoch, step
        self._resumed = True

    # -- fetching -----------------------------------------------------------------------
    def _fetch(self, ids: np.ndarray, epoch: int, step: int) -> Any:
        if isinstance(self._pool, WorkerPool) and isinstance(self.store, DirectStore) and \
                self.store.prepare(ids := self.ds.normalize_ids(ids)):   # read by the worker
            pending = self._pool.submit_ids(epoch, step, ids, self.store.read_path)
            rec = _trace.active()
            if rec is not None:   # its reads, as this rank's, when the batch comes back
                pending.on_read = lambda t0, t1: self._trace_pfs(rec, ids, t0, t1,
                                                                 epoch, step)
            return pending
        # pinned batches: gathered straight into pinned memory where forebay collates
        # them, else what the transform or collate_fn returns is pinned (below)
        pin_late = self.pin_memory and (self.transform is not None or self.collate_fn
                                        is not None or self.batch_transform is not None)
        alloc: Any = pinned_alloc if self.pin_memory and not pin_late else self._buffers
        if isinstance(self._pool, WorkerPool):
            alloc = SharedAlloc(self._pool.ring)   # gathered straight into shared memory
        rec = _trace.active()
        if rec is not None:
            rec.context.epoch, rec.context.step = epoch, step
        t0 = time.perf_counter()
        batch: "SampleBatch | SampleViews"
        if isinstance(self.store, (DistributedStore, ClairvoyantStore)) and \
                self.store.transport == "exchange":
            # every peer's request is known from the plan: no all-gather of the ids
            batch = self.store.get_step(self._group_requests(epoch, step), alloc=alloc)
            if self.views and self._pool is None:
                batch = SampleViews.of_batch(batch)
        elif self.views and self._pool is None:
            batch = self.store.get_views(ids)
        else:
            batch = self.store.get_many(ids, alloc=alloc)
        out: Any
        if isinstance(self._pool, WorkerPool) and isinstance(batch, SampleBatch):
            # resolved by the consumer (never views)
            out = self._pool.submit(epoch, step, batch, alloc.last)
        elif self._pool is not None and isinstance(batch, SampleBatch):
            out = self._pool.submit(epoch, step, batch)
        elif self.transform is not None or self.batch_transform is not None:
            out = transform_batch(batch, self.transform, self.batch_transform,
                                  self.collate_fn, self.plan.seed, epoch)
        elif self.collate_fn is not None:
            out = self.collate_fn(batch)
        elif isinstance(batch, SampleViews):
            out = collate_views(batch, pin=self.pin_memory)
        else:
            out = default_collate(batch, pin=self.pin_memory)
        if pin_late and not isinstance(out, _Pending):
            out = pin_tree(out)
        if rec is not None:
            self._trace_fetch(rec, ids, t0)
        return out

    def _group_requests(self, epoch: int, step: int) -> list[np.ndarray]:
        """What each rank exchanging with this one (its replica group, or every rank
        for the clairvoyant store) asks for at (epoch, step)."""
        if self._requests_epoch != epoch:
            ranks = self.store.group_ranks if isinstance(self.store, DistributedStore) \
                else range(self.world)
            self._requests = [self.plan.batches(int(r), epoch) for r in ranks]
            self._requests_epoch = epoch
        return [b[step] for b in self._requests]

    def _trace_pfs(self, rec: Any, ids: np.ndarray, t0: float, t1: float,
                   epoch: Optional[int] = None, step: Optional[int] = None) -> None:
        """Samples ``ids`` read from the dataset files in ``[t0, t1]`` (by this process
        or a transform worker of it): one data/item and one file read per sample."""
        from ..store import _tracing as _hooks

        if epoch is not None:
            rec.context.epoch, rec.context.step = epoch, step
        rows = self.ds.rows(ids)
        _hooks.record_parts(rec, ids, rows[:, IndexLayout.REC_LEN],
                            [(slice(None), t0, t1, "pfs", "pfs", -1)])
        _hooks.record_pfs(rec, self.ds, ids, rows, t0, t1)

    def _trace_fetch(self, rec: Any, ids: np.ndarray, t0: float) -> None:
        t1 = time.perf_counter()
        if isinstance(self.store, DirectStore):  # every sample read from the files
            self._trace_pfs(rec, ids, t0, t1)
        cat = "prefetch" if threading.current_thread().name == "forebay-prefetch" \
            else "dataloader"
        rec.span(cat, "fetch.batch", t0, t1, epoch=rec.context.epoch, step=rec.context.step,
                 count=len(ids), nbytes=int(self.ds.sample_nbytes[ids].sum()))

    def _waited(self, t0: float, epoch: int, step: int) -> None:
        """The training loop waited from ``t0`` for batch ``step``: a stall."""
        t1 = time.perf_counter()
        self._stall += t1 - t0
        rec = _trace.active()
        if rec is not None:
            rec.span("dataloader", "fetch.iter", t0, t1, epoch=epoch, step=step)
            rec.context.epoch, rec.context.step = epoch, step  # for the user's regions

    def __iter__(self) -> Iterator[Any]:
        # the training loop's first wait starts here: the epoch's set-up (its plan, the
        # transform workers' new pass, the prefetch thread) is part of it
        t_epoch = time.perf_counter()
        epoch, start = self.epoch, self._step
        if start >= len(self):  # never a silent jump to another epoch
            nxt = (f"call loader.set_epoch({epoch + 1}) for the next one, or "
                   if epoch + 1 < self.plan.epochs else "it is the plan's last; call ")
            raise UsageError(f"epoch {epoch} is finished: {nxt}loader.set_epoch({epoch}) to "
                             f"read it again")
        self._resumed = False
        if self._pool is not None and self.prefetch == 0:
            self._pool.new_pass()
        batches = self.plan.batches(self.rank, epoch)
        if self._train_t0 is None:
            self._train_t0 = t_epoch
        try:
            if self.prefetch == 0:
                for step in range(start, len(batches)):
                    # the first wait includes the epoch's set-up
                    t0 = t_epoch if step == start else time.perf_counter()
                    out = resolved(self._fetch(batches[step], epoch, step), self.pin_memory)
                    self._step = step + 1
                    self._waited(t0, epoch, step)
                    with waiting(STEP_WAIT.format(step, epoch)):
                        yield out
            else:
                yield from self._iter_prefetched(batches, start, epoch, t_epoch)
        finally:
            rec = _trace.active()
            if rec is not None:
                rec.span("pipeline", "epoch.block", t_epoch, time.perf_counter(), epoch=epoch,
                         count=self._step - start)

    def _iter_prefetched(self, batches: np.ndarray, start: int, epoch: int,
                         t_epoch: float) -> Iterator[Any]:
        """Batches fetched ahead by the prefetch thread (:class:`Prefetcher`); one
        that fetched on into this epoch while the loop was between epochs is picked up
        where it stands, any other is stopped and a new one started here."""
        pf, mine = self._prefetcher, object()
        if pf is None or pf.next_key() != (epoch, start):
            self._stop_prefetch()
            if self._pool is not None:
                self._pool.new_pass()
            pf = self._prefetcher = Prefetcher(
                self._fetch, lambda e: self.plan.batches(self.rank, e),
                self.ds.sample_nbytes, len(self), epoch, start,
                self.plan.epochs - 1 if self._across_epochs() else epoch,
                self.prefetch, self.staging_bytes)
        self._prefetch_owner = mine
        done = False
        try:
            for k in range(start, len(batches)):
                # the first wait includes the epoch's set-up (plan, thread start)
                t0 = t_epoch if k == start else time.perf_counter()
                if self._prefetch_owner is not mine:
                    raise UsageError("another iteration of this loader began while this "
                                     "one was paused: iterate one at a time")
                _, step, out, err = pf.take()
                self._staging_peak = max(self._staging_peak, pf.peak)
                if err is not None:
                    raise err
                out = resolved(out, self.pin_memory)  # a batch in a transform worker: wait for it
                self._step = step + 1
                # the wait ends here, not at take(): handing the GIL back from the
                # prefetch thread can take as long as the get itself
                self._waited(t0, epoch, step)
                with waiting(STEP_WAIT.format(step, epoch)):
                    yield out
            done = True
        finally:
            if self._prefetch_owner is mine and (not done or epoch >= pf.last_epoch):
                self._stop_prefetch()

    def _across_epochs(self) -> bool:
        """Whether the prefetch thread may go on into the next epoch while the loop is
        between epochs: not where a batch is a collective of the ranks (the exchange
        transport: a rank's loop that goes elsewhere would leave the others in it), nor
        where the next epoch's samples are only known at set_epoch (follow_appends).
        A prefetch thread still running when the program ends is stopped at exit,
        before MPI finalizes (close the loader before an explicit ``MPI.Finalize()``)."""
        collective = isinstance(self.store, (DistributedStore, ClairvoyantStore)) and \
            self.store.transport == "exchange"
        return not self.follow_appends and not collective

    def _stop_prefetch(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.stop()
            self._prefetcher = None

    def _make_workers(self, pipe: Pipeline, seed: int) -> "WorkerPool | ThreadWorkers":
        assert self.worker_start is not None
        return make_workers(self.worker_start, pipe.workers, self.ds.schema, self.transform,
                            self.batch_transform, self.collate_fn, seed,
                            timeout=pipe.worker_timeout,
                            verify_on_read=self.ds.verify_on_read)

    def _check_given_store(self, store: SampleStore) -> None:
        """A store the caller built serves this loader's dataset (and plan, for one
        that follows a plan), or the batches would be another dataset's."""
        if len(store.ds) != len(self.ds) or \
                store.ds.fingerprint != self.ds.fingerprint:
            raise InvalidArgumentError(
                f"store= holds {store.ds.path} ({len(store.ds)} samples), not this "
                f"loader's dataset {self.ds.path} ({len(self.ds)} samples)")
        plan = getattr(store, "plan", None)
        if plan is not None and plan != self.plan:
            raise InvalidArgumentError(
                f"store= follows another access plan ({plan}) than this loader's "
                f"({self.plan}): build it with the loader's batch_size x world size, "
                f"epochs, seed, shuffle and drop_last")

    def stats(self) -> dict[str, Any]:
        """Where batches came from and what waiting cost: ``stall_seconds`` (time the
        iterating thread waited for data), ``fetches_by_source``, ``pfs_reads`` and
        ``pfs_bytes`` (samples and bytes this rank read from the dataset files);
        ``worker_start``: how the transform workers run ("thread", "fork",
        "forkserver", "spawn"; None without workers; ``worker_start_reason`` on the
        loader says why ``"auto"`` chose it); ``worker_buffers``: the shared-memory
        buffers batches were gathered into for worker processes, ``allocated`` and
        ``reused``, and ``by_id``: batches whose buffer the worker held already (sent
        as its id alone);
        ``padding_per_epoch``: samples the plan repeats each epoch to fill its last
        global batch (``drop_last=False``; over all ranks); ``batch_buffers``: the
        batches' output buffers allocated and reused (a buffer is reused once no
        tensor of its batch is referenced any more)."""
        base = dict(self.store.stats())
        base["padding_per_epoch"] = self.plan.padding
        base["stall_seconds"] = self._stall
        base["staging_peak_bytes"] = self._staging_peak
        base["mode"] = self.mode
        base["worker_start"] = self.worker_start
        if isinstance(self._pool, WorkerPool):
            ring = self._pool.ring
            base["worker_buffers"] = {"allocated": ring.allocated, "reused": ring.reused,
                                      "by_id": self._pool.by_id}
        base["batch_buffers"] = self._buffers.stats()
        return base

    def close(self) -> None:
        """Release the store (collective) and stop the transform workers."""
        self._stop_prefetch()
        if self._pool is not None:
            self._pool.close()
        rec = _trace.active()
        if rec is not None and self._train_t0 is not None:
            rec.span("pipeline", "train", self._train_t0, time.perf_counter())
            self._train_t0 = None
        if self._own_store:
            self.store.close()

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._stop_prefetch()
        if self._own_store:   # a store the caller built is theirs to close
            self.store.__exit__(exc_type, exc, tb)   # no collective while an error propagates


def _cuda_available() -> bool:
    import torch      # only with pin_memory: a loader of numpy batches never loads torch

    return bool(torch.cuda.is_available())

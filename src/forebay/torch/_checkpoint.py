"""The training loop's checkpoint in one object: model, optimizer, the loader's position,
every rank's random-number states and the step, saved without stopping training into a
model repository as torch.distributed.checkpoint versions, and restored at start.

    ckpt = Checkpoint("file:///scratch/run7", loader=loader, model=model,
                      optimizer=opt, every_steps=500)
    start = ckpt.restore()                 # 0 when nothing was saved yet
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            ...; opt.step()
            ckpt.step()                    # every 500 steps: an asynchronous save
    ckpt.close()                           # waits for the last save

A save is DCP's ``async_save`` into :class:`forebay.models.dcp.Writer`: the state is
staged (copied) while the loop waits, then written in the background (GPU tensors are
staged into pinned host buffers kept for the next save: host memory the size of the
state, freed at :meth:`Checkpoint.close`); the version is
published only when every rank's items are stored, so a save is whole or absent and a
job that dies mid-save restores the previous one.  Older versions beyond ``keep`` are
deleted (and their unshared tensors collected) once the next save is whole.  A restore
at another world size resumes the loader at the same global batch (the loader's own
rule) and reshards the model through DCP; ranks that did not exist at the save keep
their own random states.

The loader position, step and random states are stored as tensors (no pickling);
DCP itself pickles the optimizer's non-tensor values (``betas``...), as with any DCP
storage: restore only from a repository you trust.
"""

from __future__ import annotations

import copy
import json
import os
import random
import warnings
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from ..errors import InvalidArgumentError, UsageError

__all__ = ["Checkpoint"]

# DCP warns at every save and load without a process group, even when told no_dist; a
# Checkpoint in one process means it, and its saves run on DCP's background thread,
# where a caller's catch_warnings does not reach: this one message is silenced
warnings.filterwarnings("ignore", category=UserWarning,
                        message="torch.distributed is (disabled, )?unavailable or "
                                "uninitialized, assuming the intent is to (save|load) in "
                                "a single process")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _warn_if_restarts_share_a_store() -> None:
    """Warn (rank 0) when torchrun will restart the workers with its rendezvous store
    shared between attempts (torch's default with the c10d rendezvous): the store keeps
    the dead attempt's keys, and a restarted job's process groups, named as before,
    can read the old ranks' addresses and fail to connect (pytorch/pytorch#135712;
    about one restart in four on the emulated cluster)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" \
            or os.environ.get("RANK", "0") != "0":
        return
    try:
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return
    if restarts > 0:
        warnings.warn(f"torchrun restarts the workers here (--max-restarts {restarts}) "
                      f"but shares its rendezvous store between attempts: a restarted "
                      f"job can read the dead attempt's addresses and fail to connect "
                      f"(pytorch/pytorch#135712). Start torchrun with "
                      f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (see "
                      f"forebay's docs/checkpoint.md)", RuntimeWarning, stacklevel=3)


def _rank_world(group: Any) -> tuple[int, int]:
    if _distributed():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _text(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def _untext(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.numpy().tobytes()).decode())


def _like(m: Any) -> torch.Tensor:
    """An empty tensor to load a saved tensor into (DCP's TensorStorageMetadata)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not isinstance(m, TensorStorageMetadata):
        raise UsageError("this checkpoint was not written by forebay.torch.Checkpoint "
                         "(a state it saves as a tensor is stored as bytes)")
    return torch.zeros(m.size, dtype=m.properties.dtype)


def _rng_state() -> dict[str, torch.Tensor]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, state, gauss_next = random.getstate()
    out = {"torch": torch.get_rng_state(),
           "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
           "numpy_rest": _text([kind, int(pos), int(has_gauss), float(gauss)]),
           "python": torch.tensor(state, dtype=torch.int64),
           "python_rest": _text([version, gauss_next])}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return out


def _set_rng_state(s: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(s["torch"])
    kind, pos, has_gauss, gauss = _untext(s["numpy_rest"])
    np.random.set_state((kind, s["numpy"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, gauss_next = _untext(s["python_rest"])
    random.setstate((version, tuple(int(x) for x in s["python"].tolist()), gauss_next))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(s["cuda"]))


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


#: how :meth:`Checkpoint.restore` reads the state (see ``restore_from``)
RESTORE_FROM = ("auto", "one", "every")


def _without_tensors(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` with the model's and optimizer's tensors left out (what a rank that gets
    them by broadcast still reads: their non-tensor values, and all of "forebay")."""
    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not isinstance(v, torch.Tensor)}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return {k: (v if k == "forebay" else strip(v)) for k, v in sd.items()}


def _take_values(into: Any, got: Any) -> None:
    """Copy the values DCP loaded into ``got`` (a :func:`_without_tensors` copy) back
    into ``into``, in place."""
    if isinstance(into, dict):
        for k, v in got.items():
            if isinstance(v, (dict, list)) and isinstance(into.get(k), (dict, list)):
                _take_values(into[k], v)
            else:
                into[k] = v
    elif isinstance(into, list):
        for i, v in enumerate(got):
            if isinstance(v, (dict, list)):
                _take_values(into[i], v)
            else:
                into[i] = v


class _PinnedStager(AsyncStager):
    """DCP's staging step for a state on the GPU: each CUDA tensor copied into a pinned
    host buffer kept for the next save under the same key (DCP's default copies into
    fresh pageable memory each time, at a fraction of the link's speed; its own pinned
    ``DefaultStager`` fails on a plain ``module.state_dict()`` in torch 2.11), CPU tensors
    cloned, other values deep-copied; then it waits for the copies, so that the loop may
    change the weights as soon as the save returns.  A buffer is rewritten only by the
    next save, which starts after the previous one is written (:meth:`Checkpoint.save`
    waits for it first)."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = self._copy(state_dict, ())
        torch.cuda.synchronize()
        return out

    def _copy(self, x: Any, key: tuple) -> Any:
        if isinstance(x, torch.Tensor):
            if not x.is_cuda:
                return x.detach().clone()
            buf = self._buffers.get(key)
            if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:
                buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                self._buffers[key] = buf
            buf.copy_(x.detach(), non_blocking=True)
            return buf
        if isinstance(x, dict):
            return type(x)((k, self._copy(v, key + (k,))) for k, v in x.items())
        if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
            return type(x)(self._copy(v, key + (i,)) for i, v in enumerate(x))
        return copy.deepcopy(x)

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        self._buffers.clear()


class Checkpoint:
    """Save and restore a training loop's state through a model repository.

    Args:
        repo: a repository URL (``file:///shared/path``, the same on every rank) or an
            open :class:`~forebay.models.Repository`.
        name: the model name its versions are kept under.
        loader: a :class:`forebay.torch.DataLoader` (its position is saved).
        model, optimizer: a ``torch.nn.Module`` and its optimizer (DCP's
            ``get_state_dict``: plain, DDP and FSDP/DTensor models alike).
        every_steps: :meth:`step` saves every this many steps (0: only :meth:`save`).
        keep: versions kept; older ones are deleted once a newer one is whole.
        process_group: the group the ranks save with (default: a gloo group of every
            rank made here, so that a save's collectives on DCP's background thread
            never meet the loop's; constructing it is then collective).  A job of
            several ranks where torch.distributed is not started yet (mpiexec, srun
            with MPI) starts it here (gloo, :func:`forebay.reduce.init_process_group`).
        restore_from: how :meth:`restore` reads the state.  ``"one"``: the group's
            first rank reads the model and optimizer and broadcasts them to the others,
            which read only their own small items (loader position, step, random
            states): the file system serves the state once per job instead of once per
            rank.  ``"every"``: each rank reads what it holds (DCP's own load: sharded
            states, FSDP).  ``"auto"`` (default): ``"one"`` when every model and
            optimizer tensor is a plain tensor (a replicated, DDP state) on more than
            one rank, else ``"every"``.
    """

    def __init__(self, repo: Any, *, name: str = "checkpoint", loader: Any = None,
                 model: Optional[torch.nn.Module] = None, optimizer: Any = None,
                 every_steps: int = 0, keep: int = 2, process_group: Any = None,
                 restore_from: str = "auto") -> None:
        if not isinstance(every_steps, int) or isinstance(every_steps, bool) \
                or every_steps < 0:
            raise InvalidArgumentError(f"every_steps must be a whole number >= 0, got "
                                       f"{every_steps!r}")
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise InvalidArgumentError(f"keep must be a whole number >= 1, got {keep!r}")
        if optimizer is not None and model is None:
            raise UsageError("Checkpoint: an optimizer needs its model (model=...)")
        if restore_from not in RESTORE_FROM:
            raise InvalidArgumentError(f"restore_from must be one of {RESTORE_FROM}, got "
                                       f"{restore_from!r}")
        self.restore_from = restore_from
        #: how the last restore read the state: ``{"from": "one" | "every",
        #: "bytes_read": this rank's bytes}``
        self.restore_stats: dict[str, Any] = {}
        self.repo, self.name, self.loader = repo, name, loader
        self.model, self.optimizer = model, optimizer
        self.every_steps, self.keep = every_steps, keep
        _warn_if_restarts_share_a_store()
        # a save's collectives run on DCP's background thread: on a group of their own,
        # never interleaved with the training loop's (DDP, the loader's exchange)
        if process_group is None:
            from ..world import detect

            if not _distributed() and detect().size > 1:
                # the job's ranks (mpiexec, srun) save together over torch.distributed
                from ..reduce import init_process_group

                init_process_group("gloo")
            if _distributed():
                process_group = dist.new_group(backend="gloo")
        self.group = process_group
        #: optimizer steps taken (restored by :meth:`restore`)
        self.step_count = 0
        #: the version the last finished save published (on the coordinator, rank 0)
        self.saved_version: Optional[int] = None
        self._pending: Any = None
        self._writer: Any = None
        self._stager: Any = None
        self._closed = False

    # -- what is saved ---------------------------------------------------------------
    def _state(self, *, load: bool = False) -> dict[str, Any]:
        """The state dict DCP saves (``load``: the one it loads into; the loader's and
        the random states' tensors are added by :meth:`restore` at their saved sizes)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        rank, world = _rank_world(self.group)
        sd: dict[str, Any] = {}
        if self.model is not None:
            opts = [self.optimizer] if self.optimizer is not None else []
            msd, osd = get_state_dict(self.model, opts)
            sd["model"] = msd
            if self.optimizer is not None:
                sd["optim"] = osd
        meta = {"step": torch.tensor(self.step_count, dtype=torch.int64),
                "world_size": torch.tensor(world, dtype=torch.int64)}
        if not load:
            if self.loader is not None:
                meta["loader"] = _text(self.loader.state_dict())
            for k, v in _rng_state().items():
                meta[f"rng_{k}_r{rank}"] = v
        sd["forebay"] = meta
        return sd

    # -- the loop's three calls ------------------------------------------------------
    def restore(self) -> int:
        """Load the latest whole version, if any; returns the step to go on from (0:
        nothing saved yet, a fresh start)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from ..models.dcp import Reader

        version = self._latest()
        if version is None:
            return 0
        md = Reader(self.repo, self.name, version).read_metadata()
        saved = md.state_dict_metadata
        rank, _ = _rank_world(self.group)
        sd = self._state(load=True)
        meta = sd["forebay"]
        if self.loader is not None:
            if "forebay.loader" not in saved:
                raise UsageError(f"{self.name!r} version {version} holds no loader "
                                 f"position: it was saved without loader=")
            meta["loader"] = _like(saved["forebay.loader"])
        mine = {k.split(".", 1)[1]: v for k, v in saved.items()
                if k.startswith("forebay.rng_") and k.endswith(f"_r{rank}")}
        for key, m in mine.items():
            meta[key] = _like(m)
        for part in ("model", "optim"):
            if part in sd and not any(k.startswith(part + ".") for k in saved):
                raise UsageError(f"{self.name!r} version {version} holds no {part} state")
        reader = Reader(self.repo, self.name, version)
        how = self._restore_how(sd)
        if how == "one":
            self._load_one(sd, reader)
        else:
            dcp.load(sd, storage_reader=reader, process_group=self.group,
                     no_dist=not _distributed())
        self.restore_stats = {"from": how, "bytes_read": reader.bytes_read}
        if self.model is not None:
            set_state_dict(self.model, [self.optimizer] if self.optimizer is not None else [],
                           model_state_dict=sd["model"],
                           optim_state_dict=sd.get("optim", {}))
        if self.loader is not None:
            self.loader.load_state_dict(_untext(meta["loader"]))
        if mine:
            _set_rng_state({k[len("rng_"):-len(f"_r{rank}")]: meta[k] for k in mine})
        self.step_count = int(meta["step"])
        self.saved_version = version
        return self.step_count

    def _restore_how(self, sd: dict[str, Any]) -> str:
        """``"one"`` or ``"every"`` (``restore_from`` resolved for this state)."""
        _, world = _rank_world(self.group)
        leaves = _tensors({k: v for k, v in sd.items() if k != "forebay"})
        plain = all(type(t) is torch.Tensor for t in leaves)
        if self.restore_from == "one" and not plain:
            raise UsageError("restore_from='one' broadcasts plain tensors: this state holds "
                             "sharded ones (DTensor, FSDP): use 'every' or 'auto'")
        if self.restore_from == "one" or (self.restore_from == "auto" and plain):
            return "one" if world > 1 else "every"
        return "every"

    def _load_one(self, sd: dict[str, Any], reader: Any) -> None:
        """The group's first rank reads the model and optimizer and broadcasts their
        tensors (in the state's order, the same on every rank: the same model and
        optimizer); every rank reads its own small items and the optimizer's
        non-tensor values itself."""
        rank, _ = _rank_world(self.group)
        if rank == 0:
            dcp.load(sd, storage_reader=reader, no_dist=True)
        else:
            light = _without_tensors(sd)
            dcp.load(light, storage_reader=reader, no_dist=True)
            _take_values(sd, light)
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for t in _tensors({k: v for k, v in sd.items() if k != "forebay"}):
            dist.broadcast(t, src=src, group=self.group)

    def step(self) -> bool:
        """Count one optimizer step; every ``every_steps`` steps start a save.  Returns
        whether it did."""
        self._check_open()
        self.step_count += 1
        if self.every_steps and self.step_count % self.every_steps == 0:
            self.save()
            return True
        return False

    def save(self, *, wait: bool = False) -> None:
        """Save now: the previous save is finished first (its error raised here), the
        state staged while the caller waits, the rest written in the background
        (``wait=True``: until the version is published)."""
        from ..models.dcp import Writer

        self._check_open()
        self.wait()
        writer = Writer(self.repo, self.name, metadata={
            "forebay_checkpoint": 1, "step": self.step_count})
        state = self._state()
        self._pending = dcp.async_save(state, storage_writer=writer,
                                       process_group=self.group, no_dist=not _distributed(),
                                       async_stager=self._gpu_stager(state))
        self._writer = writer
        if wait:
            self.wait()

    def _gpu_stager(self, state: dict[str, Any]) -> Any:
        """Where the state holds CUDA tensors (plain ones: DTensors and other subclasses
        keep DCP's default): a :class:`_PinnedStager`, kept from one save to the next.
        None elsewhere: DCP's default, a fresh pageable copy per save."""
        if self._stager is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            leaves = _tensors(state)
            if any(t.is_cuda for t in leaves) and all(type(t) is torch.Tensor for t in leaves):
                self._stager = _PinnedStager()
        return self._stager

    def wait(self) -> None:
        """Wait for the save in flight, if any, then prune versions beyond ``keep``."""
        if self._pending is None:
            return
        pending, writer = self._pending, self._writer
        self._pending = self._writer = None
        pending.result()                        # raises the save's error
        if writer.version is not None:          # the coordinator
            self.saved_version = writer.version
            self._prune()

    def close(self) -> None:
        """Finish the save in flight.  Idempotent."""
        if not self._closed:
            try:
                self.wait()
            finally:
                self._closed = True
                if self._stager is not None:
                    self._stager.close()
                    self._stager = None

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the repository --------------------------------------------------------------
    def _open(self) -> Any:
        from ..models import Repository
        from ..models._open import open_repository

        if isinstance(self.repo, Repository):
            return self.repo, False
        return open_repository(self.repo), True

    def _latest(self) -> Optional[int]:
        repo, owned = self._open()
        try:
            versions = repo.versions(self.name) if self.name in repo.list() else []
        finally:
            if owned:
                repo.close()
        return max(versions) if versions else None

    def _prune(self) -> None:
        repo, owned = self._open()
        try:
            versions = sorted(repo.versions(self.name))
            for v in versions[:-self.keep]:
                repo.delete(self.name, v)
            if len(versions) > self.keep:
                repo.gc()
        finally:
            if owned:
                repo.close()

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("Checkpoint is closed")

"""The pieces for code that keeps ``torch.utils.data.DataLoader``: a map-style
:class:`Dataset` over a packed dataset or a store, and a :class:`PlanSampler` that yields
a rank's ids in the access plan's order."""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Optional

import torch

from ..dataset import PackedDataset, open_dataset
from ..plan import AccessPlan
from ..store import SampleStore
from ..errors import UsageError

__all__ = ["Dataset", "PlanSampler"]


class Dataset(torch.utils.data.Dataset):
    """Map-style dataset over a packed dataset or a store: ``ds[i]`` is a dict of
    tensors (one writable copy of the sample's record), for code that must keep
    ``torch.utils.data.DataLoader``.  Over a store (``Dataset(DistributedStore(...))``,
    as DDStore's ``DistDataset``) each sample is the store's ``store[i]``: from the
    group's memory, not the files.  A store that shares samples between ranks serves
    them in the process that made it: use ``num_workers=0`` with it (forebay's own
    DataLoader has transform workers that read from the store's memory)."""

    def __init__(self, dataset: "PackedDataset | SampleStore | str | os.PathLike[str]",
                 transform: Optional[Callable] = None) -> None:
        self.store: Optional[SampleStore] = None
        if isinstance(dataset, SampleStore):
            self.store, self.ds = dataset, dataset.ds
        else:
            self.ds = dataset if isinstance(dataset, PackedDataset) else open_dataset(dataset)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        if self.store is None:
            arrays = self.ds.sample(i, copy=True)
        else:
            if "shared" in self.store.capabilities and \
                    torch.utils.data.get_worker_info() is not None:
                raise UsageError(
                    f"{type(self.store).__name__} serves samples in the process that made "
                    "it, not in a DataLoader worker: use num_workers=0 with it (or "
                    "forebay.torch.DataLoader, whose transform workers read its memory)")
            arrays = self.store[i]
        sample = {k: torch.from_numpy(v) for k, v in arrays.items()}
        return self.transform(sample) if self.transform is not None else sample


class PlanSampler(torch.utils.data.Sampler):
    """Yields one rank's sample ids in :class:`~forebay.AccessPlan` order; with
    ``torch.utils.data.DataLoader(..., batch_size=plan.batch_size, sampler=...)`` the
    batches are the plan's batches.  Call :meth:`set_epoch` each epoch."""

    def __init__(self, plan: AccessPlan, rank: int = 0) -> None:
        self.plan, self.rank, self.epoch = plan, rank, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(self.plan.stream(self.rank, self.epoch).tolist())

    def __len__(self) -> int:
        return self.plan.steps_per_epoch * self.plan.batch_size

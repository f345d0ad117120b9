"""PyTorch integration: a plan-driven DataLoader, a map-style Dataset, a Sampler, collation,
transform workers."""

from typing import TYPE_CHECKING, Any

from ._collate import collate_graphs, collate_views, default_collate
from ._loader import DataLoader
from ._options import Auto, Clairvoyant, Direct, Pipeline, Preload, store_settings
from ._transforms import BatchDecodeCropFlip, DecodeCropFlip
from ._start import releases_gil
from ._workers import TransformError, sample_rng, sample_rngs

if TYPE_CHECKING:
    from ._checkpoint import Checkpoint  # noqa: F401
    from ._dataset import Dataset, PlanSampler  # noqa: F401

__all__ = ["Auto", "Checkpoint", "Clairvoyant", "DataLoader", "Dataset", "Direct", "Pipeline",
           "PlanSampler", "Preload", "collate_graphs", "collate_views", "default_collate",
           "store_settings", "TransformError", "releases_gil", "sample_rng", "sample_rngs",
           "DecodeCropFlip", "BatchDecodeCropFlip"]

if not TYPE_CHECKING:      # type checkers see the import above
    def __getattr__(name: str) -> Any:
        # made on first use: torch.distributed.checkpoint costs 0.6 s to import, paid
        # otherwise by every script that only loads data and by every transform worker;
        # Dataset and PlanSampler subclass torch's (1.5 s to import), which a loader of
        # numpy batches (collate_fn making no tensors) never needs
        if name == "Checkpoint":
            from ._checkpoint import Checkpoint

            globals()[name] = Checkpoint
            return Checkpoint
        if name in ("Dataset", "PlanSampler"):
            from . import _dataset

            globals()[name] = getattr(_dataset, name)
            return globals()[name]
        raise AttributeError(f"module 'forebay.torch' has no attribute {name!r}")

"""PyTorch integration: a plan-driven DataLoader, a map-style Dataset, a Sampler, collation,
transform workers."""

from typing import TYPE_CHECKING, Any

from ._collate import collate_graphs, collate_views, default_collate
from ._dataset import Dataset, PlanSampler
from ._loader import DataLoader
from ._options import Auto, Clairvoyant, Direct, Pipeline, Preload, store_settings
from ._transforms import BatchDecodeCropFlip, DecodeCropFlip
from ._start import releases_gil
from ._workers import TransformError, sample_rng, sample_rngs

if TYPE_CHECKING:
    from ._checkpoint import Checkpoint  # noqa: F401

__all__ = ["Auto", "Checkpoint", "Clairvoyant", "DataLoader", "Dataset", "Direct", "Pipeline",
           "PlanSampler", "Preload", "collate_graphs", "collate_views", "default_collate",
           "store_settings", "TransformError", "releases_gil", "sample_rng", "sample_rngs",
           "DecodeCropFlip", "BatchDecodeCropFlip"]

if not TYPE_CHECKING:      # type checkers see the import above
    def __getattr__(name: str) -> Any:
        # made on first use: torch.distributed.checkpoint costs 0.6 s to import, paid
        # otherwise by every script that only loads data and by every transform worker
        if name == "Checkpoint":
            from ._checkpoint import Checkpoint

            globals()[name] = Checkpoint
            return Checkpoint
        raise AttributeError(f"module 'forebay.torch' has no attribute {name!r}")

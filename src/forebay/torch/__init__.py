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

#: made on first use: torch.distributed.checkpoint costs 0.6 s to import, paid otherwise
#: by every script that only loads data and by every transform worker; Dataset and
#: PlanSampler subclass torch's (about 2 s to import), which a loader of numpy batches
#: (collate_fn making no tensors) never needs
_LAZY = {"Checkpoint": "._checkpoint", "Dataset": "._dataset", "PlanSampler": "._dataset"}

if not TYPE_CHECKING:      # type checkers see the import above
    def __getattr__(name: str) -> Any:
        if name not in _LAZY:
            raise AttributeError(f"module 'forebay.torch' has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value

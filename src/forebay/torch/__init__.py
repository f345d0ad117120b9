"""PyTorch integration: a plan-driven DataLoader, a map-style Dataset, a Sampler, collation,
transform workers."""

from ._collate import collate_graphs, collate_views, default_collate
from ._dataset import Dataset, PlanSampler
from ._checkpoint import Checkpoint
from ._loader import DataLoader
from ._options import Auto, Clairvoyant, Direct, Pipeline, Preload, store_settings
from ._transforms import BatchDecodeCropFlip, DecodeCropFlip
from ._workers import TransformError, sample_rng, sample_rngs

__all__ = ["Auto", "Checkpoint", "Clairvoyant", "DataLoader", "Dataset", "Direct", "Pipeline",
           "PlanSampler", "Preload", "collate_graphs", "collate_views", "default_collate",
           "store_settings", "TransformError", "sample_rng", "sample_rngs", "DecodeCropFlip",
           "BatchDecodeCropFlip"]

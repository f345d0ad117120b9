"""PyTorch integration: a plan-driven DataLoader, a map-style Dataset, a Sampler, collation."""

from ._collate import collate_graphs, default_collate
from ._loader import DataLoader, Dataset, PlanSampler

__all__ = ["DataLoader", "Dataset", "PlanSampler", "collate_graphs", "default_collate"]

"""forebay: keep accelerators fed when training on HPC clusters.

Quick start::

    import forebay
    forebay.write_dataset("data.fb", samples)      # samples: dicts of numpy arrays
    ds = forebay.open_dataset("data.fb")
    ds[0]                                          # dict of read-only views, no copy
    ds.get_many([3, 1, 4])                         # batched gather, one buffer per field
"""

from ._version import __version__
from . import errors  # noqa: E402
from .dataset import (DatasetWriter, PackedDataset, SampleBatch, Schema,  # noqa: E402
                      open_dataset, write_dataset)
from .errors import ForebayError  # noqa: E402
from .plan import AccessPlan  # noqa: E402

__all__ = [
    "__version__", "errors", "AccessPlan", "ForebayError", "DatasetWriter", "PackedDataset",
    "SampleBatch",
    "Schema", "open_dataset", "write_dataset",
]

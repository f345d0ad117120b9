"""forebay: keep accelerators fed when training on HPC clusters.

Quick start::

    import forebay
    forebay.write_dataset("data.fb", samples)      # samples: dicts of numpy arrays
    ds = forebay.open_dataset("data.fb")
    ds[0]                                          # dict of read-only views, no copy
    ds.get_many([3, 1, 4])                         # batched gather, one buffer per field
"""

from typing import TYPE_CHECKING, Any

from ._version import __version__
from . import errors  # noqa: E402
from .errors import ForebayError  # noqa: E402

if TYPE_CHECKING:
    from .dataset import (DatasetWriter, PackedDataset, SampleBatch, Schema,  # noqa: F401
                          append, decompressed, open_dataset, write_dataset)
    from .mixture import Mixture  # noqa: F401
    from .plan import AccessPlan  # noqa: F401

__all__ = [
    "__version__", "errors", "AccessPlan", "ForebayError", "DatasetWriter", "Mixture",
    "PackedDataset",
    "SampleBatch",
    "Schema", "append", "decompressed", "open_dataset", "write_dataset",
]

#: names made on first use (``import forebay`` stays light: the ``forebay`` command
#: imports numpy and the rest inside the part that turns Ctrl-C into one line)
_LAZY = {"DatasetWriter": "dataset", "PackedDataset": "dataset", "SampleBatch": "dataset",
         "Schema": "dataset", "open_dataset": "dataset", "write_dataset": "dataset",
         "append": "dataset", "decompressed": "dataset",
         "AccessPlan": "plan", "Mixture": "mixture"}


if not TYPE_CHECKING:      # type checkers see the imports above
    def __getattr__(name: str) -> Any:
        import importlib
        from pathlib import Path

        here = Path(__file__).parent
        if name in _LAZY:
            value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        elif not name.startswith("_") and ((here / name).is_dir() or
                                           (here / f"{name}.py").is_file()):
            value = importlib.import_module(f".{name}", __name__)      # forebay.synth etc.
        else:
            raise AttributeError(f"module 'forebay' has no attribute {name!r}")
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(_LAZY))

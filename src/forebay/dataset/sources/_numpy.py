"""Sources for NumPy files: ``.npz`` containers and ``.npy`` arrays."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ...errors import InvalidArgumentError, SourceError, UnsupportedDtypeError
from ._base import Source, check_keys, list_files, register_source

__all__ = ["NpzSource", "NpySource", "split_stacked"]

LAYOUTS = ("stacked", "per-file")


def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def split_stacked(arrays: dict[str, np.ndarray], where: str) -> list[dict[str, Any]]:
    """Samples from arrays stacked along axis 0 (all of the same length)."""
    lengths = {}
    for k, a in arrays.items():
        if a.ndim == 0:
            raise SourceError(f"{where}: array {k!r} is 0-d, so it has no sample axis "
                              f"(use --layout per-file for one sample per file)")
        lengths[k] = a.shape[0]
    if len(set(lengths.values())) > 1:
        raise SourceError(f"{where}: arrays differ in length along axis 0 (the sample axis): "
                          f"{lengths}")
    n = next(iter(lengths.values()), 0)
    keys = list(arrays)
    cols = [arrays[k] for k in keys]
    return [dict(zip(keys, row)) for row in zip(*cols)] if n else []


def _load_error(path: Path, e: Exception) -> Exception:
    msg = str(e)
    if "allow_pickle" in msg or "Object arrays" in msg:
        return UnsupportedDtypeError(f"{path}: holds an object array (would need unpickling); "
                                     f"only numeric arrays can be ingested")
    return SourceError(f"{path}: cannot read as NumPy data ({type(e).__name__}: {e})")


@register_source
class NpzSource(Source):
    """A directory of ``.npz`` files (or one file), read in sorted path order.

    Fields are named after the arrays' keys (``keys`` selects and orders some).
    ``layout="stacked"`` (default, as MuMMI stores data): every array holds many
    samples along axis 0.  ``layout="per-file"``: each file is one sample.
    """

    kind = "npz"

    def __init__(self, root: "str | os.PathLike[str]", *, keys: Optional[Sequence[str]] = None,
                 layout: Optional[str] = None, follow_links: bool = False,
                 **unused: Any) -> None:
        self.files = list_files(root, [".npz"], "npz", follow_links)
        self.keys = list(keys) if keys else None
        self.layout = _check_layout(layout or "stacked")

    def units(self) -> list[Path]:
        return self.files

    def read_unit(self, path: Path) -> list[dict[str, Any]]:
        try:
            # our own handle: np.load leaks its file when the archive is garbled
            with open(path, "rb") as fh, np.load(fh, allow_pickle=False) as z:
                names = check_keys(z.files, self.keys, str(path))
                arrays = {k: z[k] for k in names}
        except (SourceError, UnsupportedDtypeError):
            raise
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as e:
            raise _load_error(path, e) from None
        if self.layout == "per-file":
            return [arrays]
        return split_stacked(arrays, str(path))


@register_source
class NpySource(Source):
    """A directory of ``.npy`` files (or one file), one field named ``keys[0]``
    (default ``data``).  ``layout="per-file"`` (default): each file is one sample;
    ``"stacked"``: each file holds samples along axis 0."""

    kind = "npy"

    def __init__(self, root: "str | os.PathLike[str]", *, keys: Optional[Sequence[str]] = None,
                 layout: Optional[str] = None, follow_links: bool = False,
                 **unused: Any) -> None:
        self.files = list_files(root, [".npy"], "npy", follow_links)
        if keys and len(keys) != 1:
            raise InvalidArgumentError(
                f"an npy source has one field; --keys names it (got {list(keys)})")
        self.name = keys[0] if keys else "data"
        self.layout = _check_layout(layout or "per-file")

    def units(self) -> list[Path]:
        return self.files

    def read_unit(self, path: Path) -> list[dict[str, Any]]:
        try:
            with open(path, "rb") as fh:
                arr = np.load(fh, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise _load_error(path, e) from None
        if self.layout == "per-file":
            return [{self.name: arr}]
        return split_stacked({self.name: arr}, str(path))

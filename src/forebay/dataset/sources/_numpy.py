"""Sources for NumPy files: ``.npz`` containers and ``.npy`` arrays."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from collections.abc import Sequence as SequenceABC
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from ...errors import (InvalidArgumentError, SampleIndexError, SourceError,
                       UnsupportedDtypeError)
from .._format import read_npy_header
from ._base import Source, check_keys, list_files, register_source

__all__ = ["NpzSource", "NpySource", "Stacked", "check_declared", "check_npz",
           "expect_format", "split_stacked"]

LAYOUTS = ("stacked", "per-file")


def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def split_stacked(arrays: dict[str, np.ndarray], where: str) -> "Stacked":
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
    return Stacked(arrays, next(iter(lengths.values()), 0))


class Stacked(SequenceABC):
    """``n`` samples stacked along axis 0 of ``arrays``, each made when it is asked
    for: 2 M one-byte samples cost their 2 MB, not 2 M dicts of views (900 MB)."""

    def __init__(self, arrays: dict[str, Any], n: int) -> None:
        """``arrays``: name -> an array stacked along axis 0, or a list of per-sample
        arrays (ragged)."""
        self.arrays, self.n = arrays, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise SampleIndexError(f"sample {i} of {self.n}")
        return {k: a[i] for k, a in self.arrays.items()}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        keys = list(self.arrays)
        return (dict(zip(keys, row)) for row in zip(*self.arrays.values()))


def check_declared(fh: Any, stored: int, where: str) -> None:
    """Read the ``.npy`` header at ``fh`` (positioned at the array's start; ``stored``
    bytes in all, header included) and refuse, before anything is allocated, an array
    that declares more bytes than are stored (truncated or crafted: an 8 MB file
    declaring shape (1, 8e9)) or more than this node's available memory.  Headers that
    cannot be read here are left to ``np.load``'s own errors."""
    from ..._memory import available_memory
    from ..._units import human_bytes

    try:
        shape, _, dtype = read_npy_header(fh)
    except Exception:       # noqa: BLE001 - np.load reports it with its own words
        return
    if dtype.hasobject:
        return
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    body = stored - fh.tell()
    what = f"{where} declares shape {shape} of {dtype} ({human_bytes(nbytes)})"
    if nbytes > body:
        raise SourceError(f"{what} but holds {human_bytes(max(body, 0))}: truncated or "
                          f"crafted; not read")
    avail = available_memory()
    if avail is not None and nbytes > avail:
        raise SourceError(f"{what}: more than the {human_bytes(avail)} of memory available "
                          f"on this node; not read")


def check_npz(z: Any, names: Sequence[str], where: str) -> None:
    """:func:`check_declared` for each of ``names`` in the open npz archive ``z``
    (``np.load``'s, whose zip directory is read once)."""
    for name in names:
        try:
            info = z.zip.getinfo(name + ".npy")
        except KeyError:
            continue
        with z.zip.open(info) as m:
            check_declared(m, info.file_size, f"{where}: array {name!r}")


def expect_format(fh: Any, kind: str, where: str) -> None:
    """Refuse a file that is not an npz archive (``kind`` "npz") or an ``.npy`` array:
    np.load takes anything else for a pickle and says "contains pickled data"."""
    fh.seek(0)
    head = fh.read(6)
    fh.seek(0)
    if kind == "npz" and not head.startswith(b"PK"):
        raise SourceError(f"{where}: not an npz archive (not a zip file)")
    if kind == "npy" and head != b"\x93NUMPY":
        raise SourceError(f"{where}: not an .npy array (no NumPy header)")


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

    def read_unit(self, path: Path) -> Sequence[dict[str, Any]]:
        try:
            # our own handle: np.load leaks its file when the archive is garbled
            with open(path, "rb") as fh:
                expect_format(fh, "npz", str(path))
                with np.load(fh, allow_pickle=False) as z:
                    names = check_keys(z.files, self.keys, str(path))
                    check_npz(z, names, str(path))
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

    def read_unit(self, path: Path) -> Sequence[dict[str, Any]]:
        try:
            with open(path, "rb") as fh:
                expect_format(fh, "npy", str(path))
                check_declared(fh, os.fstat(fh.fileno()).st_size, str(path))
                fh.seek(0)
                arr = np.load(fh, allow_pickle=False)
        except SourceError:
            raise
        except (OSError, ValueError, EOFError) as e:
            raise _load_error(path, e) from None
        if self.layout == "per-file":
            return [{self.name: arr}]
        return split_stacked({self.name: arr}, str(path))

"""Zarr stores (v2 and v3): samples along axis 0 of each array, read in chunk-aligned
ranges."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ...errors import DatasetNotFoundError, SourceError, UnsupportedDtypeError
from ._base import Source, check_keys, confine, register_source
from ._numpy import Stacked

__all__ = ["ZarrSource"]

#: bytes a unit aims at (whole chunks along axis 0)
UNIT_BYTES = 64 << 20


def _open(root: Path) -> Any:
    import zarr

    try:
        return zarr.open(str(root), mode="r")
    except Exception as e:  # noqa: BLE001 - zarr raises many kinds for a bad store
        raise SourceError(f"{root}: cannot open as a Zarr store ({type(e).__name__}: "
                          f"{e})") from None


@register_source
class ZarrSource(Source):
    """A Zarr store (format 2 or 3, a directory): one array, whose rows along axis 0
    are the samples of field ``data`` (or ``keys[0]``), or a group whose arrays (nested
    ones by their path; ``keys`` selects and orders) all hold the same number of rows,
    each a field.  Units are ranges of whole chunks along axis 0 (about ``unit_bytes``,
    64 MB), read in parallel.  Numbers and booleans only; nothing under the store that leads outside
    it is read unless ``follow_links``."""

    kind = "zarr"
    unit_name = "chunk range"

    def __init__(self, root: "str | os.PathLike[str]", *, keys: Optional[Sequence[str]] = None,
                 follow_links: bool = False, unit_bytes: int = UNIT_BYTES,
                 **unused: Any) -> None:
        import zarr

        self.root = Path(root)
        if not self.root.is_dir():
            raise DatasetNotFoundError(f"Zarr store {self.root} is not a directory")
        confine(self.root, (p for p in self.root.rglob("*") if p.is_file()), follow_links)
        z = _open(self.root)
        if isinstance(z, zarr.Array):
            name = keys[0] if keys else "data"
            if keys and len(keys) != 1:
                raise SourceError(f"{self.root}: one array, one field; --keys names it "
                                  f"(got {list(keys)})")
            self.paths: dict[str, Optional[str]] = {name: None}
            arrays = {name: z}
        else:
            found = {p: a for p, a in z.members(max_depth=None) if isinstance(a, zarr.Array)}
            chosen = check_keys(sorted(found), keys, str(self.root))
            self.paths = {p: p for p in chosen}
            arrays = {p: found[p] for p in chosen}
        if not arrays:
            raise SourceError(f"{self.root}: no arrays")
        rows = {}
        for name, a in arrays.items():
            if np.dtype(a.dtype).kind not in "biufc":
                raise UnsupportedDtypeError(f"{self.root}: array {name!r} has dtype {a.dtype}; "
                                            f"only numbers and booleans are stored")
            if not a.shape:
                raise SourceError(f"{self.root}: array {name!r} is 0-d: no sample axis")
            rows[name] = a.shape[0]
        if len(set(rows.values())) > 1:
            raise SourceError(f"{self.root}: arrays hold different numbers of rows along axis "
                              f"0 (the sample axis): {rows}")
        n = next(iter(rows.values()))
        first = next(iter(arrays.values()))
        chunk = max(1, int(first.chunks[0]))
        row_bytes = sum(int(np.prod(a.shape[1:], dtype=np.int64)) * np.dtype(a.dtype).itemsize
                        for a in arrays.values())
        per = chunk * max(1, int(unit_bytes) // max(row_bytes * chunk, 1))
        self._units = [(a, min(a + per, n)) for a in range(0, n, per)]

    def units(self) -> list[tuple[int, int]]:
        return self._units

    def read_unit(self, unit: tuple[int, int]) -> Stacked:
        a, b = unit
        z = _open(self.root)
        out = {}
        for name, path in self.paths.items():
            arr = z if path is None else z[path]
            try:
                out[name] = np.asarray(arr[a:b])
            except Exception as e:  # noqa: BLE001 - codecs and stores raise many kinds
                raise SourceError(f"{self.root}: array {name!r} rows {a}-{b}: cannot read "
                                  f"({type(e).__name__}: {e})") from None
        return Stacked(out, b - a)

    def metadata(self) -> dict[str, Any]:
        return {"source_kind": self.kind, "arrays": list(self.paths)}

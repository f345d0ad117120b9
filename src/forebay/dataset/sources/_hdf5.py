"""HDF5 containers (CFF): chosen datasets, samples along axis 0, ragged data as flat + offsets."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ...errors import InvalidArgumentError, SourceError, UnsupportedDtypeError
from ._base import OPT_IN, Source, check_keys, inside, list_files, register_source

__all__ = ["Hdf5Source", "OFFSETS_SUFFIX"]

#: ``NAME_offsets`` beside dataset ``NAME`` marks ``NAME`` as ragged (flat + offsets).
OFFSETS_SUFFIX = "_offsets"
_CHUNK_BYTES = 32 << 20


@dataclass(frozen=True)
class _FieldPlan:
    name: str
    offsets: Optional[str]  # dataset holding n+1 offsets, or None for a dense field
    axis: int               # axis the flat ragged data is concatenated along


@dataclass(frozen=True)
class _FilePlan:
    path: Path
    count: int
    fields: tuple[_FieldPlan, ...]


def _datasets(f: Any) -> list[str]:
    """The file's datasets, then its external links (not followed here: what they lead
    to is checked by :func:`guard_links` before it is opened)."""
    import h5py

    names: list[str] = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    f.visititems_links(lambda name, link: names.append(name)
                       if isinstance(link, h5py.ExternalLink) else None)
    return names


def check_fits(ds: Any, path: Path, name: str) -> None:
    """Refuse a dataset read whole whose declared size exceeds this node's available
    memory (HDF5 stores unwritten chunks as nothing: a small file may declare TiB)."""
    from ..._memory import available_memory
    from ..._units import human_bytes

    nbytes = int(np.prod(ds.shape, dtype=object)) * ds.dtype.itemsize
    avail = available_memory()
    if avail is not None and nbytes > avail:
        raise SourceError(f"{path}: dataset {name!r} declares shape {ds.shape} of {ds.dtype} "
                          f"({human_bytes(nbytes)}): more than the {human_bytes(avail)} of "
                          f"memory available on this node; not read")


def _dataset(f: Any, path: Path, name: str) -> Any:
    """``f[name]``, which must be a dataset (an external link may lead to a group)."""
    import h5py

    obj = f.get(name)
    if not isinstance(obj, h5py.Dataset):
        raise SourceError(f"{path}: {name!r} is not a dataset (an external link to "
                          f"{'nothing' if obj is None else 'a group'}?)")
    return obj


def guard_links(f: Any, path: Path, names: Sequence[str], root: "str | os.PathLike[str]",
                follow_links: bool) -> None:
    """Refuse, unless ``follow_links``, datasets ``names`` of the open HDF5 file ``f``
    whose bytes lie in other files: reached through an external link to a file outside
    the source ``root``, stored externally (raw data in another file, such as
    ``/etc/passwd``), or virtual (mapped from other files)."""
    import h5py

    if follow_links:
        return
    for name in names:
        parts = name.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            link = f.get("/".join(parts[:i]), getlink=True)
            if isinstance(link, h5py.ExternalLink):
                target = Path(link.filename)
                target = target if target.is_absolute() else path.parent / target
                if not inside(root, target):
                    raise SourceError(f"{path}: {name!r} is an external link to {target}, "
                                      f"outside the source {root}: not read; {OPT_IN}")
        obj = f.get(name)
        if isinstance(obj, h5py.Dataset):
            if obj.external:
                raise SourceError(f"{path}: dataset {name!r} stores its data in another "
                                  f"file ({obj.external[0][0]}): not read; {OPT_IN}")
            if obj.is_virtual:
                files = sorted({s.file_name for s in obj.virtual_sources()})
                raise SourceError(f"{path}: dataset {name!r} is virtual, mapped from "
                                  f"{', '.join(files)}: not read; {OPT_IN}")


@register_source
class Hdf5Source(Source):
    """One HDF5 file (or a directory of ``.h5``/``.hdf5`` files, in sorted order).

    Every chosen dataset (``keys``; default: all) holds samples along axis 0 and
    becomes a field named after its path in the file.  Ragged data (graphs with
    varying node and edge counts) is stored flat with an offsets dataset of n+1
    entries (first 0): ``NAME_offsets`` beside ``NAME`` is found automatically, or
    name the pair with ``ragged={"NAME": "OFFSETS"}``.  Sample k of a ragged field
    is ``NAME[off[k]:off[k+1]]`` along axis 0, or along the axis given by the offsets
    dataset's ``axis`` attribute (e.g. ``edge_index`` stored as ``(2, E_total)``).

    ``layout="per-file"`` reads a directory of HDF5 files holding one sample each
    (CosmoFlow's layout): every chosen dataset, whole, is a field.
    """

    kind = "hdf5"
    unit_name = "chunk"

    def __init__(self, root: "str | os.PathLike[str]", *, keys: Optional[Sequence[str]] = None,
                 ragged: Optional[Mapping[str, str]] = None, chunk_bytes: int = _CHUNK_BYTES,
                 layout: Optional[str] = None, follow_links: bool = False,
                 **unused: Any) -> None:
        import h5py

        if layout not in (None, "stacked", "per-file"):
            raise InvalidArgumentError(f"layout must be 'stacked' or 'per-file', got {layout!r}")
        self.keys = list(keys) if keys else None
        self.ragged = dict(ragged or {})
        self.per_file = layout == "per-file"
        self.plans: list[_FilePlan] = []
        self._units: list[tuple[int, int, int]] = []
        self.root, self.follow_links = root, follow_links
        files = list_files(root, [".h5", ".hdf5", ".hdf"], "HDF5", follow_links)
        if self.per_file:
            self.files = files
            self._units = [(k, 0, 1) for k in range(len(files))]
            return
        for path in files:
            try:
                with h5py.File(path, "r") as f:
                    plan, per_sample = self._plan(f, path)
            except OSError as e:
                raise SourceError(f"{path}: cannot open as HDF5 ({e})") from None
            k = len(self.plans)
            self.plans.append(plan)
            rows = max(1, int(chunk_bytes // max(per_sample, 1)))
            self._units += [(k, a, min(a + rows, plan.count)) for a in range(0, plan.count, rows)]

    def _plan(self, f: Any, path: Path) -> tuple[_FilePlan, float]:
        all_names = _datasets(f)
        offsets_of = dict(self.ragged)
        for name in all_names:
            if name + OFFSETS_SUFFIX in all_names and name not in offsets_of:
                offsets_of[name] = name + OFFSETS_SUFFIX
        hidden = set(offsets_of.values())
        candidates = [n for n in all_names if n not in hidden]
        names = check_keys(candidates if not self.keys else all_names, self.keys, str(path))
        guard_links(f, path, names + [offsets_of[n] for n in names if n in offsets_of],
                    self.root, self.follow_links)
        fields, counts, per_sample = [], {}, 0.0
        for name in names:
            ds = _dataset(f, path, name)
            if ds.dtype.kind not in "biufc":
                raise UnsupportedDtypeError(f"{path}: dataset {name!r} has dtype {ds.dtype}; "
                                            f"only numeric or bool datasets can be ingested")
            if ds.ndim == 0:
                raise SourceError(f"{path}: dataset {name!r} is a scalar, it has no sample axis")
            off_name = offsets_of.get(name)
            if off_name is not None:
                if off_name not in f:
                    raise SourceError(f"{path}: offsets dataset {off_name!r} for {name!r} "
                                      f"is missing")
                off = f[off_name]
                axis = int(off.attrs.get("axis", 0))
                axis = axis + ds.ndim if axis < 0 else axis
                if off.ndim != 1 or off.dtype.kind not in "iu" or len(off) < 1 or \
                        not 0 <= axis < ds.ndim:
                    raise SourceError(f"{path}: {off_name!r} must be 1-D integer offsets (n+1 "
                                      f"entries) with a valid axis for {name!r}")
                if int(off[-1]) != ds.shape[axis] or int(off[0]) != 0:
                    raise SourceError(f"{path}: offsets {off_name!r} run from {int(off[0])} to "
                                      f"{int(off[-1])} but {name!r} has {ds.shape[axis]} entries "
                                      f"along axis {axis}")
                counts[name] = len(off) - 1
                fields.append(_FieldPlan(name, off_name, axis))
            else:
                counts[name] = ds.shape[0]
                fields.append(_FieldPlan(name, None, 0))
            per_sample += ds.size * ds.dtype.itemsize / max(counts[name], 1)
        if len(set(counts.values())) > 1:
            raise SourceError(f"{path}: datasets hold different sample counts: {counts}")
        return _FilePlan(path, next(iter(counts.values())), tuple(fields)), per_sample

    def _read_whole(self, path: Path) -> dict[str, Any]:
        import h5py

        try:
            with h5py.File(path, "r") as f:
                names = check_keys(_datasets(f), self.keys, str(path))
                guard_links(f, path, names, self.root, self.follow_links)
                for n in names:
                    check_fits(_dataset(f, path, n), path, n)
                    if _dataset(f, path, n).dtype.kind not in "biufc":
                        raise UnsupportedDtypeError(f"{path}: dataset {n!r} has dtype "
                                                    f"{f[n].dtype}; only numeric or bool "
                                                    f"datasets can be ingested")
                return {n: f[n][()] for n in names}
        except OSError as e:
            raise SourceError(f"{path}: cannot open as HDF5 ({e})") from None

    def units(self) -> list[tuple[int, int, int]]:
        return self._units

    def read_unit(self, unit: tuple[int, int, int]) -> list[dict[str, Any]]:
        import h5py

        k, a, b = unit
        if self.per_file:
            return [self._read_whole(self.files[k])]
        plan = self.plans[k]
        cols: dict[str, list[np.ndarray]] = {}
        with h5py.File(plan.path, "r") as f:
            for fp in plan.fields:
                ds = f[fp.name]
                if fp.offsets is None:
                    cols[fp.name] = list(ds[a:b])
                    continue
                off = f[fp.offsets][a:b + 1].astype(np.int64)
                if (np.diff(off) < 0).any():
                    bad = a + int(np.argmax(np.diff(off) < 0))
                    raise SourceError(f"{plan.path}: offsets {fp.offsets!r} decrease at "
                                      f"sample {bad}")
                sl = [slice(None)] * ds.ndim
                sl[fp.axis] = slice(int(off[0]), int(off[-1]))
                flat = ds[tuple(sl)]
                cols[fp.name] = np.split(flat, (off[1:-1] - off[0]).tolist(), axis=fp.axis)
        names = list(cols)
        return [dict(zip(names, row)) for row in zip(*(cols[n] for n in names))]

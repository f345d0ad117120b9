"""Batches of samples in flat, columnar form: one buffer per field, no per-sample objects."""

from __future__ import annotations

import collections
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np

from ..errors import InvalidArgumentError, SchemaError
from ._codec import inflate
from ._schema import Schema

__all__ = ["BufferPool", "FieldBatch", "ReadOnly", "SampleBatch", "SampleViews", "assemble_batch",
           "assemble_views", "gather_ranges", "gather_ranges_numpy"]

try:  # the optional C kernel (setup.py builds it; numpy fallback otherwise)
    from .. import _native  # type: ignore[attr-defined, unused-ignore]
except ImportError:  # pragma: no cover - exercised where no compiler was available
    _native = None

ALIGN = 64
# Below this mean range length a fancy-index gather beats a loop of slice copies.
_VECTOR_GATHER_MAX_MEAN = 512


def gather_ranges(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                  out: np.ndarray, dst: np.ndarray) -> None:
    """Copy ``src[starts[k]:starts[k]+lengths[k]]`` to ``out[dst[k]:...]`` for every k.

    ``src`` and ``out`` are 1-D uint8 (``out`` writable).  Uses the C kernel
    (memcpy per range, bounds-checked, GIL released) when it was built, else numpy.
    """
    if _native is not None:
        _native.gather(src, np.ascontiguousarray(starts, dtype=np.int64),
                       np.ascontiguousarray(lengths, dtype=np.int64), out,
                       np.ascontiguousarray(dst, dtype=np.int64))
    else:
        gather_ranges_numpy(src, starts, lengths, out, dst)


def gather_ranges_numpy(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                        out: np.ndarray, dst: np.ndarray) -> None:
    """numpy fallback of :func:`gather_ranges`: small ranges by one fancy-index copy,
    large ones (where the copy, not Python, is the cost) by slice assignments."""
    n = len(starts)
    total = int(lengths.sum()) if n else 0
    if total == 0:
        return
    if (starts < 0).any() or (dst < 0).any() or (starts + lengths > len(src)).any() or \
            (dst + lengths > len(out)).any():
        raise InvalidArgumentError("gather: a range is out of bounds")
    if total <= _VECTOR_GATHER_MAX_MEAN * n:
        rep_shift = np.repeat(starts - dst, lengths)
        seg_start = np.repeat(dst, lengths)
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out_pos = seg_start + within
        out[out_pos] = src[out_pos + rep_shift]
    else:
        for s, n, d in zip(starts.tolist(), lengths.tolist(), dst.tolist()):
            out[d:d + n] = src[s:s + n]


@dataclass(frozen=True)
class FieldBatch:
    """One field of ``n`` samples, concatenated.

    Attributes:
        values: 1-D array of the field's dtype holding every sample's elements in order.
        offsets: ``int64[n+1]``; sample k's elements are ``values[offsets[k]:offsets[k+1]]``.
        shapes: ``int64[n, ndim]``; sample k's array shape.
    """

    values: np.ndarray
    offsets: np.ndarray
    shapes: np.ndarray

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def uniform(self) -> bool:
        """True when every sample has the same shape (the field stacks into one array)."""
        return len(self.shapes) == 0 or bool((self.shapes == self.shapes[0]).all())

    def stacked(self) -> np.ndarray:
        """Array of shape ``(n, *shape)``: a view of :attr:`values`, no copy."""
        if not self.uniform:
            raise SchemaError("field has ragged shapes across the batch; use .values with "
                              ".offsets and .shapes, or .sample(k)")
        shape = tuple(self.shapes[0]) if len(self.shapes) else ()
        return self.values.reshape((len(self.shapes),) + tuple(int(d) for d in shape))

    def __getitem__(self, k: int) -> np.ndarray:
        return self.values[self.offsets[k]:self.offsets[k + 1]].reshape(
            tuple(int(d) for d in self.shapes[k]))

    def equals(self, other: "FieldBatch") -> bool:
        """Bit-exact equality of values, offsets and shapes."""
        return (self.values.dtype == other.values.dtype
                and np.array_equal(self.offsets, other.offsets)
                and np.array_equal(self.shapes, other.shapes)
                and self.values.view(np.uint8).tobytes() == other.values.view(np.uint8).tobytes())


class SampleBatch:
    """The result of ``get_many(ids)``: ``n`` samples held field by field.

    ``batch[name]`` is the field stacked to ``(n, *shape)`` when every sample has the
    same shape; ``batch.field(name)`` gives the :class:`FieldBatch` (values, offsets,
    shapes) for ragged fields; ``batch.sample(k)`` gives sample k as a dict of views,
    and ``len(batch)`` / iteration go over samples as a list of samples would.
    """

    def __init__(self, ids: np.ndarray, schema: Schema, fields: dict[str, FieldBatch]) -> None:
        self.ids = ids
        self.schema = schema
        self.fields = fields

    def __getitem__(self, name: str) -> np.ndarray:
        return self.fields[name].stacked()

    def keys(self):
        return self.fields.keys()

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return (self.sample(k) for k in range(self.num_samples))

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_samples(self) -> int:
        return len(self.ids)

    def field(self, name: str) -> FieldBatch:
        return self.fields[name]

    def sample(self, k: int) -> dict[str, np.ndarray]:
        """Sample ``k`` of the batch as a dict of arrays (views into the batch)."""
        return {name: fb[k] for name, fb in self.fields.items()}

    def samples(self) -> list[dict[str, np.ndarray]]:
        return [self.sample(k) for k in range(self.num_samples)]

    def equals(self, other: "SampleBatch") -> bool:
        """Bit-exact equality with another batch (same ids, same fields, same bytes)."""
        return (np.array_equal(self.ids, other.ids) and self.fields.keys() == other.fields.keys()
                and all(fb.equals(other.fields[n]) for n, fb in self.fields.items()))

    def __repr__(self) -> str:
        return f"SampleBatch(n={self.num_samples}, fields=[{self.schema.describe()}])"


def assemble_batch(ids: np.ndarray, rows: np.ndarray, schema: Schema, layout,
                   parts: list[tuple[np.ndarray, np.ndarray, Any]],
                   alloc=None, timings: Optional[list] = None) -> SampleBatch:
    """Build a :class:`SampleBatch` of ``ids`` from record bytes held in memory.

    ``rows`` are the ids' index rows; ``parts`` covers every row once, each part a
    ``(src, record_starts, selector)``: a uint8 buffer, where each selected row's
    record starts in it, and the selector (slice or mask) of those rows.  All fields
    land in one output buffer (``alloc(nbytes)`` provides it if given, e.g. pinned host
    memory), one region per field; one gather call per part moves every field of every
    selected sample, so the fixed cost per batch is a few dozen numpy operations.
    ``timings``, if a list, gets one ``(start, end)`` perf_counter pair per part
    (tracing attributes each part's time to its source).
    """
    if layout.coded:
        return _assemble_coded(ids, rows, schema, layout, parts, alloc, timings)
    if _FAST:
        if timings is None:
            got = _assemble_one_call(ids, rows, layout, parts, alloc)
            if got is not NotImplemented:
                return SampleBatch(ids, schema, got)
        if all(_mask_of(sel, len(ids)) is not False for _, _, sel in parts):
            return _assemble_native(ids, rows, schema, layout, parts, alloc, timings)
    n = len(ids)
    nf = len(schema.fields)
    lens = rows[:, layout.nbytes_cols]                         # (n, nf) bytes per field
    totals = lens.sum(axis=0)
    region = totals + (-totals) % ALIGN                        # each field region aligned
    base = np.zeros(nf, dtype=np.int64)
    np.cumsum(region[:-1], out=base[1:])
    dst = np.cumsum(lens, axis=0) - lens + base                 # (n, nf) output offsets
    starts = rows[:, layout.off_cols]                          # (n, nf) relative to record
    size = int(region.sum())
    out = np.empty(size, dtype=np.uint8) if alloc is None else alloc(size)
    for src, rec_start, sel in parts:
        t0 = time.perf_counter() if timings is not None else 0.0
        gather_ranges(src, (starts[sel] + rec_start[:, None]).ravel(), lens[sel].ravel(), out,
                      dst[sel].ravel())
        if timings is not None:
            timings.append((t0, time.perf_counter()))
    elems = np.zeros((n + 1, nf), dtype=np.int64)
    np.cumsum(lens // layout.itemsizes, axis=0, out=elems[1:])
    fields = {}
    for k, f in enumerate(schema.fields):
        b = int(base[k])
        fields[f.name] = FieldBatch(values=out[b:b + int(totals[k])].view(f.dtype),
                                    offsets=elems[:, k], shapes=rows[:, layout.shape[f.name]])
    return SampleBatch(ids, schema, fields)


def _assemble_coded(ids: np.ndarray, rows: np.ndarray, schema: Schema, layout,
                    parts: list[tuple[np.ndarray, np.ndarray, Any]], alloc,
                    timings: Optional[list]) -> SampleBatch:
    """:func:`assemble_batch` with compressed fields: the stored fields gathered into
    the output as usual, the compressed ones' frames into a scratch buffer, then
    decompressed into the output (their size is their shape's)."""
    coded = layout.coded
    plain = [k for k in range(len(schema.fields)) if k not in coded]
    stored = rows[:, layout.nbytes_cols]                       # (n, nf) bytes in records
    lens = stored.copy()                                       # (n, nf) bytes of values
    for k in coded:
        lens[:, k] = np.prod(rows[:, layout.fields[k][2]], axis=1) * layout.itemsizes[k]
    totals = lens.sum(axis=0)
    region = totals + (-totals) % ALIGN
    base = np.concatenate([[0], np.cumsum(region)[:-1]]).astype(np.int64)
    dst = np.cumsum(lens, axis=0) - lens + base
    size = int(region.sum())
    out = np.empty(size, dtype=np.uint8) if alloc is None else alloc(size)
    frames = stored[:, coded]
    fdst = (np.cumsum(frames.ravel()) - frames.ravel()).reshape(frames.shape)
    scratch = np.empty(int(frames.sum()), dtype=np.uint8)
    starts = rows[:, layout.off_cols]
    for src, rec_start, sel in parts:
        t0 = time.perf_counter() if timings is not None else 0.0
        at = starts[sel] + np.asarray(rec_start, dtype=np.int64)[:, None]
        gather_ranges(src, at[:, plain].ravel(), lens[sel][:, plain].ravel(), out,
                      dst[sel][:, plain].ravel())
        gather_ranges(src, at[:, coded].ravel(), frames[sel].ravel(), scratch,
                      fdst[sel].ravel())
        if timings is not None:
            timings.append((t0, time.perf_counter()))
    for j, k in enumerate(coded):
        name = schema.fields[k].name
        inflate(scratch, fdst[:, j], frames[:, j], lens[:, k], out, dst[:, k],
                lambda i, name=name: f"sample {int(ids[i])}, field {name!r}")
    elems = np.zeros((len(ids) + 1, len(schema.fields)), dtype=np.int64)
    np.cumsum(lens // layout.itemsizes, axis=0, out=elems[1:])
    return SampleBatch(ids, schema, {
        f.name: FieldBatch(values=out[int(base[k]):int(base[k] + totals[k])].view(f.dtype),
                           offsets=elems[:, k], shapes=rows[:, layout.shape[f.name]])
        for k, f in enumerate(schema.fields)})


_FAST = _native is not None and hasattr(_native, "assemble")


def _empty_bytes(n: int, _empty: Any = np.empty, _u8: Any = np.uint8) -> np.ndarray:
    return _empty(n, dtype=_u8)


def _assemble_one_call(ids: np.ndarray, rows: np.ndarray, layout,
                       parts: list[tuple[np.ndarray, np.ndarray, Any]],
                       alloc) -> "dict[str, FieldBatch] | Any":
    """assemble_batch's fields in one C call (layout, allocation, every part's copy):
    a one-sample batch's fixed cost is then the FieldBatch objects.  NotImplemented
    when a part is not one the call takes (an index array or partial slice as selector,
    starts or rows that are not C-contiguous int64): nothing was allocated or copied."""
    n, nf = len(ids), len(layout.fields)
    ncols = rows.shape[1] if rows.ndim == 2 else 0
    meta = np.empty(nf + n * nf + (n + 1) * nf, dtype=np.int64)
    got = _native.assemble(rows, ncols, layout.off_cols, layout.nbytes_cols,
                           layout.itemsizes, ALIGN, meta, parts,
                           _empty_bytes if alloc is None else alloc)
    if got is NotImplemented:
        return got
    out, bounds = got
    elems = meta[nf + n * nf:].reshape(n + 1, nf)
    fields = {}
    for k, (name, dtype, shape) in enumerate(layout.fields):
        fields[name] = _field_batch(out[bounds[2 * k]:bounds[2 * k + 1]].view(dtype),
                                    elems[:, k], rows[:, shape])
    return fields


def _mask_of(sel: Any, n: int) -> Any:
    """A part's selector as the C kernel takes it: None (every row), a bool mask, or
    False (a selector it does not take: an index array, a partial slice)."""
    if isinstance(sel, slice):
        return None if sel == slice(None) else False
    if isinstance(sel, np.ndarray) and sel.dtype == np.bool_ and sel.shape == (n,):
        return np.ascontiguousarray(sel)
    return False


def _assemble_native(ids: np.ndarray, rows: np.ndarray, schema: Schema, layout,
                     parts: list[tuple[np.ndarray, np.ndarray, Any]], alloc,
                     timings: Optional[list]) -> SampleBatch:
    """assemble_batch in two C calls: the layout of the output, then one copy per part
    of every field of its samples (a batch's fixed cost is then a few microseconds)."""
    n, nf = len(ids), len(schema.fields)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    ncols = rows.shape[1] if rows.ndim == 2 else 0
    meta = np.empty(nf + n * nf + (n + 1) * nf, dtype=np.int64)
    size = _native.batch_layout(rows, ncols, layout.nbytes_cols, layout.itemsizes,
                                ALIGN, meta)
    dst = meta[nf:nf + n * nf]
    out = np.empty(size, dtype=np.uint8) if alloc is None else alloc(size)
    for src, rec_start, sel in parts:
        t0 = time.perf_counter() if timings is not None else 0.0
        _native.gather_fields(src, rows, ncols, layout.off_cols, layout.nbytes_cols,
                              np.ascontiguousarray(rec_start, dtype=np.int64),
                              _mask_of(sel, n), dst, out)
        if timings is not None:
            timings.append((t0, time.perf_counter()))
    base = meta[:nf].tolist()
    elems = meta[nf + n * nf:].reshape(n + 1, nf)
    ends = (elems[n] * layout.itemsizes + meta[:nf]).tolist()
    fields = {}
    for k, (name, dtype, shape) in enumerate(layout.fields):
        fields[name] = _field_batch(out[base[k]:ends[k]].view(dtype), elems[:, k],
                                    rows[:, shape])
    return SampleBatch(ids, schema, fields)


def _field_batch(values: np.ndarray, offsets: np.ndarray, shapes: np.ndarray,
                 _new: Any = object.__new__) -> "FieldBatch":
    """FieldBatch(values, offsets, shapes) without the frozen dataclass's checked
    __setattr__ (half its cost: a one-sample batch of five fields builds five)."""
    fb = _new(FieldBatch)
    d = fb.__dict__
    d["values"], d["offsets"], d["shapes"] = values, offsets, shapes
    return fb


class SampleViews:
    """Samples as read-only arrays over the memory that holds them, without a copy:
    what ``get_views(ids)`` returns (a store's memory, a dataset's memory-mapped files).

    ``views[name]`` is field ``name`` as a list of per-sample arrays (``ids`` order),
    ``views.sample(k)`` sample k as a dict, ``views.stacked(name)`` a field whose samples
    share one shape as one ``(n, *shape)`` array (a copy).  The arrays cannot be written
    (``ValueError: assignment destination is read-only``: copy one with ``np.array`` to
    change it), and each keeps the memory it views valid while it is referenced,
    whatever happens to the store.
    """

    def __init__(self, ids: np.ndarray, schema: Schema,
                 fields: "dict[str, list[np.ndarray]]") -> None:
        self.ids = ids
        self.schema = schema
        self.fields = fields

    def __getitem__(self, name: str) -> "list[np.ndarray]":
        return self.fields[name]

    def keys(self):
        return self.fields.keys()

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return (self.sample(k) for k in range(self.num_samples))

    @property
    def num_samples(self) -> int:
        return len(self.ids)

    def sample(self, k: int) -> dict[str, np.ndarray]:
        return {name: vs[k] for name, vs in self.fields.items()}

    def samples(self) -> list[dict[str, np.ndarray]]:
        return [self.sample(k) for k in range(self.num_samples)]

    def stacked(self, name: str) -> np.ndarray:
        """Field ``name`` as one ``(n, *shape)`` array (a copy, writable); raises
        :class:`SchemaError` when its samples differ in shape."""
        vs = self.fields[name]
        f = self.schema[name]
        if not vs:
            return np.zeros((0,) + (0,) * f.ndim, dtype=f.dtype)
        shape = vs[0].shape
        if any(v.shape != shape for v in vs):
            raise SchemaError(f"field {name!r} has ragged shapes across the batch; use the "
                              f"list of per-sample arrays")
        return np.stack(vs)

    def equals(self, other: "SampleBatch | SampleViews") -> bool:
        """Bit-exact equality with a batch (or other views) of the same samples."""
        if not np.array_equal(self.ids, other.ids) or self.fields.keys() != other.fields.keys():
            return False
        for k in range(self.num_samples):
            theirs = other.sample(k)
            for name, v in self.sample(k).items():
                w = theirs[name]
                if v.dtype != w.dtype or v.shape != w.shape or v.tobytes() != w.tobytes():
                    return False
        return True

    @classmethod
    def of_batch(cls, batch: SampleBatch) -> "SampleViews":
        """Read-only per-sample views of a gathered batch's own memory (the fallback of
        a store that cannot lend its memory)."""
        fields = {}
        for name, fb in batch.fields.items():
            values = fb.values.view()
            values.flags.writeable = False
            off = fb.offsets.tolist()
            fields[name] = [values[off[k]:off[k + 1]].reshape(tuple(s))
                            for k, s in enumerate(fb.shapes.tolist())]
        return cls(batch.ids, batch.schema, fields)

    def __repr__(self) -> str:
        return f"SampleViews(n={self.num_samples}, fields=[{self.schema.describe()}])"


class _Lease:
    """A numpy interface over ``nbytes`` of memory at address ``at`` that keeps
    ``owner`` (what holds that memory) alive: numpy keeps it as the ``base`` of the
    array made from it, and every view of that array keeps the array, so it lives as
    long as anything reaches the memory (a weak reference to it tells when nothing
    does).  A memoryview would not do: numpy wraps a buffer in a memoryview of its
    own, which does not reference the one it was given."""

    __slots__ = ("owner", "__array_interface__", "__weakref__")

    def __init__(self, owner: Any, at: int, nbytes: int, writable: bool) -> None:
        self.owner = owner
        self.__array_interface__ = {"data": (at, not writable), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}


class ReadOnly(_Lease):
    """A read-only numpy interface over ``src``'s memory that keeps ``keep`` (whatever
    owns that memory) alive: ``np.asarray(ReadOnly(src, keep))`` and its slices cannot
    be made writable, and while any of them lives this object does (a store checks that
    with a weak reference before it frees memory it does not own)."""

    __slots__ = ("src", "keep")

    def __init__(self, src: np.ndarray, keep: Any = None) -> None:
        if src.dtype != np.uint8 or src.ndim != 1:
            raise InvalidArgumentError("ReadOnly views a 1-D uint8 buffer")
        super().__init__(None, src.ctypes.data, len(src), writable=False)
        self.src, self.keep = src, keep

    def array(self) -> np.ndarray:
        return np.asarray(self)


class BufferPool:
    """An ``alloc`` for ``get_many`` that recycles batch buffers: a buffer returns to the
    pool when the last array or tensor over its memory is gone (a batch the consumer
    still holds is never handed out again), and the next batch is gathered into memory
    already mapped, instead of fresh pages the kernel must zero and fault in (warm
    epochs of 110 KB samples in 0.69-0.97x the time: benchmarks/RESULTS.md).

    ``keep``: buffers held for reuse at most (the batches in flight, e.g. a loader's
    ``prefetch`` + 2); more are freed.  Buffers are whole multiples of ``granule``
    bytes, so batches of slightly different sizes share them; a batch smaller than
    ``granule`` is a plain ``np.empty`` (the allocator's heap serves those from memory
    it keeps, and the pool's few microseconds a call would only add).  Thread-safe.
    ``stats()``: ``allocated`` (new buffers), ``reused``, ``free``.
    """

    def __init__(self, keep: int = 8, granule: int = 1 << 20) -> None:
        if keep < 0 or granule < 1:
            raise InvalidArgumentError(f"BufferPool needs keep >= 0 and granule >= 1, got "
                                       f"{keep} and {granule}")
        self.keep, self.granule = int(keep), int(granule)
        self._free: list[tuple[np.ndarray, int]] = []          # (buffer, its address)
        self._lent: dict[int, tuple[Any, np.ndarray, int]] = {}  # buffers out, by lease
        #: buffers whose lease died: the weak reference's callback only appends here
        #: (it may run in any thread, inside the garbage collector too, even while this
        #: thread holds the lock: a callback taking the lock could deadlock)
        self._returned: "collections.deque[tuple[np.ndarray, int]]" = collections.deque()
        self._lock = threading.Lock()
        self._allocated = self._reused = 0

    def __call__(self, nbytes: int) -> np.ndarray:
        nbytes = max(int(nbytes), 0)
        if nbytes < self.granule:
            return np.empty(nbytes, dtype=np.uint8)
        cap = max(1, -(-nbytes // self.granule)) * self.granule
        raw = None
        with self._lock:
            while self._returned:
                back = self._returned.popleft()
                if len(self._free) < self.keep:
                    self._free.append(back)
            # the smallest free buffer that fits, if not more than twice the need
            best = -1
            for k, (b, _) in enumerate(self._free):
                if nbytes <= len(b) <= 2 * cap and \
                        (best < 0 or len(b) < len(self._free[best][0])):
                    best = k
            if best >= 0:
                raw, at = self._free.pop(best)
                self._reused += 1
            else:
                self._allocated += 1
        if raw is None:
            raw = np.empty(cap, dtype=np.uint8)
            at = raw.ctypes.data
        # every array over the batch's memory keeps the lease alive; once the last is
        # gone, its weak reference's callback gives the buffer back
        lease = _Lease(raw, at, nbytes, writable=True)
        ref = weakref.ref(lease, self._give_back)
        self._lent[id(ref)] = (ref, raw, at)      # (one dict operation: atomic)
        return np.asarray(lease)

    def _give_back(self, ref: Any) -> None:
        # no lock here (see _returned): a dict pop and a deque append are atomic
        lent = self._lent.pop(id(ref), None)
        if lent is not None and len(self._returned) < self.keep:   # (else: freed)
            self._returned.append((lent[1], lent[2]))

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"allocated": self._allocated, "reused": self._reused,
                    "free": min(self.keep, len(self._free) + len(self._returned))}


def assemble_views(ids: np.ndarray, rows: np.ndarray, schema: Schema, layout,
                   parts: list[tuple[np.ndarray, np.ndarray, Any]],
                   timings: Optional[list] = None) -> SampleViews:
    """Per-sample read-only views of ``ids``' fields where ``parts`` hold their records
    (:func:`assemble_batch`'s parts, each source a read-only array: see
    :class:`ReadOnly`); a range outside its source raises instead of viewing less.
    With compressed fields: read-only views of a decompressed copy."""
    if layout.coded:      # compressed values are not where they would be lent from
        return SampleViews.of_batch(assemble_batch(ids, rows, schema, layout, parts,
                                                   timings=timings))
    n = len(ids)
    fields: dict[str, list[Any]] = {f.name: [None] * n for f in schema.fields}
    if n <= _FEW and timings is None:
        _few_views(rows, layout, parts, fields)
        return SampleViews(ids, schema, fields)
    every = np.arange(n)
    for src, rec_start, sel in parts:
        if src.flags.writeable:
            raise InvalidArgumentError("assemble_views: a part's source is writable")
        t0 = time.perf_counter() if timings is not None else 0.0
        r = rows[sel]
        at = every[sel].tolist()
        starts = r[:, layout.off_cols] + np.asarray(rec_start, dtype=np.int64)[:, None]
        ends = starts + r[:, layout.nbytes_cols]
        if len(r) and (starts.min() < 0 or ends.max() > len(src)):
            raise InvalidArgumentError("assemble_views: a record lies outside its source")
        for k, (name, dtype, shape) in enumerate(layout.fields):
            out = fields[name]
            a, b = starts[:, k].tolist(), ends[:, k].tolist()
            if dtype == np.uint8 and shape.stop - shape.start == 1:
                for i, x, y in zip(at, a, b):
                    out[i] = src[x:y]
            else:
                for i, x, y, s in zip(at, a, b, r[:, shape].tolist()):
                    out[i] = src[x:y].view(dtype).reshape(s)
        if timings is not None:
            timings.append((t0, time.perf_counter()))
    return SampleViews(ids, schema, fields)


#: batches of at most this many samples get their views in plain Python (a one-sample
#: get's fixed cost is then a few list operations, not a dozen numpy calls)
_FEW = 16


def _few_views(rows: np.ndarray, layout, parts: list, fields: dict) -> None:
    """assemble_views for a few samples: the same views, bounds checked alike."""
    rl = rows.tolist()
    meta = [(name, dtype, shape, off, nb, dtype == np.uint8 and shape.stop - shape.start == 1)
            for (name, dtype, shape), off, nb in zip(layout.fields, layout.off_cols.tolist(),
                                                     layout.nbytes_cols.tolist())]
    for src, rec_start, sel in parts:
        if src.flags.writeable:
            raise InvalidArgumentError("assemble_views: a part's source is writable")
        at = range(len(rl)) if isinstance(sel, slice) and sel == slice(None) else \
            np.arange(len(rl))[sel].tolist()
        size = len(src)
        for i, r0 in zip(at, np.asarray(rec_start).tolist()):
            row = rl[i]
            for name, dtype, shape, off, nb, plain in meta:
                a = r0 + row[off]
                b = a + row[nb]
                if a < 0 or b > size:
                    raise InvalidArgumentError("assemble_views: a record lies outside its "
                                               "source")
                v = src[a:b]
                fields[name][i] = v if plain else v.view(dtype).reshape(row[shape])

"""How a batch crosses between the training process and a transform worker
process: the store's batch in a reused shared-memory buffer (:class:`SharedRing`,
:class:`SharedAlloc`) with its ids, offsets and shapes pickled in the message
(:func:`_pack`), and the worker's result back, its large tensors in shared memory
(:func:`collate_shared`) and its small ones pickled (:func:`_inline_small`).  Each
tensor that crosses as shared memory costs a file, a descriptor handed over through a
socket and a map (about a millisecond each on a 2-core VM): only buffers worth it go
that way."""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import numpy as np

from ..dataset import FieldBatch, SampleBatch

__all__ = ["HeldBuffers", "SharedAlloc", "SharedRing", "collate_shared"]


class SharedRing:
    """The workers' input buffers in shared memory, reused: a new one costs a shared
    memory file and its pages zeroed and faulted in (6-10 ms for 5 MB), a reused one
    nothing.  A buffer is lent with its batch (:meth:`lend`) and comes back when the
    worker's result does (:meth:`back`), unless that result holds a tensor over the
    buffer's memory (a ``batch_transform`` returning a view of its input): such a
    buffer is the user's now and is never handed out again.  At most ``keep`` free
    buffers are held; sizes are whole ``granule`` multiples so that batches of slightly
    different sizes share them.  Thread-safe (the prefetch thread takes, the consumer
    gives back)."""

    def __init__(self, keep: int, granule: int = 1 << 20) -> None:
        self.keep, self.granule = keep, granule
        self._free: list[Any] = []
        self._lent: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self.allocated = self.reused = 0

    def take(self, nbytes: int) -> Any:
        import torch

        cap = max(1, -(-int(nbytes) // self.granule)) * self.granule
        with self._lock:
            fits = [k for k, t in enumerate(self._free) if nbytes <= t.numel() <= 2 * cap]
            if fits:
                self.reused += 1
                return self._free.pop(min(fits, key=lambda k: self._free[k].numel()))
            self.allocated += 1
            bid = self.allocated
        buffer = torch.empty(cap, dtype=torch.uint8).share_memory_()
        buffer.forebay_buffer_id = bid     # never reused: a dropped buffer's id goes too
        return buffer

    def lend(self, key: Any, buffer: Any) -> None:
        with self._lock:
            self._lent[key] = buffer

    def back(self, key: Any, reusable: bool) -> None:
        with self._lock:
            buffer = self._lent.pop(key, None)
            if buffer is not None and reusable and len(self._free) < self.keep:
                self._free.append(buffer)


class HeldBuffers:
    """The input buffers a worker holds mapped, by id, the least recently used let go
    past ``size``.  The worker keeps one (with the buffers) and the loader a copy of it
    for each worker (ids only), the same steps applied in the same order (a worker's
    inbox is first in, first out): a buffer the worker holds is sent as its id alone,
    saving the descriptor's hand-over through a socket (about half a millisecond)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._held: "collections.OrderedDict[int, Any]" = collections.OrderedDict()

    def see(self, bid: int, buffer: Any = None) -> bool:
        """A use of buffer ``bid`` (``buffer``: the worker's tensor, kept): whether it
        was held already."""
        if bid in self._held:
            self._held.move_to_end(bid)
            return True
        self._held[bid] = buffer
        if len(self._held) > self.size:
            self._held.popitem(last=False)
        return False

    def get(self, bid: int) -> Any:
        return self._held[bid]


class SharedAlloc:
    """An ``alloc`` for the store's ``get_many``: the batch is gathered straight into
    a tensor in shared memory from ``ring``, so sending it to a worker copies nothing
    (the store's own output buffer is what the worker maps); ``last`` is that tensor."""

    def __init__(self, ring: SharedRing) -> None:
        self.ring = ring
        self.last: Any = None

    def __call__(self, nbytes: int) -> np.ndarray:
        self.last = self.ring.take(nbytes)
        return self.last.numpy()[:nbytes]


def _over(out: Any, buffer: Any) -> bool:
    """Whether a tensor in ``out`` (dicts, lists and tuples walked) lies in
    ``buffer``'s memory: it would reach the training process as a view of it."""
    import torch

    if isinstance(out, torch.Tensor):
        st = buffer.untyped_storage()
        return st.data_ptr() <= out.untyped_storage().data_ptr() < st.data_ptr() + st.nbytes()
    if isinstance(out, dict):
        return any(_over(v, buffer) for v in out.values())
    if isinstance(out, (list, tuple)):
        return any(_over(v, buffer) for v in out)
    return False


def _pack(batch: SampleBatch, shared: Any = None, held: bool = False) -> dict[str, Any]:
    """A batch as a few arrays: its one buffer (``shared``, when the store gathered
    into shared memory; by its id alone when the worker ``held`` it already) with each
    field's place in it, or each field's values as a tensor.  Ids, offsets and shapes
    go as NumPy arrays, pickled with the message (a few KB): a tensor would cross as a
    shared memory file of its own (created, its descriptor handed over through a
    socket, mapped by the worker) for each of them."""
    import torch

    msg: dict[str, Any] = {"ids": np.ascontiguousarray(batch.ids), "fields": {}}
    if shared is not None:
        base = shared.data_ptr()
        msg["buffer_id"] = shared.forebay_buffer_id
        if not held:
            msg["buffer"] = shared
        for name, f in batch.fields.items():
            msg["fields"][name] = (f.values.ctypes.data - base, f.values.nbytes,
                                   np.ascontiguousarray(f.offsets),
                                   np.ascontiguousarray(f.shapes))
        return msg
    for name, f in batch.fields.items():
        values = torch.from_numpy(np.ascontiguousarray(f.values.view(np.uint8).reshape(-1)))
        msg["fields"][name] = (values, np.ascontiguousarray(f.offsets),
                               np.ascontiguousarray(f.shapes))
    return msg


def _unpack(msg: dict[str, Any], schema: Any) -> SampleBatch:
    fields = {}
    buf = msg["buffer"].numpy() if "buffer" in msg else None
    for f in schema.fields:
        if buf is not None:
            start, n, o, s = msg["fields"][f.name]
            raw = buf[start:start + n]
        else:
            v, o, s = msg["fields"][f.name]
            raw = v.numpy()
        fields[f.name] = FieldBatch(values=raw.view(f.dtype), offsets=o, shapes=s)
    return SampleBatch(msg["ids"], schema, fields)


#: a result's tensors up to this size cross pickled in the message, not as a shared
#: memory file each (created, its descriptor handed over through a socket, mapped)
_INLINE_BYTES = 64 << 10


class _Inline:
    """A small tensor of a worker's result, carried as a NumPy array."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self) -> Any:
        return (_Inline, (self.array,))


def _walk(out: Any, leaf: Callable[[Any], Any]) -> Any:
    """``out`` with ``leaf`` applied to everything but its dicts, lists and tuples."""
    if type(out) is dict:
        return {k: _walk(v, leaf) for k, v in out.items()}
    if type(out) in (list, tuple):
        return type(out)(_walk(v, leaf) for v in out)
    return leaf(out)


def _inline_one(t: Any) -> Any:
    import torch

    if (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type == "cpu"
            and not t.requires_grad and t.nbytes <= _INLINE_BYTES and not t.is_shared()):
        try:
            return _Inline(t.contiguous().numpy())
        except (TypeError, RuntimeError):      # a dtype NumPy lacks (bfloat16)
            return t
    return t


def _inline_small(out: Any) -> Any:
    """``out`` with its small CPU tensors (labels, a collated int per sample; dtypes
    NumPy has) as :class:`_Inline` (dicts, lists and tuples walked)."""
    return _walk(out, _inline_one)


def _restore_small(out: Any) -> Any:
    """:func:`_inline_small` undone in the training process."""
    import torch

    return _walk(out, lambda x: torch.from_numpy(x.array) if isinstance(x, _Inline) else x)


def collate_shared(samples: list) -> Any:
    """torch's default collation, with same-shape tensors stacked straight into shared
    memory (as torch's own workers do): the batch leaves the worker without a copy.
    A stack of up to ``_INLINE_BYTES`` stays in the worker's memory: it crosses
    pickled in the message (:func:`_inline_small`)."""
    import torch
    from torch.utils.data import default_collate

    first = samples[0]
    if isinstance(first, dict):
        return {k: collate_shared([s[k] for s in samples]) for k in first}
    if isinstance(first, torch.Tensor) and all(
            isinstance(x, torch.Tensor) and x.shape == first.shape and x.dtype == first.dtype
            for x in samples):
        out = torch.empty((len(samples), *first.shape), dtype=first.dtype)
        if out.nbytes > _INLINE_BYTES:
            out.share_memory_()
        return torch.stack(samples, out=out)
    return default_collate(samples)

"""Collation of a :class:`SampleBatch` into torch tensors: dense stacks and graph batches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from ..dataset import SampleBatch, SampleViews
from ..dataset import KIND_BYTES, gather_ranges
from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["default_collate", "collate_graphs", "collate_views", "is_graph_batch",
           "pin_tree", "NODE_FIELDS"]

#: fields whose first dimension is the node count, in order of preference
NODE_FIELDS = ("x", "pos", "z", "atomic_numbers")


def _tensor(a: np.ndarray, pin: bool) -> torch.Tensor:
    import torch      # here: a loader whose collate_fn makes no tensors never loads it

    if pin:
        return _pinned(a)
    return torch.from_numpy(a) if a.flags.writeable else torch.from_numpy(np.array(a))


_DTYPES: dict[np.dtype, torch.dtype] = {}


def _pinned(a: np.ndarray) -> torch.Tensor:
    """``a`` as a tensor in pinned memory owned by torch's pinned-memory allocator: a
    view of the pinned tensor ``a`` was gathered into (the loader's ``pin_memory``
    buffer), else a pinned copy.

    Never ``torch.from_numpy`` over pinned memory: a ``.to("cuda", non_blocking=True)``
    copy makes the allocator keep a block until the copy has run only when the source
    tensor's storage is that block; over the same memory through numpy it is not, so
    once the batch was dropped the block went to the next batch's gather while the
    copy (queued behind the model's kernels) had yet to read it."""
    import torch

    owner = a.base
    while isinstance(owner, np.ndarray):
        owner = owner.base
    dtype = _DTYPES.get(a.dtype)
    if dtype is None:
        dtype = _DTYPES.setdefault(a.dtype, torch.from_numpy(np.empty(0, a.dtype)).dtype)
    if isinstance(owner, torch.Tensor) and owner.is_contiguous() and a.flags.c_contiguous \
            and owner.is_pinned():
        start = a.ctypes.data - owner.data_ptr()
        if 0 <= start and start + a.nbytes <= owner.nbytes:
            flat = owner.reshape(-1).view(torch.uint8)[start:start + a.nbytes]
            try:
                return flat.view(dtype).reshape(a.shape)
            except RuntimeError:          # not aligned for the dtype: copy below
                pass
    out = torch.empty(a.shape, dtype=dtype, pin_memory=True)
    out.numpy()[...] = a
    return out


def pin_tree(obj: Any) -> Any:
    """Every CPU tensor in ``obj`` (dicts, lists, tuples and named tuples, nested; an
    object with a ``pin_memory()`` method, such as a PyG batch) copied into pinned
    memory, as torch's ``DataLoader(pin_memory=True)`` does to what its workers
    return; tensors already pinned and device tensors stay as they are."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.pin_memory() if obj.device.type == "cpu" else obj
    if isinstance(obj, dict):
        return {k: pin_tree(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(pin_tree(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(pin_tree(v) for v in obj)
    if callable(getattr(obj, "pin_memory", None)):
        return obj.pin_memory()
    return obj


def is_graph_batch(batch: Any) -> bool:
    """PyG-style graphs: an ``edge_index`` field of shape (2, E) and a node field (of
    anything with a ``schema``: a batch, views, a dataset)."""
    s = batch.schema
    return ("edge_index" in s and s["edge_index"].ndim == 2 and s["edge_index"].dtype.kind in "iu"
            and any(n in s and s[n].ndim >= 1 for n in NODE_FIELDS))


def collate_graphs(batch: SampleBatch, pin: bool = False) -> dict[str, Any]:
    """Concatenate graphs as PyTorch Geometric does, without a per-sample loop.

    Node fields (first dimension = node count) and edge fields (first dimension = edge
    count) are concatenated along dim 0 (a view of the batch's buffer); ``edge_index``
    ``(2, E_k)`` blocks are concatenated along dim 1 with each graph's node offset
    added; ``batch`` maps nodes to graphs and ``ptr`` holds node offsets.  Graph-level
    fields of equal shape are stacked.
    """
    s = batch.schema
    node_field = next(n for n in NODE_FIELDS if n in s and s[n].ndim >= 1)
    nodes = batch.field(node_field).shapes[:, 0]
    ei = batch.field("edge_index")
    if len(ei) and (ei.shapes[:, 0] != 2).any():
        raise InvalidArgumentError("edge_index must have shape (2, E) in every sample")
    edges = ei.shapes[:, 1] if len(ei) else np.zeros(0, np.int64)
    n = len(nodes)
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(nodes, out=ptr[1:])
    e_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(edges, out=e_ptr[1:])
    # edge_index: sample k's values are [src(E_k), dst(E_k)] at ei.offsets[k]; both rows
    # are range copies (C kernel), then every edge is shifted by its graph's node offset.
    e_total = int(e_ptr[-1])
    item = ei.values.dtype.itemsize
    edge_index = np.empty((2, e_total), dtype=ei.values.dtype)
    src = ei.values.view(np.uint8)
    starts = np.concatenate([ei.offsets[:-1], ei.offsets[:-1] + edges]) * item
    dst = np.concatenate([e_ptr[:-1], e_total + e_ptr[:-1]]) * item
    gather_ranges(src, starts, np.concatenate([edges, edges]) * item,
                  edge_index.reshape(-1).view(np.uint8), dst)
    edge_index += np.repeat(ptr[:-1].astype(edge_index.dtype, copy=False), edges)
    out: dict[str, Any] = {"edge_index": _tensor(edge_index, pin)}
    for name, fb in batch.fields.items():
        if name == "edge_index":
            continue
        f = s[name]
        if f.kind == KIND_BYTES:
            out[name] = [_tensor(fb[k], pin) for k in range(n)]
        elif f.ndim >= 1 and np.array_equal(fb.shapes[:, 0], nodes) and name != "y":
            out[name] = _tensor(fb.values.reshape((-1,) + tuple(fb.shapes[0, 1:])) if n else
                                fb.values, pin)
        elif f.ndim >= 1 and np.array_equal(fb.shapes[:, 0], edges) and name != "y":
            out[name] = _tensor(fb.values.reshape((-1,) + tuple(fb.shapes[0, 1:])) if n else
                                fb.values, pin)
        elif fb.uniform:
            out[name] = _tensor(fb.stacked(), pin)
        else:  # ragged graph-level field: concatenate along dim 0
            out[name] = _tensor(fb.values.reshape((-1,) + tuple(fb.shapes[0, 1:])) if n else
                                fb.values, pin)
    out["batch"] = _tensor(np.repeat(np.arange(n, dtype=np.int64), nodes), pin)
    out["ptr"] = _tensor(ptr, pin)
    out["num_graphs"] = n
    return out


_PYG_BATCH: Any = None


def _to_pyg(d: dict[str, Any]) -> Any:
    global _PYG_BATCH
    if _PYG_BATCH is None:
        try:
            from torch_geometric.data import Batch as _PYG_BATCH
        except ImportError:
            _PYG_BATCH = False
    if _PYG_BATCH is False:
        return d
    return _PYG_BATCH(**{k: v for k, v in d.items() if k != "num_graphs"})


def default_collate(batch: SampleBatch, pin: bool = False) -> dict[str, Any]:
    """Dense fields stacked into ``(B, ...)`` tensors sharing the batch's memory; graph
    samples batched as :func:`collate_graphs` (a PyG ``Batch`` when torch_geometric is
    installed); other ragged fields and bytes fields as lists of per-sample tensors."""
    if is_graph_batch(batch):
        return _to_pyg(collate_graphs(batch, pin))
    out: dict[str, Any] = {}
    n = batch.num_samples
    for name, fb in batch.fields.items():
        if batch.schema[name].kind != KIND_BYTES and fb.uniform:
            out[name] = _tensor(fb.stacked(), pin)
        else:
            out[name] = [_tensor(fb[k], pin) for k in range(n)]
    return out


def collate_views(views: SampleViews, pin: bool = False) -> dict[str, Any]:
    """:func:`default_collate` for a :class:`~forebay.dataset.SampleViews`
    (``DataLoader(pipeline=Pipeline(views=True))``): bytes fields and fields whose
    samples differ in shape stay lists of the read-only per-sample numpy arrays (no
    copy: decode them, or copy one with ``np.array`` to change it); fields of one shape
    are stacked into tensors (a copy, small for labels and scalars)."""
    out: dict[str, Any] = {}
    for name, vs in views.fields.items():
        first = vs[0].shape if vs else None
        if views.schema[name].kind != KIND_BYTES and all(v.shape == first for v in vs):
            out[name] = _tensor(views.stacked(name), pin)
        else:
            out[name] = vs
    return out


def collate_samples(samples: list, collate_fn: Optional[Callable] = None) -> Any:
    """torch's own collation of per-sample dicts (after a per-sample ``transform``)."""
    if collate_fn is not None:
        return collate_fn(samples)
    from torch.utils.data import default_collate as torch_collate

    return torch_collate(samples)


def pinned_alloc(nbytes: int) -> np.ndarray:
    """A page-locked uint8 buffer of ``nbytes`` (batches assembled there go to the GPU
    without a staging copy)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()

"""torch.distributed.checkpoint (DCP) on a forebay model repository.

    import torch.distributed.checkpoint as dcp
    from forebay.models.dcp import Reader, Writer

    dcp.save(state_dict, storage_writer=Writer("file:///scratch/repo", "run7"))
    dcp.load(state_dict, storage_reader=Reader("file:///scratch/repo", "run7"))

Each ``dcp.save`` is the next version of the model name: every rank stores its items
(tensors, shards, DCP's byte objects) by content, durably, and the coordinator publishes
the version when DCP has gathered every rank's results, so a version is whole or
absent.  A tensor or shard already stored (any earlier checkpoint, any model) is not
written again: ten checkpoints that each change one layer store the base once plus ten
layers.  Loads verify every item's hash; DCP's planner reshards to the loading world
size and reads only the items the target state dict needs.

DCP's metadata (tensor sizes, chunk offsets, byte-object keys, the planner's key
mappings) is kept in the version's manifest as JSON, never pickled.  The byte objects
DCP itself writes (non-tensor values) are ``torch.save`` output that DCP's own
planner unpickles on load, as with any DCP storage.

Repositories: ``file://`` paths shared by the ranks (LMDB; one writer at a time, many
readers) or an open local :class:`~forebay.models.Repository`.  Other ranks' pending
records (their tensors, protected from ``gc`` until the version is published) expire
after the repository's grace period.
"""

from __future__ import annotations

import io
import time
from typing import Any, Optional

import numpy as np

from ..errors import ModelNotFoundError, ModelRepositoryError
from ._open import open_repository
from ._repo import Repository
from ._store import ModelStore
from ._tensors import _as_bytes, _dtype_name, tensor_hash

try:
    import torch
    from torch.distributed.checkpoint import StorageReader, StorageWriter
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,
                                                       ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)
    from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future
except ImportError as e:  # pragma: no cover - torch is the models extra's dependency
    from ..errors import MissingDependencyError
    raise MissingDependencyError(f"forebay.models.dcp needs torch.distributed.checkpoint "
                                 f"({e}); pip install 'forebay[torch]'") from e

__all__ = ["Writer", "Reader", "encode_metadata", "decode_metadata"]


def _open(repo: "str | ModelStore") -> ModelStore:
    if isinstance(repo, ModelStore):
        return repo
    store = open_repository(str(repo))
    if not isinstance(store, Repository):
        store.close()
        raise ModelRepositoryError(f"{repo}: the DCP plug-in needs a local repository "
                                   f"(file:// or a path shared by the ranks, or memory:// "
                                   f"in one process)")
    return store


def _key(index: "MetadataIndex") -> str:
    """A manifest key for a DCP item: its name, chunk offset and index (no glob
    characters, so the key also works with ``load(include=...)``)."""
    off = "" if index.offset is None else ",".join(str(int(o)) for o in index.offset)
    idx = "" if index.index is None else str(int(index.index))
    return f"{index.fqn}|{off}|{idx}"


def _index(key: str) -> "MetadataIndex":
    fqn, off, idx = key.rsplit("|", 2)
    return MetadataIndex(fqn, torch.Size([int(o) for o in off.split(",")]) if off else None,
                         int(idx) if idx else None)


def _plain(v: Any) -> Any:
    """planner_data values (tuples of keys) as JSON lists, back as tuples on load."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    raise ModelRepositoryError(f"DCP planner data holds a {type(v).__name__}, which forebay "
                               f"does not store")


def _tuples(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _tuples(x) for k, x in v.items()}
    if isinstance(v, list):
        return tuple(_tuples(x) for x in v)
    return v


def encode_metadata(md: "Metadata") -> dict[str, Any]:
    """DCP's checkpoint metadata as JSON-able data (no pickles)."""
    sd: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            sd[fqn] = {"kind": "bytes"}
            continue
        p = m.properties
        sd[fqn] = {"kind": "tensor", "dtype": str(p.dtype).replace("torch.", ""),
                   "requires_grad": bool(p.requires_grad), "size": list(m.size),
                   "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks]}
    return {"state_dict": sd, "planner_data": _plain(md.planner_data),
            "version": getattr(md, "version", None)}


def decode_metadata(doc: dict[str, Any]) -> "Metadata":
    sd: dict[str, Any] = {}
    try:
        for fqn, m in doc["state_dict"].items():
            if m["kind"] == "bytes":
                sd[fqn] = BytesStorageMetadata()
                continue
            dtype = getattr(torch, m["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise ModelRepositoryError(f"malformed DCP metadata in the repository: "
                                           f"{m['dtype']!r} is not a dtype")
            sd[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype,
                                            requires_grad=bool(m.get("requires_grad"))),
                size=torch.Size(m["size"]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                        for o, s in m["chunks"]])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ModelRepositoryError(f"malformed DCP metadata in the repository: {e}") from None
    return Metadata(state_dict_metadata=sd, planner_data=_tuples(doc.get("planner_data")),
                    version=doc.get("version"))


class _OnRepository:
    """What the writer and the reader share: the repository they opened (or were
    given), closed when they are done with it, and DCP's plans taken as they are."""

    _repo_arg: "str | ModelStore"
    _store: Optional[ModelStore]

    @property
    def store(self) -> ModelStore:
        if self._store is None:
            self._store = _open(self._repo_arg)
        return self._store

    def _release(self) -> None:
        """Close a store this object opened from a URL (a store passed in stays open)."""
        if self._store is not None and not isinstance(self._repo_arg, ModelStore):
            self._store.close()
        self._store = None

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return isinstance(checkpoint_id, str)


class Writer(_OnRepository, StorageWriter):
    """A DCP storage writer: each ``dcp.save`` becomes the next version of ``name`` in
    the repository ``repo`` (URL or open store); ``metadata`` (JSON) is stored with it.
    The version number is :attr:`version` on the coordinator after the save."""

    def __init__(self, repo: "str | ModelStore", name: str,
                 metadata: Optional[dict[str, Any]] = None) -> None:
        super().__init__()
        self._repo_arg = repo
        self.name = name
        self.user_metadata = metadata or {}
        self.version: Optional[int] = None
        self._store: Optional[ModelStore] = None
        self._token = b""
        self._written = 0
        self._t0 = 0.0

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.name = str(checkpoint_id)
        self.version = None
        self._token, self._written, self._t0 = b"", 0, time.perf_counter()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def write_data(self, plan: Any, planner: Any) -> "Future[list[WriteResult]]":
        """Store this rank's items, durably, before DCP hears they are written."""
        blobs: dict[str, Any] = {}
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = np.frombuffer(data.getbuffer(), dtype=np.uint8).copy()
                dt, shape = "uint8", [int(raw.nbytes)]
            else:
                t = data.detach()
                raw, dt, shape = _as_bytes(t), _dtype_name(t), list(t.shape)
            h = tensor_hash(dt, shape, raw)
            blobs[h] = raw
            results.append(WriteResult(index=item.index, size_in_bytes=int(raw.nbytes),
                                       storage_data={"hash": h, "dtype": dt, "shape": shape,
                                                     "nbytes": int(raw.nbytes)}))
        store = self.store
        if not isinstance(store, Repository):
            raise ModelRepositoryError("the DCP plug-in needs a local repository")
        self._token, self._written = store.put_tensors(blobs)
        if not getattr(self, "is_coordinator", True):
            self._release()          # durable; only the coordinator publishes
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: "Metadata", results: list[list["WriteResult"]]) -> None:
        """Publish the version (the coordinator, once every rank's items are stored)."""
        store = self.store
        if not isinstance(store, Repository):
            raise ModelRepositoryError("the DCP plug-in needs a local repository")
        entries = {}
        for wr in (w for rank in results for w in rank):
            sd = wr.storage_data
            entries[_key(wr.index)] = {"hash": sd["hash"], "dtype": sd["dtype"],
                                       "shape": sd["shape"], "nbytes": sd["nbytes"],
                                       "leaf": None}
        body = {"metadata": {**self.user_metadata, "dcp": encode_metadata(metadata)},
                "graph": None, "leaves": {}, "tensors": entries,
                "logical_bytes": sum(e["nbytes"] for e in entries.values()),
                "new_bytes": self._written,
                "save_seconds": time.perf_counter() - self._t0}
        try:
            self.version = store.commit(self.name, body, self._token)
        finally:
            self._release()


class Reader(_OnRepository, StorageReader):
    """A DCP storage reader of version ``version`` (default: the latest) of ``name``.

    ``share=True``: the ranks of a node read each stored item once between them,
    striped by bytes, into one shared-memory segment, and every rank takes what its
    plan needs from there; the items replicated on every rank (most of a data-parallel
    model) are read once per node instead of once per rank.  It is collective over the
    whole torch.distributed world: use it when every rank calls ``dcp.load`` with the
    default process group (a load on some ranks only would wait for the others).
    :attr:`bytes_read`: what this rank read."""

    def __init__(self, repo: "str | ModelStore", name: str,
                 version: Optional[int] = None, *, share: bool = False) -> None:
        super().__init__()
        self._repo_arg = repo
        self.name = name
        self.version = version
        self.share = share
        self.bytes_read = 0
        self._store: Optional[ModelStore] = None
        self._manifest: Optional[dict[str, Any]] = None

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.name = str(checkpoint_id)
        self._manifest = None

    def _m(self) -> dict[str, Any]:
        if self._manifest is None:
            m = self.store.manifest(self.name, self.version)
            if "dcp" not in (m.get("metadata") or {}):
                raise ModelNotFoundError(f"{self.name!r} version {m['version']} was not saved "
                                         f"with DCP (load it with repo.load)")
            self._manifest = m
        return self._manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> "Metadata":
        m = self._m()
        md = decode_metadata(m["metadata"]["dcp"])
        md.storage_data = {_index(k): k for k in m["tensors"]}
        return md

    def set_up_storage_reader(self, metadata: "Metadata", is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def read_data(self, plan: Any, planner: Any) -> "Future[None]":
        """Read each stored item the plan needs once, verified, then hand DCP's planner
        the requested slices."""
        m = self._m()
        keys = []
        for req in plan.items:
            k = _key(req.storage_index)
            if k not in m["tensors"]:
                raise ModelRepositoryError(f"{self.name!r} version {m['version']}: no stored "
                                           f"item {k!r}")
            keys.append(k)
        segment = None
        bufs: dict[str, Any] = {}
        try:
            if self._sharing():
                bufs, segment = self._read_shared(m, keys)
            else:
                for k in dict.fromkeys(keys):
                    e = m["tensors"][k]
                    bufs[k] = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
                self._fetch(m, list(bufs.items()), fresh=True)
            self._deliver(plan, planner, keys, bufs)
        finally:
            bufs.clear()                     # views of the segment: gone before it closes
            if segment is not None:
                seg, node = segment
                node.Barrier()               # every rank has copied out what it needs
                seg.close()
            self._release()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _fetch(self, m: dict[str, Any], pairs: list[tuple[str, Any]], fresh: bool) -> None:
        store = self.store
        before = store._io["bytes_read"]
        store._fetch(m, pairs, fresh=fresh)
        self.bytes_read += store._io["bytes_read"] - before

    def _sharing(self) -> bool:
        if not self.share:
            return False
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _read_shared(self, m: dict[str, Any], keys: list[str]) -> tuple[dict, tuple]:
        """Collective over the job (DCP calls read_data on every rank at once): the
        node's ranks split the union of what they need, each reading its share into its
        region of one node segment, verified; returns views of every needed item."""
        from ..comm import NodeSegment, node_ranks, torch_comm

        comm = torch_comm()
        node = node_ranks(comm)
        color = node[0]
        node_comm = comm.Split(color=color, key=comm.Get_rank())
        needed = node_comm.allgather(sorted(set(keys)))
        union = sorted(set().union(*map(set, needed)))
        sizes = {k: int(m["tensors"][k]["nbytes"]) for k in union}
        load = [0] * node_comm.Get_size()
        owner: dict[str, int] = {}
        for k in sorted(union, key=lambda k: (-sizes[k], k)):   # striped by bytes
            r = min(range(len(load)), key=lambda i: (load[i], i))
            owner[k] = r
            load[r] += sizes[k] + (-sizes[k]) % 64
        me = node_comm.Get_rank()
        seg = NodeSegment(node_comm, load[me])
        views: dict[str, Any] = {}
        pos = [0] * len(load)
        for k in union:                        # every rank computes every item's place
            r = owner[k]
            start = int(seg.starts[r]) + pos[r]
            pos[r] += sizes[k] + (-sizes[k]) % 64
            e = m["tensors"][k]
            raw = torch.frombuffer(seg.view, dtype=torch.uint8, count=sizes[k],
                                   offset=start) if sizes[k] else torch.empty(0, dtype=torch.uint8)
            views[k] = raw.view(getattr(torch, e["dtype"])).reshape(e["shape"])
        try:
            mine = [(k, views[k]) for k in union if owner[k] == me]
            self._fetch(m, mine, fresh=False)
            problem = None
        except Exception as e:      # noqa: BLE001 - raised on every rank below
            problem = f"rank {comm.Get_rank()}: {type(e).__name__}: {e}"
        problems = [p for p in node_comm.allgather(problem) if p]
        if problems:
            seg.close()
            raise ModelRepositoryError("; ".join(problems))
        return {k: views[k] for k in set(keys)}, (seg, node_comm)

    def _deliver(self, plan: Any, planner: Any, keys: list[str], bufs: dict) -> None:
        for req, k in zip(plan.items, keys):
            src = bufs[k]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(src.numpy().tobytes()))
                continue
            for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                src = src.narrow(dim, int(o), int(n))
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise ModelRepositoryError(f"{k}: stored slice {tuple(src.size())} does not "
                                           f"fit the requested {tuple(target.size())}")
            target.copy_(src)
            planner.commit_tensor(req, target)

"""What every model repository does, whatever holds its bytes (:class:`ModelStore`):
saves (synchronous or in the background) of a model's tensors and architecture graph,
versions, partial and verified loads, loads by structure; a backend supplies the
storage operations."""

from __future__ import annotations

import abc
import builtins
import contextlib
import fnmatch
import json
import os
import re
import time
from typing import Any, Optional, TypeVar

import numpy as np

from ..errors import (ArgumentTypeError, CorruptModelError, ModelMismatchError, ModelNotFoundError,
                      ModelRepositoryError)
from ._arch import Architecture, IdCache, capture
from ._backend import _HUGE, prefer_huge_pages
from ._tensors import _as_bytes, _dtype_name, tensor_hash

__all__ = ["ModelStore", "PENDING_GRACE_S", "FORMAT"]


FORMAT = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,254}$")
PENDING_GRACE_S = 6 * 3600  # a save older than this without a manifest crashed


def _vkey(name: str, version: int) -> bytes:
    return f"{name}\x00{version:012d}".encode()


_S = TypeVar("_S", bound="ModelStore")


class ModelStore(abc.ABC):
    """The model repository contract: what every store of models offers, local (LMDB,
    memory) or remote (providers over tcp://).  Saving and loading, with architecture
    capture, hashing, selection and verification, are the same for all of them and live
    here; a store implements where tensors and manifests go (the abstract methods).
    Optional abilities are declared in :attr:`capabilities`, never probed.

    Every implementation passes ``tests/test_model_store_contract.py``."""

    #: optional abilities: "relocate" and "compact" (file-backed LMDB stores)
    capabilities: frozenset[str] = frozenset()

    def __init__(self, url: str) -> None:
        self.url = url
        self.cache = IdCache()  # client side: config hashes of architectures seen
        self._io = {"bytes_read": 0, "bytes_written": 0, "tensors_read": 0,
                    "tensors_written": 0, "tensors_deduplicated": 0}

    # -- saving -------------------------------------------------------------------------
    def save(self, name: str, model: Any, metadata: Optional[dict[str, Any]] = None,
             *, parent: Optional[int] = None, blocking: bool = True) -> Any:
        """Store ``model`` (an ``nn.Module`` or a state dict of tensors) as the next
        version of ``name``; returns the version.  Tensors already stored (any model,
        any version) are not written again; the version becomes visible only after all
        its tensors are durable.

        ``blocking=False``: snapshot the tensors (a copy into staging buffers kept for
        the next save of ``name``) and return a :class:`concurrent.futures.Future` of
        the version at once; hashing and writing run in a background thread while
        training goes on (it may change the tensors).  At most one save of a model
        is in flight: the next one waits for it first.  A crash before the version
        is published leaves the previous versions as they were."""
        _check_name(name)
        if metadata is not None:
            try:
                json.dumps(metadata)
            except TypeError as e:
                raise ModelRepositoryError(f"metadata must be JSON-serializable: {e}") from e
        t_start = time.perf_counter()
        sd, arch = self._state_of(model)
        if blocking:
            return self._save_state(name, sd, arch, metadata, parent, t_start)
        return self._save_async(name, sd, arch, metadata, parent, t_start)

    def _state_of(self, model: Any) -> tuple[dict[str, Any], Optional[Architecture]]:
        import torch

        if isinstance(model, torch.nn.Module):
            return model.state_dict(), capture(model, self.cache)
        if isinstance(model, dict):
            return model, None
        raise ArgumentTypeError(f"save() takes an nn.Module or a state dict, got "
                                f"{type(model).__name__}")

    def _save_async(self, name: str, sd: dict[str, Any], arch: Optional[Architecture],
                    metadata: Optional[dict[str, Any]], parent: Optional[int],
                    t_start: float) -> Any:
        """Snapshot ``sd`` into this model's staging buffers, then save in the
        background (one save per model in flight)."""
        import concurrent.futures

        import torch

        if not hasattr(self, "_async"):
            self._async: dict[str, Any] = {}      # name -> (future, staging buffers)
            self._async_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="forebay-save")
        prev, staging = self._async.get(name, (None, {}))
        if prev is not None:   # one in flight: once it ends, its buffers are ours again
            concurrent.futures.wait([prev])    # (its error stays with its future)
        snap: dict[str, Any] = {}
        for key, t in sd.items():
            if not isinstance(t, torch.Tensor):
                raise ModelRepositoryError(f"{name}: state entry {key!r} is a "
                                           f"{type(t).__name__}, not a tensor")
            buf = staging.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = staging[key] = torch.empty(t.shape, dtype=t.dtype)
            buf.copy_(t.detach())
            snap[key] = buf
        fut = self._async_pool.submit(self._save_state, name, snap, arch, metadata, parent,
                                      t_start)
        self._async[name] = (fut, staging)
        return fut

    def wait_saves(self) -> None:
        """Block until every save started with ``blocking=False`` has finished (raising
        the first one's error)."""
        for fut, _ in list(getattr(self, "_async", {}).values()):
            fut.result()

    def _end_saves(self) -> None:
        """Before closing: let background saves finish (their versions are published),
        then stop their threads; a save that failed raises here (as from
        :meth:`wait_saves`), so no failed checkpoint goes unnoticed."""
        pool = getattr(self, "_async_pool", None)
        if pool is not None:
            try:
                self.wait_saves()
            finally:
                pool.shutdown(wait=True)
                del self._async_pool, self._async

    def _save_state(self, name: str, sd: dict[str, Any], arch: Optional[Architecture],
                    metadata: Optional[dict[str, Any]], parent: Optional[int],
                    t_start: float) -> int:
        import torch
        leaf_of: dict[str, tuple[str, str]] = {}  # state key -> (leaf id, tensor name)
        leaves: dict[str, dict[str, Any]] = {}
        if arch is not None:
            for lf in arch.leaves:
                rels = {}
                for rel in lf.config["tensors"]:
                    key = f"{lf.name}.{rel}" if lf.name else rel
                    if key in sd:
                        leaf_of[key] = (lf.id, rel)
                        rels[rel] = key
                leaves[lf.id] = {"name": lf.name, "tensors": rels}
        entries: dict[str, dict[str, Any]] = {}
        blobs: dict[str, np.ndarray] = {}
        kinds: dict[str, dict[str, Any]] = {}  # hash -> dtype and shape
        for key, t in sd.items():
            if not isinstance(t, torch.Tensor):
                raise ModelRepositoryError(f"{name}: state entry {key!r} is a "
                                           f"{type(t).__name__}, not a tensor")
            data = _as_bytes(t)
            dt, shape = _dtype_name(t), list(t.shape)
            h = tensor_hash(dt, shape, data)
            entries[key] = {"hash": h, "dtype": dt, "shape": shape, "nbytes": int(data.nbytes),
                            "leaf": leaf_of.get(key, (None,))[0]}
            blobs[h] = data
            kinds[h] = {"dtype": dt, "shape": shape}
        new: set[str] = set()
        token, written = self._store_tensors(name, blobs, kinds, new=new)
        found = self._add_locations(name, entries, new)
        body = {"metadata": metadata or {},
                "graph": arch.encode() if arch is not None else None,
                "leaves": leaves, "tensors": entries,
                "logical_bytes": sum(e["nbytes"] for e in entries.values()),
                "new_bytes": written, "save_seconds": time.perf_counter() - t_start}
        version = self._publish(name, body, token, parent, found)
        _traced("save", t_start, name, version, written, len(blobs))
        return version

    def graph(self, name: str, version: Optional[int] = None) -> Optional[dict[str, Any]]:
        """The compact architecture graph stored with a version (None for a state dict)."""
        return self.manifest(name, version)["graph"]

    # -- loading ------------------------------------------------------------------------
    def _select(self, m: dict[str, Any], include: Any) -> builtins.list[str]:
        """State keys selected by ``include``: exact keys, module paths or leaf IDs
        (dictionary lookups), or glob patterns over keys and module paths."""
        keys = list(m["tensors"])
        if include is None:
            return keys
        pats = [include] if isinstance(include, str) else list(include)
        by_mod: dict[str, builtins.list[str]] = {}
        for k in keys:
            by_mod.setdefault(k.rpartition(".")[0], []).append(k)
        chosen: set[str] = set()
        for p in pats:
            if any(c in p for c in "*?["):
                rx = re.compile(fnmatch.translate(p))
                chosen.update(k for k in keys if rx.match(k) or rx.match(k.rpartition(".")[0]))
                continue
            if p in m["tensors"]:
                chosen.add(p)
            chosen.update(by_mod.get(p, ()))
            leaf = m["leaves"].get(p)
            if leaf is not None:
                chosen.update(leaf["tensors"].values())
        out = [k for k in keys if k in chosen]
        if not out:
            raise ModelNotFoundError(f"{m['name']!r} version {m['version']}: nothing matches "
                                     f"include={include!r}")
        return out

    def load(self, name: str, version: Optional[int] = None, into: Any = None,
             include: Any = None, device: Any = None) -> Any:
        """A version as a state dict of tensors, or copied in place into ``into`` (a
        module or a state dict of tensors; returned).  ``include``: state-dict name
        patterns (``"blocks.3.*"``), module paths, or leaf IDs; only the selected
        tensors' bytes are read."""

        t_start = time.perf_counter()
        read0 = self._io["bytes_read"]
        with self._advise("random"):  # manifests, B-tree pages, small tensors
            return self._load(name, version, into, include, device, t_start, read0)

    def _load(self, name: str, version: Optional[int], into: Any, include: Any, device: Any,
              t_start: float, read0: int) -> Any:
        import torch

        m = self.manifest(name, version)
        keys = self._select(m, include)
        if into is not None:
            self._check_into(m, keys, into)
            target = into.state_dict(keep_vars=True) if hasattr(into, "state_dict") else into
            self._fetch(m, [(k, target[k]) for k in keys])
            _traced("load", t_start, name, m["version"], self._io["bytes_read"] - read0,
                    len(keys))
            return into
        out: dict[str, Any] = {}
        for k in keys:
            e = m["tensors"][k]
            out[k] = t = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
            if e["nbytes"] >= 2 * _HUGE:
                prefer_huge_pages(t.data_ptr(), e["nbytes"])
        self._fetch(m, list(out.items()), fresh=True)
        if device is not None:
            out = {k: t.to(device) for k, t in out.items()}
        _traced("load", t_start, name, m["version"], self._io["bytes_read"] - read0, len(keys))
        return out

    def _check_into(self, m: dict[str, Any], keys: builtins.list[str], into: Any) -> None:
        sd = into.state_dict() if hasattr(into, "state_dict") else into
        problems = []
        for k in keys:
            e = m["tensors"][k]
            if k not in sd:
                problems.append(f"{k}: stored, not in the module")
                continue
            t = sd[k]
            if list(t.shape) != e["shape"] or _dtype_name(t) != e["dtype"]:
                problems.append(f"{k}: stored {e['dtype']}{tuple(e['shape'])}, module has "
                                f"{_dtype_name(t)}{tuple(t.shape)}")
        if problems:
            raise ModelMismatchError(f"cannot load {m['name']!r} version {m['version']} into "
                                     f"{type(into).__name__}: " + "; ".join(problems))

    def load_matching(self, name: str, into: Any, version: Optional[int] = None
                      ) -> dict[str, Any]:
        """Fill every leaf layer of ``into`` whose stable structural ID equals a stored
        leaf's, whatever the layer names (transfer learning).  Returns ``matched``
        (into's module path, the stored one, the ID), ``unmatched`` (into's leaves with
        no stored twin) and ``graph`` (how into's edges were found)."""
        m = self.manifest(name, version)
        arch = capture(into, self.cache)
        target = into.state_dict(keep_vars=True)
        matched, unmatched, keys = [], [], []
        pairs: builtins.list[tuple[str, str]] = []
        for lf in arch.leaves:
            st = m["leaves"].get(lf.id)
            if st is None:
                unmatched.append(lf.name)
                continue
            matched.append({"into": lf.name, "stored": st["name"], "id": lf.id})
            for rel, key in st["tensors"].items():
                dst = f"{lf.name}.{rel}" if lf.name else rel
                if dst in target:
                    pairs.append((dst, key))
                    keys.append(key)
        self._fetch(m, [(key, target[dst]) for dst, key in pairs])
        return {"matched": matched, "unmatched": unmatched, "graph": arch.source,
                "tensors": len(pairs)}

    @staticmethod
    def _check_hashes(bufs: list, entries: list, got: dict[int, str]) -> None:
        for i, ((_, where), e) in enumerate(zip(bufs, entries)):
            if got[i] != e["hash"]:
                raise CorruptModelError(f"{where} ({e['hash'][:16]}): stored bytes do "
                                        f"not match their hash (corrupt); the tensor "
                                        f"loaded into holds them")

    def _advise(self, pattern: str) -> Any:
        """Read-pattern advice for the store while a load runs (none by default)."""
        return contextlib.nullcontext()

    def _add_locations(self, name: str, entries: dict[str, dict[str, Any]],
                       new: set[str]) -> dict[str, int]:
        """File locations of a save's tensors, for stores that record them (none)."""
        return {}

    def relocate(self, progress: Any = None) -> dict[str, int]:
        """Find every tensor's file location again (``"relocate"`` in capabilities)."""
        raise ModelRepositoryError(f"{self.url}: this store records no file locations")

    def compact(self, dest: "str | os.PathLike[str]", progress: Any = None) -> dict[str, Any]:
        """A copy of the store at ``dest`` without free pages (``"compact"`` in
        capabilities)."""
        raise ModelRepositoryError(f"{self.url}: only LMDB stores can be compacted")

    # -- what a store implements ------------------------------------------------------------
    @abc.abstractmethod
    def _store_tensors(self, name: str, blobs: dict[str, Any], kinds: Optional[dict] = None,
                       new: Optional[set] = None, owned: bool = False) -> tuple[bytes, int]:
        """Store a save's tensors not stored yet, durably, under a pending record;
        return its token and the bytes written."""

    @abc.abstractmethod
    def _publish(self, name: str, body: dict[str, Any], token: bytes,
                 parent: Optional[int], locs: Optional[dict[str, int]] = None) -> int:
        """Make ``body`` the next version of ``name``, atomically; return the version."""

    @abc.abstractmethod
    def _fetch(self, m: dict[str, Any], pairs: builtins.list[tuple[str, Any]],
               fresh: bool = False) -> None:
        """Copy the tensors of manifest ``m`` named in ``pairs`` into their destination
        tensors, verifying each one's hash."""

    @abc.abstractmethod
    def manifest(self, name: str, version: Optional[int] = None) -> dict[str, Any]:
        """The manifest of ``name`` at ``version`` (default: the latest)."""

    @abc.abstractmethod
    def versions(self, name: str) -> builtins.list[int]:
        """The versions of ``name``, oldest first (empty: no such model)."""

    @abc.abstractmethod
    def list(self) -> dict[str, builtins.list[int]]:
        """Every model name and its versions."""

    @abc.abstractmethod
    def delete(self, name: str, version: int) -> None:
        """Remove one version (its tensors stay until :meth:`gc`)."""

    @abc.abstractmethod
    def gc(self, grace_seconds: float = PENDING_GRACE_S) -> dict[str, int]:
        """Remove tensors no version references (and saves abandoned longer ago than
        ``grace_seconds``)."""

    @abc.abstractmethod
    def verify(self) -> builtins.list[str]:
        """Check every stored tensor against its hash; the problems found."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """``models``, ``versions``, ``tensors``, ``logical_bytes``, ``stored_bytes``
        (and ``file_bytes`` for a file-backed store), ``id_cache`` and I/O counters."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store (its connections, its environment)."""

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _traced(op: str, t0: float, name: str, version: int, nbytes: int, tensors: int) -> None:
    """A ``checkpoint/save`` or ``checkpoint/load`` event when tracing is on."""
    from .. import trace

    rec = trace.active()
    if rec is not None:
        rec.span("checkpoint", op, t0, time.perf_counter(), count=tensors, nbytes=nbytes,
                 args={"model": name, "version": version})


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ModelRepositoryError(
            f"bad model name {name!r}: 1-255 characters, letters, digits and . _ - /, "
            f"starting with a letter or digit")

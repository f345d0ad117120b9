"""The model repository: models stored as tensors (each once, by content) plus a compact
architecture graph with stable IDs; versions published atomically; partial loads read
only the selected tensors; every read verified against its hash."""

from __future__ import annotations

import abc
import builtins
import contextlib
import datetime
import fnmatch
import json
import os
import re
import time
import uuid
from typing import Any, Iterable, Iterator, Optional, TypeVar

import numpy as np
import xxhash

from ..errors import (ArgumentTypeError, CorruptModelError, ModelMismatchError, ModelNotFoundError,
                      ModelRepositoryError)
from ._arch import Architecture, IdCache, capture
from ._backend import _HUGE, Backend, LmdbBackend, MemoryBackend, prefer_huge_pages

__all__ = ["ModelStore", "Repository", "open_repository", "tensor_hash"]

FORMAT = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,254}$")
PENDING_GRACE_S = 6 * 3600  # a save older than this without a manifest crashed
_PARALLEL_VERIFY = 64 << 10  # tensors from this size are hashed while they are copied
# Tensors from this size get their file location recorded: LMDB keeps a value larger
# than its node limit (about 2,000 bytes with 4 KiB pages) in overflow pages of its own,
# which never move while the value exists; smaller values sit inside B-tree leaves,
# which move whenever a leaf is rewritten.
_LOC_MIN = 2048
_pool: Any = None


def _hasher() -> Any:
    """One helper thread for hashing (xxhash releases the GIL on large buffers)."""
    global _pool
    if _pool is None:
        from concurrent.futures import ThreadPoolExecutor

        _pool = ThreadPoolExecutor(1, thread_name_prefix="forebay-verify")
    return _pool


def _hash_head(dtype: str, shape: Iterable[int]) -> bytes:
    return f"{dtype}|{','.join(map(str, shape))}|".encode()


def tensor_hash(dtype: str, shape: Iterable[int], data: Any) -> str:
    """Content hash of a tensor: xxh3-128 of its dtype, shape and bytes."""
    h = xxhash.xxh3_128()
    h.update(_hash_head(dtype, shape))
    h.update(data)
    return h.hexdigest()


_COPY_CHUNK = 1 << 20  # copied, then hashed while still in the cache


def _halves(nbytes: list[int]) -> list[list[int]]:
    """Indices split in two by bytes, largest first, each to the lighter side."""
    sides: list[list[int]] = [[], []]
    load = [0, 0]
    for i in sorted(range(len(nbytes)), key=lambda i: -nbytes[i]):
        j = 0 if load[0] <= load[1] else 1
        sides[j].append(i)
        load[j] += nbytes[i]
    return sides


def _file_halves(offsets: list[int], nbytes: list[int]) -> list[list[int]]:
    """Indices in file order, cut in two at the tensor boundary nearest half the bytes:
    each side then reads one stretch of the file front to back (on its own descriptor,
    so the kernel's read-ahead sees a sequential reader)."""
    order = sorted(range(len(offsets)), key=lambda i: offsets[i])
    total, run, cut = sum(nbytes), 0, len(order)
    for j, i in enumerate(order):
        if run + nbytes[i] / 2 >= total / 2:
            cut = j
            break
        run += nbytes[i]
    return [order[:cut], order[cut:]] if cut else [order, []]


_GAP = 64 << 10   # tensors this close in the file are read by one call, the gap discarded
_IOV_MAX = 512    # well under every kernel's IOV_MAX (1,024 on Linux)


def _pread_and_hash(fd: int, jobs: list[tuple[np.ndarray, Any, bytes]]) -> list[Optional[str]]:
    """Read each ``(destination bytes, file offset, hash header)`` with ``preadv`` and
    hash it as it arrives; None where a read came back short or failed (the caller
    reads those another way).  Jobs given in file order whose bytes lie within
    ``_GAP`` of each other are read by one call covering up to 1 MiB of the file
    (small tensors: one system call and one sequential read for many of them, not a
    random read each); larger tensors in 1 MiB pieces, each hashed right after it
    arrives while it is in the cache."""
    hashes = []
    for _, _, head in jobs:
        h = xxhash.xxh3_128()
        h.update(head)
        hashes.append(h)
    ok = [True] * len(jobs)
    scratch = np.empty(_GAP, dtype=np.uint8)
    iovs: list[Any] = []
    pieces: list[tuple[int, np.ndarray]] = []
    start = pos = 0

    def flush() -> None:
        if not iovs:
            return
        try:
            good = os.preadv(fd, iovs, start) == pos - start
        except (OSError, OverflowError, TypeError, ValueError):   # a nonsense location
            good = False
        for i, piece in pieces:
            if not good:
                ok[i] = False
            elif ok[i]:
                hashes[i].update(memoryview(piece.data))
        iovs.clear()
        pieces.clear()

    for i, (dst, off, _) in enumerate(jobs):
        if not isinstance(off, int) or off < 0:
            ok[i] = False
            continue
        first = min(len(dst), _COPY_CHUNK)
        if iovs and 0 <= off - pos <= _GAP and off + first - start <= _COPY_CHUNK:
            if off > pos:
                iovs.append(scratch[:off - pos])
        else:
            flush()
            start = off
        pos = off
        for o in range(0, len(dst), _COPY_CHUNK):
            piece = dst[o:o + _COPY_CHUNK]
            if iovs and (pos + len(piece) - start > _COPY_CHUNK or len(iovs) >= _IOV_MAX):
                flush()
                start = pos
            iovs.append(piece)
            pieces.append((i, piece))
            pos += len(piece)
    flush()
    return [h.hexdigest() if good else None for h, good in zip(hashes, ok)]


def _copy_and_hash(jobs: list[tuple[np.ndarray, Any, bytes]]) -> list[str]:
    """Copy each ``(destination bytes, stored buffer, hash header)`` chunk by chunk and
    hash every chunk right after copying it, from the destination while it is in the
    cache: one pass over memory instead of a copy and a separate hashing pass, and the
    hash covers the bytes the caller gets.  numpy's copy and xxhash release the GIL."""
    out = []
    for dst, buf, head in jobs:
        src = np.frombuffer(buf, dtype=np.uint8)
        h = xxhash.xxh3_128()
        h.update(head)
        for o in range(0, len(src), _COPY_CHUNK):
            d = dst[o:o + _COPY_CHUNK]
            np.copyto(d, src[o:o + _COPY_CHUNK])
            h.update(d.data)
        out.append(h.hexdigest())
    return out


def _dtype_name(t: Any) -> str:
    return str(t.dtype).replace("torch.", "")


def _as_bytes(t: Any) -> np.ndarray:
    """A CPU tensor's bytes as a uint8 array (no copy when already contiguous on CPU;
    works for bfloat16 and other dtypes numpy lacks)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8).numpy()


def _vkey(name: str, version: int) -> bytes:
    return f"{name}\x00{version:012d}".encode()


def open_repository(url: str, token: Optional[str] = None, *, create: bool = True
                    ) -> "ModelStore":
    """``file:///path`` (or a plain path): LMDB in that directory; ``memory://`` (fresh)
    or ``memory://NAME`` (shared within the process); ``tcp://host:port[,...]``: a
    provider (``forebay models serve``)."""
    token = token or os.environ.get("FOREBAY_TOKEN")
    if url.startswith("memory://"):
        return Repository(MemoryBackend.named(url[len("memory://"):]))
    if url.startswith("tcp://"):
        from ._remote import RemoteRepository

        return RemoteRepository(url, token)
    if url.startswith("file://"):
        path = url[len("file://"):]
    elif url.startswith("file:"):
        path = url[len("file:"):]
    elif "://" in url:
        raise ModelRepositoryError(f"{url}: unknown repository URL scheme (file://, "
                                   f"memory://, tcp://)")
    else:
        path = url
    return Repository(LmdbBackend(path, create=create))


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


class Repository(ModelStore):
    """Models and their versions in one local store, LMDB or memory (see
    :func:`open_repository`); a provider serves one to remote clients through its
    storage-side methods (:meth:`missing`, :meth:`put_tensors`, :meth:`commit`,
    :meth:`read_tensors`)."""

    def __init__(self, backend: Backend, url: Optional[str] = None) -> None:
        super().__init__(url if url is not None else backend.url)
        self.backend = backend
        if backend.file_locations:
            self.capabilities = frozenset({"relocate", "compact"})

    def _advise(self, pattern: str) -> Any:
        return self.backend.advise(pattern)

    # -- the storage side of a save (a provider runs these for its clients) -------------
    def _store_tensors(self, name: str, blobs: dict[str, Any], kinds: Optional[dict] = None,
                       new: Optional[set] = None, owned: bool = False) -> tuple[bytes, int]:
        """Write the tensors of a save of ``name`` not stored yet, durably, under a
        pending record; returns the record's token and the bytes written (``kinds``:
        hash -> dtype and shape, for a store that re-verifies; ``owned``: the buffers
        are given away, as a provider's receive buffers are, so a memory store keeps
        them instead of copies)."""
        token = uuid.uuid4().hex.encode()
        written = 0
        with self.backend.write() as txn:  # 1: the tensors, durable before any manifest
            txn.put("pending", token, json.dumps({"created": time.time(),
                                                  "hashes": sorted(blobs)}).encode())
            for h, data in blobs.items():
                # the sizes table says what is stored (a put or lookup on the tensors
                # table would read the whole stored tensor first)
                if not txn.has("sizes", h.encode()):
                    n = len(memoryview(data).cast("B"))
                    txn.put("tensors", h.encode(), data if owned else memoryview(data),
                            owned=owned)
                    txn.put("sizes", h.encode(), n.to_bytes(8, "little"))
                    written += n
                    self._io["tensors_written"] += 1
                    if new is not None:
                        new.add(h)
                else:
                    self._io["tensors_deduplicated"] += 1
        self._io["bytes_written"] += written
        return token, written

    def _add_locations(self, name: str, entries: dict[str, dict[str, Any]],
                       new: set[str]) -> dict[str, int]:
        """Record where tensors' bytes sit in the store's file (``loc``; tensors of
        ``_LOC_MIN`` bytes or more, which LMDB keeps in pages of their own), so loads
        read them with ``preadv`` straight into the destination, exactly what they need,
        neighbours in one call, instead of through the map (where every tensor is a
        B-tree lookup, py-lmdb first touches every page of a value and a cold fault
        reads the device's whole read-ahead window).  Locations come from the ``locs``
        table (whichever model stored the tensor: a fine-tuned model's shared backbone,
        a zero bias), else from the previous version of ``name`` (stores written before
        that table), else by finding the value: tensors this save wrote (still cached)
        and small ones (a page or a few).  Large tensors stored earlier without a
        location stay without (they are read through the map).  Returns the locations
        found here, for :meth:`_publish` to add to ``locs``."""
        if not self.backend.file_locations:
            return {}
        locate = self.backend.locate
        big = {k: e for k, e in entries.items()       # (a provider's entries come from
               if isinstance(e, dict) and isinstance(e.get("hash"), str)   # a client)
               and isinstance(e.get("nbytes"), int) and e["nbytes"] >= _LOC_MIN}
        if not big:
            return {}
        size = {e["hash"]: e["nbytes"] for e in big.values()}
        known: dict[str, int] = {}
        with self.backend.read() as txn:
            for h in size:
                raw = txn.get("locs", h.encode())
                if raw is not None:
                    known[h] = int.from_bytes(bytes(raw), "little")
        if len(known) < len(size):
            try:
                prev = self.manifest(name)
                for e in prev["tensors"].values():
                    if "loc" in e and e["hash"] in size:
                        known.setdefault(e["hash"], e["loc"])
            except ModelNotFoundError:
                pass
        todo = sorted(h for h in size if h not in known
                      and (h in new or size[h] < _PARALLEL_VERIFY))
        found = {h: off for h, off in zip(todo, locate([h.encode() for h in todo]))
                 if off is not None}
        known.update(found)
        for e in big.values():
            if e["hash"] in known:
                e["loc"] = known[e["hash"]]
        return found

    def _pending_hashes(self, token: bytes) -> set[str]:
        """The tensors a save in progress wrote (its pending record), or none."""
        with self.backend.read() as txn:
            raw = txn.get("pending", token)
        try:
            return set(json.loads(bytes(raw))["hashes"]) if raw is not None else set()
        except (ValueError, KeyError, TypeError):
            return set()

    def _missing(self, hashes: builtins.list[str]) -> builtins.list[str]:
        """Which of these tensors the store does not hold."""
        with self.backend.read() as txn:
            return [h for h in hashes if not txn.has("sizes", h.encode())]

    def _publish(self, name: str, body: dict[str, Any], token: bytes,
                 parent: Optional[int], locs: Optional[dict[str, int]] = None) -> int:
        """Write the manifest as the next version of ``name``, atomically, and drop the
        pending record of its tensors (and add ``locs``, from :meth:`_add_locations`,
        to the ``locs`` table in the same transaction)."""
        _check_name(name)
        with self.backend.write() as txn:  # 2: the manifest, atomically, then un-pend
            for e in body["tensors"].values():
                if not txn.has("sizes", e["hash"].encode()):
                    raise ModelRepositoryError(f"{name}: tensor {e['hash'][:16]} was never "
                                               f"stored; not publishing")
            last = self._last_version(txn, name)
            version = last + 1
            manifest = {
                "format": FORMAT, "name": name, "version": version,
                "parent": parent if parent is not None else (last if last else None),
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(), **body}
            txn.put("versions", _vkey(name, version), json.dumps(manifest).encode())
            txn.delete("pending", token)
            for h, off in (locs or {}).items():
                txn.put("locs", h.encode(), int(off).to_bytes(8, "little"))
        return version

    def _fetch(self, m: dict[str, Any], pairs: builtins.list[tuple[str, Any]],
               fresh: bool = False) -> None:
        """Fill each ``(key, destination tensor)`` with ``key``'s verified bytes.

        Tensors going straight into CPU memory whose location in the store's file the
        manifest records are read with :meth:`_fetch_pread` (neighbours in one call, no
        B-tree lookups).  Those of 64 KiB or more read through the store's map take one
        hand-off per load, not per tensor (the copies and xxhash release the interpreter
        lock): into existing tensors (a load in place) they are copied and hashed in one
        pass (:func:`_copy_and_hash`), split by bytes between this thread and one
        helper, and into ``fresh`` tensors, whose first touch page-faults and would make
        two writing threads contend, this thread copies while the helper hashes the
        stored bytes.  Other tensors are verified, then copied, one by one."""
        with self.backend.read() as txn:
            fd = self.backend.data_fd()
            located, fast, slow = [], [], []
            for k, dst in pairs:
                e = m["tensors"][k]
                ok = dst.device.type == "cpu" and dst.is_contiguous() and e["dtype"] != "bool"
                if ok and fd is not None and "loc" in e and e["nbytes"] > 0:
                    located.append((k, dst))
                elif ok and e["nbytes"] >= _PARALLEL_VERIFY:
                    fast.append((k, dst))
                else:
                    slow.append((k, dst))
            fd2 = self.backend.data_fd(1)
            if located and fd is not None and fd2 is not None:
                self._fetch_pread(txn, m, located, fd, fd2)
            for k, dst in slow:
                self._read_into(txn, m, k, dst)
            if not fast:
                return
            with self._advise("normal"):  # large values through the map: read-ahead on
                bufs = [self._buffer(txn, m, k) for k, _ in fast]
            entries = [m["tensors"][k] for k, _ in fast]
            if fresh:
                fut = _hasher().submit(lambda: [tensor_hash(e["dtype"], e["shape"], b)
                                                for e, (b, _) in zip(entries, bufs)])
                try:
                    for (_, dst), (buf, _), e in zip(fast, bufs, entries):
                        _copy_into(dst, buf, e["dtype"])
                finally:
                    hashes = fut.result()
                self._check_hashes(bufs, entries, dict(enumerate(hashes)))
                return
            jobs = [(_byte_view(dst), buf, _hash_head(e["dtype"], e["shape"]))
                    for (_, dst), (buf, _), e in zip(fast, bufs, entries)]
            sides = _halves([e["nbytes"] for e in entries])
            got: dict[int, str] = {}
            fut = _hasher().submit(_copy_and_hash, [jobs[i] for i in sides[1]])
            try:
                got.update(zip(sides[0], _copy_and_hash([jobs[i] for i in sides[0]])))
            finally:
                got.update(zip(sides[1], fut.result()))
            self._check_hashes(bufs, entries, got)

    def _fetch_pread(self, txn: Any, m: dict[str, Any], fast: list, fd: int,
                     fd2: int) -> None:
        """Read tensors whose file location is recorded with ``preadv`` straight into
        their destinations, hashing each piece right after it arrives; the tensors in
        file order, cut in two by bytes between this thread and one helper, each with
        its own descriptor (a load under 1 MiB stays on this thread).  A tensor whose
        bytes do not match (a location gone stale, e.g. after the store was compacted by
        a copy) is read again through the map and verified there before anything is
        called corrupt."""
        entries = [m["tensors"][k] for k, _ in fast]
        jobs = [(_byte_view(dst), e["loc"], _hash_head(e["dtype"], e["shape"]))
                for (_, dst), e in zip(fast, entries)]
        sides = _file_halves([e["loc"] if isinstance(e["loc"], int) else -1 for e in entries],
                             [e["nbytes"] for e in entries])
        if sum(e["nbytes"] for e in entries) < _COPY_CHUNK:
            sides = [sides[0] + sides[1], []]
        got: dict[int, Optional[str]] = {}
        fut = _hasher().submit(_pread_and_hash, fd2, [jobs[i] for i in sides[1]]) \
            if sides[1] else None
        try:
            got.update(zip(sides[0], _pread_and_hash(fd, [jobs[i] for i in sides[0]])))
        finally:
            if fut is not None:
                got.update(zip(sides[1], fut.result()))
        for i, ((k, dst), e) in enumerate(zip(fast, entries)):
            self._io["bytes_read"] += e["nbytes"]
            self._io["tensors_read"] += 1
            if got[i] != e["hash"]:
                self._io["bytes_read"] -= e["nbytes"]
                self._io["tensors_read"] -= 1
                self._read_into(txn, m, k, dst)

    # -- reading manifests --------------------------------------------------------------
    @staticmethod
    def _last_version(txn: Any, name: str) -> int:
        last = 0
        for k, _ in txn.items("versions", f"{name}\x00".encode(), values=False):
            last = max(last, int(k.split(b"\x00")[1]))
        return last

    def versions(self, name: str) -> builtins.list[int]:
        """Versions of ``name``, oldest first."""
        with self.backend.read() as txn:
            return [int(k.split(b"\x00")[1]) for k, _ in
                    txn.items("versions", f"{name}\x00".encode(), values=False)]

    def list(self) -> dict[str, builtins.list[int]]:
        """Every model name with its versions."""
        out: dict[str, builtins.list[int]] = {}
        with self.backend.read() as txn:
            for k, _ in txn.items("versions", values=False):
                n, v = k.split(b"\x00")
                out.setdefault(n.decode(), []).append(int(v))
        return out

    def manifest(self, name: str, version: Optional[int] = None) -> dict[str, Any]:
        """A version's manifest (the latest when ``version`` is None)."""
        with self.backend.read() as txn:
            if version is None:
                version = self._last_version(txn, name)
                if version == 0:
                    raise ModelNotFoundError(f"no model named {name!r} in {self.url}")
            raw = txn.get("versions", _vkey(name, version))
            if raw is None:
                have = [int(k.split(b"\x00")[1]) for k, _ in
                        txn.items("versions", f"{name}\x00".encode(), values=False)]
                raise ModelNotFoundError(
                    f"no version {version} of {name!r} in {self.url} (versions: "
                    f"{have or 'none'})")
            try:
                return json.loads(bytes(raw))
            except ValueError as e:
                raise CorruptModelError(f"model {name!r} version {version}: the manifest "
                                        f"is not valid JSON ({e})") from e

    def _buffer(self, txn: Any, m: dict[str, Any], key: str) -> tuple[Any, str]:
        """The stored bytes of ``key`` (unverified) and how to name it in errors."""
        e = m["tensors"][key]
        buf = txn.get("tensors", e["hash"].encode())
        where = f"model {m['name']!r} version {m['version']}: tensor {key!r}"
        if buf is None:
            raise CorruptModelError(f"{where} ({e['hash'][:16]}) is missing from the store")
        if len(buf) != e["nbytes"]:
            raise CorruptModelError(f"{where} ({e['hash'][:16]}): {len(buf)} bytes stored, "
                                    f"{e['nbytes']} expected (corrupt)")
        self._io["bytes_read"] += len(buf)
        self._io["tensors_read"] += 1
        return buf, where

    def _read(self, txn: Any, m: dict[str, Any], key: str) -> Any:
        """Verified bytes of ``key``."""
        e = m["tensors"][key]
        buf, where = self._buffer(txn, m, key)
        if tensor_hash(e["dtype"], e["shape"], buf) != e["hash"]:
            raise CorruptModelError(f"{where} ({e['hash'][:16]}): stored bytes do not match "
                                    f"their hash (corrupt)")
        return buf

    def _read_into(self, txn: Any, m: dict[str, Any], key: str, dst: Any) -> None:
        """Verify ``key``'s stored bytes, then copy them into tensor ``dst``."""
        _copy_into(dst, self._read(txn, m, key), m["tensors"][key]["dtype"])

    # -- housekeeping -------------------------------------------------------------------
    def delete(self, name: str, version: int) -> None:
        """Remove a version (its tensors go at the next :meth:`gc` if nothing else uses
        them)."""
        with self.backend.write() as txn:
            if not txn.delete("versions", _vkey(name, version)):
                raise ModelNotFoundError(f"no version {version} of {name!r} in {self.url}")

    def _referenced(self, txn: Any, grace_s: float) -> set[bytes]:
        refs: set[bytes] = set()
        for _, raw in txn.items("versions"):
            for e in json.loads(bytes(raw))["tensors"].values():
                refs.add(e["hash"].encode())
        now = time.time()
        for _, raw in txn.items("pending"):
            p = json.loads(bytes(raw))
            if now - p["created"] < grace_s:  # a save in progress: keep its tensors
                refs.update(h.encode() for h in p["hashes"])
        return refs

    def gc(self, grace_seconds: float = PENDING_GRACE_S) -> dict[str, int]:
        """Delete tensors no version references (sparing saves in progress for
        ``grace_seconds``; older pending records are crashed saves and go too)."""
        removed = freed = stale = 0
        with self.backend.write() as txn:
            refs = self._referenced(txn, grace_seconds)
            dead = [(k, int.from_bytes(bytes(v), "little")) for k, v in txn.items("sizes")
                    if k not in refs]
            for k, n in dead:
                txn.delete("tensors", k)
                txn.delete("sizes", k)
                txn.delete("locs", k)
                removed += 1
                freed += n
            now = time.time()
            old = [k for k, raw in txn.items("pending")
                   if now - json.loads(bytes(raw))["created"] >= grace_seconds]
            for k in old:
                txn.delete("pending", k)
                stale += 1
        return {"tensors_removed": removed, "bytes_freed": freed, "stale_saves": stale}

    def relocate(self, progress: Any = None) -> dict[str, int]:
        """Find every stored tensor's location in the store's file again and rewrite the
        ``locs`` table and every manifest's ``loc`` (after the file was rewritten, e.g.
        by a compacting copy: old locations would each cost a failed read before the
        fallback).  Reads the whole store once.  LMDB stores only."""
        from ..progress import as_progress

        if not self.backend.file_locations:
            raise ModelRepositoryError(f"{self.url}: only LMDB stores record locations")
        locate = self.backend.locate
        with self.backend.read() as txn:
            keys = [k for k, v in txn.items("sizes")
                    if int.from_bytes(bytes(v), "little") >= _LOC_MIN]
        prog = as_progress(progress)
        prog.start(len(keys), "locating tensors", unit="tensor")
        locs: dict[bytes, int] = {}
        try:
            for i in range(0, len(keys), 256):
                part = keys[i:i + 256]
                locs.update((k, off) for k, off in zip(part, locate(part)) if off is not None)
                prog.update(len(part))
        finally:
            prog.close()
        rewritten = 0
        with self.backend.write() as txn:
            for k in [k for k, _ in txn.items("locs", values=False)]:
                txn.delete("locs", k)
            for k, off in locs.items():
                txn.put("locs", k, off.to_bytes(8, "little"))
            for k, raw in [(k, bytes(v)) for k, v in txn.items("versions")]:
                m = json.loads(raw)
                changed = False
                for e in m["tensors"].values():
                    found = locs.get(e["hash"].encode())
                    if found is None:
                        changed |= e.pop("loc", None) is not None
                    elif e.get("loc") != found:
                        e["loc"], changed = found, True
                if changed:
                    txn.put("versions", k, json.dumps(m).encode())
                    rewritten += 1
        return {"tensors_located": len(locs), "manifests_rewritten": rewritten}

    def compact(self, dest: "str | os.PathLike[str]", progress: Any = None) -> dict[str, Any]:
        """Write a compacted copy of this LMDB store to ``dest`` (a new or empty
        directory): without the free pages that deleted versions and :meth:`gc` leave
        (LMDB reuses them but never shrinks its file), with every location found again
        (:meth:`relocate`).  This store is not changed; readers and writers may go on
        (the copy is one consistent snapshot); swap the directories when nothing uses
        the old one.  Returns ``bytes_before``, ``bytes_after`` and relocate's counts."""
        if not self.backend.file_locations or self.backend.data_file is None:
            raise ModelRepositoryError(f"{self.url}: only LMDB stores can be compacted")
        before = os.path.getsize(self.backend.data_file)
        out = self.backend.copy_compacted(dest)
        with Repository(LmdbBackend(out, create=False)) as other:
            moved = other.relocate(progress)
            after = os.path.getsize(out / "data.mdb")
        return {"bytes_before": before, "bytes_after": after,
                **moved}

    def verify(self) -> builtins.list[str]:
        """Check every stored tensor against its hash and every manifest against the
        store; returns the problems found (empty: intact)."""
        problems: builtins.list[str] = []
        with self.backend.read() as txn:
            known: dict[bytes, str] = {}
            for k, raw in txn.items("versions"):
                n, v = k.split(b"\x00")
                try:
                    m = json.loads(bytes(raw))
                except ValueError:
                    problems.append(f"{n.decode()} version {int(v)}: manifest is not JSON")
                    continue
                for key, e in m["tensors"].items():
                    h = e["hash"].encode()
                    where = f"{m['name']} version {m['version']}: tensor {key!r}"
                    if h not in known:
                        buf = txn.get("tensors", h)
                        if buf is None:
                            known[h] = "missing"
                        elif tensor_hash(e["dtype"], e["shape"], buf) != e["hash"]:
                            known[h] = "corrupt"
                        else:
                            known[h] = ""
                    if known[h]:
                        problems.append(f"{where} ({e['hash'][:16]}) is {known[h]}")
        return problems

    def stats(self) -> dict[str, Any]:
        """``logical_bytes`` (every version's tensors counted in full), ``stored_bytes``
        (tensor bytes actually in the store), ``file_bytes`` (LMDB: the size of its data
        file, which keeps the pages deleted versions free: see :meth:`compact`), counts,
        and this client's I/O."""
        logical = versions = 0
        names = set()
        with self.backend.read() as txn:
            for k, raw in txn.items("versions"):
                logical += json.loads(bytes(raw))["logical_bytes"]
                versions += 1
                names.add(k.split(b"\x00")[0])
            stored = tensors = 0
            for _, v in txn.items("sizes"):
                stored += int.from_bytes(bytes(v), "little")
                tensors += 1
        data = self.backend.data_file
        extra = {"file_bytes": os.path.getsize(data)} if data is not None else {}
        return {"models": len(names), "versions": versions, "tensors": tensors,
                "logical_bytes": logical, "stored_bytes": stored, **extra,
                "id_cache": {"hits": self.cache.hits, "misses": self.cache.misses},
                **self._io}

    def close(self) -> None:
        try:
            self._end_saves()
        finally:
            self.backend.close()

    # -- the storage side, served by a provider (forebay models serve) ---------------------
    def missing(self, hashes: builtins.list[str]) -> builtins.list[str]:
        """Which of these tensors the store does not hold."""
        return self._missing(hashes)

    def put_tensors(self, blobs: dict[str, Any], *, owned: bool = False) -> tuple[bytes, int]:
        """Store tensors (hash -> verified bytes) not stored yet, durably, under a
        pending record; returns its token (for :meth:`commit`) and the bytes written.
        ``owned``: the buffers are given away (a memory store keeps them)."""
        return self._store_tensors("", blobs, owned=owned)

    def commit(self, name: str, body: dict[str, Any], token: bytes,
               parent: Optional[int] = None) -> int:
        """Publish ``body`` (a manifest body whose tensors were put under ``token``) as
        the next version of ``name``; file locations are this store's own."""
        for e in body["tensors"].values():
            e.pop("loc", None)  # never a client's
        found = self._add_locations(name, body["tensors"], self._pending_hashes(token))
        return self._publish(name, body, token, parent, found)

    @contextlib.contextmanager
    def read_tensors(self, hashes: builtins.list[str]) -> Iterator[builtins.list[Any]]:
        """The stored bytes of these tensors, valid inside the ``with`` block; a missing
        one raises :class:`CorruptModelError`."""
        with self.backend.read() as txn:
            bufs = []
            for h in hashes:
                b = txn.get("tensors", str(h).encode())
                if b is None:
                    raise CorruptModelError(f"tensor {str(h)[:16]} is missing from the store")
                bufs.append(b)
            yield bufs


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


_NP = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
       "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
       "uint8": np.uint8, "bool": np.uint8}


def _from_bytes(buf: Any, dtype: str, shape: list[int]) -> Any:
    """A new CPU tensor holding a copy of ``buf``."""
    import torch

    if dtype == "bool":
        return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8) != 0).reshape(shape)
    if len(buf) == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    raw = torch.from_numpy(np.array(np.frombuffer(buf, dtype=np.uint8)))
    return raw.view(getattr(torch, dtype)).reshape(shape)


def _byte_view(t: Any) -> np.ndarray:
    """A contiguous CPU tensor's memory as a writable uint8 array (no copy)."""
    import torch

    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _copy_into(dst: Any, buf: Any, dtype: str) -> None:
    """Copy stored bytes into tensor ``dst`` in place (straight into its memory on CPU)."""
    import torch

    with torch.no_grad():
        if dst.device.type == "cpu" and dst.is_contiguous() and dtype != "bool":
            view = dst.detach().reshape(-1).view(torch.uint8).numpy()
            view[:] = np.frombuffer(buf, dtype=np.uint8)
        else:
            dst.copy_(_from_bytes(buf, dtype, list(dst.shape)).to(dst.device))

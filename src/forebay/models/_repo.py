"""The model repository over a storage backend (embedded LMDB, or memory): tensors stored
once by content, versions published atomically, partial loads that read only the
selected tensors, every read verified against its hash, and garbage collection of what
no version references."""

from __future__ import annotations

import builtins
import contextlib
import datetime
import json
import os
import time
import uuid
from typing import Any, Iterator, Optional

from ..errors import CorruptModelError, ModelNotFoundError, ModelRepositoryError
from ._backend import Backend, LmdbBackend
from ._store import FORMAT, PENDING_GRACE_S, ModelStore, _check_name, _vkey
from ._tensors import (_COPY_CHUNK, _byte_view, _copy_and_hash, _copy_into, _file_halves,
                       _halves, _hash_head, _hasher, _pread_and_hash, tensor_hash)

__all__ = ["Repository"]


_PARALLEL_VERIFY = 64 << 10  # tensors from this size are hashed while they are copied
# Tensors from this size get their file location recorded: LMDB keeps a value larger
# than its node limit (about 2,000 bytes with 4 KiB pages) in overflow pages of its own,
# which never move while the value exists; smaller values sit inside B-tree leaves,
# which move whenever a leaf is rewritten.
_LOC_MIN = 2048


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

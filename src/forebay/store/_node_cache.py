"""A node-local cache of a dataset's records that outlives the job (issue U, item 1).

The first job on a node reads its samples from the shared file system and keeps each
record it read in node-local storage (an SSD, a node's scratch); the next job on the
same node reads them from there.  Layout under the cache's root, one directory per
dataset *line* (its first generation's fingerprint, :func:`node_cache_key`: a dataset
that grows by appends keeps its directory, which grows with it)::

    ROOT/.lock                      flock: creating, extending and evicting datasets
    ROOT/<key>/manifest.json, shard-*.idx.npy     copies (the latest version seen)
    ROOT/<key>/shard-*.bin          sparse: a record at its offset in the shard once read
    ROOT/<key>/present              one byte per sample: 1 once its record is written
    ROOT/<key>/inuse                flock shared by every job using it
    ROOT/<key>/cache.json           the source's path, sizes, last use

So the cached copy is itself a forebay dataset whose shard files hold the records read
so far: the loader reads it as it reads the original (its first generations, as many
as the job's dataset has).  Guarantees:

- **Never stale**: a dataset written again has another first generation, so another
  directory; one that grew (appends never change a shard) gets the new generations'
  shards added to its directory; one whose later generations are not the copy's (the
  same first generation, then others) evicts the copy, or keeps a copy of its own
  beside it while another job uses the old one.  Old directories are evicted as the
  least recently used.
- **Checked on reuse**: every cached record is checked against its checksum on its
  first use by a job (xxh3, gigabytes per second); a record that fails is read from the
  source again.  Records read from the source are checked before they are kept.
- **Safe to share**: concurrent jobs on the node write the same bytes to the same
  places; a record's presence byte is set only after its bytes are written.  Locks
  are ``flock``s, which the kernel drops when a process dies (kill -9 included).
- **Bounded**: at most ``cap_bytes`` (allocated blocks) under the root; datasets no job
  uses are evicted least recently used first; when the cap is reached the job reads
  what is not cached from the source, as without a cache.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .._units import human_bytes
from .._fs import Flock
from ..dataset import (IndexLayout, Manifest, PackedDataset, PrefixDataset, generations,
                       open_dataset, prefix_fingerprint)
from ..errors import (ChecksumError, CorruptDatasetError, DatasetNotFoundError,
                      InvalidArgumentError)

__all__ = ["NodeCache", "cache_entries", "node_cache_key", "clear_cache", "node_cache_root",
           "NODE_CACHE_ENV",
           "NODE_CACHE_BYTES_ENV"]

#: where the cache lives when the loader is not told (unset: no cache)
NODE_CACHE_ENV = "FOREBAY_NODE_CACHE"
#: records read from the source at once by :meth:`NodeCache.ensure_all`
PIECE_BYTES = 64 << 20
#: the cap on the cache's bytes under its root (default: half the file system's free
#: space when the cache is first opened, plus what it already holds)
NODE_CACHE_BYTES_ENV = "FOREBAY_NODE_CACHE_BYTES"


def _allocated(d: Path) -> int:
    """Bytes of disk the files under ``d`` take (sparse shards count what is written)."""
    total = 0
    for p in d.rglob("*"):
        try:
            st = p.stat()
        except OSError:
            continue
        if p.is_file():
            total += st.st_blocks * 512
    return total


def _write_meta(d: Path, **updates: Any) -> None:
    """Update ``d/cache.json`` (the source's path, the last use) atomically."""
    meta = _read_meta(d)
    meta.update(updates)
    tmp = d / f".cache.json.{os.getpid()}"
    tmp.write_text(json.dumps(meta) + "\n")
    tmp.replace(d / "cache.json")


def _read_meta(d: Path) -> dict[str, Any]:
    try:
        meta = json.loads((d / "cache.json").read_text())
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError):
        return {}


def _in_use(d: Path) -> bool:
    try:
        lock = Flock(d / "inuse", block=False)
    except BlockingIOError:
        return True
    except OSError:
        return False
    lock.release()
    return False


def cache_entries(root: "str | os.PathLike[str]") -> list[dict[str, Any]]:
    """What the cache at ``root`` holds, one dict per dataset version: ``fingerprint``,
    ``source``, ``samples``, ``cached_samples``, ``bytes`` (on disk), ``last_used``
    (Unix time), ``in_use``; most recently used first."""
    root = Path(root)
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if not d.is_dir() or d.name.startswith("."):
            continue
        meta = _read_meta(d)
        try:
            present = np.fromfile(d / "present", dtype=np.uint8)
        except OSError:
            present = np.zeros(0, np.uint8)
        out.append({"fingerprint": d.name, "source": meta.get("source"),
                    "samples": len(present), "cached_samples": int(np.count_nonzero(present)),
                    "bytes": _allocated(d), "last_used": float(meta.get("last_used", 0.0)),
                    "in_use": _in_use(d)})
    return sorted(out, key=lambda e: -e["last_used"])


def clear_cache(root: "str | os.PathLike[str]", fingerprint: Optional[str] = None
                ) -> tuple[list[str], list[str]]:
    """Remove the cache's datasets (``fingerprint``: that one only) that no job uses;
    returns (removed, kept because in use)."""
    root = Path(root)
    removed: list[str] = []
    kept: list[str] = []
    if not root.is_dir():
        return removed, kept
    with Flock(root / ".lock"):
        for e in cache_entries(root):
            if fingerprint is not None and e["fingerprint"] != fingerprint:
                continue
            (kept if not _evict(root / e["fingerprint"]) else removed).append(e["fingerprint"])
    return removed, kept


def _evict(d: Path) -> bool:
    """Remove dataset directory ``d`` unless a job uses it (its inuse lock is held);
    the caller holds the root lock, so nobody opens it meanwhile."""
    try:
        lock = Flock(d / "inuse", block=False)
    except BlockingIOError:
        return False
    try:
        trash = d.with_name(f".evicted-{uuid.uuid4().hex[:8]}")
        d.rename(trash)                   # gone for openers at once, then removed
    finally:
        lock.release()
    shutil.rmtree(trash, ignore_errors=True)
    return True


class NodeCache:
    """The node-local cache of dataset ``src``'s records under ``root``.

    :meth:`ensure` makes a batch's records present (read from the source those that are
    not, kept while the cap allows); :attr:`dataset` is the cached copy, which then
    serves them.  :meth:`close` releases the dataset for eviction."""

    def __init__(self, root: "str | os.PathLike[str]", src: PackedDataset, *,
                 cap_bytes: Optional[int] = None) -> None:
        if not isinstance(src.locator, str):   # its shards are other datasets' files
            raise InvalidArgumentError(
                f"the node cache keeps one dataset's files: {src!r} reads several (a "
                f"mixture's sources) and is not cached; leave node_cache unset")
        self.root = Path(root)
        self.src = src
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise InvalidArgumentError(f"node cache {self.root}: cannot create it ({e})") from e
        self.dir = self.root / node_cache_key(src)
        with Flock(self.root / ".lock"):
            if (self.dir / "present").is_file() and not self._follow():
                self.dir = self.root / f"{node_cache_key(src)}-{src.fingerprint}"   # (see _follow)
            if not (self.dir / "present").is_file():
                self._create()
            self._inuse = Flock(self.dir / "inuse", shared=True)
            used = _allocated(self.root)
            self.cap_bytes = self._cap(cap_bytes, used)
            self._used = self._make_room(used)
            _write_meta(self.dir, source=str(src.path), last_used=time.time())
        self._present = np.memmap(self.dir / "present", dtype=np.uint8, mode="r+",
                                  shape=(len(src),)) if len(src) else np.zeros(0, np.uint8)
        #: records checked in this job (a cached record is checked on its first use)
        self._checked = np.zeros(len(src), dtype=bool)
        #: the cached copy, as the source is (its directory may hold later generations)
        self.dataset = PrefixDataset(self.dir, len(src), verify_on_read=False) if len(src) \
            else open_dataset(self.dir, verify_on_read=False)
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self.full = False
        #: requests served from the cache / from the source in this job (repeats count)
        self.hits = self.misses = 0
        self.miss_bytes = 0

    # -- set-up -----------------------------------------------------------------------
    def _create(self) -> None:
        """The dataset's directory, made under a temporary name and renamed into place:
        its manifest (the source's view) and index files copied, its shards sparse
        files of their size."""
        tmp = self.root / f".new-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(mode=0o700)
        try:
            self._add_shards(tmp, self.src.manifest.shards)
            with open(tmp / "present", "wb") as fh:
                fh.truncate(len(self.src))
            (tmp / "manifest.json").write_text(self.src.manifest.to_json())
            tmp.rename(self.dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _add_shards(self, d: Path, shards: Any) -> None:
        for s in shards:
            shutil.copy2(self.src.path / s.index, d / s.index)
            with open(d / s.data, "wb") as fh:
                fh.truncate(s.data_nbytes)

    def _follow(self) -> bool:
        """The cached copy of a dataset that grows (the root lock is held): where the
        source holds generations the copy lacks, add their (empty) shards, presence
        bytes and the source's manifest; where it holds fewer, read the copy's first
        ones.  False when the copy's later generations are not the source's (the same
        first generation, then others: a dataset replaced after its first
        generation): that copy is evicted when no job uses it, else this job keeps a
        copy of its own beside it."""
        try:
            cached = Manifest.read(self.dir)
        except (CorruptDatasetError, DatasetNotFoundError):     # a damaged copy: stale
            return _evict(self.dir)
        have, want = cached.shards, self.src.manifest.shards
        common = min(len(have), len(want))
        if have[:common] != want[:common]:
            return _evict(self.dir)
        if len(want) > len(have):
            self._add_shards(self.dir, want[len(have):])
            with open(self.dir / "present", "r+b") as fh:
                fh.truncate(max(len(self.src), os.fstat(fh.fileno()).st_size))
            staged = self.dir / f".manifest.{uuid.uuid4().hex[:8]}"
            staged.write_text(self.src.manifest.to_json())
            staged.replace(self.dir / "manifest.json")      # the new generations appear
        return True

    def _cap(self, cap_bytes: Optional[int], used: int) -> int:
        if cap_bytes is None:
            env = os.environ.get(NODE_CACHE_BYTES_ENV)
            if env:
                from .._units import parse_size

                cap_bytes = parse_size(env)
        if cap_bytes is None:
            return used + shutil.disk_usage(self.root).free // 2
        if cap_bytes <= 0:
            raise InvalidArgumentError(f"node cache cap must be positive, got {cap_bytes}")
        return int(cap_bytes)

    def _make_room(self, used: int, need: int = 0) -> int:
        """Evict the least recently used datasets no job uses (this one aside) while the
        root holds more than the cap less ``need`` (the root lock is held); ``used``: the
        bytes under the root now.  Returns them after."""
        if used + need <= self.cap_bytes:
            return used
        for e in reversed(cache_entries(self.root)):          # least recently used first
            if used + need <= self.cap_bytes:
                break
            d = self.root / e["fingerprint"]
            if d != self.dir and _evict(d):
                used -= e["bytes"]
        return used

    # -- the batch path ---------------------------------------------------------------
    def ensure(self, ids: np.ndarray) -> bool:
        """Make the records of samples ``ids`` (normalised) present and checked; False
        when the cap leaves some of them out (read those from the source)."""
        asked = len(ids)
        ids, count = np.unique(ids, return_counts=True)
        have = self._present[ids].astype(bool)
        fresh = ids[have & ~self._checked[ids]]
        if len(fresh):                     # cached by an earlier job (or a peer): check
            stale = self.dataset.bad_records(fresh)
            if stale:
                self._present[np.asarray(stale, dtype=np.int64)] = 0
                have = self._present[ids].astype(bool)
            self._checked[fresh] = True
        missing = ids[~have]
        if not len(missing):
            with self._lock:
                self.hits += asked
            return True
        rows = self.src.rows(missing)
        lens = rows[:, IndexLayout.REC_LEN]
        need = int(lens.sum())
        with self._lock:
            if not self.full and self._used + need > self.cap_bytes:
                # evict what no job uses, least recently used first, and count again
                with Flock(self.root / ".lock"):
                    self._used = self._make_room(_allocated(self.root), need)
            if self.full or self._used + need > self.cap_bytes:
                self.full = True          # the caller reads this batch from the source
                return False
            self._used += need
            wanted = int(count[~have].sum())      # requests of the missing (repeats too)
            self.hits += asked - wanted           # (fill threads and batches count here)
            self.misses += wanted
            self.miss_bytes += need
        dst = np.zeros(len(missing), dtype=np.int64)
        np.cumsum(lens[:-1], out=dst[1:])
        buf = np.empty(need, dtype=np.uint8)
        self.src.read_records(missing, rows, buf, dst)          # the shared file system
        bad = self.src.bad_records(missing, buf, dst)
        if bad:
            raise ChecksumError(f"{self.src.path}: sample {bad[0]} fails its checksum as "
                                f"read for the node cache ({len(bad)} of {len(missing)})")
        shard = self.src.shard_of[missing]
        offs = rows[:, IndexLayout.REC_OFF]
        for k in range(len(missing)):      # one pwrite per record (a batch's, no more)
            fd = self._fd(int(shard[k]))
            a, n = int(dst[k]), int(lens[k])
            os.pwrite(fd, buf[a:a + n].data, int(offs[k]))
        self._present[missing] = 1          # after the bytes: a reader never sees less
        self._checked[missing] = True
        return True

    def ensure_all(self, ids: np.ndarray, progress: Optional[Any] = None) -> bool:
        """:meth:`ensure` of many samples (a preload's chunk), in pieces of about
        :data:`PIECE_BYTES` of records (what is read from the source is held in memory
        until it is written); False as soon as the cap leaves a piece out."""
        lens = self.src.record_nbytes[ids]
        cut = np.searchsorted(np.cumsum(lens), np.arange(PIECE_BYTES, int(lens.sum()),
                                                         PIECE_BYTES), side="right")
        first = 0
        for end in np.unique(np.append(cut[cut > 0], len(ids))).tolist():
            if not self.ensure(ids[first:end]):
                return False
            if progress is not None:
                progress.update(int(lens[first:end].sum()))
            first = end
        return True

    def _fd(self, k: int) -> int:
        fd = self._fds.get(k)
        if fd is None:
            fd = self._fds[k] = os.open(self.dir / self.src.manifest.shards[k].data, os.O_WRONLY)
        return fd

    def stats(self) -> dict[str, Any]:
        return {"node_cache_hits": self.hits, "node_cache_misses": self.misses,
                "node_cache_full": self.full}

    def describe(self) -> str:
        return (f"node cache {self.dir}: {int(np.count_nonzero(self._present)):,} of "
                f"{len(self.src):,} samples, cap {human_bytes(self.cap_bytes)}")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if isinstance(self._present, np.memmap):
            self._present.flush()
        try:
            _write_meta(self.dir, last_used=time.time())
        except OSError:
            pass
        self._inuse.release()


def node_cache_key(ds: PackedDataset) -> str:
    """The key of a dataset's cached copy: its first generation's fingerprint, the same
    in every later generation (so a dataset that grows keeps its copy), another for a
    dataset written again."""
    first = generations(ds.manifest)[0]
    count, k = 0, 0
    while count < first and k < len(ds.manifest.shards):
        count += ds.manifest.shards[k].num_samples
        k += 1
    return prefix_fingerprint(ds.manifest.shards[:k])


def node_cache_root(root: "str | os.PathLike[str] | None" = None) -> Optional[Path]:
    """A store's ``node_cache=``, else ``FOREBAY_NODE_CACHE`` (unset: no cache); every
    kind of store reads through it (the loader's ``"auto"`` becomes direct with it)."""
    if root is None:
        root = os.environ.get(NODE_CACHE_ENV) or None
    return None if root is None else Path(root)

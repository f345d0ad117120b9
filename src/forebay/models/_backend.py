"""Key-value backends of the model repository: LMDB in a directory, or process memory.

Five tables: ``tensors`` (content hash -> raw bytes), ``sizes`` (content hash -> its
byte count, 8 bytes little-endian: which tensors exist and how big they are, readable
without touching the tensors), ``versions`` (name and version -> manifest JSON),
``pending`` (saves whose tensors are written but whose manifest is not yet: garbage
collection spares them for a grace period) and ``locs`` (content hash -> file offset of
its bytes in data.mdb, 8 bytes little-endian, for tensors LMDB keeps in pages of their
own: any save that uses a stored tensor, whichever model stored it, records where it
is without reading it).  Writes happen in transactions: all or
nothing.  py-lmdb reads every page of a value whenever it positions on it (get, a
cursor, an iteration), so existence checks, sizes, statistics and garbage collection go
through ``sizes``; a store written before that table existed gets it on first open.
"""

from __future__ import annotations

import contextlib
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Iterator, Optional

from .._fs import network_fs
from ..errors import ModelRepositoryError

#: what LMDB's lock file takes with its default 126 reader slots (allocated up front)
LOCK_FILE_BYTES = 8192
#: room a write needs beyond its values: LMDB's B-tree, meta and free-list pages
FREE_MARGIN = 256 << 10

__all__ = ["Backend", "LmdbBackend", "MemoryBackend", "TABLES"]

TABLES = ("tensors", "sizes", "versions", "pending", "locs")
#: address space LMDB maps for a store (it allocates nothing: pages come from the file)
DEFAULT_MAP_SIZE = 1 << 40
MAP_SIZE_ENV = "FOREBAY_LMDB_MAP_SIZE"
#: tables every forebay repository has had since the first release
_FIRST_TABLES = ("tensors", "versions")
_ADVICE = {"normal": 0, "random": 1}   # MADV_NORMAL, MADV_RANDOM (Linux and BSDs)
_MADV_HUGEPAGE = 14                     # Linux
_HUGE = 2 << 20
_MADVISE: Any = False


def prefer_huge_pages(address: int, nbytes: int) -> None:
    """Ask Linux to back the 2 MiB-aligned inside of fresh memory at ``address`` with
    transparent huge pages when it is first touched (where THP is in ``madvise`` mode,
    the usual default): one fault per 2 MiB instead of 512.  numpy does this for its
    large arrays; torch.empty does not, so a load into new tensors page-faulted at half
    the speed of h5py's reads into numpy arrays.  A no-op elsewhere."""
    import sys

    lo = (address + _HUGE - 1) & ~(_HUGE - 1)
    hi = (address + nbytes) & ~(_HUGE - 1)
    if hi <= lo or not sys.platform.startswith("linux"):
        return
    fn = LmdbBackend._madvise()
    if fn is not None:
        fn(lo, hi - lo, _MADV_HUGEPAGE)


SHARED_FS_ENV = "FOREBAY_LMDB_SHARED_FS"   # "1": the user vouches only one node opens it


def check_local_fs(path: "str | Path") -> None:
    """Refuse an LMDB store on a file system shared between nodes, unless the user
    vouches (``FOREBAY_LMDB_SHARED_FS=1``) that one node only opens it."""
    fs = network_fs(path)
    if fs is not None and os.environ.get(SHARED_FS_ENV) != "1":
        raise ModelRepositoryError(
            f"{path} is on {fs}, a file system shared between nodes: LMDB's locks "
            f"do not hold across nodes, so processes on two nodes writing it would "
            f"corrupt the store. Open it from one node only (for example a `forebay "
            f"models serve` provider that the other nodes reach with tcp:// URLs) and "
            f"set {SHARED_FS_ENV}=1 to say so")


class Txn:
    """What a transaction offers: get (a buffer valid inside the transaction), put
    (``overwrite=False`` keeps an existing value), delete, and prefix scans."""

    def get(self, table: str, key: bytes) -> Optional[Any]:
        raise NotImplementedError

    def has(self, table: str, key: bytes) -> bool:
        """Whether ``key`` is stored (on LMDB this reads the value: ask small tables)."""
        return self.get(table, key) is not None

    def put(self, table: str, key: bytes, value: Any, overwrite: bool = True,
            owned: bool = False) -> bool:
        """Store ``value`` (``owned``: the caller gives the buffer away and never touches
        it again, so a memory store keeps it instead of a copy)."""
        raise NotImplementedError

    def delete(self, table: str, key: bytes) -> bool:
        raise NotImplementedError

    def items(self, table: str, prefix: bytes = b"", values: bool = True) -> Iterator[tuple]:
        raise NotImplementedError


class Backend:
    """Where a :class:`~forebay.models.Repository` keeps its tables.  Abilities beyond
    transactions are declared, not probed: ``file_locations`` says that values live at
    stable offsets of one data file (:attr:`data_file`), so :meth:`locate`,
    :meth:`data_fd` and :meth:`copy_compacted` work."""

    url: str
    #: values have stable offsets in :attr:`data_file` (LMDB's overflow pages)
    file_locations: ClassVar[bool] = False
    #: the one file holding every value (None: not a file-backed store)
    data_file: Optional[Path] = None

    def read(self) -> Any:  # context manager yielding a Txn
        raise NotImplementedError

    def write(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def advise(self, pattern: str) -> Any:
        """A context manager under which reads follow ``pattern`` ("random" or
        "normal"); nothing to advise by default."""
        return contextlib.nullcontext()

    def locate(self, keys: list[bytes]) -> list[Optional[int]]:
        """File offsets of the values of ``keys`` (``file_locations`` stores only)."""
        raise ModelRepositoryError(f"{self.url}: this store records no file locations")

    def data_fd(self, reader: int = 0) -> Optional[int]:
        """A descriptor of :attr:`data_file` for positioned reads (None: read by key)."""
        return None

    def copy_compacted(self, dest: "str | os.PathLike[str]") -> Path:
        """A copy of the store at ``dest`` without free pages (``file_locations``)."""
        raise ModelRepositoryError(f"{self.url}: only LMDB stores can be compacted")


class _LmdbTxn(Txn):
    def __init__(self, txn: Any, dbs: dict[str, Any]) -> None:
        self.txn, self.dbs = txn, dbs
        #: bytes of the values put (what a commit writes, B-tree pages aside)
        self.written = 0

    def get(self, table, key):
        return self.txn.get(key, db=self.dbs[table])

    def put(self, table, key, value, overwrite=True, owned=False):
        self.written += len(key) + (value.nbytes if isinstance(value, memoryview)
                                    else len(value))
        return self.txn.put(key, value, db=self.dbs[table], overwrite=overwrite)

    def delete(self, table, key):
        return self.txn.delete(key, db=self.dbs[table])

    def items(self, table, prefix=b"", values=True):
        cur = self.txn.cursor(db=self.dbs[table])
        if not cur.set_range(prefix):
            return
        for k, v in cur:
            k = bytes(k)
            if not k.startswith(prefix):
                return
            yield (k, v) if values else (k, None)


class LmdbBackend(Backend):
    file_locations = True
    data_file: Path

    """One LMDB environment in ``path`` (a directory): concurrent readers, one writer at
    a time across processes, durable commits.  Repositories opened on the same path in
    one process share the environment (LMDB allows one per process)."""

    _open: dict[str, list] = {}  # resolved path -> [env, dbs, users]
    _open_lock = threading.Lock()

    def __init__(self, path: "str | Path", *, create: bool = True,
                 map_size: Optional[int] = None) -> None:
        self.path = Path(path)
        if str(self.path.resolve()) not in self._open:   # (checked when first opened)
            check_local_fs(self.path)
        made = False
        if not self.path.exists():
            if not create:
                raise ModelRepositoryError(f"{self.path}: no model repository here")
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)  # others may race us
            made = True
        elif not self.path.is_dir():
            raise ModelRepositoryError(f"{self.path}: not a directory")
        self.key = str(self.path.resolve())
        self.data_file = self.path / "data.mdb"   # where LMDB keeps every table
        if not create and not self.data_file.is_file():
            # opening to read must not turn a directory into a repository
            raise ModelRepositoryError(f"{self.path}: not a model repository (no data.mdb)")
        self.url = f"file://{self.key}"
        self.closed = False
        with self._open_lock:
            entry = self._open.get(self.key)
            if entry is None:
                if create and not self.data_file.exists():
                    self._reserve(made)
                env = self._open_env(map_size)
                if not create:
                    with env.begin() as txn:
                        missing = [t for t in _FIRST_TABLES if txn.get(t.encode()) is None]
                    if missing:
                        env.close()
                        raise ModelRepositoryError(
                            f"{self.path}: an LMDB store but not a forebay model repository "
                            f"(no {', '.join(missing)} table)")
                entry = self._open[self.key] = [env, {t: env.open_db(t.encode())
                                                      for t in TABLES}, 0]
                self.env, self.dbs = env, entry[1]
                self._index_sizes()
            entry[2] += 1
        self.env, self.dbs = entry[0], entry[1]

    def _reserve(self, made: bool) -> None:
        """Before LMDB creates a store: its lock file allocated here (LMDB maps it and
        writes through the map: on a full file system that was SIGBUS, a dead process
        and a lock.mdb left behind) and room for its first pages checked; on failure
        what was made is removed and the error says "need X, Y free in Z"."""
        lock = self.path / "lock.mdb"
        fresh = not lock.exists()
        full = self._full(0)
        try:
            if full is None and fresh:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    os.posix_fallocate(fd, 0, LOCK_FILE_BYTES)
                finally:
                    os.close(fd)
        except OSError as e:
            full = self._full(LOCK_FILE_BYTES) or f"cannot allocate its lock file ({e})"
        if full is None:
            return
        if fresh:
            lock.unlink(missing_ok=True)
        if made:
            with contextlib.suppress(OSError):
                self.path.rmdir()
        raise ModelRepositoryError(f"{self.path}: cannot create a model repository: {full}")

    def _open_env(self, map_size: Optional[int]) -> Any:
        """The LMDB environment, mapped with ``map_size`` bytes of address space (default
        ``FOREBAY_LMDB_MAP_SIZE`` or 1 TiB: address space only, nothing is allocated).
        Where a limit on virtual memory (``ulimit -v``) refuses that, smaller maps are
        tried down to twice the data file; past that the error says what to set."""
        import lmdb

        from .._units import parse_size

        if map_size is None:
            env_size = os.environ.get(MAP_SIZE_ENV)
            map_size = parse_size(env_size) if env_size else DEFAULT_MAP_SIZE
        have = self.data_file.stat().st_size if self.data_file.exists() else 0
        floor = max(2 * have, 64 << 20)
        size, last = int(map_size), None
        while True:
            try:
                # readahead on: values are whole tensors read front to back, and
                # py-lmdb touches every page of a value inside get() (its "preload",
                # with the GIL released), so advice after get() comes too late; off,
                # a cold 100 MB load ran at 35 MB/s here instead of 0.9 GB/s)
                return lmdb.open(self.key, map_size=size, max_dbs=len(TABLES), mode=0o600,
                                 subdir=True, readahead=True, sync=True, metasync=True)
            except lmdb.Error as e:
                last = e
                if "allocate memory" not in str(e) or size // 2 < floor:
                    break
                size //= 2
        hint = (f"; this process may map at most what `ulimit -v` allows: set "
                f"{MAP_SIZE_ENV} (for example 64GiB, more than the store will hold) or "
                f"raise the limit" if last is not None and "allocate memory" in str(last)
                else "")
        raise ModelRepositoryError(f"{self.path}: cannot open the LMDB store: {last}"
                                   f"{hint}") from last

    def _index_sizes(self) -> None:
        """Fill ``sizes`` for tensors stored before the table existed (one pass that
        reads them all, once per store)."""
        with self.env.begin(buffers=True) as txn:
            have = txn.stat(self.dbs["sizes"])["entries"]
            want = txn.stat(self.dbs["tensors"])["entries"]
        if have >= want:
            return
        with self.env.begin(write=True, buffers=True) as txn:
            for k, v in txn.cursor(db=self.dbs["tensors"]):
                txn.put(bytes(k), len(v).to_bytes(8, "little"), db=self.dbs["sizes"])

    @contextmanager
    def read(self):
        with self.env.begin(buffers=True) as txn:
            yield _LmdbTxn(txn, self.dbs)

    # -- reading large values with pread instead of through the map ---------------------
    def _map_base(self) -> Optional[int]:
        """Where this process mapped data.mdb (Linux: /proc/self/maps), or None; found
        once (LMDB keeps its map where it is while the environment is open)."""
        if not hasattr(self, "_base"):
            self._base = self._find_map_base()
        return self._base

    def _find_map_base(self) -> Optional[int]:
        path = os.path.realpath(self.data_file)
        try:
            with open("/proc/self/maps") as fh:
                for line in fh:
                    parts = line.split()
                    if len(parts) >= 6 and parts[5] == path and int(parts[2], 16) == 0:
                        return int(parts[0].split("-")[0], 16)
        except OSError:
            pass
        return None

    def locate(self, keys: list[bytes]) -> list[Optional[int]]:
        """File offsets in data.mdb of the values of ``keys`` in ``tensors`` (None where
        unknown).  Call right after writing them: finding a value reads it (py-lmdb),
        cheap while its pages are still cached.  A stored value's pages never move
        while the value exists (LMDB copies the pages that point to it, not its own)."""
        base = self._map_base()
        if base is None:
            return [None] * len(keys)
        size = os.path.getsize(self.data_file)
        out: list[Optional[int]] = []
        with self.read() as txn:
            for k in keys:
                buf = txn.get("tensors", k)
                off = None
                if buf is not None and len(buf):
                    import numpy as np

                    off = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) - base
                    if not 0 < off <= size - len(buf):
                        off = None
                out.append(off)
        return out

    @contextmanager
    def advise(self, pattern: str):
        """madvise the whole map ``"random"`` (a cold fault reads its page, not the
        device's read-ahead window around it: for B-tree pages, manifests and small
        values) or ``"normal"`` for the block, restoring the previous advice after."""
        base = self._map_base() if self._madvise() is not None else None
        if base is None:
            yield
            return
        prev = getattr(self, "_advice", "normal")
        if not hasattr(self, "_map_size"):
            self._map_size = self.env.info()["map_size"]
        size = self._map_size
        self._madvise()(base, size, _ADVICE[pattern])
        self._advice = pattern
        try:
            yield
        finally:
            self._madvise()(base, size, _ADVICE[prev])
            self._advice = prev

    @staticmethod
    def _madvise() -> Any:
        global _MADVISE
        if _MADVISE is False:
            import ctypes
            import ctypes.util

            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                fn = libc.madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _MADVISE = fn
            except (OSError, AttributeError):
                _MADVISE = None
        return _MADVISE

    def data_fd(self, reader: int = 0) -> Optional[int]:
        """A read-only descriptor of data.mdb for :func:`os.preadv`, one per concurrent
        ``reader`` (0 or 1) in this process: the kernel keeps read-ahead state per open
        file, and two threads reading different tensors through one descriptor look
        like random access to it, which switches read-ahead off."""
        entry = self._open.get(self.key)
        if entry is None or not hasattr(os, "preadv"):   # (a store made on Linux, read
            return None                                   # where there is no preadv)
        if len(entry) < 4:
            with self._open_lock:
                if len(entry) < 4:
                    entry.append([os.open(self.data_file, os.O_RDONLY)
                                  for _ in range(2)])
        return entry[3][reader]

    @contextmanager
    def write(self):
        import lmdb

        t: Optional[_LmdbTxn] = None
        try:
            with self.env.begin(write=True, buffers=True) as txn:
                t = _LmdbTxn(txn, self.dbs)
                yield t
        except lmdb.Error as e:
            # a commit the file system had no room for: LMDB reports the short write as
            # "Input/output error"; nothing of the transaction is stored, what was
            # stored before is intact (LMDB writes new pages, then the meta page)
            full = self._full(t.written if t is not None else 0)
            if full is None:
                raise
            raise ModelRepositoryError(f"{self.path}: {full}; nothing of this write was "
                                       f"stored ({e})") from e

    def _full(self, need: int) -> Optional[str]:
        """"need X, Y free in Z" when the file system holding the store has less room
        than ``need`` bytes plus a margin for LMDB's own pages (None: it has room)."""
        import shutil

        from .._units import human_bytes

        free = shutil.disk_usage(self.path).free
        if free >= need + FREE_MARGIN:
            return None
        return (f"the file system is full: need about {human_bytes(need + FREE_MARGIN)}, "
                f"{human_bytes(free)} free in {self.path}")

    def copy_compacted(self, dest: "str | os.PathLike[str]") -> Path:
        """A consistent copy of the store in ``dest`` (a new or empty directory) without
        its free pages (``mdb_copy -c``); readers and writers may go on meanwhile."""
        import lmdb

        dest = Path(dest)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise ModelRepositoryError(f"{dest}: not a new or empty directory; a compacted "
                                       f"copy is written to one")
        if dest.resolve() == self.path.resolve():
            raise ModelRepositoryError(f"{dest}: compact into another directory")
        check_local_fs(dest)
        dest.mkdir(parents=True, exist_ok=True)
        try:
            self.env.copy(str(dest), compact=True)
        except lmdb.Error as e:
            raise ModelRepositoryError(f"{self.path}: compacted copy to {dest} failed: "
                                       f"{e}") from e
        return dest

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with self._open_lock:
            entry = self._open[self.key]
            entry[2] -= 1
            if entry[2] == 0:
                del self._open[self.key]
                for fd in (entry[3] if len(entry) > 3 else []):
                    os.close(fd)
                self.env.close()


class _MemTxn(Txn):
    def __init__(self, tables: dict[str, dict[bytes, Any]], write: bool) -> None:
        self.tables = tables
        self.staged: dict[tuple[str, bytes], Optional[Any]] = {}
        self.writable = write

    def get(self, table, key):
        if (table, key) in self.staged:
            v = self.staged[(table, key)]
            return None if v is None else memoryview(v)
        v = self.tables[table].get(key)
        return None if v is None else memoryview(v)

    def put(self, table, key, value, overwrite=True, owned=False):
        if not overwrite and self.get(table, key) is not None:
            return False
        self.staged[(table, bytes(key))] = value if owned else bytes(value)
        return True

    def delete(self, table, key):
        found = self.get(table, key) is not None
        self.staged[(table, bytes(key))] = None
        return found

    def items(self, table, prefix=b"", values=True):
        keys = {k for k in self.tables[table] if k.startswith(prefix)}
        keys |= {k for (t, k) in self.staged if t == table and k.startswith(prefix)}
        for k in sorted(keys):
            v = self.get(table, k)
            if v is not None:
                yield (k, v) if values else (k, None)


class MemoryBackend(Backend):
    """Tables in this process's memory (tests, ephemeral ensembles); ``memory://NAME``
    opens the same one again within the process."""

    _named: dict[str, "MemoryBackend"] = {}

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        self.tables: dict[str, dict[bytes, bytes]] = {t: {} for t in TABLES}
        self.lock = threading.RLock()

    @classmethod
    def named(cls, name: str) -> "MemoryBackend":
        if not name:
            return cls()
        if name not in cls._named:
            cls._named[name] = cls(name)
        return cls._named[name]

    @contextmanager
    def read(self):
        with self.lock:
            yield _MemTxn(self.tables, False)

    @contextmanager
    def write(self):
        with self.lock:
            txn = _MemTxn(self.tables, True)
            yield txn
            for (t, k), v in txn.staged.items():  # commit: only if the body returned
                if v is None:
                    self.tables[t].pop(k, None)
                else:
                    self.tables[t][k] = v

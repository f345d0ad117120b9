"""The dataset's files at the system-call level: maps and descriptors opened with clear
errors (a process out of descriptors is told what to do), ranges read with one
``preadv`` each, pages populated and checked for residence (``mincore``)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from typing import Any, Iterator

import numpy as np

from ..errors import InvalidArgumentError, TruncatedShardError, UsageError
from .._intervals import merge_intervals
from ._batch import _native

__all__ = ["map_file", "open_checked", "close_all", "pread_ranges", "populate_ranges",
           "resident", "named_fd_limit"]

_PAGE = mmap.PAGESIZE


def _load_mincore() -> Any:
    try:
        f = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    f.restype = ctypes.c_int
    return f


_mincore = _load_mincore()


def resident(buf: np.ndarray, start: int, length: int) -> bool:
    """Whether every page of ``buf[start:start + length]`` (a read-only file map,
    ``start`` page-aligned) is in the page cache (mincore); False where unknown."""
    if _mincore is None or length <= 0:
        return False
    vec = np.zeros(-(-length // _PAGE), dtype=np.uint8)
    if _mincore(buf.ctypes.data + start, length, vec.ctypes.data) != 0:
        return False
    return bool((vec & 1).all())


@contextlib.contextmanager
def named_fd_limit(path: str) -> Iterator[None]:
    """EMFILE (this process at its RLIMIT_NOFILE) as an error that says what to do."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.EMFILE:
            raise
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise UsageError(f"{path}: this process has as many files open as it may "
                         f"(RLIMIT_NOFILE {soft}): a dataset keeps each shard it reads "
                         f"open (a descriptor for its map; another for read_records); "
                         f"raise `ulimit -n`, or write fewer, larger shards "
                         f"(shard_bytes)") from e


def open_checked(path: str, want: int) -> int:
    """Shard file ``path`` opened for reading (a descriptor), after checking its size is
    the manifest's ``want`` bytes."""
    with named_fd_limit(path):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    size = os.fstat(fd).st_size
    if size != want:
        os.close(fd)
        raise TruncatedShardError(f"{path}: {size} bytes on disk, the manifest records "
                                  f"{want}")
    return fd


def close_all(fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


def map_file(path: str, want: int) -> mmap.mmap:
    """Shard file ``path`` mapped read-only, after checking its size is the manifest's
    ``want`` bytes (a shorter file would fault the reader with SIGBUS)."""
    fd = open_checked(path, want)
    try:
        with named_fd_limit(path):     # (mmap keeps a descriptor of its own)
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def pread_ranges(fd: int, offsets: np.ndarray, lens: np.ndarray, out: np.ndarray,
                  dst: np.ndarray) -> int:
    """``out[dst[k]:+lens[k]]`` = bytes ``[offsets[k], +lens[k])`` of file ``fd`` for
    every k (int64 arrays), with pread; how many ranges were read whole (fewer: the
    file ended inside the next one).  forebay's C kernel reads them all without the
    GIL; without it, one ``os.preadv`` per range."""
    if _native is not None and hasattr(_native, "pread_ranges"):
        return int(_native.pread_ranges(fd, offsets, lens, out, dst))
    view = out.data.cast("B")
    for k, (o, n, d) in enumerate(zip(offsets.tolist(), lens.tolist(), dst.tolist())):
        if d < 0 or n < 0 or o < 0 or d + n > len(view):
            raise InvalidArgumentError(f"range {k} out of bounds: out[{d}:+{n}] of {len(view)}")
        got = 0
        while got < n:
            r = os.preadv(fd, [view[d + got:d + n]], o + got)
            if r == 0:
                return k
            got += r
    return len(offsets)


def populate_ranges(m: np.ndarray, path: str, starts: np.ndarray, ends: np.ndarray) -> None:
    """Map byte ranges [starts, ends) of shard map ``m`` (file ``path``) in now
    (MADV_POPULATE_READ; forebay's C kernel); a range the file cannot give (an I/O
    error, a file that shrank after it was mapped) raises :class:`TruncatedShardError`
    instead of SIGBUS at its first read."""
    # whole pages, ranges that touch one call (a call per record cost a system call
    # each: millions for a dataset of small records)
    a, b = merge_intervals((np.asarray(starts, dtype=np.int64) // _PAGE) * _PAGE,
                           np.minimum(-(-np.asarray(ends, dtype=np.int64) // _PAGE) * _PAGE,
                                      len(m)))
    failed = _native.populate(m, a, b)
    if failed:
        size = os.stat(path).st_size
        raise TruncatedShardError(
            f"{path}: {failed} record range(s) could not be read (the file has {size} "
            f"bytes, its map {len(m)}: it changed after it was opened, or the device "
            f"failed)")

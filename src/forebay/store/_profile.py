"""Machine profiles for the performance model: measured by ``forebay calibrate``, stored
as TOML, validated on load (unknown keys and nonsense bandwidths are errors)."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from ..errors import ForebayError

if TYPE_CHECKING:
    from ..progress import Progress

__all__ = ["ProfileError", "load_profile", "dump_profile", "calibrate", "SCHEMA"]


class ProfileError(ForebayError, ValueError):
    """A profile (system file) has unknown keys, missing keys or impossible values."""


#: section -> key -> kind ("bw": {threads or readers: MB/s} or MB/s; "str"; "num")
SCHEMA: dict[str, dict[str, str]] = {
    "machine": {"description": "str", "date": "str"},
    "ram": {"copy_MBps": "bw"},
    "ssd": {"path": "str", "write_MBps": "bw", "read_MBps": "bw"},
    # open_ms: latency of opening one file (the simulator's --layout files)
    # client_MBps: b_fs, one client's link to the PFS (the simulator caps a read there)
    # stream_MBps: t(k) of large sequential requests (a preload's chunks), where
    # read_MBps is of one request per record: what a file system's per-request cost
    # takes is the difference
    # read_fraction: the share of the dataset's records read_MBps's random reads covered;
    # dense_MBps: t(k) reading every record of a contiguous range (in random order), where
    # the pages a record's request brings in beyond it hold records read next
    "pfs": {"path": "str", "read_MBps": "bw", "record_bytes": "num", "open_ms": "num0",
            "client_MBps": "num", "stream_MBps": "bw", "read_fraction": "frac",
            "dense_MBps": "bw"},
    "rma": {"get_MBps": "bw", "ranks": "num"},
    # tier settings for the clairvoyant loader (DataLoader(system=...)); sizes in bytes
    # or as "8GiB"; 0 disables a tier
    "tiers": {"ram_bytes": "size", "ssd_dir": "str", "ssd_bytes": "size",
              "staging_bytes": "size", "prefetch": "count",
              # threads per tier (NoPFS's p_0, p_1, p_2): ram_threads and ssd_threads
              # fill the clairvoyant loader's tiers; staging_threads is the simulator's
              "staging_threads": "count", "ram_threads": "count", "ssd_threads": "count"},
    # the simulator's workload and network figures (forebay simulate; NoPFS Sec. 4):
    # training throughput c and preprocessing rate beta in MB/s per worker, network b_c;
    # cpus: a node's cores, shared by its prefetch threads; handback_MBps: the training
    # process taking batches back from worker processes, on one core
    "compute": {"MBps": "num", "preprocess_MBps": "num", "cpus": "num",
                "handback_MBps": "num"},
    "network": {"MBps": "num"},
    # the simulator's model choices (docs/sim.md): how PFS readers are counted and
    # whether a tier's table is shared by its threads or the speed of each read
    "model": {"model": "str", "pfs_readers": "str", "tier_reads": "str"},
}


def _check_size(where: str, value: Any) -> int:
    if isinstance(value, str):
        from .._units import parse_size

        try:
            return parse_size(value) if value.strip() not in ("0", "0B") else 0
        except Exception:
            raise ProfileError(f"{where} = {value!r}: not a size (try 8GiB, 512MiB, "
                               f"65536)") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProfileError(f"{where} = {value!r}: a size is a non-negative integer of bytes "
                           f"or a string such as \"8GiB\"")
    return value


def _check_bw(where: str, value: Any) -> dict[int, float]:
    table = value if isinstance(value, dict) else {"1": value}
    out = {}
    for k, v in table.items():
        try:
            n = int(k)
        except (TypeError, ValueError):
            raise ProfileError(f"{where}: key {k!r} must be a thread or reader count") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) \
                or v <= 0 or v > 1e7:
            raise ProfileError(f"{where}[{k}] = {v!r}: a bandwidth must be a number of MB/s "
                               f"in (0, 1e7]")
        if n <= 0:
            raise ProfileError(f"{where}: count {n} must be positive")
        out[n] = float(v)
    return out


def load_profile(path: "str | os.PathLike[str]") -> dict[str, Any]:
    """Read and validate a TOML profile; bandwidth tables come back as {count: MB/s}."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path}: not valid TOML ({e})") from None
    out: dict[str, Any] = {}
    for section, body in doc.items():
        if section not in SCHEMA:
            raise ProfileError(f"{path}: unknown section [{section}] (known: "
                               f"{', '.join(SCHEMA)})")
        if not isinstance(body, dict):
            raise ProfileError(f"{path}: [{section}] must be a table")
        out[section] = {}
        for key, value in body.items():
            kind = SCHEMA[section].get(key)
            where = f"{path}: [{section}] {key}"
            if kind is None:
                raise ProfileError(f"{path}: unknown key {key!r} in [{section}] (known: "
                                   f"{', '.join(SCHEMA[section])})")
            if kind == "bw":
                out[section][key] = _check_bw(where, value)
            elif kind == "size":
                out[section][key] = _check_size(where, value)
            elif kind == "count":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ProfileError(f"{where} = {value!r}: must be a non-negative integer")
                out[section][key] = value
            elif kind == "frac":
                if isinstance(value, bool) or not isinstance(value, (int, float)) \
                        or not 0 < value <= 1:
                    raise ProfileError(f"{where} = {value!r}: must be a fraction in (0, 1]")
                out[section][key] = float(value)
            elif kind in ("num", "num0"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) \
                        or not np.isfinite(value) or value < 0 or (kind == "num" and value == 0):
                    raise ProfileError(f"{where} = {value!r}: must be a "
                                       f"{'positive' if kind == 'num' else 'non-negative'} "
                                       f"number")
                out[section][key] = value
            else:
                out[section][key] = str(value)
    return out


def dump_profile(profile: dict[str, Any]) -> str:
    """TOML text of a profile (the subset of TOML profiles use)."""
    lines = []
    for section, body in profile.items():
        lines.append(f"[{section}]")
        for key, value in body.items():
            if isinstance(value, dict):
                inner = ", ".join(f'"{k}" = {v:.1f}' for k, v in sorted(value.items()))
                lines.append(f"{key} = {{ {inner} }}")
            elif isinstance(value, str):
                lines.append(f'{key} = "{value}"')
            else:
                lines.append(f"{key} = {value}")
        lines.append("")
    return "\n".join(lines)


def _threaded(fn, threads: int) -> float:
    """Run fn(k) on ``threads`` threads at once; seconds for all of them."""
    ts = [threading.Thread(target=fn, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def _ram(threads: list[int], nbytes: int) -> dict[int, float]:
    from ..dataset import gather_ranges

    src = np.ones(nbytes, dtype=np.uint8)
    out = {}
    for n in threads:
        dsts = [np.empty(nbytes // n, dtype=np.uint8) for _ in range(n)]

        def copy(k, dsts=dsts):
            d = dsts[k]
            gather_ranges(src, np.array([k * len(d)]), np.array([len(d)]), d, np.array([0]))
        for k in range(n):  # fault the pages in before timing
            copy(k)
        out[n] = nbytes / _threaded(copy, n) / 1e6
    return out


def _ssd(path: Path, nbytes: int) -> tuple[dict[int, float], dict[int, float]]:
    import uuid

    f = path / f".forebay-calibrate-{uuid.uuid4().hex[:12]}"
    block = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    try:
        t0 = time.perf_counter()
        with open(f, "wb", buffering=0) as fh:
            for _ in range(nbytes // len(block)):
                fh.write(block)
            os.fsync(fh.fileno())
        w = nbytes / (time.perf_counter() - t0) / 1e6
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while os.read(fd, 8 << 20):
                pass
            r = nbytes / (time.perf_counter() - t0) / 1e6
        finally:
            os.close(fd)
    finally:
        f.unlink(missing_ok=True)
    return {1: w}, {1: r}


#: bytes read per reader count when measuring the parallel file system (or the dataset)
PFS_BYTES = 256 << 20


def _evict(files: list[Path]) -> None:
    """Drop the files' pages from this node's page cache: the next read is cold."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _pfs(dataset: Path, readers: list[int], samples: int, pfs_bytes: int = 0,
         progress: Optional["Progress"] = None
         ) -> tuple[dict[int, float], dict[int, float], float, float, list[Path]]:
    """Cold random reads of the dataset's samples per reader count: (MB/s by readers
    of a random subset of the records, the same of every record of a contiguous range
    ({} when the subset is every record), the subset's share of the records, the mean
    sample's bytes, the shard files)."""
    from ..dataset import open_dataset

    ds = open_dataset(dataset)
    files = [dataset / s.data for s in ds.manifest.shards]
    rng = np.random.default_rng(0)
    # the same bytes at every reader count, split between the readers: at least
    # ``samples`` samples and ``pfs_bytes`` (or the whole dataset), so that a file
    # system's bursts and first requests do not decide the figure
    want = min(len(ds), max(samples, int(np.ceil(
        (pfs_bytes or PFS_BYTES) / max(float(ds.sample_nbytes.mean()), 1.0)))))

    def timed(ids: np.ndarray, n: int) -> float:
        _evict(files)
        parts = np.array_split(ids, n)
        nbytes = int(ds.sample_nbytes[ids].sum())
        fresh = open_dataset(dataset)

        def read(k, parts=parts, fresh=fresh):
            for a in range(0, len(parts[k]), 64):
                fresh.get_many(parts[k][a:a + 64])
        mbps = nbytes / _threaded(read, n) / 1e6
        # unmap before the next eviction: pages an open map holds stay cached
        del read, fresh
        gc.collect()
        if progress is not None:
            progress.update(1)
        return mbps

    # a record's request brings in pages beyond it (its neighbours' parts): wasted when
    # the neighbours are not read, read already when they are.  The random subset is
    # the sparse case, every record of one range (shuffled) the dense one: the
    # simulator interpolates between them by the share of the records a node reads
    sparse = {n: timed(rng.permutation(len(ds))[:want], n) for n in readers}
    start = int(rng.integers(0, len(ds) - want + 1))
    dense = {} if want == len(ds) else \
        {n: timed(start + rng.permutation(want), n) for n in readers}
    if not dense and progress is not None:     # the random reads were every record
        progress.update(len(readers))
    return sparse, dense, want / len(ds), float(ds.sample_nbytes.mean()), files


#: request size of the streaming reads (a preload's chunk is read in requests of the
#: kernel's read-ahead: 128 KiB to a few MiB)
STREAM_REQUEST = 4 << 20


def _pfs_stream(files: list[Path], readers: list[int]) -> dict[int, float]:
    """MB/s of k readers reading the shard ``files`` cold in large sequential requests
    (``STREAM_REQUEST``), each its own contiguous part of the same PFS_BYTES (or all
    of them)."""
    # (file, bytes read of it): the first PFS_BYTES of the shards, in order
    spans, left = [], PFS_BYTES
    for p in files:
        if left <= 0:
            break
        n = min(os.path.getsize(p), left)
        spans.append((p, n))
        left -= n
    total = sum(n for _, n in spans)
    out: dict[int, float] = {}
    for k in readers:
        _evict(files)
        cuts = np.linspace(0, total, k + 1).astype(np.int64)

        def read(j, cuts=cuts):
            lo, hi, at = int(cuts[j]), int(cuts[j + 1]), 0   # this reader's [lo, hi)
            buf = memoryview(bytearray(STREAM_REQUEST))
            for p, n in spans:
                off, end = max(lo, at) - at, min(hi, at + n) - at   # within file p
                if off < end:
                    fd = os.open(p, os.O_RDONLY)
                    try:
                        while off < end:
                            got = os.preadv(fd, [buf[:min(STREAM_REQUEST, end - off)]], off)
                            if got <= 0:
                                break
                            off += got
                    finally:
                        os.close(fd)
                at += n
        out[k] = total / _threaded(read, k) / 1e6
    return out


def _rma(comm: Any, nbytes: int, chunk: int = 64 << 10) -> float:
    """MB/s of rank 0 reading rank 1's window the way the stores read peers
    (:func:`~forebay.store._windows.rma_get`: ``chunk``-sized ranges, one MPI_Get of
    an hindexed type and one flush). Collective over ``comm``."""
    from mpi4py import MPI

    from ._windows import rma_get

    win = MPI.Win.Allocate(nbytes if comm.Get_rank() == 1 else 0, comm=comm)
    try:
        comm.Barrier()
        mbps = 0.0
        if comm.Get_rank() == 0:
            dst = np.empty(nbytes, dtype=np.uint8)
            pos = np.arange(0, nbytes, chunk, dtype=np.int64)
            length = np.minimum(chunk, nbytes - pos)
            target = np.ones(len(pos), dtype=np.int64)
            best = float("inf")
            win.Lock_all()
            for _ in range(3):
                t0 = time.perf_counter()
                rma_get(win, dst, target, pos, length, pos)
                best = min(best, time.perf_counter() - t0)
            win.Unlock_all()
            mbps = nbytes / best / 1e6
        comm.Barrier()
        return comm.bcast(mbps, root=0)
    finally:
        win.Free()


def calibrate(*, ssd_dir: Optional[Path] = None, dataset: Optional[Path] = None,
              threads: Optional[list[int]] = None, ram_bytes: int = 256 << 20,
              ssd_bytes: int = 256 << 20, samples: int = 500, comm: Any = None,
              rma_bytes: int = 64 << 20, pfs_bytes: int = PFS_BYTES,
              progress: "Progress | bool | None" = None) -> dict[str, Any]:
    """Measure this machine: RAM copy bandwidth per thread count, the SSD directory's
    write and cold read bandwidth, cold random reads of a packed dataset (the PFS) per
    reader count (one request per record: ``read_MBps`` of a random ``read_fraction``
    of the records, ``dense_MBps`` of every record of a range of as many) and its files
    read cold in large sequential requests (``stream_MBps``), and, with an MPI
    communicator of 2 or more ranks, one-sided get bandwidth from a peer's memory.
    The dataset's reads take at least ``samples`` records and ``pfs_bytes`` (or all of
    it) per reader count.  ``progress``: a hook (:mod:`forebay.progress`) told each
    measurement as it ends (this rank's: under MPI the dataset is read by rank 0
    alone).  Returns a profile (see :func:`dump_profile`)."""
    import platform

    from ..progress import as_progress

    threads = threads or sorted({1, 2, min(4, os.cpu_count() or 1)})
    reads_pfs = dataset is not None and (comm is None or comm.Get_rank() == 0)
    bar = as_progress(progress)
    # one step a measurement: RAM, SSD, the dataset's random, dense and streamed reads
    # per reader count, the peer's memory
    bar.start(1 + (ssd_dir is not None) + 3 * len(threads) * reads_pfs
              + (comm is not None and comm.Get_size() >= 2), "calibrate", "measurement")
    with bar:
        prof: dict[str, Any] = {"machine": {"description": f"{platform.node()} "
                                            f"{os.cpu_count()} cores {platform.machine()}",
                                            "date": time.strftime("%Y-%m-%d %H:%M")},
                                "ram": {"copy_MBps": _ram(threads, ram_bytes)}}
        bar.update(1)
        if ssd_dir is not None:
            w, r = _ssd(Path(ssd_dir), ssd_bytes)
            prof["ssd"] = {"path": str(ssd_dir), "write_MBps": w, "read_MBps": r}
            bar.update(1)
        if dataset is not None:
            # the file system is shared: under MPI rank 0 alone reads it while the others
            # wait (every rank at once would each see a share of it, not t(k))
            failure: Optional[BaseException] = None
            if comm is None or comm.Get_rank() == 0:
                try:
                    bw, dense, share, rec, files = _pfs(Path(dataset), threads, samples,
                                                        pfs_bytes, bar)
                    prof["pfs"] = {"path": str(dataset), "read_MBps": bw,
                                   "record_bytes": round(rec), "read_fraction": round(share, 4),
                                   "stream_MBps": _pfs_stream(files, threads)}
                    bar.update(len(threads))
                    if dense:
                        prof["pfs"]["dense_MBps"] = dense
                except Exception as e:            # every rank ends, not only rank 0
                    failure = e
            if comm is not None:
                flag = np.array([failure is not None], dtype=np.int32)
                comm.Bcast(flag, root=0)
                if flag[0] and failure is None:
                    raise ForebayError("calibrate: rank 0 could not measure the parallel file "
                                       "system (its error says why)")
            if failure is not None:
                raise failure
        if comm is not None and comm.Get_size() >= 2:
            prof["rma"] = {"get_MBps": {comm.Get_size(): _rma(comm, rma_bytes)},
                           "ranks": comm.Get_size()}
            bar.update(1)
    return prof

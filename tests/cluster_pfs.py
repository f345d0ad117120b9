"""A slow shared file system for the emulated cluster: a directory served read-only
through FUSE, every read paced by one queue of a set bandwidth and request rate.

The block-I/O cgroup that ``benchmarks/_common.py`` throttles with (``blkio`` /
``io.max``) accounts in slices of 20-100 ms and lets a reader that paused catch up
within its slice: a serial reader pausing 20 ms after every 64 files read at 363 MB/s
from a disk capped at 300 (297 without the pauses; RESULTS, "Simulator").  A parallel
file system gives no such credit.  Here every read request waits for its turn on one
virtual clock: it starts when the file system is free (never earlier than it arrives),
holds it for ``size / bandwidth`` (and at least ``1 / iops``), and is answered when that time
comes: the file system never delivers more than its rate over any interval, idle time
is not saved up, and concurrent readers share it in arrival order.  Optional
``latency`` is added to every request (a server's round trip).

The server speaks the kernel's FUSE protocol on ``/dev/fuse`` itself (no libfuse: a
read-only subset, protocol 7.31: lookup, getattr, open, read, readdir, statfs, release)
from threads of the process that made it, and mounts at ``mountpoint`` in this
process's mount namespace: mount it before the emulated nodes are made (their mount
namespaces copy it) and unmount after they are gone.  The kernel's page cache keeps
what was read (pages are kept across opens), so a cold read needs an eviction first
(``posix_fadvise(DONTNEED)``), as on the throttled disk.

One mount is one client, and one page cache: nodes that share it share what any of
them read (the neighbours of a record one node read are cached for the others).  A
cluster's nodes each have a client of their own: ``PacedFS(clients=N + 1)`` mounts N
more clients of the same server (one queue for all), and :meth:`PacedFS.attach` puts
client k + 1 at ``mountpoint`` on node k, so each node's reads fill its own cache;
:meth:`PacedFS.evict` empties every client's.

Needs root and ``/dev/fuse``: :func:`unavailable` says why not.  Used by
``benchmarks/loader/peers_bench.py --fs fuse`` and ``benchmarks/sim/sim_cluster.py``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import errno
import json
import mmap
import os
import resource
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

__all__ = ["PacedFS", "unavailable"]

_IN = struct.Struct("<IIQQIIIHH")          # fuse_in_header
_OUT = struct.Struct("<IiQ")               # fuse_out_header
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr
_ENTRY = struct.Struct("<QQQQII")          # fuse_entry_out, before its attr
_ATTR_OUT = struct.Struct("<QII")          # fuse_attr_out, before its attr
_OPEN_OUT = struct.Struct("<QII")
_READ_IN = struct.Struct("<QQIIQII")
_INIT_IN = struct.Struct("<IIII")
_INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")
_DIRENT = struct.Struct("<QQII")
_STATFS = struct.Struct("<QQQQQIIII24x")

LOOKUP, FORGET, GETATTR, OPEN, READ, STATFS, RELEASE = 1, 2, 3, 14, 15, 17, 18
FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR, ACCESS = 25, 26, 27, 28, 29, 34
INTERRUPT, DESTROY, BATCH_FORGET = 36, 38, 42
_WRITES = {4, 8, 9, 10, 11, 12, 13, 16, 20, 21, 24, 30, 35, 43, 45, 47}   # EROFS
_NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}
_ASYNC_READ, _NO_OPEN, _MAX_PAGES = 1 << 0, 1 << 17, 1 << 22
_KEEP_CACHE = 1 << 1
_MAX_READ = 1 << 20
_TTL = 3600              # seconds the kernel may keep names and attributes


def unavailable() -> Optional[str]:
    """Why a FUSE file system cannot be served here (None: it can)."""
    if os.geteuid() != 0:
        return "serving a FUSE file system needs root (mount)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse here (the kernel's FUSE)"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as e:
        return f"/dev/fuse cannot be opened: {e}"
    return None


class _Clock:
    """One queue of ``mbps`` MB/s and ``iops`` requests/s: when a request of n bytes
    arriving now is served (never earlier than now: idle time is not saved up)."""

    def __init__(self, mbps: float, iops: float, latency: float) -> None:
        self.bps, self.iops, self.latency = mbps * 1e6, iops, latency
        self.free = 0.0
        self.lock = threading.Lock()
        #: (arrival, start, end, bytes) of the last 100,000 requests served, in order
        self.schedule: "collections.deque[tuple[float, float, float, int]]" = \
            collections.deque(maxlen=100_000)

    def done_at(self, nbytes: int) -> float:
        cost = max(nbytes / self.bps if self.bps else 0.0,
                   1.0 / self.iops if self.iops else 0.0)
        with self.lock:
            now = time.monotonic()
            start = max(now, self.free)
            self.free = start + cost
            self.schedule.append((now, start, self.free, nbytes))
            return self.free + self.latency


class PacedFS:
    """``source`` served read-only at ``mountpoint`` through FUSE, its reads paced at
    ``mbps`` MB/s and ``iops`` requests/s (0: unpaced) plus ``latency`` s each, by
    ``threads`` server threads per client in a process of their own (a process that
    faults on a mapped file holds its GIL: a server in it would never answer).  A context manager:
    mounted on entry, unmounted and stopped on exit.  ``served_bytes``: bytes the reads
    returned (what the file system delivered: the page cache's hits never reach it).
    ``clients``: how many mounts (clients, each its own page cache) the server serves,
    the first at ``mountpoint`` (see :meth:`attach`)."""

    def __init__(self, source: "str | os.PathLike[str]", mountpoint: "str | os.PathLike[str]",
                 mbps: float, iops: float = 0, latency: float = 0.0, threads: int = 8,
                 clients: int = 1) -> None:
        if not 1 <= clients <= 65:
            raise ValueError(f"clients must be 1..65, got {clients}")
        self.source = Path(source).resolve()
        self.mountpoint = Path(mountpoint)
        self.mbps, self.iops, self.latency, self.threads = mbps, iops, latency, threads
        self.clients = clients
        self._server: Optional[subprocess.Popen] = None
        self._stats: Optional[Path] = None
        self._schedule: "list[tuple[float, float, float, int]]" = []
        self._final = (0, 0)
        self._cpu = 0.0
        self.error: Optional[str] = None

    @classmethod
    def beside(cls, source: "str | os.PathLike[str]", rate: str,
               clients: int = 1) -> "PacedFS":
        """``source`` served at ``<source>-pfs`` at ``rate``, ``"MBPS[,IOPS]"`` (the
        benchmarks' ``--throttle``, scripts/cluster.py's ``--pfs-rate``)."""
        mbps, _, iops = rate.partition(",")
        src = Path(source).resolve()
        return cls(src, src.with_name(src.name + "-pfs"), float(mbps), float(iops or 0),
                   clients=clients)

    def client_mount(self, k: int) -> Path:
        """Where client ``k`` is mounted in this process's namespace (client 0 at
        ``mountpoint``, the others beside it, hidden)."""
        if not 0 <= k < self.clients:
            raise ValueError(f"client {k}: this file system has {self.clients}")
        return self.mountpoint if k == 0 else \
            self.mountpoint.with_name(f".{self.mountpoint.name}-client{k}")

    def __enter__(self) -> "PacedFS":
        why = unavailable()
        if why:
            raise RuntimeError(why)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        fd, stats = tempfile.mkstemp(prefix="pacedfs-", suffix=".stats")
        os.write(fd, bytes(16))
        os.close(fd)
        self._stats = Path(stats)
        devs: list[int] = []
        try:
            for k in range(self.clients):
                where = self.client_mount(k)
                where.mkdir(parents=True, exist_ok=True)
                devs.append(os.open("/dev/fuse", os.O_RDWR))
                opts = (f"fd={devs[-1]},rootmode=40000,user_id=0,group_id=0,allow_other,"
                        f"max_read={_MAX_READ}")
                if _libc().mount(b"forebay-pfs", str(where).encode(), b"fuse",
                                 ctypes.c_ulong(1 | 2 | 4), opts.encode()) != 0:
                    e = ctypes.get_errno()             # (RDONLY|NOSUID|NODEV)
                    raise OSError(e, f"mount -t fuse at {where}: {os.strerror(e)}")
            self._server = subprocess.Popen(
                [sys.executable, __file__, ",".join(map(str, devs)), str(self.source),
                 repr(self.mbps), repr(self.iops), repr(self.latency), str(self.threads),
                 stats], pass_fds=devs, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except BaseException:
            self._unmount(len(devs))
            raise
        finally:
            for dev in devs:
                os.close(dev)       # the server holds them
        return self

    def _unmount(self, clients: int) -> None:
        # lazily: a process still holding a file of it (a map) gets ENOTCONN once the
        # server's end of /dev/fuse closes (the kernel aborts the connection)
        for k in range(clients):
            _libc().umount2(str(self.client_mount(k)).encode(), 2)     # MNT_DETACH
            if k:
                with contextlib.suppress(OSError):
                    self.client_mount(k).rmdir()

    def attach(self, cluster: Any) -> None:
        """Give each node of ``cluster`` (tests/cluster.py, made after this was mounted)
        a client of its own: node k sees client k + 1 at ``mountpoint``, so what it reads
        fills its own page cache, not the other nodes' nor this process's."""
        if self.clients < cluster.nodes + 1:
            raise ValueError(f"{cluster.nodes} nodes need clients={cluster.nodes + 1} "
                             f"(this file system has {self.clients})")
        for k in range(cluster.nodes):
            r = cluster.run(k, ["mount", "--bind", str(self.client_mount(k + 1)),
                                str(self.mountpoint)], cwd="/")
            if r.returncode:
                raise RuntimeError(f"node {k}: client {k + 1} not mounted: {r.stderr}")

    def evict(self, paths: "Iterable[str | os.PathLike[str]]") -> int:
        """Drop the files ``paths`` (under ``mountpoint``) from every client's page
        cache (``posix_fadvise(DONTNEED)``; mapped pages stay): their next read on any
        node is cold.  Returns the bytes of one copy of them."""
        total = 0
        for p in paths:
            inside = Path(p).relative_to(self.mountpoint)
            for k in range(self.clients):
                fd = os.open(self.client_mount(k) / inside, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    size = os.fstat(fd).st_size
                finally:
                    os.close(fd)
            total += size
        return total

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmount (lazily: a process of a node still inside lets go at its exit) and
        stop the server."""
        if self._server is None:
            return
        self._unmount(self.clients)
        self.cpu_seconds()
        self._server.terminate()
        try:
            _, err = self._server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            _, err = self._server.communicate()
        if self._server.returncode:
            self.error = f"the server ended with {self._server.returncode}: {err.decode()[-2000:]}"
        sched = Path(f"{self._stats}.schedule")
        if sched.exists():
            self._schedule = [tuple(x) for x in json.loads(sched.read_text())]  # type: ignore
            sched.unlink()
        self._final = self._counters()
        if self._stats is not None:
            self._stats.unlink(missing_ok=True)
        self._server = None

    def path(self, inside: "str | os.PathLike[str]") -> Path:
        """Where ``inside`` (a path under ``source``) is seen through the mount."""
        return self.mountpoint / Path(inside).resolve().relative_to(self.source)

    def describe(self) -> str:
        return (f"a FUSE file system paced at {self.mbps:g} MB/s"
                + (f" and {self.iops:g} requests/s" if self.iops else "")
                + (f", {self.latency * 1e3:g} ms a request" if self.latency else "")
                + " (one queue, no credit for idle time)")

    # the benchmarks' throttle interface (ThrottledDevice's): nothing to wrap
    def wrap(self, cmd: list[str]) -> list[str]:
        return cmd

    @property
    def served_bytes(self) -> int:
        """Bytes the file system's reads returned so far."""
        return self._counters()[0]

    @property
    def requests(self) -> int:
        """Read requests the file system served so far."""
        return self._counters()[1]

    def _counters(self) -> "tuple[int, int]":
        if self._server is None:
            return self._final
        assert self._stats is not None
        return struct.unpack("<QQ", self._stats.read_bytes()[:16])

    def read_bytes(self) -> int:
        return self.served_bytes

    def cpu_seconds(self) -> float:
        """CPU seconds the server process has used so far (its threads' user and
        system time): what serving took from the machine's cores."""
        if self._server is None:
            return self._cpu
        try:
            fields = Path(f"/proc/{self._server.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return self._cpu
        self._cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return self._cpu

    @property
    def schedule(self) -> "list[tuple[float, float, float, int]]":
        """(arrival, start, end, bytes) of the reads the file system served (the last
        100,000), in the order it served them (``time.monotonic`` seconds); known once
        it is closed."""
        return list(self._schedule)


def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class _Server:
    """The server process's side: answers the kernel's requests on each of ``devs``
    (one connection per client mount), through one clock."""

    def __init__(self, devs: "list[int]", source: Path, mbps: float, iops: float,
                 latency: float, threads: int, stats: Path) -> None:
        self.source = source
        self.clock = _Clock(mbps, iops, latency)
        self.served_bytes = 0
        self.requests = 0
        self.threads = threads
        self._paths: dict[int, Path] = {1: self.source}
        self._ids: dict[Path, int] = {self.source: 1}
        self._fds: dict[int, int] = {}
        self._next_fh = 1
        self._lock = threading.Lock()
        self._devs = devs
        self._here = threading.local()           # .dev: the connection a thread serves
        fd = os.open(stats, os.O_RDWR)
        self._stats = mmap.mmap(fd, 16)          # the counters, read by PacedFS
        os.close(fd)
        self._node_fds: dict[int, int] = {}       # a descriptor per file read, kept
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        self._fd_room = hard - 64
        self._stats_path = stats
        self._stopping = False
        self._no_open = False
        self.error: Optional[BaseException] = None

    def run(self) -> int:
        """Serve until the connection ends or SIGTERM; write the schedule; 1 if a
        request met a defect of this server."""
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        workers = [threading.Thread(target=self._serve, args=(dev,),
                                    name=f"pacedfs-{c}-{k}", daemon=True)
                   for c, dev in enumerate(self._devs) for k in range(self.threads)]
        for t in workers:
            t.start()
        while not stop.is_set() and any(t.is_alive() for t in workers):
            stop.wait(0.2)
        self._stopping = True
        with self.clock.lock:
            Path(f"{self._stats_path}.schedule").write_text(
                json.dumps(list(self.clock.schedule)))
        if self.error is not None:
            sys.stderr.write(f"pacedfs: {self.error!r}\n")
            return 1
        return 0

    # -- serving
    def _read_node(self, nid: int, p: Path, size: int, offset: int) -> bytes:
        """``size`` bytes at ``offset`` of node ``nid``'s file, through a descriptor
        opened once (an open and a close per request cost the server a third of its
        time), or opened for this read alone past the descriptor limit."""
        fd = self._node_fds.get(nid)
        if fd is None:
            with self._lock:
                fd = self._node_fds.get(nid)
                if fd is None and len(self._node_fds) < self._fd_room:
                    fd = self._node_fds[nid] = os.open(p, os.O_RDONLY)
        if fd is not None:
            return os.pread(fd, size, offset)
        fd = os.open(p, os.O_RDONLY)
        try:
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)

    def _serve(self, dev: int) -> None:
        self._here.dev = dev
        size = _MAX_READ + 4096 + 128
        while not self._stopping:
            try:
                req = os.read(dev, size)
            except OSError as e:
                if e.errno in (errno.EINTR, errno.EAGAIN):
                    continue
                return            # ENODEV: unmounted; EBADF: closed
            if not req:
                return
            try:
                self._handle(req)
            except OSError:
                if self._stopping:
                    return
            except BaseException as e:     # a defect here: said once, not lost
                self.error = e
                return

    def _reply(self, unique: int, body: bytes = b"", err: int = 0,
               data: Any = None) -> None:
        parts = [body] if data is None else [body, data]
        n = _OUT.size + sum(len(p) for p in parts)
        os.writev(self._here.dev, [_OUT.pack(n, -err, unique), *parts])

    def _attr(self, p: Path) -> bytes:
        st = os.lstat(p)
        return _ATTR.pack(st.st_ino, st.st_size, st.st_blocks, int(st.st_atime),
                          int(st.st_mtime), int(st.st_ctime), 0, 0, 0,
                          st.st_mode & ~0o222,
                          st.st_nlink, 0, 0, 0, 4096, 0)

    def _node(self, p: Path) -> int:
        with self._lock:
            nid = self._ids.get(p)
            if nid is None:
                nid = self._ids[p] = len(self._paths) + 1
                self._paths[nid] = p
            return nid

    def _handle(self, req: bytes) -> None:
        _, op, unique, nid, *_ = _IN.unpack_from(req)
        arg = memoryview(req)[_IN.size:]
        if op in _NO_REPLY:
            return
        try:
            self._op(op, unique, nid, arg)
        except OSError as e:
            if op == READ and self._stopping:
                raise
            self._reply(unique, err=e.errno or errno.EIO)

    def _op(self, op: int, unique: int, nid: int, arg: memoryview) -> None:
        if op == INIT:
            major, minor, readahead, flags = _INIT_IN.unpack_from(arg)
            want = flags & (_ASYNC_READ | _MAX_PAGES | _NO_OPEN)
            self._no_open = bool(want & _NO_OPEN)
            self._reply(unique, _INIT_OUT.pack(7, min(minor, 31), min(readahead, _MAX_READ),
                                               want, 64, 48, 65536, 1,
                                               _MAX_READ // 4096, 0, 0))
            return
        if op == DESTROY:
            self._reply(unique)
            return
        if op in _WRITES:
            raise OSError(errno.EROFS, "read-only")
        p = self._paths.get(nid)
        if p is None:
            raise OSError(errno.ENOENT, "unknown node")
        if op == LOOKUP:
            name = bytes(arg).split(b"\0", 1)[0].decode()
            child = p / name
            if name in ("", ".", "..") or not os.path.lexists(child):
                raise OSError(errno.ENOENT, name)
            self._reply(unique, _ENTRY.pack(self._node(child), 0, _TTL, _TTL, 0, 0)
                        + self._attr(child))
        elif op == GETATTR:
            self._reply(unique, _ATTR_OUT.pack(_TTL, 0, 0) + self._attr(p))
        elif op == OPEN and self._no_open:
            # the kernel opens without asking from now on (a request less per file)
            raise OSError(errno.ENOSYS, "zero-message opens")
        elif op in (OPEN, OPENDIR):
            fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if op == OPENDIR else 0))
            with self._lock:
                fh = self._next_fh
                self._next_fh += 1
                self._fds[fh] = fd
            self._reply(unique, _OPEN_OUT.pack(fh, _KEEP_CACHE if op == OPEN else 0, 0))
        elif op == READ:
            fh, offset, size, *_ = _READ_IN.unpack_from(arg)
            if fh:
                data = os.pread(self._fds[fh], size, offset)
            else:                      # opened without a request: by its node
                data = self._read_node(nid, p, size, offset)
            wait = self.clock.done_at(len(data)) - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with self._lock:
                self.served_bytes += len(data)
                self.requests += 1
                struct.pack_into("<QQ", self._stats, 0, self.served_bytes, self.requests)
            self._reply(unique, data=data)
        elif op == READDIR:
            fh, offset, size, *_ = _READ_IN.unpack_from(arg)
            names = sorted(os.listdir(p))
            out = bytearray()
            for k, name in enumerate(names[offset:], start=offset + 1):
                b = name.encode()
                st = os.lstat(p / name)
                ent = _DIRENT.pack(st.st_ino, k, len(b), stat.S_IFMT(st.st_mode) >> 12) + b
                ent += b"\0" * (-len(ent) % 8)
                if len(out) + len(ent) > size:
                    break
                out += ent
            self._reply(unique, bytes(out))
        elif op in (RELEASE, RELEASEDIR):
            fh = struct.unpack_from("<Q", arg)[0]
            with self._lock:
                fd = self._fds.pop(fh, None)
            if fd is not None:
                os.close(fd)
            self._reply(unique)
        elif op == STATFS:
            st = os.statvfs(p)
            self._reply(unique, _STATFS.pack(st.f_blocks, st.f_bfree, st.f_bavail, st.f_files,
                                             st.f_ffree, st.f_bsize, 255, st.f_frsize, 0))
        elif op == FLUSH:     # nothing to write back: not asked again
            raise OSError(errno.ENOSYS, "flush")
        elif op == ACCESS:
            self._reply(unique)
        else:
            raise OSError(errno.ENOSYS, f"operation {op}")


if __name__ == "__main__":     # the server: DEV[,DEV...] SOURCE MBPS IOPS LATENCY THREADS STATS
    _devs, _src, _mbps, _iops, _lat, _thr, _stats = sys.argv[1:8]
    sys.exit(_Server([int(d) for d in _devs.split(",")], Path(_src), float(_mbps),
                     float(_iops), float(_lat), int(_thr), Path(_stats)).run())

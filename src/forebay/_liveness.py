"""A deadline on the data plane's waits, and which node is gone when one passes.

A collective or one-sided wait of a store (a batch's exchange, an RMA get, a peer's
fill counter) blocks in MPI or gloo with no deadline of its own: a node that dies, or
whose link is cut, leaves its peers waiting forever (MPI has no timeout; gloo's is 30
minutes).  Each such wait runs inside :func:`waiting`.  A watchdog thread looks at the
waits in progress; one that has lasted ``FOREBAY_PEER_TIMEOUT`` seconds (default 30)
makes it probe every rank of the job: each rank answers on a small TCP listener of its
own (it sends 8 bytes, ``FBLV`` and its rank, and closes; it reads nothing).  If every
rank answers, the wait is only slow (a peer busy elsewhere: validation on rank 0, a
long step) and it goes on.  If some do not, this rank writes one line naming them,
their nodes and what the probe saw (the node answers but the rank does not: its
process is gone; the node does not answer: it is down or its link is cut) and ends
(exit 1; the launcher ends the rest of the job).  A wait that fails at once instead
(gloo's connection to a peer reset when the peer's node died) probes the same way, and
ends with the same line when a rank is gone; otherwise its error is raised as it was.

The listener binds to the address this host's name resolves to (the network the
ranks reach each other on; 127.0.0.1 when every rank of the job is on this host).
``FOREBAY_PEER_TIMEOUT=0`` turns the deadline off (waits are unbounded again).
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import sys
import threading
import time
from typing import Any, Optional

__all__ = ["waiting", "join", "peer_timeout", "TIMEOUT_ENV"]

TIMEOUT_ENV = "FOREBAY_PEER_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0
_MAGIC = b"FBLV"
_PROBE_S = 3.0           # how long one probe waits for a connection and its 8 bytes
#: exit status of a rank that ended because a peer is gone
EXIT_PEER_GONE = 1


def peer_timeout() -> float:
    """Seconds a data-plane wait may last before the peers are probed (0: never), from
    ``FOREBAY_PEER_TIMEOUT``; a value that is not a number >= 0 is refused by name."""
    from .errors import InvalidArgumentError

    v = os.environ.get(TIMEOUT_ENV, "").strip()
    if not v:
        return DEFAULT_TIMEOUT_S
    try:
        t = float(v)
    except ValueError:
        t = -1.0
    if not t >= 0 or t == float("inf"):
        raise InvalidArgumentError(f"{TIMEOUT_ENV}={v!r} is not a number of seconds >= 0 "
                                   f"(0 turns the deadline off)")
    return t


class _Watch:
    """The process's listener, the job's table of ranks and the waits in progress."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.table: dict[int, tuple[str, str, int]] = {}   # rank -> (host, addr, port)
        self.rank = -1
        self.sock: Optional[socket.socket] = None
        #: waits in progress: id -> (what, since); changed without the lock (single
        #: dict operations are atomic), read by the watchdog as a copy
        self.waits: dict[int, tuple[str, float]] = {}
        self.ids = itertools.count()
        self.thread: Optional[threading.Thread] = None
        self.limit = DEFAULT_TIMEOUT_S

    # -- the listener -------------------------------------------------------------------
    def listen(self, addr: str) -> int:
        if self.sock is None:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, 0))
            s.listen(64)
            self.sock = s
            threading.Thread(target=self._serve, name="forebay-liveness",
                             daemon=True).start()
        return int(self.sock.getsockname()[1])

    def _serve(self) -> None:
        assert self.sock is not None
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                conn.sendall(_MAGIC + struct.pack("<i", self.rank))
            except OSError:
                pass
            finally:
                conn.close()

    # -- the watchdog -------------------------------------------------------------------
    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._watch, name="forebay-watchdog",
                                           daemon=True)
            self.thread.start()

    def _watch(self) -> None:
        limit = self.limit
        while True:
            time.sleep(min(1.0, limit / 4))
            now = time.monotonic()
            late = [(k, w) for k, (w, t0) in list(self.waits.items()) if now - t0 >= limit]
            if not late:
                continue
            gone = self.probe()
            if not gone:        # everyone answers: the wait is slow, not broken
                for k, w in late:
                    if k in self.waits:
                        self.waits[k] = (w, now)
                continue
            self.end(f"{late[0][1]} has waited {limit:g} s", gone,
                     f" ({TIMEOUT_ENV} sets the deadline)")

    def broken(self, what: str, exc: BaseException) -> None:
        """A wait that failed (gloo's connection to a peer reset or closed): if a
        rank is gone, end with one line naming it instead of the traceback."""
        gone = self.probe()
        if gone:
            self.end(f"{what} failed ({_short(exc)})", gone, "")

    def probe(self) -> dict[int, str]:
        """Every other rank that does not answer, and what the probe saw."""
        out: dict[int, str] = {}
        for r, (_, addr, port) in sorted(self.table.items()):
            if r == self.rank:
                continue
            why = _probe(addr, port, r)
            if why:
                out[r] = why
        return out

    def end(self, happened: str, gone: dict[int, str], hint: str) -> None:
        """One line naming the ranks and nodes gone, then this process ends."""
        by_host: dict[str, list[int]] = {}
        for r in gone:
            by_host.setdefault(self.table[r][0], []).append(r)
        parts = []
        for host, ranks in by_host.items():
            whys = {gone[r] for r in ranks}
            parts.append(f"{host} (rank{'s' if len(ranks) > 1 else ''} "
                         f"{', '.join(map(str, ranks))}: {'; '.join(sorted(whys))})")
        me = self.table.get(self.rank, (socket.gethostname(), "", 0))[0]
        msg = (f"forebay: rank {self.rank} on {me}: {happened}, and "
               f"{' and '.join(parts)} {'do' if len(gone) > 1 else 'does'} not answer; "
               f"ending this rank{hint}\n")
        try:
            sys.stderr.write(msg)
            sys.stderr.flush()
            sys.stdout.flush()
            _abort_mpi()
        finally:
            os._exit(EXIT_PEER_GONE)


def _short(exc: BaseException) -> str:
    """An error's first sentence, without gloo's source location
    (``[.../pair.cc:537] Read error ...: Connection reset by peer. This is ...``)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "] " in text:
        text = "gloo: " + text.split("] ", 1)[1]
    return text.split(". ", 1)[0][:200]


def _abort_mpi() -> None:
    """Under MPI, MPI_Abort (the launcher then ends every rank it can reach), given a
    few seconds before this process exits by itself."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    threading.Timer(5.0, os._exit, (EXIT_PEER_GONE,)).start()
    mpi.COMM_WORLD.Abort(EXIT_PEER_GONE)


def _probe(addr: str, port: int, rank: int) -> Optional[str]:
    """None if rank ``rank``'s listener answers; else what was seen."""
    try:
        with socket.create_connection((addr, port), timeout=_PROBE_S) as s:
            s.settimeout(_PROBE_S)
            got = b""
            while len(got) < 8:
                chunk = s.recv(8 - len(got))
                if not chunk:
                    break
                got += chunk
    except (ConnectionRefusedError, ConnectionResetError):
        # refused, or reset by a listener that was ending: the node's kernel answers
        return "the node answers, the rank does not: its process is gone"
    except (socket.timeout, TimeoutError):
        return "the node does not answer: it is down or its link is cut"
    except OSError as e:
        return f"the node is unreachable ({e.strerror or e})"
    if not got:
        # accepted from the listen queue, then closed without a word: a listener whose
        # process was ending (its socket is closed at the process's exit)
        return "the node answers, the rank does not: its process is gone"
    if len(got) != 8 or got[:4] != _MAGIC or struct.unpack("<i", got[4:])[0] != rank:
        return "something else answers on its port: its process is gone"
    return None


_W = _Watch()


def _my_address(hosts: list[str]) -> str:
    """The address peers reach this rank on: loopback when every rank is on this
    host, else what this host's name resolves to."""
    me = socket.gethostname()
    if all(h == me for h in hosts):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(me)
    except OSError:
        return "0.0.0.0"


def join(comm: Any, world_rank: Optional[int] = None) -> None:
    """Enter the job's table of live ranks (collective over ``comm``, which spans the
    job: MPI's COMM_WORLD or forebay's torch.distributed world).  Idempotent per
    process; a job of one rank, or ``FOREBAY_PEER_TIMEOUT=0``, does nothing."""
    if comm is None or comm.Get_size() <= 1 or _W.table:
        return
    limit = peer_timeout()     # the same environment on every rank: the same answer
    if not limit:
        return
    _W.limit = limit
    hosts = comm.allgather(socket.gethostname())
    addr = _my_address(hosts)
    rank = comm.Get_rank() if world_rank is None else world_rank
    _W.rank = rank
    port = _W.listen(addr)
    every = comm.allgather([rank, socket.gethostname(),
                            addr if addr != "0.0.0.0" else socket.gethostname(), port])
    with _W.lock:
        _W.table = {int(r): (str(h), str(a), int(p)) for r, h, a, p in every}
    _W.start()


class waiting:
    """``with waiting(what):`` around a data-plane wait (``what`` names it in the
    error): past the deadline with a peer gone, this process ends with one line naming
    it (see the module).  Cheap: two dict operations when the job's table is set."""

    __slots__ = ("what", "key")

    def __init__(self, what: str) -> None:
        self.what = what
        self.key = -1

    def __enter__(self) -> "waiting":
        if _W.table:
            self.key = next(_W.ids)
            _W.waits[self.key] = (self.what, time.monotonic())
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if self.key >= 0:
            _W.waits.pop(self.key, None)
            if kind is not None and issubclass(kind, RuntimeError):
                _W.broken(self.what, exc)       # a peer gone ends here, by name

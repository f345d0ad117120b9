"""Named arrays held in ranks' memory, read by any rank: DDStore's programming model
(``add`` from in-memory arrays, ``get`` of a range of rows, ``update``, epoch fences) on
forebay's transports.

Every rank contributes the rows it has of each named variable; a variable's global
rows are the ranks' rows concatenated in rank order (rank 0's first), so any rank can
read any row with no ingest step and no files.  Transports as for the
:class:`~forebay.store.DistributedStore`: ``shm`` (all ranks on one node: an MPI shared
window, or a ``NodeSegment`` under torch.distributed; a read is a memory copy),
``rma`` (MPI one-sided gets: one ``MPI_Get`` per owner inside a passive-target epoch
opened at set-up) and ``local`` (one process).
"""

from __future__ import annotations

import bisect
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np

from .._liveness import join as join_liveness, waiting
from ..comm import NodeSegment, fence, is_mpi, node_ranks, node_size
from ..dataset import ALIGNMENT, gather_ranges
from ..errors import InvalidArgumentError, NameNotFoundError, SampleIndexError
from ..world import abort_on_uncaught, resolve_comm
from ._base import Releasable, StoreError
from ._agreement import raise_mismatches
from ._windows import TargetProgress, rma_get, target_progress

__all__ = ["ArrayStore", "ARRAY_TRANSPORTS"]

ARRAY_TRANSPORTS = ("auto", "shm", "rma")


class _Var:
    """One variable: its row type and where every rank's rows are."""

    __slots__ = ("name", "dtype", "row_shape", "row_bytes", "starts", "starts_list",
                 "offset", "offset_list", "rows")

    def __init__(self, name: str, dtype: np.dtype, row_shape: tuple[int, ...],
                 counts: np.ndarray) -> None:
        self.name = name
        self.dtype = dtype
        self.row_shape = row_shape
        self.row_bytes = int(dtype.itemsize * int(np.prod(row_shape, dtype=np.int64)))
        #: global row of each rank's first row, and the total (world + 1 entries)
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.starts_list = self.starts.tolist()
        self.rows = int(self.starts[-1])
        #: byte offset of this variable's block in each rank's memory (set by the store)
        self.offset = np.zeros(len(counts), dtype=np.int64)
        self.offset_list: list[int] = []


def _describe(arrays: Mapping[str, np.ndarray]) -> "tuple[dict[str, Any], Optional[str]]":
    """(name -> [dtype, row shape], a problem with this rank's arrays or None)."""
    desc: dict[str, Any] = {}
    if not isinstance(arrays, Mapping) or not arrays:
        return desc, "arrays must be a non-empty mapping of name -> numpy array"
    for name, a in arrays.items():
        if not isinstance(name, str) or not name:
            return desc, f"variable names must be non-empty strings, got {name!r}"
        if not isinstance(a, np.ndarray):
            return desc, f"variable {name!r} is a {type(a).__name__}, not a numpy array"
        if a.ndim < 1:
            return desc, f"variable {name!r} is a scalar; give rows (an array of ndim >= 1)"
        if a.dtype.hasobject:
            return desc, (f"variable {name!r} has dtype {a.dtype}, which holds Python "
                          f"objects; only fixed-size dtypes can be shared")
        desc[name] = [a.dtype.str, list(a.shape[1:])]
    return desc, None


class ArrayStore(Releasable):
    """Named arrays striped over ranks' memory (see the module docstring); made by
    :meth:`forebay.store.DistributedStore.from_arrays`.

    Reads: :meth:`get` (a range of consecutive global rows, in one call even when it
    spans ranks) and :meth:`get_rows` (any rows, one gather or one ``MPI_Get`` per
    owner).  A ``mutable`` store accepts :meth:`update` of the calling rank's own rows
    between epochs; its reads happen inside epochs (:meth:`epoch_begin` /
    :meth:`epoch_end`, or ``with store.epoch():``), both collective fences, so a read
    never sees a row half written: a read outside an epoch, or an update inside one,
    raises :class:`StoreError`.  A read-only store (the default) reads anywhere, and
    its epoch calls cost nothing.
    """

    capabilities = frozenset({"shared"})

    def __init__(self, arrays: Mapping[str, np.ndarray], comm: Any = None, *,
                 transport: str = "auto", mutable: bool = False) -> None:
        self.comm = resolve_comm(comm)
        abort_on_uncaught(self.comm)
        join_liveness(self.comm)       # a peer gone mid-wait ends the job, not a hang
        if transport not in ARRAY_TRANSPORTS:
            raise InvalidArgumentError(
                f"transport must be one of {', '.join(map(repr, ARRAY_TRANSPORTS))}, got "
                f"{transport!r}")
        self.rank = self.comm.Get_rank() if self.comm is not None else 0
        self.world = self.comm.Get_size() if self.comm is not None else 1
        self.mutable = bool(mutable)
        self._closed = False
        self._in_epoch = False
        self._win: Any = None
        self._progress: Optional[TargetProgress] = None   # rma across nodes
        self._seg: Optional[NodeSegment] = None
        self._rows_read = {"local": 0, "peer": 0}
        desc, problem = _describe(arrays)
        self.transport = self._choose_transport(transport)
        mine = {"transport": transport, "mutable": self.mutable, "variables": sorted(desc)}
        mine.update({f"variable {n!r}": f"{d[0]} rows of shape {tuple(d[1])}"
                     for n, d in desc.items()})
        counts_mine = {n: int(len(a)) for n, a in arrays.items()} if problem is None else {}
        if self.comm is None:
            if problem:
                raise InvalidArgumentError(problem)
            every = [(mine, counts_mine)]
        else:
            every = self.comm.allgather([problem, mine, counts_mine])
            bad = [(r, p) for r, (p, _, _) in enumerate(every) if p]
            if bad:
                raise InvalidArgumentError("; ".join(f"rank {r}: {p}" for r, p in bad[:4]))
            raise_mismatches("arrays of the ArrayStore", [m for _, m, _ in every])
            every = [(m, c) for _, m, c in every]
        self.vars: dict[str, _Var] = {}
        for name in sorted(desc):
            dt, shape = desc[name]
            counts = np.array([c[name] for _, c in every], dtype=np.int64)
            self.vars[name] = _Var(name, np.dtype(dt), tuple(int(d) for d in shape), counts)
        # each rank's memory: its block of every variable, in name order, 64-byte aligned
        sizes = np.zeros(self.world, dtype=np.int64)
        for v in self.vars.values():
            v.offset = sizes.copy()
            nbytes = np.diff(v.starts) * v.row_bytes
            sizes += nbytes + (-nbytes) % ALIGNMENT
        self.nbytes = int(sizes[self.rank])
        self._allocate(int(sizes[self.rank]))
        self._fill(arrays)

    # -- set-up -----------------------------------------------------------------------
    def _choose_transport(self, transport: str) -> str:
        if self.comm is None:
            return "local"
        one_node = len(node_ranks(self.comm)) == self.world
        one_node = all(self.comm.allgather(one_node))
        if transport == "auto":
            transport = "shm" if one_node else "rma"
        if transport == "shm" and not one_node:
            raise StoreError("transport='shm' needs every rank on one node; use 'rma' (MPI)")
        if transport == "rma" and not is_mpi(self.comm):
            raise StoreError("transport='rma' needs MPI (mpiexec/srun with mpi4py); under "
                             "torch.distributed an ArrayStore spans one node (shm)")
        return transport

    def _allocate(self, size: int) -> None:
        size += ALIGNMENT
        if self.transport == "local":
            raw = np.zeros(size, dtype=np.uint8)
            views = [raw]
        elif not is_mpi(self.comm):
            self._seg = NodeSegment(self.comm, size)
            views = [self._seg.region(r) for r in range(self.world)]
            raw = views[self.rank]
        else:
            from mpi4py import MPI

            if self.transport == "shm":
                self._win = MPI.Win.Allocate_shared(size, 1, comm=self.comm)
                views = [np.frombuffer(self._win.Shared_query(r)[0], dtype=np.uint8)
                         for r in range(self.world)]
                raw = views[self.rank]
            else:
                self._win = MPI.Win.Allocate(size, 1, comm=self.comm)
                raw = np.frombuffer(self._win.tomemory(), dtype=np.uint8)
                views = [raw]
                self._progress = target_progress(self.comm,   # gets across nodes
                                                 node_size(self.comm) < self.world)
        shift = (-raw.ctypes.data) % ALIGNMENT
        shifts = (self.comm.allgather(int(shift)) if self.comm is not None else [shift])
        self._shift = np.array(shifts, dtype=np.int64)
        for v in self.vars.values():
            v.offset = v.offset + self._shift
        #: uint8 views of the ranks' memory this process can read directly (shm, local)
        self._views = views
        self._shared = self.transport == "shm"
        for v in self.vars.values():
            v.offset_list = v.offset.tolist()
        if self._win is not None:
            from mpi4py import MPI

            self._byte = MPI.BYTE
        self._mem = raw

    def _fill(self, arrays: Mapping[str, np.ndarray]) -> None:
        if self._win is not None:
            from mpi4py import MPI

            self._win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
        try:
            for name, v in self.vars.items():
                a = np.ascontiguousarray(arrays[name])
                off = int(v.offset[self.rank])
                self._mem[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        finally:
            if self._win is not None:
                self._win.Unlock(self.rank)
        if self._win is not None:
            from mpi4py import MPI

            self._win.Lock_all(MPI.MODE_NOCHECK)
        self._publish()

    def _publish(self) -> None:
        """Make this rank's writes visible to every rank, and theirs to it: a memory
        barrier (``MPI_Win_sync``), a barrier of all ranks, and another memory barrier."""
        if self.comm is None:
            return
        self._sync()
        self.comm.Barrier()
        self._sync()

    def _sync(self) -> None:
        if self._win is not None:
            self._win.Sync()
        else:
            fence()

    # -- reads ------------------------------------------------------------------------
    def _var(self, name: str) -> _Var:
        v = self.vars.get(name)
        if v is not None and not self._closed and (self._in_epoch or not self.mutable):
            return v
        if self._closed:
            raise StoreError("the store is closed")
        if self.mutable and not self._in_epoch:
            raise StoreError("a mutable ArrayStore is read inside an epoch (epoch_begin() "
                             "... epoch_end(), or `with store.epoch():`), so no read can "
                             "see a row a peer is updating")
        raise NameNotFoundError(f"no variable {name!r} in the store (it has "
                                f"{', '.join(map(repr, self.vars))})")

    def _out(self, v: _Var, count: int, out: Optional[np.ndarray]) -> np.ndarray:
        if out is None:
            return np.empty((count,) + v.row_shape, dtype=v.dtype)
        if not isinstance(out, np.ndarray) or out.dtype != v.dtype or \
                out.shape != (count,) + v.row_shape or not out.flags.c_contiguous or \
                not out.flags.writeable:
            raise InvalidArgumentError(
                f"out must be a writable C-contiguous {v.dtype} array of shape "
                f"{(count,) + v.row_shape} for {count} row(s) of {v.name!r}")
        return out

    def get(self, name: str, start: int, count: int = 1, *,
            out: Optional[np.ndarray] = None) -> np.ndarray:
        """Rows ``[start, start + count)`` of variable ``name`` (global rows: rank 0's,
        then rank 1's...), as an array of shape ``(count, *row_shape)``, written into
        ``out`` when given.  A range spanning several ranks is read in one call."""
        v = self._var(name)
        start, count = int(start), int(count)
        if start < 0 or count < 0 or start + count > v.rows:
            raise SampleIndexError(f"rows [{start}, {start + count}) out of range for "
                                   f"{name!r}, which has {v.rows} rows")
        starts = v.starts_list
        owner = bisect.bisect_right(starts, start) - 1
        if out is None and count and starts[owner + 1] >= start + count:
            # the common case, one owner: as few Python steps as the copy allows
            off = v.offset_list[owner] + (start - starts[owner]) * v.row_bytes
            nbytes = count * v.row_bytes
            self._rows_read["local" if owner == self.rank else "peer"] += count
            if self._win is None or owner == self.rank:
                src = self._views[owner if self._shared else 0]
                return src[off:off + nbytes].copy().view(v.dtype).reshape(
                    (count,) + v.row_shape)
            res = np.empty((count,) + v.row_shape, dtype=v.dtype)
            with waiting("a one-sided get from a peer"):
                self._win.Get([res, nbytes, self._byte], owner, (off, nbytes, self._byte))
                self._win.Flush(owner)
            return res
        res = self._out(v, count, out)
        if count == 0:
            return res
        dst = res.reshape(-1).view(np.uint8)
        last = bisect.bisect_right(starts, start + count - 1) - 1
        owners = np.arange(owner, last + 1)
        first = np.maximum(v.starts[owners], start)
        end = np.minimum(v.starts[owners + 1], start + count)
        self._read(v, owners, first, end - first, dst)
        return res

    def get_rows(self, name: str, ids: "Sequence[int] | np.ndarray", *,
                 out: Optional[np.ndarray] = None) -> np.ndarray:
        """Rows ``ids`` (any order, repeats and negative ids allowed) of variable
        ``name``, as an array of shape ``(len(ids), *row_shape)``."""
        v = self._var(name)
        ids = np.asarray(ids)
        if ids.size and ids.dtype.kind not in "iu":
            raise InvalidArgumentError(f"row ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        ids = np.where(ids < 0, ids + v.rows, ids)
        bad = (ids < 0) | (ids >= v.rows)
        if bad.any():
            raise SampleIndexError(f"row {int(ids[np.argmax(bad)])} out of range for "
                                   f"{name!r}, which has {v.rows} rows ({int(bad.sum())} "
                                   f"bad ids)")
        res = self._out(v, len(ids), out)
        if not len(ids):
            return res
        dst = res.reshape(-1).view(np.uint8)
        owner = np.searchsorted(v.starts, ids, side="right") - 1
        src_off = v.offset[owner] + (ids - v.starts[owner]) * v.row_bytes
        rb = v.row_bytes
        pos = np.arange(len(ids), dtype=np.int64) * rb
        lens = np.full(len(ids), rb, dtype=np.int64)
        local = owner == self.rank
        nlocal = int(local.sum())
        self._count(True, nlocal)
        self._count(False, len(ids) - nlocal)
        if self.transport != "rma":
            for r in np.unique(owner).tolist():
                m = owner == r
                gather_ranges(self._views[r if self.transport == "shm" else 0], src_off[m],
                              lens[m], dst, pos[m])
            return res
        if nlocal:
            gather_ranges(self._mem, src_off[local], lens[local], dst, pos[local])
        if nlocal < len(ids):
            remote = np.flatnonzero(~local)
            order = remote[np.argsort(owner[remote], kind="stable")]
            stage = np.empty(len(order) * rb, dtype=np.uint8)
            rma_get(self._win, stage, owner[order], src_off[order], lens[order],
                    np.arange(len(order), dtype=np.int64) * rb)
            gather_ranges(stage, np.arange(len(order), dtype=np.int64) * rb, lens[order],
                          dst, pos[order])
        return res

    def _read(self, v: _Var, owners: np.ndarray, first: np.ndarray, nrows: np.ndarray,
              dst: np.ndarray) -> None:
        """Consecutive rows held by several owners into ``dst`` (each owner's part is
        contiguous there)."""
        disp = v.offset[owners] + (first - v.starts[owners]) * v.row_bytes
        length = nrows * v.row_bytes
        pos = np.cumsum(length) - length
        mine = owners == self.rank
        self._count(True, int(nrows[mine].sum()))
        self._count(False, int(nrows[~mine].sum()))
        if self.transport != "rma":
            for r, d, n, p in zip(owners.tolist(), disp.tolist(), length.tolist(),
                                  pos.tolist()):
                src = self._views[r if self.transport == "shm" else 0]
                dst[p:p + n] = src[d:d + n]
            return
        if mine.any():
            k = int(np.flatnonzero(mine)[0])
            dst[pos[k]:pos[k] + length[k]] = self._mem[disp[k]:disp[k] + length[k]]
        rest = ~mine & (length > 0)
        if rest.any():
            rma_get(self._win, dst, owners[rest], disp[rest], length[rest], pos[rest])

    def _count(self, local: bool, n: int) -> None:
        self._rows_read["local" if local else "peer"] += n

    # -- writes and fences ------------------------------------------------------------
    def update(self, name: str, start: int, rows: np.ndarray) -> None:
        """Overwrite global rows ``[start, start + len(rows))`` of variable ``name``,
        which must be rows this rank contributed (DDStore's rule: a rank writes its own
        memory).  Only on a ``mutable`` store, between epochs; peers see the new rows
        from the next :meth:`epoch_begin` on."""
        if self._closed:
            raise StoreError("the store is closed")
        if not self.mutable:
            raise StoreError("this ArrayStore is read-only; create it with mutable=True "
                             "to update rows")
        if self._in_epoch:
            raise StoreError("update() inside an epoch: peers may be reading; update "
                             "between epoch_end() and the next epoch_begin()")
        v = self.vars.get(name)
        if v is None:
            raise NameNotFoundError(f"no variable {name!r} in the store")
        rows = np.asarray(rows)
        if rows.dtype != v.dtype or rows.shape[1:] != v.row_shape:
            raise InvalidArgumentError(
                f"rows for {name!r} must be {v.dtype} of row shape {v.row_shape}, got "
                f"{rows.dtype} of shape {rows.shape}")
        start = int(start)
        lo, hi = v.starts_list[self.rank], v.starts_list[self.rank + 1]
        if start < lo or start + len(rows) > hi:
            raise StoreError(f"rank {self.rank} holds rows [{lo}, {hi}) of {name!r}; an "
                             f"update of rows [{start}, {start + len(rows)}) must stay "
                             f"within them (each rank updates its own rows)")
        off = int(v.offset[self.rank]) + (start - lo) * v.row_bytes
        data = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
        self._mem[off:off + len(data)] = data

    def epoch_begin(self) -> None:
        """Start a read epoch (collective on a mutable store: every rank's updates
        before it are visible to every rank's reads after it)."""
        if self._closed:
            raise StoreError("the store is closed")
        if self._in_epoch:
            raise StoreError("epoch_begin() twice: the epoch already began")
        if self.mutable:
            self._publish()
        self._in_epoch = True

    def epoch_end(self) -> None:
        """End a read epoch (collective on a mutable store: no rank updates rows until
        every rank stopped reading)."""
        if not self._in_epoch:
            raise StoreError("epoch_end() without epoch_begin()")
        self._in_epoch = False
        if self.mutable and not self._closed:
            self._publish()

    @contextmanager
    def epoch(self) -> Iterator["ArrayStore"]:
        """``with store.epoch():`` reads inside; see :meth:`epoch_begin`."""
        self.epoch_begin()
        try:
            yield self
        finally:
            self.epoch_end()

    # -- the rest ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.vars)

    def rows(self, name: str) -> int:
        """Number of global rows of variable ``name``."""
        return self.vars[name].rows

    def owner(self, name: str, ids: "Sequence[int] | np.ndarray") -> np.ndarray:
        """The rank holding each of rows ``ids`` of ``name``."""
        v = self.vars[name]
        return np.searchsorted(v.starts, np.asarray(ids, dtype=np.int64), side="right") - 1

    def stats(self) -> dict[str, Any]:
        """``rows_by_source`` (rows read from this rank's memory, from a peer's),
        ``transport`` and ``nbytes`` (this rank's memory)."""
        return {"rows_by_source": dict(self._rows_read), "transport": self.transport,
                "nbytes": self.nbytes}

    def abandon(self) -> None:
        """Stop using the store without any collective (later reads raise)."""
        if self.comm is None:
            self.close()
        self._closed = True

    def close(self) -> None:
        """Release the memory (collective); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._views = []
        self._mem = np.zeros(0, dtype=np.uint8)
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self._win is not None:
            self._win.Unlock_all()
            self._win.Free()
            self._win = None
        if self._seg is not None:
            self.comm.Barrier()          # nobody reads our rows any more
            self._seg.close()
            self._seg = None

    def __repr__(self) -> str:
        vs = ", ".join(f"{n}: {v.rows} x {v.row_shape} {v.dtype}" for n, v in self.vars.items())
        return (f"ArrayStore({vs}; rank={self.rank}/{self.world}, "
                f"transport={self.transport})")

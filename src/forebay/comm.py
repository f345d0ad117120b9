"""The communicator seam: what forebay's data plane needs from the job's runtime.

A *communicator* is anything with the methods of :class:`Communicator` (mpi4py's
spelling): an mpi4py communicator is used as it is; :class:`TorchComm` gives the same
methods over a torch.distributed gloo process group of forebay's own, for jobs started
by torchrun (or any launcher, once ``torch.distributed`` is initialised) without MPI.
Stores call only these methods and the helpers below, never ``mpi4py`` directly except
for what needs MPI itself (RMA windows), and say which transport they chose in
``stats()["transport"]``.

Objects crossing a :class:`TorchComm` are encoded as JSON (plain numbers, strings,
lists and dicts: set-up values), never pickled; arrays go as raw bytes.
"""

from __future__ import annotations

import atexit
import json
import mmap
import os
import socket
import uuid
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

import numpy as np

from ._liveness import waiting
from .errors import ArgumentTypeError, LaunchError, UsageError

__all__ = ["Communicator", "TorchComm", "torch_comm", "is_mpi", "all_true", "node_size",
           "node_ranks", "NodeSegment", "SHM_DIR", "allgather_array", "alltoall_bytes",
           "fence", "ordered_shared_memory", "shm_usable"]

#: where node segments of TorchComm jobs live (a tmpfs on Linux)
SHM_DIR = Path("/dev/shm")


class Communicator(Protocol):
    """The collective operations forebay's stores use (mpi4py's names)."""

    def Get_rank(self) -> int: ...

    def Get_size(self) -> int: ...

    def allgather(self, obj: Any) -> list[Any]: ...

    def bcast(self, obj: Any, root: int = 0) -> Any: ...

    def Barrier(self) -> None: ...

    def Split(self, color: int = 0, key: int = 0) -> Any: ...

    def Free(self) -> None: ...


def shm_usable(comm: Any) -> bool:
    """Every rank of ``comm`` can create node segments (:data:`SHM_DIR` is a writable
    directory); collective."""
    return all_true(comm, SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK | os.X_OK))


def is_mpi(comm: Any) -> bool:
    """``comm`` is an mpi4py communicator (RMA windows and MPI shared memory exist)."""
    return comm is not None and type(comm).__module__.startswith("mpi4py")


def all_true(comm: Any, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on every rank (one allgather)."""
    return bool(flag) if comm is None else all(comm.allgather(bool(flag)))


def node_ranks(comm: Any) -> list[int]:
    """Ranks of ``comm`` on this rank's node, in rank order (collective).  MPI asks
    ``COMM_TYPE_SHARED``; other communicators compare host names."""
    if comm is None:
        return [0]
    if is_mpi(comm):
        from mpi4py import MPI

        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        ranks = node.allgather(comm.Get_rank())
        node.Free()
        return sorted(ranks)
    hosts = comm.allgather(socket.gethostname())
    me = hosts[comm.Get_rank()]
    return [r for r, h in enumerate(hosts) if h == me]


def shm_room(comm: Any, nbytes: int, directory: Path = SHM_DIR) -> Optional[str]:
    """Why ``nbytes`` of shared memory for each rank of this node do not fit in the
    node's ``directory`` (/dev/shm, where shared segments live) together, or None when
    they do (or its free space cannot be read).  Collective over ``comm``; the answer
    is this rank's (pass it to an agreement)."""
    node = node_ranks(comm)
    every = comm.allgather(int(nbytes)) if comm is not None else [int(nbytes)]
    need = sum(every[r] for r in node)
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if need <= free:
        return None
    from ._units import human_bytes

    return (f"the node's shared segments need {human_bytes(need)} in {directory} on "
            f"{socket.gethostname()}, which has {human_bytes(free)} free")


def node_size(comm: Any) -> int:
    """Ranks of ``comm`` on this rank's node (1 without a communicator); collective."""
    return len(node_ranks(comm))


def _plain(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (Path, os.PathLike)):
        return os.fspath(v)
    raise ArgumentTypeError(f"forebay cannot send a {type(v).__name__} between ranks")


class TorchComm:
    """A :class:`Communicator` over a torch.distributed gloo process group (CPU
    tensors; its own group, so its collectives never interleave with the program's).

    Besides the set-up collectives it moves arrays: :meth:`allgather_array` and
    :meth:`alltoall_bytes` (one ``all_to_all_single`` with sizes known to both ends)."""

    def __init__(self, group: Any, ranks: Optional[Sequence[int]] = None) -> None:
        import torch.distributed as dist

        self.group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        #: global rank of each member (new groups are made from global ranks)
        self.global_ranks = list(ranks) if ranks is not None else list(range(self._size))

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._size

    # -- arrays -------------------------------------------------------------------------
    def allgather_array(self, a: np.ndarray) -> list[np.ndarray]:
        """Every rank's 1-D array (any lengths, one dtype on every rank)."""
        import torch
        import torch.distributed as dist

        a = np.ascontiguousarray(a)
        n = torch.tensor([a.nbytes], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self._size)]
        dist.all_gather(sizes, n, group=self.group)
        counts = [int(s.item()) for s in sizes]
        width = max(max(counts), 1)
        mine = torch.zeros(width, dtype=torch.uint8)
        if a.nbytes:
            mine[:a.nbytes] = torch.from_numpy(a.view(np.uint8).reshape(-1).copy())
        outs = [torch.empty(width, dtype=torch.uint8) for _ in range(self._size)]
        dist.all_gather(outs, mine, group=self.group)
        return [o.numpy()[:c].view(a.dtype).copy() for o, c in zip(outs, counts)]

    def alltoall_bytes(self, send: np.ndarray, send_counts: "Sequence[int] | np.ndarray",
                       recv_counts: "Sequence[int] | np.ndarray") -> np.ndarray:
        """Send ``send[sum(send_counts[:r]):...]`` to rank r and receive
        ``recv_counts[r]`` bytes from each rank r, concatenated in rank order."""
        import torch
        import torch.distributed as dist

        out = torch.empty(int(sum(recv_counts)), dtype=torch.uint8)
        src = torch.from_numpy(np.ascontiguousarray(send, dtype=np.uint8))
        dist.all_to_all_single(out, src, [int(c) for c in recv_counts],
                               [int(c) for c in send_counts], group=self.group)
        return out.numpy()

    # -- objects --------------------------------------------------------------------------
    def allgather(self, obj: Any) -> list[Any]:
        data = np.frombuffer(json.dumps(obj, default=_plain).encode(), dtype=np.uint8)
        return [json.loads(b.tobytes()) for b in self.allgather_array(data)]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.allgather(obj if self._rank == root else None)[root]

    def Barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def Split(self, color: int = 0, key: int = 0) -> "TorchComm":
        """Sub-communicators by ``color``, members ordered by ``key`` (collective; the
        communicator must span the whole torch.distributed world, which every new group
        needs to take part in making)."""
        import torch.distributed as dist

        if self._size != dist.get_world_size():
            raise UsageError("TorchComm.Split needs a communicator over the whole "
                             "torch.distributed world")
        every = self.allgather([int(color), int(key), self._rank])
        mine = None
        for c in sorted({e[0] for e in every}):
            ordered = sorted((k, r) for cc, k, r in every if cc == c)
            members = [self.global_ranks[r] for _, r in ordered]
            g = _new_group(members)
            if c == color:
                mine = TorchComm(g, members)
        assert mine is not None
        return mine

    def Free(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"TorchComm(rank {self._rank} of {self._size}, gloo)"


_groups: list[Any] = []      # process groups forebay made, destroyed at exit
_made_default = False        # forebay initialised torch.distributed itself


def _new_group(ranks: Optional[list[int]] = None) -> Any:
    import torch.distributed as dist

    g = dist.new_group(ranks, backend="gloo")
    _groups.append(g)
    return g


@atexit.register
def _destroy_groups() -> None:
    """Destroy forebay's groups (and the default group, if forebay made it) while
    Python still runs: gloo's threads dropping their last tensor references during
    interpreter teardown abort the process ("terminate called without an active
    exception").  A group the program destroyed itself is skipped."""
    dist = __import__("sys").modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return
    for g in reversed(_groups):
        try:
            dist.destroy_process_group(g)
        except Exception:                    # noqa: BLE001 - exiting anyway
            pass
    _groups.clear()
    if _made_default:
        try:
            dist.destroy_process_group()
        except Exception:                    # noqa: BLE001 - exiting anyway
            pass


def torch_comm() -> TorchComm:
    """forebay's own gloo communicator over the torch.distributed world, initialising
    torch.distributed from the launcher's variables (``env://``: MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE) when the program has not: then with gloo for CPU
    tensors and NCCL for CUDA tensors where CUDA is available, so the program's own
    collectives work as after its own ``init_process_group``.  Collective."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise LaunchError("the job was started by torchrun but torch is not installed; "
                          "pip install 'forebay[torch]'") from None
    if not dist.is_available():
        raise LaunchError("this torch build has no torch.distributed")
    if not dist.is_initialized():
        global _made_default
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        try:
            dist.init_process_group(backend, init_method="env://")
            _made_default = True
        except Exception as e:
            raise LaunchError(
                f"forebay could not initialise torch.distributed from the launcher's "
                f"variables (MASTER_ADDR={os.environ.get('MASTER_ADDR')}, MASTER_PORT="
                f"{os.environ.get('MASTER_PORT')}, RANK={os.environ.get('RANK')}, "
                f"WORLD_SIZE={os.environ.get('WORLD_SIZE')}): {e}") from e
    return TorchComm(_new_group())


def mpi_thread_multiple() -> bool:
    """Whether MPI lets several threads of this process call it at once
    (MPI_THREAD_MULTIPLE): a background thread may then make MPI calls."""
    from mpi4py import MPI

    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


class NodeSegment:
    """One shared-memory segment for ranks of one node, each owning a region of it
    (the torch.distributed counterpart of an MPI shared window).

    Collective over ``comm``, whose ranks must all be on this node.  The lowest rank
    creates a file in :data:`SHM_DIR` (mode 0600), every rank maps it, and it is
    unlinked as soon as all have: the memory lives while a rank maps it and nothing
    is left behind when the job ends, crashed or not.  ``view`` spans the segment;
    rank r's region starts at ``starts[r]`` (64-byte aligned) and holds
    ``sizes[r]`` bytes."""

    ALIGN = 64

    def __init__(self, comm: Any, nbytes: int, directory: Path = SHM_DIR) -> None:
        rank = comm.Get_rank()
        sizes = np.array(comm.allgather(int(nbytes)), dtype=np.int64)
        spans = sizes + (-sizes) % self.ALIGN
        self.sizes = sizes
        self.starts = np.concatenate([[0], np.cumsum(spans)[:-1]]).astype(np.int64)
        total = max(int(spans.sum()), 1)
        name = comm.bcast(f".forebay-seg-{uuid.uuid4().hex[:16]}" if rank == 0 else None)
        path = directory / name
        problem = None
        if rank == 0:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, total)
                finally:
                    os.close(fd)
            except OSError as e:
                problem = f"cannot create a {total}-byte shared segment in {directory}: {e}"
        problem = next((p for p in comm.allgather(problem) if p), None)
        if problem:
            raise LaunchError(problem)
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                self._mm: Optional[mmap.mmap] = mmap.mmap(fd, total, mmap.MAP_SHARED)
            finally:
                os.close(fd)
            problem = None
        except OSError as e:
            problem = f"rank {rank}: cannot map the shared segment {path}: {e}"
        finally:
            comm.Barrier()               # everyone has it open (or failed): remove the name
            if rank == 0:
                path.unlink(missing_ok=True)
        problem = next((p for p in comm.allgather(problem) if p), None)
        if problem:
            self.close()
            raise LaunchError(problem)
        assert self._mm is not None
        self.view = np.frombuffer(self._mm, dtype=np.uint8)
        self.rank = rank

    def region(self, rank: Optional[int] = None) -> np.ndarray:
        r = self.rank if rank is None else rank
        return self.view[self.starts[r]:self.starts[r] + self.sizes[r]]

    def close(self) -> None:
        mm, self._mm = getattr(self, "_mm", None), None
        self.view = np.zeros(0, dtype=np.uint8)
        if mm is not None:
            try:
                mm.close()
            except BufferError:     # a batch still views it: the OS unmaps at exit
                pass


def allgather_array(comm: Any, a: np.ndarray) -> list[np.ndarray]:
    """Every rank's 1-D array ``a`` (lengths may differ; one dtype); collective."""
    a = np.ascontiguousarray(a)
    with waiting("an all-gather of the data plane"):
        if not is_mpi(comm):
            return comm.allgather_array(a)
        from mpi4py import MPI

        counts = np.array(comm.allgather(a.nbytes), dtype=np.int64)
        out = np.empty(int(counts.sum()), dtype=np.uint8)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
        comm.Allgatherv([a.view(np.uint8).reshape(-1), MPI.BYTE],
                        [out, (counts.tolist(), displs.tolist()), MPI.BYTE])
    return [out[d:d + c].view(a.dtype) for d, c in zip(displs.tolist(), counts.tolist())]


def alltoall_bytes(comm: Any, send: np.ndarray, send_counts: "Sequence[int] | np.ndarray",
                   recv_counts: "Sequence[int] | np.ndarray") -> np.ndarray:
    """One all-to-all of bytes whose sizes both ends know: ``send_counts[r]`` bytes of
    ``send`` (in rank order) go to rank r, ``recv_counts[r]`` come from it; returns
    what arrived, concatenated in rank order.  Collective."""
    with waiting("an all-to-all of the data plane"):
        if not is_mpi(comm):
            return comm.alltoall_bytes(send, send_counts, recv_counts)
        from mpi4py import MPI

        sc = np.asarray(send_counts, dtype=np.int64)
        rc = np.asarray(recv_counts, dtype=np.int64)
        out = np.empty(int(rc.sum()), dtype=np.uint8)
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
        comm.Alltoallv([np.ascontiguousarray(send, dtype=np.uint8), (sc.tolist(),
                        sd.tolist()), MPI.BYTE], [out, (rc.tolist(), rd.tolist()), MPI.BYTE])
    return out


try:  # the C kernel's full barrier (setup.py builds it)
    from ._native import fence as _fence  # type: ignore[attr-defined, unused-ignore]
except ImportError:  # pragma: no cover - exercised where no compiler was available
    _fence = None


def ordered_shared_memory() -> bool:
    """Whether :func:`fence` orders stores to a shared segment as other processes see
    them (the C kernel's barrier, or a total-store-order CPU without it)."""
    import platform
    return _fence is not None or platform.machine().lower() in ("x86_64", "amd64")


def fence() -> None:
    """A full memory barrier between this process's accesses to a shared segment:
    data written before it is visible to another process before a flag written after
    it (the role of MPI_Win_sync for :class:`NodeSegment`)."""
    if _fence is not None:
        _fence()

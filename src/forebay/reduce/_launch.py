"""Start torch.distributed from whatever launched the job: torchrun, mpiexec/mpirun
(MPICH, Open MPI, Intel MPI, Cray PMI) or srun, without writing rendezvous code."""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

from ..errors import ReduceError
from ..world import detect

def launch_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher (:func:`forebay.world.detect`);
    (0, 1, 0) if none."""
    w = detect()
    return w.rank, w.size, w.local_rank


def init_process_group(backend: str | None = None, *, timeout_s: float = 300.0,
                       port: int | None = None) -> tuple[int, int]:
    """Initialize torch.distributed for this job and return (rank, world size).

    Rank and size come from the launcher's environment. The rendezvous is
    ``MASTER_ADDR:MASTER_PORT`` when set; otherwise, under MPI, rank 0 picks a free port
    on its host and tells the others through ``mpi4py``; otherwise 127.0.0.1:29500 (a
    free port for a single process).  Rank 0 serves the rendezvous store on that address
    only, not on every interface of the node (under torchrun, its agent serves it).
    ``backend`` defaults to nccl when CUDA is available, else gloo.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    import torch
    rank, size, local = launch_env()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local % max(torch.cuda.device_count(), 1))
    timeout = timedelta(seconds=timeout_s)
    addr, mport = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent already serves the rendezvous store: join it
        addr = addr or "127.0.0.1"
        mport_n = int(mport or port or 29500)
        _join(backend, dict(init_method=f"tcp://{addr}:{mport_n}"), rank, size, timeout,
              f"{addr}:{mport_n}")
    else:
        listener: socket.socket | None = None
        if (addr is None or mport is None) and size > 1 and "RANK" not in os.environ:
            addr, got, listener = _rendezvous_over_mpi(addr, port)
            mport = str(got)
        addr = addr or "127.0.0.1"
        # one process alone takes any free port (two of them on a node never collide)
        mport_n = int(mport or port or (29500 if size > 1 else 0))
        where = f"{addr}:{mport_n}"
        try:
            if rank == 0:
                if listener is None:
                    listener = _listen(addr, mport_n)
                    mport_n = listener.getsockname()[1]
                # the store serves on our socket, bound to the job's address only (torch's
                # own binds every interface); it owns the descriptor from here on
                store = dist.TCPStore(addr, mport_n, size, True, timeout,
                                      master_listen_fd=listener.detach())
            else:
                store = dist.TCPStore(addr, mport_n, size, False, timeout)
        except Exception as exc:
            raise ReduceError(f"rank {rank} of {size} could not join the rendezvous at "
                              f"{where}: {exc}") from exc
        _join(backend, dict(store=store), rank, size, timeout, where)
    global _OURS
    _OURS = True
    return rank, size


_OURS = False  # the default group was made by init_process_group above


def _destroy_at_exit() -> None:
    """Destroy a default group this module made, at interpreter exit, after the
    coordinators stopped: its gloo worker threads drop their last tensor references
    while Python still runs (a drop during teardown takes the GIL from a dying
    interpreter and aborts the process: "terminate called without an active
    exception").  A program that destroyed the group itself is left alone."""
    if _OURS and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:                    # noqa: BLE001 - exiting anyway
            pass


def _join(backend: str, how: dict, rank: int, size: int, timeout: timedelta,
          where: str) -> None:
    try:
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout, **how)
    except Exception as exc:
        raise ReduceError(f"rank {rank} of {size} could not join the process group at "
                          f"{where} ({backend}): {exc}") from exc


def _listen(addr: str, port: int) -> socket.socket:
    """A listening socket on ``addr`` (a name is resolved: the rendezvous listens on the
    one address the job uses, not on every interface of the node)."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ReduceError(f"the rendezvous address {addr!r} does not resolve: {exc}") \
            from None
    family, _, _, _, sockaddr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(sockaddr)
        s.listen(1024)
    except OSError as exc:
        s.close()
        raise ReduceError(f"rank 0 cannot listen for the rendezvous on {addr}:{port} "
                          f"({sockaddr[0]}): {exc}; MASTER_ADDR must name this node") from None
    return s


def _rendezvous_over_mpi(addr: str | None, port: int | None
                         ) -> tuple[str, int, socket.socket | None]:
    """Rank 0 listens (on a free port unless ``port`` is given) and tells every rank where:
    (address, port, rank 0's listening socket or None)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise ReduceError("launched by an MPI launcher but MASTER_ADDR/MASTER_PORT are not set "
                          "and mpi4py is missing: set them, or pip install mpi4py") from None
    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname())
    listener = None
    failed = None
    if comm.rank == 0:
        if addr is None:
            addr = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(hosts[0])
        try:
            listener = _listen(addr, port or 0)
            port = listener.getsockname()[1]
        except ReduceError as exc:
            failed = str(exc)
    addr, port, failed = comm.bcast((addr, port, failed), root=0)
    if failed:
        raise ReduceError(failed)
    return addr, port, listener

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
    on its host and tells the others through ``mpi4py``; otherwise 127.0.0.1:29500.
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
    addr, mport = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if (addr is None or mport is None) and size > 1 and "RANK" not in os.environ:
        addr, got = _rendezvous_over_mpi(addr, port)
        mport = str(got)
    addr = addr or "127.0.0.1"
    mport_n = int(mport or port or 29500)
    try:
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{mport_n}", rank=rank,
                                world_size=size, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise ReduceError(f"rank {rank} of {size} could not join the process group at "
                          f"{addr}:{mport_n} ({backend}): {exc}") from exc
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


def _rendezvous_over_mpi(addr: str | None, port: int | None) -> tuple[str, int]:
    try:
        from mpi4py import MPI
    except ImportError:
        raise ReduceError("launched by an MPI launcher but MASTER_ADDR/MASTER_PORT are not set "
                          "and mpi4py is missing: set them, or pip install mpi4py") from None
    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname())
    if comm.rank == 0:
        if addr is None:
            addr = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(hosts[0])
        if port is None:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
    return comm.bcast((addr, port), root=0)

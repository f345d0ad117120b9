"""Who this process is in the job, and which launcher started it: found in one place.

Every package asks :func:`detect` (rank, size, local rank, node, launcher) and
:func:`resolve_comm` (the communicator forebay's data plane uses).  A job whose
launcher says it has several ranks but whose data plane cannot see them fails at once
on every rank with :class:`~forebay.errors.LaunchError`; it never runs as a world of 1
(every rank would read the whole dataset in the same order).

Launchers, in the order they are recognised (the first whose variables are set wins;
torchrun comes before Slurm because torchrun under srun sets both, and Slurm's are
then the node's task, not the rank):

============ ======================================================================
openmpi      ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE``
pmi          ``PMI_RANK``/``PMI_SIZE`` (MPICH's hydra, Intel MPI, Cray PMI, srun --mpi=pmi2);
             local rank ``MPI_LOCALRANKID``, local size ``MPI_LOCALNRANKS``
pmix         ``PMIX_RANK`` (size from ``OMPI_COMM_WORLD_SIZE`` or MPI itself)
torchrun     ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (torchrun, or
             any launcher that sets torch.distributed's variables)
slurm        ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` (srun)
none         a single process
============ ======================================================================
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .errors import LaunchError

__all__ = ["World", "detect", "resolve_comm", "abort_on_uncaught", "LOCAL", "MPI_LAUNCHERS",
           "ABORT_ENV"]

#: set to 0 to keep an uncaught exception from aborting the MPI job
ABORT_ENV = "FOREBAY_ABORT_ON_ERROR"
#: seconds between printing the traceback and MPI_Abort
ABORT_GRACE_S = 0.5

#: set by :func:`slurm_rendezvous` beside the torch.distributed variables it derives
#: from Slurm's, so that :func:`detect` goes on saying "slurm"
_RENDEZVOUS_ENV = "FOREBAY_RENDEZVOUS"

#: launchers that start MPI processes (mpi4py's COMM_WORLD spans the job)
MPI_LAUNCHERS = ("openmpi", "pmi", "pmix")


class _Local:
    """``comm=LOCAL``: this process alone, whatever the launcher says (each rank reads
    the whole dataset on its own; for evaluation or tools, never for training)."""

    def __repr__(self) -> str:
        return "forebay.world.LOCAL"


LOCAL: Any = _Local()


@dataclass(frozen=True)
class World:
    """This process's place in the job, as its launcher tells it."""

    rank: int
    size: int
    local_rank: int
    #: ranks on this node (None when the launcher does not say)
    local_size: Optional[int]
    #: openmpi, pmi, pmix, torchrun, slurm or none
    launcher: str
    node: str

    @property
    def is_mpi(self) -> bool:
        """Started by an MPI launcher (mpiexec, mpirun, srun with an MPI plug-in)."""
        return self.launcher in MPI_LAUNCHERS

    def describe(self) -> str:
        return f"rank {self.rank} of {self.size} ({self.launcher}, node {self.node})"


def _int(env: Mapping[str, str], name: str, default: Optional[int] = None) -> Optional[int]:
    v = env.get(name)
    if v is None or not v.strip().lstrip("-").isdigit():
        return default
    return int(v)


# launcher -> (rank, size, local rank, local size) variables
_VARS = [
    ("openmpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE")),
    ("pmi", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
    ("pmix", ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE")),
    ("torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")),
    ("slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None)),
]


def detect(environ: Optional[Mapping[str, str]] = None) -> World:
    """This process's :class:`World` from the launcher's environment variables (or
    ``environ``); a single process when no launcher is recognised."""
    env = os.environ if environ is None else environ
    node = socket.gethostname()
    for launcher, (r, s, lr, ls) in _VARS:
        rank = _int(env, r)
        if rank is None:
            continue
        size = _int(env, s)
        if size is None and launcher == "pmix":
            size = _mpi_size()
        if size is None:
            continue
        local_size = _int(env, ls) if ls else None
        if launcher == "torchrun" and env.get(_RENDEZVOUS_ENV) == "slurm":
            launcher = "slurm"      # torch's variables are the ones slurm_rendezvous set
        return World(rank=rank, size=size, local_rank=_int(env, lr, 0) or 0,
                     local_size=local_size, launcher=launcher, node=node)
    return World(rank=0, size=1, local_rank=0, local_size=1, launcher="none", node=node)


def _mpi_size() -> Optional[int]:
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD.Get_size()


def _torch_initialised() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def resolve_comm(comm: Any = None) -> Any:
    """The communicator the data plane uses (see :mod:`forebay.comm`), or None for a
    single process.

    ``comm`` given: that communicator (an mpi4py communicator, a
    :class:`~forebay.comm.TorchComm`, or a torch.distributed process group, wrapped;
    :data:`LOCAL`: None).  Otherwise MPI's COMM_WORLD under an MPI launcher, or when
    mpi4py is already initialised; under torchrun, or once torch.distributed is
    initialised without MPI, forebay's own gloo group over the torch.distributed world
    (:func:`forebay.comm.torch_comm`); under another launcher of several ranks,
    COMM_WORLD if it spans them all.  A launcher that reports several ranks which the
    data plane cannot see raises :class:`LaunchError` on every rank, naming the
    launcher and the fix, instead of running as one rank.
    """
    if comm is LOCAL:
        return None
    if comm is not None:
        if type(comm).__name__ == "ProcessGroup":
            import torch.distributed as dist

            from .comm import TorchComm
            return TorchComm(comm, dist.get_process_group_ranks(comm))
        return comm
    world = detect()
    mpi_loaded = "mpi4py.MPI" in sys.modules
    if not world.is_mpi and not mpi_loaded and (world.launcher == "torchrun" and
                                                world.size > 1 or _torch_initialised()):
        return _torch_world(world)
    if world.size <= 1 and not world.is_mpi and not mpi_loaded:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        if world.size <= 1:
            return None
        if world.launcher == "slurm":       # srun without MPI: torch.distributed
            return _torch_world(world)
        raise LaunchError(
            f"{world.describe()}: the launcher started {world.size} ranks but mpi4py is "
            f"not installed, so forebay cannot reach the other ranks; pip install "
            f"'forebay[mpi]' (or mpi4py built against your MPI), or start the job with "
            f"torchrun") from None
    size = MPI.COMM_WORLD.Get_size()
    if size == world.size or world.size <= 1:
        return MPI.COMM_WORLD
    if size == 1 and world.launcher in ("slurm", "torchrun"):
        # srun without an MPI plug-in, or torchrun, with mpi4py loaded by the program or
        # an earlier store (MPI then runs as a singleton): the ranks meet over torch
        return _torch_world(world)
    raise LaunchError(_mismatch(world, size, "MPI"))


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list (``nid[0012-0015,0020],login1`` ->
    ``nid0012``)."""
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    if m is None or not (m.group(1) or m.group(2)):
        raise LaunchError(f"cannot read the Slurm host list {nodelist!r}")
    prefix, ranges, suffix = m.groups()
    first = ranges.split(",")[0].split("-")[0] if ranges else ""
    return prefix + first + (suffix or "")


def slurm_rendezvous(world: World, environ: "Optional[dict[str, str]]" = None) -> dict:
    """torch.distributed's variables for a job started by srun without MPI: RANK,
    WORLD_SIZE and LOCAL_RANK from Slurm's; MASTER_ADDR the step's first node;
    MASTER_PORT derived from the job and step ids (20000-39999).  Variables already
    set win.  Returns what was added to ``environ`` (default ``os.environ``)."""
    env: Any = os.environ if environ is None else environ
    nodes = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
             or env.get("SLURM_NODELIST"))
    want = {"RANK": str(world.rank), "WORLD_SIZE": str(world.size),
            "LOCAL_RANK": str(world.local_rank)}
    if nodes:
        want["MASTER_ADDR"] = first_host(nodes)
    job, step = _int(env, "SLURM_JOB_ID", 0) or 0, _int(env, "SLURM_STEP_ID", 0) or 0
    want["MASTER_PORT"] = str(20000 + (job * 131 + step) % 20000)
    added = {k: v for k, v in want.items() if k not in env}
    if "RANK" in added:
        added[_RENDEZVOUS_ENV] = "slurm"
    env.update(added)
    return added


def _torch_world(world: World) -> Any:
    """forebay's torch.distributed communicator for this job (torchrun, srun without
    MPI, or a program that initialised torch.distributed itself)."""
    from .comm import torch_comm

    if world.launcher == "slurm":
        slurm_rendezvous(world)
    try:
        tc = torch_comm()
    except LaunchError as e:
        raise LaunchError(f"{world.describe()}: {e}; or pass comm=forebay.world.LOCAL "
                          f"to read the whole dataset on every rank on purpose") from None
    if world.launcher in ("torchrun", "slurm") and tc.Get_size() != world.size:
        raise LaunchError(_mismatch(world, tc.Get_size(), "torch.distributed"))
    return tc


def _mismatch(world: World, seen: int, plane: str) -> str:
    if plane == "torch.distributed":
        fix = (f"torch.distributed's world has {seen} ranks: the program initialised it with "
               f"other ranks than the launcher's")
    else:
        fix = (f"MPI sees a world of {seen}: mpi4py is probably built against another "
               f"MPI than the launcher's (compare `python -c \"import mpi4py; "
               f"print(mpi4py.get_config())\"` with `which mpiexec`)")
    return (f"{world.describe()}: the launcher reports {world.size} ranks but forebay's data "
            f"plane ({plane}) sees {seen}, so every rank would read the whole dataset in "
            f"the same order. {fix}")


_abort_installed = False


def abort_on_uncaught(comm: Any) -> None:
    """Make an uncaught exception on this rank abort the whole MPI job (MPI_Abort on
    COMM_WORLD, as ``python -m mpi4py`` does), once the traceback is printed.

    Without it a rank that raises leaves the others waiting forever in their next
    collective (and itself in MPI_Finalize).  forebay's stores and loader call this
    when they join a job of several ranks; ``FOREBAY_ABORT_ON_ERROR=0`` turns it off.
    An exception the program catches changes nothing."""
    global _abort_installed
    if _abort_installed or comm is None or os.environ.get(ABORT_ENV, "1") == "0":
        return
    if type(comm).__module__.split(".")[0] != "mpi4py":
        return      # torchrun's agent ends the other ranks when one fails
    if comm.Get_size() <= 1:
        return
    from mpi4py import MPI

    previous = sys.excepthook
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()

    def hook(kind: Any, value: Any, tb: Any) -> None:
        try:
            previous(kind, value, tb)
            sys.stderr.write(f"forebay: rank {rank} of {size} ended with an uncaught "
                             f"{kind.__name__}; aborting the MPI job so that no other rank "
                             f"waits for it ({ABORT_ENV}=0 turns this off)\n")
            sys.stderr.flush()
            sys.stdout.flush()
            # the launcher forwards output asynchronously and MPI_Abort kills its
            # forwarders: give the traceback a moment to get out
            time.sleep(ABORT_GRACE_S)
        finally:
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook
    _abort_installed = True

#!/usr/bin/env python3
"""Run a job on an emulated cluster: N nodes as Linux namespaces on this machine (each
its own hostname, network, IPC, /dev/shm and local scratch; the rest of the file system
shared as a parallel file system), built for the job and removed after it.  Needs root.

    sudo .venv/bin/python scripts/cluster.py --nodes 4 --ppn 2 mpiexec -- python train.py
    sudo .venv/bin/python scripts/cluster.py --nodes 2 --ppn 2 torchrun -- train.py
    sudo .venv/bin/python scripts/cluster.py --nodes 4 srun -- python train.py
    sudo .venv/bin/python scripts/cluster.py --nodes 4 --mpi pmi2 srun -- python train.py
    sudo .venv/bin/python scripts/cluster.py --nodes 2 run 1 -- hostname
    sudo .venv/bin/python scripts/cluster.py --nodes 2 --cpus 1 --pfs /data/train.fb \
        --pfs-rate 300,3000 mpiexec -- python train.py    # reads $FOREBAY_CLUSTER_PFS

Inside the job, ``$FOREBAY_CLUSTER_SHARED`` is the shared directory (the cluster's
``shared/``) and ``$FOREBAY_CLUSTER_LOCAL`` each node's own scratch directory.  ``srun``
needs Slurm installed (Debian: ``apt-get install slurm-wlm munge``): the script starts
munged, slurmctld on node0 and a slurmd on every node for the job.  ``--pfs DIR``
serves DIR to every node read-only through a paced file system (tests/cluster_pfs.py:
``--pfs-rate MBPS[,IOPS]``, one queue, no credit for a reader's idle time), mounted at
``DIR-pfs`` before the nodes are made, each node a client of its own (its own page
cache); ``$FOREBAY_CLUSTER_PFS`` is that mount, and the bytes it served are said at the
end.  The cluster's
implementation, also the test suite's, is tests/cluster.py.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster import Cluster, slurm_unavailable, unavailable  # noqa: E402


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4, help="emulated nodes (default 4)")
    p.add_argument("--ppn", type=int, default=1, help="ranks per node (default 1)")
    p.add_argument("--shm", default="512", help="each node's /dev/shm in MiB (default 512)")
    p.add_argument("--root", help="the cluster's directory (default: a new one in /tmp)")
    p.add_argument("--cpus", type=float, default=None,
                   help="cores each node may use at most, e.g. 0.5 (default: the "
                        "machine's, shared by every node)")
    p.add_argument("--mpi", default=None,
                   help="srun's MPI plug-in (pmi2 for MPICH; default: none, the ranks "
                        "meet over torch.distributed)")
    p.add_argument("--pfs", type=Path, default=None,
                   help="serve this directory to the nodes through a paced file system "
                        "at DIR-pfs ($FOREBAY_CLUSTER_PFS)")
    p.add_argument("--pfs-rate", default="300,3000", metavar="MBPS[,IOPS]",
                   help="the paced file system's bandwidth and requests per second "
                        "(default 300,3000)")
    p.add_argument("how", choices=["mpiexec", "torchrun", "srun", "run"])
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="run: NODE -- COMMAND; else -- COMMAND")
    a = p.parse_args(argv)
    why = unavailable() or (slurm_unavailable() if a.how == "srun" else None)
    if why:
        print(f"cluster.py: {why}", file=sys.stderr)
        return 2
    cmd = [c for c in a.command if c != "--"] if a.command[:1] == ["--"] else a.command
    node = 0
    if a.how == "run":
        if not cmd or not cmd[0].isdigit():
            p.error("run needs a node number, then -- COMMAND")
        node, cmd = int(cmd[0]), [c for c in cmd[1:] if c != "--"][:]
    if not cmd:
        p.error("no command given")
    made = a.root is None
    root = Path(a.root) if a.root else Path(tempfile.mkdtemp(prefix="forebay-cluster-"))
    try:
        with contextlib.ExitStack() as stack:
            extra: dict[str, str] = {}
            if a.pfs is not None:          # mounted first: the nodes copy the host's mounts
                from cluster_pfs import PacedFS, unavailable as pfs_unavailable

                why = pfs_unavailable() or (None if a.pfs.is_dir() else
                                            f"{a.pfs} is not a directory")
                if why:
                    print(f"cluster.py: --pfs: {why}", file=sys.stderr)
                    return 2
                # a client per node (its own page cache) and one for this process
                fs = stack.enter_context(PacedFS.beside(a.pfs, a.pfs_rate, a.nodes + 1))
                stack.callback(lambda: print(f"cluster: the paced file system served "
                                             f"{fs.served_bytes / 1e6:,.1f} MB in "
                                             f"{fs.requests:,} requests", file=sys.stderr))
                extra["FOREBAY_CLUSTER_PFS"] = str(fs.mountpoint)
            c = stack.enter_context(
                Cluster(a.nodes, root / "c", shm_bytes=int(a.shm) << 20, cpus=a.cpus))
            if a.pfs is not None:
                fs.attach(c)
            return _run(a, c, cmd, node, extra)
    finally:
        if made:
            shutil.rmtree(root, ignore_errors=True)


def _run(a: argparse.Namespace, c: Cluster, cmd: list[str], node: int, extra: dict) -> int:
    """The job on cluster ``c``; its exit status."""
    env = c.env({"FOREBAY_CLUSTER_SHARED": str(c.shared),
                 "FOREBAY_CLUSTER_LOCAL": str(c.local), **extra})
    print(f"cluster: {a.nodes} nodes ({', '.join(c.hosts)}), shared {c.shared}",
          file=sys.stderr)
    if a.how == "torchrun":
        rs = c.torchrun(cmd, ppn=a.ppn, timeout=None, env=env, capture=False)
        return max(abs(r.returncode) for r in rs)
    if a.how == "srun":
        c.slurm_up()
        argv = c.srun_argv(cmd, ppn=a.ppn, mpi=a.mpi)
    else:
        argv = c.mpiexec_argv(cmd, ppn=a.ppn) if a.how == "mpiexec" else cmd
    return c.popen(node, argv, env=env).wait()


if __name__ == "__main__":
    sys.exit(main())

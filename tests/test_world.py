"""forebay.world: one detection of rank, size and launcher; a launcher whose ranks the
data plane cannot see fails on every rank instead of running each as a world of 1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import forebay
from forebay.world import LOCAL, detect, first_host, resolve_comm, slurm_rendezvous


@pytest.mark.parametrize("env, want", [
    ({}, (0, 1, 0, "none")),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (3, 8, 1, "openmpi")),
    ({"PMI_RANK": "5", "PMI_SIZE": "6", "MPI_LOCALRANKID": "2"}, (5, 6, 2, "pmi")),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
     (1, 4, 1, "torchrun")),
    ({"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3"}, (7, 16, 3, "slurm")),
    # torchrun under srun: torchrun's variables name the rank, Slurm's the node's task
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "RANK": "5", "WORLD_SIZE": "8"},
     (5, 8, 0, "torchrun")),
    # mpiexec under srun: MPI's variables win
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "PMI_RANK": "2", "PMI_SIZE": "4"},
     (2, 4, 0, "pmi")),
    ({"RANK": "x", "WORLD_SIZE": "2"}, (0, 1, 0, "none")),   # garbage is not a launcher
])
def test_detect_each_launcher(env, want):
    w = detect(env)
    assert (w.rank, w.size, w.local_rank, w.launcher) == want
    assert w.is_mpi == (w.launcher in ("openmpi", "pmi", "pmix"))


def test_single_process_and_local_mean_no_communicator():
    assert resolve_comm() is None and resolve_comm(LOCAL) is None
    sentinel = object()
    assert resolve_comm(sentinel) is sentinel


def test_launcher_world_without_a_data_plane_fails(tmp_path):
    """RANK=0 WORLD_SIZE=2 with no torch.distributed or MPI reachable (no MASTER_ADDR to
    meet at): the loader raises instead of reading the whole dataset as a world of 1
    (every rank alike).  A real torchrun job works: tests/mpi/test_torchrun.py."""
    forebay.write_dataset(tmp_path / "ds", [{"x": forebay.__version__.encode()}] * 10)
    code = ("import sys, forebay\nfrom forebay.torch import DataLoader\n"
            "try:\n    DataLoader(sys.argv[1], 2)\n"
            "except forebay.errors.LaunchError as e:\n    print('LaunchError', e); sys.exit(3)\n")
    for rank in ("0", "1"):
        env = dict(os.environ, RANK=rank, WORLD_SIZE="2", LOCAL_RANK=rank)
        p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ds")], env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 3, p.stderr[-2000:]
        assert f"rank {rank} of 2 (torchrun" in p.stdout and "forebay.world.LOCAL" in p.stdout
        assert "MASTER_ADDR" in p.stdout
    # on purpose, each rank alone
    p = subprocess.run([sys.executable, "-c", "import sys, forebay.world as w\n"
                        "from forebay.torch import DataLoader\n"
                        "print(len(list(DataLoader(sys.argv[1], 2, comm=w.LOCAL))))",
                        str(tmp_path / "ds")],
                       env=dict(os.environ, RANK="1", WORLD_SIZE="2"), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "5", p.stderr[-2000:]


@pytest.mark.parametrize("nodes, first", [("nid[0012-0015,0020],login1", "nid0012"),
                                          ("node1,node2", "node1"), ("c[3]", "c3"),
                                          ("gpu-a[01-02]-ib", "gpu-a01-ib"),
                                          ("localhost", "localhost")])
def test_first_host_of_a_slurm_host_list(nodes, first):
    assert first_host(nodes) == first


def test_slurm_rendezvous_fills_only_what_is_missing():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_STEP_NODELIST": "nid[0040-0043]", "SLURM_JOB_ID": "1234",
           "SLURM_STEP_ID": "2", "MASTER_PORT": "29400"}
    added = slurm_rendezvous(detect(env), env)
    assert added == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                     "MASTER_ADDR": "nid0040", "FOREBAY_RENDEZVOUS": "slurm"}
    assert env["MASTER_PORT"] == "29400"              # already set: kept
    assert detect(env).launcher == "slurm"            # still srun's job, not torchrun's
    env2 = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "1234",
            "SLURM_STEP_ID": "2", "SLURM_JOB_NODELIST": "a1"}
    slurm_rendezvous(detect(env2), env2)
    assert env2["MASTER_PORT"] == str(20000 + (1234 * 131 + 2) % 20000)
    assert env2["MASTER_ADDR"] == "a1"

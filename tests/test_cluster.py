"""forebay across real node boundaries: four emulated nodes on this machine
(tests/cluster.py: each node its own network, hostname, IPC, /dev/shm and local
scratch; the rest of the file system shared, as a parallel file system), real
``mpiexec`` (hydra entering each node in place of ssh), real ``torchrun`` (one
agent per node, c10d rendezvous on node0) and real ``srun`` (Slurm's daemons on the
nodes; with ``--mpi=pmi2`` and without MPI) across them.

Needs root and network namespaces (CI has both), and Slurm for the srun tests (.ci/run
installs it); elsewhere those tests are skipped with one line saying why."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import forebay
from cluster import Cluster, slurm_unavailable, unavailable
from conftest import rank_command, say

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]
MPI_TESTS = Path(__file__).parent / "mpi"
if str(MPI_TESTS) not in sys.path:      # the rank functions of tests/mpi run here too
    sys.path.insert(0, str(MPI_TESTS))

#: store kinds of tests/mpi/test_store_contract.py whose transport reaches across nodes,
#: with the transport each must report there (kind=transport; "arrays": ArrayStore)
ACROSS_MPI = ["preload-rma=rma", "preload-overlap=rma", "preload-overlap-rma=rma",
              "preload-exchange=exchange", "preload-overlap-exchange=exchange",
              "clairvoyant-ram=rma", "clairvoyant-rma=rma", "clairvoyant-ssd=rma",
              "clairvoyant-exchange=exchange", "arrays=rma"]
ACROSS_TORCH = ["preload-exchange=exchange", "preload-overlap=exchange",
                "preload-overlap-exchange=exchange", "clairvoyant-exchange=exchange",
                "clairvoyant-ram=exchange"]
#: (nodes, ranks per node) of the cross-node layouts
LAYOUTS = [(2, 2), (4, 1)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = unavailable()
    if why:
        pytest.skip(why)
    c = Cluster(4, tmp_path_factory.mktemp("cluster") / "c", shm_bytes=256 << 20)
    with c:
        yield c


@pytest.fixture(scope="module")
def dataset(cluster):
    """The contract suite's dataset, on the cluster's shared file system."""
    from test_store_contract import write_contract_dataset

    return write_contract_dataset(cluster.shared / "contract")


def run_mpi(cluster: Cluster, nodes: int, ppn: int, func, *args, timeout: int = 240,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """``func(*args)`` (a rank function of a test module) on every rank of real
    ``mpiexec`` across ``nodes`` nodes, ``ppn`` ranks each."""
    cmd, full_env = rank_command(func, args, env)
    return cluster.mpiexec([sys.executable, *cmd], nodes=nodes, ppn=ppn, timeout=timeout,
                           env=full_env)


def run_torch(cluster: Cluster, nodes: int, ppn: int, func, *args, timeout: int = 240,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """As :func:`run_mpi` under real ``torchrun``, one agent per node; the agents'
    outputs joined (node order)."""
    cmd, full_env = rank_command(func, args, env)
    return _joined(cluster.torchrun(cmd, nodes=nodes, ppn=ppn, timeout=timeout,
                                    env=full_env))


@pytest.fixture(scope="module")
def slurm(cluster):
    """The cluster with Slurm up (munged, slurmctld on node0, a slurmd per node)."""
    why = slurm_unavailable()
    if why:
        pytest.skip(why)
    cluster.slurm_up()
    return cluster


def run_srun(cluster: Cluster, nodes: int, ppn: int, func, *args, mpi: str | None = None,
             timeout: int = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """As :func:`run_mpi` under real ``srun`` (``--mpi=mpi``; None: without MPI, the
    ranks meet over torch.distributed from Slurm's variables)."""
    cmd, full_env = rank_command(func, args, env)
    return cluster.srun([sys.executable, *cmd], nodes=nodes, ppn=ppn, mpi=mpi,
                        timeout=timeout, env=full_env)


def _joined(out: list[subprocess.CompletedProcess]) -> subprocess.CompletedProcess:
    """The agents' outputs as one job's (node order), its worst exit status."""
    return subprocess.CompletedProcess([p.args for p in out],
                                       max(abs(p.returncode) for p in out),
                                       "".join(p.stdout for p in out),
                                       "".join(p.stderr for p in out))


def _why(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"


# -- the test bed itself ------------------------------------------------------------
def test_each_node_has_its_own_host_shm_and_scratch_and_shares_the_rest(cluster):
    (cluster.shared / "seen").write_text("everywhere")
    for k in range(cluster.nodes):
        r = cluster.run(k, ["sh", "-c", f"hostname; touch /dev/shm/mine-{k} "
                            f"{cluster.local}/mine-{k}; ls /dev/shm {cluster.local}; "
                            f"cat {cluster.shared / 'seen'}"])
        assert r.returncode == 0, r.stderr
        out = r.stdout.split()
        assert out[0] == f"node{k}"
        assert [f for f in out if f.startswith("mine-")] == [f"mine-{k}", f"mine-{k}"]
        assert out[-1] == "everywhere"
    assert not list(Path("/dev/shm").glob("mine-*"))       # nothing on the host's
    got = cluster.run(1, ["python3", "-c", "import socket; print(socket.gethostbyname("
                          "'node2'))"])
    assert got.stdout.strip() == cluster.address(2)


def rank_busy_where() -> None:
    """Say this rank's host and CPU group, after 0.2 s of CPU (more than half a core
    gives in 0.2 s of periods)."""
    import socket

    group = next(line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup")
                 if line.split(":")[1] in ("cpu", "cpu,cpuacct", ""))
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    say(f"GROUP {socket.gethostname()} {group}")


def test_nodes_capped_in_cpu_run_in_groups_of_their_own(tmp_path):
    """Cluster(cpus=0.5): every process a launcher starts on a node is in that node's
    CPU group, whose cap holds it back when it wants more."""
    from cluster_cpu import CpuGroups

    try:
        c = Cluster(2, tmp_path / "c", cpus=0.5).up()
    except RuntimeError as e:
        pytest.skip(str(e))
    with c:
        assert isinstance(c.cpu_groups, CpuGroups)
        p = run_mpi(c, 2, 2, rank_busy_where)
        assert p.returncode == 0, _why(p)
        seen = sorted(x.split()[1:] for x in p.stdout.splitlines() if x.startswith("GROUP "))
        assert seen == [[h, f"/{c.prefix}/{h}"] for h in ("node0", "node0", "node1", "node1")]
        for h in c.hosts:
            assert c.cpu_groups.stat(h)["nr_throttled"] > 0, h
    assert not c.cpu_groups.base.exists()


def test_a_paced_file_system_serves_every_node_read_only_and_never_above_its_rate(tmp_path):
    """PacedFS (the benchmarks' ``--fs fuse``): mounted before the nodes, every node
    reads the directory through it, bit-exact, and cannot write; a forebay dataset reads
    through it as from its own files; a cold read reaches the server again; and its
    schedule never serves faster than its rate nor earlier than a request came."""
    import hashlib

    from cluster_pfs import PacedFS, unavailable as pfs_unavailable
    from test_store_contract import write_contract_dataset

    for why in (unavailable(), pfs_unavailable()):
        if why:
            pytest.skip(why)
    src = tmp_path / "src"
    ds = forebay.open_dataset(write_contract_dataset(src / "contract"))
    (src / "plain").write_bytes(np.random.default_rng(1).bytes(300_000))
    with PacedFS(src, tmp_path / "pfs", mbps=200, iops=2000) as fs, \
            Cluster(2, tmp_path / "c").up() as c:
        plain = fs.path(src / "plain")
        for k in range(2):
            r = c.run(k, ["sh", "-c", f"sha256sum {plain}; touch {plain.parent}/new 2>&1 "
                          f"|| echo refused"])
            assert r.returncode == 0, r.stderr
            digest, said = r.stdout.split("\n", 1)
            assert digest.split()[0] == hashlib.sha256((src / "plain").read_bytes()).hexdigest()
            assert "Read-only file system" in said and "refused" in said
        assert not (src / "new").exists()
        through = forebay.open_dataset(fs.path(src / "contract"))
        ids = np.random.default_rng(2).permutation(len(ds))
        assert through.get_many(ids).equals(ds.get_many(ids))
        served = fs.served_bytes
        fd = os.open(plain, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        assert plain.read_bytes() == (src / "plain").read_bytes()
        assert fs.served_bytes >= served + 300_000
    assert fs.error is None and not os.path.ismount(tmp_path / "pfs")
    assert fs.cpu_seconds() > 0
    sched = np.array(fs.schedule)
    assert len(sched) >= 4
    arrival, start, end, nbytes = sched.T
    assert (start >= arrival).all()                   # idle time is not saved up
    assert (start[1:] >= end[:-1] - 1e-9).all()       # one queue
    assert (end - start >= np.maximum(nbytes / 200e6, 1 / 2000) - 1e-9).all()


def test_each_node_of_a_paced_file_system_caches_only_what_it_read(tmp_path):
    """PacedFS(clients=3).attach(cluster): each node reads through a client of its own,
    as a cluster's nodes do, so its page cache holds what it read and nothing another
    node read: a file node 0 read is served to node 1 again, node 0's second read is
    not; this process is a client of its own too; evict() empties every client's."""
    import hashlib

    from cluster_pfs import PacedFS, unavailable as pfs_unavailable

    for why in (unavailable(), pfs_unavailable()):
        if why:
            pytest.skip(why)
    src = tmp_path / "src"
    src.mkdir()
    data = np.random.default_rng(4).bytes(400_000)
    (src / "f").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    with PacedFS(src, tmp_path / "pfs", mbps=2000, clients=3) as fs, \
            Cluster(2, tmp_path / "c").up() as c:
        with pytest.raises(ValueError, match="3 nodes need clients=4"):
            fs.attach(Cluster(3, tmp_path / "never"))
        fs.attach(c)
        f = fs.path(src / "f")

        def served_to(k: int) -> int:
            before = fs.served_bytes
            r = c.run(k, ["sha256sum", str(f)])
            assert r.returncode == 0 and r.stdout.split()[0] == digest, r.stderr
            return fs.served_bytes - before

        assert served_to(0) >= len(data)
        assert served_to(0) == 0                  # node 0's own cache
        assert served_to(1) >= len(data)          # not node 0's
        before = fs.served_bytes
        assert f.read_bytes() == data             # this process: client 0
        assert fs.served_bytes - before >= len(data)
        assert served_to(1) == 0
        assert fs.evict([f]) == len(data)
        assert served_to(0) >= len(data) and served_to(1) >= len(data)
    assert fs.error is None
    assert not any(p.name.startswith(".pfs-client") for p in tmp_path.iterdir())


def test_the_cluster_script_gives_each_node_its_own_client_of_the_paced_file_system(tmp_path):
    """``scripts/cluster.py --pfs DIR``: every node reads DIR through the paced mount,
    bit-exact, and caches what it read itself: two nodes reading a file twice each
    are served it twice, not once, nor four times."""
    import hashlib

    from cluster_pfs import unavailable as pfs_unavailable

    for why in (unavailable(), pfs_unavailable()):
        if why:
            pytest.skip(why)
    data = np.random.default_rng(5).bytes(3_000_000)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "f").write_bytes(data)
    script = Path(__file__).resolve().parents[1] / "scripts" / "cluster.py"
    p = subprocess.run([sys.executable, str(script), "--nodes", "2", "--root",
                        str(tmp_path / "c"), "--pfs", str(tmp_path / "data"), "--pfs-rate",
                        "500", "mpiexec", "--", "sh", "-c",
                        "sha256sum $FOREBAY_CLUSTER_PFS/f; sha256sum $FOREBAY_CLUSTER_PFS/f"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    digest = hashlib.sha256(data).hexdigest()
    assert [line.split()[0] for line in p.stdout.splitlines()] == [digest] * 4
    assert "the paced file system served 6.0 MB in" in p.stderr, p.stderr


def rank_read_the_plan(path: str, kind: str, epochs: str) -> None:
    """Every batch of the plan through a preload or clairvoyant store over ``path``,
    the dataset's files evicted from this node's page cache before each epoch."""
    from mpi4py import MPI

    from forebay.store import ClairvoyantStore, DistributedStore

    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(path)
    plan = forebay.AccessPlan(len(ds), comm.size, 8, int(epochs), seed=0)
    store = DistributedStore(ds, comm, transport="rma") if kind == "preload" else \
        ClairvoyantStore(ds, plan, comm, ram_bytes=int(ds.record_nbytes.sum()),
                         transport="rma", ram_tier="copy")
    for epoch in range(plan.epochs):
        comm.Barrier()
        if comm.rank == 0:
            for shard in ds.manifest.shards:
                fd = os.open(Path(path) / shard.data, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        comm.Barrier()
        for ids in plan.batches(comm.rank, epoch):
            store.get_many(ids)
    store.close()


@pytest.mark.parametrize("kind", ["preload", "clairvoyant"])
def test_the_simulator_and_the_file_system_count_the_same_bytes(tmp_path, kind):
    """The model's bytes from the file system (issue R) against what a paced file
    system served to the same plan run across two nodes, the files evicted before
    every epoch: a preload reads each sample once, as the model says, whatever the
    epochs; clairvoyant caching that holds the dataset at most once per rank."""
    from dataclasses import replace

    from cluster_pfs import PacedFS, unavailable as pfs_unavailable
    from forebay.sim import Workload, lassen, simulate_policy

    for why in (unavailable(), pfs_unavailable()):
        if why:
            pytest.skip(why)
    rng = np.random.default_rng(3)
    src = tmp_path / "src"
    forebay.write_dataset(src / "d.fb", ({"x": rng.bytes(int(rng.integers(10_000, 30_000)))}
                                         for _ in range(400)), shard_bytes=2 << 20)
    ds = forebay.open_dataset(src / "d.fb")
    with PacedFS(src, tmp_path / "pfs", mbps=2000) as fs, \
            Cluster(2, tmp_path / "c").up() as c:
        p = run_mpi(c, 2, 1, rank_read_the_plan, str(fs.path(src / "d.fb")), kind, "3")
        assert p.returncode == 0, _why(p)
        served = fs.served_bytes
    plan = forebay.AccessPlan(len(ds), 2, 8, 3, seed=0)
    sysm = replace(lassen(), ram_bytes=int(ds.record_nbytes.sum()), ssd_bytes=0)
    model = simulate_policy(f"forebay-{kind}", Workload(ds.record_nbytes, plan, sysm))
    data = sum(s.data_nbytes for s in ds.manifest.shards)
    assert model["pfs_MB"] == pytest.approx(ds.record_nbytes.sum() / 1e6, rel=1e-6)
    meta = sum(f.stat().st_size for f in (src / "d.fb").iterdir()
               if f.name not in {s.data for s in ds.manifest.shards})
    if kind == "preload":
        # the shards once (each rank its chunk; the rest over RMA, every epoch), and
        # the index and manifest each rank opened
        assert data <= served <= data + 2 * meta
        assert served / 1e6 == pytest.approx(model["pfs_MB"], rel=0.05)
    else:
        # a rank reads each sample into its tier once at most; in a cold epoch a batch
        # that needs a peer's sample before the peer filled it reads it from the files
        # too (the model counts one read: the runs of RESULTS measured 1.00x at 6,000
        # samples)
        assert data <= served <= 2 * data + 2 * meta


def rank_where() -> None:
    import socket

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    every = comm.allgather(socket.gethostname())
    if comm.rank == 0:
        say("HOSTS " + json.dumps(every))


@pytest.mark.parametrize("nodes, ppn", LAYOUTS)
def test_mpiexec_places_ranks_on_the_nodes_in_order(cluster, nodes, ppn):
    p = run_mpi(cluster, nodes, ppn, rank_where)
    assert p.returncode == 0, _why(p)
    line = next(x for x in p.stdout.splitlines() if x.startswith("HOSTS "))
    assert json.loads(line[6:]) == [f"node{r // ppn}" for r in range(nodes * ppn)]


def rank_world_where() -> None:
    import socket

    from forebay.world import detect

    w = detect()
    say(f"WORLD {w.rank} {w.size} {w.launcher} {w.node} {socket.gethostname()}")


@pytest.mark.parametrize("mpi, launcher", [(None, "slurm"), ("pmi2", "pmi")])
def test_srun_places_tasks_on_the_nodes_and_forebay_knows_them(slurm, mpi, launcher):
    p = run_srun(slurm, 2, 2, rank_world_where, mpi=mpi)
    assert p.returncode == 0, _why(p)
    seen = sorted(x.split()[1:] for x in p.stdout.splitlines() if x.startswith("WORLD "))
    assert seen == [[str(r), "4", launcher, f"node{r // 2}", f"node{r // 2}"]
                    for r in range(4)], p.stdout


# -- the store contract across nodes --------------------------------------------------
def rank_contracts(path: str, kinds: str) -> None:
    from test_store_contract import rank_contracts as contracts

    contracts(path, kinds)


_jobs: dict = {}


#: launches of a job whose pmi2 start-up came garbled (see _pmi2_garbled)
PMI2_TRIES = 3
#: why a test skips when every launch was garbled: the scenario never ran
PMI2_SKIP = (f"Slurm's pmi2 plug-in garbled MPICH's start-up {PMI2_TRIES} times in a row "
             f"(MPI_Init failed, or hung, before forebay ran): the scenario could not run")


def _pmi2_skip(output: str) -> str:
    """PMI2_SKIP with the last try's own words (its last lines naming pmi2 or UCX), so
    that a CI log that skipped says how the start-up failed."""
    said = [x.strip() for x in output.splitlines() if re.search(r"pmi2|UCX", x)]
    return f"{PMI2_SKIP}; the last try said: {' | '.join(said[-2:])[:300] or '(nothing)'}"


def _pmi2_garbled(stderr: str) -> bool:
    """Slurm 22.05's pmi2 plug-in now and then receives garbage for MPICH's start-up
    message ("value not properly terminated in client request"; the "full request" it
    prints is bytes of Python files the rank had read, as if a buffer went out
    unfilled), and MPI_Init fails: before forebay runs, so the job is launched again
    (up to PMI2_TRIES times; such a try ends within seconds)."""
    return "mpi/pmi2" in stderr


#: seconds an srun + MPI contract job may take (it takes 11-25 s): Slurm's pmi2
#: start-up, when it garbles, sometimes hangs MPI_Init instead of failing at once
PMI2_HANG_S = 120


def _srun_try(cluster, args: tuple, mpi: bool, env: dict) -> subprocess.CompletedProcess:
    """One srun launch of a contract job; under ``--mpi=pmi2`` a launch that does not
    end within PMI2_HANG_S is cancelled and reported as the garble it comes from
    (stderr names pmi2), so it is launched again like one that failed at once."""
    if not mpi:
        return run_srun(*args, env=env, timeout=400)
    try:
        return run_srun(*args, mpi="pmi2", env=env, timeout=PMI2_HANG_S)
    except subprocess.TimeoutExpired:
        cluster.run(0, ["scancel", "--user", "root"], env=cluster.env())
        return subprocess.CompletedProcess(
            [], -9, "", f"mpi/pmi2: the job did not end within {PMI2_HANG_S} s (its start-up "
                        f"hung); cancelled")


def _contract_job(cluster, dataset, launcher: str, nodes: int, ppn: int):
    """One job per launcher and layout runs every contract (cached for the tests)."""
    key = (launcher, nodes, ppn)
    if key not in _jobs:
        mpi = launcher in ("mpiexec", "srun --mpi=pmi2")
        kinds = ",".join(ACROSS_MPI if mpi else ACROSS_TORCH)
        env = {"PYTHONPATH": os.pathsep.join([str(MPI_TESTS), os.environ.get("PYTHONPATH", "")])}
        args = (cluster, nodes, ppn, rank_contracts, dataset, kinds)
        if launcher.startswith("srun"):
            p = _srun_try(cluster, args, mpi, env)
            for _ in range(PMI2_TRIES - 1):
                if not (mpi and p.returncode and "contract" not in p.stdout and
                        _pmi2_garbled(p.stderr)):
                    break
                p = _srun_try(cluster, args, mpi, env)
            _jobs[key] = p
        else:
            run = run_mpi if launcher == "mpiexec" else run_torch
            _jobs[key] = run(*args, env=env, timeout=400)
    return _jobs[key]


# torchrun at 4 nodes x 1 only: its 2 x 2 layout runs the same torch.distributed
# transports as srun's (test_store_contract_across_nodes_under_srun)
@pytest.mark.parametrize("launcher, item, nodes, ppn",
                         [("mpiexec", k, n, p) for k in ACROSS_MPI for n, p in LAYOUTS] +
                         [("torchrun", k, 4, 1) for k in ACROSS_TORCH])
def test_store_contract_across_nodes(cluster, dataset, nodes, ppn, launcher, item):
    p = _contract_job(cluster, dataset, launcher, nodes, ppn)
    kind = item.split("=")[0]
    assert p.stdout.count(f"contract {kind} ok") == nodes * ppn, _why(p)


@pytest.mark.parametrize("launcher, item", [("srun --mpi=pmi2", k) for k in ACROSS_MPI] +
                         [("srun", k) for k in ACROSS_TORCH])
def test_store_contract_across_nodes_under_srun(slurm, dataset, launcher, item):
    """Every store over srun at 2 nodes x 2 tasks: MPI's transports under
    ``--mpi=pmi2``, the exchange over torch.distributed without MPI."""
    p = _contract_job(slurm, dataset, launcher, 2, 2)
    if p.returncode and "contract" not in p.stdout and _pmi2_garbled(p.stderr):
        pytest.skip(_pmi2_skip(p.stdout + p.stderr))
    kind = item.split("=")[0]
    assert p.stdout.count(f"contract {kind} ok") == 4, _why(p)


def rank_shm_across(path: str) -> None:
    from mpi4py import MPI

    from forebay.store import DistributedStore, StoreError

    try:
        DistributedStore(path, MPI.COMM_WORLD, transport="shm", progress=False)
    except StoreError as e:
        say(f"REFUSED {e}")
        return
    raise AssertionError("a shm store across nodes was built")


def test_shared_memory_across_nodes_is_refused_on_every_rank(cluster, dataset):
    p = run_mpi(cluster, 2, 2, rank_shm_across, dataset)
    assert p.returncode == 0, _why(p)
    refused = [x for x in p.stdout.splitlines() if x.startswith("REFUSED ")]
    assert len(refused) == 4 and all("needs every replica group on one node" in x
                                     for x in refused), refused


def rank_node_aware(path: str) -> None:
    import socket

    from mpi4py import MPI

    from forebay.store import DistributedStore

    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(path)
    store = DistributedStore(ds, comm, node_aware=True, progress=False)
    hosts = comm.allgather(socket.gethostname())
    mates = [r for r in range(comm.size) if hosts[r] == hosts[comm.rank]]
    assert store.width == len(mates) and store.group_ranks.tolist() == mates
    assert store.transport in ("shm", "pages"), store.transport
    every = np.arange(len(ds))
    assert set(store.owner(every).tolist()) == set(mates)   # every read stays on the node
    assert store.get_many(every).equals(ds.get_many(every))
    st = store.stats()
    assert st["fetches_by_source"].get("pfs", 0) == 0
    store.close()
    say(f"NODE-AWARE {comm.rank} ok")


def test_node_aware_replica_groups_are_the_nodes(cluster, dataset):
    p = run_mpi(cluster, 2, 2, rank_node_aware, dataset)
    assert p.returncode == 0 and p.stdout.count("NODE-AWARE") == 4, _why(p)


# -- the loader across nodes ----------------------------------------------------------
@pytest.fixture(scope="module")
def labelled(cluster):
    path = cluster.shared / "lab.fb"
    forebay.write_dataset(path, ({"label": np.int64(i), "v": np.full(i % 7, i, np.float32)}
                                 for i in range(101)), shard_bytes=4096)
    return path


@pytest.mark.parametrize("nodes, ppn, width", [(2, 2, 0), (4, 1, 2)])
def test_global_batches_across_nodes_are_the_plans(cluster, labelled, nodes, ppn, width):
    from test_loader import GLOBAL_BATCH, rank_global_batches

    p = run_mpi(cluster, nodes, ppn, rank_global_batches, labelled, width, "-")
    assert p.returncode == 0, _why(p)
    line = next(x for x in p.stdout.splitlines() if x.startswith("GLOBAL "))
    plan = forebay.AccessPlan(101, 1, GLOBAL_BATCH, 2, seed=5)
    assert json.loads(line[7:]) == [[e] + g.tolist() for e in range(2)
                                    for g in plan.global_batches(e)]


# -- node faults ------------------------------------------------------------------------
def _launch(cluster: Cluster, launcher: str, cmd: list[str], env: dict, *, nodes: int = 2,
            ppn: int = 1, port: int = 29411, mpi: str | None = None) -> list[subprocess.Popen]:
    """The job's launcher processes, their output piped: mpiexec or srun on node0, or
    one torchrun agent per node (node0's first)."""
    on: "list[int] | range" = [0]
    if launcher == "torchrun":
        argv, on = cluster.torchrun_argv(cmd, nodes=nodes, ppn=ppn, port=port), range(nodes)
    elif launcher == "srun":
        argv = cluster.srun_argv([sys.executable, *cmd], nodes=nodes, ppn=ppn, mpi=mpi)
    else:
        argv = cluster.mpiexec_argv([sys.executable, *cmd], nodes=nodes, ppn=ppn)
    return [cluster.popen(k, argv, env=cluster.env(env), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) for k in on]


class JobDidNotStart(AssertionError):
    """The job ended, or did not say TRAINING in time, before any fault: its stderr."""


def _pump(stream, into: list, training: "threading.Event | None") -> None:
    for line in stream:
        into.append(line)
        if training is not None and line.startswith("TRAINING"):
            training.set()


def _fault_mid_training(jobs: list[subprocess.Popen], fault, after=None,
                        start_timeout: float = 180.0, stalled: str = ""
                        ) -> tuple[int, str, float]:
    """Once the job trains (rank 0 says TRAINING), ``fault()``; node0's launcher gets 60
    s to end.  Every launcher process is ended whatever happens, and ``after()`` run
    once the fault was made.  Raises :class:`JobDidNotStart` (with node0's stderr) when
    the job ends or stays silent for ``start_timeout`` s before TRAINING, or 3 s after
    its stderr said ``stalled`` (a start-up that never recovers once it says so; a
    healthy start says nothing on stderr before TRAINING).  Returns
    node0's launcher's exit status, its stderr and the seconds it took."""
    job = jobs[0]
    out: list[str] = []
    err: list[str] = []
    training = threading.Event()
    pumps = [threading.Thread(target=_pump, args=(job.stdout, out, training), daemon=True),
             threading.Thread(target=_pump, args=(job.stderr, err, None), daemon=True)]
    for t in pumps:
        t.start()
    faulted = False
    try:
        began = time.monotonic()
        deadline = began + start_timeout
        while not training.wait(0.5):
            if stalled and deadline - time.monotonic() > 3 and stalled in "".join(err):
                deadline = time.monotonic() + 3
            if job.poll() is not None or time.monotonic() > deadline:
                state = (f"ended with status {job.returncode}" if job.poll() is not None
                         else f"said nothing for {time.monotonic() - began:.0f} s")
                job.kill()
                job.wait()
                for t in pumps:
                    t.join(timeout=10)
                raise JobDidNotStart(f"the job {state} before training: "
                                     f"{''.join(err)[-4000:]}")
        faulted = True
        fault()
        t0 = time.monotonic()
        job.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        for j in jobs:
            if j.poll() is None:
                j.kill()
            if j is job:
                j.wait()
            else:
                j.communicate()
        for t in pumps:
            t.join(timeout=10)
        for f in (job.stdout, job.stderr):
            if f is not None:
                f.close()
        if after is not None and faulted:
            after()
    return job.returncode, "".join(err), took


def _ranks_left(cluster: Cluster, k: int, within: float = 15.0) -> list[str]:
    """The command lines of the job's rank processes still on node ``k`` once ``within``
    s have passed (a rank that its launcher just killed may take a moment to exit)."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for p in cluster.node_pids(k):
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")
            except OSError:                      # it exited meanwhile
                continue
            if "rank_main" in cmd:
                left.append(cmd)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


#: under srun --mpi=pmi2 and load, MPICH (the PyPI wheel, UCX) can die of SIGSEGV inside
#: MPI_Alltoallv on node0 once node1 is gone, seconds before forebay's deadline (a core
#: dump, 2026-11-29: PMPI_Alltoallv_c -> libmpi's own frames -> SIGSEGV; faulthandler:
#: forebay's all-to-all of the data plane in the prefetch thread, the watchdog asleep):
#: the job still ends, srun naming node1, but forebay never got to say so
MPICH_CRASH = ("MPICH died of SIGSEGV inside MPI_Alltoallv once node1 was gone, before "
               "forebay's deadline (the job ended; srun named node1): ")


def _mpich_crashed(err: str) -> bool:
    return ("node0: task 0: Segmentation fault" in err and "Node failure on node1" in err
            and "forebay: rank 0 on node0" not in err)


def _ended_naming(code: int, err: str, took: float, names: str) -> None:
    """node0's side of the job failed within 30 s, rank 0 with one line saying
    ``names`` (the node gone and what the probe saw)."""
    assert code != 0
    assert took < 30, f"node0's side took {took:.1f} s to end"
    lines = [x for x in err.splitlines() if x.startswith("forebay: rank 0 on node0")]
    assert len(lines) == 1, err[-4000:]
    assert names in lines[0], lines[0]


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_a_node_whose_processes_die_ends_the_job_on_every_node(cluster, labelled, launcher):
    cmd, env = rank_command(rank_train_exchange, [labelled, "auto"])

    def kill() -> None:
        assert cluster.kill_node(1) > 0

    code, err, took = _fault_mid_training(
        _launch(cluster, launcher, cmd, env, ppn=2, port=29431), kill)
    assert code != 0
    assert took < 30, f"the survivors took {took:.1f} s to end"
    if launcher == "torchrun":         # gloo's reset becomes one line per rank of node0
        for r in (0, 1):
            lines = [x for x in err.splitlines() if x.startswith(f"forebay: rank {r} on node0")]
            # rank 1 may be ended by its agent (rank 0 failed) before its probe is done;
            # a probe made while node1 is being killed may find one of its ranks alive
            assert len(lines) == (1 if r == 0 else len(lines[:1])), err[-4000:]
            assert all(re.search(r"node1 \(ranks? (2|3|2, 3): the node answers, the rank "
                                 r"does not: its process is gone\)", x) for x in lines), \
                err[-4000:]
    assert not _ranks_left(cluster, 0)                  # nothing of the job on node0
    r = cluster.run(0, ["sh", "-c", "ls /dev/shm"])
    assert "forebay" not in r.stdout, r.stdout          # no segment left on node0


@pytest.mark.parametrize("mpi", [None, "pmi2"])
def test_a_node_that_dies_ends_the_srun_job_on_every_node(slurm, labelled, mpi):
    """Every process of node1 killed (its slurmd too) mid-epoch under srun: node0's
    ranks end within 30 s, each with one line naming node1, nothing left in /dev/shm."""
    cmd, env = rank_command(rank_train_exchange, [labelled, "exchange"],
                            {"FOREBAY_PEER_TIMEOUT": "5"})

    def kill() -> None:
        assert slurm.kill_node(1, daemons=True) > 0

    for attempt in range(1, PMI2_TRIES + 1):
        try:
            # a job that starts says TRAINING within seconds; a garbled start ends within
            # seconds, or hangs after saying so: the tries fit the test's time
            code, err, took = _fault_mid_training(_launch(slurm, "srun", cmd, env, mpi=mpi),
                                                  kill, lambda: slurm.slurm_restore(1),
                                                  start_timeout=100, stalled="mpi/pmi2")
            break
        except JobDidNotStart as e:
            if not _pmi2_garbled(str(e)):
                raise
            if attempt == PMI2_TRIES:
                pytest.skip(_pmi2_skip(str(e)))
    if mpi == "pmi2" and code != 0 and took < 30 and _mpich_crashed(err):
        pytest.skip(MPICH_CRASH + err.strip().splitlines()[0])
    _ended_naming(code, err, took, "node1 (rank 1: the node answers, the rank does not: "
                  "its process is gone)")
    assert "Traceback" not in err, err[-4000:]
    r = slurm.run(0, ["sh", "-c", "ls /dev/shm"])
    assert "forebay" not in r.stdout, r.stdout


def rank_train_exchange(path: str, transport: str) -> None:
    """Epochs of batches until killed, under either launcher, over ``transport``; rank
    0 says when the first batch is in."""
    from forebay.torch import DataLoader, Pipeline, Preload

    dl = DataLoader(path, 4, seed=1, epochs=1000, store=Preload(transport=transport),
                    pipeline=Pipeline(collate_fn=lambda b: b.ids.copy()))
    rank = int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0")))
    for epoch in range(1000):
        dl.set_epoch(epoch)
        for _ in dl:
            if epoch == 0 and rank == 0:
                say("TRAINING")


@pytest.mark.parametrize("launcher, transport", [("mpiexec", "rma"), ("mpiexec", "exchange"),
                                                 ("torchrun", "exchange")])
def test_a_cut_link_ends_the_job_with_one_error_naming_the_node(cluster, labelled, launcher,
                                                                 transport):
    """node1's link goes down mid-epoch: the ranks on node0 end within the deadline
    (FOREBAY_PEER_TIMEOUT, 3 s here) plus a probe, each with one line naming node1
    and what the probe saw, nothing left in node0's /dev/shm."""
    cmd, env = rank_command(rank_train_exchange, [labelled, transport],
                            {"FOREBAY_PEER_TIMEOUT": "3"})

    def restore() -> None:
        cluster.kill_node(1)            # the cut node's launcher may wait on for node0
        cluster.restore_link(1)

    code, err, took = _fault_mid_training(_launch(cluster, launcher, cmd, env),
                                          lambda: cluster.cut_link(1), restore)
    _ended_naming(code, err, took, "node1 (rank 1: the node does not answer: it is down "
                  "or its link is cut)")
    # no traceback from the ranks (torchrun's agent prints its own for a failed worker)
    agent = 1 if launcher == "torchrun" and "ChildFailedError" in err else 0
    assert err.count("Traceback") == agent, err[-4000:]
    r = cluster.run(0, ["sh", "-c", "ls /dev/shm"])
    assert "forebay" not in r.stdout, r.stdout


def rank_ddp_steps(path: str) -> None:
    """DDP steps over a loader that never waits on a peer (direct reads): a hang can
    only be in the loop's own all-reduce; rank 0 says when training."""
    import torch

    import forebay.reduce as fr
    from forebay.torch import DataLoader, Pipeline

    rank, _ = fr.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    dl = DataLoader(path, 4, seed=1, epochs=1000, store="direct",
                    pipeline=Pipeline(collate_fn=lambda b: b.ids.copy()))
    for epoch in range(1000):
        dl.set_epoch(epoch)
        for _ in dl:
            model(torch.ones(1, 1)).sum().backward()
            if epoch == 0 and rank == 0:
                say("TRAINING")


def test_a_node_that_stops_answering_mid_all_reduce_ends_the_job_by_name(cluster, labelled):
    """node1's link cut while the ranks are in DDP's all-reduce (gloo waits 300 s, the
    process group's timeout): the loader watches the loop's step between two batches,
    so node0's rank ends within the deadline with one line naming node1 (the recovery
    benchmark found the job hanging there for minutes)."""
    cmd, env = rank_command(rank_ddp_steps, [labelled], {"FOREBAY_PEER_TIMEOUT": "3"})

    def restore() -> None:
        cluster.kill_node(1)
        cluster.restore_link(1)

    code, err, took = _fault_mid_training(_launch(cluster, "mpiexec", cmd, env),
                                          lambda: cluster.cut_link(1), restore)
    _ended_naming(code, err, took, "node1 (rank 1: the node does not answer: it is down "
                  "or its link is cut)")
    assert "the training step after batch" in err, err[-3000:]


def test_a_slow_link_only_slows_the_job(cluster, labelled):
    """node1's link capped at 4 Mbit/s with a 50 ms queue, and a deadline (0.2 s) shorter
    than its waits: every probe finds node1 alive, so the job runs to the end with the
    plan's batches."""
    from test_loader import GLOBAL_BATCH, rank_global_batches

    cluster.cap_link(1, 4)
    try:
        p = run_mpi(cluster, 2, 1, rank_global_batches, labelled, 0, "-",
                    env={"FOREBAY_PEER_TIMEOUT": "0.2"})
    finally:
        cluster.uncap_link(1)
    assert p.returncode == 0, _why(p)
    line = next(x for x in p.stdout.splitlines() if x.startswith("GLOBAL "))
    plan = forebay.AccessPlan(101, 1, GLOBAL_BATCH, 2, seed=5)
    assert json.loads(line[7:]) == [[e] + g.tolist() for e in range(2)
                                    for g in plan.global_batches(e)]


# -- a lost node costs minutes, not the run (issue T) ----------------------------------
#: the global batch of the elastic tests: the same at 3 and 2 ranks
ELASTIC_BATCH = 12


def rank_train_checkpointed(path: str, repo: str, out: str, hold_at_world: str = "0"
                            ) -> None:
    """DDP training with a Checkpoint every 3 steps over a preloaded store; each step's
    ids go to ``out/rank-R-world-W-from-S.jsonl`` as they come; rank 0 says RESTORED
    <step> and, at the attempt's 7th step, TRAINING (the cue for a fault).  An attempt
    at ``hold_at_world`` ranks stops after its 7th step, rank 0 saying HOLDING, until
    its launcher ends it (the cue for a node to join)."""
    import time

    import torch

    import forebay.reduce as fr
    from forebay.torch import Checkpoint, DataLoader, Pipeline

    rank, world = fr.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(path, ELASTIC_BATCH // world, seed=1, epochs=3, store="preload",
                        pipeline=Pipeline(collate_fn=lambda b: b.ids.copy()))
    ckpt = Checkpoint(repo, loader=loader, model=model, optimizer=opt, every_steps=3)
    start = ckpt.restore()
    if rank == 0:
        say(f"RESTORED {start} AT WORLD {world}")
    if start:                    # how it read the state: once, broadcast across the nodes
        Path(out, f"restore-{rank}-world-{world}-from-{start}.json").write_text(
            json.dumps(ckpt.restore_stats))
    log = Path(out, f"rank-{rank}-world-{world}-from-{start}.jsonl").open("w")
    ran = 0
    for epoch in range(loader.epoch, 3):
        loader.set_epoch(epoch)
        for ids in loader:
            model(torch.ones(1, 1)).sum().backward()
            opt.step()
            log.write(json.dumps([ckpt.step_count, ids.tolist()]) + "\n")
            log.flush()
            ckpt.step()
            ran += 1
            if ran == 7 and rank == 0:
                say("TRAINING")
            if ran == 7 and world == int(hold_at_world):
                ckpt.wait()                     # the step-6 save is whole
                if rank == 0:
                    say("HOLDING")
                time.sleep(300)
                raise AssertionError("held for 300 s: no node joined")
    ckpt.close()
    loader.close()


def _global_steps(out: Path, world: int, start: int) -> dict[int, list[int]]:
    """Each step's global batch (sorted ids) that an attempt's ranks logged; a step
    not every rank logged (the attempt died in it) is left out."""
    steps: dict[int, list[int]] = {}
    ranks: dict[int, int] = {}
    for r in range(world):
        f = out / f"rank-{r}-world-{world}-from-{start}.jsonl"
        for line in f.read_text().splitlines():
            step, ids = json.loads(line)
            steps.setdefault(step, []).extend(ids)
            ranks[step] = ranks.get(step, 0) + 1
    return {k: sorted(v) for k, v in steps.items() if ranks[k] == world}


def _assert_the_plans_run(out: Path, worlds: list[int]) -> list[tuple[int, int]]:
    """The attempts' logs in ``out``, in the order they ran, are one run of the plan:
    each attempt at its world size (``worlds``) began where it restored, after a step
    already run (from a save: later each time), every logged step the plan's global
    batch, every step to the end; each restore read the replicated state on one rank
    and broadcast it.  Returns each attempt's (world, first step)."""
    plan = forebay.AccessPlan(101, 1, ELASTIC_BATCH, 3, seed=1)
    want = [sorted(g.tolist()) for e in range(3) for g in plan.global_batches(e)]
    seen: dict[int, list[int]] = {}
    starts = []
    for f in sorted(out.glob("rank-0-*.jsonl"), key=lambda f: f.stat().st_mtime):
        world, start = (int(x) for x in re.findall(r"\d+", f.name)[1:3])
        steps = _global_steps(out, world, start)
        assert min(steps, default=start) == start          # it began where it restored
        assert start == 0 or start - 1 in seen             # after a step already run
        for k, ids in steps.items():
            assert ids == want[k], (f.name, k)              # the plan's global batch
            seen[k] = ids
        starts.append((world, start))
    assert sorted(seen) == list(range(len(want)))        # every step, to the end
    assert [w for w, _ in starts] == worlds, starts
    firsts = [start for _, start in starts]
    assert firsts[0] == 0 and firsts[1:] == sorted(set(firsts[1:])) and 0 not in firsts[1:]
    for world, start in starts[1:]:     # each restore: read once, broadcast over the links
        stats = [json.loads((out / f"restore-{r}-world-{world}-from-{start}.json")
                            .read_text()) for r in range(world)]
        assert {s["from"] for s in stats} == {"one"}, stats
    return starts


def test_a_job_that_loses_a_node_resumes_on_the_survivors_with_the_same_samples(
        cluster, labelled, tmp_path):
    """Issue T item 2 (resubmitting under mpiexec): 3 nodes, node2 killed mid-epoch; the
    same command on the 2 nodes left restores the last whole checkpoint and finishes.
    The global sample sequence is the plan's, every step after a restore the
    uninterrupted run's; only the steps after the last save are seen twice. (A node
    that comes back, 2 -> 3: the torchrun test below.)"""
    out = cluster.shared / "elastic"
    out.mkdir()
    repo = str(cluster.shared / "elastic-repo")
    cmd, env = rank_command(rank_train_checkpointed, [labelled, repo, out])
    restored = []

    def attempt(nodes: int, kill: "int | None") -> None:
        jobs = _launch(cluster, "mpiexec", cmd, env, nodes=nodes)
        if kill is None:
            got, err = jobs[0].communicate(timeout=240)
            assert jobs[0].returncode == 0, err[-4000:]
        else:
            def fault() -> None:
                assert cluster.kill_node(kill) > 0
            code, err, took = _fault_mid_training(jobs, fault)
            assert code != 0 and took < 30, (code, took, err[-3000:])
            got = ""
        m = re.search(r"RESTORED (\d+) AT WORLD (\d+)", got + err) if kill is None else None
        restored.append(int(m.group(1)) if m else None)

    attempt(3, kill=2)                   # 3 nodes; node2 dies
    attempt(2, kill=None)                # resubmitted on the 2 left: to the end
    starts = _assert_the_plans_run(out, [3, 2])
    assert restored[-1] == starts[1][1]


def _wait_for(log: Path, text: str, agents: list[subprocess.Popen],
              timeout: float = 180.0) -> None:
    """Until node0's agent log holds ``text``; fails, with the log's end, when an agent
    ends first or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        ended = [a.returncode for a in agents if a.poll() is not None]
        assert not ended and time.monotonic() < deadline, \
            (text, ended, log.read_text()[-4000:])
        time.sleep(0.2)


def test_a_torchrun_job_goes_on_in_place_when_a_node_is_lost_and_when_it_comes_back(
        cluster, labelled, tmp_path):
    """Issue T item 2 under torchrun (``--nnodes 2:3 --max-restarts 3``): node2 killed
    mid-epoch, the agents left restart the workers on 2 nodes, which restore the last
    save; node2's agent started again, the 3 nodes re-form and finish. The whole run's
    global batches are the plan's, every attempt going on from a save."""
    out = cluster.shared / "elastic-torchrun"
    out.mkdir()
    repo = str(cluster.shared / "elastic-torchrun-repo")
    cmd, env = rank_command(rank_train_checkpointed, [labelled, repo, out, 2])
    env.update(FOREBAY_PEER_TIMEOUT="5", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    argv = cluster.torchrun_argv(cmd, nodes="2:3", port=29451, restarts=3)
    logs = [tmp_path / f"agent{k}.log" for k in range(3)] + [tmp_path / "agent2b.log"]

    def agent(k: int, log: Path) -> subprocess.Popen:
        with log.open("w") as f:
            return cluster.popen(k, argv, env=cluster.env(env), stdout=f,
                                 stderr=subprocess.STDOUT, text=True)

    agents = [agent(k, logs[k]) for k in range(3)]
    lost = agents[2]
    try:
        _wait_for(logs[0], "TRAINING", agents)
        assert cluster.kill_node(2) > 0                 # node2 lost mid-epoch
        lost.wait(timeout=30)
        _wait_for(logs[0], "HOLDING", agents[:2])    # going on at 2 nodes
        agents[2] = agent(2, logs[3])                   # and node2 comes back
        for a in agents:
            a.wait(timeout=180)
    finally:
        for a in agents + [lost]:
            a.kill()
            a.wait()
    assert [a.returncode for a in agents] == [0, 0, 0], logs[0].read_text()[-4000:]
    assert "RuntimeWarning" not in logs[0].read_text()  # the store was not shared
    _assert_the_plans_run(out, [3, 2, 3])


# -- every distributed path across nodes ----------------------------------------------
def rank_load_once_per_node_where(url: str, out: str) -> None:
    import socket

    from test_models_ecosystem import rank_load_once_per_node

    Path(out, f"host-{os.environ['RANK']}").write_text(socket.gethostname())
    rank_load_once_per_node(url, out)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_reader_shared_reads_each_item_once_per_node(cluster):
    """torch.distributed.checkpoint through the model repository on 2 nodes x 2 ranks:
    with share=True each node reads each item once, between its own ranks."""
    import torch.distributed.checkpoint as dcp

    from forebay.models import open_repository
    from forebay.models.dcp import Writer
    from test_models_ecosystem import DCP_ENV, _state

    d = cluster.shared / "dcp"
    d.mkdir()
    url = f"file://{d / 'repo'}"
    dcp.save({"model": _state()["model"]}, storage_writer=Writer(url, "replicated"),
             no_dist=True)
    logical = open_repository(url).manifest("replicated")["logical_bytes"]
    p = run_torch(cluster, 2, 2, rank_load_once_per_node_where, url, d, env=DCP_ENV,
                  timeout=300)
    assert p.returncode == 0 and p.stdout.count("rank-main: rank") == 4, _why(p)
    per = {r: json.loads((d / f"rank-{r}.json").read_text()) for r in range(4)}
    host = {r: (d / f"host-{r}").read_text() for r in range(4)}
    assert sorted(host.values()) == ["node0", "node0", "node1", "node1"]
    assert sum(p["False"] for p in per.values()) == 4 * logical    # each rank all of it
    for node in ("node0", "node1"):                                # once per node
        assert sum(per[r]["True"] for r in per if host[r] == node) == logical


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun", "srun"])
def test_the_readme_training_script_runs_across_four_nodes(request, cluster, launcher):
    """README's train.py as written, on 4 nodes x 1 rank: every rank sees batches of its
    own, the same under every launcher (srun without MPI)."""
    if launcher == "srun":
        request.getfixturevalue("slurm")
    from test_readme import BLOCKS, DATA, TRAIN_CHECK, _assert_saved

    code = next(c for _, c in BLOCKS if "# train.py" in c).replace("every_steps=500",
                                                                   "every_steps=5")
    d = cluster.shared / f"readme-{launcher}"
    d.mkdir()
    env = {"PYTHONPATH": str(Path(forebay.__file__).parents[1]), "FOREBAY_TRACE": ""}
    data = cluster.shared / "readme-data"            # README's data.py, once per cluster
    if not (data / "ising.fb").exists():
        data.mkdir(exist_ok=True)
        (data / "data.py").write_text(DATA)
        assert cluster.run(0, [sys.executable, "data.py"], cwd=data,
                           env=cluster.env(env)).returncode == 0
    (d / "ising.fb").symlink_to(data / "ising.fb")
    (d / "train.py").write_text(code + TRAIN_CHECK)
    if launcher == "mpiexec":
        p = cluster.mpiexec([sys.executable, "train.py"], cwd=d, env=env, timeout=400)
    elif launcher == "srun":
        p = cluster.srun([sys.executable, "train.py"], cwd=d, env=env, timeout=400)
    else:
        p = _joined(cluster.torchrun(["train.py"], cwd=d, env=env, timeout=400,
                                     port=29421))
    assert p.returncode == 0, _why(p)
    _assert_saved(d / "checkpoints")
    ids = [json.loads((d / f"ids-{r}.json").read_text()) for r in range(4)]
    flat = [tuple(b) for r in ids for b in r]
    assert len(set(flat)) == len(flat)               # no batch seen by two ranks
    _readme_ids[launcher] = ids
    assert all(seen == ids for seen in _readme_ids.values())


_readme_ids: dict = {}


def rank_traced(path: str) -> None:
    from forebay.torch import DataLoader, Pipeline

    dl = DataLoader(path, 4, seed=2, epochs=1,
                    pipeline=Pipeline(collate_fn=lambda b: b.ids.copy()))
    for _ in dl:
        pass
    dl.close()


def test_traces_from_several_nodes_are_analyzed_as_one_job(cluster, labelled):
    """A traced job on 2 nodes x 2 ranks: one trace file per rank, from two hosts;
    `forebay analyze` reports 4 ranks, their steps and every record read once."""
    import gzip

    from forebay.trace import analyze

    d = cluster.shared / "trace"
    p = run_mpi(cluster, 2, 2, rank_traced, labelled, env={"FOREBAY_TRACE": str(d)})
    assert p.returncode == 0, _why(p)
    files = sorted(d.glob("*.pfw.gz"))
    assert len(files) == 4
    hosts = set()
    for f in files:
        with gzip.open(f, "rt") as fh:
            for line in fh:
                ev = json.loads(line)
                if ev.get("name") == "HH":
                    hosts.add(ev["args"]["name"])
    assert hosts == {"node0", "node1"}, hosts
    res = analyze(d)
    assert res["files"] == 4 and res["ranks"] == 4 and not res["skipped"]
    assert res["dataset_samples"] == 101
    assert res["pfs_records_read"] == 101          # the preload read each record once
    plan = forebay.AccessPlan(101, 4, 4, 1, seed=2)
    assert res["steps"] == 4 * len(plan.global_batches(0))


def test_gradient_reduction_across_nodes_equals_ddp(cluster):
    """forebay.reduce's DistributedOptimizer on 4 nodes x 1 rank under mpiexec (its own
    torch.distributed rendezvous from MPI): the training curve equals DDP's, in both
    coordination modes."""
    from conftest import rank_steps
    from test_reduce import rank_ddp, results_of

    steps = {f"ddp-{mode}": (rank_ddp, mode) for mode in ("bitvector", "master")}
    spec = json.dumps([[name, f.__module__, f.__name__, [str(a) for a in args]]
                       for name, (f, *args) in steps.items()])
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                          os.environ.get("PYTHONPATH", "")])}
    p = run_mpi(cluster, 4, 1, rank_steps, spec, env=env, timeout=300)
    assert p.returncode == 0, _why(p)
    for mode in ("bitvector", "master"):
        res = [r for r in results_of(p) if r["case"] == f"ddp-{mode}"]
        assert len(res) == 4, _why(p)
        for r in res:
            np.testing.assert_allclose(r["losses"], r["ddp"], rtol=1e-5, atol=1e-6)


def rank_small_shm(path: str, store: str) -> None:
    from mpi4py import MPI

    from forebay.store import ClairvoyantStore, DistributedStore, StoreError

    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(path)
    plan = forebay.AccessPlan(len(ds), comm.size, 4, 1, seed=0)
    kinds = {"preload": ["shm", "rma"], "clairvoyant": ["shm", "rma"]}[store]
    for transport in kinds:
        try:
            if store == "preload":
                DistributedStore(ds, comm, node_aware=True, transport=transport,
                                 progress=False).close()
            else:
                ClairvoyantStore(ds, plan, comm, ram_bytes=int(ds.record_nbytes.sum()),
                                 transport=transport, ram_tier="copy").close()
        except StoreError as e:
            say(f"REFUSED {transport} {e}")
        else:
            say(f"BUILT {transport}")
    if store == "preload":
        # auto (the page cache ruled out by an emulated file system): the exchange
        st = DistributedStore(ds, comm, node_aware=True, on_pfs_read=lambda *a: None,
                              progress=False)
        every = np.arange(len(ds))
        assert st.get_many(every).equals(ds.get_many(every))
        say(f"AUTO {comm.rank} {st.transport}")
        st.close()


def test_a_dev_shm_too_small_for_the_segment_is_said_on_every_rank(cluster):
    """node1's /dev/shm with 4 MiB free (MPICH takes 2), a node's chunks 6 MiB: a store
    is refused on every rank naming node1, what is needed and what is free (not
    'Bad address' from a read into a segment past the end of the tmpfs); with the
    transport left to forebay, node_aware groups read as across nodes."""
    path = cluster.shared / "shm6"
    forebay.write_dataset(path, ({"x": np.full(1 << 16, i % 251, np.uint8)}
                                 for i in range(96)), shard_bytes=1 << 20)
    p = _with_small_shm(cluster, 1, rank_small_shm, path, "preload", nodes=2, ppn=2)
    _refused_naming(p, "node1", 4)
    assert sorted(x.split()[2] for x in p.stdout.splitlines() if x.startswith("AUTO ")) \
        == ["exchange"] * 4, _why(p)
    assert "Bad address" not in p.stderr
    # the clairvoyant store's RAM tiers on one node (node0, 4 MiB free): refused alike
    _refused_naming(_with_small_shm(cluster, 0, rank_small_shm, path, "clairvoyant",
                                    nodes=1, ppn=2), "node0", 2)


def _with_small_shm(cluster, node: int, func, *args, nodes: int, ppn: int):
    """``func(*args)`` under mpiexec while ``node``'s /dev/shm has 4 MiB more than it
    holds (files an aborted MPI job left there, MPICH's, stay)."""
    used = int(cluster.run(node, ["df", "--output=used", "-B1", "/dev/shm"]).stdout.split()[1])
    size = used + (4 << 20)
    assert cluster.run(node, ["mount", "-o", f"remount,size={size}", "/dev/shm"]).returncode == 0
    try:
        p = run_mpi(cluster, nodes, ppn, func, *args)
    finally:
        cluster.run(node, ["mount", "-o", f"remount,size={cluster.shm_bytes}", "/dev/shm"])
    assert p.returncode == 0, _why(p)
    return p


def _refused_naming(p, host: str, ranks: int) -> None:
    """Both explicit transports refused on every rank, naming ``host`` and its room."""
    for transport in ("shm", "rma"):
        refused = [x for x in p.stdout.splitlines() if x.startswith(f"REFUSED {transport} ")]
        assert len(refused) == ranks, _why(p)
        assert all(f"on {host}, which has" in x and "free" in x for x in refused), refused


def rank_get_from_a_busy_peer(path: str, flag: str, kind: str) -> None:
    """Rank 0 stays outside MPI (as in a gloo all-reduce or a long step) until rank 1
    says its one-sided gets from rank 0 completed; both then close."""
    from mpi4py import MPI

    from forebay.store import ArrayStore, ClairvoyantStore, DistributedStore

    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(path)
    if kind == "preload":
        store = DistributedStore(ds, comm, transport="rma", progress=False)
        theirs = np.flatnonzero(store.owner(np.arange(len(ds))) == 0)
        check = lambda: store.get_many(theirs).equals(ds.get_many(theirs))  # noqa: E731
    elif kind == "clairvoyant":
        store = ClairvoyantStore(ds, forebay.AccessPlan(len(ds), 2, 4, 1, seed=0), comm,
                                 ram_bytes=int(ds.record_nbytes.sum()), transport="rma")
        store.wait_filled(timeout=60)
        comm.Barrier()
        every = np.arange(len(ds))
        check = lambda: store.get_many(every).equals(ds.get_many(every))  # noqa: E731
    else:
        rows = np.arange(10 * comm.rank, 10 * comm.rank + 10, dtype=np.float64)
        store = ArrayStore({"v": rows.reshape(-1, 1)}, comm, transport="rma")
        check = lambda: store.get("v", 0, 10)[:, 0].tolist() == list(range(10))  # noqa
    done = Path(flag)
    if comm.rank == 1:
        assert check()
        done.write_text("got")
    else:
        deadline = time.monotonic() + 60
        while not done.exists():            # no MPI call here
            assert time.monotonic() < deadline, "the peer's gets never completed"
            time.sleep(0.01)
    store.close()
    say(f"BUSY-PEER {comm.rank} ok")


@pytest.mark.parametrize("kind", ["preload", "clairvoyant", "arrays"])
def test_gets_from_a_peer_busy_outside_mpi_complete(cluster, labelled, kind):
    """Over MPICH's tcp provider a one-sided get completes only while its target is in
    MPI; a rank in a gloo all-reduce never is (a job hung so across nodes). The
    stores keep each rank's MPI progressing while it is elsewhere."""
    flag = cluster.shared / f"busy-{kind}"
    p = run_mpi(cluster, 2, 1, rank_get_from_a_busy_peer, labelled, flag, kind, timeout=150)
    assert p.returncode == 0 and p.stdout.count("BUSY-PEER") == 2, _why(p)


def test_a_consumer_gets_a_producers_samples_from_its_node_not_the_shared_fs(cluster):
    """Issue U, item 3 (DYAD's path): a producer on node2 keeps its frames in node2's
    own storage and serves them (``forebay serve``); a consumer on node0 waits for a
    generation not yet published and mirrors it into node0's storage over the nodes'
    link (node0 cannot see node2's storage: the bytes can only have come that way),
    bit-exact; with node2's processes gone, the consumer reads the shared copy."""
    bin_dir = Path(sys.executable).parent
    produced = cluster.node_dir(2) / "frames.fb"         # node2's /local, from the host
    forebay.write_dataset(produced, ({"x": np.full(300, i, np.float32), "id": np.int64(i)}
                                     for i in range(40)), shard_bytes=16_000)
    token = cluster.shared / "serve-token"
    token.write_text("cluster-token\n")
    local = cluster.local
    assert cluster.run(0, ["test", "-e", str(local / "frames.fb")]).returncode == 1
    server = cluster.popen(2, [str(bin_dir / "forebay"), "serve", str(local / "frames.fb"),
                               "--listen", f"{cluster.address(2)}:7532", "--token-file",
                               str(token)], env=cluster.env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        url = server.stdout.readline().split(" on ")[-1].strip()
        assert url == f"http://{cluster.address(2)}:7532", server.stderr.read() \
            if server.stderr else url
        consumer = cluster.popen(0, [str(bin_dir / "forebay"), "mirror", url,
                                     str(local / "mirror.fb"), "--samples", "64",
                                     "--timeout", "120", "--token-file", str(token)],
                                 env=cluster.env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        forebay.append(produced, ({"x": np.full(300, i, np.float32), "id": np.int64(i)}
                                  for i in range(40, 64)), shard_bytes=16_000)
        out, err = consumer.communicate(timeout=150)
        assert consumer.returncode == 0 and "64 samples in" in out, err[-3000:]
        got = forebay.open_dataset(cluster.node_dir(0) / "mirror.fb")   # node0's /local
        want = forebay.open_dataset(produced)
        every = np.arange(64)
        assert len(got) == 64 and got.get_many(every).equals(want.get_many(every))
        shared = cluster.shared / "frames-shared.fb"            # the producer's later copy
        shutil.copytree(produced, shared)
    finally:
        server.terminate()
        for stream in (server.stdout, server.stderr):
            if stream is not None:
                stream.close()
        server.wait(timeout=30)
    gone = cluster.run(0, [str(bin_dir / "forebay"), "mirror", url, str(local / "again.fb"),
                           "--token-file", str(token), "--fallback", str(shared),
                           "--samples", "64"], env=cluster.env())
    assert gone.returncode == 0 and f"64 samples in {shared}" in gone.stdout, gone.stderr


def test_a_mummi_like_workflow_overlaps_producers_and_trainers(cluster):
    """Issue U, item 4: producers on node2 and node3 append generations of frames to a
    dataset on the shared file system while a trainer on node0 and node1 (mpiexec, 2
    ranks) retrains every 2 generations; each round's global batches are the plan's
    over the samples both ranks saw, and one trace shows the producers' appends, from
    their nodes, going on after the training began."""
    import gzip

    from forebay.trace import analyze

    script = Path(__file__).resolve().parents[1] / "scripts" / "mummi_workflow.py"
    path, traces = cluster.shared / "frames.fb", cluster.shared / "wf-trace"
    env = cluster.env({"FOREBAY_TRACE": str(traces)})
    producers = [cluster.popen(k, [sys.executable, str(script), "produce", str(path),
                                   "--producer", str(k - 2), "--generations", "3",
                                   "--timeout", "120"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for k in (2, 3)]
    try:
        out = cluster.shared / "wf-rounds"
        out.mkdir()
        p = cluster.mpiexec([sys.executable, str(script), "train", str(path), "--rounds", "2",
                             "--every", "2", "--timeout", "120", "--out", str(out)], nodes=2,
                            ppn=1, timeout=240, env=env)
    finally:
        outs = [q.communicate(timeout=120) for q in producers]
    assert p.returncode == 0, _why(p)
    assert all(q.returncode == 0 for q in producers), [e[-2000:] for _, e in outs]
    rounds = [json.loads(f.read_text()) for f in sorted(out.glob("round-*.json"))]
    assert len(rounds) == 4
    ds = forebay.open_dataset(path)
    ids = np.array([int(ds[j]["id"]) for j in range(len(ds))])
    for r in range(2):
        mine = {x["rank"]: x for x in rounds if x["round"] == r}
        n = mine[0]["samples"]
        assert n == mine[1]["samples"] and n >= (r + 1) * 2 * 32
        plan = forebay.AccessPlan(n, 2, 8, 2, seed=0)
        for rank in (0, 1):
            assert mine[rank]["ids"] == ids[plan.batches(rank, r).ravel()].tolist()
    spans: dict[str, list[tuple[int, int, str]]] = {"producer": [], "dataloader": [],
                                                    "consumer": []}
    for f in traces.glob("*.pfw.gz"):
        host = ""
        with gzip.open(f, "rt") as fh:
            events = [json.loads(line) for line in fh if line.startswith("{")]
        for ev in events:
            if ev.get("name") == "HH":
                host = ev["args"]["name"]
        for ev in events:
            if ev.get("cat") in spans and ev.get("ph") == 1:       # complete events
                spans[ev["cat"]].append((ev["ts"], ev["ts"] + ev["dur"], host))
    assert {h for _, _, h in spans["producer"]} == {"node2", "node3"}
    assert {h for _, _, h in spans["dataloader"]} == {"node0", "node1"}
    # the trainer's first round began (its wait ended) before the producers' last
    # appends started: they overlap (the producers wait for that, so it always holds)
    began = min(t1 for _, t1, h in spans["consumer"] if h in ("node0", "node1"))
    assert max(t0 for t0, _, _ in spans["producer"]) > began
    res = analyze(traces)
    assert not res["skipped"]
    # the analysis compares the reads with the dataset as it had grown, not as it began
    assert res["dataset_samples"] >= max(x["samples"] for x in rounds) > 64

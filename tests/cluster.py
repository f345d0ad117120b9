"""An emulated cluster on one machine: each node a set of Linux namespaces.

A node has its own network namespace (``eth0`` on a veth pair whose other end is on one
bridge, an address of its own, no route anywhere else), its own hostname (``node0`` ..
``nodeN-1``), its own IPC namespace and a mount namespace in which ``/dev/shm`` is a
private tmpfs of a set size, ``<root>/local`` is the node's own scratch directory (the
SSD tier's place) and ``/etc/hosts`` names every node.  Everything else of the file
system is shared by the nodes, as a parallel file system is: a dataset written under
``<root>/shared`` (or anywhere outside ``<root>/local``) is seen by every node.

Processes run on a node through ``nsenter`` into a holder process that keeps the
node's namespaces alive.  Real launchers run across the nodes: ``mpiexec`` (MPICH's
hydra, with :data:`NODE_EXEC` as its launcher in place of ssh) and ``torchrun`` (one
agent per node, the rendezvous on node0) and, where Slurm is installed, ``srun``
(:meth:`Cluster.slurm_up`: munged on this host, slurmctld on node0, one slurmd per
node; with ``--mpi=pmi2`` for MPI programs, or without MPI).  Node faults: :meth:`Cluster.kill_node`
(every process of a node), :meth:`Cluster.cut_link` / :meth:`Cluster.restore_link`
(``ip link set down``), :meth:`Cluster.cap_link` (a token bucket on the node's link).
With ``cpus``, each node's processes share that many cores at most (a CPU cgroup of
its own, ``cpu.max`` or CFS quota), so that nodes on one machine do not lend each other
time: 4 nodes of 0.5 core on 2 cores behave as 4 small machines, not as one.

Needs root, ``ip`` (iproute2), ``unshare`` and ``nsenter`` (util-linux) and network
namespaces; :func:`unavailable` says why not where any is missing.  :meth:`Cluster.down`
(also at exit, and on SIGTERM of the process that built it) kills every process of
every node and removes every namespace, link and directory it made.

Used by the cluster tests (``tests/cluster/``) and by ``scripts/cluster.py``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from cluster_cpu import CpuGroups

__all__ = ["Cluster", "unavailable", "slurm_unavailable", "NODE_EXEC"]

#: hydra's launcher in place of ssh: ``node_exec.sh [-opts] HOST COMMAND...`` runs
#: COMMAND on node HOST of the cluster named by ``FOREBAY_CLUSTER_DIR``
NODE_EXEC = Path(__file__).with_name("node_exec.sh")
#: the clusters of this process still up (taken down at exit)
_LIVE: "list[Cluster]" = []
#: the tags of the clusters this process has made
_MADE: "list[int]" = []


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


def unavailable() -> Optional[str]:
    """Why an emulated cluster cannot be built here (None: it can)."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, mounts)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs `{tool}` (iproute2, util-linux)"
    probe = f"fbprobe{os.getpid()}"
    r = _sh("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"network namespaces are not available here: {r.stderr.strip()}"
    _sh("ip", "netns", "del", probe, check=False)
    return None


def slurm_unavailable() -> Optional[str]:
    """Why Slurm cannot run on an emulated cluster here (None: it can)."""
    missing = [t for t in ("srun", "sinfo", "slurmctld", "slurmd", "munged")
               if shutil.which(t) is None]
    if missing:
        return (f"Slurm is not installed here ({', '.join(missing)} not found; Debian: "
                f"apt-get install slurm-wlm munge, as .ci/run does)")
    return None


class Cluster:
    """``nodes`` emulated nodes under directory ``root`` (created; removed by
    :meth:`down`).

    Args:
        nodes: how many (hostnames node0 .. node{nodes-1}).
        root: the cluster's directory: ``shared/`` (the parallel file system, seen by
            every node), ``local/`` (each node's own scratch at the same path),
            ``nodes/`` (the nodes' private directories behind ``local/``).
        shm_bytes: the size of each node's ``/dev/shm`` (a tmpfs of its own).
        cpus: the cores each node may use at most (None: the machine's, shared by all).
    """

    def __init__(self, nodes: int = 4, root: "str | os.PathLike[str]" = "/tmp/forebay-cluster",
                 *, shm_bytes: int = 512 << 20, cpus: Optional[float] = None) -> None:
        if nodes < 1 or nodes > 64:
            raise ValueError(f"nodes must be 1..64, got {nodes}")
        if cpus is not None and not 0.01 <= cpus <= (os.cpu_count() or 1):
            raise ValueError(f"cpus must be 0.01..{os.cpu_count()} (this machine's "
                             f"cores), got {cpus}")
        self.cpus = cpus
        #: each node's CPU group, with ``cpus``
        self.cpu_groups: Optional[CpuGroups] = None
        self.nodes = nodes
        self.root = Path(root).resolve()
        self.shm_bytes = int(shm_bytes)
        # one process may build several clusters (a test's own beside a module's):
        # each its own names and subnet
        tag = (os.getpid() + 1009 * len(_MADE)) % 100000
        _MADE.append(tag)
        self.prefix = f"fb{tag}"            # names of this cluster's netns and links
        self.subnet = f"10.213.{tag % 250}"  # the nodes' own addresses, nothing routes out
        self.hosts = [f"node{k}" for k in range(nodes)]
        self.pids: list[int] = []            # each node's holder process
        self._holders: list[subprocess.Popen] = []
        self._daemons: list[subprocess.Popen] = []    # munged, slurmctld, slurmds
        self._slurmctld: Optional[subprocess.Popen] = None
        self._up = False

    # -- names ----------------------------------------------------------------------
    @property
    def shared(self) -> Path:
        """The parallel file system: one directory every node sees."""
        return self.root / "shared"

    @property
    def local(self) -> Path:
        """Each node's own scratch directory (the same path on every node)."""
        return self.root / "local"

    def node_dir(self, k: int) -> Path:
        """Node ``k``'s private directory as this (host) process sees it."""
        return self.root / "nodes" / self.hosts[k]

    def netns(self, k: int) -> str:
        return f"{self.prefix}n{k}"

    def address(self, k: int) -> str:
        return f"{self.subnet}.{k + 1}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def _veth(self, k: int) -> str:
        return f"{self.prefix}v{k}"

    # -- up and down ----------------------------------------------------------------
    def up(self) -> "Cluster":
        """Build every node (collective of nothing: one process builds all)."""
        if self._up:
            return self
        _LIVE.append(self)
        self._up = True
        _on_sigterm_take_down()
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        self.shared.mkdir(parents=True, exist_ok=True)
        self.local.mkdir(parents=True, exist_ok=True)
        if self.cpus is not None:      # before the nodes: their mount namespaces see it
            try:
                self.cpu_groups = CpuGroups(self.prefix, self.hosts, self.cpus,
                                            self.root / "cpu")
            except OSError as e:
                raise RuntimeError(f"a CPU cap per node could not be set up: {e}") from e
        hosts = self.root / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"{self.address(k)} {h}\n" for k, h in enumerate(self.hosts)))
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "link", "set", self.bridge, "up")
        for k in range(self.nodes):
            ns, veth = self.netns(k), self._veth(k)
            self.node_dir(k).mkdir(parents=True, exist_ok=True)
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", veth, "master", self.bridge)
            _sh("ip", "link", "set", veth, "up")
            for cmd in (["ip", "link", "set", "lo", "up"],
                        ["ip", "addr", "add", f"{self.address(k)}/24", "dev", "eth0"],
                        ["ip", "link", "set", "eth0", "up"]):
                _sh("ip", "netns", "exec", ns, *cmd)
            # the holder: the node's own hostname, IPC, /dev/shm, local/ and /etc/hosts;
            # an empty tmpfs as /sys/fs/cgroup (`ip netns exec`'s fresh sysfs has none,
            # and slurmd will not start without a file system there)
            setup = (f"hostname {self.hosts[k]} && "
                     f"mount -t tmpfs -o size={self.shm_bytes},mode=1777 tmpfs /dev/shm && "
                     f"mount -t tmpfs -o size=1m,mode=755 cgroup /sys/fs/cgroup && "
                     f"mount --bind {self.node_dir(k)} {self.local} && "
                     f"mount --bind {hosts} /etc/hosts && echo $$ && exec sleep infinity")
            holder = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--uts", "--ipc", "--mount",
                 "--propagation", "private", "--fork", "sh", "-c", setup],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
            self._holders.append(holder)
            assert holder.stdout is not None and holder.stderr is not None
            line = holder.stdout.readline()
            if not line.strip().isdigit():
                holder.wait()
                err = holder.stderr.read()
                holder.stdout.close()
                holder.stderr.close()
                raise RuntimeError(f"node {self.hosts[k]} did not start: {err.strip()}")
            holder.stdout.close()          # the holder writes nothing more
            holder.stderr.close()
            self.pids.append(int(line))
        (self.root / "pids.json").write_text(json.dumps(dict(zip(self.hosts, self.pids))))

    def down(self) -> None:
        """Kill every process of every node, remove the namespaces, links and the
        cluster's directory.  Idempotent; never raises."""
        if not self._up:
            return
        self._up = False
        for k in range(len(self.pids)):
            self.kill_node(k, daemons=True)
        for h in [*self._daemons, *self._holders]:
            try:
                os.killpg(h.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                h.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.cpu_groups is not None:
            self.cpu_groups.remove()
        for k in range(self.nodes):
            _sh("ip", "netns", "del", self.netns(k), check=False)
            _sh("ip", "link", "del", self._veth(k), check=False)
        _sh("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        if self in _LIVE:
            _LIVE.remove(self)

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- running --------------------------------------------------------------------
    def on(self, k: int, argv: Sequence[str],
           cwd: "str | os.PathLike[str] | None" = None) -> list[str]:
        """``argv`` as a command that runs on node ``k``, in ``cwd`` (default: this
        process's working directory; the path is the same on every node)."""
        join = [] if self.cpu_groups is None else self.cpu_groups.join_argv(self.hosts[k])
        return [*join, "nsenter", "-t", str(self.pids[k]), "-n", "-u", "-i", "-m",
                f"--wd={os.fspath(cwd) if cwd is not None else os.getcwd()}", "--", *argv]

    def run(self, k: int, argv: Sequence[str], *, timeout: Optional[float] = 120,
            env: Optional[dict] = None, cwd: "str | os.PathLike[str] | None" = None
            ) -> subprocess.CompletedProcess:
        """Run ``argv`` on node ``k`` to the end (its output captured), in ``cwd``."""
        return subprocess.run(self.on(k, argv, cwd), capture_output=True, text=True,
                              timeout=timeout, env=env)

    def popen(self, k: int, argv: Sequence[str], *, env: Optional[dict] = None,
              cwd: "str | os.PathLike[str] | None" = None, **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(self.on(k, argv, cwd), env=env, **kw)

    def env(self, extra: Optional[dict] = None) -> dict:
        """The environment of a job on the cluster: the caller's, the cluster's
        directory for :data:`NODE_EXEC`, and the nodes' interface for gloo and MPI
        (MPICH's wheel picks UCX, whose own interface search once failed a job's
        MPI_Init under srun with "invalid bandwidth 0.00"; OFI's is named too)."""
        e = dict(os.environ, FOREBAY_CLUSTER_DIR=str(self.root), GLOO_SOCKET_IFNAME="eth0",
                 UCX_NET_DEVICES="eth0", FI_PROVIDER="tcp", FI_TCP_IFACE="eth0",
                 OMP_NUM_THREADS="1", SLURM_CONF=str(self.slurm_conf))
        e.update(extra or {})
        return e

    def mpiexec_argv(self, argv: Sequence[str], *, nodes: Optional[int] = None,
                     ppn: int = 1) -> list[str]:
        """The ``mpiexec`` command (to run on node0) that starts ``argv`` on
        ``nodes * ppn`` ranks across the first ``nodes`` nodes, ``ppn`` each (ranks
        0..ppn-1 on node0, ...)."""
        n = self.nodes if nodes is None else nodes
        mpiexec = str(Path(sys.executable).parent / "mpiexec")
        return [mpiexec, "-launcher", "ssh", "-launcher-exec", str(NODE_EXEC),
                "-hosts", ",".join(self.hosts[:n]), "-ppn", str(ppn), "-n", str(n * ppn),
                *argv]

    def mpiexec(self, argv: Sequence[str], *, nodes: Optional[int] = None, ppn: int = 1,
                timeout: Optional[float] = 180, env: Optional[dict] = None,
                cwd: "str | os.PathLike[str] | None" = None) -> subprocess.CompletedProcess:
        """Run :meth:`mpiexec_argv` on node0 to the end, in ``cwd`` (every rank's
        working directory); its output captured."""
        return self.run(0, self.mpiexec_argv(argv, nodes=nodes, ppn=ppn), timeout=timeout,
                        env=self.env(env), cwd=cwd)

    def torchrun_argv(self, argv: Sequence[str], *, nodes: "int | str | None" = None,
                      ppn: int = 1, port: int = 29400, restarts: int = 0) -> list[str]:
        """The ``torchrun`` command each node's agent runs (``--nnodes nodes
        --nproc-per-node ppn``, the c10d rendezvous on node0).  ``nodes`` may be an
        elastic range ``"MIN:MAX"``; with ``restarts`` the agents restart the workers
        that many times, a node's loss found within 3 s (its agent's missed heartbeats)
        and a round closed 1 s after its last member joined."""
        n = self.nodes if nodes is None else nodes
        torchrun = str(Path(sys.executable).parent / "torchrun")
        elastic = ["--max-restarts", str(restarts), "--rdzv-conf",
                   "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
                   ] if restarts else []
        return [torchrun, "--nnodes", str(n), "--nproc-per-node", str(ppn), *elastic,
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.hosts[0]}:{port}",
                "--rdzv-id", self.prefix, *argv]

    def torchrun(self, argv: Sequence[str], *, nodes: Optional[int] = None, ppn: int = 1,
                 timeout: Optional[float] = 180, env: Optional[dict] = None,
                 port: int = 29400, capture: bool = True,
                 cwd: "str | os.PathLike[str] | None" = None
                 ) -> list[subprocess.CompletedProcess]:
        """One ``torchrun`` agent on each of the first ``nodes`` nodes
        (:meth:`torchrun_argv`), to the end; each agent's output (``capture``)."""
        n = self.nodes if nodes is None else nodes
        cmd = self.torchrun_argv(argv, nodes=n, ppn=ppn, port=port)
        pipe = subprocess.PIPE if capture else None
        procs = [self.popen(k, cmd, env=self.env(env), stdout=pipe, stderr=pipe, text=True,
                            cwd=cwd) for k in range(n)]
        out = []
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in procs:
            try:
                so, se = p.communicate(timeout=None if deadline is None else
                                       max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            out.append(subprocess.CompletedProcess(p.args, p.returncode, so or "", se or ""))
        return out

    # -- Slurm ----------------------------------------------------------------------
    @property
    def slurm_conf(self) -> Path:
        """The cluster's ``slurm.conf`` (``SLURM_CONF`` in :meth:`env` once Slurm is up)."""
        return self.root / "slurm" / "slurm.conf"

    def slurm_up(self, cpus: int = 4, timeout: float = 60.0) -> None:
        """Start Slurm on the cluster: ``munged`` on this host (its socket and key in
        the cluster's directory: the nodes share the file system), ``slurmctld`` on
        node0, one ``slurmd`` per node (``cpus`` each, whatever the machine has: tasks
        share its cores), one partition of every node.  Returns once every node is idle;
        :meth:`down` stops them all.  Raises naming the daemon that did not start."""
        why = slurm_unavailable()
        if why:
            raise RuntimeError(why)
        d = self.root / "slurm"
        (d / "state").mkdir(parents=True)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = d / "munge.sock"
        self._daemons.append(subprocess.Popen(
            ["munged", "-F", "--force", f"--socket={sock}", f"--key-file={key}",
             f"--log-file={d / 'munged.log'}", f"--pid-file={d / 'munged.pid'}",
             f"--seed-file={d / 'munged.seed'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        nodes = "".join(f"NodeName={h} NodeAddr={self.address(k)} CPUs={cpus} "
                        f"State=UNKNOWN\n" for k, h in enumerate(self.hosts))
        # node-local paths under local/ (each node's own); no cgroups, no accounting
        self.slurm_conf.write_text(
            f"ClusterName=forebay\nSlurmctldHost={self.hosts[0]}({self.address(0)})\n"
            f"SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\n"
            f"AuthInfo=socket={sock}\nCredType=cred/munge\n"
            f"StateSaveLocation={d / 'state'}\nSlurmctldPidFile={d / 'slurmctld.pid'}\n"
            f"SlurmctldLogFile={d / 'slurmctld.log'}\n"
            f"SlurmdSpoolDir={self.local / 'slurmd'}\n"
            f"SlurmdPidFile={self.local / 'slurmd.pid'}\n"
            f"SlurmdLogFile={self.local / 'slurmd.log'}\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "JobAcctGatherType=jobacct_gather/none\n"
            "AccountingStorageType=accounting_storage/none\nSchedulerType=sched/builtin\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nMpiDefault=none\n"
            "ReturnToService=2\nSlurmdParameters=config_overrides\nKillWait=5\n"
            # a node that dies is found in seconds, not minutes (tests kill nodes)
            "SlurmdTimeout=6\nMessageTimeout=4\nInactiveLimit=0\n"
            f"{nodes}PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
            f"OverSubscribe=YES\n")
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        self._slurmctld = self.popen(0, ["slurmctld", "-D", "-i"], env=self.env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self._daemons.append(self._slurmctld)
        started = [self._slurmd(k) for k in range(self.nodes)]
        self._slurm_idle(timeout, started)

    def slurm_restore(self, k: int, timeout: float = 60.0) -> None:
        """Node ``k``'s slurmd started again (after :meth:`kill_node`); returns once
        Slurm has every node idle again."""
        self._slurm_idle(timeout, [self._slurmd(k)])

    def _slurmd(self, k: int) -> subprocess.Popen:
        (self.node_dir(k) / "slurmd").mkdir(exist_ok=True)
        self._daemons.append(self.popen(k, ["slurmd", "-D"], env=self.env(),
                                        stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True))
        return self._daemons[-1]

    def _slurm_idle(self, timeout: float, started: list[subprocess.Popen]) -> None:
        """Wait until Slurm has every node idle; raise if slurmctld or one of the
        slurmds just ``started`` exits first."""
        deadline = time.monotonic() + timeout
        state: list[str] = []
        while time.monotonic() < deadline:
            if any(p is not None and p.poll() is not None
                   for p in [self._slurmctld, *started]):
                raise RuntimeError(f"Slurm did not start: slurmctld or slurmd exited; logs in "
                                   f"{self.slurm_conf.parent} and {self.local}/slurmd.log "
                                   f"of each node")
            r = self.run(0, ["sinfo", "-h", "-N", "-o", "%T"], env=self.env(), timeout=30)
            state = r.stdout.split()
            if r.returncode == 0 and state == ["idle"] * self.nodes:
                return
            time.sleep(0.2)
        raise RuntimeError(f"Slurm's nodes not idle after {timeout:g} s: {state}")

    def srun_argv(self, argv: Sequence[str], *, nodes: Optional[int] = None,
                  ppn: int = 1, mpi: Optional[str] = None) -> list[str]:
        """The ``srun`` command (to run on node0) that starts ``argv`` as
        ``nodes * ppn`` tasks on the first ``nodes`` nodes, ``ppn`` each; ``mpi``
        Slurm's MPI plug-in (``pmi2`` for MPICH; None: no MPI).  The step fails
        when its nodes are not free within 60 s (one killed and not restored)."""
        n = self.nodes if nodes is None else nodes
        return ["srun", "-N", str(n), "--ntasks-per-node", str(ppn), "-n", str(n * ppn),
                "-w", ",".join(self.hosts[:n]), "--kill-on-bad-exit=1", "--immediate=60",
                f"--mpi={mpi or 'none'}", *argv]

    def srun(self, argv: Sequence[str], *, nodes: Optional[int] = None, ppn: int = 1,
             mpi: Optional[str] = None, timeout: Optional[float] = 180,
             env: Optional[dict] = None, cwd: "str | os.PathLike[str] | None" = None
             ) -> subprocess.CompletedProcess:
        """Run :meth:`srun_argv` on node0 to the end (:meth:`slurm_up` first); its
        output captured."""
        return self.run(0, self.srun_argv(argv, nodes=nodes, ppn=ppn, mpi=mpi),
                        timeout=timeout, env=self.env(env), cwd=cwd)

    # -- faults ---------------------------------------------------------------------
    def node_pids(self, k: int) -> list[int]:
        """The processes running on node ``k`` (its network namespace), holder aside."""
        r = _sh("ip", "netns", "pids", self.netns(k), check=False)
        holder = set()
        if k < len(self.pids):          # the holder shell and the unshare that forked it
            holder = {self.pids[k], _ppid(self.pids[k])}
        return [int(p) for p in r.stdout.split() if p.strip().isdigit() and
                int(p) not in holder and int(p) != os.getpid()]

    def kill_node(self, k: int, sig: int = signal.SIGKILL, *, daemons: bool = False) -> int:
        """Send ``sig`` to every process of node ``k`` (its holder stays: the node is
        there, its processes are gone), its Slurm daemons too only with ``daemons``
        (then :meth:`slurm_restore` brings it back to Slurm); returns how many."""
        keep = set() if daemons else {d.pid for d in self._daemons}
        pids = [p for p in self.node_pids(k) if p not in keep]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return len(pids)

    def cut_link(self, k: int) -> None:
        """Node ``k``'s link down: nothing reaches it or leaves it."""
        _sh("ip", "link", "set", self._veth(k), "down")

    def restore_link(self, k: int, timeout: float = 20.0) -> None:
        """Node ``k``'s link up again, and wait until node0 reaches it (neighbour
        caches that remember the cut are flushed)."""
        _sh("ip", "link", "set", self._veth(k), "up")
        for j in range(self.nodes):
            _sh("ip", "netns", "exec", self.netns(j), "ip", "neigh", "flush", "all",
                check=False)
        if not self.reachable(k, timeout):
            raise RuntimeError(f"{self.hosts[k]} is not reachable {timeout:g} s after its "
                               f"link came back")

    def reachable(self, k: int, timeout: float = 5.0, src: int = 0) -> bool:
        """Whether node ``src`` reaches node ``k`` within ``timeout`` (a TCP connection
        to a closed port is refused: the host answered)."""
        probe = ("import socket,sys,time\n"
                 f"end = time.monotonic() + {timeout}\n"
                 "while time.monotonic() < end:\n"
                 "    try:\n"
                 f"        socket.create_connection(('{self.address(k)}', 9), timeout=1)\n"
                 "    except ConnectionRefusedError:\n"
                 "        sys.exit(0)\n"
                 "    except OSError:\n"
                 "        time.sleep(0.1)\n"
                 "    else:\n"
                 "        sys.exit(0)\n"
                 "sys.exit(1)\n")
        return self.run(src, [sys.executable, "-c", probe], timeout=timeout + 10).returncode == 0

    def cap_link(self, k: int, mbit: float) -> None:
        """Node ``k``'s link (both ways) capped at ``mbit`` Mbit/s (a token bucket)."""
        for where, dev in self._link_ends(k):
            _sh(*where, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                f"{mbit}mbit", "burst", "64kb", "latency", "50ms")

    def uncap_link(self, k: int) -> None:
        for where, dev in self._link_ends(k):
            _sh(*where, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def _link_ends(self, k: int) -> list[tuple[list[str], str]]:
        """Both ends of node ``k``'s link: (how to run a command where it is, device)."""
        return [([], self._veth(k)), (["ip", "netns", "exec", self.netns(k)], "eth0")]


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _down_all() -> None:
    for c in list(_LIVE):
        c.down()


def _on_sigterm_take_down() -> None:
    """SIGTERM (a timeout, a batch system) takes the clusters down before the process
    ends, as an exit does (atexit alone does not run on a signal); only where the
    process has not set a handler of its own."""
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def handler(signum: int, frame: Any) -> None:
        _down_all()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)


atexit.register(_down_all)

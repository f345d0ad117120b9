"""forebay's loader modes against the loaders a user would pick instead (issue O).

Every contender is a fresh ``torchrun --standalone --nproc-per-node R`` job (``--launcher
mpiexec``: ``mpiexec -n R``, forebay on MPI) over the same samples, contenders in
rotating order, repeated; the page cache is emptied of the contender's files before its
job (epoch 1 is cold), later epochs are warm:

* ``forebay direct`` / ``preload`` / ``clairvoyant``: ``forebay.torch.DataLoader`` over
  the packed dataset (``mode=``), its own vectorised collation; ``preload-overlap``:
  preload with ``overlap_preload=True`` (training starts while the chunks load); a
  ``views`` suffix (``forebay direct views``...): ``views=True``, the samples lent as
  read-only arrays over the store's memory instead of copied; an ``exchange`` suffix
  (``forebay preload-overlap exchange``; ``rma`` under ``--launcher mpiexec``): a
  transport used across nodes, forced; ``copy`` / ``pages`` (``forebay clairvoyant
  copy``): the clairvoyant RAM tier's ``ram_tier`` (default ``auto``); ``shm`` /
  ``pages`` after preload (``forebay preload shm``): the preload's transport, its
  chunks in a shared segment or in the files' pages (default ``auto``: pages on one
  node);
* ``torch 0 workers`` / ``torch 2 workers``: ``torch.utils.data.DataLoader`` +
  ``DistributedSampler`` over one file per sample (PFF pickles for graphs, an
  ImageFolder tree of blobs for images), per-sample collation; ``torch 2 workers
  file_system``: the same with ``torch.multiprocessing.set_sharing_strategy(
  "file_system")`` (batches come back as shared-memory names, not as descriptors that
  the main process fetches from the worker one tensor at a time);
* ``mosaicml-streaming``: ``StreamingDataset`` over MDS shards in a local directory
  (``MDSWriter``, 64 MiB shards) + torch ``DataLoader(num_workers=2)``;
* ``litdata``: ``StreamingDataset`` over ``litdata.optimize`` chunks (64 MB) +
  ``StreamingDataLoader(num_workers=2)``.

Per job: set-up seconds (the store's preload or placement, the streaming dataset's
construction), epoch seconds of the slowest rank, and the CPU-seconds each epoch cost
(``epoch_cpu_s``: every rank and its descendants, a loader's workers, summed over
the ranks; ``benchmarks/sim/sim_cluster.py`` checks its calibration with it).
Reported per workload: samples/s in the cold epoch with set-up counted and in the warm
epochs (median), each as a ratio to the best peer of the same round (the fastest of the
torch, streaming and litdata rows), min and median over rounds.  ``--compute-ms`` sleeps
that long per step (an accelerator's step, as the host sees it).  ``--touch``: the
training loop reads every byte of every image once (an xxh3 of each: what a decoder
would do; without it a contender that lends its samples is never charged for reading
them, while one that copies them has read them once).

``--throttle MBPS[,IOPS]`` runs every job in a block-I/O cgroup that caps reads from
the data's disk (root only; unmodified peers read through it too): a slow shared file
system.  ``--evict-each-epoch`` also empties the page cache of the contender's files
before every epoch, not only the first (a file system whose data this node does not
keep between epochs, the case NoPFS is for); the kernel does not drop pages a process
has mapped, so a contender that keeps its files mapped (forebay direct) still reads
them from memory after its first epoch.  With ``--throttle`` the table also gives the
bytes each contender read from the device (the cgroup's count) per sample and epoch.
The cgroup's throttle accounts in slices of 20-100 ms, and a reader that paused (a
training step) catches up within its slice: a serial reader with 20 ms pauses gets
more than the cap.  ``--fs fuse`` paces a file system instead: ``--out``'s files are
served read-only through FUSE at ``<out>-pfs`` (tests/cluster_pfs.py), every read
waiting its turn in one queue of the cap's rate, no credit for idle time, the bytes it
served in the table; the server's own cost per request (about 0.3 ms, Python) is part
of that file system, measured by the same runs' calibration.
``--network-fs`` tells forebay the data's file system is shared between hosts
(``FOREBAY_NETWORK_FS``), so it decides as on a parallel file system: no page-cache
transport or RAM tier, the preload overlapped with training by default.

``--cluster N`` runs every job across N emulated nodes (tests/cluster.py: each node its
own network, hostname, IPC and /dev/shm; the data shared; root only), ``--ranks``
spread evenly over them: mpiexec with hydra entering each node, or one torchrun agent
per node with the rendezvous on node0.  forebay then reads peers' memory across nodes
(rma under mpiexec, the exchange under torchrun).  On the throttled disk the nodes share
this machine's one page cache: what one node read (a record's neighbouring pages
included) the others find cached.  With ``--fs fuse`` each node is a client of its
own (``PacedFS.attach``: its own page cache, as a cluster's nodes have), and
``--evict-each-epoch`` empties every node's before each epoch.  ``--cpus-per-node C``
caps each node at C cores (a CPU cgroup of its own), so that nodes do not lend each
other this machine's cores.

The streaming peers are not forebay's dependencies: install them (with the torch pin)
somewhere on PYTHONPATH, e.g.::

    pip install --no-deps --target /tmp/peerlib mosaicml-streaming==0.13.0 \\
        litdata==0.2.76 "transformers<5" "huggingface_hub<1" "tokenizers>=0.22,<=0.23" \\
        regex brotli python-snappy cramjam "zstd<2" "catalogue<3" lightning-utilities \\
        boto3 botocore s3transfer jmespath requests urllib3 idna certifi \\
        charset-normalizer pyyaml filelock packaging fsspec
    PYTHONPATH=/tmp/peerlib python benchmarks/loader/peers_bench.py --out /tmp/peers-run \\
        --kind imagenet --samples 10000 --reps 3

(``import streaming`` imports its vision datasets, hence torchvision, whose PyPI wheel
needs CUDA torch; the benchmark imports ``streaming.base`` alone, which does not.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _common import evict, files_under, machine, paced, throttled, tree_cpu_s  # noqa: E402
from _baselines import (image_collate, image_folder_dataset, list_collate,  # noqa: E402
                        pff_dataset)

BIN = Path(sys.executable).parent
FOREBAY = ("forebay direct", "forebay preload", "forebay preload-overlap",
           "forebay clairvoyant", "forebay direct views", "forebay preload views",
           "forebay clairvoyant views")
PEERS = ("torch 0 workers", "torch 2 workers", "torch 2 workers file_system",
         "mosaicml-streaming", "litdata")


def _streaming():
    """``streaming.base`` without ``streaming/__init__`` (which imports torchvision)."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None:
            raise ImportError("mosaicml-streaming is not installed (see the docstring)")
        pkg = types.ModuleType("streaming")
        pkg.__path__ = list(spec.submodule_search_locations or [])
        sys.modules["streaming"] = pkg
    import streaming.base as sb
    return sb


def _peer_collate(images: bool):
    return image_collate if images else list_collate


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    if "PMI_RANK" in os.environ and "RANK" not in os.environ:     # under mpiexec
        os.environ["RANK"], os.environ["WORLD_SIZE"] = (os.environ["PMI_RANK"],
                                                        os.environ["PMI_SIZE"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    images = a.kind == "imagenet"
    key = "label" if images else "y"
    bs, c = a.batch_size, a.contender
    compute = a.compute_ms / 1e3

    def count(batch) -> int:
        v = batch[key]
        return int(v.shape[0]) if hasattr(v, "shape") else len(v)

    def touch(batch) -> None:      # every byte of every image read once
        for x in batch["image"]:
            xxhash.xxh3_64_intdigest(x.numpy() if isinstance(x, torch.Tensor) else x)

    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    first_on_node = hosts.index(hosts[rank]) == rank
    t0 = time.perf_counter()
    set_epoch = None
    if c.startswith("forebay"):
        from forebay.torch import DataLoader, Pipeline, store_settings
        words = c.split()
        mode = words[1]
        kw: dict = {"ram_bytes": a.ram_bytes} if mode == "clairvoyant" else {}
        if mode == "preload-overlap":
            mode, kw = "preload", {"overlap": True}
        for t in ("exchange", "rma"):  # the transports across nodes, forced on one
            if t in words:
                kw["transport"] = t
        for t in ("copy", "pages", "shm"):
            if t in words and mode == "clairvoyant":   # its RAM tier (default: auto)
                kw["ram_tier"] = t
            elif t in words:           # preload's memory (default: auto)
                kw["transport"] = t
        loader = DataLoader(a.packed, bs, seed=0, epochs=a.epochs, progress=False,
                            store=store_settings(mode, **kw),
                            pipeline=Pipeline(views="views" in words))
        set_epoch = loader.set_epoch
    elif c.startswith("torch"):
        ds = image_folder_dataset(Path(a.pff))[0] if images else pff_dataset(Path(a.pff))[0]
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank,
                                                      shuffle=True, seed=0)
        nw = int(c.split()[1])
        if c.endswith(" file_system"):
            torch.multiprocessing.set_sharing_strategy("file_system")
        loader = torch.utils.data.DataLoader(
            ds, batch_size=bs, sampler=sampler, num_workers=nw,
            persistent_workers=nw > 0, prefetch_factor=4 if nw else None,
            collate_fn=_peer_collate(images))
        set_epoch = sampler.set_epoch
    elif c == "mosaicml-streaming":
        sb = _streaming()
        ds = sb.StreamingDataset(local=a.mds, shuffle=True, shuffle_seed=0, batch_size=bs)
        loader = torch.utils.data.DataLoader(ds, batch_size=bs, num_workers=2,
                                             persistent_workers=True, prefetch_factor=4,
                                             collate_fn=_peer_collate(images))
    elif c == "litdata":
        import litdata
        ds = litdata.StreamingDataset(a.lit, shuffle=True, seed=0)
        loader = litdata.StreamingDataLoader(ds, batch_size=bs, num_workers=2,
                                             collate_fn=_peer_collate(images))
    else:
        raise SystemExit(f"unknown contender {c!r}")
    setup = time.perf_counter() - t0

    def over_ranks(x: float, op=dist.ReduceOp.MAX) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return float(t)

    times, counts, cpus = [], [], []
    setup = over_ranks(setup)
    mine = {"forebay": a.packed, "torch": a.pff, "mosaicml-streaming": a.mds,
            "litdata": a.lit}[c.split()[0]]
    for e in range(a.epochs):
        if set_epoch is not None:
            set_epoch(e)
        if e and a.evict_each_epoch and first_on_node:   # each node its own cache
            evict(files_under(Path(mine)))
        dist.barrier()
        # the CPU the epoch costs: every rank and its descendants (a loader's workers)
        c0 = tree_cpu_s()
        t0 = time.perf_counter()
        n = 0
        for batch in loader:
            n += count(batch)
            if a.touch and images:
                touch(batch)
            if compute:
                time.sleep(compute)
            if a.sync_steps:       # synchronous SGD's gradient all-reduce, as a barrier
                dist.all_reduce(torch.zeros(1))
        dt = time.perf_counter() - t0
        cpus.append(over_ranks(tree_cpu_s() - c0, dist.ReduceOp.SUM))
        times.append(over_ranks(dt))
        counts.append(n)
    total = torch.tensor([counts[0]], dtype=torch.int64)
    dist.all_reduce(total)
    if rank == 0:
        print("RESULT " + json.dumps({"epoch_s": times, "setup_s": setup,
                                      "epoch_cpu_s": cpus, "samples": int(total)}),
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


# -- the same samples in each peer's format ----------------------------------------------------
def _samples(kind: str, pff: Path):
    if kind == "imagenet":
        ds = image_folder_dataset(pff)[0]
        return len(ds), lambda i: {"image": ds[i]["image"], "label": int(ds[i]["label"])}
    files = sorted(pff.glob("*.pkl"))
    return len(files), lambda i: pickle.loads(files[i].read_bytes())


def write_mds(kind: str, pff: Path, out: Path) -> None:
    sb = _streaming()
    n, get = _samples(kind, pff)
    cols = {"image": "ndarray:uint8", "label": "int"} if kind == "imagenet" else \
        {k: "ndarray" for k in get(0)}
    with sb.MDSWriter(out=str(out), columns=cols, size_limit=64 << 20) as w:
        for i in range(n):
            w.write(get(i))


_LIT: dict = {}


def _lit_item(arg):
    kind, pff, i = arg
    if (kind, pff) not in _LIT:         # once per optimize worker, not once per sample
        _LIT[(kind, pff)] = _samples(kind, Path(pff))[1]
    return _LIT[(kind, pff)](i)


def write_litdata(kind: str, pff: Path, out: Path) -> None:
    import litdata
    n, _ = _samples(kind, pff)
    litdata.optimize(fn=_lit_item, inputs=[(kind, str(pff), i) for i in range(n)],
                     output_dir=str(out), chunk_bytes="64MB", num_workers=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/forebay-peers"))
    p.add_argument("--kind", default="imagenet", choices=["ising", "imagenet"])
    p.add_argument("--samples", type=int, default=10000)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3, help="the first is cold")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--compute-ms", type=float, default=0.0)
    p.add_argument("--sync-steps", action="store_true",
                   help="an all-reduce after every step, as synchronous SGD's gradients "
                        "(the ranks step together, as the simulator assumes)")
    p.add_argument("--launcher", default="torchrun", choices=["torchrun", "mpiexec"],
                   help="mpiexec: forebay on MPI (the timing still meets over gloo)")
    p.add_argument("--touch", action="store_true",
                   help="the loop reads every byte of every image once (xxh3)")
    p.add_argument("--ram-bytes", type=int, default=0,
                   help="clairvoyant RAM tier per rank (default: the whole dataset)")
    p.add_argument("--contenders", help="comma-separated (default: every forebay mode "
                   "and peer; for graphs no views contender: graph batches are a copy)")
    p.add_argument("--throttle", metavar="MBPS[,IOPS]",
                   help="cap reads from the data's disk (block-I/O cgroup; root)")
    p.add_argument("--evict-each-epoch", action="store_true",
                   help="empty the page cache of the contender's files before every epoch")
    p.add_argument("--network-fs", action="store_true",
                   help="forebay treats the data's file system as shared between hosts "
                   "(FOREBAY_NETWORK_FS), as on a parallel file system")
    p.add_argument("--cluster", type=int, default=0, metavar="NODES",
                   help="run every job across NODES emulated nodes (root; see above)")
    p.add_argument("--cpus-per-node", type=float, default=None, metavar="C",
                   help="with --cluster: each node capped at C cores (default: none)")
    p.add_argument("--fs", choices=("cgroup", "fuse"), default="cgroup",
                   help="how --throttle makes the file system slow: a block-I/O cgroup "
                        "on the data's disk (default), or the data served through a "
                        "paced FUSE file system (no credit for a reader's idle time; "
                        "tests/cluster_pfs.py)")
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", help=argparse.SUPPRESS)
    for k in ("pff", "packed", "mds", "lit"):
        p.add_argument(f"--{k}", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    from forebay.dataset.sources import get_source, ingest
    from forebay.synth import synthesize

    a.out.mkdir(parents=True, exist_ok=True)
    stem = f"{a.kind}-{a.samples}"
    paths = {"pff": a.out / f"{stem}-pff", "packed": a.out / f"{stem}.fb",
             "mds": a.out / f"{stem}-mds", "lit": a.out / f"{stem}-litdata"}
    if not paths["pff"].exists():
        synthesize(a.kind, paths["pff"], a.samples, 0, progress=True)
    if not paths["packed"].exists():
        src = get_source("imagefolder", paths["pff"]) if a.kind == "imagenet" else \
            get_source("pickle", paths["pff"], trust_pickle=True)
        ingest(src, paths["packed"], progress=True)
    contenders = [c for c in a.contenders.split(",") if c] if a.contenders else \
        [c for c in FOREBAY + PEERS if (a.kind == "imagenet" or not c.endswith(" views"))
         and not c.endswith(" file_system")]
    if not paths["mds"].exists() and "mosaicml-streaming" in contenders:
        write_mds(a.kind, paths["pff"], paths["mds"])
    if not paths["lit"].exists() and "litdata" in contenders:
        write_litdata(a.kind, paths["pff"], paths["lit"])
    import forebay
    if not a.ram_bytes:
        a.ram_bytes = int(forebay.open_dataset(paths["packed"]).nbytes) + (64 << 20)
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    if a.network_fs:
        from forebay._fs import NETWORK_FS_ENV, filesystem_type

        a.fs_type = filesystem_type(paths["packed"])
        env[NETWORK_FS_ENV] = a.fs_type or ""
    runs: dict[str, list[dict]] = {}
    if a.fs == "fuse" and not a.throttle:
        p.error("--fs fuse needs --throttle MBPS[,IOPS] (its pace)")
    # through FUSE, each node a client of its own (its own page cache), and this one
    slow_fs = paced(a.out, a.throttle, (a.cluster or 0) + 1) if a.fs == "fuse" else \
        throttled(paths["packed"], a.throttle)
    with slow_fs as throttle, _cluster(a) as cluster:
        if a.fs == "fuse":          # every contender reads through the mount
            paths = {k: throttle.path(v) for k, v in paths.items()}
            if cluster is not None:
                throttle.attach(cluster)
        files = {"forebay": files_under(paths["packed"]), "torch": files_under(paths["pff"]),
                 "mosaicml-streaming": files_under(paths["mds"]) if paths["mds"].exists()
                 else [],
                 "litdata": files_under(paths["lit"]) if paths["lit"].exists() else []}
        if cluster is not None:
            env["MASTER_ADDR"] = cluster.hosts[0]
        _rounds(a, contenders, paths, files, env, runs, throttle, cluster)
    _report(a, contenders, runs, throttle)


def _cluster(a):
    """The emulated cluster of ``--cluster`` (a context manager), or a null context."""
    import contextlib

    if not a.cluster:
        return contextlib.nullcontext(None)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from cluster import Cluster, unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"--cluster: {why}")
    if a.ranks % a.cluster:
        raise SystemExit(f"--ranks {a.ranks} must be a multiple of --cluster {a.cluster}")
    return Cluster(a.cluster, a.out / "cluster", shm_bytes=1 << 30, cpus=a.cpus_per_node)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(a, cmd: list[str], env: dict, throttle, cluster) -> subprocess.CompletedProcess:
    """One job of ``cmd`` (the worker's arguments) under the chosen launcher, on this
    host or across the emulated nodes, in the throttled cgroup if any."""
    wrap = throttle.wrap if throttle is not None else (lambda c: c)
    if cluster is None:
        launch = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node",
                  str(a.ranks)] if a.launcher == "torchrun" else \
            [str(BIN / "mpiexec"), "-n", str(a.ranks), sys.executable]
        return subprocess.run(wrap(launch + cmd), capture_output=True, text=True,
                              timeout=3600, env=env)
    ppn = a.ranks // a.cluster
    if a.launcher == "mpiexec":
        argv = cluster.mpiexec_argv([sys.executable, *cmd], ppn=ppn)
        return subprocess.run(wrap(cluster.on(0, argv)), capture_output=True, text=True,
                              timeout=3600, env=cluster.env(env))
    argv = cluster.torchrun_argv(cmd, ppn=ppn, port=_free_port())
    procs = [subprocess.Popen(wrap(cluster.on(k, argv)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=cluster.env(env))
             for k in range(a.cluster)]
    outs = [p.communicate(timeout=3600) for p in procs]
    return subprocess.CompletedProcess(cmd, max(abs(p.returncode) for p in procs),
                                       "".join(o for o, _ in outs), "".join(e for _, e in outs))


def _rounds(a, contenders, paths, files, env, runs, throttle, cluster=None) -> None:
    for rep in range(a.reps):
        k = rep % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            # every client's cache, with a file system of several (--fs fuse)
            getattr(throttle, "evict", evict)(files[c.split()[0]])
            cmd = [__file__, "--worker", "--contender", c, "--kind", a.kind,
                   "--batch-size", str(a.batch_size), "--epochs", str(a.epochs),
                   "--compute-ms", str(a.compute_ms), "--ram-bytes", str(a.ram_bytes)]
            cmd += ["--evict-each-epoch"] if a.evict_each_epoch else []
            cmd += ["--touch"] if a.touch else []
            cmd += ["--sync-steps"] if a.sync_steps else []
            for name, path in paths.items():
                cmd += [f"--{name}", str(path)]
            env["MASTER_PORT"] = str(_free_port())     # (mpiexec: the timing's gloo)
            read0 = throttle.read_bytes() if throttle is not None else 0
            cpu0 = throttle.cpu_seconds() if hasattr(throttle, "cpu_seconds") else None
            proc = _launch(a, cmd, env, throttle, cluster)
            if proc.returncode != 0:
                sys.exit(f"{c} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            r = json.loads(next(line for line in proc.stdout.splitlines()
                                if line.startswith("RESULT "))[7:])
            # distinct samples: forebay's plan pads the last global batch with repeats,
            # DistributedSampler pads to a multiple of the ranks; neither counts
            n = r["samples"] = min(r["samples"], a.samples)
            r["cold"] = n / (r["setup_s"] + r["epoch_s"][0])
            r["warm"] = n / float(np.median(r["epoch_s"][1:]))
            r["run"] = n * len(r["epoch_s"]) / (r["setup_s"] + sum(r["epoch_s"]))
            if throttle is not None:    # what the file system served, per sample read
                r["device_bytes_per_sample"] = (throttle.read_bytes() - read0) / (
                    n * len(r["epoch_s"]))
            r["rep"] = rep
            if cpu0 is not None:      # what the paced file system's server took of the cores
                r["fs_server_cpu_s"] = throttle.cpu_seconds() - cpu0
            runs.setdefault(c, []).append(r)
            print(f"rep {rep} {c:<22} set-up {r['setup_s']:6.2f} s, epochs "
                  f"{', '.join(f'{t:.2f}' for t in r['epoch_s'])} s ({n} samples)"
                  + (f"; the file system's server used {r['fs_server_cpu_s']:.2f} CPU-s"
                     if cpu0 is not None else "")
                  + "; the ranks' CPU an epoch "
                  + ", ".join(f"{t:.2f}" for t in r["epoch_cpu_s"]) + " s",
                  flush=True)


def _report(a, contenders, runs, throttle) -> None:
    print(f"\nmachine: {machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{a.kind}, {a.samples} samples, {a.ranks} ranks under {a.launcher}, per-rank batch "
          f"{a.batch_size}"
          + (f", across {a.cluster} emulated nodes" if a.cluster else "")
          + (f" of {a.cpus_per_node:g} core each" if a.cluster and a.cpus_per_node else "")
          + f", {a.epochs} epochs (the first cold, after evicting the "
          f"contender's files{'; evicted again before every epoch' if a.evict_each_epoch else ''}"
          f"), compute {a.compute_ms} ms/step"
          + (" with an all-reduce after each" if a.sync_steps else "")
          + f"{', every image byte read by the loop (--touch)' if a.touch else ''}, {a.reps} rounds"
          + (f"; {throttle.describe()}" if throttle is not None else "")
          + (f"; forebay told {a.fs_type} is shared between hosts (FOREBAY_NETWORK_FS)"
             if a.network_fs else ""))
    # ratios to the best peer of each round (no peer run: to the best contender)
    peers = [c for c in contenders if c in PEERS] or contenders
    later = "later epochs (files evicted)" if a.evict_each_epoch else "warm"
    print(f"\n| contender | cold samples/s (set-up counted), median | vs best peer, min / "
          f"median | {later} samples/s, median | vs best peer, min / median | whole run "
          f"(set-up + every epoch) vs best peer, min / median | set-up s |"
          + (" device bytes read per sample and epoch, median |" if throttle else ""))
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if throttle else ""))
    for c in contenders:
        row = []
        for what in ("cold", "warm", "run"):
            ratios = []
            for r in runs[c]:
                best = max(x[what] for p_ in peers for x in runs[p_] if x["rep"] == r["rep"])
                ratios.append(r[what] / best)
            rate = f"{statistics.median(x[what] for x in runs[c]):,.0f} | " \
                if what != "run" else ""
            row.append(f"{rate}{min(ratios):.2f} / {statistics.median(ratios):.2f}")
        setup = statistics.median(x["setup_s"] for x in runs[c])
        dev = [x["device_bytes_per_sample"] for x in runs[c] if "device_bytes_per_sample" in x]
        extra = f" {statistics.median(dev):,.0f} |" if dev else ""
        print(f"| {c} | {' | '.join(row)} | {setup:.2f} |{extra}")
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(), "args": vars(a) | {
            "out": str(a.out), "json": str(a.json)}, "runs": runs}, indent=1, default=str))


if __name__ == "__main__":
    main()

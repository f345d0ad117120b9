"""The simulator against runs measured on the emulated cluster (issue R, item 2): the
default (conserving) model, calibrated once, predicts each loader's run at 1, 2 and 4
nodes; the table gives the error per run, epoch 1 and the later epochs.

The runs: ``benchmarks/loader/peers_bench.py --cluster N --throttle MBPS,IOPS
--evict-each-epoch --network-fs --compute-ms MS --json nN.json`` (root; one rank per node,
the shared disk capped by a block-I/O cgroup, every epoch read from the disk again).

The calibration, once (root; ``--profile`` reuses it): ``forebay calibrate --dataset``
under mpiexec across two emulated nodes, inside the same throttled cgroup: RAM copy
bandwidth, the packed dataset's cold random reads per reader count (the PFS table t(k))
and one-sided gets from the other node's memory (the link).  torch reads one file per
sample: its t(k) is measured the same way on those files (cold, k threads, in the
cgroup).  The preprocessing rate of each path is timed warm (forebay's get_many +
collate; torch's ``__getitem__`` + per-sample collate; torch with worker processes,
warm epochs through them, batches handed back in shared memory, with the CPU seconds
a batch costs the workers and the main process); each figure the median of three.  Nothing is fitted to the times
under test: compute is the runs' ``--compute-ms`` per step.  Runs made on capped nodes
(``--cpus-per-node``) are calibrated on nodes of the same size, and the rates timed on one.

    python benchmarks/loader/peers_bench.py --out /tmp/cb --kind imagenet --samples 2000 \\
        --ranks N --cluster N [--cpus-per-node 0.5] --launcher mpiexec --reps 2 --epochs 3 \\
        --throttle 300,3000 \\
        --evict-each-epoch --network-fs --compute-ms 10 --json /tmp/rv/nN.json \\
        --contenders "forebay preload,forebay clairvoyant,forebay direct,torch 0 workers,torch 2 workers"
    python benchmarks/sim/sim_cluster.py --data /tmp/cb --runs /tmp/rv/n1.json \\
        /tmp/rv/n2.json /tmp/rv/n4.json --profile /tmp/rv/profile.toml [--measured-steps]

On 2 cores, 4 nodes of one core do not fit: RESULTS' 4-node table scales every rate
by 1/4 instead (``--cpus-per-node 0.4 --throttle 75,750 --fs fuse --compute-ms 80``).
``--calibration SIM.json`` predicts again from the rates and steps an earlier
``--json`` recorded, measuring nothing (a change to the model, checked in seconds).

Runs made with ``--fs fuse`` (the data served by tests/cluster_pfs.py's paced file
system, which gives a pausing reader no credit) are calibrated through the same mount,
made once before any node; forebay-preload's chunks then load at the calibration's
``stream_MBps`` (large requests), every other read at its ``read_MBps`` (a request per
record), as a cluster's nodes read it: a node's records at the rate of its share of
them (``read_fraction`` and ``dense_MBps``: a record's request brings in parts of its
neighbours, ``System.pfs_record_cost``).  peers_bench gives each node a client of the
mount of its own (its own page cache), as a cluster's nodes have.

Which policy models which loader: torch with 0 workers is *naive* (fetch, collate,
compute in turn) over the files; torch with 2 workers is *staging* with 2 threads and
its prefetch depth (2 workers x prefetch_factor 4 batches), queueing for the node's
cores (``System.cpus``: ``--cpus-per-node``; docs/sim.md, "A node's cores"): the
workers' CPU a batch is its preprocessing, and the main process's CPU taking each
batch back is the hand-back, in series with the step (``System.handback_MBps``), both
timed over warm epochs through the workers (``torch 2 workers file_system``: the same
over the figures timed with that sharing strategy).  The table ends with the CPU a
batch the runs spent on a node (peers_bench's ``epoch_cpu_s``) next to the
calibration's.  forebay direct is *staging* with the loader's one prefetch thread over
the packed dataset; forebay preload and clairvoyant are *forebay-preload*
and *forebay-clairvoyant* (the runtime's own placement).

forebay direct is left out of the error summary: it keeps the dataset mapped and the
kernel does not drop mapped pages, so on one machine (one page cache for every
emulated node) its later epochs read memory, not the disk (its PFS MB column shows it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))                    # _common, _baselines
sys.path.insert(0, str(HERE.parent))                        # sim_validate
sys.path.insert(0, str(HERE.parents[2] / "tests"))          # cluster
from _baselines import image_collate, image_folder_dataset  # noqa: E402
from _common import machine, paced, throttled, tree_cpu_s  # noqa: E402
from sim_validate import _cold_MBps, _rate  # noqa: E402

#: torch DataLoader's prefetch: workers x prefetch_factor batches (peers_bench's settings)
TORCH_WORKERS, PREFETCH_FACTOR = 2, 4
#: forebay's loader (its default Pipeline(prefetch=4)): 4 batches wait in its queue and
#: its thread fetches a fifth while the loop uses one
FOREBAY_PREFETCH = 4
#: the model's staging buffer holds the batch in use too (a batch leaves it when its
#: step ends), so it is one batch more than what a loader keeps ahead: torch's next
#: fetch starts when the loop takes a batch, with workers x prefetch_factor outstanding;
#: forebay's when a batch leaves its queue, with its queue full and one in its thread
FOREBAY_BUFFER = FOREBAY_PREFETCH + 2


def torch_buffer(workers: int) -> int:
    """The model's buffer, in batches, for torch's DataLoader with ``workers``."""
    return workers * PREFETCH_FACTOR + 1


def calibrate(packed: Path, spec: str, out: Path, workdir: Path,
              cpus: "float | None" = None) -> None:
    """``forebay calibrate --dataset packed`` across two emulated nodes (of ``cpus``
    cores each), throttled."""
    from cluster import Cluster, unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"calibration needs the emulated cluster: {why}")
    with throttled(packed, spec) as th, Cluster(2, workdir / "cluster", cpus=cpus) as cl:
        forebay_cli = str(Path(sys.executable).with_name("forebay"))
        argv = cl.mpiexec_argv([forebay_cli, "calibrate", "--dataset",
                                str(packed), "--out", str(out)], ppn=1)
        cmd = cl.on(0, argv)
        proc = subprocess.run(th.wrap(cmd) if th else cmd, capture_output=True, text=True,
                              timeout=900, env=cl.env(dict(os.environ)))
        if proc.returncode:
            raise SystemExit(f"forebay calibrate failed:\n{proc.stderr[-3000:]}")


#: times each calibration figure of this script is measured (its median is used): one
#: measurement of a figure moved by up to a third between two runs on one mount
REPEAT = 3


def files_table(pff: Path, spec: str, readers=(1, 2, 4)) -> dict[int, float]:
    """Cold reads of one file per sample by k threads, in the throttled cgroup (the
    median of REPEAT measurements per k)."""
    ds, files = image_folder_dataset(pff)
    sizes = np.array([f.stat().st_size for f in files], dtype=np.int64)
    ids = np.random.default_rng(0).permutation(len(files))   # every file: a stable figure
    with throttled(pff, spec) as th:
        if th is not None:
            th.join()
        got = [_cold_MBps(lambda: lambda part: [files[int(i)].read_bytes() for i in part],
                          files, ids, lambda i: int(sizes[i].sum()), readers)
               for _ in range(REPEAT)]
    return {k: statistics.median(g[k] for g in got) for k in readers}


def torch_workers(pff: Path, bs: int, workers: int, sharing: "str | None" = None) -> dict:
    """torch's DataLoader with ``workers`` worker processes over the files, warm (the
    median of REPEAT epochs after one): reading from the page cache, collating and handing each
    batch back through shared memory.  ``MBps``: the model's preprocessing rate of that
    path; ``main_cpu_ms`` and ``workers_cpu_ms``: the CPU a batch costs the main
    process (taking it back) and the workers, in that epoch.  ``sharing``: torch's
    sharing strategy for the run (then set for the rest of the process)."""
    import torch

    if sharing:
        torch.multiprocessing.set_sharing_strategy(sharing)

    ds, files = image_folder_dataset(pff)
    nbytes = sum(f.stat().st_size for f in files)
    loader = torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, num_workers=workers,
                                         persistent_workers=True,
                                         prefetch_factor=PREFETCH_FACTOR,
                                         collate_fn=image_collate)
    got: dict[str, list] = {"MBps": [], "main_cpu_ms": [], "workers_cpu_ms": []}
    for epoch in range(REPEAT + 1):           # the first starts the workers: not counted
        it = iter(loader)                    # the workers exist from here on
        c0, w0, t0 = time.process_time(), tree_cpu_s(own=False), time.perf_counter()
        n = sum(1 for _batch in it)
        t = time.perf_counter() - t0
        if epoch:
            got["MBps"].append(nbytes / t / 1e6)
            got["main_cpu_ms"].append(1e3 * (time.process_time() - c0) / n)
            got["workers_cpu_ms"].append(1e3 * (tree_cpu_s(own=False) - w0) / n)
    return {k: statistics.median(v) for k, v in got.items()}


def rates(packed: Path, pff: Path, spec: "str | None", bs: int,
          file_system: bool = False) -> dict:
    """The files' t(k) and the preprocessing rates of each path (in this process, or,
    when the runs' nodes were capped, see :func:`rates_on_a_node`); ``file_system``:
    torch's workers timed again with that sharing strategy (a run has that contender)."""
    import forebay
    from forebay.torch import default_collate

    ds = forebay.open_dataset(packed)
    sizes = np.asarray(ds.sample_nbytes, dtype=np.int64)
    tds, files = image_folder_dataset(pff)
    fsizes = np.array([f.stat().st_size for f in files], dtype=np.int64)
    rng = np.random.default_rng(0)
    picks = [rng.choice(len(ds), bs, replace=False) for _ in range(20)]

    def rate(fn, nbytes: int) -> float:
        return statistics.median(_rate(fn, picks, nbytes) for _ in range(REPEAT))

    got = {"files_MBps": files_table(pff, spec),
            "beta_forebay_MBps": rate(lambda b: default_collate(ds.get_many(b)),
                                      sum(int(sizes[b].sum()) for b in picks)),
            "beta_torch_MBps": rate(lambda b: image_collate([tds[int(i)] for i in b]),
                                    sum(int(fsizes[b].sum()) for b in picks)),
            **{f"torch_workers_{k}": v for k, v in
               torch_workers(pff, bs, TORCH_WORKERS).items()}}
    if file_system:    # after the default: the strategy stays set in this process
        got.update({f"torch_workers_fs_{k}": v for k, v in
                    torch_workers(pff, bs, TORCH_WORKERS, "file_system").items()})
    return got


def rates_on_a_node(packed: Path, pff: Path, spec: str, bs: int, cpus: float,
                    workdir: Path, file_system: bool = False) -> dict:
    """:func:`rates` measured on a node of ``cpus`` cores, in the throttled cgroup."""
    from cluster import Cluster

    out = workdir / "rates.json"
    with throttled(packed, spec) as th, Cluster(1, workdir / "one", cpus=cpus) as cl:
        cmd = cl.on(0, [sys.executable, str(HERE), "--rates", str(out), str(packed),
                        str(pff), str(bs), str(int(file_system))])
        proc = subprocess.run(th.wrap(cmd) if th else cmd, capture_output=True, text=True,
                              timeout=900, env=cl.env(dict(os.environ)))
        if proc.returncode:
            raise SystemExit(f"the rates on a node failed:\n{proc.stderr[-3000:]}")
    return {k: ({int(x): y for x, y in v.items()} if isinstance(v, dict) else v)
            for k, v in json.loads(out.read_text()).items()}


def step_probe(compute_ms: float, steps: int) -> None:
    """One rank of the loop without I/O (``--probe``, under mpiexec): ``steps`` steps
    of ``compute_ms`` of sleep and a one-element gloo all-reduce, as peers_bench's loop
    with ``--sync-steps``; rank 0 prints the slowest rank's mean step in seconds."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("RANK", os.environ.get("PMI_RANK", "0"))
    os.environ.setdefault("WORLD_SIZE", os.environ.get("PMI_SIZE", "1"))
    dist.init_process_group("gloo")
    for _ in range(10):                         # the group's connections made
        dist.all_reduce(torch.zeros(1))
    t0 = time.perf_counter()
    for _ in range(steps):
        time.sleep(compute_ms / 1e3)
        dist.all_reduce(torch.zeros(1))
    t = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"STEP {float(t)}", flush=True)
    dist.destroy_process_group()


def step_seconds(nodes: int, compute_ms: float, cpus: "float | None", workdir: Path,
                 steps: int = 200) -> float:
    """The loop's step without I/O on ``nodes`` emulated nodes (of ``cpus`` cores), one
    rank each: what the model's compute per step is on that rig."""
    from cluster import Cluster

    with Cluster(nodes, workdir / f"probe{nodes}", cpus=cpus) as cl:
        argv = cl.mpiexec_argv([sys.executable, str(HERE), "--probe", str(compute_ms),
                                str(steps)], ppn=1)
        # the nodes' own network: no port of this host's in the way
        env = cl.env(dict(os.environ, MASTER_ADDR=cl.hosts[0], MASTER_PORT="29533"))
        proc = subprocess.run(cl.on(0, argv), capture_output=True, text=True, timeout=600,
                              env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("STEP ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"the step probe failed:\n{proc.stderr[-3000:]}")
    return float(line.split()[1])


def _cpu_a_batch(runs: list[dict], bs: int, samples: int, nodes: int) -> "float | None":
    """The CPU a batch costs a node in the runs' later epochs, every process of it (the
    ranks and their workers; peers_bench's ``epoch_cpu_s``, summed over the nodes):
    the median over the repetitions, in ms; None for runs without it."""
    got = [statistics.mean(r["epoch_cpu_s"][1:]) / nodes for r in runs
           if len(r.get("epoch_cpu_s", [])) > 1]
    steps = -(-samples // (nodes * bs))                 # a node's batches an epoch
    return 1e3 * statistics.median(got) / steps if got else None


def _median_run(rows: list[dict]) -> dict:
    """Per-epoch medians over the repetitions, and the set-up's."""
    epochs = [statistics.median(r["epoch_s"][e] for r in rows)
              for e in range(len(rows[0]["epoch_s"]))]
    return {"setup_s": statistics.median(r["setup_s"] for r in rows), "epoch_s": epochs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, help="peers_bench's --out directory")
    p.add_argument("--runs", type=Path, nargs="+")
    p.add_argument("--profile", type=Path, help="the calibration (written here when missing)")
    p.add_argument("--json", type=Path)
    # the workers of rates_on_a_node (OUT PACKED PFF BATCH) and step_seconds (MS STEPS)
    p.add_argument("--rates", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--probe", nargs=2, type=float, help=argparse.SUPPRESS)
    p.add_argument("--calibration", type=Path, metavar="JSON",
                   help="the rates and steps a previous --json recorded, reused (nothing "
                        "measured again: the model's prediction alone)")
    p.add_argument("--measured-steps", action="store_true",
                   help="the model's compute per step from the loop run without I/O on "
                        "the same nodes (sleep and all-reduce), not --compute-ms alone")
    a = p.parse_args()
    if a.probe:
        step_probe(a.probe[0], int(a.probe[1]))
        return
    if a.rates:                   # on a capped node, already in the throttled cgroup
        out, packed, pff, bs, fs = a.rates
        Path(out).write_text(json.dumps(rates(Path(packed), Path(pff), None, int(bs),
                                              fs == "1")))
        return
    if not (a.data and a.runs and a.profile):
        p.error("--data, --runs and --profile are required")
    if a.calibration and not a.profile.exists():
        p.error("--calibration reuses a calibrated --profile: it must exist")
    docs = [json.loads(r.read_text()) for r in a.runs]
    args0 = docs[0]["args"]
    spec, samples = args0["throttle"], args0["samples"]
    cpus = args0.get("cpus_per_node")
    if any(d["args"].get("cpus_per_node") != cpus for d in docs):
        raise SystemExit("the runs were made on nodes of different sizes (--cpus-per-node)")
    packed = a.data / f"{args0['kind']}-{samples}.fb"
    pff = a.data / f"{args0['kind']}-{samples}-pff"
    bs = args0["batch_size"]
    fs = args0.get("fs") or "cgroup"
    if any((d["args"].get("fs") or "cgroup") != fs for d in docs):
        raise SystemExit("the runs were made on different file systems (--fs)")
    with contextlib.ExitStack() as stack:
        if fs == "fuse" and not a.calibration:     # calibrated through the same paced mount, made before the nodes
            pfs = stack.enter_context(paced(a.data, spec))
            packed, pff, spec = pfs.path(packed), pfs.path(pff), None
            print(f"file system: {pfs.describe()}")
        predict(a, docs, packed, pff, spec, bs, cpus)


def predict(a: argparse.Namespace, docs: list, packed: Path, pff: Path,
            spec: "str | None", bs: int, cpus: "float | None") -> None:
    """Calibrate (unless ``a.profile`` exists), then predict every run of ``docs`` and
    print the table."""
    import forebay
    from forebay.plan import AccessPlan
    from forebay.sim import System, Workload, simulate_policy
    from forebay.store import load_profile

    if not a.profile.exists():
        with tempfile.TemporaryDirectory() as tmp:
            calibrate(packed, spec, a.profile, Path(tmp), cpus)
    prof = load_profile(a.profile)
    old = json.loads(a.calibration.read_text()) if a.calibration else None
    if old is not None:
        if "torch_workers_main_cpu_ms" not in old:
            raise SystemExit(f"{a.calibration} has no CPU figures of torch's workers (an "
                             f"older --json): calibrate again, without --calibration")
        got = {k: old[k] for k in ("files_MBps", "beta_forebay_MBps", "beta_torch_MBps",
                                   "torch_workers_MBps", "torch_workers_main_cpu_ms",
                                   "torch_workers_workers_cpu_ms")}
        got.update({k: old[k] for k in ("torch_workers_fs_main_cpu_ms",
                                         "torch_workers_fs_workers_cpu_ms") if k in old})
        got["files_MBps"] = {int(k): v for k, v in got["files_MBps"].items()}
    else:
        fs = any(name.endswith(" file_system") for doc in docs for name in doc["runs"])
        if cpus:
            with tempfile.TemporaryDirectory() as tmp:
                got = rates_on_a_node(packed, pff, spec, bs, cpus, Path(tmp), fs)
        else:
            got = rates(packed, pff, spec, bs, fs)
    t_files, beta_fb = got["files_MBps"], got["beta_forebay_MBps"]
    beta_torch, beta_workers = got["beta_torch_MBps"], got["torch_workers_MBps"]
    main_ms, workers_ms = got["torch_workers_main_cpu_ms"], got["torch_workers_workers_cpu_ms"]
    fs_ms = (got.get("torch_workers_fs_main_cpu_ms"), got.get("torch_workers_fs_workers_cpu_ms"))

    ds = forebay.open_dataset(packed)
    sizes = np.asarray(ds.sample_nbytes, dtype=np.int64)
    _tds, files = image_folder_dataset(pff)
    fsizes = np.array([f.stat().st_size for f in files], dtype=np.int64)
    mem = prof["ram"]["copy_MBps"]
    link = max(prof.get("rma", {}).get("get_MBps", {}).values() or mem.values())
    t_packed = prof["pfs"]["read_MBps"]
    print(f"machine: {machine()}" + (f"; nodes of {cpus:g} core each" if cpus else ""))
    print(f"calibration: packed t(k) {t_packed} MB/s (random records, "
          f"{prof['pfs'].get('read_fraction', '-')} of them; every record of a range "
          f"{prof['pfs'].get('dense_MBps', '-')}; streamed "
          f"{prof['pfs'].get('stream_MBps', '-')}), files t(k) "
          f"{ {k: round(v) for k, v in t_files.items()} } MB/s, RAM {mem} MB/s, link "
          f"{link:.0f} MB/s; beta forebay {beta_fb:.0f} MB/s, torch {beta_torch:.0f} MB/s, "
          f"torch through {TORCH_WORKERS} workers {beta_workers:.0f} MB/s (CPU a batch: "
          f"{workers_ms:.1f} ms in the workers, {main_ms:.1f} ms taking it back"
          + (f"; with file_system sharing {fs_ms[1]:.1f} and {fs_ms[0]:.1f} ms"
             if fs_ms[0] is not None else "") + ")")

    rows = []
    steps_ms: dict = {}
    for doc in docs:
        ar = doc["args"]
        n, epochs, cms = ar["ranks"], ar["epochs"], ar["compute_ms"]
        if old is not None and str(n) in old["step_ms"]:
            steps_ms[n] = old["step_ms"][str(n)]
            cms = steps_ms[n]
        elif a.measured_steps and cms:
            with tempfile.TemporaryDirectory() as tmp:
                steps_ms[n] = 1e3 * step_seconds(n, cms, cpus, Path(tmp))
            print(f"the loop's step without I/O on {n} node(s): {steps_ms[n]:.2f} ms "
                  f"({cms:g} ms of compute)")
            cms = steps_ms[n]
        plan = AccessPlan(len(sizes), n, bs, epochs, seed=0)
        for name, runs in doc["runs"].items():
            meas = _median_run(runs)
            torch_run = name.startswith("torch")
            sz = fsizes if torch_run else sizes
            c = bs * sz.mean() / 1e6 / (cms / 1e3) if cms else 1e9
            base = dict(compute_MBps=c, network_MBps=link, mem_MBps=mem,
                        ram_threads=1, ssd_threads=1, name="emulated cluster")
            nw = int(name.split()[1]) if torch_run else 0
            m_ms = w_ms = 0.0
            if torch_run:
                batch_MB = bs * sz.mean() / 1e6
                # with workers: their CPU a batch and the main process's taking it
                # back (in series with the step), both on the node's cores
                m_ms, w_ms = (main_ms, workers_ms)
                if name.endswith(" file_system"):
                    if fs_ms[0] is None:
                        raise SystemExit(f"{name}: the calibration has no file_system "
                                         f"figures (an older --json): calibrate again")
                    m_ms, w_ms = fs_ms
                extra = dict(preprocess_MBps=batch_MB / (w_ms / 1e3),
                             handback_MBps=batch_MB / (m_ms / 1e3), cpus=cpus) \
                    if nw else dict(preprocess_MBps=beta_torch)
                sysm = System(pfs_MBps=t_files, staging_threads=max(nw, 1),
                              staging_bytes=int(torch_buffer(max(nw, 1)) * bs * sz.mean()),
                              **extra, **base)
                policy = "staging" if nw else "naive"
            else:
                mode = name.split()[1]
                sysm = System(preprocess_MBps=beta_fb, pfs_MBps=t_packed,
                              pfs_stream_MBps=prof["pfs"].get("stream_MBps", {}),
                              pfs_dense_MBps=prof["pfs"].get("dense_MBps", {}),
                              pfs_read_fraction=prof["pfs"].get("read_fraction", 0.0),
                              staging_threads=1,
                              staging_bytes=int(FOREBAY_BUFFER * bs * sz.mean()),
                              ram_bytes=int(ar.get("ram_bytes") or sz.sum()), **base)
                policy = {"direct": "staging", "preload": "forebay-preload",
                          "clairvoyant": "forebay-clairvoyant"}[mode]
            wl = Workload(sz, plan if not torch_run else
                          AccessPlan(len(sz), n, bs, epochs, seed=0), sysm,
                          per_file=torch_run)
            res = simulate_policy(policy, wl)
            if res["failed"]:
                print(f"{name} at {n}: {res['failed']}")
                continue
            m_total = meas["setup_s"] + sum(meas["epoch_s"])
            m_first = meas["setup_s"] + meas["epoch_s"][0]
            m_later = sum(meas["epoch_s"][1:])
            p_first = res["epoch_s"][0]
            p_later = sum(res["epoch_s"][1:])
            dev = [r["device_bytes_per_sample"] for r in runs
                   if r.get("device_bytes_per_sample") is not None]
            m_mb = statistics.median(dev) * len(sz) * epochs / 1e6 if dev else None
            rows.append({"nodes": ar.get("cluster") or 1, "loader": name, "policy": policy,
                         "measured_pfs_MB": m_mb, "predicted_pfs_MB": res.get("pfs_MB"),
                         "measured_s": m_total, "predicted_s": res["total_s"],
                         "measured_first_s": m_first, "predicted_first_s": p_first,
                         "measured_later_s": m_later, "predicted_later_s": p_later,
                         "binding": res.get("binding"),
                         "cpu_ms": _cpu_a_batch(runs, bs, len(sz), ar.get("cluster") or 1)
                         if nw else None,
                         "calibrated_cpu_ms": m_ms + w_ms if nw else None})
    print("\n| nodes | loader | policy | run measured s | predicted s | error | epoch 1 "
          "error | later epochs error | PFS MB measured | predicted | bound |\n"
          "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|")

    def err(p_, m_):
        return f"{100 * (p_ / m_ - 1):+.0f}%"

    for r in rows:
        print(f"| {r['nodes']} | {r['loader']} | {r['policy']} | {r['measured_s']:.2f} | "
              f"{r['predicted_s']:.2f} | {err(r['predicted_s'], r['measured_s'])} | "
              f"{err(r['predicted_first_s'], r['measured_first_s'])} | "
              f"{err(r['predicted_later_s'], r['measured_later_s'])} | "
              + (f"{r['measured_pfs_MB']:.0f}" if r["measured_pfs_MB"] is not None else "-")
              + f" | {r['predicted_pfs_MB']:.0f} | {r['binding']} |")
    errs = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows
            if r["loader"] != "forebay direct"]
    if errs:
        print(f"\nwhole runs (forebay direct left out): mean |error| {100 * np.mean(errs):.0f}%, max "
              f"{100 * max(errs):.0f}%; within 10%: {sum(e <= 0.10 for e in errs)} of "
              f"{len(errs)}, within 15%: {sum(e <= 0.15 for e in errs)}")
    cpu = [r for r in rows if r["cpu_ms"] is not None]
    if cpu:       # the calibration's CPU a batch against what the runs spent
        print("\nCPU a batch on a node, its later epochs (every process) / the calibration's: "
              + "; ".join(f"{r['loader']} at {r['nodes']}: {r['cpu_ms']:.1f} / "
                          f"{r['calibrated_cpu_ms']:.1f} ms" for r in cpu))
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(), "profile": prof,
                                      "step_ms": steps_ms,
                                      "files_MBps": t_files, "beta_forebay_MBps": beta_fb,
                                      "beta_torch_MBps": beta_torch,
                                      "torch_workers_MBps": beta_workers,
                                      "torch_workers_main_cpu_ms": main_ms,
                                      "torch_workers_workers_cpu_ms": workers_ms,
                                      "torch_workers_fs_main_cpu_ms": fs_ms[0],
                                      "torch_workers_fs_workers_cpu_ms": fs_ms[1],
                                      "rows": rows}, indent=1,
                                     default=str))


if __name__ == "__main__":
    main()

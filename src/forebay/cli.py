"""The ``forebay`` command."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ._version import __version__
from ._units import human_bytes, parse_size
from .errors import ChecksumError, ForebayError, InvalidArgumentError
from .world import detect

__all__ = ["main", "parse_size"]

def _progress():
    from .progress import TqdmProgress

    return TqdmProgress()


# -- commands -------------------------------------------------------------------------
def cmd_synth(a: argparse.Namespace) -> int:
    from .synth import KINDS, synthesize

    t0 = time.perf_counter()
    out = synthesize(a.kind, a.out, a.samples, a.seed, overwrite=a.overwrite, progress=_progress(),
                     format=a.format, per_file=a.per_file, classes=a.classes, size=a.size,
                     encode=a.encode)
    how = KINDS[a.kind][1]
    if "|" in how:  # pff | cff: the hint for the format just written
        how = [h.split(" (")[0].strip() for h in how.split("|")][a.format == "cff"]
    print(f"wrote {a.samples} {a.kind} samples to {out} in {time.perf_counter() - t0:.1f} s "
          f"(ingest with: forebay ingest {out} OUT {how})")
    return 0


def cmd_ingest(a: argparse.Namespace) -> int:
    from .dataset.sources import get_source, ingest

    ragged = {}
    for spec in a.ragged or []:
        name, sep, off = spec.partition("=")
        if not sep or not name or not off:
            raise InvalidArgumentError(f"--ragged takes NAME=OFFSETS_DATASET, got {spec!r}")
        ragged[name] = off
    keys = [k for k in a.keys.split(",") if k] if a.keys else None
    source = get_source(a.from_, a.src, keys=keys, layout=a.layout, trust_pickle=a.trust_pickle,
                        ragged=ragged)
    t0 = time.perf_counter()
    m = ingest(source, a.out, shard_bytes=a.shard_size, workers=a.workers,
               overwrite=a.overwrite, progress=_progress())
    dt = time.perf_counter() - t0
    print(f"ingested {m.num_samples} samples ({human_bytes(m.payload_nbytes)}) into {a.out} "
          f"in {dt:.1f} s: {m.num_samples / dt:,.0f} samples/s, "
          f"{m.payload_nbytes / dt / 2**20:,.1f} MiB/s, {len(m.shards)} shard(s)")
    return 0


def dataset_info(path: str) -> dict:
    from .dataset import open_dataset

    ds = open_dataset(path)
    lay = ds.layout
    fields = []
    for f in ds.schema.fields:
        shapes = ds.index[:, lay.shape[f.name]]
        fields.append({**f.to_dict(),
                       "shape_min": shapes.min(axis=0).tolist() if len(ds) else [],
                       "shape_max": shapes.max(axis=0).tolist() if len(ds) else []})
    sn = ds.sample_nbytes
    return {"path": str(ds.path), "samples": len(ds), "shards": len(ds.manifest.shards),
            "payload_bytes": ds.nbytes, "disk_bytes": ds.disk_nbytes,
            "sample_bytes": {"min": int(sn.min()), "mean": float(sn.mean()),
                             "max": int(sn.max())},
            "fields": fields, "metadata": ds.metadata, "fingerprint": ds.fingerprint,
            "created_by": ds.manifest.created_by}


def cmd_dlio_configs(a: argparse.Namespace) -> int:
    """The directory of forebay's DLIO workload configs (for ``--config-dir``)."""
    d = Path(__file__).parent / "dlio_workloads"
    if a.list:
        for f in sorted((d / "workload").glob("*.yaml")):
            print(f.stem)
    else:
        print(d)
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    info = dataset_info(a.path)
    if a.json:
        print(json.dumps(info, indent=1))
        return 0
    sb = info["sample_bytes"]
    print(f"{info['path']}\n  samples      {info['samples']:,}\n  shards       {info['shards']}\n"
          f"  payload      {human_bytes(info['payload_bytes'])}  (on disk "
          f"{human_bytes(info['disk_bytes'])})\n  sample size  min {human_bytes(sb['min'])}, "
          f"mean {human_bytes(sb['mean'])}, max {human_bytes(sb['max'])}\n"
          f"  fingerprint  {info['fingerprint']}   ({info['created_by']})\n  fields")
    for f in info["fields"]:
        if f["kind"] == "bytes":
            desc = f"bytes, {f['shape_min'][0]}..{f['shape_max'][0]} B"
        else:
            dims = [str(lo) if lo == hi else f"{lo}..{hi}"
                    for lo, hi in zip(f["shape_min"], f["shape_max"])]
            desc = f"{np.dtype(f['dtype']).name} ({', '.join(dims)}{',' if len(dims) == 1 else ''})"
        print(f"    {f['name']:<16} {desc}")
    meta = {k: v for k, v in info["metadata"].items()}
    if meta:
        text = json.dumps(meta)
        print(f"  metadata     {text if len(text) < 200 else text[:197] + '...'}")
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    from .dataset import open_dataset
    from .errors import CorruptDatasetError, DatasetNotFoundError

    try:
        ds = open_dataset(a.path)
    except CorruptDatasetError as e:   # damaged manifest, index or sizes: corrupt, exit 1
        print(f"CORRUPT {e}", file=sys.stderr)
        return 1
    except DatasetNotFoundError as e:
        if not (Path(a.path) / "manifest.json").is_file():
            raise                      # no dataset at all: exit 2
        print(f"CORRUPT {e}", file=sys.stderr)   # a part of one is missing: damage
        return 1
    t0 = time.perf_counter()
    report = ds.verify(progress=_progress(), raise_on_error=False)
    dt = time.perf_counter() - t0
    if report.ok:
        print(f"ok: {len(ds):,} samples, {human_bytes(report.bytes_checked)} checked in {dt:.1f} s")
        return 0
    for p in report.problems:
        print(f"CORRUPT {p}", file=sys.stderr)
    return 1


def cmd_calibrate(a: argparse.Namespace) -> int:
    from .store import calibrate, dump_profile, load_profile

    comm = None
    if detect().is_mpi:
        from mpi4py import MPI   # under mpiexec: also measure gets from a peer's memory

        comm = MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() >= 2 else None
    prof = calibrate(ssd_dir=a.ssd_dir, dataset=a.dataset, comm=comm)
    if comm is not None and comm.Get_rank() != 0:
        return 0                 # rank 0 writes and prints the profile
    text = dump_profile(prof)
    if a.out:
        from pathlib import Path

        Path(a.out).write_text(text)
        load_profile(a.out)  # what we write must read back
        print(f"wrote {a.out}")
    print(text, end="")
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    from .plan import AccessPlan, frequency_tail, frequency_tail_monte_carlo

    mean = a.epochs / a.world
    k0 = int(np.ceil((1 + a.delta) * mean))
    analytic = frequency_tail(a.samples, a.world, a.epochs, a.delta)
    print(f"F={a.samples:,} samples, N={a.world} workers, E={a.epochs} epochs, delta={a.delta}")
    print(f"each worker reads a sample {mean:.2f} times on average; samples read at least "
          f"{k0} times by a given worker:")
    print(f"  analytic (binomial):  {analytic:,.1f}")
    if a.monte_carlo:
        plan = AccessPlan(a.samples, a.world, a.batch_size, a.epochs, a.seed)
        mc = frequency_tail_monte_carlo(plan, a.delta, progress=_progress())
        print(f"  Monte Carlo (seed {a.seed}, mean over workers): {mc:,.1f}")
    return 0


def _sizes_list(text: str) -> list[int]:
    from .errors import InvalidArgumentError

    out = []
    for t in text.split(","):
        t = t.strip()
        try:
            out.append(0 if t in ("0", "0B") else parse_size(t))
        except argparse.ArgumentTypeError as e:
            raise InvalidArgumentError(f"in {text!r}: {e}") from None
    return out


def cmd_simulate(a: argparse.Namespace) -> int:
    from pathlib import Path

    from .sim import POLICIES, load_system, simulate, sweep
    from .sim import format_sweep, format_table, plot_policies, plot_sweep

    sysm = load_system(a.system, compute_MBps=a.compute_MBps,
                       preprocess_MBps=a.preprocess_MBps, network_MBps=a.network_MBps,
                       pfs_open_ms=a.pfs_open_ms)
    kw = dict(workers=a.workers, epochs=a.epochs, batch=a.batch, scale=a.scale, seed=a.seed,
              layout=a.layout)
    if a.mode == "plan":
        from .sim import format_plan, plan_capacity

        if a.target_au is None:
            raise InvalidArgumentError("simulate plan needs --target-au, e.g. 0.9")
        policy = (a.policies or "forebay-clairvoyant").split(",")[0]
        res = plan_capacity(sysm, a.dataset, target_au=a.target_au, policy=policy,
                            progress=_progress(), **kw)
        print(format_plan(res))
    elif a.mode == "sweep":
        if not a.ram or not a.ssd:
            raise InvalidArgumentError("simulate sweep needs --ram and --ssd lists, e.g. "
                             "--ram 0,60GB,120GB --ssd 0,450GB,900GB")
        policy = (a.policies or "forebay-clairvoyant").split(",")[0]
        res = sweep(sysm, a.dataset, ram_bytes=_sizes_list(a.ram), ssd_bytes=_sizes_list(a.ssd),
                    policy=policy, **kw)
        print(format_sweep(res))
        if a.plot:
            plot_sweep(res, a.plot)
            print(f"wrote {a.plot}")
    else:
        sysm = _capacities(a, sysm)
        names = a.policies.split(",") if a.policies else list(POLICIES)
        res = simulate(sysm, a.dataset, policies=names, progress=_progress(), **kw)
        print(format_table(res))
        if a.plot:
            plot_policies(res, a.plot)
            print(f"wrote {a.plot}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.json}")
    return 0


def _capacities(a: argparse.Namespace, sysm: Any) -> Any:
    """``--ram``/``--ssd`` (one size each) override the system's tier capacities; a
    system file without ``[tiers]`` (as `forebay calibrate` writes it) and neither flag
    is said, not silently simulated with nothing to cache in."""
    import dataclasses

    from .errors import InvalidArgumentError
    from .sim import PRESETS
    from .store import load_profile

    over: dict[str, int] = {}
    for flag, field in (("ram", "ram_bytes"), ("ssd", "ssd_bytes")):
        v = getattr(a, flag)
        if v:
            sizes = _sizes_list(v)
            if len(sizes) != 1:
                raise InvalidArgumentError(f"--{flag} takes one size here (a list is for "
                                           f"'simulate sweep')")
            over[field] = sizes[0]
    path = Path(a.system)
    if not over and a.system not in PRESETS:
        if "tiers" not in load_profile(path):     # read and checked by load_system already
            print(f"note: {path} has no [tiers]: the caching policies get 0 B of RAM and "
                  f"SSD per worker; add [tiers] ram_bytes = ..., ssd_bytes = ... or pass "
                  f"--ram SIZE --ssd SIZE", file=sys.stderr)
    return dataclasses.replace(sysm, **over) if over else sysm


def _trace_input(path: str) -> None:
    """A trace directory or file that exists and holds trace files (checked before any
    work or output)."""
    from .errors import InvalidArgumentError, PathNotFoundError
    from .trace._read import trace_files

    if not Path(path).exists():
        raise PathNotFoundError(f"no trace directory or file at {path}")
    if not trace_files(path):
        raise InvalidArgumentError(f"{path}: no trace files (*.pfw, *.pfw.gz, *.json, "
                                   f"*.json.gz) in it or in its sub-directories")


def cmd_analyze(a: argparse.Namespace) -> int:
    from .trace import analyze, format_summary, plot_all, read_traces, write_html

    _trace_input(a.trace_dir)
    prog = _progress()
    prog.start(None, "reading the trace", unit="event")
    with prog:
        if a.plots or a.html:   # the plots draw every event: only then are they all held
            ev = read_traces(a.trace_dir, progress=prog)
            res = analyze(a.trace_dir, events=ev)
        else:                   # a stream: memory does not grow with the trace
            ev, res = None, analyze(a.trace_dir, progress=prog)
    summary = format_summary(res)
    print(summary)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.json}")
    if ev is not None:
        pngs = plot_all(ev, res, a.plots or Path(a.html).with_suffix("").as_posix() + "_plots")
        print("wrote " + ", ".join(str(p) for p in pngs))
        if a.html:
            write_html(res, summary, pngs, a.html)
            print(f"wrote {a.html}")
    return 0 if res["events"] else 1


def cmd_trace_export(a: argparse.Namespace) -> int:
    from .trace import export_chrome

    _trace_input(a.trace_dir)
    r = export_chrome(a.trace_dir, a.out)
    for s in r["skipped"]:
        print(f"skipped: {s}", file=sys.stderr)
    print(f"wrote {a.out}: {r['events']:,} events of {r['ranks']} rank(s), for Perfetto "
          f"(ui.perfetto.dev) or chrome://tracing")
    return 0


def _log_without_blocking() -> Any:
    """Log records to stderr from one thread, through a bounded queue: a stderr nobody
    reads (a full pipe) stalls that thread only, never a provider's handlers (they
    drop records while the queue is full).  Returns a function that flushes what it can
    within 2 s and stops the thread; it returns False if the thread is stuck on stderr."""
    import logging
    import logging.handlers
    import queue
    import threading

    class Dropping(logging.handlers.QueueHandler):
        def enqueue(self, record: logging.LogRecord) -> None:
            try:
                self.queue.put_nowait(record)
            except queue.Full:
                pass                    # the log is behind: this record is dropped

    q: "queue.Queue[Optional[logging.LogRecord]]" = queue.Queue(10_000)
    out = logging.StreamHandler(sys.stderr)
    out.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))

    def write() -> None:
        while (record := q.get()) is not None:
            out.handle(record)

    t = threading.Thread(target=write, name="forebay-log", daemon=True)
    t.start()
    handler = Dropping(q)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(handler)

    def stop() -> bool:
        root.removeHandler(handler)
        try:
            q.put(None, timeout=2)
        except queue.Full:
            return False
        t.join(timeout=2)
        return not t.is_alive()

    return stop


def cmd_models_serve(a: argparse.Namespace) -> int:
    import os

    stop_log = _log_without_blocking()
    code = 2
    try:
        code = _serve_models(a)       # the store is closed when this returns
    finally:
        if not stop_log():
            # stderr is a pipe nobody reads: the interpreter's own flush at exit would
            # wait on it forever; everything else is done
            sys.stdout.flush()
            os._exit(code)
    return code


def _serve_models(a: argparse.Namespace) -> int:
    from .models import serve, token_from_file

    token = token_from_file(a.token_file)
    if not token and not a.no_token:
        print("forebay models serve: a token is required, even on 127.0.0.1, which every "
              "user of this node can reach (--token-file or FOREBAY_TOKEN; --no-token to "
              "serve anyone)", file=sys.stderr)
        return 2
    try:
        serve(a.listen, a.store, token, workers=a.workers, max_data=a.max_frame,
              allow_no_token=a.no_token,
              ready=lambda srv: print(f"serving {a.store} on {srv.address}", flush=True))
    except KeyboardInterrupt:
        pass
    return 0


def cmd_models(a: argparse.Namespace) -> int:
    from .models import open_repository
    from .models import token_from_file

    repo = open_repository(a.url, token_from_file(getattr(a, "token_file", None)),
                           create=a.models_command == "import")
    try:
        if a.models_command == "import":
            from .models import import_safetensors

            v = import_safetensors(repo, a.file, a.name)
            m = repo.manifest(a.name, v)
            print(f"{a.name} version {v}: {len(m['tensors'])} tensors, "
                  f"{human_bytes(m['logical_bytes'])} ({human_bytes(m['new_bytes'])} new)")
        elif a.models_command == "export":
            from .models import export_safetensors

            out = export_safetensors(repo, a.name, a.file, a.version,
                                     a.include.split(",") if a.include else None)
            print(f"wrote {out}")
        elif a.models_command == "ls":
            listing = repo.list()
            if not listing:
                print(f"{repo.url}: no models")
            for name, vs in sorted(listing.items()):
                m = repo.manifest(name, vs[-1])
                print(f"{name:<32} versions {vs[0]}..{vs[-1]} ({len(vs)})  latest: "
                      f"{len(m['tensors'])} tensors, {human_bytes(m['logical_bytes'])}, "
                      f"{m['created'][:19]}")
            st = repo.stats()
            print(f"store: {st['tensors']} tensors, {human_bytes(st['stored_bytes'])} stored for "
                  f"{human_bytes(st['logical_bytes'])} of versions")
            fb = st.get("file_bytes")
            if fb is not None and fb > 2 * st["stored_bytes"] + (64 << 20):
                print(f"data file: {human_bytes(fb)}, mostly pages freed by deleted versions; "
                      f"`forebay models compact` writes a copy without them")
        elif a.models_command == "show":
            m = repo.manifest(a.name, a.version)
            if a.json:
                print(json.dumps(m, indent=1))
                return 0
            g = m["graph"]
            parent = f"parent {m['parent']}" if m['parent'] is not None else "no parent"
            print(f"{m['name']} version {m['version']} ({parent}), created "
                  f"{m['created'][:19]}, metadata {json.dumps(m['metadata'])}")
            print(f"  {len(m['tensors'])} tensors, {human_bytes(m['logical_bytes'])}; "
                  f"{human_bytes(m['new_bytes'])} new in this version")
            if g is not None:
                print(f"  {len(g['nodes'])} leaf layers, edges from {g['source']}:")
                for k, node in enumerate(g["nodes"]):
                    ins = ",".join(map(str, node["inputs"])) or "-"
                    print(f"  {k:>4} {node['name'] or '(root)':<40} <- {ins:<12} "
                          f"id {node['id'][:16]}")
        elif a.models_command == "verify":
            problems = repo.verify()
            for p in problems:
                print(f"CORRUPT {p}", file=sys.stderr)
            if problems:
                return 1
            st = repo.stats()
            print(f"ok: {st['versions']} versions of {st['models']} models, "
                  f"{st['tensors']} tensors ({human_bytes(st['stored_bytes'])}) checked")
        elif a.models_command == "gc":
            r = repo.gc(grace_seconds=a.grace_hours * 3600)
            print(f"removed {r['tensors_removed']} tensors ({human_bytes(r['bytes_freed'])}), "
                  f"{r['stale_saves']} records of crashed saves")
        elif a.models_command == "compact":
            r = repo.compact(a.dest, progress=_progress())
            print(f"{a.dest}: {human_bytes(r['bytes_after'])} (was "
                  f"{human_bytes(r['bytes_before'])}); {r['tensors_located']} tensors "
                  f"located, {r['manifests_rewritten']} manifests rewritten")
        elif a.models_command == "relocate":
            r = repo.relocate(progress=_progress())
            print(f"{r['tensors_located']} tensors located, {r['manifests_rewritten']} "
                  f"manifests rewritten")
    finally:
        repo.close()
    return 0


# -- parser ---------------------------------------------------------------------------
def _number(kind: type, low: float, inclusive: bool, what: str) -> Any:
    """An argparse type: a ``kind`` number above ``low`` (or at it, ``inclusive``)."""
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if v < low or (v == low and not inclusive) or v != v:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return v
    parse.__name__ = what
    return parse


positive_int = _number(int, 0, False, "a positive integer")
count_int = _number(int, 0, True, "an integer >= 0")
positive_float = _number(float, 0.0, False, "a positive number")
nonneg_float = _number(float, 0.0, True, "a number >= 0")


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    from .dataset.sources import SOURCES
    from .synth import KINDS

    p = argparse.ArgumentParser(prog="forebay", description="Keep accelerators fed on HPC systems: "
                                "packed datasets, distributed in-memory stores, clairvoyant "
                                "caching.")
    p.add_argument("--version", action="version", version=f"forebay {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("synth", help="write synthetic source files shaped like the datasets of "
                       "DDStore, NoPFS and MuMMI (Ising graphs, molecules, ImageNet, CosmoFlow)",
                       description="Write synthetic source files: " + "; ".join(
                           f"{k}: {v[2]}" for k, v in KINDS.items()))
    s.add_argument("kind", choices=sorted(KINDS))
    s.add_argument("out")
    s.add_argument("--samples", "-n", type=positive_int, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--format", choices=["pff", "cff"], help="ising/molecules: one pickle per "
                   "sample (pff, default) or one HDF5 file (cff)")
    s.add_argument("--per-file", type=positive_int,
                   help="mummi: samples per NPZ file (default 256)")
    s.add_argument("--classes", type=positive_int,
                   help="imagenet: number of classes (default 10)")
    s.add_argument("--encode", choices=["blob", "jpeg"],
                   help="imagenet: random bytes of JPEG sizes (blob, default, fast) or real "
                        "JPEG images to decode (jpeg, via Pillow)")
    s.add_argument("--size", type=positive_int, help="cosmoflow: volume side S (default 32)")
    s.add_argument("--overwrite", action="store_true")
    s.set_defaults(func=cmd_synth)

    g = sub.add_parser("ingest", help="pack source files into a forebay dataset")
    g.add_argument("src")
    g.add_argument("out")
    g.add_argument("--from", dest="from_", required=True, choices=sorted(SOURCES),
                   help="kind of source")
    g.add_argument("--keys", help="comma-separated arrays/datasets to keep (npz, hdf5, pickle), "
                   "or the field name (npy)")
    g.add_argument("--layout", choices=["stacked", "per-file"],
                   help="npz, hdf5: samples stacked along axis 0 (default) or one per file; "
                   "npy: one per file (default) or stacked")
    g.add_argument("--ragged", action="append", metavar="NAME=OFFSETS",
                   help="hdf5: NAME is flat data split by the OFFSETS dataset (NAME_offsets "
                   "is found automatically)")
    g.add_argument("--shard-size", type=parse_size, default="256MiB",
                   help="bytes per shard (default 256MiB)")
    g.add_argument("--workers", type=positive_int, default=1,
                   help="reader processes (default 1; more help only when decoding a unit "
                        "costs more than writing it, on spare cores)")
    g.add_argument("--trust-pickle", action="store_true",
                   help="allow unpickling the source (runs code stored in it)")
    g.add_argument("--overwrite", action="store_true")
    g.set_defaults(func=cmd_ingest)

    dc = sub.add_parser("dlio-configs", help="print the directory of forebay's DLIO workload "
                        "configs: dlio_benchmark --config-dir=$(forebay dlio-configs) "
                        "workload=forebay_unet3d")
    dc.add_argument("--list", action="store_true", help="list the workloads instead")
    dc.set_defaults(func=cmd_dlio_configs)

    i = sub.add_parser("info", help="describe a packed dataset")
    i.add_argument("path")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    pl = sub.add_parser("plan", help="access-frequency analysis of a shuffled run (NoPFS 3.1)")
    pl.add_argument("--samples", "-F", type=positive_int, required=True)
    pl.add_argument("--world", "-N", type=positive_int, required=True)
    pl.add_argument("--epochs", "-E", type=positive_int, required=True)
    pl.add_argument("--delta", type=positive_float, default=0.8,
                    help="NoPFS's delta > 0: count the samples a worker reads at least "
                         "(1 + delta) x the mean number of times (default 0.8)")
    pl.add_argument("--monte-carlo", action="store_true",
                    help="also count on a real AccessPlan (vectorized; ~30 s for ImageNet-1k)")
    pl.add_argument("--batch-size", type=positive_int, default=32,
                    help="per-rank batch (Monte Carlo)")
    pl.add_argument("--seed", type=int, default=0)
    pl.set_defaults(func=cmd_plan)

    c = sub.add_parser("calibrate", help="measure tier and file-system bandwidths (and, under "
                       "mpiexec -n 2, one-sided gets from a peer), write a TOML profile")
    c.add_argument("--out", help="profile file to write (TOML)")
    c.add_argument("--ssd-dir", help="node-local directory to measure as the SSD tier")
    c.add_argument("--dataset", help="packed dataset on the parallel file system to measure")
    c.set_defaults(func=cmd_calibrate)

    an = sub.add_parser("analyze", help="summarize I/O traces (forebay's and DFTracer's)",
                        description="Summarize every .pfw/.pfw.gz/.json trace in a directory: "
                        "time split (compute, app-level I/O, I/O, overlapped or not), data "
                        "stalls, fetch latency per source, where samples came from, bytes "
                        "read from the dataset files, per-event statistics, imbalance.")
    an.add_argument("trace_dir")
    an.add_argument("--json", metavar="OUT", help="write the full analysis as JSON")
    an.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    an.add_argument("--html", metavar="OUT", help="write a self-contained HTML report")
    an.set_defaults(func=cmd_analyze)

    tr = sub.add_parser("trace", help="trace files: export for Perfetto")
    trs = tr.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    te = trs.add_parser("export", help="write one Chrome-format JSON for Perfetto / "
                        "chrome://tracing")
    te.add_argument("trace_dir")
    te.add_argument("out", help="output file (.json or .json.gz)")
    te.set_defaults(func=cmd_trace_export)

    mo = sub.add_parser("models", help="model repository: list, show, verify, gc, compact, "
                        "import/export safetensors, serve")
    mos = mo.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    ml = mos.add_parser("ls", help="models and versions")
    ml.add_argument("url", help="repository: file:///path, a path")
    ms = mos.add_parser("show", help="a version's metadata and architecture graph")
    ms.add_argument("url")
    ms.add_argument("name")
    ms.add_argument("--version", type=positive_int, help="default: the latest")
    ms.add_argument("--json", action="store_true", help="the whole manifest")
    mv = mos.add_parser("verify", help="check every stored tensor; exit 1 on corruption")
    mv.add_argument("url")
    mg = mos.add_parser("gc", help="delete tensors no version references")
    mg.add_argument("url")
    mg.add_argument("--grace-hours", type=nonneg_float, default=6.0,
                    help="spare saves in progress younger than this (default 6)")
    mc = mos.add_parser("compact", help="write a copy without free pages (after gc), with "
                        "fresh tensor locations")
    mc.add_argument("url", help="an LMDB repository (file:///path or a path)")
    mc.add_argument("dest", help="a new or empty directory for the copy")
    mr = mos.add_parser("relocate", help="find every tensor's file location again (after "
                        "the store's file was rewritten by a copy)")
    mr.add_argument("url")
    mi = mos.add_parser("import", help="store a .safetensors file as the next version of NAME")
    mi.add_argument("url", help="repository (created if missing)")
    mi.add_argument("file")
    mi.add_argument("name")
    mx = mos.add_parser("export", help="write a version to a .safetensors file")
    mx.add_argument("url")
    mx.add_argument("name")
    mx.add_argument("file")
    mx.add_argument("--version", type=positive_int, help="default: the latest")
    mx.add_argument("--include", help="comma-separated tensor names or patterns")
    for q in (ml, ms, mv, mg, mc, mr, mi, mx):
        q.set_defaults(func=cmd_models)
        q.add_argument("--token-file", help="shared token for tcp:// providers "
                       "(default: FOREBAY_TOKEN)")
    sv = mos.add_parser("serve", help="serve a repository to clients over TCP (tcp://)")
    sv.add_argument("--listen", default="127.0.0.1:7531", help="HOST:PORT (default "
                    "127.0.0.1:7531)")
    sv.add_argument("--store", required=True, help="the repository served: file:///path "
                    "or memory://")
    sv.add_argument("--token-file", help="file whose first line is the shared token "
                    "(default: FOREBAY_TOKEN; one is required)")
    sv.add_argument("--no-token", action="store_true",
                    help="serve without a token: anyone who can reach the port may read, "
                         "write and delete models")
    sv.add_argument("--workers", type=positive_int, default=16, help="clients served at once")
    sv.add_argument("--max-frame", type=parse_size, default="16GiB",
                    help="largest request accepted (default 16GiB)")
    sv.set_defaults(func=cmd_models_serve)

    sm = sub.add_parser("simulate", help="simulate I/O policies for a workload (NoPFS's model)",
                        description="Simulate training I/O policies with NoPFS's performance "
                        "model, using forebay's own placement code. 'simulate sweep' varies "
                        "RAM and SSD capacity (NoPFS Fig. 9).")
    sm.add_argument("mode", nargs="?", choices=["run", "sweep", "plan"], default="run",
                    help="run: the policies side by side; sweep: a RAM x SSD grid; plan: "
                    "the smallest RAM or SSD per worker reaching --target-au")
    sm.add_argument("--target-au", dest="target_au", type=fraction, default=None,
                    help="plan: the accelerator utilisation to reach, e.g. 0.9")
    sm.add_argument("--system", default="lassen",
                    help="preset (lassen, hdmlp-thesis) or a TOML profile from forebay "
                    "calibrate")
    sm.add_argument("--dataset", required=True,
                    help="scenario (mnist, imagenet-1k, openimages, imagenet-22k, cosmoflow, "
                         "cosmoflow-512), normal:MEAN_MB,SD_MB,COUNT (sizes drawn from a "
                         "normal distribution) or a packed dataset directory")
    sm.add_argument("--workers", type=positive_int, required=True)
    sm.add_argument("--epochs", type=positive_int, required=True)
    sm.add_argument("--batch", type=positive_int, default=None,
                    help="per-worker batch (default: the scenario's, or 32)")
    sm.add_argument("--policies", default=None, help="comma-separated (default: all)")
    sm.add_argument("--scale", type=fraction, default=1.0, help="simulate this fraction of the "
                    "samples, RAM and SSD scaled alike (default 1)")
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--compute-MBps", dest="compute_MBps", type=positive_float, default=None,
                    help="training throughput c per worker (overrides the system)")
    sm.add_argument("--preprocess-MBps", dest="preprocess_MBps", type=positive_float,
                    default=None)
    sm.add_argument("--network-MBps", dest="network_MBps", type=positive_float, default=None)
    sm.add_argument("--pfs-open-ms", dest="pfs_open_ms", type=nonneg_float, default=None,
                    help="latency of opening one file on the PFS (overrides [pfs] open_ms; "
                    "paid per sample read with --layout files)")
    sm.add_argument("--layout", choices=["files", "packed"], default=None,
                    help="samples as a file each on the PFS, or one packed dataset (default: "
                    "files for a scenario, packed for a dataset directory)")
    sm.add_argument("--ram", help="RAM per worker for caching, overriding the system's "
                    "(sweep: a list, e.g. 0,60GB,120GB)")
    sm.add_argument("--ssd", help="SSD per worker for caching, overriding the system's "
                    "(sweep: a list, e.g. 0,450GB,900GB)")
    sm.add_argument("--json", help="write the results as JSON")
    sm.add_argument("--plot", help="write a PNG (stacked bars; heat map for sweep)")
    sm.set_defaults(func=cmd_simulate)

    v = sub.add_parser("verify", help="check every checksum; exit 1 on any mismatch")
    v.add_argument("path")
    v.set_defaults(func=cmd_verify)
    return p


#: optional dependencies -> the pip extra that brings them (pyproject.toml)
_EXTRAS = {"lmdb": "models", "msgpack": "models", "safetensors": "models",
           "matplotlib": "plots", "torch": "torch", "mpi4py": "mpi"}


def _check_outputs(args: argparse.Namespace) -> None:
    """Output files (``--json``, ``--plot``, ``--html``) go into directories that exist
    and can be written: checked before any work, not after it."""
    import os

    from .errors import InvalidArgumentError

    for attr in ("json", "plot", "html"):
        v = getattr(args, attr, None)
        if not v or not isinstance(v, (str, os.PathLike)):
            continue
        parent = Path(v).resolve().parent
        if not parent.is_dir():
            raise InvalidArgumentError(f"--{attr} {v}: no directory {parent} to write it in")
        if not os.access(parent, os.W_OK):
            raise InvalidArgumentError(f"--{attr} {v}: {parent} is not writable")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_outputs(args)
        return args.func(args)
    except ChecksumError as e:
        print(f"forebay: CORRUPT: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # the reader went away (`forebay info x | head`): not an error; keep Python's
        # own flush at exit from complaining about the closed pipe
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (ForebayError, OSError) as e:
        # what the user can fix (a bad argument, a missing file, a refused path): one
        # line; anything else is a bug in forebay and shows its traceback
        print(f"forebay {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in _EXTRAS:
            raise
        print(f"forebay {args.command}: error: this needs the {top!r} package, not "
              f"installed here: pip install 'forebay[{_EXTRAS[top]}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("forebay: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""``forebay synth``, ``ingest``, ``info``, ``verify``, ``decompress``, ``serve``,
``mirror`` and ``dlio-configs``: packed datasets made, described, checked and moved."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .._units import human_bytes, parse_size
from ..errors import InvalidArgumentError
from ._args import count_int, positive_int, progress

__all__ = ["register"]


def cmd_synth(a: argparse.Namespace) -> int:
    from ..synth import KINDS, synthesize

    t0 = time.perf_counter()
    out = synthesize(a.kind, a.out, a.samples, a.seed, overwrite=a.overwrite, progress=progress(),
                     format=a.format, per_file=a.per_file, classes=a.classes, size=a.size,
                     encode=a.encode)
    how = KINDS[a.kind][1]
    if "|" in how:  # pff | cff: the hint for the format just written
        how = [h.split(" (")[0].strip() for h in how.split("|")][a.format == "cff"]
    print(f"wrote {a.samples} {a.kind} samples to {out} in {time.perf_counter() - t0:.1f} s "
          f"(ingest with: forebay ingest {shlex.quote(str(out))} OUT {how})")
    return 0

def cmd_ingest(a: argparse.Namespace) -> int:
    from ..dataset.sources import get_source, ingest

    ragged = {}
    for spec in a.ragged or []:
        name, sep, off = spec.partition("=")
        if not sep or not name or not off:
            raise InvalidArgumentError(f"--ragged takes NAME=OFFSETS_DATASET, got {spec!r}")
        ragged[name] = off
    keys = [k for k in a.keys.split(",") if k] if a.keys else None
    # a source at an object-store URL is copied beside the output first (where there is
    # room for the dataset), with its own progress
    source = get_source(a.from_, a.src, keys=keys, layout=a.layout, trust_pickle=a.trust_pickle,
                        ragged=ragged, follow_links=a.follow_links, nulls=a.nulls,
                        stage_dir=a.stage_dir or Path(a.out).resolve().parent,
                        progress=progress())
    t0 = time.perf_counter()
    compress: Any = a.compress
    if compress and "=" in compress:     # FIELD=zstd[:LEVEL],...
        compress = dict(part.split("=", 1) for part in compress.split(",") if part)
    m = ingest(source, a.out, shard_bytes=a.shard_size, workers=a.workers,
               overwrite=a.overwrite, progress=progress(), compress=compress)
    dt = time.perf_counter() - t0
    print(f"ingested {m.num_samples} samples ({human_bytes(m.payload_nbytes)}) into {a.out} "
          f"in {dt:.1f} s: {m.num_samples / dt:,.0f} samples/s, "
          f"{m.payload_nbytes / dt / 2**20:,.1f} MiB/s, {len(m.shards)} shard(s)")
    return 0

def dataset_info(path: str) -> dict:
    from ..dataset import open_dataset

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
    d = Path(__file__).parents[1] / "dlio_workloads"
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
        if f.get("codec"):
            desc += f", {f['codec']}-compressed per sample"
        print(f"    {f['name']:<16} {desc}")
    meta = {k: v for k, v in info["metadata"].items()}
    if meta:
        text = json.dumps(meta)
        print(f"  metadata     {text if len(text) < 200 else text[:197] + '...'}")
    return 0

def cmd_verify(a: argparse.Namespace) -> int:
    from ..dataset import open_dataset
    from ..errors import CorruptDatasetError, DatasetNotFoundError

    if Path(a.path).is_dir() and not (Path(a.path) / "manifest.json").exists():
        # a directory that is not a dataset at all: nothing to verify (as info, exit 2)
        raise DatasetNotFoundError(f"{a.path} is not a forebay dataset: it has no "
                                   f"manifest.json")
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
    report = ds.verify(progress=progress(), raise_on_error=False)
    dt = time.perf_counter() - t0
    if report.ok:
        print(f"ok: {len(ds):,} samples, {human_bytes(report.bytes_checked)} checked in {dt:.1f} s")
        return 0
    for p in report.problems:
        print(f"CORRUPT {p}", file=sys.stderr)
    return 1


def cmd_decompress(a: argparse.Namespace) -> int:
    from ..dataset import decompressed, open_dataset

    src = open_dataset(a.path)
    if not src.layout.coded:
        print(f"{src.path}: no compressed fields; read it as it is", file=sys.stderr)
        print(src.path)
        return 0
    t0 = time.perf_counter()
    copy = decompressed(src, a.into, progress=progress())
    print(f"{len(copy):,} samples, {human_bytes(copy.nbytes)} decompressed "
          f"({human_bytes(src.nbytes)} stored), ready in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    print(copy.path)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    import threading

    from ..dataset import serve_dataset
    from ..models import token_from_file
    from ._args import token_refused

    token = token_from_file(a.token_file)
    if token_refused(token, a.no_token, "forebay serve"):
        return 2
    srv = serve_dataset(a.path, a.listen, token=token, workers=a.workers,
                        allow_no_token=a.no_token)
    print(f"serving {a.path} on {srv.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
    return 0


def cmd_mirror(a: argparse.Namespace) -> int:
    from ..dataset import mirror
    from ..models import token_from_file

    t0 = time.perf_counter()
    ds = mirror(a.url, a.into, samples=a.samples, timeout=a.timeout,
                token=token_from_file(a.token_file), fallback=a.fallback)
    print(f"{len(ds):,} samples in {ds.path} ({time.perf_counter() - t0:.1f} s)")
    return 0


def _cache_root(a: argparse.Namespace) -> Path:
    import os

    from ..store import NODE_CACHE_ENV

    root = a.root or os.environ.get(NODE_CACHE_ENV)
    if not root:
        raise InvalidArgumentError(f"name the cache's directory, or set {NODE_CACHE_ENV}")
    return Path(root)


def cmd_cache_ls(a: argparse.Namespace) -> int:
    from ..store import cache_entries

    root = _cache_root(a)
    entries = cache_entries(root)
    if a.json:
        print(json.dumps(entries, indent=1))
        return 0
    if not entries:
        print(f"{root}: empty")
        return 0
    print(f"{'dataset key':<18} {'cached':>17} {'on disk':>10}  {'last used':<16}  source")
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["last_used"]))
        print(f"{e['fingerprint']:<18} {e['cached_samples']:>8,}/{e['samples']:<8,} "
              f"{human_bytes(e['bytes']):>10}  {when:<16}  {e['source']}"
              f"{'  (in use)' if e['in_use'] else ''}")
    print(f"{len(entries)} dataset(s), {human_bytes(sum(e['bytes'] for e in entries))}"
          f" in {root}")
    return 0


def cmd_cache_clear(a: argparse.Namespace) -> int:
    from ..store import clear_cache

    root = _cache_root(a)
    removed, kept = clear_cache(root, a.dataset)
    print(f"removed {len(removed)} dataset(s) from {root}"
          + (f"; kept {len(kept)} a running job uses: {', '.join(kept)}"
             if kept else ""))
    return 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``forebay`` parser."""
    from ..dataset.sources import SOURCES
    from ..synth import KINDS

    s = sub.add_parser("synth", help="write synthetic source files shaped like the datasets of "
                       "DDStore, NoPFS and MuMMI (Ising graphs, molecules, ImageNet, CosmoFlow)",
                       description="Write synthetic source files: " + "; ".join(
                           f"{k}: {v[2]}" for k, v in KINDS.items()))
    s.add_argument("kind", choices=sorted(KINDS))
    s.add_argument("out")
    s.add_argument("--samples", "-n", type=positive_int, required=True)
    s.add_argument("--seed", type=count_int, default=0)
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
                   help="kind of source (SRC: a path, or s3://bucket/prefix)")
    g.add_argument("--compress", metavar="zstd[:LEVEL] | FIELD=zstd[:LEVEL],...",
                   help="store fields compressed, each sample's value a zstd frame of its "
                        "own (read at random without its neighbours): every field, or "
                        "the ones named")
    g.add_argument("--stage-dir", help="s3:// sources: where their objects are copied "
                   "before reading (default: beside OUT; removed at the end)")
    g.add_argument("--keys", help="comma-separated arrays/datasets/columns to keep (npz, hdf5, "
                   "pickle, parquet), or the field name (npy)")
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
    g.add_argument("--nulls", choices=["refuse", "zero"],
                   help="parquet: a null is refused (default) or stored as 0, False or empty")
    g.add_argument("--follow-links", action="store_true",
                   help="read what symlinks, HDF5 external links, external storage and "
                        "virtual datasets point to outside SRC (refused by default)")
    g.add_argument("--overwrite", action="store_true")
    g.set_defaults(func=cmd_ingest)

    c = sub.add_parser("cache", help="the node-local cache that keeps records across jobs "
                       "(DataLoader(store=Direct(node_cache=...)), FOREBAY_NODE_CACHE)")
    cs = c.add_subparsers(dest="cache_command", required=True, metavar="ls|clear")
    cl = cs.add_parser("ls", help="what the cache holds, most recently used first")
    cl.add_argument("root", nargs="?", help="the cache's directory (default "
                    "FOREBAY_NODE_CACHE)")
    cl.add_argument("--json", action="store_true")
    cl.set_defaults(func=cmd_cache_ls)
    cc = cs.add_parser("clear", help="remove what no running job uses")
    cc.add_argument("root", nargs="?", help="the cache's directory (default "
                    "FOREBAY_NODE_CACHE)")
    cc.add_argument("--dataset", metavar="KEY", help="only this dataset (its key, as "
                    "'forebay cache ls' shows it)")
    cc.set_defaults(func=cmd_cache_clear)

    i = sub.add_parser("info", help="describe a packed dataset")
    i.add_argument("path")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    v = sub.add_parser("verify", help="check every checksum; exit 1 on any mismatch")
    v.add_argument("path")
    v.set_defaults(func=cmd_verify)
    d = sub.add_parser("decompress", help="a decompressed copy of a dataset with compressed "
                       "fields in node-local storage, made once per node and reused (the "
                       "stores' tiers then hold decompressed records); prints its path")
    d.add_argument("path")
    d.add_argument("--into", required=True, metavar="DIR",
                   help="node-local directory (an SSD, the node's scratch)")
    d.set_defaults(func=cmd_decompress)
    sv = sub.add_parser("serve", help="serve a (node-local) dataset to other nodes' "
                        "'forebay mirror' until stopped (HTTP, GET only, token required)")
    sv.add_argument("path")
    sv.add_argument("--listen", default="127.0.0.1:7532",
                    help="HOST:PORT (default 127.0.0.1:7532; this node's address for others)")
    sv.add_argument("--token-file", help="file whose first line is the shared token "
                    "(default: FOREBAY_TOKEN; one is required)")
    sv.add_argument("--no-token", action="store_true",
                    help="serve without a token: anyone who can reach the port may read")
    sv.add_argument("--workers", type=int, default=16, help="requests served at once")
    sv.set_defaults(func=cmd_serve)
    mi = sub.add_parser("mirror", help="copy the generations a 'forebay serve' holds that "
                        "the local mirror lacks (checked, each whole), waiting for --samples")
    mi.add_argument("url", help="http://HOST:PORT of the producer's 'forebay serve'")
    mi.add_argument("into", help="the mirror's directory (this node's storage)")
    mi.add_argument("--samples", type=int, help="wait until the producer holds this many")
    mi.add_argument("--timeout", type=float, help="seconds to wait (default: up to 600)")
    mi.add_argument("--token-file", help="shared token (default: FOREBAY_TOKEN)")
    mi.add_argument("--fallback", help="the dataset's copy on the shared file system, read "
                    "when the producer does not answer")
    mi.set_defaults(func=cmd_mirror)
    dc = sub.add_parser("dlio-configs", help="print the directory of forebay's DLIO workload "
                        "configs: dlio_benchmark --config-dir=$(forebay dlio-configs) "
                        "workload=forebay_unet3d")
    dc.add_argument("--list", action="store_true", help="list the workloads instead")
    dc.set_defaults(func=cmd_dlio_configs)

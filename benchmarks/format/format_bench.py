"""Random-access read benchmark: PFF pickles vs one HDF5 file vs MuMMI NPZ vs forebay packed.

Every contender reads the same random sample ids and materializes each sample as
in-memory numpy arrays.  "cold": the contender's files are evicted from the page
cache (posix_fadvise DONTNEED) right before its run; "warm": the same ids again.
Also measures ingest speed against this machine's sequential write bandwidth.

    python benchmarks/format/format_bench.py --out .demo/bench [--samples 20000] [--reads 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _baselines import hdf5_dataset, pff_dataset  # noqa: E402
from _common import drop_all_caches, evict, files_under, machine, seq_write_bandwidth, summarize, time_reads  # noqa

import forebay  # noqa: E402
from forebay.dataset.sources import get_source, ingest  # noqa: E402
from forebay.synth import synthesize  # noqa: E402


# -- contenders: open(...) -> read(i) returning the sample's arrays in memory ----------
def pff_reader(root: Path):
    """One pickle per sample (the same reader the loader benchmark's baseline uses)."""
    return pff_dataset(root)[0].__getitem__


def hdf5_reader(path: Path):
    """Keeps the file open and the (small) offset arrays in memory, then reads each
    field's slice per sample, as a CFF data loader would."""
    ds, _ = hdf5_dataset(path)

    def read(i):
        return ds[i]
    read.close = ds.close
    return read


def packed_reader(path: Path, readahead: str = "record"):
    ds = forebay.open_dataset(path, readahead=readahead)

    def read(i):
        return {k: np.array(v) for k, v in ds[i].items()}  # copy: touch every byte
    return read


def pread_floor(path: Path):
    """Not a contender: one os.pread of exactly each record's bytes, no decoding: what
    one random read of a sample costs the device without any read-ahead.  Not a floor
    for every reader: "packed, OS readahead" reads neighbouring pages along and beats
    it cold when the next sample asked for is one of them."""
    import os

    ds = forebay.open_dataset(path)
    fds = [os.open(path / s.data, os.O_RDONLY) for s in ds.manifest.shards]
    rows = ds._index

    def read(i):
        return os.pread(fds[ds._shard_of[i]], int(rows[i, 1]), int(rows[i, 0]))

    def close():
        for fd in fds:
            os.close(fd)
    read.close = close
    return read


def npz_reader(root: Path, per_file: int):
    files = sorted(root.glob("*.npz"))

    def read(i):
        with np.load(files[i // per_file]) as z:
            return {"x": z["x"][i % per_file]}
    return read


STATES = ["cold", "warm"]


def _make_cold(state, files):
    evict(files)
    if state == "cold-all" and not drop_all_caches():
        raise SystemExit("--cold-all needs root (writes /proc/sys/vm/drop_caches)")


def run_contender(name, make, files, ids, results):
    for state in STATES:
        if state.startswith("cold"):
            _make_cold(state, files)
        read = make()
        lat = time_reads(read, ids)
        getattr(read, "close", lambda: None)()
        del read  # drop maps and handles: mapped pages cannot be evicted
        results.append({"format": name, "state": state, **summarize(lat)})
        print(f"  {name:<26} {state:<8} p50 {results[-1]['p50_ms']:8.3f} ms  "
              f"p99 {results[-1]['p99_ms']:8.3f} ms  {results[-1]['samples_per_s']:10,.0f} samples/s",
              flush=True)


def packed_batched(path, ids, batch, files, results, name):
    for state in STATES:
        if state.startswith("cold"):
            _make_cold(state, files)
        ds = forebay.open_dataset(path)
        lat = []
        for a in range(0, len(ids), batch):
            t0 = time.perf_counter()
            ds.get_many(ids[a:a + batch])
            lat.append(time.perf_counter() - t0)
        lat = np.array(lat)
        del ds
        r = {"format": name, "state": state, **summarize(lat, samples=len(ids)),
             "note": f"per batch of {batch}"}
        results.append(r)
        print(f"  {name:<26} {state:<8} p50 {r['p50_ms']:8.3f} ms/batch  "
              f"{r['samples_per_s']:10,.0f} samples/s", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(".demo/bench"))
    p.add_argument("--samples", type=int, default=20000, help="Ising samples")
    p.add_argument("--reads", type=int, default=2000, help="random reads per run")
    p.add_argument("--mummi-samples", type=int, default=2048)
    p.add_argument("--mummi-reads", type=int, default=200)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-mummi", action="store_true")
    p.add_argument("--json", type=Path, help="also write results here")
    p.add_argument("--cold-all", action="store_true",
                   help="add a 'cold-all' run per contender that also drops dentry and inode "
                   "caches (root only, machine-wide), as a PFS open costs a metadata round trip")
    a = p.parse_args(argv)
    if a.cold_all:
        STATES.insert(1, "cold-all")
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}\ndata: {out.resolve()}")

    ising_pff, ising_cff, ising_fb = out / "ising-pff", out / "ising-cff", out / "ising.fb"
    results, ingest_rows = [], []
    if not ising_pff.exists():
        synthesize("ising", ising_pff, a.samples, a.seed, progress=True)
    if not ising_cff.exists():
        synthesize("ising", ising_cff, a.samples, a.seed, format="cff", progress=True)
    bw = seq_write_bandwidth(out)
    for name, src in (("PFF pickles", get_source("pickle", ising_pff, trust_pickle=True)),
                      ("HDF5", get_source("hdf5", ising_cff))):
        evict(files_under(ising_pff if name.startswith("PFF") else ising_cff))
        t0 = time.perf_counter()
        m = ingest(src, ising_fb, overwrite=True)
        dt = time.perf_counter() - t0
        ingest_rows.append({"source": f"Ising {name}", "samples": m.num_samples,
                            "MiB_per_s": m.payload_nbytes / dt / 2**20,
                            "ratio_to_seq_write": (m.payload_nbytes / dt) / bw})
    n = len(forebay.open_dataset(ising_fb))
    ids = np.random.default_rng(a.seed + 1).choice(n, size=min(a.reads, n), replace=False)
    print(f"Ising: {n} samples, {a.reads} random reads (cold = evicted before the run)")
    run_contender("Ising PFF (pickle)", lambda: pff_reader(ising_pff), files_under(ising_pff),
                  ids, results)
    run_contender("Ising HDF5 (h5py)", lambda: hdf5_reader(ising_cff / "ising.h5"),
                  files_under(ising_cff), ids, results)
    run_contender("Ising forebay packed", lambda: packed_reader(ising_fb), files_under(ising_fb),
                  ids, results)
    run_contender("Ising packed, OS readahead", lambda: packed_reader(ising_fb, "os"),
                  files_under(ising_fb), ids, results)
    run_contender("(reference: raw pread)", lambda: pread_floor(ising_fb),
                  files_under(ising_fb), ids, results)
    packed_batched(ising_fb, ids, a.batch, files_under(ising_fb), results,
                   "Ising forebay get_many")

    if not a.skip_mummi:
        mummi_npz, mummi_fb = out / "mummi-npz", out / "mummi.fb"
        per_file = 256
        if not mummi_npz.exists():
            synthesize("mummi", mummi_npz, a.mummi_samples, a.seed, per_file=per_file,
                       progress=True)
        evict(files_under(mummi_npz))
        t0 = time.perf_counter()
        m = ingest(get_source("npz", mummi_npz), mummi_fb, overwrite=True)
        dt = time.perf_counter() - t0
        ingest_rows.append({"source": "MuMMI NPZ", "samples": m.num_samples,
                            "MiB_per_s": m.payload_nbytes / dt / 2**20,
                            "ratio_to_seq_write": (m.payload_nbytes / dt) / bw})
        mids = np.random.default_rng(a.seed + 2).choice(a.mummi_samples,
                                                        size=min(a.mummi_reads, a.mummi_samples),
                                                        replace=False)
        print(f"MuMMI: {a.mummi_samples} samples of 8,691 float64, {len(mids)} random reads")
        run_contender("MuMMI NPZ (np.load)", lambda: npz_reader(mummi_npz, per_file),
                      files_under(mummi_npz), mids, results)
        run_contender("MuMMI forebay packed", lambda: packed_reader(mummi_fb),
                      files_under(mummi_fb), mids, results)

    print(f"\nsequential write bandwidth: {bw / 2**20:,.0f} MiB/s")
    print("\n| format | state | p50 ms | p95 ms | p99 ms | samples/s |\n|---|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['format']}{' (' + r['note'] + ')' if 'note' in r else ''} | {r['state']} | "
              f"{r['p50_ms']:.3f} | {r['p95_ms']:.3f} | {r['p99_ms']:.3f} | "
              f"{r['samples_per_s']:,.0f} |")
    for state in STATES:
        by = {r["format"]: r for r in results if r["state"] == state}
        fb = by["Ising forebay packed"]["p50_ms"]
        print(f"{state} p50 speed-up of packed: {by['Ising PFF (pickle)']['p50_ms'] / fb:.1f}x vs "
              f"PFF, {by['Ising HDF5 (h5py)']['p50_ms'] / fb:.1f}x vs HDF5; batched get_many "
              f"throughput {by['Ising forebay get_many']['samples_per_s'] / by['Ising PFF (pickle)']['samples_per_s']:.1f}x PFF, "
              f"{by['Ising forebay get_many']['samples_per_s'] / by['Ising HDF5 (h5py)']['samples_per_s']:.1f}x HDF5")
    print("\n| ingest source | samples | MiB/s | share of sequential write bandwidth |\n|---|---:|---:|---:|")
    for r in ingest_rows:
        print(f"| {r['source']} | {r['samples']} | {r['MiB_per_s']:,.0f} | "
              f"{r['ratio_to_seq_write']:.2f} |")
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(), "reads": results,
                                      "ingest": ingest_rows, "seq_write_MiB_s": bw / 2**20},
                                     indent=1))


if __name__ == "__main__":
    main()

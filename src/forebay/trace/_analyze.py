"""Summaries of a trace directory: DFAnalyzer's time split, per-event statistics, and the
data-loading views of DDStore (latency per source) and NoPFS (where samples came from).

Times are per rank: each rank's events are merged into unions of intervals (threads and
nested events counted once), so "unoverlapped I/O" is I/O time during which that rank
computed nothing.  Job-level figures are the mean over ranks, except ``job_time_s`` (the
longest rank).  Clock skew between ranks does not matter: no interval of one rank is
compared with another's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np

from ._read import Events, read_traces

__all__ = ["analyze", "classify", "union_length", "format_summary", "CLASSES"]

#: what each time class is made of (categories, lower-case)
CLASSES = {
    # work of the model
    "compute": {"compute"},
    # I/O as the application sees it: fetching samples and batches, filling caches,
    # checkpoints (DFAnalyzer's "app-level I/O")
    "app_io": {"data", "dataloader", "data_loader", "prefetch", "cache", "checkpoint",
               "reader"},
    # the reads and copies that move bytes: file system calls (DFTracer's POSIX/STDIO,
    # forebay's dataset-file reads) and peers' memory (DFAnalyzer's "I/O")
    "io": {"posix", "stdio", "mpiio", "mpi-io", "hdf5", "reader", "memstore"},
}
STALL = ("dataloader", "fetch.iter")
_Q = (0, 25, 50, 75, 100)


def classify(ev: Events) -> dict[str, np.ndarray]:
    """Masks of the time classes (:data:`CLASSES`) and of the stalls."""
    cls = {c: np.isin(ev.cat, list(cats)) for c, cats in CLASSES.items()}
    # DFTracer's iteration wrappers: "X.iter" is the wait for the next item (kept),
    # "X.block" the loop body that follows (the user's work, not I/O)
    body = np.array([n.endswith(".block") for n in ev.name.tolist()], dtype=bool)
    cls["app_io"] &= ~body
    cls["stall"] = (ev.cat == STALL[0]) & (ev.name == STALL[1])
    return cls


def union_length(start: np.ndarray, end: np.ndarray) -> float:
    """Length of the union of intervals ``[start, end)`` (any order, may overlap)."""
    if len(start) == 0:
        return 0.0
    o = np.argsort(start, kind="stable")
    s, e = start[o], end[o]
    reach = np.maximum.accumulate(e)
    # a new merged segment starts where an interval begins after everything before ended
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    seg = np.cumsum(new) - 1
    seg_start = s[new]
    seg_end = np.zeros(len(seg_start))
    np.maximum.at(seg_end, seg, reach)
    return float((seg_end - seg_start).sum())


def _stats(x: np.ndarray) -> Optional[dict[str, float]]:
    x = x[~np.isnan(x)]
    if not len(x):
        return None
    q = np.percentile(x, _Q)
    return {"min": float(q[0]), "p25": float(q[1]), "mean": float(x.mean()),
            "median": float(q[2]), "p75": float(q[3]), "max": float(q[4])}


def _pcts(x: np.ndarray) -> dict[str, float]:
    p50, p95, p99 = np.percentile(x, [50, 95, 99])
    return {"count": int(len(x)), "p50": float(p50), "p95": float(p95), "p99": float(p99),
            "mean": float(x.mean())}


def _sizes(ev: Events) -> np.ndarray:
    """Bytes of each event: image_size, else ret (POSIX), else size."""
    n = ev.num
    out = n["image_size"].copy()
    for k in ("ret", "size"):
        m = np.isnan(out)
        out[m] = n[k][m]
    out[out < 0] = np.nan
    return out


def analyze(directory: "str | Path", events: Optional[Events] = None) -> dict[str, Any]:
    """Summary of every trace file under ``directory`` (see the module docstring)."""
    ev = read_traces(directory) if events is None else events
    rank = ev.rank
    ranks = sorted(set(rank.tolist()))
    end = ev.ts + ev.dur
    cls = classify(ev)
    stall = cls.pop("stall")
    item = (ev.cat == "data") & (ev.name == "item")
    sizes = _sizes(ev)
    out: dict[str, Any] = {"files": len(ev.files), "ranks": len(ranks), "events": len(ev),
                           "skipped": list(ev.skipped)}
    per_rank = []
    for r in ranks:
        m = rank == r
        t: dict[str, Any] = {}
        span_m = m  # the ai_root span covers the traced part of the run
        t["job_time_s"] = float(end[span_m].max() - ev.ts[span_m].min()) / 1e6 if span_m.any() \
            else 0.0
        u = {c: (ev.ts[m & cls[c]], end[m & cls[c]]) for c in cls}
        comp = union_length(*u["compute"])
        t["compute_time_s"] = comp / 1e6
        # DLIO's accelerator utilisation: compute over the rank's job time
        t["accelerator_utilization"] = (t["compute_time_s"] / t["job_time_s"]
                                        if t["job_time_s"] > 0 and comp > 0 else None)
        for c in ("app_io", "io"):
            alone = union_length(*u[c])
            both = union_length(np.concatenate([u[c][0], u["compute"][0]]),
                                np.concatenate([u[c][1], u["compute"][1]]))
            t[f"{c}_time_s"] = alone / 1e6
            t[f"unoverlapped_{c}_s"] = (both - comp) / 1e6
        io_any = m & (cls["io"] | cls["app_io"])
        both = union_length(np.concatenate([ev.ts[io_any], u["compute"][0]]),
                            np.concatenate([end[io_any], u["compute"][1]]))
        t["unoverlapped_compute_s"] = (both - union_length(ev.ts[io_any], end[io_any])) / 1e6
        t["stall_s"] = float(ev.dur[m & stall].sum()) / 1e6
        t["steps"] = int((m & stall).sum())
        t["fetches"] = int((m & item).sum())
        t["start_us"] = float(ev.ts[span_m].min()) if span_m.any() else float("nan")
        per_rank.append({"rank": r, **t})
    keys = ("app_io_time_s", "unoverlapped_app_io_s", "io_time_s", "unoverlapped_io_s",
            "compute_time_s", "unoverlapped_compute_s", "stall_s")
    out["job_time_s"] = max((p["job_time_s"] for p in per_rank), default=0.0)
    for k in keys:
        out[k] = float(np.mean([p[k] for p in per_rank])) if per_rank else 0.0
    aus = [p["accelerator_utilization"] for p in per_rank
           if p["accelerator_utilization"] is not None]
    out["accelerator_utilization"] = float(np.mean(aus)) if aus else None
    out["accelerator_utilization_min"] = float(min(aus)) if aus else None
    out["stall_total_s"] = float(ev.dur[stall].sum()) / 1e6
    out["steps"] = int(stall.sum())
    if stall.any():
        per_step = ev.dur[stall] / 1e3
        out["stall_per_step_ms"] = {"mean": float(per_step.mean()),
                                    **{k: float(v) for k, v in zip(
                                        ("p50", "p95", "p99", "max"),
                                        np.percentile(per_step, [50, 95, 99, 100]))}}
    starts = [p["start_us"] for p in per_rank if not np.isnan(p["start_us"])]
    if len(starts) > 1:
        spread = (max(starts) - min(starts)) / 1e6
        if spread > max(60.0, out["job_time_s"]):
            out["skipped"].append(f"clock skew: ranks' first events are {spread:.0f} s apart "
                                  f"(longer than the job); each rank's times are measured on "
                                  f"its own clock")
    for p in per_rank:
        p.pop("start_us")
    # fetches: latency per source (DDStore Table 2) and where samples came from (NoPFS)
    lat: dict[str, Any] = {}
    lat_tier: dict[str, Any] = {}
    srcs: dict[str, Any] = {}
    n_items = int(item.sum())
    for s in sorted(set(ev.source[item].tolist())):
        m = item & (ev.source == s)
        lat[s or "unknown"] = _pcts(ev.dur[m])
        b = sizes[m]
        srcs[s or "unknown"] = {"count": int(m.sum()), "bytes": int(np.nansum(b)),
                                "share": float(m.sum() / n_items)}
    for s in sorted(set(ev.tier[item].tolist())):
        m = item & (ev.tier == s)
        lat_tier[s or "unknown"] = _pcts(ev.dur[m])
    out["fetch_latency_us"] = lat
    out["fetch_latency_by_tier_us"] = lat_tier
    out["fetch_sources"] = srcs
    out["fetch_sources_by_rank"] = {
        int(r): {s: int(((rank == r) & item & (ev.source == s)).sum()) for s in srcs}
        for r in ranks}
    # what was read from the dataset files, against the dataset: bytes (the files' size)
    # and records (NoPFS's PFS reads per sample)
    reads = (ev.cat == "reader") & (ev.name == "read")
    out["pfs_read_bytes"] = int(np.nansum(sizes[reads]))
    out["pfs_reads"] = int(reads.sum())
    nrec = ev.num["samples"][reads]
    out["pfs_records_read"] = int(np.where(np.isnan(nrec), 1, nrec).sum())
    datasets: dict[str, dict] = {}
    for md in ev.meta:
        if md.get("name") == "dataset" and "path" in md:
            datasets[md["path"]] = md
    if datasets:
        nbytes = sum(int(m.get("file_bytes", m.get("record_bytes", 0))) for m in
                     datasets.values())
        nsamp = sum(int(m.get("samples", 0)) for m in datasets.values())
        out["dataset_bytes"], out["dataset_samples"] = nbytes, nsamp
        out["pfs_read_amplification"] = out["pfs_read_bytes"] / nbytes if nbytes else None
        out["pfs_reads_per_sample"] = out["pfs_records_read"] / nsamp if nsamp else None
    else:
        out["dataset_bytes"] = out["dataset_samples"] = None
        out["pfs_read_amplification"] = out["pfs_reads_per_sample"] = None
    # POSIX-level I/O from DFTracer (any traced application)
    posix = np.isin(ev.cat, ["posix", "stdio"])
    if posix.any():
        rd = posix & np.isin(ev.name, ["read", "pread", "pread64", "readv", "preadv", "fread"])
        wr = posix & np.isin(ev.name, ["write", "pwrite", "pwrite64", "writev", "fwrite"])
        out["posix"] = {"events": int(posix.sum()), "read_bytes": int(np.nansum(sizes[rd])),
                        "write_bytes": int(np.nansum(sizes[wr])),
                        "time_s": float(ev.dur[posix].sum()) / 1e6,
                        "files": len(set(ev.fname[posix].tolist()) - {""})}
    # per event name
    by_name = []
    keyarr = np.array([f"{c}\x00{n}" for c, n in zip(ev.cat.tolist(), ev.name.tolist())],
                      dtype=object) if len(ev) else np.zeros(0, dtype=object)
    for key in sorted(set(keyarr.tolist())):
        m = keyarr == key
        c, n = key.split("\x00")
        by_name.append({"cat": c, "name": n, "count": int(m.sum()),
                        "dur_us": _stats(ev.dur[m]), "size_bytes": _stats(sizes[m])})
    by_name.sort(key=lambda d: -(d["dur_us"]["mean"] * d["count"] if d["dur_us"] else 0))
    out["events_by_name"] = by_name
    out["per_rank"] = per_rank
    imb = {}
    for k in ("job_time_s", "io_time_s", "compute_time_s", "stall_s", "fetches"):
        v = np.array([p[k] for p in per_rank], dtype=np.float64)
        if len(v) and v.mean() > 0:
            imb[k] = float(v.max() / v.mean())
    out["imbalance_max_over_mean"] = imb
    return out


def _t(s: float) -> str:
    return f"{s:9.3f} s"


def format_summary(a: dict[str, Any]) -> str:
    """The analysis as text, DFAnalyzer-style."""
    lines = [f"trace: {a['files']} file(s), {a['ranks']} rank(s), {a['events']:,} events"]
    for s in a["skipped"]:
        lines.append(f"  skipped: {s}")
    lines += [
        "time per rank (mean over ranks; job time = longest rank)",
        f"  job time                 {_t(a['job_time_s'])}",
        f"  compute                  {_t(a['compute_time_s'])}   unoverlapped "
        f"{_t(a['unoverlapped_compute_s'])}",
        "  accelerator utilisation  " + (
            f"{100 * a['accelerator_utilization']:.1f}% (lowest rank "
            f"{100 * a['accelerator_utilization_min']:.1f}%; compute / job time, DLIO's AU)"
            if a.get("accelerator_utilization") is not None else "- (no compute marked)"),
        f"  app-level I/O            {_t(a['app_io_time_s'])}   unoverlapped "
        f"{_t(a['unoverlapped_app_io_s'])}",
        f"  I/O                      {_t(a['io_time_s'])}   unoverlapped "
        f"{_t(a['unoverlapped_io_s'])}",
        f"  data stall (fetch.iter)  {_t(a['stall_s'])}   over {a['steps']:,} steps",
    ]
    if "stall_per_step_ms" in a:
        s = a["stall_per_step_ms"]
        lines.append(f"  stall per step: mean {s['mean']:.3f} ms, p50 {s['p50']:.3f}, "
                     f"p99 {s['p99']:.3f}, max {s['max']:.3f}")
    if a["fetch_sources"]:
        lines.append("sample fetches by source      count     share      bytes     p50 us"
                     "     p95 us     p99 us")
        for s, v in a["fetch_sources"].items():
            la = a["fetch_latency_us"][s]
            lines.append(f"  {s:<24} {v['count']:>9,} {v['share']:>8.1%} {v['bytes']:>10,} "
                         f"{la['p50']:>10.1f} {la['p95']:>10.1f} {la['p99']:>10.1f}")
    if a["pfs_read_amplification"] is not None:
        lines.append(f"dataset-file reads: {a['pfs_reads']:,} reads of {a['pfs_records_read']:,}"
                     f" records ({a['pfs_reads_per_sample']:.2f} per sample), "
                     f"{a['pfs_read_bytes']:,} B = {a['pfs_read_amplification']:.2f}x the "
                     f"dataset's files")
    if "posix" in a:
        p = a["posix"]
        lines.append(f"POSIX: {p['events']:,} calls on {p['files']} files, "
                     f"{p['read_bytes']:,} B read, {p['write_bytes']:,} B written, "
                     f"{p['time_s']:.3f} s")
    if a["imbalance_max_over_mean"]:
        lines.append("imbalance (max/mean over ranks): " + ", ".join(
            f"{k.replace('_s', '').replace('_time', '')} {v:.2f}"
            for k, v in a["imbalance_max_over_mean"].items()))
    lines.append("events by name (top 12 by total time)      count      mean us    median us"
                 "       max us   mean bytes")
    for d in a["events_by_name"][:12]:
        du, sz = d["dur_us"], d["size_bytes"]
        lines.append(f"  {d['cat'] + '/' + d['name']:<38} {d['count']:>9,} "
                     f"{du['mean']:>12.1f} {du['median']:>12.1f} {du['max']:>12.1f} "
                     f"{(sz['mean'] if sz else float('nan')):>12.0f}")
    return "\n".join(lines)

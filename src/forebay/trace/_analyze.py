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

from .._intervals import merge_intervals
from ._read import CHUNK, Columns, Events, Scanner, Strings

__all__ = ["analyze", "classify", "union_length", "format_summary", "CLASSES", "EXACT"]

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
_READS = {"read", "pread", "pread64", "readv", "preadv", "fread"}
_WRITES = {"write", "pwrite", "pwrite64", "writev", "fwrite"}
#: values of one kind kept for exact percentiles; beyond, a histogram (see Quantiles)
EXACT = 1 << 16


#: what the masks test of each distinct string (a category or an event name)
_PREDICATES: dict[str, Any] = {
    **{k: (lambda v, cats=cats: v in cats) for k, cats in CLASSES.items()},
    "block": lambda v: v.endswith(".block"),
    "dataloader": lambda v: v == STALL[0], "fetch.iter": lambda v: v == STALL[1],
    "data": lambda v: v == "data", "item": lambda v: v == "item",
    "reader": lambda v: v == "reader", "read": lambda v: v == "read",
    "posix": lambda v: v in ("posix", "stdio"), "any": lambda v: True,
    "reads": lambda v: v in _READS, "writes": lambda v: v in _WRITES,
}


class _Tables:
    """Each predicate of every distinct string, indexable by code; extended only for
    the strings added since (a trace of many files has many distinct names)."""

    def __init__(self, strings: Strings) -> None:
        self.strings = strings
        self.t: dict[str, np.ndarray] = {}

    def __getitem__(self, key: str) -> np.ndarray:
        have = self.t.get(key, np.zeros(0, dtype=bool))
        values = self.strings.values
        if len(have) < len(values):
            pred = _PREDICATES[key]
            new = np.fromiter((bool(pred(v)) for v in values[len(have):]), dtype=bool,
                              count=len(values) - len(have))
            have = self.t[key] = np.concatenate([have, new])
        return have


def _masks(c: Columns, t: _Tables) -> dict[str, np.ndarray]:
    """Masks of the time classes, the stalls, sample fetches, dataset-file reads and
    POSIX calls of one chunk."""
    cls = {k: t[k][c.cat_code] for k in CLASSES}
    # DFTracer's iteration wrappers: "X.iter" is the wait for the next item (kept),
    # "X.block" the loop body that follows (the user's work, not I/O)
    cls["app_io"] &= ~t["block"][c.name_code]

    def named(cat: str, name: str) -> np.ndarray:
        return t[cat][c.cat_code] & t[name][c.name_code]

    cls["stall"] = named("dataloader", "fetch.iter")
    cls["item"] = named("data", "item")
    cls["reads"] = named("reader", "read")
    cls["posix"] = named("posix", "any")
    cls["posix_read"] = named("posix", "reads")
    cls["posix_write"] = named("posix", "writes")
    return cls


def classify(ev: Events) -> dict[str, np.ndarray]:
    """Masks of the time classes (:data:`CLASSES`) and of the stalls."""
    m = _masks(ev, _Tables(ev.strings))
    return {k: m[k] for k in (*CLASSES, "stall")}


def union_length(start: np.ndarray, end: np.ndarray) -> float:
    """Length of the union of intervals ``[start, end)`` (any order, may overlap)."""
    s, e = merge_intervals(start, end)
    return float((e - s).sum())


class _Union:
    """A union of intervals fed in pieces: memory grows with its disjoint segments
    (about one per step for a training loop), not with the intervals."""

    def __init__(self) -> None:
        self.s, self.e = np.zeros(0), np.zeros(0)

    def add(self, s: np.ndarray, e: np.ndarray) -> None:
        if not len(s):
            return
        # segments that end before the new intervals begin stay as they are: a trace
        # written as events end touches only the last few
        cut = int(np.searchsorted(self.e, s.min(), side="left"))
        ts, te = merge_intervals(np.concatenate([self.s[cut:], s]),
                                 np.concatenate([self.e[cut:], e]))
        self.s, self.e = np.concatenate([self.s[:cut], ts]), np.concatenate([self.e[:cut], te])

    def update(self, other: "_Union") -> None:
        self.add(other.s, other.e)

    def length(self) -> float:
        return float((self.e - self.s).sum())


class Quantiles:
    """Count, mean, min, max and percentiles of a stream of values (NaN ignored).

    Exact (``np.percentile``) up to :data:`EXACT` values; beyond, the values go into a
    histogram of 1%-wide logarithmic bins (positive and negative, and zero), so a
    percentile is within 1% of the exact one (one bin), min, max, mean and count stay
    exact, and memory stays under 80 KiB whatever the count.
    """

    _LOG = np.log(1.01)
    _LO, _NB = -1400, 4900        # bins cover 1.01**-1400 (1e-6) .. 1.01**3500 (1e15)

    def __init__(self) -> None:
        self.n, self.total = 0, 0.0
        self.lo, self.hi = np.inf, -np.inf
        self._vals: list[np.ndarray] = []
        self._hist: Optional[np.ndarray] = None   # [negative bins, zero, positive bins]

    def add(self, x: np.ndarray) -> None:
        x = x[~np.isnan(x)]
        if not len(x):
            return
        self.n += len(x)
        self.total += float(x.sum())
        self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))
        if self._hist is None:
            self._vals.append(x)
            if self.n <= EXACT:
                return
            x = np.concatenate(self._vals)
            self._vals = []
            self._hist = np.zeros(2 * self._NB + 1, dtype=np.int64)
        self._hist += np.bincount(self._bin(x), minlength=len(self._hist))

    def _bin(self, x: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore"):
            k = np.floor(np.log(np.abs(x)) / self._LOG) - self._LO
        k = np.clip(np.nan_to_num(k, neginf=0), 0, self._NB - 1).astype(np.int64)
        return np.where(x > 0, self._NB + 1 + k, np.where(x < 0, self._NB - 1 - k, self._NB))

    def _value(self, b: np.ndarray) -> np.ndarray:
        k = np.abs(b - self._NB) - 1
        v = np.exp((k + self._LO + 0.5) * self._LOG) * np.sign(b - self._NB)
        return np.clip(v, self.lo, self.hi)

    def percentile(self, q: "tuple[float, ...] | list[float]") -> np.ndarray:
        if self._hist is None:
            return np.percentile(np.concatenate(self._vals), q)
        cum = np.cumsum(self._hist)
        rank = np.asarray(q, dtype=np.float64) / 100 * (self.n - 1)
        v = self._value(np.searchsorted(cum, rank, side="right"))
        v[np.asarray(q) == 0], v[np.asarray(q) == 100] = self.lo, self.hi
        return v

    def stats(self) -> Optional[dict[str, float]]:
        if not self.n:
            return None
        q = self.percentile(_Q)
        return {"min": self.lo, "p25": float(q[1]), "mean": self.total / self.n,
                "median": float(q[2]), "p75": float(q[3]), "max": self.hi}

    def pcts(self) -> dict[str, float]:
        p50, p95, p99 = self.percentile((50, 95, 99))
        return {"count": self.n, "p50": float(p50), "p95": float(p95), "p99": float(p99),
                "mean": self.total / self.n}


def _sizes(c: Columns) -> np.ndarray:
    """Bytes of each event: image_size, else ret (POSIX), else size."""
    n = c.num
    out = n["image_size"].copy()
    for k in ("ret", "size"):
        m = np.isnan(out)
        out[m] = n[k][m]
    out[out < 0] = np.nan
    return out


_UNIONS = ("compute", "app_io", "io", "app_io+compute", "io+compute", "any", "any+compute")


class _Proc:
    """What the analysis keeps of one process: its span, its busy intervals, counts."""

    def __init__(self) -> None:
        self.t0, self.t1 = np.inf, -np.inf
        self.u = {k: _Union() for k in _UNIONS}
        self.stall_us = 0.0
        self.steps = self.fetches = 0
        self.by_source: dict[int, int] = {}

    def update(self, o: "_Proc") -> None:
        self.t0, self.t1 = min(self.t0, o.t0), max(self.t1, o.t1)
        for k in _UNIONS:
            self.u[k].update(o.u[k])
        self.stall_us += o.stall_us
        self.steps += o.steps
        self.fetches += o.fetches
        for s, n in o.by_source.items():
            self.by_source[s] = self.by_source.get(s, 0) + n


class _Analysis:
    """The analysis fed chunk by chunk: memory grows with the number of distinct event
    names, sources and processes and with the busy intervals (one per step), never with
    the number of events."""

    def __init__(self, strings: Strings) -> None:
        self.strings = strings
        self.tables = _Tables(strings)
        self.events = 0
        self.procs: dict[int, _Proc] = {}
        self.stall = Quantiles()
        self.src_lat: dict[int, Quantiles] = {}
        self.src_bytes: dict[int, float] = {}
        self.tier_lat: dict[int, Quantiles] = {}
        self.reads = {"bytes": 0.0, "count": 0, "records": 0.0}
        self.posix = {"events": 0, "read_bytes": 0.0, "write_bytes": 0.0, "time_us": 0.0}
        self.posix_files: set[int] = set()
        self.by_name: dict[tuple[int, int], tuple[Quantiles, Quantiles]] = {}

    def add(self, c: Columns) -> None:
        if not len(c):
            return
        self.events += len(c)
        m = _masks(c, self.tables)
        end = c.ts + c.dur
        sizes = _sizes(c)
        comp, app, io = m["compute"], m["app_io"], m["io"]
        any_io = io | app
        unions = {"compute": comp, "app_io": app, "io": io, "app_io+compute": app | comp,
                  "io+compute": io | comp, "any": any_io, "any+compute": any_io | comp}
        for p in np.unique(c.proc).tolist():
            mp = c.proc == p
            q = self.procs.setdefault(p, _Proc())
            q.t0, q.t1 = min(q.t0, float(c.ts[mp].min())), max(q.t1, float(end[mp].max()))
            for k, sel in unions.items():
                w = mp & sel
                q.u[k].add(c.ts[w], end[w])
            q.stall_us += float(c.dur[mp & m["stall"]].sum())
            q.steps += int((mp & m["stall"]).sum())
            q.fetches += int((mp & m["item"]).sum())
            src, n = np.unique(c.source_code[mp & m["item"]], return_counts=True)
            for s, k in zip(src.tolist(), n.tolist()):
                q.by_source[s] = q.by_source.get(s, 0) + k
        self.stall.add(c.dur[m["stall"]])
        item = m["item"]
        for s in np.unique(c.source_code[item]).tolist():
            w = item & (c.source_code == s)
            self.src_lat.setdefault(s, Quantiles()).add(c.dur[w])
            self.src_bytes[s] = self.src_bytes.get(s, 0.0) + float(np.nansum(sizes[w]))
        for s in np.unique(c.tier_code[item]).tolist():
            self.tier_lat.setdefault(s, Quantiles()).add(c.dur[item & (c.tier_code == s)])
        r = m["reads"]
        nrec = c.num["samples"][r]
        self.reads["bytes"] += float(np.nansum(sizes[r]))
        self.reads["count"] += int(r.sum())
        self.reads["records"] += float(np.where(np.isnan(nrec), 1, nrec).sum())
        px = m["posix"]
        if px.any():
            self.posix["events"] += int(px.sum())
            self.posix["read_bytes"] += float(np.nansum(sizes[m["posix_read"]]))
            self.posix["write_bytes"] += float(np.nansum(sizes[m["posix_write"]]))
            self.posix["time_us"] += float(c.dur[px].sum())
            self.posix_files.update(np.unique(c.fname_code[px]).tolist())
        key = c.cat_code.astype(np.int64) << 32 | c.name_code.astype(np.int64)
        order = np.argsort(key, kind="stable")
        ks, starts = np.unique(key[order], return_index=True)
        for k, part in zip(ks.tolist(), np.split(order, starts[1:])):
            d, z = self.by_name.setdefault((k >> 32, k & 0xFFFFFFFF),
                                           (Quantiles(), Quantiles()))
            d.add(c.dur[part])
            z.add(sizes[part])

    def result(self, procs: list[dict[str, Any]], rank_of: np.ndarray, fname_map: np.ndarray,
               meta: list[dict[str, Any]], skipped: list[str], nfiles: int) -> dict[str, Any]:
        val = self.strings.values
        by_rank: dict[int, _Proc] = {}
        for p, q in sorted(self.procs.items()):
            by_rank.setdefault(int(rank_of[p]), _Proc()).update(q)
        out: dict[str, Any] = {"files": nfiles, "ranks": len(by_rank), "events": self.events,
                               "skipped": list(skipped), "warnings": []}
        # one rank in processes one after the other: runs (or a job and its restart)
        # whose files share the directory; their times are added up as one run
        spans: dict[int, list[tuple[float, float, int]]] = {}
        for p, q in self.procs.items():
            if q.t1 >= q.t0:
                spans.setdefault(int(rank_of[p]), []).append((q.t0, q.t1, p))
        for r, sp in sorted(spans.items()):
            sp.sort()
            if len(sp) > 1 and all(b[0] >= a[1] for a, b in zip(sp, sp[1:])):
                names = sorted({f for _, _, p in sp for f in procs[p].get("files", ())})
                out["warnings"].append(
                    f"rank {r} is {len(sp)} processes one after another ("
                    f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): several "
                    f"runs in one directory? They are analysed as one run; give each run a "
                    f"directory of its own")
                break
        per_rank = []
        for r, q in sorted(by_rank.items()):
            t: dict[str, Any] = {}
            t["job_time_s"] = (q.t1 - q.t0) / 1e6
            comp = q.u["compute"].length()
            t["compute_time_s"] = comp / 1e6
            # DLIO's accelerator utilisation: compute over the rank's job time
            t["accelerator_utilization"] = (t["compute_time_s"] / t["job_time_s"]
                                            if t["job_time_s"] > 0 and comp > 0 else None)
            for k in ("app_io", "io"):
                t[f"{k}_time_s"] = q.u[k].length() / 1e6
                t[f"unoverlapped_{k}_s"] = (q.u[f"{k}+compute"].length() - comp) / 1e6
            t["unoverlapped_compute_s"] = (q.u["any+compute"].length()
                                           - q.u["any"].length()) / 1e6
            t["stall_s"] = q.stall_us / 1e6
            t["steps"] = q.steps
            t["fetches"] = q.fetches
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
        out["stall_total_s"] = self.stall.total / 1e6
        out["steps"] = self.stall.n
        if self.stall.n:
            pct = self.stall.percentile((50, 95, 99, 100)) / 1e3
            out["stall_per_step_ms"] = {"mean": self.stall.total / self.stall.n / 1e3,
                                        **{k: float(v) for k, v in zip(
                                            ("p50", "p95", "p99", "max"), pct)}}
        starts = [q.t0 for q in by_rank.values()]
        if len(starts) > 1:
            spread = (max(starts) - min(starts)) / 1e6
            if spread > max(60.0, out["job_time_s"]):
                out["skipped"].append(f"clock skew: ranks' first events are {spread:.0f} s "
                                      f"apart (longer than the job); each rank's times are "
                                      f"measured on its own clock")
        # fetches: latency per source (DDStore Table 2) and where samples came from (NoPFS)
        label = lambda s: val[s] or "unknown"  # noqa: E731
        n_items = sum(q.n for q in self.src_lat.values())
        srcs = sorted(self.src_lat, key=lambda s: val[s])
        out["fetch_latency_us"] = {label(s): self.src_lat[s].pcts() for s in srcs}
        out["fetch_latency_by_tier_us"] = {
            label(s): self.tier_lat[s].pcts() for s in sorted(self.tier_lat,
                                                               key=lambda s: val[s])}
        out["fetch_sources"] = {label(s): {"count": self.src_lat[s].n,
                                           "bytes": int(self.src_bytes[s]),
                                           "share": self.src_lat[s].n / n_items}
                                for s in srcs}
        out["fetch_sources_by_rank"] = {r: {label(s): q.by_source.get(s, 0) for s in srcs}
                                        for r, q in sorted(by_rank.items())}
        # what was read from the dataset files, against the dataset: bytes (the files'
        # size) and records (NoPFS's PFS reads per sample)
        out["pfs_read_bytes"] = int(self.reads["bytes"])
        out["pfs_reads"] = int(self.reads["count"])
        out["pfs_records_read"] = int(self.reads["records"])
        datasets: dict[str, dict] = {}
        for md in meta:
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
        if self.posix["events"]:
            files = {val[int(fname_map[f])] for f in self.posix_files} - {""}
            out["posix"] = {"events": self.posix["events"],
                            "read_bytes": int(self.posix["read_bytes"]),
                            "write_bytes": int(self.posix["write_bytes"]),
                            "time_s": self.posix["time_us"] / 1e6, "files": len(files)}
        # per event name
        by_name: list[dict[str, Any]] = []
        for (c, n), (d, z) in sorted(self.by_name.items(),
                                     key=lambda kv: f"{val[kv[0][0]]}\x00{val[kv[0][1]]}"):
            by_name.append({"cat": val[c], "name": val[n], "count": d.n,
                            "dur_us": d.stats(), "size_bytes": z.stats()})
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


def analyze(directory: "str | Path", events: Optional[Events] = None,
            progress: Any = None, chunk: int = CHUNK) -> dict[str, Any]:
    """Summary of every trace file under ``directory`` (see the module docstring), read
    as a stream of ``chunk`` events at a time: memory grows with the distinct event
    names and the steps, not with the trace.  ``events`` (from :func:`read_traces`)
    analyses those instead."""
    if events is not None:
        a = _Analysis(events.strings)
        a.add(events)
        ident = np.arange(len(events.strings.values), dtype=np.int32)
        rank_of = np.array([q["rank"] for q in events.procs], dtype=np.int64)
        return a.result(events.procs, rank_of, ident, events.meta, events.skipped,
                        len(events.files))
    sc = Scanner(directory, chunk=chunk, progress=progress)
    a = _Analysis(sc.strings)
    for part in sc.chunks():
        a.add(part)
    sc.finish()
    return a.result(sc.procs, sc.rank_of, sc.fname_map, sc.meta, sc.skipped, len(sc.files))


def _steps(a: dict[str, Any]) -> str:
    """The steps behind the (per-rank) stall figure: per rank, not summed over ranks."""
    per = sorted({p["steps"] for p in a["per_rank"]})
    if len(per) <= 1:
        n = per[0] if per else 0
        return f"{n:,} steps" + (f" per rank ({a['steps']:,} in all)" if a["ranks"] > 1 else "")
    return f"{per[0]:,}-{per[-1]:,} steps per rank ({a['steps']:,} in all)"


def _t(s: float) -> str:
    return f"{s:9.3f} s"


def format_summary(a: dict[str, Any]) -> str:
    """The analysis as text, DFAnalyzer-style."""
    lines = [f"trace: {a['files']} file(s), {a['ranks']} rank(s), {a['events']:,} events"]
    for s in a["skipped"]:
        lines.append(f"  skipped: {s}")
    for s in a.get("warnings", []):
        lines.append(f"  warning: {s}")
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
        f"  data stall (fetch.iter)  {_t(a['stall_s'])}   over {_steps(a)}",
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
                     + (f"{sz['mean']:>12.0f}" if sz else f"{'-':>12}"))
    return "\n".join(lines)

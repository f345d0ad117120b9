"""System descriptions for the simulator: NoPFS's performance-model parameters (§4)
read from the same TOML profile format ``forebay calibrate`` writes, plus a ``lassen``
preset with the figures of NoPFS §6.1.

Parameters per worker: compute throughput c and preprocessing rate beta (MB/s),
network bandwidth b_c (MB/s), the PFS's aggregate random-read throughput t(gamma) for
gamma concurrent readers, and three storage classes: the staging buffer (class 0),
RAM (class 1) and local SSD (class 2), each with a capacity, a number of prefetch
threads and read/write throughput tables by thread count.  Staging buffer and RAM are
both memory, so both read the ``[ram] copy_MBps`` table (lassen: r_0(8) = 111 GB/s,
r_1(4) = 85 GB/s are two points of one table).  Beyond NoPFS: the cores of a node
(``cpus``), which its prefetch threads share, and the rate at which the training
process takes batches back from worker processes (``handback_MBps``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

import numpy as np

from ..store import ProfileError, interpolate, load_profile

__all__ = ["System", "lassen", "hdmlp_thesis", "load_system", "PFS_READERS", "TIER_READS",
           "MODELS"]


@dataclass(frozen=True)
class System:
    """One worker's machine and the shared file system, in NoPFS's terms."""

    compute_MBps: float                       # c
    preprocess_MBps: float                    # beta, per prefetch thread
    network_MBps: float                       # b_c
    pfs_MBps: Mapping[int, float]             # t(gamma): readers -> aggregate MB/s
    mem_MBps: Mapping[int, float]             # r_0, r_1 (and w_0, w_1): threads -> MB/s
    ssd_read_MBps: Mapping[int, float] = field(default_factory=dict)   # r_2
    ssd_write_MBps: Mapping[int, float] = field(default_factory=dict)  # w_2
    staging_bytes: int = 5 * 10**9            # d_0
    ram_bytes: int = 0                        # d_1
    ssd_bytes: int = 0                        # d_2
    staging_threads: int = 8                  # p_0
    ram_threads: int = 4                      # p_1
    ssd_threads: int = 2                      # p_2
    pfs_open_ms: float = 0.0                  # per file opened on the PFS (metadata)
    # t(gamma) of large sequential requests (a preload's chunks); empty: pfs_MBps, which
    # is measured with one request per record
    pfs_stream_MBps: Mapping[int, float] = field(default_factory=dict)
    # t(gamma) reading every record of a range (a record's request brings in parts of
    # its neighbours, read next), and the share of the records pfs_MBps's reads covered
    # (random ones); empty / 0: a read's speed does not depend on what else is read
    pfs_dense_MBps: Mapping[int, float] = field(default_factory=dict)
    pfs_read_fraction: float = 0.0
    pfs_client_MBps: float = float("inf")     # b_fs: one worker's link to the PFS
    pfs_readers: str = "active"               # how gamma is counted (PFS_READERS)
    tier_reads: str = "shared"                # a tier's table per thread (TIER_READS)
    # cores of a worker's node that its prefetch threads (and the training process's
    # hand-back) share; None: every thread has a core of its own (NoPFS's model)
    cpus: Optional[float] = None
    # MB/s on one core at which the training process takes a batch back from the
    # loader's worker processes, in series with its step; None: no such cost (threads)
    handback_MBps: Optional[float] = None
    name: str = "custom"
    model: str = "conserving"                 # MODELS: bandwidth conserved, or the thesis'

    def __post_init__(self) -> None:
        for key in ("compute_MBps", "preprocess_MBps", "network_MBps"):
            v = getattr(self, key)
            if not v > 0:
                raise ProfileError(f"system {self.name}: {key} must be positive, got {v!r}")
        if not self.pfs_MBps or not self.mem_MBps:
            raise ProfileError(f"system {self.name}: needs the PFS read table ([pfs] "
                               f"read_MBps) and the memory table ([ram] copy_MBps)")
        if self.ssd_bytes and not self.ssd_read_MBps:
            raise ProfileError(f"system {self.name}: an SSD tier of {self.ssd_bytes} bytes "
                               f"needs [ssd] read_MBps")
        for key in ("staging_bytes", "ram_bytes", "ssd_bytes"):
            if getattr(self, key) < 0:
                raise ProfileError(f"system {self.name}: {key} must be >= 0")
        for key in ("staging_threads", "ram_threads", "ssd_threads"):
            if getattr(self, key) < 1:
                raise ProfileError(f"system {self.name}: {key} must be >= 1")
        if self.pfs_readers not in PFS_READERS:
            raise ProfileError(f"system {self.name}: [model] pfs_readers must be one of "
                               f"{', '.join(PFS_READERS)}, got {self.pfs_readers!r}")
        if self.tier_reads not in TIER_READS:
            raise ProfileError(f"system {self.name}: [model] tier_reads must be one of "
                               f"{', '.join(TIER_READS)}, got {self.tier_reads!r}")
        if self.model not in MODELS:
            raise ProfileError(f"system {self.name}: [model] model must be one of "
                               f"{', '.join(MODELS)}, got {self.model!r}")
        if self.model == "conserving" and self.tier_reads != "shared":
            raise ProfileError(f"system {self.name}: tier_reads = {self.tier_reads!r} gives "
                               f"every read a tier's whole table, more than the tier has; "
                               f"it belongs to model = \"thesis\" (the published rule)")
        for key in ("cpus", "handback_MBps"):
            v = getattr(self, key)
            if v is not None and not v > 0:
                raise ProfileError(f"system {self.name}: {key} must be positive, got {v!r}")
        if not 0 <= self.pfs_read_fraction <= 1:
            raise ProfileError(f"system {self.name}: pfs_read_fraction must be in [0, 1], "
                               f"got {self.pfs_read_fraction!r}")
        if self.pfs_dense_MBps and not 0 < self.pfs_read_fraction < 1:
            raise ProfileError(f"system {self.name}: [pfs] dense_MBps needs read_fraction "
                               f"(the share of the records read_MBps's reads covered), "
                               f"in (0, 1)")
        if not self.pfs_client_MBps > 0:
            raise ProfileError(f"system {self.name}: pfs_client_MBps must be positive")
        if not self.pfs_open_ms >= 0:
            raise ProfileError(f"system {self.name}: pfs_open_ms must be >= 0, got "
                               f"{self.pfs_open_ms!r}")

    # -- per-MB times of one read (NoPFS §4) -----------------------------------------
    def pfs_s_per_MB(self, readers: "float | np.ndarray") -> "float | np.ndarray":
        """fetch_{i,0,0}: 1 / min(b_fs, t(gamma) / gamma) with gamma concurrent readers
        (fractional gammas, and arrays of them, interpolate the table)."""
        g = np.maximum(np.asarray(readers, dtype=np.float64), 1.0)
        ks = np.array(sorted(self.pfs_MBps), dtype=np.float64)
        vs = np.array([self.pfs_MBps[int(k)] for k in ks])
        out = 1.0 / np.minimum(self.pfs_client_MBps, np.interp(g, ks, vs) / g)
        return float(out) if out.ndim == 0 else out

    @property
    def conserving(self) -> bool:
        """Whether no resource delivers more than its table (the default model)."""
        return self.model == "conserving"

    def pfs_thread_MBps(self, readers: "float | np.ndarray",
                        stream: bool = False) -> np.ndarray:
        """The conserving model's speed of one reading thread when ``readers`` threads
        read the PFS at once: t(G) / G with G = max(readers, 1), so that G threads
        together get t(G), never more (the table clamped past its largest count).
        ``stream``: reads in large sequential requests (``pfs_stream_MBps``, when the
        profile has it), not one request per record."""
        table = self.pfs_stream_MBps if stream and self.pfs_stream_MBps else self.pfs_MBps
        g = np.maximum(np.asarray(readers, dtype=np.float64), 1.0)
        ks = np.array(sorted(table), dtype=np.float64)
        vs = np.array([table[int(k)] for k in ks])
        return np.interp(g, ks, vs) / g

    def pfs_record_cost(self, share: "float | np.ndarray") -> np.ndarray:
        """A record read's PFS seconds per MB, relative to ``pfs_MBps``'s, for a reader
        whose node reads ``share`` of the dataset's records in the epoch: the pages a
        request brings in beyond its record hold parts of the neighbours, fetched again
        only if the node reads them later (probability about ``share``).  Linear in the
        share through the two calibrated points, 1 at ``pfs_read_fraction`` (random
        records) and d = t(1) / t_dense(1) at every record:
        d + (1 - d) (1 - share) / (1 - pfs_read_fraction), above 1 below the
        calibration's share.  1 without ``pfs_dense_MBps``."""
        share = np.clip(np.asarray(share, dtype=np.float64), 0.0, 1.0)
        if not self.pfs_dense_MBps:
            return np.ones_like(share)
        d = interpolate(self.pfs_MBps, 1) / interpolate(self.pfs_dense_MBps, 1)
        return d + (1.0 - d) * (1.0 - share) / (1.0 - self.pfs_read_fraction)

    @property
    def pfs_top_MBps(self) -> float:
        """The most the PFS delivers of records' bytes: the largest rate of its tables
        of record reads (dense reads waste no pages)."""
        return max([*self.pfs_MBps.values(), *self.pfs_dense_MBps.values()])

    def pfs_setup_s_per_MB(self, workers: int, threads: int, stream: bool = False) -> float:
        """Per MB of one thread when ``workers`` workers load with ``threads`` threads
        each, all at once (a set-up phase): conserving, the PFS shared by every thread
        and a worker's link by its threads; the thesis' rule, t(N) / N per read."""
        if not self.conserving:
            return float(self.pfs_s_per_MB(workers))
        per = float(self.pfs_thread_MBps(workers * threads, stream))
        return 1.0 / min(per, self.pfs_client_MBps / threads)

    def local_s_per_MB(self, tier: str) -> float:
        """fetch_{i,2,j}: one prefetch thread's read of the own tier 'ram' or 'ssd'.
        Conserving: the p_0 prefetch threads share the tier's table at p_0,
        r_j(p_0) / p_0 each.  Thesis: 1 / (r_j(p_j) / p_j) as NoPFS §4 writes it
        (``tier_reads = "per-read"``: 1 / r_j(p_j), as the thesis' simulator computes)."""
        table = self.mem_MBps if tier == "ram" else self.ssd_read_MBps
        if self.conserving:
            return self.staging_threads / interpolate(table, self.staging_threads)
        p = self.ram_threads if tier == "ram" else self.ssd_threads
        return (p if self.tier_reads == "shared" else 1) / interpolate(table, p)

    def peer_s_per_MB(self, tier: str) -> float:
        """fetch_{i,1,j}: 1 / min(b_c, r_j(p_j) / p_j); conserving, the worker's link
        shared by its p_0 prefetch threads (b_c / p_0 each)."""
        link = self.network_MBps / (self.staging_threads if self.conserving else 1)
        return max(1.0 / link, self.local_s_per_MB(tier))

    @property
    def core_share(self) -> float:
        """The cores one thread may use: min(1, cpus) (1 without ``cpus``)."""
        return 1.0 if self.cpus is None else min(1.0, self.cpus)

    def write_s_per_MB(self, threads: Optional[int] = None) -> float:
        """write_i: max(1/beta, 1/(w_0(p_0)/p_0)) (preprocessing and the staging write
        pipelined); beta on a node of less than a core is that share of it."""
        p = self.staging_threads if threads is None else threads
        return max(1.0 / (self.preprocess_MBps * self.core_share),
                   p / interpolate(self.mem_MBps, p))

    def handback_s_per_MB(self) -> float:
        """The training process's seconds per MB taking batches back from the loader's
        workers, in series with its step (0 without ``handback_MBps``)."""
        if self.handback_MBps is None:
            return 0.0
        return 1.0 / (self.handback_MBps * self.core_share)

    def tier_write_s_per_MB(self, tier: str) -> float:
        p = self.ram_threads if tier == "ram" else self.ssd_threads
        table = self.mem_MBps if tier == "ram" else (self.ssd_write_MBps or self.ssd_read_MBps)
        return p / interpolate(table, p)

    def compute_s_per_MB(self) -> float:
        return 1.0 / self.compute_MBps

    def scaled(self, factor: float) -> "System":
        """The same machine with its RAM and SSD capacities multiplied by ``factor``
        (used with a dataset scaled by the same factor: the same case, fewer samples).
        The staging buffer is sized in batches, not in dataset fractions: it stays."""
        return replace(self, ram_bytes=int(self.ram_bytes * factor),
                       ssd_bytes=int(self.ssd_bytes * factor))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "compute_MBps": self.compute_MBps,
                "preprocess_MBps": self.preprocess_MBps, "network_MBps": self.network_MBps,
                "pfs_MBps": dict(self.pfs_MBps), "pfs_stream_MBps": dict(self.pfs_stream_MBps),
                "pfs_dense_MBps": dict(self.pfs_dense_MBps),
                "pfs_read_fraction": self.pfs_read_fraction,
                "mem_MBps": dict(self.mem_MBps),
                "ssd_read_MBps": dict(self.ssd_read_MBps),
                "staging_bytes": self.staging_bytes, "ram_bytes": self.ram_bytes,
                "ssd_bytes": self.ssd_bytes, "threads": [self.staging_threads,
                                                         self.ram_threads, self.ssd_threads],
                "pfs_open_ms": self.pfs_open_ms,
                "pfs_client_MBps": (None if self.pfs_client_MBps == float("inf")
                                    else self.pfs_client_MBps),
                "pfs_readers": self.pfs_readers, "tier_reads": self.tier_reads,
                "cpus": self.cpus, "handback_MBps": self.handback_MBps,
                "model": self.model}


def lassen() -> System:
    """NoPFS §6.1's small Lassen-like cluster node: c = 64 MB/s, beta = 200 MB/s,
    b_c = 24,000 MB/s, 5 GB staging buffer, 120 GB RAM, 900 GB SSD, 8/4/2 prefetch
    threads, r_0(8) = 111 GB/s, r_1(4) = 85 GB/s, r_2(2) = 4 GB/s, PFS t(1) = 330,
    t(2) = 730, t(4) = 1,540, t(8) = 2,870 MB/s.  No separate open latency: the paper's
    model has none (its t(gamma) is a throughput of reading samples)."""
    return System(compute_MBps=64.0, preprocess_MBps=200.0, network_MBps=24_000.0,
                  pfs_MBps={1: 330.0, 2: 730.0, 4: 1540.0, 8: 2870.0},
                  mem_MBps={4: 85_000.0, 8: 111_000.0},
                  ssd_read_MBps={2: 4_000.0}, ssd_write_MBps={2: 4_000.0},
                  staging_bytes=5 * 10**9, ram_bytes=120 * 10**9, ssd_bytes=900 * 10**9,
                  staging_threads=8, ram_threads=4, ssd_threads=2, name="lassen")


def hdmlp_thesis() -> System:
    """The cluster of the HDMLP thesis (Boehringer, ETH 2020, §5.2.1), whose Tables
    5.1-5.4 forebay's validation suite reproduces: 4 nodes, c = 100 MB/s, beta = 200 MB/s,
    b_c = 10,000 MB/s, b_fs = 2,000 MB/s, a 1,024 MB staging buffer, 50 GB RAM and
    100 GB SSD (in the thesis' units of 1,024 MB), 2 threads per class, r_0(2) = r_1(2)
    = 21,164 MB/s, r_2(2) = 86 MB/s, t(1..4) = 66, 86, 129, 146 MB/s.  Its simulator
    gives every tier read the whole r_j(p) (``tier_reads = "per-read"``)."""
    gb = 1024 * 10**6
    return System(compute_MBps=100.0, preprocess_MBps=200.0, network_MBps=10_000.0,
                  pfs_MBps={1: 66.0, 2: 86.0, 3: 129.0, 4: 146.0}, mem_MBps={2: 21_164.0},
                  ssd_read_MBps={2: 86.0}, staging_bytes=1024 * 10**6,
                  ram_bytes=50 * gb, ssd_bytes=100 * gb, staging_threads=2, ram_threads=2,
                  ssd_threads=2, pfs_client_MBps=2000.0, tier_reads="per-read",
                  name="hdmlp-thesis", model="thesis")


#: "conserving" (default): at every moment the PFS, a tier and a link deliver at most
#: what their tables give for the threads using them; "thesis": the published rule
#: (every read of a worker's threads gets t(gamma)/gamma), which reproduces the HDMLP
#: thesis' tables and does not conserve bandwidth
MODELS = ("conserving", "thesis")
#: how the simulator counts gamma, the PFS readers a read shares t(gamma) with
PFS_READERS = ("active", "all")
#: whether a tier's r_j(p) table is shared by its p threads (NoPFS §4) or is the speed
#: of every read (the thesis' simulator)
TIER_READS = ("shared", "per-read")

PRESETS = {"lassen": lassen, "hdmlp-thesis": hdmlp_thesis}


def load_system(spec: "str | os.PathLike[str]", *, compute_MBps: Optional[float] = None,
                preprocess_MBps: Optional[float] = None,
                network_MBps: Optional[float] = None,
                pfs_open_ms: Optional[float] = None) -> System:
    """A preset name (``lassen``) or a TOML profile.  A profile from ``forebay calibrate``
    lacks the workload figures: give them in ``[compute]``/``[network]`` or as
    arguments (arguments win)."""
    if str(spec) in PRESETS:
        sysm = PRESETS[str(spec)]()
        over: dict[str, Any] = {k: v for k, v in (("compute_MBps", compute_MBps),
                                  ("preprocess_MBps", preprocess_MBps),
                                  ("network_MBps", network_MBps),
                                  ("pfs_open_ms", pfs_open_ms)) if v is not None}
        return replace(sysm, **over) if over else sysm
    prof = load_profile(spec)
    return system_from_profile(prof, name=os.path.basename(str(spec)),
                               compute_MBps=compute_MBps, preprocess_MBps=preprocess_MBps,
                               network_MBps=network_MBps, pfs_open_ms=pfs_open_ms)


def system_from_profile(prof: Mapping[str, Any], *, name: str = "profile",
                        compute_MBps: Optional[float] = None,
                        preprocess_MBps: Optional[float] = None,
                        network_MBps: Optional[float] = None,
                        pfs_open_ms: Optional[float] = None) -> System:
    comp = prof.get("compute", {})
    c = compute_MBps or comp.get("MBps")
    beta = preprocess_MBps or comp.get("preprocess_MBps")
    if c is None:
        raise ProfileError(f"{name}: no compute throughput: add [compute] MBps = ... (the "
                           f"training step's MB/s per worker) or pass --compute-MBps")
    pfs = prof.get("pfs", {}).get("read_MBps")
    mem = prof.get("ram", {}).get("copy_MBps")
    if not pfs or not mem:
        raise ProfileError(f"{name}: the simulator needs [pfs] read_MBps and [ram] "
                           f"copy_MBps (run forebay calibrate --dataset ...)")
    rma = prof.get("rma", {}).get("get_MBps")
    # no network figure: the measured RMA get bandwidth, else "as fast as memory"
    bc = network_MBps or prof.get("network", {}).get("MBps") \
        or (max(rma.values()) if rma else max(mem.values()))
    ssd = prof.get("ssd", {})
    tiers = prof.get("tiers", {})
    model = prof.get("model", {})
    return System(compute_MBps=float(c), preprocess_MBps=float(beta or 1e7),
                  network_MBps=float(bc), pfs_MBps=pfs, mem_MBps=mem,
                  ssd_read_MBps=ssd.get("read_MBps", {}),
                  ssd_write_MBps=ssd.get("write_MBps", {}),
                  staging_bytes=tiers.get("staging_bytes", 256 << 20),
                  ram_bytes=tiers.get("ram_bytes", 0),
                  ssd_bytes=tiers.get("ssd_bytes", 0) if ssd.get("read_MBps") else 0,
                  staging_threads=tiers.get("staging_threads", 1),   # 0 is refused by name
                  ram_threads=tiers.get("ram_threads", 1),
                  ssd_threads=tiers.get("ssd_threads", 1),
                  pfs_open_ms=float(pfs_open_ms if pfs_open_ms is not None
                                    else prof.get("pfs", {}).get("open_ms", 0.0)),
                  pfs_client_MBps=float(prof.get("pfs", {}).get("client_MBps", float("inf"))),
                  pfs_stream_MBps=prof.get("pfs", {}).get("stream_MBps", {}),
                  pfs_dense_MBps=prof.get("pfs", {}).get("dense_MBps", {}),
                  pfs_read_fraction=float(prof.get("pfs", {}).get("read_fraction", 0.0)),
                  pfs_readers=model.get("pfs_readers", "active"),
                  tier_reads=model.get("tier_reads", "shared"),
                  cpus=comp.get("cpus"), handback_MBps=comp.get("handback_MBps"),
                  name=name, model=model.get("model", "conserving"))

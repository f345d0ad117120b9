"""Shared helpers for forebay benchmarks: page-cache eviction, percentiles, machine facts."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np


def evict(paths: Iterable[Path]) -> int:
    """Drop the files' pages from the page cache (posix_fadvise DONTNEED); returns bytes.

    Dirty pages cannot be dropped, so everything is written back first (os.sync):
    files written moments ago (fresh synthetic data) would otherwise stay cached."""
    os.sync()
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


class ThrottledDevice:
    """A slow shared file system for unmodified programs: a block-I/O cgroup that caps
    the reads of the block device holding ``path`` at ``mbps`` MB/s and ``iops``
    requests/s.  Every process started through :meth:`wrap` (and its children) reads
    through the cap; the page cache is not capped (evict first for a cold read).
    Needs root and the cgroup v1 ``blkio`` controller or cgroup v2 ``io`` (raises
    ``SystemExit`` naming what is missing).  Use as a context manager: the cgroup is
    removed at exit."""

    def __init__(self, path: Path, mbps: float, iops: int = 0) -> None:
        st = os.stat(path)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        sysdev = Path(f"/sys/dev/block/{dev}")
        if (sysdev / "partition").exists():        # caps apply to the whole disk
            dev = (sysdev.resolve().parent / "dev").read_text().strip()
        elif not sysdev.exists():
            raise SystemExit(f"{path} is not on a block device (st_dev {dev}): nothing to "
                             f"throttle")
        self.dev, self.mbps, self.iops = dev, mbps, iops
        name = f"forebay-bench-{os.getpid()}"
        v1, v2 = Path("/sys/fs/cgroup/blkio"), Path("/sys/fs/cgroup")
        bps = int(mbps * 1e6)
        try:
            if (v1 / "blkio.throttle.read_bps_device").exists():
                self.group = v1 / name
                self.group.mkdir(exist_ok=True)
                (self.group / "blkio.throttle.read_bps_device").write_text(f"{dev} {bps}")
                if iops:
                    (self.group / "blkio.throttle.read_iops_device").write_text(
                        f"{dev} {iops}")
            elif "io" in (v2 / "cgroup.controllers").read_text().split() \
                    if (v2 / "cgroup.controllers").exists() else False:
                self.group = v2 / name
                self.group.mkdir(exist_ok=True)
                (self.group / "io.max").write_text(
                    f"{dev} rbps={bps}" + (f" riops={iops}" if iops else ""))
            else:
                raise SystemExit("no block-I/O cgroup controller here (cgroup v1 blkio or "
                                 "v2 io): cannot throttle the device")
        except PermissionError as e:
            raise SystemExit(f"throttling the device needs root: {e}") from None

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside the cgroup."""
        procs = self.group / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *cmd]

    def join(self) -> None:
        """Move this process (and the children it starts from now on) into the cgroup;
        it leaves again at exit."""
        (self.group / "cgroup.procs").write_text(str(os.getpid()))
        self._joined = True

    def read_bytes(self) -> int:
        """Bytes the cgroup's processes have read from the device so far (page-cache
        misses: what the file system really served)."""
        v1 = self.group / "blkio.throttle.io_service_bytes"
        if v1.exists():
            for line in v1.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[0] == self.dev and parts[1] == "Read":
                    return int(parts[2])
            return 0
        for line in (self.group / "io.stat").read_text().splitlines():
            if line.startswith(self.dev + " "):
                for kv in line.split()[1:]:
                    if kv.startswith("rbytes="):
                        return int(kv[7:])
        return 0

    def describe(self) -> str:
        return (f"device {self.dev} read-capped at {self.mbps:g} MB/s"
                + (f" and {self.iops} IOPS" if self.iops else "") + " (block-I/O cgroup)")

    def __enter__(self) -> "ThrottledDevice":
        return self

    def __exit__(self, *exc: object) -> None:
        """Remove the cgroup: this process and any process still in it (workers that
        outlived their job by a moment) move back to the parent group first."""
        parent = self.group.parent / "cgroup.procs"
        if getattr(self, "_joined", False):
            parent.write_text(str(os.getpid()))
        for _ in range(50):
            try:
                for pid in (self.group / "cgroup.procs").read_text().split():
                    try:
                        parent.write_text(pid)
                    except OSError:          # it exited meanwhile
                        pass
                self.group.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        print(f"warning: could not remove the cgroup {self.group}; rmdir it by hand")


def throttled(path: Path, spec: "str | None") -> "Any":
    """The benchmarks' ``--throttle MBPS[,IOPS]``: a :class:`ThrottledDevice` for the
    disk holding ``path`` (a context manager), or a null context giving None."""
    import contextlib

    if not spec:
        return contextlib.nullcontext(None)
    mbps, _, iops = spec.partition(",")
    return ThrottledDevice(path, float(mbps), int(iops or 0))


def paced(root: Path, spec: str, clients: int = 1) -> "Any":
    """The benchmarks' ``--fs fuse``: ``root`` served read-only through a FUSE file
    system paced at ``--throttle MBPS[,IOPS]`` (tests/cluster_pfs.py: one queue, no
    credit for a reader's idle time, unlike the block-I/O cgroup), mounted at
    ``<root>-pfs`` (a context manager; :meth:`path` maps a path under ``root`` to the
    mount; make it before an emulated cluster, whose nodes copy the host's mounts;
    ``clients``: mounts of it, each its own page cache, for ``attach``: one for this
    process and one per node).  The files are read once first, so that the server
    reads from memory and the pacing is the file system's speed."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from cluster_pfs import PacedFS, unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"--fs fuse: {why}")
    for f in files_under(Path(root)):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    return PacedFS.beside(root, spec, clients)


def drop_all_caches() -> bool:
    """Also drop dentries and inodes (echo 3 > /proc/sys/vm/drop_caches): the next open()
    of a file must read directory and inode blocks, as on a parallel file system where
    each open is a metadata-server round trip.  Needs root; machine-wide.  Returns
    whether it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def files_under(path: Path) -> list[Path]:
    path = Path(path)
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def time_reads(read: Callable[[int], object], ids: Sequence[int]) -> np.ndarray:
    """Latency of each ``read(i)`` in seconds."""
    lat = np.empty(len(ids))
    clock = time.perf_counter
    for k, i in enumerate(ids):
        t0 = clock()
        read(int(i))
        lat[k] = clock() - t0
    return lat


def summarize(lat: np.ndarray, samples: int | None = None) -> dict:
    samples = len(lat) if samples is None else samples
    return {"p50_ms": float(np.percentile(lat, 50) * 1e3),
            "p95_ms": float(np.percentile(lat, 95) * 1e3),
            "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "samples_per_s": float(samples / lat.sum())}


def rss_bytes() -> int:
    """This process's resident memory now (VmRSS: its own pages and the shared ones it
    touched)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_cpu_s(own: bool = True) -> float:
    """CPU seconds (user + system) of this process and every live descendant (a
    loader's workers, a fork server's children), from /proc, each with what its
    children that ended have used (workers that stop at an epoch's end); without this
    process's own (``own=False``): its descendants' alone."""
    tick, me = os.sysconf("SC_CLK_TCK"), os.getpid()
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for st in Path("/proc").glob("[0-9]*/stat"):
        try:
            f = st.read_text().rsplit(")", 1)[1].split()
        except OSError:                              # a process that ended meanwhile
            continue
        pid = int(st.parent.name)                    # fields after the name: ppid at 1
        parent[pid] = int(f[1])
        # utime, stime (not this process's without ``own``), cutime, cstime
        first = 13 if pid == me and not own else 11
        cpu[pid] = sum(int(x) for x in f[first:15]) / tick
    total = 0.0
    for pid, used in cpu.items():
        p = pid
        while p > 1 and p != me:
            p = parent.get(p, 0)
        total += used if p == me else 0.0
    return total


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def seq_write_bandwidth(directory: Path, nbytes: int = 512 << 20, block: int = 8 << 20) -> float:
    """Sequential write bandwidth of ``directory`` in bytes/s (written, fsynced, removed)."""
    path = Path(directory) / ".forebay-bw-probe"
    buf = np.random.default_rng(0).integers(0, 256, block, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(nbytes // block):
            f.write(buf)
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return nbytes / dt


# -- A/B of two source trees ---------------------------------------------------------------
def run_in_tree(src: str, snippet: str, *args: object) -> dict:
    """Run ``snippet`` (a program printing one JSON object, with ``"code"`` set to
    ``forebay.__file__``) in a new Python importing forebay from the tree ``src``."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    out = subprocess.run([sys.executable, "-c", snippet, *map(str, args)], env=env,
                         capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert Path(r["code"]).resolve().is_relative_to(Path(src).resolve()), r["code"]
    return r


def ab_table(first: str, times: dict[str, dict[str, list[float]]]) -> str:
    """A markdown table of ``times[tree][row]`` (trees "old" and "new"): min and median
    of each, and new/old ratios."""
    import statistics

    lines = [f"| {first} | old min / median s | new min / median s | new/old min | "
             f"new/old median |", "|---|---:|---:|---:|---:|"]
    for row in times["old"]:
        o, n = times["old"][row], times["new"][row]
        lines.append(f"| {row} | {min(o):.3f} / {statistics.median(o):.3f} | {min(n):.3f} / "
                     f"{statistics.median(n):.3f} | {min(n) / min(o):.2f} | "
                     f"{statistics.median(n) / statistics.median(o):.2f} |")
    return "\n".join(lines)


def jpeg_dataset(out: Path, samples: int) -> tuple[Path, Path]:
    """``samples`` real JPEGs under ``out`` (``forebay synth imagenet --encode jpeg``,
    an ImageFolder tree) and the same packed (``forebay ingest --from imagefolder``),
    made once: (the tree, the packed dataset)."""
    from forebay.dataset.sources import get_source, ingest
    from forebay.synth import synthesize

    out.mkdir(parents=True, exist_ok=True)
    src, packed = out / f"jpeg-{samples}", out / f"jpeg-{samples}.fb"
    if not src.exists():
        synthesize("imagenet", src, samples, seed=0, encode="jpeg", progress=True)
    if not packed.exists():
        ingest(get_source("imagefolder", src), packed)
    return src, packed


def imagenet_dataset(path: Path, samples: int) -> Path:
    """An ImageNet-sized packed dataset at ``path`` (``forebay synth imagenet`` ingested
    from its ImageFolder), made once: the node-cache and growth benchmarks' data."""
    import shutil
    import subprocess

    if not path.exists():
        src = path.parent / f"{path.name}-src"
        subprocess.run(["forebay", "synth", "imagenet", str(src), "--samples", str(samples),
                        "--overwrite"], check=True)
        subprocess.run(["forebay", "ingest", str(src), str(path), "--from", "imagefolder",
                        "--overwrite"], check=True)
        shutil.rmtree(src)
    return path

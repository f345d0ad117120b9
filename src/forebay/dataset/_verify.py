"""Every checksum of a packed dataset checked (``forebay verify``): index files, whole
shards, and the samples of a shard that fails."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import xxhash

from ..errors import ChecksumError
from ..progress import Progress, as_progress
from ._format import IndexLayout, checksum

if TYPE_CHECKING:
    from ._reader import PackedDataset

__all__ = ["VerifyReport", "bad_records", "verify_files"]

class VerifyReport:
    """What :meth:`PackedDataset.verify` found: ``ok``, ``problems``, ``bad_samples``."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.bad_samples: list[int] = []
        self.bytes_checked = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def __repr__(self) -> str:
        return (f"VerifyReport(ok={self.ok}, problems={len(self.problems)}, "
                f"bad_samples={self.bad_samples[:10]}"
                f"{'...' if len(self.bad_samples) > 10 else ''})")


def verify_files(ds: "PackedDataset", *, progress: "Progress | bool | None" = None,
                 raise_on_error: bool = True) -> VerifyReport:
    """:meth:`PackedDataset.verify`: every index file's and shard's checksum, and the
    samples of a damaged shard one by one."""
    report = VerifyReport()
    starts = np.cumsum([0] + [sh.num_samples for sh in ds.manifest.shards])
    prog = as_progress(progress)
    prog.start(ds.disk_nbytes, desc="verify", unit="B")
    for k, s in enumerate(ds.manifest.shards):
        ipath, dpath = ds.path / s.index, ds.path / s.data
        try:
            if checksum(ipath.read_bytes()) != s.index_checksum:
                report.problems.append(f"{ipath}: index checksum mismatch")
            prog.update(s.index_nbytes)
            h = xxhash.xxh3_64()
            size = 0
            with open(dpath, "rb") as f:
                while chunk := f.read(16 << 20):
                    h.update(chunk)
                    size += len(chunk)
                    prog.update(len(chunk))
            report.bytes_checked += size + s.index_nbytes
        except OSError as e:
            report.problems.append(f"{dpath}: cannot read ({e})")
            continue
        if size != s.data_nbytes:
            report.problems.append(f"{dpath}: {size} bytes, manifest records {s.data_nbytes}")
        elif h.hexdigest() != s.data_checksum:
            first = int(starts[k])
            bad = ds.bad_records(np.arange(first, first + s.num_samples))
            report.bad_samples += bad
            report.problems.append(
                f"{dpath}: shard checksum mismatch; damaged samples: "
                f"{bad[:20]}{'...' if len(bad) > 20 else ''}" if bad else
                f"{dpath}: shard checksum mismatch (in padding; every sample checks out)")
    prog.close()
    if report.problems and raise_on_error:
        raise ChecksumError(f"{ds.path}: " + "; ".join(report.problems[:10]) +
                            (f" (+{len(report.problems) - 10} more)"
                             if len(report.problems) > 10 else ""))
    return report


def bad_records(ds: "PackedDataset", ids: np.ndarray, buf: Optional[np.ndarray] = None,
                offsets: Optional[np.ndarray] = None) -> list[int]:
    """:meth:`PackedDataset.bad_records`: those of samples ``ids`` whose record bytes
    fail their checksum, in the dataset's files or in ``buf`` at ``offsets``."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    bad = []
    rows = ds.index[ids]
    if buf is None:
        starts = rows[:, IndexLayout.REC_OFF].tolist()
        srcs = [ds.shard_buffer(s) for s in ds.shard_of[ids].tolist()]
    else:
        starts = np.asarray(offsets, dtype=np.int64).reshape(-1).tolist()
        srcs = [buf] * len(ids)
    for i, src, off, ln, want in zip(ids.tolist(), srcs, starts,
                                     rows[:, IndexLayout.REC_LEN].tolist(),
                                     rows[:, IndexLayout.REC_SUM].view(np.uint64).tolist()):
        if off < 0 or off + ln > len(src) or \
                xxhash.xxh3_64_intdigest(src[off:off + ln].data) != want:
            bad.append(i)
    return bad

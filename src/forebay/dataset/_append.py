"""A dataset that grows (issue U, item 2): producers append generations while readers
are open.

A generation's samples are written as new shard files (under a temporary directory,
then renamed into the dataset's), and the manifest naming them is swapped in with one
``rename``: a reader opening the dataset sees every generation before it whole and
none after it; a reader that is open keeps the view it opened (shard files are never
changed once written).  Producers take turns (an ``flock`` on the dataset directory,
which the kernel drops when a producer dies).  The manifest's metadata records the
generations (``ds.metadata["generations"]``: the sample count after each), so an
access plan over the dataset can be made from the generation a reader saw."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from .._fs import fsync_dir
from ..errors import DatasetNotFoundError, SchemaError, WaitTimeoutError
from ..progress import Progress
from ._format import MANIFEST_NAME, Manifest
from ._writer import DEFAULT_SHARD_BYTES, write_dataset

__all__ = ["append", "generations", "wait_for"]

_SHARD = re.compile(r"shard-(\d{5,})\.(bin|idx\.npy)\Z")


def append(path: "str | os.PathLike[str]", samples: Iterable[Mapping[str, Any]], *,
           shard_bytes: int = DEFAULT_SHARD_BYTES,
           progress: "Progress | bool | None" = None) -> Manifest:
    """Append ``samples`` to the packed dataset at ``path`` as one new generation, whole
    or not at all; returns the new manifest.  The samples must match the dataset's
    schema (:class:`SchemaError` otherwise, nothing changed).  Producers on any node of
    a shared file system that supports ``flock`` take turns."""
    import time

    path = Path(path)
    if not (path / MANIFEST_NAME).is_file():
        raise DatasetNotFoundError(f"no dataset at {path} to append to")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)             # producers take turns
        cur = Manifest.read(path)
        _remove_orphans(path, cur)
        for pattern in (f".{path.name}.forebay-tmp-append-*",       # a dead producer's
                        f"..{path.name}.forebay-tmp-append-*"):     # (and its writer's)
            for q in path.parent.glob(pattern):
                shutil.rmtree(q, ignore_errors=True)
        tmp = path.parent / f".{path.name}.forebay-tmp-append-{uuid.uuid4().hex[:8]}"
        try:
            new = write_dataset(tmp, samples, shard_bytes=shard_bytes, progress=progress,
                                compress={f.name: "zstd" for f in cur.schema.fields
                                          if f.codec} or None)
            if new.schema != cur.schema:
                raise SchemaError(f"the samples' fields ({new.schema.describe()}) differ from "
                                  f"the dataset's ({cur.schema.describe()}): not appended")
            base = len(cur.shards)
            moved = []
            for k, s in enumerate(new.shards):
                data, index = f"shard-{base + k:05d}.bin", f"shard-{base + k:05d}.idx.npy"
                os.rename(tmp / s.data, path / data)
                os.rename(tmp / s.index, path / index)
                moved.append(replace(s, data=data, index=index))
            fsync_dir(path)
            gens = list(cur.metadata.get("generations") or [cur.num_samples])
            meta = dict(cur.metadata, generations=gens + [cur.num_samples + new.num_samples])
            out = Manifest(num_samples=cur.num_samples + new.num_samples, schema=cur.schema,
                           shards=cur.shards + tuple(moved),
                           payload_nbytes=cur.payload_nbytes + new.payload_nbytes,
                           metadata=meta, created_by=cur.created_by, fingerprint="")
            staged = path / f".{MANIFEST_NAME}.{uuid.uuid4().hex[:8]}"
            with open(staged, "wb") as f:
                f.write(out.to_json().encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(staged, path / MANIFEST_NAME)        # the generation appears whole
            fsync_dir(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _traced("producer", "append", t0, new.num_samples, new.payload_nbytes)
        return Manifest.read(path)
    finally:
        os.close(fd)


def _remove_orphans(path: Path, m: Manifest) -> None:
    """Shard files a producer that died mid-append moved in but never published (the
    lock is held: no producer is at work), and its staged manifests."""
    named = {n for s in m.shards for n in (s.data, s.index)}
    for p in path.iterdir():
        if (_SHARD.match(p.name) and p.name not in named) or \
                p.name.startswith(f".{MANIFEST_NAME}."):
            p.unlink(missing_ok=True)


def generations(m: Manifest) -> list[int]:
    """The sample count after each generation (one generation: the dataset as written)."""
    return [int(g) for g in (m.metadata.get("generations") or [m.num_samples])]



def wait_for(path: "str | os.PathLike[str]", samples: int, *,
             timeout: "float | None" = None, poll: float = 0.05) -> Manifest:
    """Wait until the dataset at ``path`` holds at least ``samples`` samples (a
    producer appending generations: :func:`append`) and return its manifest; the
    dataset may not exist yet.  Checks the manifest's file every ``poll`` seconds
    (parsing it only when it changed: it works on a shared file system, where no
    change notification crosses nodes); after ``timeout`` seconds (None: no limit)
    raises :class:`~forebay.errors.WaitTimeoutError` saying how many there are."""
    import time

    path = Path(path)
    t0 = time.perf_counter()
    deadline = None if timeout is None else time.monotonic() + timeout
    seen: Any = None
    have = 0
    while True:
        try:
            st = (path / MANIFEST_NAME).stat()
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            key = None
        if key is not None and key != seen:
            seen = key
            try:
                m = Manifest.read(path)
            except DatasetNotFoundError:
                m = None
            if m is not None:
                have = m.num_samples
                if have >= samples:
                    _traced("consumer", "wait_for", t0, samples, -1)
                    return m
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeoutError(f"{path}: {have} samples after {timeout:g} s, waiting "
                                   f"for {samples} (no producer appended them)")
        time.sleep(poll if deadline is None else max(0.0, min(poll,
                                                             deadline - time.monotonic())))


def _traced(cat: str, name: str, t0: float, count: int, nbytes: int) -> None:
    """A span from ``t0`` to now in the trace, when one is recorded (a workflow's
    producers and consumers in one timeline: ``forebay analyze``)."""
    import time

    from .. import trace as _trace

    rec = _trace.active()
    if rec is not None:
        rec.span(cat, name, t0, time.perf_counter(), count=count, nbytes=nbytes)

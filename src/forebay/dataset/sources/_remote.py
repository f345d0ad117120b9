"""Sources at an object-store URL (``s3://bucket/prefix``, S3-compatible stores): the
objects under the URL are copied to a local staging directory (in parallel, checked
against the free space first), the source of the asked kind reads that copy, and the
copy is removed when the ingest ends.  pyarrow's S3 file system does the transfers;
credentials and the endpoint come from the usual places (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, ``~/.aws``)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, Optional, Sequence

from ...errors import EmptySourceError, SourceError
from ...progress import as_progress
from ._base import REMOTE_SCHEMES, SOURCES, Source, is_remote, register_remote

__all__ = ["REMOTE_SCHEMES", "StagedSource", "is_remote"]

#: objects copied at once
_TRANSFERS = 8
_CHUNK = 8 << 20


class StagedSource(Source):
    """A source of kind ``kind`` over the objects at ``url``, read from a local copy
    made in ``stage_dir`` (default: the system's temporary directory;
    ``FOREBAY_STAGE_DIR`` overrides) when its units are listed, removed by
    :meth:`close` (the ingest driver calls it).  ``options`` go to the source."""

    def __init__(self, kind: str, url: str, *, stage_dir: "str | os.PathLike[str] | None" = None,
                 progress: Any = None, **options: Any) -> None:
        if kind not in SOURCES:
            raise SourceError(f"unknown source kind {kind!r}")
        self.kind = kind                                  # type: ignore[misc]
        self.unit_name = SOURCES[kind].unit_name          # type: ignore[misc]
        self.url, self.options = url, options
        self.stage_dir = stage_dir or os.environ.get("FOREBAY_STAGE_DIR") or None
        self._progress = progress
        self._dir: Optional[Path] = None
        self._inner: Optional[Source] = None

    def units(self) -> Sequence[Any]:
        if self._inner is None:
            self._inner = SOURCES[self.kind](self._stage(), **self.options)
        return self._inner.units()

    def read_unit(self, unit: Any) -> Sequence[dict[str, Any]]:
        assert self._inner is not None, "units() first"
        return self._inner.read_unit(unit)

    def metadata(self) -> dict[str, Any]:
        meta = self._inner.metadata() if self._inner is not None else {"source_kind": self.kind}
        return {**meta, "source_url": self.url}

    def close(self) -> None:
        """Remove the local copy."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = self._inner = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_progress": None}     # reader processes: no progress

    # -- the copy ---------------------------------------------------------------------
    def _stage(self) -> Path:
        """Copy the objects under the URL; the local path standing for it."""
        import pyarrow.fs as pafs

        try:
            fs, path = pafs.FileSystem.from_uri(self.url)
            bucket = path.split("/")[0]
            if fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                raise SourceError(f"{self.url}: no bucket {bucket!r} there (or not one these "
                                  f"credentials see)")
            top = fs.get_file_info(path)
            if top.type == pafs.FileType.File:
                files = [top]
            else:
                files = [f for f in fs.get_file_info(pafs.FileSelector(
                    path, recursive=True, allow_not_found=True))
                    if f.type == pafs.FileType.File]
        except (OSError, ValueError) as e:
            raise SourceError(f"{self.url}: cannot list it ({e})") from None
        if not files:
            raise EmptySourceError(f"{self.url}: no objects there")
        # each object's place under the staging directory: NAME (the URL's last part) for
        # one object, NAME/its key under the prefix for a prefix's objects
        base = PurePosixPath(path)
        name = base.name or "source"
        rels = []
        for f in files:
            rel = PurePosixPath(name) / PurePosixPath(f.path).relative_to(base)
            if ".." in rel.parts:
                raise SourceError(f"{self.url}: object {f.path!r} would be written outside "
                                  f"the staging directory; refused")
            rels.append(rel)
        total = sum(f.size for f in files)
        where = Path(self.stage_dir) if self.stage_dir else Path(tempfile.gettempdir())
        free = shutil.disk_usage(where).free
        if total > free:
            raise SourceError(f"{self.url}: {total:,} bytes to copy, {free:,} free in {where} "
                              f"(stage_dir=, or FOREBAY_STAGE_DIR, names another directory)")
        self._dir = Path(tempfile.mkdtemp(prefix="forebay-stage-", dir=where))
        stage = self._dir
        prog = as_progress(self._progress)
        prog.start(total, desc=f"copy {self.url}", unit="B")
        lock = threading.Lock()

        def copy(f: Any, rel: PurePosixPath) -> None:
            dst = stage / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            with fs.open_input_stream(f.path) as src, open(dst, "wb") as out:
                while True:
                    chunk = src.read(_CHUNK)
                    if not chunk:
                        break
                    out.write(chunk)
                    with lock:
                        prog.update(len(chunk))
        try:
            with ThreadPoolExecutor(_TRANSFERS) as ex:
                for fut in [ex.submit(copy, f, r) for f, r in zip(files, rels)]:
                    fut.result()
        except OSError as e:
            self.close()
            raise SourceError(f"{self.url}: copying it failed ({e})") from None
        except BaseException:
            self.close()
            raise
        finally:
            prog.close()
        return stage / name


register_remote(StagedSource)

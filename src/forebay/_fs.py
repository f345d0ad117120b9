"""Atomic directory creation: build under a temporary sibling, fsync, rename into place."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from .errors import DatasetExistsError

__all__ = ["check_target", "tmp_sibling", "commit_dir", "fsync_dir"]


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_target(path: Path, overwrite: bool) -> None:
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise DatasetExistsError(f"{path} exists; pass overwrite=True (--overwrite) to replace it")


def tmp_sibling(path: Path, tag: str = "tmp") -> Path:
    """A fresh hidden name beside ``path`` (random, never a PID: unique across nodes)."""
    return path.parent / f".{path.name}.forebay-{tag}-{uuid.uuid4().hex[:12]}"


def commit_dir(tmp: Path, path: Path, overwrite: bool) -> None:
    """Move the finished directory ``tmp`` to ``path``, replacing it if ``overwrite``.

    The old dataset is renamed aside first and removed only after the new one is in
    place, so a crash leaves either the old or the new one (possibly under its
    hidden ``.forebay-old-`` name), never a mix.
    """
    fsync_dir(tmp)
    old = None
    if path.exists() or path.is_symlink():
        check_target(path, overwrite)
        old = tmp_sibling(path, "old")
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()

"""Atomic directory creation (build under a temporary sibling, fsync, rename into place)
and which file system holds a path."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from .errors import DatasetExistsError

__all__ = ["check_target", "tmp_sibling", "commit_dir", "fsync_dir", "filesystem_type",
           "NETWORK_FS", "NETWORK_FS_ENV", "network_fs", "create_private", "Flock", "LiveLock",
           "abandoned", "new_tmp_dir"]

#: temporaries whose liveness cannot be told (no lock, or locks unsupported) are stale
#: only when nothing in them changed for this long
STALE_AFTER_S = 3600.0
_LIVE = ".forebay-live"


class LiveLock:
    """An exclusive ``flock`` on ``path`` held while its owner lives; the kernel drops it
    when the process dies, kill -9 included, so :func:`abandoned` can tell a crashed
    writer's leftovers from a live one's."""

    def __init__(self, path: "str | os.PathLike[str]") -> None:
        import fcntl

        self.path = Path(path)
        self.fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass   # locks unsupported here: abandoned() falls back to the age

    def release(self, unlink: bool = True) -> None:
        if self.fd is not None:
            if unlink:
                self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


class Flock:
    """An flock on ``path`` (created 0600), released by :meth:`release` or by the
    kernel when the process dies."""

    def __init__(self, path: "str | os.PathLike[str]", shared: bool = False,
                 block: bool = True) -> None:
        import fcntl

        self.fd: Optional[int] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        flags = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if block else fcntl.LOCK_NB)
        try:
            fcntl.flock(self.fd, flags)
        except OSError:
            os.close(self.fd)
            self.fd = None
            raise

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "Flock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def abandoned(path: "str | os.PathLike[str]", newest: float) -> bool:
    """Whether the file at ``path`` (locked by a :class:`LiveLock`, or anything else
    that takes one) belongs to no live process; where that cannot be told, whether
    ``newest`` (the latest modification time of what it guards) is older than
    :data:`STALE_AFTER_S`."""
    import fcntl
    import time

    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return time.time() - newest > STALE_AFTER_S
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False                      # its owner is alive
    except OSError:
        return time.time() - newest > STALE_AFTER_S
    finally:
        os.close(fd)
    return True


def _newest(d: Path) -> float:
    try:
        return max([d.stat().st_mtime] + [p.stat().st_mtime for p in d.iterdir()])
    except OSError:
        return 0.0


def new_tmp_dir(path: Path) -> "tuple[Path, LiveLock]":
    """A fresh temporary sibling of ``path`` to build into, locked as live; first
    removes what crashed writers of the same output left (their temporaries, and an
    old copy an interrupted overwrite renamed aside once ``path`` exists again)."""
    import shutil
    import time

    for p in path.parent.glob(f".{path.name}.forebay-tmp-*"):
        if p.is_dir() and abandoned(p / _LIVE, _newest(p)):
            shutil.rmtree(p, ignore_errors=True)
    if path.exists():
        for p in path.parent.glob(f".{path.name}.forebay-old-*"):
            if p.is_dir() and time.time() - _newest(p) > 600:
                shutil.rmtree(p, ignore_errors=True)
    tmp = tmp_sibling(path)
    tmp.mkdir()
    return tmp, LiveLock(tmp / _LIVE)


def create_private(path: "str | os.PathLike[str]") -> None:
    """Create ``path`` empty, readable and writable by its owner only (0600, whatever
    the umask): for what other users of a node must not read (model stores, tier
    files, traces).  An existing file is truncated and keeps its mode."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))


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


#: says why ``overwrite`` must not replace an existing path (None: it may)
Replaceable = Callable[[Path], Optional[str]]


def check_target(path: Path, overwrite: bool, replaceable: Optional[Replaceable] = None) -> None:
    """Raise :class:`DatasetExistsError` unless ``path`` is free, or ``overwrite`` is
    given and ``path`` is an empty directory or something ``replaceable`` recognises as
    forebay's own output.  ``overwrite`` never deletes a user's files."""
    if not (path.exists() or path.is_symlink()):
        return
    if not overwrite:
        raise DatasetExistsError(f"{path} exists; pass overwrite=True (--overwrite) to replace it")
    if path.is_symlink():
        why: Optional[str] = "it is a symbolic link"
    elif not path.is_dir():
        why = "it is not a directory"
    elif not any(path.iterdir()):
        why = None
    elif replaceable is None:
        why = "it is not empty"
    else:
        why = replaceable(path)
    if why is not None:
        raise DatasetExistsError(f"refusing to overwrite {path}: {why}; overwrite replaces only "
                                 f"what forebay wrote there (or an empty directory): remove or "
                                 f"rename it yourself, or choose another path")


def tmp_sibling(path: Path, tag: str = "tmp") -> Path:
    """A fresh hidden name beside ``path`` (random, never a PID: unique across nodes)."""
    return path.parent / f".{path.name}.forebay-{tag}-{uuid.uuid4().hex[:12]}"


def commit_dir(tmp: Path, path: Path, overwrite: bool,
               replaceable: Optional[Replaceable] = None) -> None:
    """Move the finished directory ``tmp`` to ``path``, replacing it if ``overwrite``.

    The old dataset is renamed aside first and removed only after the new one is in
    place, so a crash leaves either the old or the new one (possibly under its
    hidden ``.forebay-old-`` name), never a mix.
    """
    fsync_dir(tmp)
    old = None
    if path.exists() or path.is_symlink():
        check_target(path, overwrite, replaceable)
        old = tmp_sibling(path, "old")
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


# File systems shared between hosts (by their /proc/mounts type): LMDB's locks do not
# hold across nodes there, and a cache tier there is not node-local.
NETWORK_FS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "ceph",
              "glusterfs", "panfs", "orangefs", "pvfs2", "afs", "wekafs", "fuse.ceph",
              "fuse.glusterfs", "fuse.sshfs", "fuse.gcsfuse", "fuse.s3fs"}
_MOUNTS = "/proc/mounts"
#: more file system types to treat as shared between hosts (comma-separated): one
#: forebay does not list, or a local one declared shared to emulate a parallel one
NETWORK_FS_ENV = "FOREBAY_NETWORK_FS"


def network_fs(path: "str | Path", mounts: Optional[str] = None) -> Optional[str]:
    """The type of the file system holding ``path`` when it is shared between hosts
    (:data:`NETWORK_FS`, or a type named in ``FOREBAY_NETWORK_FS``); None for a local
    one, or where the type cannot be read."""
    fs = filesystem_type(path, mounts)
    extra = {t.strip() for t in os.environ.get(NETWORK_FS_ENV, "").split(",")}
    return fs if fs is not None and (fs in NETWORK_FS or fs in extra) else None


def filesystem_type(path: "str | Path", mounts: Optional[str] = None) -> Optional[str]:
    """Type of the file system holding ``path`` (the longest mount point above it in
    ``/proc/mounts``, or ``mounts`` when given); None where that cannot be read."""
    p, tail = Path(path).absolute(), []
    while not p.exists() and p != p.parent:   # a store not created yet: its parents
        tail.append(p.name)
        p = p.parent
    p = p.resolve().joinpath(*reversed(tail))
    try:
        text = mounts if mounts is not None else Path(_MOUNTS).read_text()
    except OSError:
        return None
    best, kind = -1, None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ").replace("\\011", "\t")
        mp = Path(point)
        if (p == mp or mp in p.parents) and len(mp.parts) > best:
            best, kind = len(mp.parts), parts[2]
    return kind

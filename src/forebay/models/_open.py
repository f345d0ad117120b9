"""A model repository from its URL: ``file://`` (LMDB), ``memory://`` or ``tcp://`` (a
provider)."""

from __future__ import annotations

import os
from typing import Optional

from ..errors import ModelRepositoryError
from ._backend import LmdbBackend, MemoryBackend
from ._remote import RemoteRepository
from ._repo import Repository
from ._store import ModelStore

__all__ = ["open_repository"]


def open_repository(url: str, token: Optional[str] = None, *, create: bool = True
                    ) -> "ModelStore":
    """``file:///path`` (or a plain path): LMDB in that directory; ``memory://`` (fresh)
    or ``memory://NAME`` (shared within the process); ``tcp://host:port[,...]``: a
    provider (``forebay models serve``)."""
    token = token or os.environ.get("FOREBAY_TOKEN")
    if url.startswith("memory://"):
        return Repository(MemoryBackend.named(url[len("memory://"):]))
    if url.startswith("tcp://"):
        return RemoteRepository(url, token)
    if url.startswith("file://"):
        path = url[len("file://"):]
    elif url.startswith("file:"):
        path = url[len("file:"):]
    elif "://" in url:
        raise ModelRepositoryError(f"{url}: unknown repository URL scheme (file://, "
                                   f"memory://, tcp://)")
    else:
        path = url
    return Repository(LmdbBackend(path, create=create))

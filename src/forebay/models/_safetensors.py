"""safetensors files in and out of a repository, with the ``safetensors`` library."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from ..errors import MissingDependencyError, ModelRepositoryError
from ._store import ModelStore

__all__ = ["import_safetensors", "export_safetensors"]


def _lib() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise MissingDependencyError("safetensors files need the safetensors library; pip "
                                     "install 'forebay[models]'") from None
    return safetensors


def import_safetensors(repo: ModelStore, path: "str | os.PathLike[str]", name: str,
                       metadata: Optional[dict[str, Any]] = None) -> int:
    """Store the tensors of a ``.safetensors`` file as the next version of ``name``
    (tensors already stored are not written again); the file's own metadata is kept
    under ``metadata["safetensors"]``.  A file that is not valid safetensors raises
    :class:`~forebay.errors.ModelRepositoryError` naming it; nothing is stored."""
    st = _lib()
    path = Path(path)
    try:
        with st.safe_open(str(path), framework="pt") as f:
            file_meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise
    except Exception as e:   # noqa: BLE001 - safetensors raises its own error types
        raise ModelRepositoryError(f"{path}: not a valid safetensors file "
                                   f"({type(e).__name__}: {e})") from None
    if not tensors:
        raise ModelRepositoryError(f"{path}: holds no tensors")
    meta = dict(metadata or {})
    meta["safetensors"] = {str(k): str(v) for k, v in file_meta.items()}
    meta.setdefault("source", path.name)
    return repo.save(name, tensors, meta)


def export_safetensors(repo: ModelStore, name: str, path: "str | os.PathLike[str]",
                       version: Optional[int] = None, include: Any = None) -> Path:
    """Write a version (or the tensors ``include`` selects) to a ``.safetensors`` file,
    atomically (a temporary renamed into place), with the metadata it was imported
    with and ``forebay_model``/``forebay_version``."""
    st = _lib()
    m = repo.manifest(name, version)
    sd = repo.load(name, m["version"], include=include)
    meta = dict((m.get("metadata") or {}).get("safetensors") or {})
    meta.update(forebay_model=name, forebay_version=str(m["version"]))
    path = Path(path)
    tmp = path.with_name(f".{path.name}.forebay-tmp-{os.getpid()}")
    try:
        st.torch.save_file({k: t.contiguous() for k, t in sd.items()}, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path

"""Per-object pickle files (PFF): one sample per file, as DDStore's baseline stores graphs."""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Sequence

from ...errors import SourceError, UntrustedPickleError
from ._base import Source, check_keys, list_files, register_source

__all__ = ["PickleSource", "sample_from_object"]


def sample_from_object(obj: Any, where: str) -> dict[str, Any]:
    """A sample dict from an unpickled object: a mapping, or an object with
    ``to_dict()`` (PyTorch Geometric ``Data``) or attributes."""
    if isinstance(obj, Mapping):
        return dict(obj)
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        d = to_dict()
        if isinstance(d, Mapping):
            return dict(d)
    if hasattr(obj, "__dict__"):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    raise SourceError(f"{where}: unpickled a {type(obj).__name__}, expected a mapping of field "
                      f"name to array (or a list of them)")


@register_source
class PickleSource(Source):
    """A directory of ``.pkl``/``.pickle`` files, each one sample (a dict of arrays, or
    an object such as a PyG ``Data``) or a list of samples.

    Unpickling runs arbitrary code: this source refuses to read anything unless
    ``trust_pickle=True`` (CLI ``--trust-pickle``).
    """

    kind = "pickle"

    def __init__(self, root: "str | os.PathLike[str]", *, keys: Optional[Sequence[str]] = None,
                 trust_pickle: bool = False, chunk_files: int = 256,
                 follow_links: bool = False, **unused: Any) -> None:
        if not trust_pickle:
            raise UntrustedPickleError(
                f"{root}: reading pickles runs code stored in them; pass --trust-pickle "
                f"(trust_pickle=True) only for files you trust")
        files = list_files(root, [".pkl", ".pickle"], "pickle", follow_links)
        self.chunks = [files[i:i + chunk_files] for i in range(0, len(files), chunk_files)]
        self.keys = list(keys) if keys else None
        self.num_files = len(files)

    unit_name = "chunk"

    def units(self) -> list[list[Path]]:
        return self.chunks

    def read_unit(self, paths: list[Path]) -> list[dict[str, Any]]:
        out = []
        for path in paths:
            try:
                with open(path, "rb") as f:
                    obj = pickle.load(f)  # noqa: S301 - the user passed trust_pickle
            except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError,
                    IndexError, TypeError, ValueError) as e:
                raise SourceError(f"{path}: cannot unpickle ({type(e).__name__}: {e})") from None
            objs = obj if isinstance(obj, (list, tuple)) else [obj]
            for k, o in enumerate(objs):
                where = str(path) if len(objs) == 1 else f"{path}[{k}]"
                s = sample_from_object(o, where)
                names = check_keys(list(s), self.keys, where)
                out.append({n: s[n] for n in names})
        return out

"""ImageFolder trees: ``ROOT/CLASS/IMAGE``; encoded bytes plus a class label, no decoding."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import DatasetNotFoundError, EmptySourceError, SourceError
from ._base import Source, confine, register_source

__all__ = ["ImageFolderSource", "IMAGE_EXTENSIONS"]

#: as torchvision's ImageFolder
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@register_source
class ImageFolderSource(Source):
    """Images as stored for ``torchvision.datasets.ImageFolder``.

    Classes are the subdirectories of ``root`` in sorted order (label = position);
    each sample is ``{"image": <the file's bytes>, "label": int64}``.  The class
    names go to the manifest metadata (``ds.metadata["classes"]``).
    """

    kind = "imagefolder"
    unit_name = "chunk"

    def __init__(self, root: "str | os.PathLike[str]", *, chunk_files: int = 128,
                 follow_links: bool = False, **unused: Any) -> None:
        root = Path(root)
        if not root.is_dir():
            raise DatasetNotFoundError(f"source {root} is not a directory")
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        items = []
        for label, c in enumerate(self.classes):
            for p in sorted((root / c).rglob("*")):
                if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file():
                    items.append((p, label))
        if not items:
            raise EmptySourceError(f"source {root}: no images ({', '.join(IMAGE_EXTENSIONS)}) "
                                   f"in class subdirectories")
        confine(root, (p for p, _ in items), follow_links)
        self.chunks = [items[i:i + chunk_files] for i in range(0, len(items), chunk_files)]

    def units(self) -> list[list[tuple[Path, int]]]:
        return self.chunks

    def read_unit(self, items: list[tuple[Path, int]]) -> list[dict[str, Any]]:
        out = []
        for path, label in items:
            try:
                data = path.read_bytes()
            except OSError as e:
                raise SourceError(f"{path}: cannot read ({e})") from None
            out.append({"image": data, "label": np.int64(label)})
        return out

    def metadata(self) -> dict[str, Any]:
        return {"source_kind": self.kind, "classes": self.classes}

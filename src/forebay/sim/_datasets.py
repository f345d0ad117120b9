"""Datasets for the simulator: the scenarios of NoPFS §6.1 (sample sizes drawn from a
normal distribution with the paper's mean and deviation, deterministically), or the
real sample sizes of a packed dataset."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import ForebayError

__all__ = ["DatasetSpec", "SCENARIOS", "dataset_sizes"]

MIN_SAMPLE_MB = 0.001  # normal draws are clipped here: no empty or negative samples


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    samples: int
    mean_MB: float
    std_MB: float
    batch: int  # the per-worker batch size the paper used
    note: str


#: NoPFS §6.1's scenarios (mean and deviation of the sample size in MB, sample count)
SCENARIOS = {
    "mnist": DatasetSpec("mnist", 50_000, 0.00076, 0.0, 32,
                         "scenario 1: fits in every worker's RAM"),
    "imagenet-1k": DatasetSpec("imagenet-1k", 1_281_167, 0.1077, 0.1, 32,
                               "scenario 2: fits one worker's RAM + SSD"),
    "openimages": DatasetSpec("openimages", 1_743_042, 0.2937, 0.2, 32,
                              "scenario 2: fits one worker's RAM + SSD"),
    "imagenet-22k": DatasetSpec("imagenet-22k", 14_197_122, 0.1077, 0.2, 32,
                                "scenario 3: fits only the workers' aggregate storage"),
    "cosmoflow": DatasetSpec("cosmoflow", 262_144, 17.0, 0.0, 16,
                             "scenario 4: larger than aggregate storage"),
    "cosmoflow-512": DatasetSpec("cosmoflow-512", 10_000, 1000.0, 0.0, 1,
                                 "scenario 4: larger than aggregate storage"),
}


def dataset_sizes(spec: "str | os.PathLike[str]", *, scale: float = 1.0,
                  seed: int = 0) -> tuple[np.ndarray, Optional[DatasetSpec]]:
    """``(int64 bytes per sample, scenario or None)`` for a scenario name or a packed
    dataset directory.  ``scale`` < 1 keeps that fraction of the samples (at least 1)."""
    if not 0 < scale <= 1:
        raise ForebayError(f"scale must be in (0, 1], got {scale}")
    name = str(spec)
    if name.startswith("normal:"):
        return _normal(name, scale, seed), None
    if name in SCENARIOS:
        sc = SCENARIOS[name]
        n = max(1, int(round(sc.samples * scale)))
        rng = np.random.default_rng(seed)
        mb = np.full(n, sc.mean_MB) if sc.std_MB == 0 else rng.normal(sc.mean_MB, sc.std_MB, n)
        # clipped at 1 KB, then rescaled to the paper's mean so the dataset's total
        # matches its stated size (ImageNet-22k: 1.5 TB, not the clipped 2 TB)
        mb = np.maximum(mb, MIN_SAMPLE_MB)
        mb *= sc.mean_MB / mb.mean()
        return np.round(mb * 1e6).astype(np.int64), sc
    path = Path(name)
    if not path.exists():
        raise ForebayError(f"dataset {name!r}: neither a scenario ({', '.join(SCENARIOS)}), "
                           f"normal:MEAN_MB,SD_MB,COUNT nor a packed dataset directory")
    from ..dataset import open_dataset

    ds = open_dataset(path)
    sizes = np.asarray(ds.sample_nbytes, dtype=np.int64)
    if scale < 1:
        sizes = sizes[: max(1, int(round(len(sizes) * scale)))]
    return sizes, None


#: bytes the simulator holds per sample (sizes, draws, each epoch's order, placement)
SIM_BYTES_PER_SAMPLE = 64


def _check_memory(n: int, what: str) -> None:
    """Refuse, before drawing anything, a dataset of ``n`` samples whose simulation
    would not fit this node's available memory."""
    from .._memory import available_memory
    from .._units import human_bytes

    need = n * SIM_BYTES_PER_SAMPLE
    avail = available_memory()
    if avail is not None and need > avail:
        raise ForebayError(f"dataset {what!r}: {n:,} samples need about {human_bytes(need)} "
                           f"to simulate, more than the {human_bytes(avail)} available; "
                           f"simulate a fraction with --scale (e.g. --scale "
                           f"{max(avail / need / 2, 1e-9):.2g})")


def _normal(text: str, scale: float, seed: int) -> np.ndarray:
    """``normal:MEAN_MB,SD_MB,COUNT``: COUNT sizes from a normal distribution truncated
    at zero (non-positive draws drawn again, as the HDMLP thesis' simulator does)."""
    parts = text[len("normal:"):].split(",")
    try:
        mean, sd, count = float(parts[0]), float(parts[1]), int(parts[2])
        if len(parts) != 3:
            raise ValueError
    except (ValueError, IndexError):
        raise ForebayError(f"dataset {text!r}: expected normal:MEAN_MB,SD_MB,COUNT, e.g. "
                           f"normal:0.027,0.01,10000") from None
    if not (mean > 0 and sd >= 0 and count > 0 and np.isfinite(mean) and np.isfinite(sd)):
        raise ForebayError(f"dataset {text!r}: the mean must be positive, the deviation "
                           f"non-negative and the count a positive integer")
    n = max(1, int(round(count * scale)))
    _check_memory(n, text)
    rng = np.random.default_rng(seed)
    mb = rng.normal(mean, sd, n)
    for _ in range(1000):
        bad = mb <= 0
        if not bad.any():
            break
        mb[bad] = rng.normal(mean, sd, int(bad.sum()))
    else:
        raise ForebayError(f"dataset {text!r}: too few positive draws; is the deviation "
                           f"far larger than the mean?")
    return np.maximum(np.round(mb * 1e6), 1).astype(np.int64)

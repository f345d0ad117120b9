"""The demo's training script runs on 2 ranks and both loaders train the model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from forebay.dataset.sources import get_source, ingest
from forebay.synth import synthesize
from conftest import BIN, skip_without

pytest.importorskip("mpi4py")
skip_without("torch")
pytestmark = pytest.mark.mpi

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "loader" / "train_gnn.py"


def test_train_gnn_on_two_ranks(tmp_path):
    synthesize("ising", tmp_path / "pff", 96, seed=1)
    ingest(get_source("pickle", tmp_path / "pff", trust_pickle=True), tmp_path / "ising.fb")
    p = subprocess.run([str(BIN / "mpiexec"), "-n", "2", sys.executable, str(SCRIPT),
                        "--packed", str(tmp_path / "ising.fb"), "--pff", str(tmp_path / "pff"),
                        "--epochs", "2", "--batch-size", "8"],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = re.findall(r"^\s+(forebay DataLoader \(preload\)|torch DataLoader \(PFF pickles\))"
                      r"\s+(\d)\s+[\d.]+\s+([\d,]+)\s+[\d.]+ s\s+\d+%\s+([\d.]+)$",
                      p.stdout, re.M)
    assert len(rows) == 4, p.stdout
    import math

    assert all(math.isfinite(float(loss)) and float(rate.replace(",", "")) > 0
               for _, _, rate, loss in rows)
    assert "forebay / torch DataLoader:" in p.stdout

"""MPI from the PyPI wheels works under real mpiexec, and every rank reads the same bytes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import BIN

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.mpi

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from mpi4py import MPI
    import forebay
    comm = MPI.COMM_WORLD
    ds = forebay.open_dataset(sys.argv[1])
    mine = np.arange(comm.rank, len(ds), comm.size)
    digest = sum(int(ds.get_many(mine).field("x").values.view(np.uint8).sum()) for _ in [0])
    fps = comm.allgather(ds.fingerprint)
    total = comm.allreduce(digest)
    if comm.rank == 0:
        print("fingerprints", len(set(fps)), "size", comm.size, "total", total)
""")


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_share_a_dataset(tmp_path, packed, ranks):
    path, samples = packed
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    p = subprocess.run([str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, str(script),
                        str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    import numpy as np
    want = sum(int(np.asarray(s["x"]).view(np.uint8).sum()) for s in samples)
    assert f"fingerprints 1 size {ranks} total {want}" in p.stdout

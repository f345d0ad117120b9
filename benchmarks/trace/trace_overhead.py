"""Tracing overhead, side by side: the same training run with forebay.trace switched on
and off epoch by epoch (ABBA order), so machine noise hits both alike.

One loader and one model for the whole run: epoch 0 warms up (the clairvoyant fill, page
cache) and is not counted; then each pair of epochs is one traced and one untraced, the
order flipped every pair.  Two loops: the GraphNet training step of train_gnn.py (the
real case) and the bare loader with no model (the worst case: recording cost against the
fastest possible epoch).  Epoch times exclude writing the trace file (done between
epochs, timed and reported apart).

    mpiexec -n 2 python benchmarks/trace/trace_overhead.py --packed .demo/ising.fb --pairs 4
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "loader"))  # train_gnn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--packed", type=Path, required=True)
    p.add_argument("--mode", default="clairvoyant", choices=["preload", "clairvoyant"])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--pairs", type=int, default=4, help="traced/untraced epoch pairs")
    p.add_argument("--loops", default="train,bare")
    a = p.parse_args()

    import torch
    from mpi4py import MPI
    from torch import nn

    import forebay.trace as trace
    from forebay.torch import DataLoader
    from train_gnn import GraphNet

    comm = MPI.COMM_WORLD
    rank, world = comm.rank, comm.size
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="fb-trace-")) if rank == 0 else None
    tmp = Path(comm.bcast(str(tmp) if tmp else None))

    def run(loop: str) -> tuple[list, list, list, int]:
        torch.manual_seed(0)
        model = GraphNet(in_dim=1)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        epochs = 1 + 2 * a.pairs
        dl = DataLoader(a.packed, a.batch_size, comm=comm, epochs=epochs, progress=False,
                        store=a.mode)
        on, off, writes, events = [], [], [], 0
        for e in range(epochs):
            k = e - 1
            traced = e > 0 and (k % 2 == 0) == ((k // 2) % 2 == 0)  # ABBA
            if traced:
                trace.enable(tmp / f"{loop}-{e}")
            dl.set_epoch(e)
            comm.Barrier()
            t0 = time.perf_counter()
            for b in dl:
                if loop == "bare":
                    continue
                with trace.region("compute"):
                    g = int(b["y"].shape[0])
                    pred = model(b["x"].float(), b["pos"].float(), b["edge_index"],
                                 b["edge_attr"].float(), b["batch"], g)
                    loss = nn.functional.mse_loss(pred, b["y"][:, 0].float() / 100)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if traced:
                w0 = time.perf_counter()
                events = comm.allreduce(trace.active().num_events)
                trace.disable()
                writes.append(comm.allreduce(time.perf_counter() - w0, op=MPI.MAX))
            if e > 0:
                (on if traced else off).append(dt)
        dl.close()
        return on, off, writes, events

    results = {loop: run(loop) for loop in a.loops.split(",")}
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"tracing overhead: {world} ranks, {a.mode} loader, per-rank batch "
              f"{a.batch_size}, {a.pairs} traced/untraced epoch pairs (ABBA) after a "
              f"warm-up epoch, {a.packed.name}")
        print(f"  {'loop':<6} {'epoch off (s)':>14} {'epoch on (s)':>13} {'overhead':>9} "
              f"{'events/epoch':>13} {'write (s)':>10}   on/off per pair")
        for loop, (on, off, w, n) in results.items():
            on, off = np.array(on), np.array(off)
            ratios = " ".join(f"{r:.3f}" for r in on / off)
            print(f"  {loop:<6} {np.median(off):>14.3f} {np.median(on):>13.3f} "
                  f"{np.median(on / off) - 1:>+9.1%} {n:>13,} {np.median(w):>10.3f}   "
                  f"{ratios}")
        print("  (overhead = median over pairs of on/off - 1; epoch times are medians, the "
              "slowest rank's)")


if __name__ == "__main__":
    main()

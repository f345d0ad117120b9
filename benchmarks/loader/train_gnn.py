"""Train a small graph network for a few epochs on MPI ranks with the forebay loader, then
with the torch DataLoader over PFF pickles, and print both throughputs.

Plain torch (no torch_geometric): message passing with index_add, DistributedDataParallel
on the gloo backend for gradients, MPI (mpi4py) for the data plane.

    mpiexec -n 2 python benchmarks/loader/train_gnn.py --packed .demo/ising.fb --pff .demo/ising-pff
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import forebay
import forebay.trace as trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _baselines import list_collate, pff_dataset  # noqa: E402


class GraphNet(nn.Module):
    """Node embedding, three message-passing layers (edge-weighted sums), mean pooling."""

    def __init__(self, in_dim: int, hidden: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim + 3, hidden)
        self.edge = nn.ModuleList(nn.Linear(1, hidden) for _ in range(layers))
        self.update = nn.ModuleList(nn.Linear(2 * hidden, hidden) for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x, pos, edge_index, edge_attr, batch, num_graphs):
        h = torch.relu(self.embed(torch.cat([x, pos], dim=1)))
        src, dst = edge_index
        for edge, update in zip(self.edge, self.update):
            msg = h[src] * torch.sigmoid(edge(edge_attr))
            agg = torch.zeros_like(h).index_add_(0, dst, msg)
            h = torch.relu(update(torch.cat([h, agg], dim=1)))
        pooled = torch.zeros(num_graphs, h.shape[1]).index_add_(0, batch, h)
        counts = torch.bincount(batch, minlength=num_graphs).clamp(min=1).unsqueeze(1)
        return self.head(pooled / counts).squeeze(1)


def train(model, opt, batches, y_scale: float, stall_clock=None
          ) -> tuple[int, float, float, float]:
    """One epoch; returns (graphs, seconds, seconds stalled waiting for data, mean loss).

    The stall is what `forebay analyze` calls the data stall (`fetch.iter`): each wait
    for a batch, from asking to having it, the first including the epoch's set-up; the
    last call, which only learns that the epoch is over, is not a step.  A forebay
    loader times its own waits (``stall_clock``, its cumulative ``stall_seconds``: the
    figure its trace holds); the loop's own clock around ``next()`` would add the
    moments the prefetch thread holds the GIL after the batch is ready (~0.5 ms a step
    here), which land in the epoch's time instead."""
    s0 = stall_clock() if stall_clock is not None else 0.0
    n, losses, stall = 0, [], 0.0
    t0 = time.perf_counter()
    it = iter(batches)
    while True:
        w = time.perf_counter()
        b = next(it, None)
        if b is None:
            break
        stall += time.perf_counter() - w
        g = int(b["y"].shape[0])
        with trace.region("compute"):  # recorded when tracing is on, free otherwise
            pred = model(b["x"].float(), b["pos"].float(), b["edge_index"],
                         b["edge_attr"].float(), b["batch"], g)
            loss = nn.functional.mse_loss(pred, b["y"][:, 0].float() / y_scale)
            opt.zero_grad()
            loss.backward()
            opt.step()
        n += g
        losses.append(loss.item())
    if stall_clock is not None:
        stall = stall_clock() - s0
    return n, time.perf_counter() - t0, stall, float(np.mean(losses))


def save_and_reload(url: str, model: nn.Module, per_epoch: list) -> None:
    """Store the trained model as a new version, then load only its head into a fresh
    model (a partial load: only those tensors are read)."""
    import forebay.models as fm

    with fm.open_repository(url) as repo, trace.region("checkpoint/capture"):
        v = repo.save("graphnet", model, metadata={"epochs": len(per_epoch),
                                                   "loss": per_epoch[-1][3]})
        fresh = GraphNet(in_dim=1)
        before = repo.stats()["bytes_read"]
        repo.load("graphnet", v, into=fresh, include="head.*")
        read = repo.stats()["bytes_read"] - before
        ok = all(torch.equal(a, b) for a, b in zip(fresh.head.parameters(),
                                                   model.head.parameters()))
        st = repo.stats()
        print(f"saved graphnet version {v} to {url} ({st['stored_bytes']:,} B stored for "
              f"{st['logical_bytes']:,} B of versions); reloaded head.* alone: {read:,} of "
              f"{repo.manifest('graphnet', v)['logical_bytes']:,} B read, "
              f"{'identical' if ok else 'DIFFERENT'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--packed", type=Path, required=True)
    p.add_argument("--pff", type=Path, help="PFF pickles of the same data, for the baseline")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--prefetch", type=int, default=None,
                   help="forebay loader's batches fetched ahead (0: in the loop; default: "
                        "the loader's)")
    p.add_argument("--trace", type=Path, help="trace the forebay run into this directory "
                   "(then: forebay analyze DIR)")
    p.add_argument("--reduce", choices=["ddp", "bitvector", "master"], default="ddp",
                   help="gradient averaging of the forebay run: torch DDP, or "
                   "forebay.reduce.DistributedOptimizer with that coordination")
    p.add_argument("--mode", choices=["preload", "clairvoyant"], default="preload",
                   help="forebay loader mode (clairvoyant: a RAM tier of --ram-share of the "
                   "dataset per rank, filled in the background)")
    p.add_argument("--ram-share", type=float, default=0.6,
                   help="clairvoyant: each rank's RAM tier as a share of the dataset")
    p.add_argument("--slow-fs", metavar="MBPS,MS",
                   help="emulate a slow shared file system for both loaders: every read of "
                        "the dataset's files (forebay's store, the baseline's pickles) "
                        "waits MS per request plus its bytes at MBPS")
    p.add_argument("--json", type=Path, help="write the measured epochs (for the simulator "
                   "comparison: benchmarks/sim/sim_validate.py)")
    p.add_argument("--repo", help="save the forebay-trained model into this model repository "
                   "(e.g. file:///tmp/models) and reload its head alone")
    a = p.parse_args()

    from mpi4py import MPI

    from forebay.torch import DataLoader, Pipeline, store_settings

    comm = MPI.COMM_WORLD
    rank, world = comm.rank, comm.size
    torch.set_num_threads(a.threads)
    from forebay.reduce import init_process_group
    init_process_group("gloo")          # rank 0 picks a port, mpi4py tells the others

    def fresh_model(reduce="ddp"):
        torch.manual_seed(0)
        if reduce == "ddp":
            m = nn.parallel.DistributedDataParallel(GraphNet(in_dim=1))
            return m, torch.optim.Adam(m.parameters(), lr=1e-3)
        import forebay.reduce as fr
        m = GraphNet(in_dim=1)
        fr.broadcast_parameters(m.state_dict(), root_rank=0)
        return m, fr.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=1e-3),
                                          m.named_parameters(), coordination=reduce)

    results = {}

    def epoch_row(n: int, dt: float, stall: float, loss: float) -> tuple:
        """Graphs over all ranks, the slowest rank's time, the data stall as `forebay
        analyze` reports it (the mean over ranks), the mean loss."""
        return (comm.allreduce(n), comm.allreduce(dt, op=MPI.MAX),
                comm.allreduce(stall) / world, comm.allreduce(loss) / world)

    if a.trace:
        trace.enable(a.trace)
    setup = trace.region("setup", cat="setup")     # store, model: marked on the timeline
    setup.__enter__()
    ram = None
    if a.mode == "clairvoyant":
        from forebay.store import tier_nbytes

        ram = int(tier_nbytes(forebay.open_dataset(a.packed)).sum() * a.ram_share)
    extra: dict = {}
    slow = None
    if a.slow_fs:
        mbps, ms = (float(v) for v in a.slow_fs.split(","))

        def slow(nbytes: int, requests: int, seconds: float = 0.0) -> None:
            """The emulated file system's time for what was read, beyond what it took."""
            time.sleep(max(0.0, requests * ms / 1e3 + nbytes / (mbps * 1e6) - seconds))
        extra["on_pfs_read"] = slow
    loader = DataLoader(a.packed, a.batch_size, comm=comm, seed=0, epochs=a.epochs,
                        progress=False, store=store_settings(a.mode, ram_bytes=ram, **extra),
                        pipeline=Pipeline(prefetch=a.prefetch))
    y_scale = 100.0
    model, opt = fresh_model(a.reduce)
    setup.__exit__(None, None, None)
    per_epoch = []
    for epoch in range(a.epochs):
        loader.set_epoch(epoch)
        n, dt, stall, loss = train(model, opt, loader, y_scale,
                                   stall_clock=lambda: loader.stats()["stall_seconds"])
        per_epoch.append(epoch_row(n, dt, stall, loss))
    fb_stats = loader.stats()
    loader.close()
    if a.reduce != "ddp":
        st = opt.stats()
        opt.close()
        if rank == 0:
            ps = st["per_step"]
            print(f"gradients averaged by forebay.reduce ({a.reduce}): {st['steps']} steps, "
                  f"per step {ps['cycles']:.1f} cycles, {ps['control_bytes_sent']:.0f} B of "
                  f"control traffic sent by rank 0, {ps['data_collectives']:.1f} fused "
                  f"all-reduces of {ps['data_bytes'] / max(ps['data_collectives'], 1):,.0f} B")
    if a.repo and rank == 0:
        save_and_reload(a.repo, getattr(model, "module", model), per_epoch)
    if a.trace:
        trace.disable()
    forebay_name = f"forebay DataLoader ({a.mode})"
    results[forebay_name] = per_epoch

    if a.pff is not None:
        ds, files = pff_dataset(a.pff)
        if slow is not None:
            plain = ds.__class__.__getitem__

            def slowed(self, i):               # one file, one request
                out = plain(self, i)
                slow(files[i].stat().st_size, 1)
                return out
            ds.__class__.__getitem__ = slowed
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank, seed=0)
        tl = torch.utils.data.DataLoader(ds, batch_size=a.batch_size, sampler=sampler,
                                         collate_fn=list_collate)
        model, opt = fresh_model(a.reduce)   # the same gradient averaging for both loaders
        per_epoch = []
        for epoch in range(a.epochs):
            sampler.set_epoch(epoch)

            def batches():
                for b in tl:
                    b["num_graphs"] = int(b["y"].shape[0])
                    yield b
            n, dt, stall, loss = train(model, opt, batches(), y_scale)
            per_epoch.append(epoch_row(n, dt, stall, loss))
        if a.reduce != "ddp":
            opt.close()
        results["torch DataLoader (PFF pickles)"] = per_epoch

    if rank == 0:
        print(f"GraphNet on {a.packed.name}: {world} ranks, per-rank batch {a.batch_size}, "
              f"{a.epochs} epochs")
        n_ds = len(forebay.open_dataset(a.packed))
        print(f"  {'loader':<32} {'epoch':>5} {'seconds':>8} {'graphs/s':>9} "
              f"{'data stall':>11} {'loss':>8}")
        for name, rows in results.items():
            for e, (_n, dt, stall, loss) in enumerate(rows):
                print(f"  {name:<32} {e:>5} {dt:>8.2f} {n_ds / dt:>9,.0f} "
                      f"{stall:>6.3f} s {stall / dt:>3.0%} {loss:>8.4f}")
        print(f"  graphs/s: the dataset's {n_ds:,} graphs per epoch over the slowest rank's "
              f"epoch time (forebay pads its last step with repeats, counted as time, not "
              f"as graphs); data stall: waits for a batch, mean over ranks, as `forebay "
              f"analyze` reports them")
        if len(results) == 2:
            f, b = (sum(r[1] for r in rows) for rows in results.values())
            gf, gb = (sum(r[0] for r in rows) for rows in results.values())
            print(f"  forebay / torch DataLoader: {b / f:.2f}x the speed over the run (the "
                  f"stall is what a loader can remove; the rest is the model's compute on "
                  f"this CPU, {gf / gb - 1:+.1%} for forebay's padded last steps: "
                  f"{gf:,} graphs computed against {gb:,})")
            if a.slow_fs:
                print(f"  the regime forebay is for: every read of the files costs what a "
                      f"busy shared file system charges (emulated: {a.slow_fs.split(',')[1]} "
                      f"ms a request, {a.slow_fs.split(',')[0]} MB/s); torch's loader pays "
                      f"it every epoch, forebay's clairvoyant tiers after the first only for "
                      f"what they do not hold (torch's worker processes, num_workers, would "
                      f"overlap its waits, not remove them)")
            else:
                print("  the regime here is the one forebay is not for: 2,000 small graphs "
                      "on a local disk, in the page cache after the first read, so torch's "
                      "loader waits little; forebay's gains come where samples come from a "
                      "slow shared file system every epoch (the next step, and "
                      "benchmarks/RESULTS.md: the emulated cluster with a throttled shared "
                      "file system)")
    if rank == 0 and a.json:
        import json

        a.json.write_text(json.dumps({
            "ranks": world, "batch_size": a.batch_size, "epochs": a.epochs, "mode": a.mode,
            "ram_bytes": ram, "packed": str(a.packed), "pff": str(a.pff) if a.pff else None,
            "pfs_reads": fb_stats.get("pfs_reads"),
            "runs": {name: [{"graphs": n, "seconds": dt, "stall_s": st, "loss": lo}
                            for n, dt, st, lo in rows] for name, rows in results.items()},
            "forebay": forebay_name}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

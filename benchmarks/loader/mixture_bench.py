"""Loader epochs over a 3-source mixture (issue S item 4): ``forebay.Mixture`` against
the mixing a user of the peers would write instead.

Three sources of ~110 KB image blobs (``forebay synth imagenet``, different seeds and
sizes), weights 0.5 / 0.3 / 0.2, an epoch of as many samples as the three hold. Each
contender is a fresh ``torchrun --standalone --nproc-per-node R`` job, contenders in
rotating order, repeated; the contender's files are evicted from the page cache before
its job (epoch 1 is cold), later epochs are warm:

* ``forebay preload`` / ``direct`` / ``clairvoyant``: ``DataLoader(Mixture({...}))``
  (policy "cycle": exact shares per epoch) with that store;
* ``mosaicml-streaming``: ``StreamingDataset(streams=[Stream(local=, proportion=)],
  epoch_size=)`` over each source's MDS shards + torch ``DataLoader(num_workers=2)``;
* ``litdata``: ``CombinedStreamingDataset([StreamingDataset(...)], weights=,
  iterate_over_all=False)`` over each source's ``litdata.optimize`` chunks +
  ``StreamingDataLoader(num_workers=2)`` (it draws each sample's source by weight and
  stops at the first exhausted source: its epochs are shorter, samples/s compares);
* ``torch 0 workers`` / ``torch 2 workers``: ``ConcatDataset`` of the three ImageFolder
  trees + ``WeightedRandomSampler`` (per-sample weights w_i / n_i, each rank its own
  draws of its share: the usual hand-written mixing; with replacement) + ``DataLoader``.

``--touch``: the loop reads every byte of every image (xxh3), as a decoder would.
Reported: samples/s in epoch 1 with set-up and warm (median), each as a ratio to the
best peer of the same round, min and median over rounds. Samples delivered are
counted (a mixture repeats samples by design), up to an epoch's worth (forebay's padding
of the last global batch is not). The peers are not forebay's
dependencies: install them as peers_bench.py's docstring says, then::

    PYTHONPATH=/tmp/peerlib python benchmarks/loader/mixture_bench.py --out /tmp/mix-run \\
        --reps 3 --touch
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _common import evict, files_under, machine  # noqa: E402
from _baselines import image_collate, image_folder_dataset  # noqa: E402
from peers_bench import _free_port, _streaming, write_litdata, write_mds  # noqa: E402

BIN = Path(sys.executable).parent
FOREBAY = ("forebay preload", "forebay direct", "forebay clairvoyant")
PEERS = ("torch 0 workers", "torch 2 workers", "mosaicml-streaming", "litdata")
WEIGHTS = (0.5, 0.3, 0.2)


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    bs, c = a.batch_size, a.contender
    srcs = a.sources.split(",")
    total = a.epoch_samples
    t0 = time.perf_counter()
    set_epoch = None
    if c.startswith("forebay"):
        from forebay import Mixture
        from forebay.torch import DataLoader

        mix = Mixture({f"{s}.fb": w for s, w in zip(srcs, WEIGHTS)})
        loader = DataLoader(mix, bs, seed=0, epochs=a.epochs, progress=False,
                            store=c.split()[1])
        set_epoch = loader.set_epoch
    elif c == "mosaicml-streaming":
        sb = _streaming()
        streams = [sb.Stream(local=f"{s}-mds", proportion=w) for s, w in zip(srcs, WEIGHTS)]
        ds = sb.StreamingDataset(streams=streams, epoch_size=total, shuffle=True,
                                 shuffle_seed=0, batch_size=bs)
        loader = torch.utils.data.DataLoader(ds, batch_size=bs, num_workers=2,
                                             persistent_workers=True, prefetch_factor=4,
                                             collate_fn=image_collate)
    elif c == "litdata":
        import litdata

        parts = [litdata.StreamingDataset(f"{s}-litdata", shuffle=True, seed=0) for s in srcs]
        ds = litdata.CombinedStreamingDataset(parts, seed=0, weights=list(WEIGHTS),
                                              iterate_over_all=False)
        loader = litdata.StreamingDataLoader(ds, batch_size=bs, num_workers=2,
                                             collate_fn=image_collate)
    elif c.startswith("torch"):
        parts = [image_folder_dataset(Path(f"{s}-pff"))[0] for s in srcs]
        ds = torch.utils.data.ConcatDataset(parts)
        weights = torch.cat([torch.full((len(p),), w / len(p), dtype=torch.float64)
                             for p, w in zip(parts, WEIGHTS)])
        gen = torch.Generator()
        sampler = torch.utils.data.WeightedRandomSampler(weights, total // world,
                                                         replacement=True, generator=gen)

        def set_epoch(e: int) -> None:      # each rank its own draws, new every epoch
            gen.manual_seed(1000 * e + rank)

        nw = int(c.split()[1])
        loader = torch.utils.data.DataLoader(ds, batch_size=bs, sampler=sampler,
                                             num_workers=nw, persistent_workers=nw > 0,
                                             prefetch_factor=4 if nw else None,
                                             collate_fn=image_collate)
    else:
        raise SystemExit(f"unknown contender {c!r}")
    setup = time.perf_counter() - t0

    def slowest(dt: float) -> float:
        t = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    setup = slowest(setup)
    times, counts = [], []
    for e in range(a.epochs):
        if set_epoch is not None:
            set_epoch(e)
        dist.barrier()
        t0 = time.perf_counter()
        n = 0
        for batch in loader:
            n += len(batch["label"])
            if a.touch:
                for x in batch["image"]:
                    xxhash.xxh3_64_intdigest(x.numpy() if isinstance(x, torch.Tensor) else x)
        times.append(slowest(time.perf_counter() - t0))
        got = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(got)
        counts.append(int(got))
    if rank == 0:
        print("RESULT " + json.dumps({"epoch_s": times, "setup_s": setup,
                                      "samples": counts}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def prepare(a) -> list[str]:
    """The three sources in every contender's format; their stems."""
    from forebay.dataset.sources import get_source, ingest
    from forebay.synth import synthesize

    stems = []
    for i, n in enumerate(a.sizes):
        stem = str(a.out / f"src{i}-{n}")
        if not Path(f"{stem}-pff").exists():
            synthesize("imagenet", Path(f"{stem}-pff"), n, i, progress=True)
        if not Path(f"{stem}.fb").exists():
            ingest(get_source("imagefolder", Path(f"{stem}-pff")), Path(f"{stem}.fb"))
        if not Path(f"{stem}-mds").exists():
            write_mds("imagenet", Path(f"{stem}-pff"), Path(f"{stem}-mds"))
        if not Path(f"{stem}-litdata").exists():
            write_litdata("imagenet", Path(f"{stem}-pff"), Path(f"{stem}-litdata"))
        stems.append(stem)
    return stems


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/forebay-mixture"))
    p.add_argument("--sizes", default="3000,1500,500",
                   help="samples of each of the three sources")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3, help="the first is cold")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--touch", action="store_true",
                   help="the loop reads every byte of every image once (xxh3)")
    p.add_argument("--contenders", help="comma-separated (default: all)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", help=argparse.SUPPRESS)
    p.add_argument("--sources", help=argparse.SUPPRESS)
    p.add_argument("--epoch-samples", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    a.sizes = [int(x) for x in a.sizes.split(",")]
    if len(a.sizes) != 3:
        raise SystemExit("--sizes: three numbers")
    a.out.mkdir(parents=True, exist_ok=True)
    stems = prepare(a)
    contenders = [c for c in a.contenders.split(",") if c] if a.contenders else \
        list(FOREBAY + PEERS)
    suffix = {"forebay": ".fb", "mosaicml-streaming": "-mds", "litdata": "-litdata",
              "torch": "-pff"}
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    runs: dict[str, list[dict]] = {}
    for rep in range(a.reps):
        k = rep % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            evict([f for s in stems for f in files_under(Path(s + suffix[c.split()[0]]))])
            env["MASTER_PORT"] = str(_free_port())
            cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(a.ranks),
                   __file__, "--worker", "--contender", c, "--sources", ",".join(stems),
                   "--epoch-samples", str(sum(a.sizes)), "--batch-size", str(a.batch_size),
                   "--epochs", str(a.epochs)] + (["--touch"] if a.touch else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
            if proc.returncode != 0:
                sys.exit(f"{c} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            r = json.loads(next(line for line in proc.stdout.splitlines()
                                if line.startswith("RESULT "))[7:])
            # forebay's plan completes the last global batch with repeats: not counted
            n = r["samples"] = [min(m, sum(a.sizes)) for m in r["samples"]]
            r["cold"] = n[0] / (r["setup_s"] + r["epoch_s"][0])
            r["warm"] = float(np.median([m / t for m, t in zip(n[1:], r["epoch_s"][1:])]))
            r["rep"] = rep
            runs.setdefault(c, []).append(r)
            print(f"rep {rep} {c:<20} set-up {r['setup_s']:6.2f} s, epochs "
                  f"{', '.join(f'{t:.2f}' for t in r['epoch_s'])} s ({n} samples)", flush=True)
    report(a, contenders, runs)


def report(a, contenders, runs) -> None:
    print(f"\nmachine: {machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"3 sources of {a.sizes} ~110 KB images, weights {WEIGHTS}, {a.ranks} ranks "
          f"under torchrun, per-rank batch {a.batch_size}, {a.epochs} epochs (the first "
          f"cold){', every image byte read (--touch)' if a.touch else ''}, {a.reps} rounds")
    peers = [c for c in contenders if c in PEERS] or contenders
    print("\n| contender | epoch 1 samples/s (set-up counted), median | vs best peer, min / "
          "median | warm samples/s, median | vs best peer, min / median | samples per "
          "epoch | set-up s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for c in contenders:
        row = []
        for what in ("cold", "warm"):
            ratios = [r[what] / max(x[what] for p_ in peers for x in runs[p_]
                                    if x["rep"] == r["rep"]) for r in runs[c]]
            row.append(f"{statistics.median(x[what] for x in runs[c]):,.0f} | "
                       f"{min(ratios):.2f} / {statistics.median(ratios):.2f}")
        setup = statistics.median(x["setup_s"] for x in runs[c])
        print(f"| {c} | {' | '.join(row)} | {runs[c][0]['samples'][0]} | {setup:.2f} |")


if __name__ == "__main__":
    main()

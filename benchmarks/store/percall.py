"""Where a one-sample ``get_many`` of the packed store spends its time (issue O, item 1).

One process (no launcher: a one-rank store, its chunk local), no I/O: every record is
in memory.  Times, with ``timeit`` (best of ``--repeat`` runs of ``--number`` calls
each, microseconds per call), the whole call beside the public steps it is made of,
and the array store's ``get`` (the few-microsecond path) for scale:

* ``store.get_many([i])``: the whole call (``DistributedStore``, the transport ``auto``
  picks for one rank: ``pages`` on a local file system);
* ``ds.normalize_ids``: the ids checked and copied (the batch owns them);
* ``ds.rows``: the samples' index rows;
* ``assemble_batch``: the batch from one part (layout, allocation and copy in one C
  call, then one ``FieldBatch`` per field and the ``SampleBatch``);
* ``store[i]``: the one-sample read without a batch (a dict of arrays over one copy
  of the record), through ``pages`` and ``shm``; ``ds.sample(i, copy=True)``: the same
  from the dataset's own maps;
* ``arrays.get``: ``DistributedStore.from_arrays``'s one-row read, same bytes.

What the whole call spends beyond these steps is the store's own bookkeeping (which
member holds the sample, fetch counters, the parts list) and Python calls between them.
``--fields 5`` reads a five-field sample (an Ising graph's shape) instead of one 500 B
row.  The machine is shared: compare rows of one run, not runs.

    python benchmarks/store/percall.py [--fields 1|5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fields", type=int, default=1, choices=(1, 5))
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--number", type=int, default=100000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()

    import forebay
    from forebay.dataset import assemble_batch
    from forebay.store import DistributedStore

    rng = np.random.default_rng(0)
    rows = rng.integers(0, 255, size=(args.samples, 500), dtype=np.uint8)

    def sample(i: int) -> dict:
        if args.fields == 1:
            return {"row": rows[i]}
        return {"x": rows[i, :100].view(np.float32), "pos": rows[i, 100:196].view(np.float32),
                "edges": rows[i, 200:456].view(np.int64), "y": rows[i, 456:460].view(np.float32),
                "k": np.int64(i)}

    with tempfile.TemporaryDirectory() as tmp:
        forebay.write_dataset(Path(tmp) / "d", (sample(i) for i in range(args.samples)))
        ds = forebay.open_dataset(Path(tmp) / "d")
        store = DistributedStore(ds, None, progress=False)
        shm = DistributedStore(ds, None, transport="shm", progress=False)
        arrays = DistributedStore.from_arrays({"row": rows}, None)
        ids = np.array([args.samples // 3])
        r = ds.rows(ids)
        parts = [(ds.shard_buffer(0), r[:, 0], slice(None))]
        assert len(ds.manifest.shards) == 1
        assert assemble_batch(ids, r, ds.schema, ds.layout, parts).equals(ds.get_many(ids))
        assert store.get_many(ids).equals(ds.get_many(ids))
        i = int(ids[0])
        for got in (store[i], shm[i], ds.sample(i, copy=True)):
            assert all(np.array_equal(got[k], v) and got[k].dtype == v.dtype
                       for k, v in ds[i].items())
        steps = {
            "store.get_many([i])": lambda: store.get_many(ids),
            "ds.normalize_ids": lambda: ds.normalize_ids(ids),
            "ds.rows": lambda: ds.rows(ids),
            "assemble_batch": lambda: assemble_batch(ids, r, ds.schema, ds.layout, parts),
            "store[i]": lambda: store[i],
            "store[i], shm": lambda: shm[i],
            "ds.sample(i, copy=True)": lambda: ds.sample(i, copy=True),
            "arrays.get": lambda: arrays.get("row", i),
        }
        print(f"# percall: one-sample get_many, {args.fields} field(s), transport "
              f"{store.transport}; best of {args.repeat} x {args.number} calls; "
              f"{machine()}")
        for name, fn in steps.items():
            best = min(timeit.repeat(fn, number=args.number, repeat=args.repeat))
            print(f"{name:24s} {best / args.number * 1e6:7.2f} us")
        store.close()
        shm.close()
        arrays.close()


if __name__ == "__main__":
    main()

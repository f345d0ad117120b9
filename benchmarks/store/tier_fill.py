"""How fast one process fills a clairvoyant copying RAM tier (issue O, item 2).

A one-rank ``ClairvoyantStore(ram_tier="copy")`` whose tier holds the whole dataset,
filled in the calling thread (``fill_now``) from files already in the page cache
(``warm``, read once first) or evicted (``cold``, as root: drop_caches).  Reports the
seconds, the bytes per second, and this process's minor page faults, user and system
CPU seconds over the fill (getrusage): the copy's cost beside the faults of reaching
the files' pages.  One fill per run: run it several times, interleaved with the code
it is compared with, and read ratios.

    python benchmarks/store/tier_fill.py /tmp/peers-run/imagenet-10240.fb [--cold]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import drop_all_caches, files_under, machine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dataset", type=Path)
    ap.add_argument("--cold", action="store_true", help="evict every cached page first")
    args = ap.parse_args()

    import forebay
    from forebay.plan import AccessPlan
    from forebay.store import ClairvoyantStore
    from forebay.world import LOCAL

    ds = forebay.open_dataset(args.dataset)
    if args.cold:
        if not drop_all_caches():
            raise SystemExit("--cold needs root (echo 3 > /proc/sys/vm/drop_caches)")
    else:
        for p in files_under(args.dataset):
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass
    plan = AccessPlan(len(ds), 1, 64, 1, 0)
    st = ClairvoyantStore(ds, plan, LOCAL, ram_bytes=int(ds.nbytes) + (64 << 20),
                          ram_tier="copy", fill=False, warm_files=False)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    n = st.fill_now()
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    st.close()
    print(f"# tier_fill: {'cold' if args.cold else 'warm'}, {n} samples, "
          f"{ds.nbytes / 2**30:.2f} GiB; {machine()}")
    print(f"fill {dt:.3f} s  {ds.nbytes / dt / 1e9:.2f} GB/s  minor faults "
          f"{r1.ru_minflt - r0.ru_minflt}  user {r1.ru_utime - r0.ru_utime:.2f} s  system "
          f"{r1.ru_stime - r0.ru_stime:.2f} s")


if __name__ == "__main__":
    main()

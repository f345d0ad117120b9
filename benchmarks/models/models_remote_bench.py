"""Model providers over TCP on one machine (loopback), after DStore Sec. 6:

1. the loopback limit: raw TCP throughput between two processes on 127.0.0.1;
2. one client against a provider serving from memory and from LMDB: store, full load
   (new tensors and in place) and a 25% partial load of a 100-layer model;
3. 1, 4 and 16 concurrent client processes loading the model whole, against 1 and 2
   providers (two model names placed on different providers by rendezvous hashing);
4. DStore's setting: the file-based contenders read through issue B's emulated
   parallel file system (Lassen: 330 MB/s for one reader, an open latency per file)
   against a provider serving from memory.

    python benchmarks/models/models_remote_bench.py [--mib 1024] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common, _baselines
from _baselines import EmulatedPFS  # noqa: E402
from _common import evict, machine  # noqa: E402
from models_bench import H5, Safetensors, TorchSave, make, subset, uniform  # noqa: E402

import forebay.models as fm  # noqa: E402

MB = 1 << 20
TOKEN = "bench-token"


def loopback(nbytes: int = 2 << 30) -> float:
    """Bytes/s of one TCP stream over 127.0.0.1, sender and receiver in two processes."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    proc = mp.get_context("spawn").Process(target=_sender, args=(port, nbytes))
    proc.start()
    conn, _ = srv.accept()
    buf = memoryview(bytearray(8 << 20))
    t0 = time.perf_counter()
    got = 0
    while got < nbytes:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    dt = time.perf_counter() - t0
    conn.close()
    srv.close()
    proc.join()
    return got / dt


def _sender(port: int, nbytes: int) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    chunk = memoryview(bytes(8 << 20))
    sent = 0
    while sent < nbytes:
        s.sendall(chunk)
        sent += len(chunk)
    s.close()


def start_provider(store: str, tok: Path) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "forebay.cli", "models", "serve", "--listen",
                          "127.0.0.1:0", "--store", store, "--token-file", str(tok),
                          "--workers", "32"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    if not line.startswith("serving"):
        raise RuntimeError(f"provider did not start: {line!r}")
    return p, line.split()[-1]


def _client(url: str, name: str, reps: int, q, go) -> None:
    torch.set_num_threads(1)
    r = fm.open_repository(url, token=TOKEN)
    m = r.manifest(name)
    dst = {k: torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
           for k, e in m["tensors"].items()}
    r.load(name, into=dst)  # warm-up: connection, first touch of dst
    q.put(("ready", 0.0))
    go.wait()  # every client starts together
    t0 = time.perf_counter()
    for _ in range(reps):
        r.load(name, into=dst)
    q.put(("done", time.perf_counter() - t0))
    r.close()


def concurrent_loads(urls: list[str], names: list[str], clients: int, reps: int,
                     nbytes: int) -> float:
    """Aggregate bytes/s of ``clients`` processes each loading its model ``reps`` times."""
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_client, args=(urls[k % len(urls)], names[k % len(names)],
                                               reps, q, go)) for k in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:
        assert q.get(timeout=600)[0] == "ready"
    go.set()
    t0 = time.perf_counter()
    times = [q.get(timeout=1200)[1] for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    del times
    return clients * reps * nbytes / wall


def best(f, reps: int) -> float:
    b = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        b = min(b, time.perf_counter() - t0)
    return b


def one_client(r, sd: dict, keys: list) -> tuple[float, float, float, float]:
    """Seconds to store; to load whole into new tensors, whole in place, 25% in place."""
    t_store = best(lambda: r.save("m", sd), 1)
    dst = {k: torch.empty_like(t) for k, t in sd.items()}
    part = {k: dst[k] for k in keys}
    r.load("m", into=dst)  # connection and first touch of dst, untimed
    out = (t_store, best(lambda: r.load("m"), 2), best(lambda: r.load("m", into=dst), 3),
           best(lambda: r.load("m", include=keys, into=part), 3))
    r.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=1024, help="model size (100 layers)")
    p.add_argument("--concurrent-mib", type=int, default=256,
                   help="model size for the concurrent-client runs")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--open-latency-ms", type=float, default=0.5)
    p.add_argument("--prefault-gib", type=int, default=14)
    a = p.parse_args()
    if a.quick:
        a.mib, a.concurrent_mib = 64, 32
    torch.set_num_threads(1)
    print(f"model providers on loopback; {machine()}")
    # this VM backs guest memory on first touch (0.3 GB/s); touch it once up front so the
    # providers' and clients' first allocations do not pay it (see models_bench.py)
    t0 = time.perf_counter()
    if not a.quick:
        warm = bytearray(a.prefault_gib << 30)
        for i in range(0, len(warm), 4096):
            warm[i] = 1
        del warm
    print(f"pre-faulted {0 if a.quick else a.prefault_gib} GiB in "
          f"{time.perf_counter() - t0:.1f} s")
    lb = loopback(256 * MB if a.quick else 2 << 30)
    print(f"loopback TCP, one stream between two processes: {lb / 1e9:.2f} GB/s")
    work = Path(tempfile.mkdtemp(prefix="fb-remote-"))
    tok = work / "token"
    tok.write_text(TOKEN + "\n")
    sd = make(uniform(100, a.mib * MB))
    nbytes = sum(t.numel() * 4 for t in sd.values())
    keys = subset(sd, 0.25)
    part_bytes = sum(sd[k].numel() * 4 for k in keys)
    rows = {}
    procs = []
    try:
        for store in ("memory://", f"file://{work / 'lmdb'}"):
            prov, url = start_provider(store, tok)
            procs.append(prov)
            label = "provider, memory store" if store.startswith("memory") else \
                "provider, LMDB store"
            rows[label] = one_client(fm.open_repository(url, token=TOKEN), sd, keys)
        rows["embedded memory://"] = one_client(fm.open_repository("memory://"), sd, keys)
        print(f"\none client, {len(sd)} layers of {nbytes / len(sd) / MB:.1f} MiB "
              f"({nbytes / MB:.0f} MiB), seconds and GB/s:")
        print(f"  {'':<26} {'store':>7} {'full, new':>10} {'full, in place':>15} "
              f"{'25% in place':>13} {'in place GB/s':>14} {'of loopback':>12}")
        for k, (st, fn, fi, pt) in rows.items():
            print(f"  {k:<26} {st:7.3f} {fn:10.3f} {fi:15.3f} {pt:13.3f} "
                  f"{nbytes / fi / 1e9:14.2f} {nbytes / fi / lb:11.2f}x")
        # concurrent clients: 1 and 2 providers serving from memory
        csd = make(uniform(100, a.concurrent_mib * MB), seed=1)
        cbytes = sum(t.numel() * 4 for t in csd.values())
        prov2, url2 = start_provider("memory://", tok)
        procs.append(prov2)
        one = start_provider("memory://", tok)
        procs.append(one[0])
        r1 = fm.open_repository(one[1], token=TOKEN)
        r1.save("c0", csd)
        r1.close()
        pair = f"{one[1]},{url2}"
        rp = fm.open_repository(pair, token=TOKEN)
        names = []
        for k in range(64):  # two names the rendezvous puts on different providers
            n = f"c{k}"
            if rp.provider_for(n) not in [rp.provider_for(x) for x in names]:
                names.append(n)
            if len(names) == 2:
                break
        for n in names:
            rp.save(n, csd)
        rp.close()
        reps = 2 if a.quick else 3
        print(f"\nconcurrent clients, each loading a {cbytes / MB:.0f} MiB model in place "
              f"{reps}x (aggregate GB/s; 2 cores: 16 clients oversubscribe them):")
        for clients in (1, 4, 16):
            g1 = concurrent_loads([one[1]], ["c0"], clients, reps, cbytes)
            g2 = concurrent_loads([pair], names, clients, reps, cbytes)
            print(f"  {clients:>3} clients: 1 provider {g1 / 1e9:6.2f} GB/s, "
                  f"2 providers {g2 / 1e9:6.2f} GB/s")
        # DStore's setting: files on an emulated PFS vs a provider serving from memory
        pfs = EmulatedPFS(1, a.open_latency_ms / 1e3)
        print(f"\nDStore's setting: file contenders through an emulated PFS ({pfs.rate / 1e6:.0f}"
              f" MB/s for one reader, {a.open_latency_ms} ms per open) vs the provider "
              f"serving from memory (seconds; ratio = theirs / provider's):")
        st_mem, fn_mem, fi_mem, pt_mem = rows["provider, memory store"]
        contenders = [TorchSave(work, False), H5(work), Safetensors(work)]
        for c in contenders:
            t0 = time.perf_counter()
            c.store(sd)
            t_store = time.perf_counter() - t0
            t_store_pfs = max(t_store, pfs.open_latency + nbytes / pfs.rate)
            res = []
            for ks, size in ((list(sd), nbytes), (keys, part_bytes)):
                evict(c.files())
                t0 = time.perf_counter()
                c.load(ks, list(sd))
                el = time.perf_counter() - t0
                read = nbytes if isinstance(c, TorchSave) else size
                res.append(max(el, pfs.open_latency + read / pfs.rate))
            print(f"  {c.name:<26} store {t_store_pfs:7.3f} ({t_store_pfs / st_mem:5.1f}x)  "
                  f"full {res[0]:7.3f} ({res[0] / fn_mem:5.1f}x)  25% {res[1]:7.3f} "
                  f"({res[1] / pt_mem:5.1f}x)")
        print(f"  {'provider, memory store':<26} store {st_mem:7.3f}          full "
              f"{fn_mem:7.3f}          25% {pt_mem:7.3f}   (full in place {fi_mem:.3f})")
    finally:
        for pr in procs:
            pr.terminate()
            pr.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

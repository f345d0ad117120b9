"""Rerun of issue M's attacks at scale, with counts (the tests check each case once).

Datasets: every single-byte change of a dataset's manifest (three XOR masks per byte)
and crafted index rows (every column of many rows set to hostile values, every checksum
recomputed), each opened and, when it opens, read whole and compared bit for bit with
the original.  Provider: random well-framed requests from a fuzzer (random ops, random
msgpack metadata and data) on authenticated connections, counting the replies; then
idle sockets and idle clients against 2 workers while a real client saves and loads;
then the provider's peak RSS before authentication against frames announcing 64 MiB::

    python benchmarks/robustness/attack_rerun.py --frames 13036 --out results.txt

Every outcome is counted; the figures to look for are zero "WRONG DATA", zero "no
reply", zero "hang" and zero "traceback".
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

import forebay
from forebay import errors
from forebay.dataset import checksum, seal_manifest
from forebay.models._wire import HEADER, MAGIC, OP

TOKEN = "attack-rerun-token"


def samples(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(int(rng.integers(0, 6)), 3)).astype(np.float32),
             "label": np.int64(i),
             "blob": rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8).tobytes(),
             "z": (rng.normal(size=2) + 1j * rng.normal(size=2)).astype(np.complex64)}
            for i in range(n)]


def same(ds: Any, ref: list[dict]) -> bool:
    """Every sample of ``ds`` equal to ``ref``, bit for bit."""
    if len(ds) != len(ref):
        return False
    for i, want in enumerate(ref):
        got = ds[i]
        for k, v in want.items():
            g = got[k]
            gb = g.tobytes() if isinstance(g, np.ndarray) else bytes(g)
            wb = v if isinstance(v, bytes) else np.asarray(v).tobytes()
            if gb != wb:
                return False
    return True


def outcome(path: Path, ref: list[dict]) -> str:
    try:
        ds = forebay.open_dataset(path)
    except errors.ForebayError as e:
        return f"refused: {type(e).__name__}"
    except Exception as e:                       # anything else is a finding
        return f"traceback: {type(e).__name__}"
    try:
        if same(ds, ref):
            return "opened, same data"
        # a row may point at other bytes of its own shard: the dataset's author can
        # write any data; what must hold is that verify and verify_on_read notice
        bad = ds.verify(raise_on_error=False)
        return "opened, other bytes of the shard, caught by verify" if bad else \
            "WRONG DATA past verify"
    except errors.ForebayError as e:
        return f"opened, then a read refused: {type(e).__name__}"
    except Exception as e:
        return f"opened, then traceback: {type(e).__name__}"


def attack_manifest(work: Path, ref: list[dict]) -> Counter:
    good = work / "good"
    raw = (good / "manifest.json").read_bytes()
    c: Counter = Counter()
    ds = work / "m"
    shutil.copytree(good, ds)
    for k in range(len(raw)):
        for mask in (0x01, 0x20, 0x80):
            bad = bytearray(raw)
            bad[k] ^= mask
            (ds / "manifest.json").write_bytes(bytes(bad))
            c[outcome(ds, ref)] += 1
    return c


def attack_index(work: Path, ref: list[dict], rows: int, seed: int) -> Counter:
    good = work / "good"
    doc0 = json.loads((good / "manifest.json").read_text())
    rng = np.random.default_rng(seed)
    values = [-1, -4096, -(2**63), 2**31, 2**32 + 1, 2**62, 2**63 - 1, 0, 1, 7]
    c: Counter = Counter()
    ds = work / "i"
    shutil.copytree(good, ds)
    for s, shard in enumerate(doc0["shards"]):
        base = np.load(good / shard["index"])
        picks = rng.choice(len(base), size=min(rows, len(base)), replace=False)
        for r in picks.tolist():
            for col in range(base.shape[1]):
                for v in values + [int(base[r, col]) + int(rng.integers(-64, 65))]:
                    rows_ = base.copy()
                    rows_[r, col] = v
                    buf = io.BytesIO()
                    np.save(buf, rows_, allow_pickle=False)
                    doc = json.loads(json.dumps(doc0))
                    doc["shards"][s]["index_nbytes"] = len(buf.getvalue())
                    doc["shards"][s]["index_checksum"] = checksum(buf.getvalue())
                    (ds / shard["index"]).write_bytes(buf.getvalue())
                    (ds / "manifest.json").write_text(seal_manifest(doc))
                    c[outcome(ds, ref)] += 1
        shutil.copy(good / shard["index"], ds / shard["index"])
    return c


# -- the provider -----------------------------------------------------------------------
def serve(work: Path, *extra: str) -> tuple[subprocess.Popen, tuple[str, int]]:
    tok = work / "token"
    tok.write_text(TOKEN + "\n")
    # the log goes to a file: a pipe nobody reads fills up and blocks the provider
    log = open(work / "provider.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "forebay.cli", "models", "serve", "--listen",
                          "127.0.0.1:0", "--store", "memory://", "--token-file", str(tok),
                          *extra], stdout=subprocess.PIPE, stderr=log, text=True)
    log.close()
    line = p.stdout.readline() if p.stdout else ""
    host, port = line.split()[-1][len("tcp://"):].rsplit(":", 1)
    return p, (host, int(port))


def stop(p: subprocess.Popen, work: Path) -> str:
    p.send_signal(signal.SIGINT)
    try:
        p.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
    return (work / "provider.log").read_text()


def frame(op: int, meta: Any, data: bytes = b"", raw_meta: bytes | None = None) -> bytes:
    m = raw_meta if raw_meta is not None else msgpack.packb(meta, use_bin_type=True)
    return HEADER.pack(MAGIC, 1, op, 0, len(m), len(data)) + m + data


def connect(addr: tuple[str, int]) -> socket.socket:
    s = socket.create_connection(addr, timeout=15)
    s.sendall(frame(OP["HELLO"], {"token": TOKEN}))
    if reply(s)[0] != OP["OK"]:
        raise RuntimeError("the provider refused the token")
    return s


def reply(s: socket.socket) -> tuple[Any, Any]:
    hdr = s.recv(HEADER.size, socket.MSG_WAITALL)
    if len(hdr) < HEADER.size:
        return None, None
    _, _, op, _, mlen, dlen = HEADER.unpack(hdr)
    meta = msgpack.unpackb(s.recv(mlen, socket.MSG_WAITALL)) if mlen else None
    left = dlen
    while left:
        got = s.recv(min(left, 1 << 20))
        if not got:
            return None, None
        left -= len(got)
    return op, meta


KEYS = ["name", "version", "hashes", "tensors", "include", "exclude", "grace_seconds",
        "body", "token", "metadata", "hash", "nbytes", "dtype", "shape", "versions", "parent"]


def value(rng: np.random.Generator, depth: int = 0) -> Any:
    k = int(rng.integers(0, 12 if depth < 4 else 8))
    if k == 0:
        return None
    if k == 1:
        return bool(rng.integers(0, 2))
    if k == 2:
        return pick(rng, [0, 1, -1, 2**31, -(2**63), 2**64 - 1, 10**18, 7])
    if k == 3:
        return pick(rng, [0.5, -0.0, float("inf"), float("nan"), 1e308, -1e-308])
    if k == 4:
        return pick(rng, ["keep", "", "../x", "a" * 300, "\x00", "m/../../etc", "é"])
    if k == 5:
        return rng.bytes(int(rng.integers(0, 40)))
    if k in (6, 7):
        return "0" * 32 if k == 6 else pick(rng, ["uint8", "float32", "<f4", "|O"])
    if k in (8, 9):
        return [value(rng, depth + 1) for _ in range(int(rng.integers(0, 5)))]
    return {pick(rng, KEYS): value(rng, depth + 1) for _ in range(int(rng.integers(0, 5)))}


def pick(rng: np.random.Generator, xs: list) -> Any:
    return xs[int(rng.integers(0, len(xs)))]


def fuzz(addr: tuple[str, int], n: int, seed: int) -> Counter:
    rng = np.random.default_rng(seed)
    ops = [v for k, v in OP.items() if k not in ("OK", "ERR", "HELLO")]
    c: Counter = Counter()
    s = connect(addr)
    for _ in range(n):
        r = rng.random()
        op = pick(rng, ops) if r < 0.9 else int(rng.integers(0, 256))
        data = rng.bytes(int(rng.integers(0, 64))) if rng.random() < 0.2 else b""
        if rng.random() < 0.1:           # metadata that is not msgpack at all
            f = frame(op, None, data, raw_meta=rng.bytes(int(rng.integers(1, 64))))
        else:
            meta = {pick(rng, KEYS): value(rng) for _ in range(int(rng.integers(0, 5)))} \
                if rng.random() < 0.8 else value(rng)
            f = frame(op, meta, data)
        kind = None
        try:
            s.sendall(f)
            got, meta = reply(s)
            kind = meta.get("kind") if isinstance(meta, dict) else None
        except socket.timeout:
            c["hang (no reply in 15 s)"] += 1
            got = -1
        except OSError:
            got = None
        if got == OP["ERR"] and kind == "protocol":
            c["ERR reply, then closed (protocol error)"] += 1
            got = None
        elif got == OP["ERR"]:
            c["ERR reply, connection kept"] += 1
        elif got == OP["OK"]:
            c["OK reply"] += 1
        elif got is None:
            c["no reply, closed"] += 1
        if got is None or got == -1 or kind == "protocol":
            s.close()
            s = connect(addr)
    s.close()
    return c


def served_times(addr: tuple[str, int], k: int) -> list[float]:
    """Seconds for a new client to connect, save a model and load it back, ``k`` times."""
    import torch

    import forebay.models as fm

    out = []
    for i in range(k):
        t = time.perf_counter()
        r = fm.RemoteRepository(f"tcp://{addr[0]}:{addr[1]}", TOKEN, timeout=30)
        r.save(f"m{i}", {"w": torch.arange(1000.0)})
        assert torch.equal(r.load(f"m{i}")["w"], torch.arange(1000.0))
        r.close()
        out.append(time.perf_counter() - t)
    return out


def peak_rss_kib(pid: int) -> int:
    m = re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) if m else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=120)
    ap.add_argument("--rows", type=int, default=12, help="index rows attacked per shard")
    ap.add_argument("--frames", type=int, default=13036)
    ap.add_argument("--idle", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"# attack rerun, {time.strftime('%Y-%m-%d %H:%M:%S')} UTC, {os.uname().nodename}, "
        f"{os.cpu_count()} cpus, forebay {forebay.__version__}")
    work = Path(tempfile.mkdtemp(prefix="forebay-attack-"))
    try:
        ref = samples(a.samples, a.seed)
        forebay.write_dataset(work / "good", ref, shard_bytes=8 << 10)
        nbytes = (work / "good" / "manifest.json").stat().st_size
        t = time.perf_counter()
        c = attack_manifest(work, ref)
        say(f"manifest: {sum(c.values()):,} single-byte changes of a {nbytes:,}-byte "
            f"manifest ({time.perf_counter() - t:.0f} s): {dict(c.most_common())}")
        t = time.perf_counter()
        c = attack_index(work, ref, a.rows, a.seed)
        say(f"index rows: {sum(c.values()):,} crafted rows, checksums recomputed "
            f"({time.perf_counter() - t:.0f} s): {dict(c.most_common())}")

        p, addr = serve(work, "--workers", "2", "--max-frame", "1MiB")
        try:
            t = time.perf_counter()
            c = fuzz(addr, a.frames, a.seed)
            say(f"provider: {a.frames:,} fuzzed well-framed requests on authenticated "
                f"connections ({time.perf_counter() - t:.0f} s): {dict(c.most_common())}")
            base = served_times(addr, 10)
            idle = [socket.create_connection(addr, timeout=30) for _ in range(a.idle)]
            import forebay.models as fm
            kept = []
            for _ in range(8):
                r = fm.RemoteRepository(f"tcp://{addr[0]}:{addr[1]}", TOKEN, timeout=30)
                r.list()
                kept.append(r)
            loaded = served_times(addr, 10)
            for s in idle:
                s.close()
            for r in kept:
                r.close()
            say(f"provider, 2 workers: a new client's connect+save+load, min/median/max "
                f"{min(base) * 1e3:.1f}/{statistics.median(base) * 1e3:.1f}/"
                f"{max(base) * 1e3:.1f} ms alone; {min(loaded) * 1e3:.1f}/"
                f"{statistics.median(loaded) * 1e3:.1f}/{max(loaded) * 1e3:.1f} ms with "
                f"{a.idle} silent sockets and 8 idle authenticated clients open")
            before = peak_rss_kib(p.pid)
            big = b"\xdd" + (64 << 20).to_bytes(4, "big") + b"\x90" * (64 << 20)
            for k in range(16):
                s = socket.create_connection(addr, timeout=30)
                s.sendall(HEADER.pack(MAGIC, 1, OP["HELLO"], 0, len(big), 0))
                if k == 0:
                    try:
                        s.sendall(big)
                    except OSError:
                        pass
                got, _ = reply(s)
                s.close()
                if got != OP["ERR"]:
                    say(f"pre-authentication frame {k}: reply {got}, not ERR")
            say(f"provider: 16 pre-authentication frames announcing 64 MiB (one sending 64 "
                f"MiB of empty msgpack arrays): peak RSS (VmHWM, updated lazily by the "
                f"kernel) {before / 1024:.1f} MiB before, {peak_rss_kib(p.pid) / 1024:.1f} "
                f"MiB after")
            served_times(addr, 1)
        finally:
            err = stop(p, work)
        tb = err.count("Traceback")
        say(f"provider stderr: {tb} traceback(s), {len(err.splitlines())} log lines")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

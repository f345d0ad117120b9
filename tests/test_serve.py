"""A producer's node-local dataset served to consumers, and their mirrors (issue U, item
3: DYAD's path): real HTTP servers and clients on 127.0.0.1.  The mirror is bit-exact,
copies only the generations it lacks, waits for samples not yet published, and takes
nothing that is not whole and checked; the server answers only what its manifest names
to whoever holds the token.  Across emulated nodes: tests/test_cluster.py."""

from __future__ import annotations

import http.client
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import forebay
from forebay.dataset import mirror, serve_dataset
from forebay.errors import (ChecksumError, DatasetServerError, InvalidArgumentError,
                            WaitTimeoutError)

TOKEN = "not-a-real-secret"


def _gen(a: int, b: int):
    return ({"x": np.full(500 + i % 7, i, np.float32), "y": np.int64(i)} for i in range(a, b))


@pytest.fixture
def producer(tmp_path):
    path = tmp_path / "producer" / "frames.fb"
    forebay.write_dataset(path, _gen(0, 60), shard_bytes=40_000)
    with serve_dataset(path, token=TOKEN) as srv:
        yield path, srv


def _same(a, b) -> bool:
    every = np.arange(len(a))
    return len(a) == len(b) and a.get_many(every).equals(b.get_many(every))


def test_a_mirror_is_bit_exact_and_copies_only_the_new_generations(producer, tmp_path):
    path, srv = producer
    m = mirror(srv.url, tmp_path / "m.fb", token=TOKEN)
    src = forebay.open_dataset(path)
    assert _same(m, src) and m.fingerprint == src.fingerprint and m.verify().ok
    first = srv.files_sent
    assert first == 2 * len(src.manifest.shards)
    forebay.append(path, _gen(60, 90), shard_bytes=40_000)
    m = mirror(srv.url, tmp_path / "m.fb", token=TOKEN)
    src = forebay.open_dataset(path)
    assert _same(m, src) and len(m) == 90
    assert srv.files_sent - first == 2 * (len(src.manifest.shards) - first // 2)
    assert forebay.dataset.generations(m.manifest) == [60, 90]


def test_a_consumer_waits_for_samples_a_producer_has_not_published(producer, tmp_path):
    """Whether the producer's append comes before or during the wait, the mirror
    returns once the samples are there, with exactly what was published."""
    path, srv = producer
    appender = threading.Thread(target=forebay.append, args=(path, _gen(60, 100)))
    appender.start()
    try:
        m = mirror(srv.url, tmp_path / "m.fb", token=TOKEN, samples=100, timeout=60)
    finally:
        appender.join()
    assert len(m) == 100 and _same(m, forebay.open_dataset(path))


def test_a_timeout_or_a_wrong_token_changes_nothing(producer, tmp_path):
    path, srv = producer
    m = mirror(srv.url, tmp_path / "m.fb", token=TOKEN)
    before = sorted(p.name for p in (tmp_path / "m.fb").iterdir())
    with pytest.raises(WaitTimeoutError, match="60 samples, waiting for 61"):
        mirror(srv.url, tmp_path / "m.fb", token=TOKEN, samples=61, timeout=0.2)
    with pytest.raises(DatasetServerError, match="401: a wrong or missing token"):
        mirror(srv.url, tmp_path / "m.fb", token="guess")
    assert sorted(p.name for p in (tmp_path / "m.fb").iterdir()) == before
    assert len(forebay.open_dataset(tmp_path / "m.fb")) == len(m)
    with pytest.raises(InvalidArgumentError, match="needs a shared token"):
        serve_dataset(path, token="")


def _raw(srv, path: str, method: str = "GET", token: "str | None" = TOKEN):
    host, port = srv.server_address[:2]
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request(method, path, headers={"Authorization": f"Bearer {token}"} if token else {})
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, body


def test_crafted_requests_are_refused_and_the_server_keeps_serving(producer, tmp_path):
    path, srv = producer
    (path.parent / "secret.txt").write_text("not in the manifest")
    assert _raw(srv, "/manifest", token=None)[0] == 401
    assert _raw(srv, "/manifest", token=TOKEN + "x")[0] == 401
    for bad in ("/file/../frames.fb/manifest.json", "/file/..%2Fsecret.txt",
                "/file/secret.txt", "/file/manifest.json", "/file/shard-99999.bin",
                "/etc/passwd", "/file/"):
        assert _raw(srv, bad)[0] == 404, bad
    for bad in ("/wait?samples=x", "/wait?samples=-1", "/wait?samples=1&timeout=1e9",
                "/wait?samples=1&timeout=nan"):
        assert _raw(srv, bad)[0] == 400, bad
    assert _raw(srv, "/manifest", method="POST")[0] == 501
    assert _raw(srv, "/manifest", method="PUT")[0] == 501
    status, body = _raw(srv, "/manifest")
    assert status == 200 and body == (path / "manifest.json").read_bytes()
    assert _same(mirror(srv.url, tmp_path / "m.fb", token=TOKEN), forebay.open_dataset(path))


def test_a_damaged_file_or_a_replaced_dataset_is_not_taken(producer, tmp_path):
    path, srv = producer
    mirror(srv.url, tmp_path / "m.fb", token=TOKEN)
    forebay.append(path, _gen(60, 80), shard_bytes=40_000)
    last = forebay.open_dataset(path).manifest.shards[-1].data
    data = bytearray((path / last).read_bytes())
    data[100] ^= 0xFF                             # damaged on the producer's node
    (path / last).write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=f"{last} as received fails its checksum"):
        mirror(srv.url, tmp_path / "m.fb", token=TOKEN)
    m = forebay.open_dataset(tmp_path / "m.fb")        # the mirror as it was
    assert len(m) == 60 and m.verify().ok
    assert not list((tmp_path / "m.fb").glob(".mirror-*"))
    forebay.write_dataset(path, _gen(0, 70), shard_bytes=30_000, overwrite=True)
    with pytest.raises(DatasetServerError, match="does not continue the mirror"):
        mirror(srv.url, tmp_path / "m.fb", token=TOKEN)
    assert len(forebay.open_dataset(tmp_path / "m.fb")) == 60


def test_the_shared_copy_is_read_when_the_producer_does_not_answer(producer, tmp_path):
    path, srv = producer
    shared = tmp_path / "shared.fb"
    shutil.copytree(path, shared)
    url = srv.url
    srv.close()                                    # the producer's node is gone
    with pytest.raises(DatasetServerError, match="does not answer"):
        mirror(url, tmp_path / "m.fb", token=TOKEN)
    got = mirror(url, tmp_path / "m.fb", token=TOKEN, samples=60, fallback=shared)
    assert got.path == shared and len(got) == 60
    assert not (tmp_path / "m.fb" / "manifest.json").exists()


def test_two_consumers_of_a_node_mirror_into_one_directory(producer, tmp_path):
    path, srv = producer
    out: list = []
    threads = [threading.Thread(target=lambda: out.append(
        mirror(srv.url, tmp_path / "m.fb", token=TOKEN, samples=60))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 2 and all(_same(m, forebay.open_dataset(path)) for m in out)
    assert srv.files_sent == 2 * len(forebay.open_dataset(path).manifest.shards)


def test_forebay_serve_and_mirror_commands(tmp_path, cli):
    path = tmp_path / "frames.fb"
    forebay.write_dataset(path, _gen(0, 30))
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    forebay_bin = str(Path(sys.executable).parent / "forebay")
    assert subprocess.run([forebay_bin, "serve", str(path)], capture_output=True,
                          text=True, env={"PATH": ""}).returncode == 2    # no token
    srv = subprocess.Popen([forebay_bin, "serve", str(path), "--listen", "127.0.0.1:0",
                            "--token-file", str(token)], stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None
        url = srv.stdout.readline().split(" on ")[-1].strip()
        assert url.startswith("http://127.0.0.1:"), url
        code, out, err = cli("mirror", url, tmp_path / "m.fb", "--samples", "30",
                             "--token-file", token)
        assert code == 0 and "30 samples in" in out, err
        assert _same(forebay.open_dataset(tmp_path / "m.fb"), forebay.open_dataset(path))
    finally:
        srv.terminate()
        srv.wait(timeout=30)
        if srv.stdout is not None:
            srv.stdout.close()

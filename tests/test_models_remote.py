"""Model providers on 127.0.0.1: a real `forebay models serve` process, real sockets,
concurrent client processes, bad clients, a provider killed mid-save, rendezvous."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmdb")
pytest.importorskip("msgpack")
from torch import nn  # noqa: E402

import forebay.models as fm  # noqa: E402
from forebay.errors import ModelNotFoundError, ModelRepositoryError  # noqa: E402
from forebay.models._wire import HEADER, MAGIC, OP, _packb  # noqa: E402

TOKEN = "s3cret-token"


def _serve(tmp_path, store: str, *extra: str):
    tok = tmp_path / "token"
    tok.write_text(TOKEN + "\n")
    p = subprocess.Popen([sys.executable, "-m", "forebay.cli", "models", "serve", "--listen",
                          "127.0.0.1:0", "--store", store, "--token-file", str(tok), *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.startswith("serving"), (line, p.stderr.read() if p.poll() is not None else "")
    return p, line.split()[-1]


def _stop(p):
    p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    p.stdout.close()
    p.stderr.close()


@pytest.fixture
def provider(tmp_path):
    p, url = _serve(tmp_path, f"file://{tmp_path / 'store'}")
    yield url
    _stop(p)


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 4))


def test_round_trip_partial_and_matching_over_tcp(provider):
    r = fm.open_repository(provider, token=TOKEN)
    m = net()
    v = r.save("mlp", m, metadata={"lr": 0.1})
    assert r.versions("mlp") == [v] and r.list() == {"mlp": [v]}
    fresh = net(seed=1)
    r.load("mlp", into=fresh)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), fresh.parameters()))
    before = r.stats()["bytes_read"]
    part = r.load("mlp", include="4.*")
    assert sorted(part) == ["4.bias", "4.weight"]
    assert r.stats()["bytes_read"] - before == (64 * 4 + 4) * 4
    # a second save of the same weights sends nothing new
    r.save("mlp", m)
    st = r.stats()
    assert st["stored_bytes"] * 2 == st["logical_bytes"] and st["tensors_deduplicated"] == 6
    other = net(seed=2)
    rep = r.load_matching("mlp", other)
    assert len(rep["matched"]) == 3 and torch.equal(other[2].weight, m[2].weight)
    assert r.manifest("mlp", v)["metadata"] == {"lr": 0.1}
    with pytest.raises(ModelNotFoundError, match="no model named 'nope'"):
        r.load("nope")
    r.close()


def test_wrong_token_is_refused_and_others_go_on(provider):
    with pytest.raises(ModelRepositoryError, match="wrong token"):
        fm.open_repository(provider, token="guess").list()
    assert fm.open_repository(provider, token=TOKEN).list() == {}


def _raw(url: str, hello: bool = True) -> socket.socket:
    host, port = url[len("tcp://"):].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    if hello:
        m = _packb({"token": TOKEN})
        s.sendall(HEADER.pack(MAGIC, 1, OP["HELLO"], 0, len(m), 0) + m)
        hdr = s.recv(HEADER.size, socket.MSG_WAITALL)
        mlen = HEADER.unpack(hdr)[4]
        s.recv(mlen, socket.MSG_WAITALL)
    return s


def _reply(s: socket.socket):
    import msgpack

    hdr = s.recv(HEADER.size, socket.MSG_WAITALL)
    if not hdr:
        return None, None
    _, _, op, _, mlen, _ = HEADER.unpack(hdr)
    return op, msgpack.unpackb(s.recv(mlen, socket.MSG_WAITALL))


@pytest.mark.parametrize("bad", ["magic", "oversized", "garbled", "unknown-op", "truncated",
                                 "corrupt-put", "no-hello", "bad-commit"])
def test_bad_clients_are_dropped_and_the_provider_keeps_serving(tmp_path, bad):
    p, url = _serve(tmp_path, "memory://", "--max-frame", "1MiB")
    try:
        good = fm.open_repository(url, token=TOKEN)
        good.save("keep", net())
        s = _raw(url, hello=bad != "no-hello")
        if bad == "magic":
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        elif bad == "oversized":
            s.sendall(HEADER.pack(MAGIC, 1, OP["PUT"], 0, 2, 2 << 20) + b"\x80\x80")
        elif bad == "garbled":
            s.sendall(HEADER.pack(MAGIC, 1, OP["LIST"], 0, 3, 0) + b"\xc1\xc1\xc1")
        elif bad == "unknown-op":
            m = _packb({})
            s.sendall(HEADER.pack(MAGIC, 1, 77, 0, len(m), 0) + m)
        elif bad == "truncated":  # announces 1000 bytes of data, sends 10, hangs up
            m = _packb({"tensors": [{"hash": "0" * 32, "nbytes": 1000, "dtype": "uint8",
                                     "shape": [1000]}]})
            s.sendall(HEADER.pack(MAGIC, 1, OP["PUT"], 0, len(m), 1000) + m + b"x" * 10)
        elif bad == "corrupt-put":  # bytes that do not match the hash they claim
            m = _packb({"tensors": [{"hash": "0" * 32, "nbytes": 8, "dtype": "uint8",
                                     "shape": [8]}]})
            s.sendall(HEADER.pack(MAGIC, 1, OP["PUT"], 0, len(m), 8) + m + b"12345678")
        elif bad == "no-hello":
            m = _packb({})
            s.sendall(HEADER.pack(MAGIC, 1, OP["LIST"], 0, len(m), 0) + m)
        elif bad == "bad-commit":  # a body whose tensors are not a map
            m = _packb({"name": "keep", "token": b"x", "body": {"tensors": [1, 2]}})
            s.sendall(HEADER.pack(MAGIC, 1, OP["COMMIT"], 0, len(m), 0) + m)
        if bad == "truncated":
            s.close()
        else:
            op, meta = _reply(s)
            assert op == OP["ERR"], meta
            want = {"magic": "bad magic", "oversized": "exceeds", "garbled": "malformed",
                    "unknown-op": "unknown op", "corrupt-put": "arrived corrupt",
                    "no-hello": "HELLO", "bad-commit": "COMMIT body malformed"}[bad]
            assert want in meta["error"]
            s.close()
        # the provider still serves everybody else, and stored nothing bad
        assert good.versions("keep") == [1]
        assert fm.open_repository(url, token=TOKEN).verify() == []
        good.close()
    finally:
        _stop(p)


def rank_save_and_load(url: str, token: str, seed: str) -> None:
    """A client process: three versions saved and each loaded back bit-exact."""
    import torch

    r = fm.open_repository(url, token=token)
    torch.manual_seed(int(seed))
    m = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])
    for k in range(3):
        with torch.no_grad():
            m[k].weight.add_(1)
        v = r.save("shared", m, metadata={"seed": int(seed)})
        got = r.load("shared", v)
        assert all(torch.equal(got[n], t) for n, t in m.state_dict().items())
        print("SAVED", v, flush=True)


def test_four_concurrent_writers_and_readers(tmp_path, provider):
    from conftest import rank_command

    procs = []
    for seed in range(4):
        cmd, env = rank_command(rank_save_and_load, [provider, TOKEN, str(seed)])
        procs.append(subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    versions = sorted(int(x.split()[1]) for o, _ in outs for x in o.splitlines()
                      if x.startswith("SAVED"))
    assert versions == list(range(1, 13))
    r = fm.open_repository(provider, token=TOKEN)
    assert r.versions("shared") == list(range(1, 13)) and r.verify() == []


def test_provider_killed_mid_save_leaves_whole_versions(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    p, url = _serve(tmp_path, store)
    r = fm.open_repository(url, token=TOKEN)
    big = nn.Sequential(*[nn.Linear(512, 512) for _ in range(16)])
    r.save("big", big)
    first = r.load("big")

    import threading

    errors = []

    def keep_saving():
        try:
            for _ in range(1000):
                with torch.no_grad():
                    big[0].weight.add_(1)
                r.save("big", big)
        except ModelRepositoryError as e:
            errors.append(e)

    t = threading.Thread(target=keep_saving)
    t.start()
    time.sleep(1.0)
    os.kill(p.pid, signal.SIGKILL)
    t.join(timeout=60)
    p.wait()
    p.stdout.close()
    p.stderr.close()
    assert errors and "model provider" in str(errors[0])
    p, url = _serve(tmp_path, store)  # the same store, a new provider
    try:
        r2 = fm.open_repository(url, token=TOKEN)
        assert r2.verify() == []
        for v in r2.versions("big"):
            assert len(r2.load("big", v)) == 32
        got = r2.load("big", 1)
        assert all(torch.equal(got[k], first[k]) for k in first)
    finally:
        _stop(p)


def test_rendezvous_moves_only_names_of_a_new_provider():
    from forebay.models._remote import RemoteRepository

    two = RemoteRepository("tcp://10.0.0.1:1,10.0.0.2:1")
    three = RemoteRepository("tcp://10.0.0.1:1,10.0.0.2:1,10.0.0.3:1")
    names = [f"model-{k}" for k in range(400)]
    a = [two.provider_for(n) for n in names]
    b = [three.provider_for(n) for n in names]
    assert 150 < a.count(0) < 250  # spread
    moved = [(x, y) for x, y in zip(a, b) if x != y]
    assert moved and all(y == 2 for _, y in moved)  # only onto the new one
    assert 90 < b.count(2) < 180


def test_cli_against_a_provider(tmp_path, provider, cli):
    r = fm.open_repository(provider, token=TOKEN)
    r.save("mlp", net())
    r.close()
    tok = tmp_path / "token"  # written by _serve
    code, out, _ = cli("models", "ls", provider, "--token-file", tok)
    assert code == 0 and "mlp" in out and "versions 1..1" in out
    code, out, _ = cli("models", "show", provider, "mlp", "--token-file", tok)
    assert code == 0 and "3 leaf layers" in out
    code, out, _ = cli("models", "verify", provider, "--token-file", tok)
    assert code == 0 and out.startswith("ok:")
    code, _, err = cli("models", "ls", provider)  # no token
    assert code == 2 and "wrong token" in err


def test_provider_records_its_own_file_locations(tmp_path, provider):
    # the provider locates what it stored; a location a client sends is never kept
    c = fm.open_repository(provider, token=TOKEN)
    sd = {"w": torch.randn(512, 512), "b": torch.randn(10)}
    c.save("m", sd)
    real = c.manifest("m")["tensors"]["w"]
    assert "loc" in real and "loc" not in c.manifest("m")["tensors"]["b"]
    token, _ = c._store_tensors("m", {})
    body = {"metadata": {}, "graph": None, "leaves": {}, "logical_bytes": 0, "new_bytes": 0,
            "tensors": {"w": dict(real, loc=12345)}}
    v = c._conn("m").call("COMMIT", {"name": "m", "body": body, "token": token})["version"]
    assert c.manifest("m", v)["tensors"]["w"]["loc"] == real["loc"]
    assert torch.equal(c.load("m", version=v)["w"], sd["w"])
    c.close()


def test_corrupt_tensor_over_a_provider_is_named_and_the_connection_goes_on(tmp_path):
    """Bytes corrupt in the provider's store: the client names the tensor after reading
    the whole reply, and its next request on the same connection works."""
    import threading

    from conftest import corrupt_stored_tensor
    from forebay.errors import CorruptModelError
    from forebay.models._provider import Provider

    sd = {"a": torch.randn(64, 64), "w": torch.randn(256, 256), "z": torch.randn(100)}
    with fm.open_repository(str(tmp_path / "store")) as r:
        r.save("m", sd)
        h = r.manifest("m")["tensors"]["w"]["hash"]
    corrupt_stored_tensor(tmp_path / "store", h, at=7, mask=0x40)
    store = fm.open_repository(str(tmp_path / "store"))
    srv = Provider(("127.0.0.1", 0), store, TOKEN)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        c = fm.open_repository(srv.address, token=TOKEN)
        with pytest.raises(CorruptModelError, match=r"version 1: tensor 'w' arrived corrupt"):
            c.load("m")
        sock = c.conns[0].sock
        back = c.load("m", include=["a", "z"])
        assert c.conns[0].sock is sock                      # same connection, in step
        assert torch.equal(back["a"], sd["a"]) and torch.equal(back["z"], sd["z"])
        c.close()
    finally:
        srv.shutdown()
        srv.server_close()
        store.close()


# -- hostile clients (issue M.6-9) ------------------------------------------------------------
def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def test_idle_sockets_never_starve_a_real_client(tmp_path):
    """20 connections that send nothing (no token), and 3 authenticated clients that
    stay connected and idle, against a provider of 2 workers: a new client is still
    served (before, the idle ones held every worker slot for up to 600 s)."""
    p, url = _serve(tmp_path, "memory://", "--workers", "2")
    idle, kept = [], []
    try:
        host, port = url[len("tcp://"):].rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=30) for _ in range(20)]
        for _ in range(3):
            r = fm.RemoteRepository(url, TOKEN, timeout=30)
            r.list()                                  # connected, authenticated, now idle
            kept.append(r)
        late = fm.RemoteRepository(url, TOKEN, timeout=30)
        late.save("m", net())                         # a socket timeout here fails the test
        assert late.versions("m") == [1]
        late.close()
    finally:
        for s in idle:
            s.close()
        for r in kept:
            r.close()
        _stop(p)


def test_memory_before_authentication_is_bounded(tmp_path):
    """Before the token is checked only a small HELLO is read: a header announcing 64 MiB
    of metadata, or 64 MiB of empty msgpack arrays, is refused without allocating it
    (before: 4.8 GiB peak for one such frame)."""
    p, url = _serve(tmp_path, "memory://")
    try:
        base = _peak_rss_kib(p.pid)
        frame = b"\xdd" + (64 << 20).to_bytes(4, "big") + b"\x90" * (64 << 20)   # array32
        for k in range(4):
            s = _raw(url, hello=False)
            s.sendall(HEADER.pack(MAGIC, 1, OP["HELLO"], 0, len(frame), 0))
            if k % 2:
                try:
                    s.sendall(frame)
                except OSError:
                    pass                                 # dropped as soon as it said the size
            op, meta = _reply(s)
            assert op == OP["ERR"] and "exceeds the 4096 limit" in meta["error"]
            s.close()
        assert _peak_rss_kib(p.pid) - base < 64 << 10      # KiB: well under one frame
        r = fm.open_repository(url, token=TOKEN)
        r.save("m", net())
        assert r.versions("m") == [1]
        r.close()
    finally:
        _stop(p)


def test_a_frame_of_empty_arrays_after_hello_is_refused_without_building_it(tmp_path):
    """Issue X item 8: after a valid HELLO, 16 arrays of 1 M empty arrays (16 MiB) were
    unpacked into 16 M Python lists (1.2 GiB, the attack's 60 MiB into 4.4 GiB and 161 s)
    before the reply said the metadata must be a map."""
    from forebay.models._wire import MAX_CONTAINERS

    p, url = _serve(tmp_path, "memory://")
    try:
        base = _peak_rss_kib(p.pid)
        inner = b"\xdd" + (1 << 20).to_bytes(4, "big") + b"\x90" * (1 << 20)   # array32
        frame = b"\xdc" + (16).to_bytes(2, "big") + inner * 16                  # array16
        s = _raw(url)
        s.sendall(HEADER.pack(MAGIC, 1, OP["LIST"], 0, len(frame), 0) + frame)
        op, meta = _reply(s)
        assert op == OP["ERR"] and f"more than {MAX_CONTAINERS} arrays" in meta["error"], meta
        assert _peak_rss_kib(p.pid) - base < 256 << 10     # KiB: not the 1.2 GiB of lists
        s.close()                                          # (a protocol error drops it)
        r = fm.open_repository(url, token=TOKEN)           # the provider serves on
        assert r.list() == {}
        r.close()
    finally:
        _stop(p)


@pytest.mark.parametrize("op, meta", [
    ("DELETE", {"name": "m", "version": float("inf")}),        # OverflowError
    ("DELETE", {"name": "m", "version": [1]}),                  # TypeError
    ("GC", {"grace_seconds": "soon"}),                          # ValueError
    ("MANIFEST", {"name": {"nested": 1}}),                     # a map where a name goes
    ("HAS", {"hashes": None}),
])
def test_every_malformed_request_gets_an_error_reply(tmp_path, op, meta):
    p, url = _serve(tmp_path, "memory://")
    try:
        s = _raw(url)
        m = _packb(meta)
        s.sendall(HEADER.pack(MAGIC, 1, OP[op], 0, len(m), 0) + m)
        got, reply = _reply(s)
        assert got == OP["ERR"] and reply["error"], reply
        m = _packb({})                                     # the connection is still in step
        s.sendall(HEADER.pack(MAGIC, 1, OP["LIST"], 0, len(m), 0) + m)
        got, reply = _reply(s)
        assert got == OP["OK"] and reply == {"models": {}}
        s.close()
    finally:
        _stop(p)


@pytest.mark.parametrize("meta", [
    {"tensors": "not a list"},                                              # TypeError
    {"metadata": 1},                                                        # KeyError
    {"tensors": [{"nbytes": 16, "hash": "0" * 32, "dtype": "x", "shape": {"a": 1}}]},
    {"tensors": [{"nbytes": 8, "hash": "0" * 32, "dtype": "u1", "shape": [8]},
                 {"nbytes": 8, "hash": [], "dtype": "u1", "shape": [8]}]},
])
def test_a_malformed_put_with_data_keeps_the_connection_in_step(tmp_path, meta):
    """A PUT whose metadata fails after its header announced data: an ERR reply, and the
    data is read and dropped, so the next request on the connection is answered (the
    attack rerun found the provider reading the data as the next frame's header)."""
    p, url = _serve(tmp_path, "memory://")
    try:
        s = _raw(url)
        m = _packb(meta)
        s.sendall(HEADER.pack(MAGIC, 1, OP["PUT"], 0, len(m), 16) + m + b"\x01" * 16)
        got, reply = _reply(s)
        assert got == OP["ERR"] and reply["kind"] != "protocol", reply
        m = _packb({})
        s.sendall(HEADER.pack(MAGIC, 1, OP["LIST"], 0, len(m), 0) + m)
        got, reply = _reply(s)
        assert got == OP["OK"] and reply == {"models": {}}, reply
        s.close()
    finally:
        _stop(p)


def test_a_stderr_nobody_reads_never_stops_the_provider(tmp_path):
    """The provider logs every dropped client: with its stderr a pipe nobody reads, the
    pipe fills (64 KiB) and a logging call that waited on it would hold every handler
    (the attack rerun's harness stalled so). 1,500 bad clients, then a real one is
    served: the log is written by one thread and dropped when it falls behind."""
    p, url = _serve(tmp_path, "memory://")     # stderr: a pipe this test never reads
    try:
        host, port = url[len("tcp://"):].rsplit(":", 1)
        for _ in range(1500):                  # each logs ~100 bytes: > 2x the pipe
            s = socket.create_connection((host, int(port)), timeout=30)
            s.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 16)
            s.recv(4096)                       # the ERR reply, then the provider hangs up
            s.close()
        r = fm.RemoteRepository(url, TOKEN, timeout=30)
        r.save("m", net())
        assert r.versions("m") == [1]
        r.close()
    finally:
        _stop(p)


def test_a_provider_needs_a_token_unless_told_otherwise(tmp_path, cli):
    code, _, err = cli("models", "serve", "--listen", "127.0.0.1:0", "--store", "memory://")
    assert code == 2 and "token is required" in err
    with pytest.raises(ModelRepositoryError, match="needs a token"):
        fm.serve("127.0.0.1:0", "memory://", None)

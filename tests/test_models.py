"""forebay.models: architecture capture and stable IDs, the repository (LMDB and memory),
partial loads, dedup, transfer by structure, corruption, crashes and concurrent clients."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmdb")
from torch import nn  # noqa: E402

import forebay.models as fm  # noqa: E402
from forebay.errors import (CorruptModelError, ModelMismatchError,  # noqa: E402
                            ModelNotFoundError, ModelRepositoryError)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x)) + x)


class Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 4, out: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, out)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Renamed(nn.Module):
    """Net's structure, other attribute names, built in another order."""

    def __init__(self, d: int = 16, n: int = 4, out: int = 3) -> None:
        super().__init__()
        self.classifier = nn.Linear(d, out)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.stem = nn.Linear(8, d)

    def forward(self, x):
        x = self.stem(x)
        for b in self.layers:
            x = b(x)
        return self.classifier(x)


@pytest.fixture
def repo(tmp_path):
    r = fm.open_repository(f"file://{tmp_path / 'repo'}")
    yield r
    r.close()


def _equal_sd(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].reshape(-1).view(torch.uint8).tolist() == \
            b[k].contiguous().reshape(-1).view(torch.uint8).tolist(), k


def test_round_trip_is_bit_exact_for_every_dtype(repo):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    sd = {"f16": base.half(), "bf16": base.bfloat16(), "f32": base, "f64": base.double(),
          "i64": torch.arange(7), "i8": torch.arange(-3, 3, dtype=torch.int8),
          "u8": torch.arange(5, dtype=torch.uint8), "flag": torch.tensor([True, False, True]),
          "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
          "transposed": base.t(), "strided": base[::2, 1:]}
    assert not sd["transposed"].is_contiguous()
    v = repo.save("dtypes", sd)
    _equal_sd(repo.load("dtypes", v), sd)


def test_module_round_trip_with_buffers_in_place(repo):
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                      nn.LazyLinear(2) if False else nn.Linear(4 * 6 * 6, 2))
    m(torch.randn(2, 3, 8, 8))  # running stats and num_batches_tracked move
    repo.save("cnn", m)
    fresh = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 2))
    assert repo.load("cnn", into=fresh) is fresh
    _equal_sd(fresh.state_dict(), m.state_dict())
    assert int(fresh[1].num_batches_tracked) == 1


def test_stable_ids_ignore_names_and_construction_order():
    torch.manual_seed(0)
    a, b = fm.capture(Net()), fm.capture(Renamed())
    assert a.source == b.source == "fx"
    assert [lf.id for lf in a.leaves] == [lf.id for lf in b.leaves]
    assert len({lf.id for lf in a.leaves}) == len(a.leaves)  # repeated blocks differ
    assert a.leaves[1].name == "blocks.0.lin" and a.leaves[1].inputs == [0]
    # the residual: blocks.0.norm reads embed and blocks.0.lin (inputs in graph order)
    names = [lf.name for lf in a.leaves]
    assert a.leaves[names.index("blocks.0.norm")].inputs == [0, 1]
    assert a.leaves[names.index("blocks.1.lin")].inputs == [names.index("blocks.0.norm")]


def test_stable_ids_change_with_a_shape_or_an_edge():
    base = [lf.id for lf in fm.capture(Net()).leaves]
    wider = [lf.id for lf in fm.capture(Net(out=5)).leaves]
    assert wider[:-1] == base[:-1] and wider[-1] != base[-1]  # only the head changes

    class NoResidual(Block):
        def forward(self, x):
            return self.norm(torch.relu(self.lin(x)))

    n = Net()
    n.blocks[2] = NoResidual(16)
    edged = [lf.id for lf in fm.capture(n).leaves]
    k = 1 + 2 * 2 + 1  # blocks.2.norm: its inputs changed, and everything downstream
    assert edged[:k] == base[:k] and all(x != y for x, y in zip(edged[k:], base[k:]))


def test_untraceable_models_fall_back_to_module_order():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent: torch.fx cannot trace it
                x = self.a(x)
            return self.b(x)

    arch = fm.capture(Branchy())
    assert arch.source == "module order"
    assert [lf.inputs for lf in arch.leaves] == [[], [0]]


def test_partial_load_reads_only_the_selected_tensors(repo):
    torch.manual_seed(1)
    m = Net()
    v = repo.save("net", m)
    sd = m.state_dict()
    before = repo.stats()["bytes_read"]
    got = repo.load("net", v, include="blocks.3.*")
    assert sorted(got) == sorted(k for k in sd if k.startswith("blocks.3."))
    want = sum(sd[k].numel() * sd[k].element_size() for k in got)
    assert repo.stats()["bytes_read"] - before == want
    for k in got:
        assert torch.equal(got[k], sd[k])
    # by module path and by leaf ID
    assert sorted(repo.load("net", include=["head"])) == ["head.bias", "head.weight"]
    lid = fm.capture(m).ids()["embed"]
    assert sorted(repo.load("net", include=lid)) == ["embed.bias", "embed.weight"]
    with pytest.raises(ModelNotFoundError, match="nothing matches"):
        repo.load("net", include="nope.*")


def test_a_new_version_stores_only_the_changed_layer(repo):
    torch.manual_seed(2)
    m = Net(d=64)
    repo.save("net", m)
    s1 = repo.stats()
    with torch.no_grad():
        m.blocks[1].lin.weight.add_(1.0)
    v2 = repo.save("net", m, metadata={"note": "one layer changed"})
    s2 = repo.stats()
    assert s2["stored_bytes"] - s1["stored_bytes"] == 64 * 64 * 4
    assert s2["logical_bytes"] == 2 * s1["logical_bytes"]
    m2 = repo.manifest("net", v2)
    assert m2["parent"] == 1 and m2["metadata"] == {"note": "one layer changed"}
    assert m2["new_bytes"] == 64 * 64 * 4
    assert s2["id_cache"]["hits"] >= len(fm.capture(m).leaves)  # second save: all cached


def test_load_matching_reuses_a_backbone_under_new_names(repo):
    torch.manual_seed(3)
    src = Net(out=3)
    repo.save("pretrained", src)
    dst = Renamed(out=10)  # same backbone, new head
    r = repo.load_matching("pretrained", dst)
    assert r["graph"] == "fx"
    assert r["unmatched"] == ["classifier"]
    pairs = {d["into"]: d["stored"] for d in r["matched"]}
    assert pairs["stem"] == "embed" and pairs["layers.2.norm"] == "blocks.2.norm"
    assert torch.equal(dst.layers[2].lin.weight, src.blocks[2].lin.weight)
    assert torch.equal(dst.stem.bias, src.embed.bias)


def test_loading_into_other_shapes_lists_every_mismatch(repo):
    repo.save("net", Net(d=16))
    with pytest.raises(ModelMismatchError) as e:
        repo.load("net", into=Net(d=32))
    msg = str(e.value)
    assert "embed.weight: stored float32(16, 8), module has float32(32, 8)" in msg
    assert "blocks.3.norm.bias" in msg


def test_store_without_a_sizes_table_is_indexed_on_open(tmp_path):
    # stores written before the sizes table existed: it is built on first open, then
    # saves, stats and gc use it
    import lmdb

    path = tmp_path / "old"
    r = fm.open_repository(str(path))
    sd = {"a": torch.randn(64, 64), "b": torch.randn(1000)}
    r.save("m", sd)
    stored = r.stats()["stored_bytes"]
    r.close()
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"sizes", txn=txn), delete=True)
    env.close()
    r = fm.open_repository(str(path))
    st = r.stats()
    assert (st["tensors"], st["stored_bytes"]) == (2, stored)
    sd["b"] = torch.randn(1000)                   # one changed tensor
    r.save("m", sd)
    assert r.stats()["tensors_written"] == 1 and r.stats()["tensors_deduplicated"] == 1
    r.delete("m", 1)
    gone = r.gc(grace_seconds=0)
    assert gone["tensors_removed"] == 1 and r.stats()["tensors"] == 2
    assert torch.equal(r.load("m")["b"], sd["b"]) and r.verify() == []
    r.close()


def test_large_tensors_are_read_at_their_recorded_location(tmp_path):
    import json as _json

    import lmdb

    path = tmp_path / "loc"
    r = fm.open_repository(str(path))
    sd = {"big": torch.randn(512, 512), "also": torch.randn(300, 300), "small": torch.randn(8),
          "bias": torch.randn(1024), "bias2": torch.randn(600)}
    r.save("m", sd)
    m = r.manifest("m")
    assert all("loc" in m["tensors"][k] for k in ("big", "also", "bias", "bias2"))
    assert "loc" not in m["tensors"]["small"]               # inside a B-tree leaf: via LMDB
    assert torch.equal(r.load("m", include=["bias", "bias2"])["bias2"], sd["bias2"])
    sd2 = dict(sd, also=torch.randn(300, 300))
    r.save("m", sd2)                                       # unchanged tensor keeps its loc
    assert r.manifest("m")["tensors"]["big"]["loc"] == m["tensors"]["big"]["loc"]
    before = r.stats()["bytes_read"]
    part = r.load("m", include="big")
    assert torch.equal(part["big"], sd["big"])
    assert r.stats()["bytes_read"] - before == sd["big"].numel() * 4
    r.close()
    # a stale location (say the store was compacted): read through the map instead
    env = lmdb.open(str(path), max_dbs=4)
    db = env.open_db(b"versions")
    with env.begin(write=True) as txn:
        for k, v in list(txn.cursor(db=db)):
            man = _json.loads(bytes(v))
            for e in man["tensors"].values():
                if "loc" in e:
                    e["loc"] += 4096
            txn.put(bytes(k), _json.dumps(man).encode(), db=db)
    env.close()
    r = fm.open_repository(str(path))
    back = r.load("m", version=2)
    assert all(torch.equal(back[k], sd2[k]) for k in sd2)
    into = {k: torch.zeros_like(v) for k, v in sd2.items()}
    r.load("m", version=2, into=into)
    man = r.manifest("m", 2)
    man["tensors"]["big"]["loc"] = -7                      # nonsense: read through the map
    r._fetch(man, [("big", into["big"])])
    assert torch.equal(into["big"], sd2["big"])
    assert all(torch.equal(into[k], sd2[k]) for k in sd2)
    loc = r.manifest("m", 1)["tensors"]["big"]["loc"] - 4096
    r.close()
    # bytes corrupted on disk where they are: named, whichever way they are read
    with open(path / "data.mdb", "r+b") as fh:
        fh.seek(loc + 1000)
        b = fh.read(1)
        fh.seek(loc + 1000)
        fh.write(bytes([b[0] ^ 0x10]))
    r = fm.open_repository(str(path))
    with pytest.raises(CorruptModelError, match=r"tensor 'big' .*corrupt"):
        r.load("m", version=1)
    r.close()


def test_corrupt_tensor_is_named(repo, tmp_path, cli):
    from conftest import corrupt_stored_tensor

    m = Net()
    repo.save("net", m)
    man = repo.manifest("net")
    repo.close()
    corrupt_stored_tensor(tmp_path / "repo", man["tensors"]["blocks.1.lin.weight"]["hash"])
    r = fm.open_repository(str(tmp_path / "repo"))
    with pytest.raises(CorruptModelError, match=r"model 'net' version 1: tensor "
                       r"'blocks.1.lin.weight' .*corrupt"):
        r.load("net")
    assert r.load("net", include="head.*")  # the rest still loads
    assert any("blocks.1.lin.weight" in p for p in r.verify())
    r.close()
    code, _, err = cli("models", "verify", tmp_path / "repo")
    assert code == 1 and "CORRUPT net version 1: tensor 'blocks.1.lin.weight'" in err


def test_delete_and_gc(repo):
    torch.manual_seed(4)
    a, b = Net(), Net()
    repo.save("a", a)
    repo.save("b", b)
    n = repo.stats()["stored_bytes"]
    assert repo.gc() == {"tensors_removed": 0, "bytes_freed": 0, "stale_saves": 0}
    repo.delete("b", 1)
    r = repo.gc()
    assert r["tensors_removed"] > 0 and repo.stats()["stored_bytes"] == n - r["bytes_freed"]
    _equal_sd(repo.load("a"), a.state_dict())
    with pytest.raises(ModelNotFoundError, match="no model named 'b'"):
        repo.load("b")
    with pytest.raises(ModelNotFoundError, match=r"no version 7 of 'a'.*versions: \[1\]"):
        repo.load("a", 7)


def test_memory_backend_and_urls(tmp_path):
    r = fm.open_repository("memory://shared")
    r.save("m", Net())
    again = fm.open_repository("memory://shared")
    assert again.versions("m") == [1]
    assert fm.open_repository("memory://").list() == {}
    with pytest.raises(ModelRepositoryError, match="unknown repository URL scheme"):
        fm.open_repository("s3://bucket/x")
    with pytest.raises(ModelRepositoryError, match="cannot reach the model provider"):
        fm.open_repository("tcp://127.0.0.1:1").list()
    with pytest.raises(ModelRepositoryError, match="expected tcp://host:port"):
        fm.open_repository("tcp://nohost")
    with pytest.raises(ModelRepositoryError, match="bad model name"):
        r.save("../etc", Net())
    with pytest.raises(ModelRepositoryError, match="JSON"):
        r.save("m", Net(), metadata={"f": object()})
    with pytest.raises(TypeError, match="nn.Module or a state dict"):
        r.save("m", [1, 2])
    with pytest.raises(ModelRepositoryError, match="not a tensor"):
        r.save("m", {"w": np.zeros(3)})
    with pytest.raises(ModelRepositoryError, match="no model repository"):
        fm.open_repository(str(tmp_path / "missing"), create=False)


def rank_save_versions(url: str, name: str, n: str, seed: str, count: str) -> None:
    """A writer process: ``count`` versions of an ``n``-layer model, each announced."""
    import torch

    repo = fm.open_repository(url)
    torch.manual_seed(int(seed))
    m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(int(n))])
    print("READY", flush=True)
    for k in range(int(count)):
        with torch.no_grad():
            m[k % int(n)].weight.add_(1)
        v = repo.save(name, m, metadata={"seed": int(seed), "k": k})
        print("SAVED", v, flush=True)


def _spawn(tmp_path, *args):
    from conftest import rank_command

    cmd, env = rank_command(rank_save_versions, [str(a) for a in args])
    return subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE, text=True,
                            env=env)


def test_concurrent_writers_get_consistent_versions(tmp_path):
    url = f"file://{tmp_path / 'repo'}"
    procs = [_spawn(tmp_path, url, "shared", 4, seed, 3) for seed in range(4)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    got = sorted(int(line.split()[1]) for o in outs for line in o.splitlines()
                 if line.startswith("SAVED"))
    assert got == list(range(1, 13))  # 12 saves, 12 distinct versions
    r = fm.open_repository(url)
    assert r.versions("shared") == list(range(1, 13))
    assert r.verify() == []
    for v in r.versions("shared"):  # every version whole and loadable
        m = r.manifest("shared", v)
        sd = r.load("shared", v)
        assert len(sd) == 8 and m["metadata"]["k"] in (0, 1, 2)


def test_kill_during_save_leaves_the_previous_version(tmp_path):
    url = f"file://{tmp_path / 'repo'}"
    p = _spawn(tmp_path, url, "big", 64, 0, 1)  # one save first, to completion
    assert p.communicate(timeout=240)[0].count("SAVED") == 1
    r = fm.open_repository(url)
    first = r.load("big", 1)
    r.close()
    p = _spawn(tmp_path, url, "big", 64, 1, 1000)  # saves in a loop: kill it mid-way
    assert p.stdout.readline().startswith("READY")
    time.sleep(1.0)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    saved = p.stdout.read().count("SAVED")
    p.stdout.close()
    r = fm.open_repository(url)
    assert r.verify() == []
    versions = r.versions("big")
    assert versions == list(range(1, 2 + saved)) or versions == list(range(1, 3 + saved))
    for v in versions:  # whatever was published is whole
        assert len(r.load("big", v)) == 128
    _equal_sd(r.load("big", 1), first)
    r.gc(grace_seconds=0)  # tensors of the killed save: unreferenced, removed
    assert r.verify() == []
    _equal_sd(r.load("big", 1), first)


def test_cli_models(tmp_path, cli):
    r = fm.open_repository(str(tmp_path / "repo"))
    r.save("net", Net(), metadata={"lr": 0.1})
    r.close()
    code, out, _ = cli("models", "ls", tmp_path / "repo")
    assert code == 0 and "net" in out and "versions 1..1" in out
    code, out, _ = cli("models", "show", tmp_path / "repo", "net")
    assert code == 0 and "edges from fx" in out and "blocks.2.lin" in out and '"lr": 0.1' in out
    assert "(no parent)" in out and "None" not in out          # it printed "parent None"
    code, out, _ = cli("models", "verify", tmp_path / "repo")
    assert code == 0 and out.startswith("ok: 1 versions")
    code, out, _ = cli("models", "gc", tmp_path / "repo")
    assert code == 0 and "removed 0 tensors" in out


def test_read_only_commands_never_create_a_repository(tmp_path, cli):
    """`models ls|verify|show|gc DIR` on a directory that is not a repository fail with
    a message and create nothing (they used to create data.mdb and report 'no models')."""
    import lmdb

    empty, mine = tmp_path / "empty", tmp_path / "mine"
    empty.mkdir()
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    other = tmp_path / "other-lmdb"   # an LMDB store of some other program
    env = lmdb.open(str(other), max_dbs=2)
    env.open_db(b"stuff")
    env.close()
    before = {p: sorted(x.name for x in p.iterdir()) for p in (empty, mine, other)}
    for d in (empty, mine, other):
        for args in (("ls", d), ("verify", d), ("show", d, "net"), ("gc", d)):
            code, out, err = cli("models", *args)
            assert code == 2 and "model repository" in err and "Traceback" not in err, args
            assert "no models" not in out and "ok:" not in out
    assert before == {p: sorted(x.name for x in p.iterdir()) for p in (empty, mine, other)}
    with pytest.raises(ModelRepositoryError, match="not a forebay model repository"):
        fm.open_repository(str(other), create=False)


def test_corrupt_large_tensor_detected_while_copying():
    r = fm.open_repository("memory://")
    sd = {"big": torch.randn(1024, 1024), "small": torch.randn(4)}  # 4 MiB: verified in parallel
    r.save("m", sd)
    h = r.manifest("m")["tensors"]["big"]["hash"].encode()
    bad = bytearray(r.backend.tables["tensors"][h])
    bad[-1] ^= 1
    r.backend.tables["tensors"][h] = bytes(bad)
    with pytest.raises(CorruptModelError, match=r"tensor 'big' .*corrupt"):
        r.load("m")
    dst = {k: torch.zeros_like(t) for k, t in sd.items()}
    with pytest.raises(CorruptModelError, match="the tensor loaded into holds them"):
        r.load("m", into=dst)
    assert torch.equal(r.load("m", include="small")["small"], sd["small"])


def test_corruption_found_on_either_copying_thread():
    # large tensors are split between the loading thread and a helper; a corrupt one is
    # named whichever side copied it
    r = fm.open_repository("memory://")
    sd = {f"t{i}": torch.randn(256, 1024) for i in range(4)}    # 1 MiB each
    r.save("m", sd)
    for victim in sd:
        h = r.manifest("m")["tensors"][victim]["hash"].encode()
        good = r.backend.tables["tensors"][h]
        bad = bytearray(good)
        bad[12345] ^= 0x40
        r.backend.tables["tensors"][h] = bytes(bad)
        with pytest.raises(CorruptModelError, match=rf"tensor '{victim}' .*corrupt"):
            r.load("m")
        r.backend.tables["tensors"][h] = good
    back = r.load("m")
    assert all(torch.equal(back[k], v) for k, v in sd.items())


def test_saves_and_loads_are_traced(tmp_path):
    import gzip
    import json

    import forebay.trace as trace

    trace.enable(tmp_path / "tr")
    r = fm.open_repository("memory://")
    v = r.save("net", Net())
    r.load("net", v, include="head.*")
    trace.disable()
    ev = [json.loads(x) for f in (tmp_path / "tr").glob("*.pfw.gz") for x in gzip.open(f, "rt")]
    ck = [e for e in ev if e["cat"] == "checkpoint"]
    assert [e["name"] for e in ck] == ["save", "load"]
    assert ck[0]["args"]["model"] == "net" and ck[0]["args"]["version"] == v
    assert ck[1]["args"]["count"] == 2 and ck[1]["args"]["size"] == (16 * 3 + 3) * 4


def test_located_reads_coalesce_neighbours_and_flag_bad_ones(tmp_path):
    """``_pread_and_hash`` on a real file: neighbours within the gap are read by one call
    (the gap discarded), far ones and 1 MiB-plus tensors in pieces; a read past the end
    or at a nonsense offset comes back None, the others are still right."""
    import os as _os

    import xxhash
    from forebay.models import _tensors

    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 6 << 20, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    spans = [(0, 4096), (4096 + 16, 4096), (20000, 1500), (20000 + 1500 + 60000, 3000),
             (400000, (2 << 20) + 123), (3 << 20, 5000), (len(data) - 100, 4096), (-5, 10),
             (5 << 20, 0)]
    jobs = [(np.zeros(n, dtype=np.uint8), off, b"h|") for off, n in spans]
    fd = _os.open(path, _os.O_RDONLY)
    try:
        got = _tensors._pread_and_hash(fd, jobs)
    finally:
        _os.close(fd)
    for (off, n), (dst, _, _), h in zip(spans, jobs, got):
        if off < 0 or off + n > len(data):
            assert h is None
            continue
        assert np.array_equal(dst, data[off:off + n])
        want = xxhash.xxh3_128(b"h|" + data[off:off + n].tobytes()).hexdigest()
        assert h == want
    halves = _tensors._file_halves([off for off, _ in spans[:6]], [n for _, n in spans[:6]])
    assert sorted(halves[0] + halves[1]) == list(range(6))
    assert halves[1] == [4, 5] and halves[0] == [0, 1, 2, 3]   # file order, cut by bytes


def test_tensors_shared_with_another_model_get_their_location(tmp_path):
    """A fine-tuned model saved under a new name shares its backbone (and zero biases)
    with the base: those tensors are not written again, and the new manifest still
    records where they are (the ``locs`` table), so its loads read them with preadv."""
    r = fm.open_repository(str(tmp_path / "r"))
    base = {"backbone.w": torch.randn(256, 256), "backbone.b": torch.zeros(1024),
            "head.w": torch.randn(10, 256)}
    r.save("base", base)
    ft = dict(base, **{"head.w": torch.randn(10, 256)})
    r.save("finetuned", ft)
    mb, mf = r.manifest("base"), r.manifest("finetuned")
    for k in ("backbone.w", "backbone.b"):
        assert mf["tensors"][k]["loc"] == mb["tensors"][k]["loc"]
    assert "loc" in mf["tensors"]["head.w"]
    back = r.load("finetuned")
    assert all(torch.equal(back[k], ft[k]) for k in ft)
    # a store written before the table: the small shared tensor is located by reading it
    with r.backend.write() as txn:
        for k, _ in list(txn.items("locs", values=False)):
            txn.delete("locs", k)
    r.save("another", {"b": torch.zeros(1024), "w": base["backbone.w"]})
    ma = r.manifest("another")
    assert ma["tensors"]["b"]["loc"] == mb["tensors"]["backbone.b"]["loc"]
    assert "loc" not in ma["tensors"]["w"]      # large, stored before, not read to find it
    # gc drops the locations of the tensors it removes
    r.delete("base", 1)
    r.delete("finetuned", 1)
    r.delete("another", 1)
    r.gc(grace_seconds=0)
    with r.backend.read() as txn:
        assert list(txn.items("locs", values=False)) == []
    r.close()


def test_lmdb_store_on_a_shared_file_system_is_refused_unless_vouched_for(tmp_path,
                                                                         monkeypatch):
    """LMDB's locks do not hold across nodes: a store on Lustre, GPFS, NFS... is refused
    with a message naming the file system and the way out (a provider), unless the user
    sets FOREBAY_LMDB_SHARED_FS=1; a local store opens as before."""
    from forebay import _fs
    from forebay.models import _backend

    home = str(tmp_path / "my home").replace(" ", "\\040")   # as /proc/mounts escapes it
    table = ("/dev/vda / ext4 rw 0 0\n"
             f"10.0.0.1@o2ib:/scratch {tmp_path / 'lus'} lustre rw,flock 0 0\n"
             f"srv:/home/a\\040b {home} nfs4 rw 0 0\n")
    assert _fs.filesystem_type(tmp_path / "lus" / "models" / "new", table) == "lustre"
    assert _fs.filesystem_type(tmp_path / "my home" / "x", table) == "nfs4"
    assert _fs.filesystem_type(tmp_path / "elsewhere", table) == "ext4"
    (tmp_path / "lus").mkdir()
    mounts = tmp_path / "mounts"
    mounts.write_text(table)
    monkeypatch.setattr(_fs, "_MOUNTS", str(mounts))
    monkeypatch.delenv(_backend.SHARED_FS_ENV, raising=False)
    with pytest.raises(ModelRepositoryError, match=r"is on lustre.*forebay models serve"):
        fm.open_repository(f"file://{tmp_path / 'lus' / 'repo'}")
    assert not (tmp_path / "lus" / "repo").exists()          # nothing created
    monkeypatch.setenv(_backend.SHARED_FS_ENV, "1")
    with fm.open_repository(f"file://{tmp_path / 'lus' / 'repo'}") as r:
        r.save("m", {"w": torch.ones(3)})
    monkeypatch.delenv(_backend.SHARED_FS_ENV)
    with fm.open_repository(f"file://{tmp_path / 'local'}") as r:   # ext4: as before
        r.save("m", {"w": torch.ones(3)})


def test_compact_shrinks_the_store_and_finds_locations_again(tmp_path, cli):
    """After versions are deleted and gc'ed, LMDB keeps its file size; ``compact`` writes
    a smaller copy whose manifests point at the tensors' new places (checked against
    the file's bytes), every version still loads bit-exact, and the source is unchanged."""
    import os as _os

    src, dst = tmp_path / "src", tmp_path / "dst"
    r = fm.open_repository(str(src))
    torch.manual_seed(0)
    kept = {}
    for v in range(6):
        sd = {f"l{i}": torch.randn(64, 256) for i in range(6)}
        sd["b"] = torch.randn(1024)
        r.save("m", sd)
        kept[v + 1] = sd
    for v in (1, 2, 3, 4):
        r.delete("m", v)
    r.gc(grace_seconds=0)
    size_src = _os.path.getsize(src / "data.mdb")
    man_src = r.manifest("m", 6)
    out = r.compact(dst)
    assert out["bytes_before"] == size_src
    assert out["bytes_after"] < size_src * 0.6
    r.close()
    c = fm.open_repository(str(dst))
    assert c.versions("m") == [5, 6] and c.verify() == []
    raw = (dst / "data.mdb").read_bytes()
    man = c.manifest("m", 6)
    moved = 0
    for k, e in man["tensors"].items():
        want = kept[6][k].numpy().tobytes()
        assert raw[e["loc"]:e["loc"] + e["nbytes"]] == want       # a true location
        moved += e["loc"] != man_src["tensors"][k]["loc"]
    assert moved > 0
    for v in (5, 6):
        back = c.load("m", version=v)
        assert all(torch.equal(back[k], kept[v][k]) for k in kept[v])
    c.close()
    with fm.open_repository(str(src)) as again:                      # source unchanged
        assert again.manifest("m", 6) == man_src
    code, outp, err = cli("models", "compact", str(src), str(dst))
    assert code == 2 and "not a new or empty directory" in err
    code, outp, _ = cli("models", "relocate", str(dst))
    assert code == 0 and "0 manifests rewritten" in outp


def test_ls_points_at_compact_when_the_file_is_mostly_free_pages(tmp_path, cli):
    src, dst = tmp_path / "src", tmp_path / "dst"
    with fm.open_repository(str(src)) as r:
        for v in range(6):
            r.save("m", {f"w{i}": torch.full((1536, 1024), float(v * 10 + i))
                         for i in range(4)})                     # 24 MiB per version
        for v in range(1, 6):
            r.delete("m", v)
        r.gc(grace_seconds=0)
        st = r.stats()
        assert st["file_bytes"] > 5 * st["stored_bytes"]
    code, out, _ = cli("models", "ls", str(src))
    assert code == 0 and "forebay models compact" in out
    code, out, _ = cli("models", "compact", str(src), str(dst))
    assert code == 0
    code, out, _ = cli("models", "ls", str(dst))
    assert code == 0 and "compact" not in out and "versions 6..6" in out


def test_a_store_opens_under_a_virtual_memory_limit(tmp_path):
    """LMDB mapped 1 TiB: under `ulimit -v 16000000` no repository opened.  Now a smaller
    map is chosen, and a save and a load work."""
    import subprocess
    import sys

    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (16_000_000_000, 16_000_000_000))\n"
        "import torch, forebay.models as fm\n"
        "with fm.open_repository(sys.argv[1]) as r:\n"
        "    r.save('m', {'w': torch.arange(10.0)})\n"
        "    assert r.load('m')['w'].tolist() == list(range(10))\n"
        "    print('map', r.backend.env.info()['map_size'])\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "repo")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert 0 < int(p.stdout.split()[-1]) < 16_000_000_000


# ---------------------------------------------------------------- a file system that fills

def test_a_repository_on_a_full_file_system_is_refused_with_the_numbers(small_fs, cli):
    """X item 5: creating a repository where no byte is free died with SIGBUS (LMDB
    writes its lock file through a map) and left lock.mdb; now one line, nothing left."""
    (small_fs / "fill").write_bytes(b"\0" * (1 << 20))      # ENOSPC past what fits
    code, out, err = cli("models", "ls", f"file://{small_fs}/new")   # a reader: no store
    assert code == 2 and "no model repository" in err, err
    p = subprocess.run([sys.executable, "-c", "import forebay.models as fm; "
                        f"fm.open_repository('file://{small_fs}/repo')"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])        # not -SIGBUS
    last = p.stderr.strip().splitlines()[-1]
    assert "ModelRepositoryError" in last and "cannot create a model repository: the file " \
        "system is full: need about 256.0 KiB, 0 B free" in last, last
    assert sorted(q.name for q in small_fs.iterdir()) == ["fill"]


def test_a_save_that_does_not_fit_says_so_and_keeps_what_was_stored(small_fs):
    """X item 5: a save on a full file system raised lmdb.Error "Input/output error";
    now the numbers, and the versions stored before are whole and the repository goes
    on once there is room."""
    repo = fm.open_repository(f"file://{small_fs}/repo")
    torch.manual_seed(0)
    small = nn.Linear(16, 16)
    repo.save("small", small)
    with pytest.raises(ModelRepositoryError, match=r"the file system is full: need about "
                       r"1\.3 MiB, .* free in .*; nothing of this write was stored"):
        repo.save("big", nn.Linear(512, 512))
    assert repo.list() == {"small": [1]}
    sd = repo.load("small")
    assert all(torch.equal(sd[k], v) for k, v in small.state_dict().items())
    repo.save("small2", nn.Linear(8, 8))
    assert set(repo.list()) == {"small", "small2"}
    repo.close()

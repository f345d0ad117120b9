"""The node-local cache that outlives the job (issue U, item 1): a second job on the
node reads what the first read from node-local storage, bit-exact; a changed dataset
never uses the old copy; damaged records are read again; the cap evicts the least
recently used dataset no job uses; a killed job leaves no lock held; ``forebay cache``
shows and clears it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import forebay  # noqa: E402
from forebay.errors import InvalidArgumentError  # noqa: E402
from forebay.store import NodeCache, cache_entries, node_cache_key  # noqa: E402
from forebay.torch import Clairvoyant, DataLoader, Direct, Pipeline, Preload  # noqa: E402

SAMPLES, BATCH = 96, 8


def _write(path, seed=0, n=SAMPLES, size=1000):
    rng = np.random.default_rng(seed)
    forebay.write_dataset(path, ({"x": rng.integers(0, 255, size + i % 7, dtype=np.uint8),
                                  "label": np.int64(i)} for i in range(n)), overwrite=True)
    return path


def _epoch(path, cache=None, kind="direct", **kw):
    """One epoch's batches (their bytes) and the loader's stats."""
    store = {"direct": Direct, "preload": Preload,
             "clairvoyant": Clairvoyant}[kind](node_cache=cache)
    dl = DataLoader(path, BATCH, comm=None, seed=3, store=store,
                    pipeline=Pipeline(collate_fn=lambda b: [bytes(np.asarray(b.sample(k)["x"]))
                                          for k in range(len(b.ids))]),
                    **kw)
    out = [b for b in dl]
    st = dl.stats()
    dl.close()
    return out, st


@pytest.mark.parametrize("kind", ["direct", "preload", "clairvoyant"])
def test_a_second_job_reads_the_node_cache_bit_exact(tmp_path, kind):
    ds = _write(tmp_path / "pfs" / "ds")
    want, plain = _epoch(ds)
    first, st1 = _epoch(ds, tmp_path / "cache", kind)
    assert first == want
    assert st1["pfs_reads"] == SAMPLES and st1["node_cache_misses"] == SAMPLES
    second, st2 = _epoch(ds, tmp_path / "cache", kind)      # the next job on the node
    assert second == want
    assert st2["pfs_reads"] == 0 and st2["node_cache_misses"] == 0
    if kind == "direct":
        assert st2["fetches_by_source"] == {"local": SAMPLES}
    [e] = cache_entries(tmp_path / "cache")
    assert e["cached_samples"] == e["samples"] == SAMPLES and not e["in_use"]
    assert e["fingerprint"] == node_cache_key(forebay.open_dataset(ds))


@pytest.mark.parametrize("kind", ["direct", "preload", "clairvoyant"])
def test_a_dataset_that_grew_between_jobs_keeps_its_cached_generations(tmp_path, kind):
    """The copy is keyed by the first generation: the next job over the grown dataset
    reads only the new generation from the files; a dataset replaced after its first
    generation does not use the old copy's later ones."""
    ds = _write(tmp_path / "ds")
    _epoch(ds, tmp_path / "cache", kind)
    forebay.append(ds, ({"x": np.full(900, i % 251, np.uint8), "label": np.int64(i)}
                        for i in range(SAMPLES, SAMPLES + 40)))
    want, _ = _epoch(ds)
    got, st = _epoch(ds, tmp_path / "cache", kind)
    assert got == want and st["pfs_reads"] == 40 and st["node_cache_misses"] == 40
    [e] = cache_entries(tmp_path / "cache")
    assert e["samples"] == e["cached_samples"] == SAMPLES + 40
    # the same first generation, another second one: the cached second is not used
    shutil.rmtree(ds)
    _write(ds)
    forebay.append(ds, ({"x": np.full(900, 7, np.uint8), "label": np.int64(-i)}
                        for i in range(40)))
    want, _ = _epoch(ds)
    got, st = _epoch(ds, tmp_path / "cache", kind)
    assert got == want and st["pfs_reads"] == SAMPLES + 40


@pytest.mark.parametrize("kind", [Direct, Preload, Clairvoyant])
def test_a_loader_following_appends_reads_only_new_generations_from_the_files(tmp_path,
                                                                               kind):
    ds = _write(tmp_path / "ds", n=40)
    pipe = Pipeline(collate_fn=_labels)
    with DataLoader(ds, BATCH, comm=None, seed=3, epochs=2, follow_appends=True,
                    store=kind(node_cache=tmp_path / "cache"), pipeline=pipe) as dl:
        assert sum(len(b) for b in dl) == 40 and dl.stats()["pfs_reads"] == 40
        forebay.append(ds, ({"x": np.full(900, i % 251, np.uint8), "label": np.int64(i)}
                            for i in range(40, 64)))
        dl.set_epoch(1)
        got = [x for b in dl for x in b]
        plan = forebay.AccessPlan(64, 1, BATCH, 2, seed=3)
        assert got == plan.batches(0, 1).ravel().tolist()
        assert dl.stats()["pfs_reads"] == 24            # the new generation, once
    with DataLoader(ds, BATCH, comm=None, seed=3, epochs=2, follow_appends=True,
                    store=kind(node_cache=tmp_path / "cache"), pipeline=pipe) as again:
        list(again)
        assert again.stats()["pfs_reads"] == 0          # the next job: from the node


def _labels(b):
    return b["label"].tolist()


def rank_cached(ds: str, cache: str) -> None:
    """Three jobs' loaders in turn on every rank, for a preload and a clairvoyant
    store: without the cache, filling it, and reading from it."""
    def epoch(kind, c):
        with DataLoader(ds, BATCH, seed=3, store=kind(node_cache=c),
                        pipeline=Pipeline(collate_fn=_labels)) as dl:
            return [b for b in dl], dl.stats()

    want, _ = epoch(Direct, None)        # the plan's batches, whatever the store
    for kind in (Preload, Clairvoyant):
        where = f"{cache}/{kind.mode}"
        first, st1 = epoch(kind, where)
        second, st2 = epoch(kind, where)
        assert first == want and second == want, kind
        assert st1["pfs_reads"] == st1["node_cache_misses"] > 0, kind
        assert st2["pfs_reads"] == 0, (kind, st2)


@pytest.mark.mpi
def test_each_rank_reads_its_share_from_the_node_cache(tmp_path):
    """Under mpiexec -n 2: what each rank read (a preload's chunk, a clairvoyant
    store's tiers and misses) kept, and read from there by the next job."""
    pytest.importorskip("mpi4py")
    from conftest import assert_ranks_ok, run_ranks

    ds = _write(tmp_path / "ds")
    assert_ranks_ok(run_ranks(2, rank_cached, ds, tmp_path / "cache"), 2)
    for kind in ("preload", "clairvoyant"):
        assert cache_entries(tmp_path / "cache" / kind)[0]["cached_samples"] == SAMPLES


def test_the_environment_names_the_cache_and_other_modes_are_told(tmp_path, monkeypatch):
    ds = _write(tmp_path / "ds")
    monkeypatch.setenv("FOREBAY_NODE_CACHE", str(tmp_path / "env-cache"))
    _epoch(ds)
    assert cache_entries(tmp_path / "env-cache")[0]["cached_samples"] == SAMPLES
    for store in ("preload", "clairvoyant"):                   # the variable: every kind
        with DataLoader(ds, BATCH, comm=None, store=store) as dl:
            list(dl)
            assert dl.stats()["node_cache_hits"] >= SAMPLES, store
            assert dl.stats()["pfs_reads"] == 0, store
    with pytest.raises(InvalidArgumentError, match="with a node cache the tier is a copy"):
        DataLoader(ds, BATCH, comm=None,
                   store=Clairvoyant(node_cache=tmp_path / "c", ram_tier="pages"))


def test_a_changed_dataset_never_uses_the_old_copy(tmp_path):
    ds = _write(tmp_path / "ds", seed=0)
    _epoch(ds, tmp_path / "cache")
    _write(tmp_path / "ds", seed=1)                          # rewritten in place
    want, _ = _epoch(ds)
    got, st = _epoch(ds, tmp_path / "cache")
    assert got == want and st["pfs_reads"] == SAMPLES        # nothing of the old copy
    assert len(cache_entries(tmp_path / "cache")) == 2


@pytest.mark.parametrize("kind", ["direct", "preload", "clairvoyant"])
def test_a_damaged_cached_record_is_read_again(tmp_path, kind):
    ds = _write(tmp_path / "ds")
    want, _ = _epoch(ds)
    _epoch(ds, tmp_path / "cache", kind)
    src = forebay.open_dataset(ds)
    d = tmp_path / "cache" / node_cache_key(src)
    off = int(src.index[5, 0])                               # sample 5's record
    shard = d / src.manifest.shards[int(src.shard_of[5])].data
    with open(shard, "r+b") as fh:
        fh.seek(off + 3)
        b = fh.read(1)
        fh.seek(off + 3)
        fh.write(bytes([b[0] ^ 0xFF]))
    got, st = _epoch(ds, tmp_path / "cache", kind)
    assert got == want and st["pfs_reads"] == 1


def test_a_damaged_cached_manifest_is_a_stale_copy(tmp_path):
    ds = _write(tmp_path / "ds")
    want, _ = _epoch(ds, tmp_path / "cache")
    d = tmp_path / "cache" / node_cache_key(forebay.open_dataset(ds))
    (d / "manifest.json").write_text("{not json")
    got, st = _epoch(ds, tmp_path / "cache")          # evicted, made again, filled
    assert got == want and st["pfs_reads"] == SAMPLES
    assert cache_entries(tmp_path / "cache")[0]["cached_samples"] == SAMPLES


def test_the_cap_evicts_the_least_recently_used_and_reads_past_it(tmp_path):
    a, b = _write(tmp_path / "a", seed=0), _write(tmp_path / "b", seed=1)
    _epoch(a, tmp_path / "cache")
    one = cache_entries(tmp_path / "cache")[0]["bytes"]
    os.environ["FOREBAY_NODE_CACHE_BYTES"] = str(int(one * 1.5))
    try:
        want, _ = _epoch(b)
        got, st = _epoch(b, tmp_path / "cache")              # a (unused, older) goes
        assert got == want and st["pfs_reads"] == SAMPLES
        assert [e["source"] for e in cache_entries(tmp_path / "cache")] == [str(b)]
        # a cap below one dataset: what does not fit is read from the source, right
        os.environ["FOREBAY_NODE_CACHE_BYTES"] = str(one // 3)
        want_a, _ = _epoch(a)
        got_a, st_a = _epoch(a, tmp_path / "cache")
        assert got_a == want_a and st_a["node_cache_full"]
        assert 0 < cache_entries(tmp_path / "cache")[0]["cached_samples"] < SAMPLES
    finally:
        del os.environ["FOREBAY_NODE_CACHE_BYTES"]


def test_a_job_holding_the_cache_keeps_it_and_a_killed_one_does_not(tmp_path, cli):
    ds = _write(tmp_path / "ds")
    _epoch(ds, tmp_path / "cache")
    code = ("import sys, time, forebay; from forebay.store import NodeCache; "
            f"c = NodeCache({str(tmp_path / 'cache')!r}, forebay.open_dataset({str(ds)!r})); "
            "print('open', flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "open\n"
        assert cache_entries(tmp_path / "cache")[0]["in_use"]
        code_, out, err = cli("cache", "clear", tmp_path / "cache")
        assert code_ == 0 and "removed 0" in out and "kept 1 a running job uses" in out, out
        p.send_signal(signal.SIGKILL)                        # its locks go with it
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
    code_, out, err = cli("cache", "ls", tmp_path / "cache")
    assert code_ == 0 and "in use" not in out and "1 dataset(s)" in out, out
    code_, out, err = cli("cache", "clear", tmp_path / "cache")
    assert code_ == 0 and "removed 1 dataset(s)" in out, out
    assert cache_entries(tmp_path / "cache") == []
    code_, out, err = cli("cache", "ls", tmp_path / "cache")
    assert code_ == 0 and "empty" in out


def rank_fill_and_die(ds: str, cache: str, writes: str) -> None:
    """Fill the node cache batch by batch (8 samples), the process killed (SIGKILL) in
    its ``writes``-th record's write: half of the record's bytes written, its batch's
    presence bytes not set yet."""
    real = os.pwrite
    done = [0]

    def pwrite(fd: int, data, offset: int) -> int:
        done[0] += 1
        if done[0] == int(writes):
            real(fd, bytes(data)[:len(data) // 2], offset)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(fd, data, offset)

    os.pwrite = pwrite                   # the system call the cache's writes go through
    c = NodeCache(cache, forebay.open_dataset(ds))
    ids = np.arange(SAMPLES)
    for b in range(0, SAMPLES, BATCH):
        c.ensure(ids[b:b + BATCH])
    raise AssertionError("the fill was not killed")


def test_a_job_killed_mid_fill_leaves_a_cache_the_next_job_completes(tmp_path):
    """A job dies (kill -9) while writing the cache, in the middle of a record: what it
    made present is kept, what it was writing is not used, and the next job reads the
    rest from the files and completes the copy, every batch bit-exact."""
    from conftest import rank_command

    ds = _write(tmp_path / "ds")
    want, _ = _epoch(ds)
    cmd, env = rank_command(rank_fill_and_die, [ds, tmp_path / "cache", 2 * BATCH + 4])
    p = subprocess.run([sys.executable, *cmd], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    (entry,) = cache_entries(tmp_path / "cache")
    assert not entry["in_use"]                            # its lock went with it
    after, st = _epoch(ds, tmp_path / "cache")
    assert after == want
    # the two batches it finished are read from the cache, the rest from the files
    assert st["node_cache_misses"] == SAMPLES - 2 * BATCH and st["pfs_reads"] == st[
        "node_cache_misses"]
    again, st = _epoch(ds, tmp_path / "cache")            # and the copy is now whole
    assert again == want and st["pfs_reads"] == 0 and st["node_cache_misses"] == 0


def test_views_and_single_samples_come_from_the_cache_too(tmp_path):
    ds = _write(tmp_path / "ds")
    src = forebay.open_dataset(ds)
    dl = DataLoader(ds, BATCH, comm=None, store=Direct(node_cache=tmp_path / "cache"),
                    pipeline=Pipeline(views=True, collate_fn=lambda v: [bytes(x) for x in v["x"]]))
    got = [b for b in dl]
    dl.close()
    order = [i for b in DataLoader(ds, BATCH, comm=None, store="direct",
                                   pipeline=Pipeline(collate_fn=lambda b: b.ids.tolist()))
             for i in b]
    assert [x for b in got for x in b] == [bytes(src[i]["x"]) for i in order]
    cache = NodeCache(tmp_path / "cache", src)
    assert cache.ensure(np.arange(SAMPLES)) and cache.hits == SAMPLES and cache.misses == 0
    cache.close()


def tagged(s):
    """A per-sample transform for the workers (module level: spawned workers import it)."""
    return {"x": bytes(np.asarray(s["x"])), "label": int(s["label"])}


def as_list(samples):
    return samples


def test_transform_workers_read_the_node_cache(tmp_path):
    """In direct mode the workers read their batches themselves: from the cache's copy,
    which the loader fills before it hands them the ids."""
    ds = _write(tmp_path / "ds")

    def run(cache):
        # fork: the workers start at once (the start method is not what is tested here)
        dl = DataLoader(ds, BATCH, comm=None, seed=3, store=Direct(node_cache=cache),
                        pipeline=Pipeline(transform=tagged, workers=2, collate_fn=as_list,
                                          worker_start="fork"))
        out = [[(s["label"], s["x"]) for s in b] for b in dl]
        st = dl.stats()
        dl.close()
        return out, st

    want, _ = run(None)
    first, st1 = run(tmp_path / "cache")
    second, st2 = run(tmp_path / "cache")
    assert first == want and second == want
    assert st1["pfs_reads"] == SAMPLES and st2["pfs_reads"] == 0
    os.environ["FOREBAY_NODE_CACHE_BYTES"] = "20000"      # past the cap: the loader reads
    try:
        full, st3 = run(tmp_path / "small-cache")
    finally:
        del os.environ["FOREBAY_NODE_CACHE_BYTES"]
    assert full == want and st3["node_cache_full"]

"""The loader's grouped settings: ``store=`` (a kind's name, its settings object, or a
store the caller built) and ``pipeline=``; the old flat keywords warned and translated."""

from __future__ import annotations

import numpy as np
import pytest

import forebay
from forebay.errors import InvalidArgumentError
from forebay.store import ClairvoyantStore, DirectStore, StoreError, tier_nbytes
from forebay.torch import (Auto, Clairvoyant, DataLoader, Direct, Pipeline, Preload,
                           store_settings)

N, BATCH = 97, 8


def _ids(batch):
    return batch.ids.copy()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("opt") / "ds.fb"
    rng = np.random.default_rng(5)
    forebay.write_dataset(p, ({"x": rng.integers(0, 255, 64 + i % 7, dtype=np.uint8),
                               "label": np.int64(i)} for i in range(N)),
                          shard_bytes=2 << 10)
    return p


def _run(path, **kw):
    with DataLoader(path, BATCH, comm=None, seed=3, epochs=2, **kw) as dl:
        out = []
        for e in range(2):
            dl.set_epoch(e)
            out += [b.tolist() for b in dl]
        return out, dl.mode


def test_each_kind_by_name_and_by_settings_gives_the_plans_batches(path):
    plan = forebay.AccessPlan(N, 1, BATCH, 2, seed=3)
    want = [b.tolist() for e in range(2) for b in plan.batches(0, e)]
    ram = int(tier_nbytes(forebay.open_dataset(path)).sum()) // 3
    for store, mode in (("preload", "preload"), (Preload(width=1), "preload"),
                        ("direct", "direct"), (Direct(warm_files=False), "direct"),
                        (Clairvoyant(ram_bytes=ram, ram_tier="copy"), "clairvoyant"),
                        (Auto(), "preload")):
        got, chosen = _run(path, store=store, pipeline=Pipeline(collate_fn=_ids))
        assert (got, chosen) == (want, mode), store


def test_the_old_keywords_warn_with_their_new_place_and_give_the_same_batches(path):
    ram = int(tier_nbytes(forebay.open_dataset(path)).sum()) // 3
    new, _ = _run(path, store=Clairvoyant(ram_bytes=ram), pipeline=Pipeline(collate_fn=_ids,
                                                                            prefetch=0))
    with pytest.warns(FutureWarning, match=r"pipeline=Pipeline\(collate_fn=\.\.\., prefetch="
                      r"\.\.\.\), store=Clairvoyant\(ram_bytes=\.\.\.\)"):
        old, mode = _run(path, mode="clairvoyant", ram_bytes=ram, collate_fn=_ids, prefetch=0)
    assert (old, mode) == (new, "clairvoyant")
    with pytest.warns(FutureWarning, match="store='direct'"):
        _run(path, mode="direct", collate_fn=_ids)


def test_mixed_or_unknown_spellings_are_refused(path):
    with pytest.raises(InvalidArgumentError, match="give store= or the keywords"):
        DataLoader(path, BATCH, comm=None, store="direct", mode="preload")
    with pytest.raises(InvalidArgumentError, match="give pipeline= or the keywords"):
        DataLoader(path, BATCH, comm=None, pipeline=Pipeline(), prefetch=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_workers'"):
        DataLoader(path, BATCH, comm=None, num_workers=2)
    with pytest.raises(InvalidArgumentError, match="pipeline must be a forebay.torch.Pipeline"):
        DataLoader(path, BATCH, comm=None, pipeline={"prefetch": 2})
    with pytest.raises(InvalidArgumentError, match="store must be one of"):
        DataLoader(path, BATCH, comm=None, store=Pipeline())


@pytest.mark.parametrize("make, match", [
    (lambda: Clairvoyant(ram_threads=0), r"Clairvoyant\(ram_threads=\) must be a positive"),
    (lambda: Clairvoyant(ram_bytes=-1), r"Clairvoyant\(ram_bytes=\) must be a non-negative"),
    (lambda: Preload(width=0), r"Preload\(width=\) must be a positive"),
    (lambda: Preload(overlap="sometimes"), r"Preload\(overlap=\) must be one of"),
    (lambda: Direct(warm_files="yes"), r"Direct\(warm_files=\) must be one of"),
    (lambda: Pipeline(staging_bytes=0), r"Pipeline\(staging_bytes=\) must be a positive"),
    (lambda: Pipeline(worker_start="threads"), r"Pipeline\(worker_start=\) must be one"),
    (lambda: Pipeline(transform=len, batch_transform=len), "transform or batch_transform"),
    (lambda: store_settings("lazy"), "mode must be one of"),
    (lambda: store_settings("direct", ram_byte=1), "no store kind has the setting 'ram_byte'"),
])
def test_settings_are_checked_where_they_are_made(make, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make()


def test_store_settings_keeps_what_applies_to_the_kind():
    assert store_settings("direct", ram_bytes=5, warm_files=False) == Direct(warm_files=False)
    assert store_settings("clairvoyant", ram_bytes=5, width=2) == Clairvoyant(ram_bytes=5)
    assert store_settings("auto", ram_bytes=5, width=2) == \
        Auto(Preload(width=2), Clairvoyant(ram_bytes=5))


def test_a_store_the_caller_built_serves_the_loader_and_stays_open(path):
    want, _ = _run(path, store="direct", pipeline=Pipeline(collate_fn=_ids))
    ds = forebay.open_dataset(path)
    store = DirectStore(ds)
    got, mode = _run(path, store=store, pipeline=Pipeline(collate_fn=_ids))
    assert (got, mode) == (want, "direct")
    assert store.get_many([4]).sample(0)["label"] == 4       # not closed by the loader
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get_many([4])
    plan = forebay.AccessPlan(N, 1, BATCH, 2, seed=3)
    ram = int(tier_nbytes(ds).sum()) // 3
    with ClairvoyantStore(ds, plan, comm=None, ram_bytes=ram) as clair:
        got, mode = _run(path, store=clair, pipeline=Pipeline(collate_fn=_ids))
        assert (got, mode) == (want, "clairvoyant")


def test_a_built_store_of_another_dataset_or_plan_is_refused(path, tmp_path):
    other = tmp_path / "other.fb"
    forebay.write_dataset(other, ({"x": np.zeros(3, np.uint8)} for _ in range(N)))
    with DirectStore(forebay.open_dataset(other)) as store:
        with pytest.raises(InvalidArgumentError, match="not this loader's dataset"):
            DataLoader(path, BATCH, comm=None, store=store)
    ds = forebay.open_dataset(path)
    with ClairvoyantStore(ds, forebay.AccessPlan(N, 1, BATCH, 2, seed=4), comm=None,
                          ram_bytes=1 << 20) as clair:
        with pytest.raises(InvalidArgumentError, match="another access plan"):
            DataLoader(path, BATCH, comm=None, seed=3, epochs=2, store=clair)

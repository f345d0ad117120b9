"""forebay.Mixture: weighted mixing of several datasets in the plan, the loader and
every store (single process; tests/mpi/test_mixture_mpi.py runs it on ranks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import forebay
from forebay import AccessPlan
from forebay.dataset import ConcatDataset
from forebay.errors import InvalidArgumentError, SchemaError
from forebay import Mixture

SIZES = {"a": 97, "b": 13, "c": 40}
#: a sample's label says which source and which sample it is
BASE = {"a": 0, "b": 1000, "c": 2000}


def make_sources(root) -> dict[str, str]:
    paths = {}
    for name, n in SIZES.items():
        p = root / f"{name}.fb"
        forebay.write_dataset(p, ({"label": np.int64(BASE[name] + i),
                                   "v": np.full(i % 5, i, np.float32)} for i in range(n)),
                              shard_bytes=2048)
        paths[name] = str(p)
    return paths


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_sources(tmp_path_factory.mktemp("mix"))


def labels_of(ids: np.ndarray) -> np.ndarray:
    """The label each concatenated id must carry (sources in SIZES' order)."""
    ids = np.asarray(ids)
    out = np.empty_like(ids)
    start = 0
    for name, n in SIZES.items():
        m = (ids >= start) & (ids < start + n)
        out[m] = BASE[name] + ids[m] - start
        start += n
    return out


def source_of(ids: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.cumsum(list(SIZES.values())), ids, side="right")


def weights(sources, a=0.5, b=0.3, c=0.2):
    return {sources["a"]: a, sources["b"]: b, sources["c"]: c}


def test_concat_dataset_reads_each_source_in_place(sources):
    ds = ConcatDataset(list(sources.values()))
    assert len(ds) == sum(SIZES.values()) and ds.part_sizes == tuple(SIZES.values())
    ids = np.array([0, 96, 97, 109, 110, 149])
    got = ds.get_many(ids)
    assert got["label"].tolist() == labels_of(ids).tolist()
    one = forebay.open_dataset(sources["c"])
    assert np.array_equal(ds[112]["v"], one[2]["v"])
    assert ds.fingerprint != ConcatDataset([sources["b"], sources["a"]]).fingerprint
    assert ds.reopened(verify_on_read=True).verify_on_read


def test_sources_with_other_fields_are_refused(sources, tmp_path):
    other = tmp_path / "other.fb"
    forebay.write_dataset(other, [{"label": np.int32(1), "v": np.zeros(2, np.float32)}])
    with pytest.raises(SchemaError, match="same fields"):
        ConcatDataset([sources["a"], str(other)])


@pytest.mark.parametrize("policy", ["cycle", "stop", "sample"])
def test_same_global_batches_at_any_world_size(sources, policy):
    mix = Mixture(weights(sources), policy=policy)
    plans = [mix.plan(w, 24 // w, 3, seed=11) for w in (1, 2, 4)]
    for e in range(3):
        want = plans[0].global_batches(e)
        for p in plans[1:]:
            assert np.array_equal(p.global_batches(e), want)
    again = Mixture(weights(sources), policy=policy).plan(2, 12, 3, seed=11)
    assert np.array_equal(again.epoch_order(2), plans[1].epoch_order(2))
    other = mix.plan(2, 12, 3, seed=12)
    assert not np.array_equal(other.epoch_order(0), plans[1].epoch_order(0))


def test_cycle_gives_each_source_its_exact_share(sources):
    mix = Mixture(weights(sources), policy="cycle")
    plan = mix.plan(1, 10, 4, seed=1, drop_last=True)
    order = mix.order(list(SIZES.values()))
    assert plan.epoch_length == 150
    assert order.counts(0).tolist() == [75, 45, 30]
    span = plan.steps_per_epoch * plan.global_batch
    for e in range(4):
        epoch = plan._ids_at(e, np.arange(plan.epoch_length))     # before any cut
        assert np.bincount(source_of(epoch), minlength=3).tolist() == [75, 45, 30]
        assert len(plan.epoch_order(e)) == span
    # a large source is covered over epochs, each sample once before any twice
    # (150 reads of 97 samples in two epochs: every one once or twice, none 0 or 3)
    a = [plan._ids_at(e, np.arange(150)) for e in range(2)]
    assert len(np.unique(a[0][source_of(a[0]) == 0])) == 75
    reads = np.bincount(np.concatenate([x[source_of(x) == 0] for x in a]), minlength=97)
    assert reads.min() == 1 and reads.max() == 2 and reads.sum() == 150
    # a small one repeats: 45 of 13 samples, every one 3 or 4 times
    b = np.bincount(a[0][source_of(a[0]) == 1] - 97, minlength=13)
    assert b.min() >= 3 and b.max() <= 4 and b.sum() == 45


def test_stop_ends_the_epoch_at_the_first_exhausted_source(sources):
    mix = Mixture(weights(sources), policy="stop")
    plan = mix.plan(1, 4, 3, seed=2)
    # b holds 13 samples at weight 0.3: 43 positions, every b sample once
    assert plan.epoch_length == 43
    for e in range(3):
        epoch = plan._ids_at(e, np.arange(43))
        assert len(np.unique(epoch)) == 43          # nothing twice in an epoch
        assert sorted(epoch[source_of(epoch) == 1] - 97) == list(range(13))
    with pytest.raises(InvalidArgumentError, match="holds 13"):
        Mixture(weights(sources), policy="stop", samples_per_epoch=100).plan(1, 4, 1)


def test_sample_draws_by_weight_with_replacement(sources):
    mix = Mixture(weights(sources, 0.6, 0.1, 0.3), policy="sample", samples_per_epoch=6000)
    plan = mix.plan(1, 100, 1, seed=3)
    share = np.bincount(source_of(plan.epoch_order(0)), minlength=3) / 6000
    assert np.allclose(share, [0.6, 0.1, 0.3], atol=0.03)
    with pytest.raises(InvalidArgumentError, match="draws at random"):
        Mixture(weights(sources), policy="sample").plan(1, 4, 1, shuffle=False).epoch_order(0)


def test_schedule_changes_the_weights_from_its_epoch(sources):
    mix = Mixture(weights(sources), schedule={2: {sources["a"]: 1, sources["c"]: 1}})
    plan = mix.plan(1, 10, 4, seed=4)
    order = plan.order
    assert order.counts(1).tolist() == [75, 45, 30]
    assert order.counts(2).tolist() == [75, 0, 75]
    assert not (source_of(plan._ids_at(3, np.arange(150))) == 1).any()
    with pytest.raises(InvalidArgumentError, match="samples_per_epoch"):
        Mixture(weights(sources), policy="stop", schedule={1: weights(sources)})


@pytest.mark.parametrize("bad, match", [
    (lambda s: Mixture({}), "no sources"),
    (lambda s: Mixture({s["a"]: -1}), "finite number"),
    (lambda s: Mixture({s["a"]: 0}), "every weight is 0"),
    (lambda s: Mixture({s["a"]: 1, s["a"] + "/": 1}), "same dataset"),
    (lambda s: Mixture({s["a"]: 1}, policy="zip"), "policy"),
    (lambda s: Mixture({s["a"]: 1}, samples_per_epoch=0), "samples_per_epoch"),
    (lambda s: Mixture({s["a"]: 1}, schedule={1: {"x.fb": 1}}), "not one of the sources"),
])
def test_bad_mixtures_are_named(sources, bad, match):
    with pytest.raises(InvalidArgumentError, match=match):
        bad(sources)


def test_the_plan_finds_positions_and_frequencies(sources):
    plan = Mixture(weights(sources)).plan(2, 5, 2, seed=5)
    order = plan.epoch_order(1)
    pos = plan.position(1, np.arange(plan.num_samples))
    read = pos >= 0
    assert np.array_equal(order[pos[read]], np.flatnonzero(read))
    assert set(np.flatnonzero(read)) == set(order.tolist())
    total = plan.frequencies(0) + plan.frequencies(1)
    assert total.sum() == 2 * plan.steps_per_epoch * plan.global_batch
    assert plan.to_dict()["order"]["policy"] == "cycle"


def loader_labels(loader, epochs=range(2)) -> list[list[int]]:
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out += [b["label"].tolist() for b in loader]
    return out


@pytest.mark.parametrize("store", ["preload", "clairvoyant", "direct"])
def test_every_store_serves_the_mixture_bit_exact(sources, store):
    from forebay.torch import DataLoader

    mix = Mixture(weights(sources))
    plan = mix.plan(1, 8, 2, seed=6)
    want = [labels_of(b).tolist() for e in range(2) for b in plan.batches(0, e)]
    with DataLoader(mix, 8, epochs=2, seed=6, store=store, verify_on_read=True,
                    pipeline=None) as loader:
        assert loader_labels(loader) == want


def label_only(sample: dict) -> dict:
    return {"label": sample["label"]}


def test_transform_workers_read_the_mixture(sources):
    from forebay.torch import DataLoader, Pipeline

    mix = Mixture(weights(sources), policy="stop")
    plan = mix.plan(1, 4, 1, seed=7)
    want = [labels_of(b).tolist() for b in plan.batches(0, 0)]
    with DataLoader(mix, 4, seed=7, store="direct",
                    pipeline=Pipeline(workers=2, worker_start="spawn",
                                      transform=label_only)) as loader:
        assert [b["label"].tolist() for b in loader] == want
        assert loader.stats()["worker_start"] == "spawn"   # opened the sources anew


def test_resume_mid_epoch_and_refuse_another_mixture(sources):
    from forebay.torch import DataLoader

    mix = Mixture(weights(sources))
    with DataLoader(mix, 8, epochs=2, seed=8, store="direct") as loader:
        full = loader_labels(loader)
        loader.set_epoch(1)
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
    with DataLoader(mix, 8, epochs=2, seed=8, store="direct") as again:
        again.load_state_dict(state)
        rest = loader_labels(again, range(1, 2))
    assert rest == full[len(full) // 2 + 3:]
    other = Mixture(weights(sources, 0.2, 0.3, 0.5))
    with DataLoader(other, 8, epochs=2, seed=8, store="direct") as wrong:
        with pytest.raises(InvalidArgumentError, match="mixture"):
            wrong.load_state_dict(state)


def test_access_plan_checks_its_order(sources):
    order = Mixture(weights(sources)).order(list(SIZES.values()))
    with pytest.raises(InvalidArgumentError, match="covers 150"):
        AccessPlan(10, 1, 2, 1, order=order)


def test_the_node_cache_refuses_a_mixture_and_leaves_the_sources_alone(sources, tmp_path,
                                                                       monkeypatch):
    from forebay.torch import DataLoader, Direct

    mix = Mixture(weights(sources))
    before = {p: sorted((f.name, f.stat().st_size, f.read_bytes())
                        for f in Path(p).iterdir()) for p in sources.values()}
    with pytest.raises(InvalidArgumentError, match="node cache keeps one dataset"):
        DataLoader(mix, 8, store=Direct(node_cache=tmp_path / "cache"))
    # the environment's cache (a site's default) is for single datasets: not used here
    monkeypatch.setenv("FOREBAY_NODE_CACHE", str(tmp_path / "env-cache"))
    with DataLoader(mix, 8, store="direct") as loader:
        assert sum(len(b["label"]) for b in loader) == len(loader) * 8
    assert not (tmp_path / "env-cache").exists() or not any((tmp_path / "env-cache").iterdir())
    after = {p: sorted((f.name, f.stat().st_size, f.read_bytes())
                       for f in Path(p).iterdir()) for p in sources.values()}
    assert after == before


def test_forebay_plan_prints_each_sources_share(sources, cli, capsys):
    code, out, err = cli("plan", "--mix", f"{sources['a']}=0.5", "--mix", f"{sources['b']}=0.3",
                         "--mix", f"{sources['c']}=0.2", "-N", "2", "-E", "4",
                         "--batch-size", "5", "--monte-carlo")
    assert code == 0, err
    assert "150 positions per epoch" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(tuple(sources.values()))}
    assert [rows[sources[k]][3] for k in "abc"] == ["75", "45", "30"]
    assert float(rows[sources["b"]][4]) == pytest.approx(4 * 45 / 13, abs=0.01)
    with pytest.raises(SystemExit):
        cli("plan", "--mix", "a.fb", "-N", "2", "-E", "1")
    assert "give SOURCE=WEIGHT, got 'a.fb'" in capsys.readouterr().err


def test_forebay_simulate_takes_a_mixture(sources, cli):
    code, out, err = cli("simulate", "--mix", f"{sources['a']}=0.7", "--mix",
                         f"{sources['b']}=0.3", "--mix-policy", "stop", "--workers", "2",
                         "--epochs", "2", "--batch", "4", "--policies", "naive,forebay-preload")
    assert code == 0, err
    assert "policy='stop'" in out and "43 samples" not in out and "110 samples" in out
    code, out, err = cli("simulate", "--workers", "2", "--epochs", "1")
    assert code != 0 and "--dataset, or a mixture" in err

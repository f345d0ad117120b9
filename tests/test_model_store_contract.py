"""The ModelStore contract: one suite, every implementation (memory://, file:// LMDB,
tcp:// against a real `forebay models serve` process).  A new store passes it by adding
a subclass whose ``store`` fixture yields one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmdb")
pytest.importorskip("msgpack")
from torch import nn  # noqa: E402

import forebay.models as fm  # noqa: E402
from forebay.errors import ModelNotFoundError, ModelRepositoryError  # noqa: E402
from test_models_remote import TOKEN, _serve, _stop  # noqa: E402


def mlp(seed: int = 0, width: int = 48) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 3))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k])
        for k in a)


class ModelStoreContract:
    """What every ModelStore does; subclasses provide the ``store`` fixture."""

    #: abilities the implementation declares
    capabilities: frozenset[str] = frozenset()

    def test_is_a_model_store_with_declared_capabilities(self, store):
        assert isinstance(store, fm.ModelStore)
        assert store.capabilities == self.capabilities
        if "relocate" not in store.capabilities:
            with pytest.raises(ModelRepositoryError):
                store.relocate()

    def test_save_versions_list_manifest(self, store):
        m = mlp()
        v1 = store.save("net", m, metadata={"lr": 0.1})
        v2 = store.save("net", mlp(seed=1))
        assert (v1, v2) == (1, 2)
        assert store.versions("net") == [1, 2] and store.list() == {"net": [1, 2]}
        man = store.manifest("net", 1)
        assert man["name"] == "net" and man["version"] == 1 and man["metadata"] == {"lr": 0.1}
        assert set(man["tensors"]) == set(m.state_dict())
        assert store.manifest("net")["version"] == 2
        assert store.versions("nothing") == []

    def test_load_is_bit_exact_whole_partial_and_in_place(self, store):
        m = mlp()
        store.save("net", m)
        assert same(store.load("net"), m.state_dict())
        part = store.load("net", include="2.*")
        assert set(part) == {"2.weight", "2.bias"}
        assert same(part, {k: v for k, v in m.state_dict().items() if k.startswith("2.")})
        other = mlp(seed=7)
        store.load("net", into=other)
        assert same(other.state_dict(), m.state_dict())

    def test_load_matching_by_structure(self, store):
        m = mlp()
        store.save("net", m)
        wrapped = nn.Sequential()           # other names, same leaves in the same graph
        wrapped.add_module("body", mlp(seed=3))
        got = store.load_matching("net", wrapped)
        assert got["matched"] and not got["unmatched"]
        assert same({k[len("body."):]: v for k, v in wrapped.state_dict().items()},
                    m.state_dict())

    def test_unchanged_tensors_are_stored_once(self, store):
        m = mlp()
        store.save("net", m)
        before = store.stats()
        store.save("net", m)                 # nothing new
        after = store.stats()
        assert after["stored_bytes"] == before["stored_bytes"]
        assert after["tensors"] == before["tensors"] and after["versions"] == 2
        for key in ("models", "versions", "tensors", "logical_bytes", "stored_bytes"):
            assert isinstance(after[key], int), key

    def test_delete_gc_verify(self, store):
        store.save("net", mlp(seed=0))
        store.save("net", mlp(seed=1))
        assert store.verify() == []
        store.delete("net", 1)
        assert store.versions("net") == [2]
        store.gc(grace_seconds=0)
        assert store.stats()["tensors"] == len(mlp().state_dict())
        assert same(store.load("net"), mlp(seed=1).state_dict())
        assert store.verify() == []

    def test_missing_models_and_versions_are_named(self, store):
        with pytest.raises(ModelNotFoundError, match="ghost"):
            store.load("ghost")
        store.save("net", mlp())
        with pytest.raises(ModelNotFoundError):
            store.manifest("net", 9)


class TestMemoryStore(ModelStoreContract):
    @pytest.fixture
    def store(self):
        with fm.open_repository("memory://") as r:
            yield r


class TestLmdbStore(ModelStoreContract):
    capabilities = frozenset({"relocate", "compact"})

    @pytest.fixture
    def store(self, tmp_path):
        with fm.open_repository(f"file://{tmp_path / 'store'}") as r:
            yield r


class TestProviderStore(ModelStoreContract):
    @pytest.fixture
    def store(self, tmp_path):
        p, url = _serve(tmp_path, f"file://{tmp_path / 'store'}")
        try:
            with fm.open_repository(url, token=TOKEN) as r:
                yield r
        finally:
            _stop(p)

"""litdata's optimized directories (issue S, item 1): datasets written by litdata's own
``optimize`` (tests/data/litdata, remade by its make.py) ingest bit-exact, plain and in
each of its zstd layouts; damaged or crafted ones are named and nothing is written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import forebay
from forebay.dataset.sources import get_source, ingest
from forebay.errors import SourceError
from conftest import copy_tree, edit_json

DATA = Path(__file__).parent / "data" / "litdata"


def _made():
    spec = importlib.util.spec_from_file_location("litdata_make", DATA / "make.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("variant, workers", [("plain", 1), ("plain", 2), ("zstd", 2),
                                              ("zstd-sample", 1), ("zstd-chunk", 1)])
def test_litdata_written_by_optimize_ingests_bit_exact(tmp_path, cli, variant, workers):
    if variant != "plain":
        pytest.importorskip("zstandard")
    code, _, err = cli("ingest", DATA / variant, tmp_path / "ds", "--from", "litdata",
                       "--workers", workers)
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "ds")
    made = _made()
    assert len(ds) == made.N
    assert [f.name for f in ds.schema.fields] == [
        "label", "score", "name", "raw", "img", "vec", "t", "ok", "meta.id", "meta.pair.0",
        "meta.pair.1"]
    for i in range(made.N):
        s, got = made.sample(i), ds[i]
        assert int(got["label"]) == s["label"] and got["label"].dtype == np.int64
        assert float(got["score"]) == s["score"]
        assert got["name"].tobytes().decode() == s["name"]
        assert got["raw"].tobytes() == s["raw"]
        for k in ("img", "vec", "t"):
            assert got[k].dtype == s[k].dtype and np.array_equal(got[k], s[k]), (i, k)
        assert bool(got["ok"]) == s["ok"]
        assert int(got["meta.id"]) == s["meta"]["id"]
        assert float(got["meta.pair.0"]) == s["meta"]["pair"][0]
        assert int(got["meta.pair.1"]) == s["meta"]["pair"][1]
    assert ds.metadata["litdata_formats"]["vec"] == "no_header_numpy:9"


def test_litdata_keys_select_leaves(tmp_path):
    ingest(get_source("litdata", DATA / "plain", keys=["label", "meta.pair.0"]),
           tmp_path / "ds")
    ds = forebay.open_dataset(tmp_path / "ds")
    assert [f.name for f in ds.schema.fields] == ["label", "meta.pair.0"]


def _copy(tmp_path, variant="plain"):
    return copy_tree(DATA / variant, tmp_path / "lit")


def _index(d, edit):
    edit_json(d / "index.json", edit)


def _fails(d, out, match):
    with pytest.raises(SourceError, match=match):
        ingest(get_source("litdata", d), out)
    assert not out.exists()


def test_damaged_or_crafted_litdata_is_named_and_nothing_is_written(tmp_path):
    d = _copy(tmp_path)
    chunk = d / "chunk-0-1.bin"
    data = bytearray(chunk.read_bytes())
    chunk.write_bytes(bytes(data[:-10]))
    _fails(d, tmp_path / "a.fb", r"chunk-0-1.bin: its sample offsets lie outside the file")
    bad = bytearray(data)
    bad[0:4] = (7777).to_bytes(4, "little")
    chunk.write_bytes(bytes(bad))
    _fails(d, tmp_path / "b.fb", r"chunk-0-1.bin: does not begin with its \d+ samples")
    bad = bytearray(data)
    n = int.from_bytes(data[0:4], "little")
    first = int.from_bytes(data[4:8], "little")
    bad[first:first + 4] = (1 << 20).to_bytes(4, "little")   # sample 0's first leaf size
    chunk.write_bytes(bytes(bad))
    _fails(d, tmp_path / "c.fb", r"chunk-0-1.bin: sample 0's leaf sizes add up to")
    assert n > 1

    d = _copy(tmp_path / "z", "zstd")
    chunk = d / "chunk-0-0.bin"
    data = bytearray(chunk.read_bytes())
    data[-5] ^= 0xFF
    chunk.write_bytes(bytes(data))
    pytest.importorskip("zstandard")
    _fails(d, tmp_path / "d.fb", r"chunk-0-0.bin: (cannot decompress it|frame 0 inflates)")


@pytest.mark.parametrize("edit, match", [
    (lambda doc: doc["config"]["data_format"].__setitem__(3, "pickle"),
     r"leaf 'raw'.*'pickle' \(pickled objects run code when read\)"),
    (lambda doc: doc["config"].update(item_loader="TokensLoader"), "TokensLoader"),
    (lambda doc: doc["config"].update(encryption={"a": 1}), "encrypted"),
    (lambda doc: doc["config"].update(compression="lz4"), "compression 'lz4'"),
    (lambda doc: doc["config"].update(data_spec="[1, {\"type\": \"mymod.Thing\"}]"),
     "samples of type mymod.Thing"),
    (lambda doc: doc["config"]["data_format"].pop(), "11 leaves in data_spec, 10"),
    (lambda doc: doc["chunks"][0].update(filename="../../escape.bin"), "not a chunk of"),
    (lambda doc: doc["chunks"][1].update(filename="gone.bin"), "gone.bin is missing"),
    (lambda doc: doc.pop("config"), "not a litdata index"),
])
def test_crafted_litdata_index_is_refused_by_name(tmp_path, edit, match):
    d = _copy(tmp_path)
    _index(d, edit)
    with pytest.raises(SourceError, match=match):
        get_source("litdata", d)


def test_a_refused_leaf_left_out_with_keys_is_fine(tmp_path):
    d = _copy(tmp_path)
    _index(d, lambda doc: doc["config"]["data_format"].__setitem__(3, "pickle"))
    ingest(get_source("litdata", d, keys=["label"]), tmp_path / "ds")
    assert len(forebay.open_dataset(tmp_path / "ds")) == _made().N
    with pytest.raises(SourceError, match="not a litdata directory"):
        get_source("litdata", tmp_path / "ds")

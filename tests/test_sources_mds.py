"""mosaicml-streaming's MDS directories (issue S, item 1): datasets written by the
library's own MDSWriter (tests/data/mds, remade by its make.py) ingest bit-exact, plain
over several hashed shards and zstd-compressed; damaged or crafted ones are named."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import forebay
from forebay.dataset.sources import get_source, ingest
from forebay.errors import SourceError
from conftest import copy_tree, edit_json

DATA = Path(__file__).parent / "data" / "mds"


def _made():
    spec = importlib.util.spec_from_file_location("mds_make", DATA / "make.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.samples()


@pytest.mark.parametrize("variant, workers", [("plain", 1), ("plain", 2), ("zstd", 2)])
def test_mds_written_by_mosaicml_streaming_ingests_bit_exact(tmp_path, cli, variant, workers):
    if variant == "zstd":
        pytest.importorskip("zstandard")
    code, _, err = cli("ingest", DATA / variant, tmp_path / "ds", "--from", "mds",
                       "--workers", workers)
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "ds")
    want = _made()
    assert len(ds) == len(want)
    for i, s in enumerate(want):
        got = ds[i]
        assert got["image"].tobytes() == s["image"] and got["raw"].tobytes() == s["raw"]
        assert int(got["label"]) == s["label"] and int(got["n"]) == s["n"]
        assert got["name"].tobytes().decode() == s["name"]
        assert json.loads(got["meta"].tobytes()) == s["meta"]
        assert got["s"].dtype == np.float32 and float(got["s"]) == s["s"]
        assert got["u"].dtype == np.uint8 and int(got["u"]) == s["u"]
        assert got["x"].dtype == s["x"].dtype and np.array_equal(got["x"], s["x"])
        assert got["y"].dtype == np.float32 and np.array_equal(got["y"], s["y"])
    assert ds.metadata["mds_encodings"]["y"] == "ndarray:float32:2,3"


def test_mds_keys_select_columns(tmp_path):
    ingest(get_source("mds", DATA / "plain", keys=["label", "x"]), tmp_path / "ds")
    ds = forebay.open_dataset(tmp_path / "ds")
    assert [f.name for f in ds.schema.fields] == ["label", "x"]


def _copy(tmp_path):
    return copy_tree(DATA / "plain", tmp_path / "mds")


def _index(d, edit):
    edit_json(d / "index.json", edit)


def _fails(d, out, match):
    with pytest.raises(SourceError, match=match):
        ingest(get_source("mds", d), out)
    assert not out.exists()


def test_damaged_or_crafted_mds_is_named_and_nothing_is_written(tmp_path):
    d = _copy(tmp_path)
    shard = d / "shard.00002.mds"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    _fails(d, tmp_path / "a.fb", r"shard.00002.mds: its sha1 is [0-9a-f]+, the index says")
    shard.write_bytes(bytes(data[:-10]))
    _fails(d, tmp_path / "b.fb", r"shard.00002.mds: [\d,]+ bytes, the index says")

    d = _copy(tmp_path / "c")             # no hashes: the structure itself is checked
    _index(d, lambda doc: [s["raw_data"].update(hashes={}, bytes=None)
                           for s in doc["shards"]])
    shard = d / "shard.00001.mds"
    data = bytearray(shard.read_bytes())
    data[8:12] = (len(data) + 100).to_bytes(4, "little")     # sample 0 ends past the file
    shard.write_bytes(bytes(data))
    _fails(d, tmp_path / "c.fb", r"shard.00001.mds: its sample offsets lie outside the file")
    data = bytearray(shard.read_bytes())
    data[0:4] = (7777).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    _fails(d, tmp_path / "d.fb", r"shard.00001.mds: does not begin with its \d+ samples")

    d = _copy(tmp_path / "e")
    _index(d, lambda doc: [s.update(column_encodings=["pkl" if e == "bytes" and n == "raw"
                                                      else e for n, e in
                                                      zip(s["column_names"],
                                                          s["column_encodings"])])
                           for s in doc["shards"]])
    with pytest.raises(SourceError, match=r"column 'raw' is MDS 'pkl' \(pickled objects run "
                                          r"code when read\)"):
        get_source("mds", d)
    get_source("mds", d, keys=["label"])              # left out: fine

    d = _copy(tmp_path / "f")
    _index(d, lambda doc: doc["shards"][0]["raw_data"].update(basename="../../escape.mds"))
    (tmp_path / "escape.mds").write_bytes(b"x")
    with pytest.raises(SourceError, match="outside"):
        get_source("mds", d)
    _index(d, lambda doc: doc.update(version=3))
    with pytest.raises(SourceError, match="not an MDS index"):
        get_source("mds", d)
    with pytest.raises(SourceError, match="not an MDS directory"):
        get_source("mds", tmp_path)

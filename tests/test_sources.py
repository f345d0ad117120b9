"""More ingest sources (issue S, item 1): files made by their own libraries, ingested
bit-exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import forebay
from forebay.dataset.sources import get_source, ingest
from forebay.errors import SourceError, UnsupportedDtypeError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N = 500


def _table(n=N, seed=0, nulls=False):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 9, n)
    ragged = [rng.normal(size=k).astype(np.float32) for k in lengths]
    blobs = [rng.bytes(int(k)) for k in rng.integers(0, 40, n)]
    cols = {
        "id": pa.array(np.arange(n, dtype=np.int64)),
        "y": pa.array(rng.normal(size=n)),
        "flag": pa.array(rng.random(n) > 0.5),
        "tokens": pa.array([r.tolist() for r in ragged], type=pa.list_(pa.float32())),
        "xyz": pa.FixedSizeListArray.from_arrays(pa.array(rng.normal(size=3 * n)), 3),
        "blob": pa.array(blobs, type=pa.binary()),
        "text": pa.array([f"sample {i} é" for i in range(n)]),
        "cls": pa.array([["cat", "dog"][i % 2] for i in range(n)]).dictionary_encode(),
    }
    if nulls:
        cols["maybe"] = pa.array([None if i % 7 == 0 else float(i) for i in range(n)])
    return pa.table(cols), ragged, blobs


def test_parquet_rows_become_samples_bit_exact(tmp_path, cli):
    table, ragged, blobs = _table()
    (tmp_path / "src").mkdir()
    pq.write_table(table.slice(0, 300), tmp_path / "src" / "a.parquet", row_group_size=64)
    pq.write_table(table.slice(300), tmp_path / "src" / "b.parquet", row_group_size=64)
    code, out, err = cli("ingest", tmp_path / "src", tmp_path / "ds", "--from", "parquet",
                         "--workers", "2")
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "ds")
    assert len(ds) == N and ds.metadata["columns"] == list(table.column_names)
    y, xyz = table.column("y").to_numpy(), table.column("xyz").combine_chunks()
    xyz = xyz.flatten().to_numpy().reshape(N, 3)
    for i in range(N):
        s = ds[i]
        assert int(s["id"]) == i and float(s["y"]) == y[i] and bool(s["flag"]) == \
            table.column("flag")[i].as_py()
        assert s["tokens"].dtype == np.float32 and np.array_equal(s["tokens"], ragged[i])
        assert np.array_equal(s["xyz"], xyz[i])
        assert s["blob"].tobytes() == blobs[i]
        assert s["text"].tobytes().decode() == f"sample {i} é"
        assert s["cls"].tobytes().decode() == ["cat", "dog"][i % 2]


def test_parquet_keys_nulls_and_types_it_cannot_store(tmp_path, cli):
    table, _, _ = _table(nulls=True)
    pq.write_table(table, tmp_path / "n.parquet", row_group_size=100)
    code, out, err = cli("ingest", tmp_path / "n.parquet", tmp_path / "ds", "--from",
                         "parquet")
    assert code == 2 and "column 'maybe' has 72 null value(s)" in err and "--nulls zero" \
        in err, err
    code, out, err = cli("ingest", tmp_path / "n.parquet", tmp_path / "ds", "--from",
                         "parquet", "--nulls", "zero", "--keys", "maybe,id")
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "ds")
    assert list(ds.schema.names) == ["maybe", "id"]
    assert [float(ds[i]["maybe"]) for i in range(8)] == [0.0, 1, 2, 3, 4, 5, 6, 0.0]
    stamps = pa.table({"t": pa.array(np.arange(5).astype("datetime64[s]"))})
    pq.write_table(stamps, tmp_path / "t.parquet")
    with pytest.raises(UnsupportedDtypeError, match=r"t.parquet: column 't' has type "
                       r"timestamp\[ms\]; forebay stores numbers"):
        get_source("parquet", tmp_path / "t.parquet")
    assert len(get_source("parquet", tmp_path / "n.parquet", keys=["id"]).units()) == 5
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(SourceError, match="bad.parquet: cannot read as Parquet"):
        get_source("parquet", tmp_path / "bad.parquet")
    with pytest.raises(SourceError, match=r"no 'nope'"):
        get_source("parquet", tmp_path / "n.parquet", keys=["nope"])


def test_arrow_streams_as_hugging_face_saves_them_and_ipc_files(tmp_path, cli):
    """``datasets.Dataset.save_to_disk`` writes Arrow IPC *streams*
    (data-00000-of-00002.arrow ...); an IPC file (random access) reads the same."""
    table, ragged, blobs = _table()
    d = tmp_path / "hf" / "train"
    d.mkdir(parents=True)
    for k, part in enumerate((table.slice(0, 250), table.slice(250))):
        with pa.ipc.new_stream(d / f"data-{k:05d}-of-00002.arrow", part.schema) as w:
            for batch in part.to_batches(max_chunksize=100):
                w.write_batch(batch)
    (d / "dataset_info.json").write_text("{}")
    code, out, err = cli("ingest", tmp_path / "hf", tmp_path / "ds", "--from", "arrow",
                         "--keys", "id,tokens,blob")
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "ds")
    assert len(ds) == N
    for i in (0, 249, 250, N - 1):
        assert int(ds[i]["id"]) == i and np.array_equal(ds[i]["tokens"], ragged[i])
        assert ds[i]["blob"].tobytes() == blobs[i]
    with pa.ipc.new_file(tmp_path / "one.arrow", table.schema) as w:
        w.write_table(table)
    src = get_source("arrow", tmp_path / "one.arrow", keys=["text"])
    assert [s["text"].tobytes().decode() for s in src.read_unit(tmp_path / "one.arrow")][:2] \
        == ["sample 0 é", "sample 1 é"]


def test_a_directory_saved_by_hugging_face_datasets_ingests_bit_exact(tmp_path, cli):
    """tests/data/hf/saved: ``datasets.Dataset.save_to_disk``'s own output (make.py)."""
    import importlib.util

    here = Path(__file__).parent / "data" / "hf"
    spec = importlib.util.spec_from_file_location("hf_make", here / "make.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    code, _, err = cli("ingest", here / "saved", tmp_path / "ds", "--from", "arrow")
    assert code == 0, err
    ds, want = forebay.open_dataset(tmp_path / "ds"), mod.rows()
    assert len(ds) == mod.N and list(ds.schema.names) == list(want)
    for i in range(mod.N):
        assert int(ds[i]["id"]) == want["id"][i] and float(ds[i]["score"]) == want["score"][i]
        assert ds[i]["text"].tobytes().decode() == want["text"][i]
        assert ds[i]["tokens"].tolist() == want["tokens"][i]
        assert ds[i]["blob"].tobytes() == want["blob"][i]


# ----------------------------------------------------------------------------- WebDataset

def test_webdataset_shards_written_by_webdataset_ingest_bit_exact(tmp_path, cli):
    wds = pytest.importorskip("webdataset")
    import json

    rng = np.random.default_rng(1)
    want = []
    (tmp_path / "shards").mkdir()
    for shard in range(3):
        with wds.TarWriter(str(tmp_path / "shards" / f"train-{shard:04d}.tar")) as w:
            for i in range(40):
                k = shard * 40 + i
                s = {"__key__": f"sample{k:06d}", "jpg": rng.bytes(int(rng.integers(50, 500))),
                     "cls": int(k % 10), "json": {"k": k, "name": f"n{k}"},
                     "seg.png": rng.bytes(30), "npy": rng.normal(size=(2, k % 4 + 1))}
                w.write(s)
                want.append(s)
    code, out, err = cli("ingest", tmp_path / "shards", tmp_path / "ds", "--from",
                         "webdataset", "--workers", "2")
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "ds")
    assert len(ds) == 120 and ds.metadata["fields"] == ["cls", "jpg", "json", "npy", "seg.png"]
    for k, s in enumerate(want):
        got = ds[k]
        assert got["jpg"].tobytes() == s["jpg"] and got["seg.png"].tobytes() == s["seg.png"]
        assert int(got["cls"]) == s["cls"] and json.loads(got["json"].tobytes()) == s["json"]
        assert np.array_equal(got["npy"], s["npy"])


def test_webdataset_shards_that_do_not_fit_are_named(tmp_path):
    import io
    import tarfile

    def shard(path, members):
        with tarfile.open(path, "w") as t:
            for name, data in members:
                info = tarfile.TarInfo(name)
                if data is None:
                    info.type, info.linkname = tarfile.SYMTYPE, "/etc/shadow"
                    t.addfile(info)
                else:
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))

    shard(tmp_path / "a.tar", [("x.jpg", b"1"), ("x.cls", b"1"), ("y.jpg", b"2")])
    with pytest.raises(SourceError, match=r"a sample lacks .cls \(has .jpg\)"):
        ingest(get_source("webdataset", tmp_path / "a.tar"), tmp_path / "o")
    src = get_source("webdataset", tmp_path / "a.tar", keys=["jpg"])
    assert [s["jpg"] for s in src.read_unit(tmp_path / "a.tar")] == [b"1", b"2"]
    shard(tmp_path / "b.tar", [("x.jpg", b"1"), ("x.txt", None)])
    with pytest.raises(SourceError, match=r"member 'x.txt' is a link or a device"):
        get_source("webdataset", tmp_path / "b.tar")
    shard(tmp_path / "c.tar", [("x.cls", b"cat")])
    with pytest.raises(SourceError, match=r"\.cls should hold an integer"):
        get_source("webdataset", tmp_path / "c.tar")
    (tmp_path / "d.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(SourceError, match="d.tar: cannot read as a tar shard"):
        get_source("webdataset", tmp_path / "d.tar")


# ---------------------------------------------------------------------------------- Zarr

@pytest.mark.parametrize("fmt", [2, 3])
def test_zarr_stores_written_by_zarr_ingest_bit_exact(tmp_path, cli, fmt):
    zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng(fmt)
    x = rng.normal(size=(300, 4, 3)).astype(np.float32)
    y = np.arange(300, dtype=np.int64)
    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="w", zarr_format=fmt)
    g.create_array("x", shape=x.shape, chunks=(32, 4, 3), dtype=x.dtype)[:] = x
    g.create_group("meta").create_array("y", shape=y.shape, chunks=(50,), dtype=y.dtype)[:] = y
    code, out, err = cli("ingest", tmp_path / "s.zarr", tmp_path / "ds", "--from", "zarr",
                         "--workers", "2", "--keys", "x,meta/y")
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "ds")
    assert len(ds) == 300 and list(ds.schema.names) == ["x", "meta/y"]
    every = ds.get_many(np.arange(300))
    assert np.array_equal(every.field("x").stacked(), x)
    assert np.array_equal(every.field("meta/y").stacked(), y)
    one = zarr.open_array(str(tmp_path / "a.zarr"), mode="w", shape=(40, 2), chunks=(8, 2),
                          dtype="u2", zarr_format=fmt)
    one[:] = np.arange(80, dtype=np.uint16).reshape(40, 2)
    src = get_source("zarr", tmp_path / "a.zarr", keys=["pair"])
    assert len(src.units()) == 1 and [s["pair"].tolist() for s in src.read_unit(
        src.units()[0])][:2] == [[0, 1], [2, 3]]


def test_zarr_stores_that_do_not_fit_are_named(tmp_path):
    zarr = pytest.importorskip("zarr")
    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="w")
    g.create_array("x", shape=(10, 2), chunks=(5, 2), dtype="f4")
    g.create_array("y", shape=(9,), chunks=(5,), dtype="i4")
    with pytest.raises(SourceError, match=r"different numbers of rows .*'x': 10, 'y': 9"):
        get_source("zarr", tmp_path / "s.zarr")
    (tmp_path / "secret").write_bytes(b"s" * 8)
    (tmp_path / "s.zarr" / "x" / "c" / "0").mkdir(parents=True, exist_ok=True)
    (tmp_path / "s.zarr" / "x" / "c" / "0" / "9").symlink_to(tmp_path / "secret")
    with pytest.raises(SourceError, match="leads outside the source"):
        get_source("zarr", tmp_path / "s.zarr", keys=["x"])
    (tmp_path / "t.zarr").mkdir()
    (tmp_path / "t.zarr" / "zarr.json").write_text("{not json")
    with pytest.raises(SourceError, match="cannot open as a Zarr store"):
        get_source("zarr", tmp_path / "t.zarr")

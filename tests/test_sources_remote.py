"""Sources at an object-store URL (issue S, item 1): files made by their own libraries,
uploaded to a local S3-compatible server (moto's, started here on 127.0.0.1), ingested
from ``s3://bucket/prefix`` bit-exact to the same files ingested from a directory."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

import forebay
from forebay.dataset.sources import get_source, ingest
from forebay.errors import EmptySourceError, SourceError

pa = pytest.importorskip("pyarrow")
pafs = pytest.importorskip("pyarrow.fs")
pq = pytest.importorskip("pyarrow.parquet")
moto_server = pytest.importorskip("moto.server", reason="moto[s3] (the dev extra) runs the "
                                  "local S3 server")


@pytest.fixture(scope="module")
def s3():
    """A local S3 server; the usual AWS_* variables point at it while the tests run."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_DEFAULT_REGION": "us-east-1"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        fs = pafs.S3FileSystem(access_key="testing", secret_key="testing",
                               endpoint_override=env["AWS_ENDPOINT_URL"], scheme="http",
                               region="us-east-1", allow_bucket_creation=True)
        fs.create_dir("data")
        yield fs
    server.stop()


def _upload(fs, local, key):
    pafs.copy_files(str(local), f"data/{key}", source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)


def _same(a, b):
    """Two datasets hold the same samples, field by field, bit for bit."""
    da, db = forebay.open_dataset(a), forebay.open_dataset(b)
    assert len(da) == len(db) and da.schema == db.schema
    ids = np.arange(len(da))
    ba, bb = da.get_many(ids), db.get_many(ids)
    for name in ba.fields:
        fa, fb = ba.fields[name], bb.fields[name]
        assert np.array_equal(fa.values.view(np.uint8), fb.values.view(np.uint8)), name
        assert np.array_equal(fa.offsets, fb.offsets) and np.array_equal(fa.shapes, fb.shapes)


def _parquet(d):
    rng = np.random.default_rng(3)
    d.mkdir()
    for k in range(3):
        n = 40 + k
        pq.write_table(pa.table({"x": pa.array(rng.normal(size=n)),
                                 "blob": pa.array([rng.bytes(int(m)) for m in
                                                   rng.integers(0, 50, n)], type=pa.binary())}),
                       d / f"part-{k}.parquet", row_group_size=16)


def _webdataset(d):
    wds = pytest.importorskip("webdataset")
    rng = np.random.default_rng(4)
    d.mkdir()
    for shard in range(2):
        with wds.TarWriter(str(d / f"train-{shard:04d}.tar")) as w:
            for i in range(30):
                w.write({"__key__": f"s{shard * 30 + i:05d}", "jpg": rng.bytes(200),
                         "cls": i % 10})


def _zarr(d):
    zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng(5)
    g = zarr.open_group(str(d), mode="w")
    g.create_array("x", data=rng.normal(size=(64, 3)).astype(np.float32), chunks=(16, 3))
    g.create_array("y", data=np.arange(64, dtype=np.int64), chunks=(16,))


def _fixture(name):
    """A directory its library wrote (tests/data/NAME), copied to ``d``."""
    def make(d):
        import shutil
        from pathlib import Path

        shutil.copytree(Path(__file__).parent / "data" / name, d)
    return make


@pytest.mark.parametrize("kind, make", [
    ("parquet", _parquet), ("webdataset", _webdataset), ("zarr", _zarr),
    ("arrow", _fixture("hf/saved")), ("mds", _fixture("mds/zstd")),
    ("litdata", _fixture("litdata/zstd"))])
def test_a_source_at_an_s3_url_ingests_as_from_a_directory(tmp_path, cli, s3, kind, make):
    if kind in ("mds", "litdata"):
        pytest.importorskip("zstandard")
    make(tmp_path / "src")
    _upload(s3, tmp_path / "src", f"{kind}/v1")
    code, _, err = cli("ingest", tmp_path / "src", tmp_path / "local.fb", "--from", kind)
    assert code == 0, err
    stage = tmp_path / "stage"
    stage.mkdir()
    code, out, err = cli("ingest", f"s3://data/{kind}/v1", tmp_path / "remote.fb", "--from",
                         kind, "--workers", "2", "--stage-dir", stage)
    assert code == 0, err
    _same(tmp_path / "local.fb", tmp_path / "remote.fb")
    meta = forebay.open_dataset(tmp_path / "remote.fb").metadata
    assert meta["source_url"] == f"s3://data/{kind}/v1"
    assert not list(stage.iterdir())                 # the copy is gone


def test_one_object_and_the_python_api(tmp_path, s3):
    _parquet(tmp_path / "src")
    _upload(s3, tmp_path / "src", "one")
    source = get_source("parquet", "s3://data/one/part-1.parquet", stage_dir=tmp_path)
    ingest(source, tmp_path / "one.fb")
    assert len(forebay.open_dataset(tmp_path / "one.fb")) == 41
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.fb", "src"]   # copy gone


def test_what_an_s3_url_cannot_give_is_named(tmp_path, cli, s3):
    code, _, err = cli("ingest", "s3://data/nothing-here", tmp_path / "a.fb", "--from",
                       "parquet")
    assert code != 0 and "s3://data/nothing-here: no objects there" in err, err
    assert not (tmp_path / "a.fb").exists()
    with pytest.raises(SourceError, match="s3://no-such-bucket/x: no bucket 'no-such-bucket'"):
        ingest(get_source("parquet", "s3://no-such-bucket/x"), tmp_path / "b.fb")
    with pytest.raises(EmptySourceError):
        ingest(get_source("parquet", "s3://data/nothing-here"), tmp_path / "c.fb")
    assert not [p for p in os.listdir(tmp_path) if p.startswith("forebay-stage-")]

"""Ingest from every source kind, checked sample by sample against the source files."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

import forebay
from forebay.dataset.sources import SOURCES, get_source, ingest
from forebay.synth import MUMMI_FEATURES, ising_samples, molecule_samples, synthesize
from conftest import assert_sample_equal


def _by_name(sample):
    return {k: sample[k] for k in sorted(sample)}


def test_registry_lists_every_kind():
    assert set(SOURCES) == {"npz", "npy", "pickle", "hdf5", "imagefolder", "dlio", "parquet",
                            "arrow", "webdataset", "zarr", "mds", "litdata"}


@pytest.mark.parametrize("kind, gen", [("ising", ising_samples), ("molecules", molecule_samples)])
def test_pff_and_cff_ingest_to_the_same_samples(tmp_path, kind, gen):
    synthesize(kind, tmp_path / "pff", 60, seed=4)
    synthesize(kind, tmp_path / "cff", 60, seed=4, format="cff")
    a = forebay.open_dataset(ingest(get_source("pickle", tmp_path / "pff", trust_pickle=True),
                                    tmp_path / "a", shard_bytes=64 << 10) and tmp_path / "a")
    h5 = get_source("hdf5", tmp_path / "cff", chunk_bytes=100_000)  # several chunks
    assert len(h5.units()) > 1
    b = forebay.open_dataset(ingest(h5, tmp_path / "b") and tmp_path / "b")
    want = list(gen(60, 4))
    assert len(a) == len(b) == 60
    assert set(a.schema.names) == set(b.schema.names) == set(want[0])
    for i in range(60):
        assert_sample_equal(a[i], want[i])
        assert_sample_equal(_by_name(b[i]), _by_name(want[i]))
    if kind == "molecules":  # really ragged in nodes and edges
        assert len({a[i]["x"].shape[0] for i in range(60)}) > 5


def test_mummi_npz_stacked_with_keys_and_workers(tmp_path):
    synthesize("mummi", tmp_path / "src", 50, seed=1, per_file=16)
    files = sorted((tmp_path / "src").glob("*.npz"))
    assert len(files) == 4
    m1 = ingest(get_source("npz", tmp_path / "src"), tmp_path / "one", shard_bytes=1 << 20)
    m2 = ingest(get_source("npz", tmp_path / "src", keys=["x"]), tmp_path / "two",
                shard_bytes=1 << 20, workers=2)
    assert m1.fingerprint == m2.fingerprint  # workers change nothing on disk
    ds = forebay.open_dataset(tmp_path / "two")
    assert len(ds) == 50 and ds.schema["x"].dtype == np.float64
    rows = np.concatenate([np.load(f)["x"] for f in files])
    assert rows.shape == (50, MUMMI_FEATURES)
    np.testing.assert_array_equal(ds.get_many(np.arange(50))["x"], rows)


def test_npz_per_file_layout_cosmoflow(tmp_path, cli):
    synthesize("cosmoflow", tmp_path / "src", 5, seed=2, size=8)
    code, out, err = cli("ingest", tmp_path / "src", tmp_path / "ds", "--from", "npz",
                         "--layout", "per-file", "--keys", "y,x")
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "ds")
    assert ds.schema.names == ("y", "x")
    for i, f in enumerate(sorted((tmp_path / "src").glob("*.npz"))):
        z = np.load(f)
        assert_sample_equal(ds[i], {"y": z["y"], "x": z["x"]})
    assert ds[0]["x"].shape == (4, 8, 8, 8) and ds[0]["x"].dtype == np.int16


def test_npy_per_file_and_stacked(tmp_path):
    (tmp_path / "src").mkdir()
    arrays = [np.arange(6, dtype=np.int32).reshape(2, 3) + i for i in range(3)]
    for i, a in enumerate(arrays):
        np.save(tmp_path / "src" / f"s{i}.npy", a)
    ingest(get_source("npy", tmp_path / "src", keys=["img"]), tmp_path / "per")
    ds = forebay.open_dataset(tmp_path / "per")
    assert ds.schema.names == ("img",) and len(ds) == 3
    assert_sample_equal(ds[2], {"img": arrays[2]})
    ingest(get_source("npy", tmp_path / "src", layout="stacked"), tmp_path / "stk")
    ds = forebay.open_dataset(tmp_path / "stk")
    assert len(ds) == 6 and ds[3]["data"].tolist() == [4, 5, 6]


def test_imagefolder_keeps_encoded_bytes_and_labels(tmp_path):
    synthesize("imagenet", tmp_path / "src", 12, seed=3, classes=3, mean_bytes=5000)
    (tmp_path / "src" / "README.txt").write_text("not an image")
    src = get_source("imagefolder", tmp_path / "src", chunk_files=5)
    ingest(src, tmp_path / "ds", workers=2)
    ds = forebay.open_dataset(tmp_path / "ds")
    assert ds.metadata["classes"] == ["n00000000", "n00000001", "n00000002"]
    files = sorted((tmp_path / "src").rglob("*.JPEG"))
    assert len(ds) == len(files) == 12
    for i, f in enumerate(files):
        s = ds[i]
        assert s["image"].tobytes() == f.read_bytes()
        assert s["image"][:3].tobytes() == b"\xff\xd8\xff"
        assert int(s["label"]) == ds.metadata["classes"].index(f.parent.name)


class GraphData:
    """Stands in for a PyG Data object: unpickled, then converted with to_dict()."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def to_dict(self):
        return dict(self.__dict__)


def test_pickle_objects_lists_and_keys(tmp_path):
    (tmp_path / "src").mkdir()
    with open(tmp_path / "src" / "a.pkl", "wb") as f:
        pickle.dump(GraphData(x=np.ones((3, 2)), y=np.float64(1.0), name=None), f)
    with open(tmp_path / "src" / "b.pkl", "wb") as f:
        pickle.dump([{"x": np.zeros((1, 2)), "y": 2.0, "name": None}] * 2, f)
    src = get_source("pickle", tmp_path / "src", trust_pickle=True, keys=["x", "y"])
    ingest(src, tmp_path / "ds")
    ds = forebay.open_dataset(tmp_path / "ds")
    assert len(ds) == 3 and ds.schema.names == ("x", "y")
    assert ds.get_many([0, 1, 2])["y"].tolist() == [1.0, 2.0, 2.0]
    # without --keys the None field cannot be stored, and the error says which
    with pytest.raises(forebay.errors.UnsupportedDtypeError, match="field 'name'"):
        ingest(get_source("pickle", tmp_path / "src", trust_pickle=True), tmp_path / "bad")


def test_hdf5_keys_groups_and_explicit_ragged(tmp_path):
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f["grp/img"] = np.arange(24, dtype=np.uint8).reshape(4, 6)
        f["flat"] = np.arange(10, dtype=np.float32)
        f["starts"] = np.array([0, 1, 3, 6, 10])
        f["label"] = np.arange(4)
    src = get_source("hdf5", tmp_path / "c.h5", keys=["grp/img", "flat"], ragged={"flat": "starts"})
    ingest(src, tmp_path / "ds")
    ds = forebay.open_dataset(tmp_path / "ds")
    assert ds.schema.names == ("grp/img", "flat")
    assert ds[2]["flat"].tolist() == [3, 4, 5] and ds[3]["grp/img"].tolist() == list(range(18, 24))


def test_synth_is_deterministic_and_physical(tmp_path):
    synthesize("ising", tmp_path / "a", 5, seed=9)
    synthesize("ising", tmp_path / "b", 5, seed=9)
    for fa, fb in zip(sorted((tmp_path / "a").iterdir()), sorted((tmp_path / "b").iterdir())):
        assert fa.read_bytes() == fb.read_bytes()
    s = next(ising_samples(1, seed=5))
    spins = s["x"][:, 0].reshape(5, 5, 5)
    energy = -sum((spins[:-1] * spins[1:]).sum() for spins in
                  (spins, spins.transpose(1, 0, 2), spins.transpose(2, 1, 0)))
    assert s["y"][0] == energy and s["x"].shape == (125, 1)
    assert set(np.unique(s["x"])) <= {-1.0, 1.0}
    src, dst = s["edge_index"]
    d = np.linalg.norm(s["pos"][src] - s["pos"][dst], axis=1)
    np.testing.assert_allclose(d, s["edge_attr"][:, 0], rtol=1e-5)
    sizes = [m["x"].shape[0] for m in molecule_samples(200, seed=1)]
    assert min(sizes) >= 5 and max(sizes) <= 71
    with pytest.raises(forebay.errors.DatasetExistsError):
        synthesize("ising", tmp_path / "a", 5)


def test_hdf5_per_file_layout(tmp_path, cli):
    h5py = pytest.importorskip("h5py")
    (tmp_path / "src").mkdir()
    vols = [np.full((2, 3, 3), i, dtype=np.int16) for i in range(3)]
    for i, v in enumerate(vols):
        with h5py.File(tmp_path / "src" / f"s{i}.h5", "w") as f:
            f["x"] = v
            f["y"] = np.float32(i)
    code, _, err = cli("ingest", tmp_path / "src", tmp_path / "ds", "--from", "hdf5",
                       "--layout", "per-file")
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "ds")
    assert len(ds) == 3 and ds[2]["x"].tolist() == vols[2].tolist() and ds[1]["y"] == 1.0


def _many_unit_sources(root):
    """Every source kind, each with many more units than workers (issue M.0)."""
    synthesize("ising", root / "pff", 150, seed=3)                       # 150 files
    synthesize("ising", root / "cff", 150, seed=3, format="cff")
    synthesize("mummi", root / "mummi", 120, seed=3, per_file=4)         # 30 files
    synthesize("imagenet", root / "img", 90, seed=3, classes=3, mean_bytes=300)
    (root / "npy").mkdir()
    for i in range(40):
        np.save(root / "npy" / f"{i:03d}.npy", np.arange(i, dtype=np.int32))
    (root / "dlio").mkdir()                   # DLIO's npz: samples on the last axis
    for i in range(30):
        np.savez(root / "dlio" / f"img_{i:02d}_of_30.npz",
                 x=np.full((3, 2, 4), i, dtype=np.uint8), y=[i] * 4)
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"i": pa.array(np.arange(400)),
                      "v": pa.array([list(range(k % 5)) for k in range(400)],
                                    type=pa.list_(pa.int32()))})
    pq.write_table(table, root / "t.parquet", row_group_size=16)          # 25 row groups
    (root / "arrow").mkdir()
    for k in range(30):
        with pa.ipc.new_stream(root / "arrow" / f"data-{k:05d}.arrow", table.schema) as w:
            w.write_table(table.slice(10 * k, 10))
    import tarfile

    (root / "wds").mkdir()
    for k in range(30):
        with tarfile.open(root / "wds" / f"s-{k:04d}.tar", "w") as t:
            for i in range(3):
                for ext, data in (("bin", bytes([k, i]) * (i + 1)), ("cls", b"%d" % i)):
                    info = tarfile.TarInfo(f"k{k:02d}{i}.{ext}")
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))
    import zarr

    z = zarr.open_array(str(root / "z.zarr"), mode="w", shape=(400, 3), chunks=(10, 3),
                        dtype="i4")
    z[:] = np.arange(1200, dtype=np.int32).reshape(400, 3)
    # MDS: MDSWriter's shards (tests/data/mds/plain) listed 5 times over, as 30 shards
    plain = Path(__file__).parent / "data" / "mds" / "plain"
    doc = json.loads((plain / "index.json").read_text())
    (root / "mds").mkdir()
    shards = []
    for copy in range(5):
        for sh in doc["shards"]:
            name = f"c{copy}-{sh['raw_data']['basename']}"
            shutil.copyfile(plain / sh["raw_data"]["basename"], root / "mds" / name)
            shards.append({**sh, "raw_data": {**sh["raw_data"], "basename": name}})
    (root / "mds" / "index.json").write_text(json.dumps({**doc, "shards": shards}))
    # litdata: optimize's chunks (tests/data/litdata/plain) listed 4 times over, as 32
    lit = Path(__file__).parent / "data" / "litdata" / "plain"
    doc = json.loads((lit / "index.json").read_text())
    (root / "lit").mkdir()
    chunks = []
    for copy in range(4):
        for ch in doc["chunks"]:
            name = f"c{copy}-{ch['filename']}"
            shutil.copyfile(lit / ch["filename"], root / "lit" / name)
            chunks.append({**ch, "filename": name})
    (root / "lit" / "index.json").write_text(json.dumps({**doc, "chunks": chunks}))
    return {
        "mds": get_source("mds", root / "mds"),
        "litdata": get_source("litdata", root / "lit"),
        "zarr": get_source("zarr", root / "z.zarr", unit_bytes=1),      # a chunk per unit
        "webdataset": get_source("webdataset", root / "wds"),
        "parquet": get_source("parquet", root / "t.parquet"),
        "arrow": get_source("arrow", root / "arrow"),
        "dlio": get_source("dlio", root / "dlio"),
        "pickle": get_source("pickle", root / "pff", trust_pickle=True, chunk_files=4),
        "hdf5": get_source("hdf5", root / "cff", chunk_bytes=20_000),
        "npz": get_source("npz", root / "mummi"),
        "npy": get_source("npy", root / "npy"),
        "imagefolder": get_source("imagefolder", root / "img", chunk_files=2),
    }


def test_workers_keep_every_unit_of_every_source(tmp_path):
    """More units than 2 x workers: every sample is ingested, bit for bit as with one
    worker (a window of 2N units in flight once dropped one unit in every refill);
    2 and 3 workers in turn over the sources."""
    sources = _many_unit_sources(tmp_path)
    assert set(sources) == set(SOURCES)
    for i, (kind, src) in enumerate(sources.items()):
        workers = 2 + i % 2
        assert len(src.units()) > 8 * workers, kind
        one = ingest(src, tmp_path / f"{kind}-1")
        many = ingest(src, tmp_path / f"{kind}-{workers}", workers=workers)
        assert many.num_samples == one.num_samples, kind
        assert many.fingerprint == one.fingerprint, kind
        a, b = forebay.open_dataset(tmp_path / f"{kind}-1"), \
            forebay.open_dataset(tmp_path / f"{kind}-{workers}")
        every = np.arange(len(a))
        assert a.get_many(every).equals(b.get_many(every)), kind


def test_units_per_task_bounds():
    from forebay.dataset.sources import units_per_task

    assert units_per_task(5, 4) == 1
    assert units_per_task(10_000, 4) == 64
    assert units_per_task(100, 2) == 12


# ------------------------------------------------ nothing read from outside the source

SECRET = b"root:x:0:0:SECRET" * 64


def _secret(tmp_path):
    """A file outside every source below (stands in for /etc/shadow)."""
    (tmp_path / "elsewhere").mkdir(exist_ok=True)
    p = tmp_path / "elsewhere" / "shadow"
    p.write_bytes(SECRET)
    return p


def _imagefolder_file_link(tmp_path):
    synthesize("imagenet", tmp_path / "src", 4, seed=3, classes=2, mean_bytes=500)
    (tmp_path / "src" / "n00000000" / "a.jpeg").symlink_to(_secret(tmp_path))
    return "imagefolder", tmp_path / "src", "a.jpeg"


def _imagefolder_dir_link(tmp_path):
    synthesize("imagenet", tmp_path / "src", 4, seed=3, classes=2, mean_bytes=500)
    out = tmp_path / "elsewhere" / "cls"
    out.mkdir(parents=True)
    (out / "b.jpeg").write_bytes(SECRET)
    (tmp_path / "src" / "n00000009").symlink_to(out)
    return "imagefolder", tmp_path / "src", "n00000009"


def _npy_link(tmp_path):
    (tmp_path / "src").mkdir()
    np.save(tmp_path / "src" / "0.npy", np.arange(4, dtype=np.uint8))
    np.save(tmp_path / "elsewhere.npy", np.frombuffer(SECRET, np.uint8))
    (tmp_path / "src" / "1.npy").symlink_to(tmp_path / "elsewhere.npy")
    return "npy", tmp_path / "src", "1.npy"


def _dlio_link(tmp_path):
    (tmp_path / "src").mkdir()
    np.savez(tmp_path / "src" / "img_0_of_2.npz", x=np.zeros((4, 4, 2), np.uint8), y=np.zeros(2))
    np.savez(tmp_path / "elsewhere.npz", x=np.frombuffer(SECRET[:16], np.uint8).reshape(4, 4, 1),
             y=np.zeros(1))
    (tmp_path / "src" / "img_1_of_2.npz").symlink_to(tmp_path / "elsewhere.npz")
    return "dlio", tmp_path / "src", "img_1_of_2.npz"


def _hdf5_external_storage(tmp_path):
    h5py = pytest.importorskip("h5py")
    (tmp_path / "src").mkdir()
    with h5py.File(tmp_path / "src" / "a.h5", "w") as f:
        f["x"] = np.arange(16)
        f.create_dataset("z", shape=(16,), dtype="u1",
                         external=[(str(_secret(tmp_path)), 0, h5py.h5f.UNLIMITED)])
    return "hdf5", tmp_path / "src", "'z' stores its data in another file"


def _hdf5_external_link(tmp_path):
    h5py = pytest.importorskip("h5py")
    (tmp_path / "src").mkdir()
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["data"] = np.frombuffer(SECRET[:16], np.uint8)
    with h5py.File(tmp_path / "src" / "a.h5", "w") as f:
        f["x"] = np.arange(16)
        f["y"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/data")
    return "hdf5", tmp_path / "src", "'y' is an external link"


def _hdf5_virtual(tmp_path):
    h5py = pytest.importorskip("h5py")
    (tmp_path / "src").mkdir()
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["data"] = np.frombuffer(SECRET[:16], np.uint8)
    layout = h5py.VirtualLayout(shape=(16,), dtype="u1")
    layout[:] = h5py.VirtualSource(str(tmp_path / "other.h5"), "data", shape=(16,))
    with h5py.File(tmp_path / "src" / "a.h5", "w") as f:
        f["x"] = np.arange(16)
        f.create_virtual_dataset("v", layout)
    return "hdf5", tmp_path / "src", "'v' is virtual"


OUTSIDE = {"imagefolder file symlink": _imagefolder_file_link,
           "imagefolder class directory symlink": _imagefolder_dir_link,
           "npy symlink": _npy_link, "dlio symlink": _dlio_link,
           "hdf5 external storage": _hdf5_external_storage,
           "hdf5 external link": _hdf5_external_link, "hdf5 virtual dataset": _hdf5_virtual}


@pytest.mark.parametrize("case", list(OUTSIDE))
def test_ingest_reads_nothing_outside_its_source_unless_told(tmp_path, cli, case):
    kind, src, names = OUTSIDE[case](tmp_path)
    keys = ["x", names.split("'")[1]] if kind == "hdf5" else None
    code, out, err = cli("ingest", src, tmp_path / "ds", "--from", kind,
                         *(["--keys", ",".join(keys)] if keys else []))
    assert code == 2 and not out, (out, err)
    line = err.strip()
    assert "\n" not in line and names in line and "--follow-links" in line, err
    assert "Traceback" not in err and not (tmp_path / "ds").exists()
    # opted in: the same command packs it, the outside bytes included
    code, out, err = cli("ingest", src, tmp_path / "ds", "--from", kind, "--follow-links",
                         *(["--keys", ",".join(keys)] if keys else []))
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "ds")
    packed = b"".join(np.asarray(ds[i][f]).tobytes() for f in ds[0] for i in range(len(ds)))
    assert SECRET[:16] in packed


def test_links_inside_the_source_are_read(tmp_path, cli):
    """A symlink to a file in the same tree, and an HDF5 external link to a file of the
    source directory, are the source's own."""
    h5py = pytest.importorskip("h5py")
    (tmp_path / "src").mkdir()
    with h5py.File(tmp_path / "src" / "b.data", "w") as f:   # not an .h5: not listed
        f["data"] = np.arange(16, 32)
    with h5py.File(tmp_path / "src" / "a.h5", "w") as f:
        f["x"] = np.arange(16)
        f["y"] = h5py.ExternalLink("b.data", "/data")
    code, out, err = cli("ingest", tmp_path / "src" / "a.h5", tmp_path / "one", "--from",
                         "hdf5", "--keys", "x,y")
    assert code == 2 and "outside the source" in err     # the source is that one file
    code, out, err = cli("ingest", tmp_path / "src", tmp_path / "ds", "--from", "hdf5",
                         "--keys", "x,y")
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "ds")
    assert [int(ds[i]["y"]) for i in range(len(ds))] == list(range(16, 32))
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "0.npy", np.arange(3))
    (tmp_path / "npy" / "1.npy").symlink_to(tmp_path / "npy" / "0.npy")
    code, out, err = cli("ingest", tmp_path / "npy", tmp_path / "n", "--from", "npy")
    assert code == 0, err
    assert len(forebay.open_dataset(tmp_path / "n")) == 2

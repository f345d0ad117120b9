"""Compressed fields (issue S, item 2): each sample's value a zstd frame of its own, read
at random without its neighbours, bit-exact through every read path and store;
checksums over what is stored; damaged or crafted frames named."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import forebay
from forebay.dataset import CODED_FORMAT_VERSION, seal_manifest
from forebay.errors import (ChecksumError, CorruptDatasetError, InvalidArgumentError,
                            ManifestError)

pytest.importorskip("zstandard")
N = 120


def samples():
    rng = np.random.default_rng(3)
    for i in range(N):
        yield {"x": np.repeat(rng.normal(size=(i % 6, 1)), 4, axis=1).astype(np.float32),
               "blob": bytes([i % 7]) * (i % 11) + rng.bytes(i % 3),
               "label": np.int64(i), "img": np.full((3, 4), i, np.uint8)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("cz")
    forebay.write_dataset(d / "plain.fb", samples(), shard_bytes=4096)
    forebay.write_dataset(d / "z.fb", samples(), shard_bytes=4096,
                          compress={"x": "zstd", "blob": "zstd:19", "img": "zstd"})
    return d / "plain.fb", d / "z.fb"


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


def test_compressed_fields_read_bit_exact_one_by_one_and_in_batches(pair):
    plain, z = (forebay.open_dataset(p) for p in pair)
    assert [f.codec for f in z.schema.fields] == ["zstd", "zstd", "", "zstd"]
    assert json.loads((pair[1] / "manifest.json").read_text())["version"] == \
        CODED_FORMAT_VERSION
    for i in range(N):
        assert_same(z[i], plain[i])
        assert not z[i]["x"].flags.writeable and z.sample(i, copy=True)["x"].flags.writeable
    ids = np.random.default_rng(0).integers(0, N, 77)
    got, want = z.get_many(ids), plain.get_many(ids)
    for name in plain.schema.names:
        assert got.field(name).equals(want.field(name)), name
    assert z.verify().ok


def test_each_value_is_its_own_frame(pair):
    """A sample is read without its neighbours: its stored bytes decompress alone."""
    import zstandard

    z = forebay.open_dataset(pair[1])
    lay, i = z.layout, 57
    row = z.index[i]
    rec = z.shard_buffer(int(z.shard_of[i]))[row[lay.REC_OFF]:row[lay.REC_OFF] + row[lay.REC_LEN]]
    off, nb = row[lay.off["img"]], row[lay.nbytes["img"]]
    assert zstandard.ZstdDecompressor().decompress(rec[off:off + nb].tobytes()) == \
        np.full((3, 4), i, np.uint8).tobytes()


@pytest.mark.parametrize("store", ["preload", "clairvoyant", "direct"])
def test_every_store_serves_compressed_fields(pair, store):
    from forebay.torch import DataLoader, Pipeline

    def labels_and_x(b):
        return b["label"].copy(), b.field("x").values.copy(), b["img"].copy()

    out = []
    for path in pair:
        with DataLoader(path, 16, seed=2, epochs=1, store=store, verify_on_read=True,
                        pipeline=Pipeline(collate_fn=labels_and_x)) as loader:
            out.append([tuple(t.tobytes() for t in b) for b in loader])
    assert out[0] == out[1]


def label_only(sample):
    return {"label": sample["label"], "img": sample["img"]}


def test_transform_workers_and_views_with_compressed_fields(pair):
    from forebay.torch import DataLoader, Pipeline

    got = []
    for path in pair:
        with DataLoader(path, 16, seed=1, store="direct",
                        pipeline=Pipeline(workers=2, transform=label_only)) as loader:
            got.append([(b["label"].tolist(), b["img"].numpy().tobytes()) for b in loader])
    assert got[0] == got[1]
    lent = []                     # views=True: read-only views of a decompressed copy
    for path in pair:
        with DataLoader(path, 16, seed=1, store="preload",
                        pipeline=Pipeline(views=True,
                                          collate_fn=lambda v: [a.tobytes() for a in
                                                                v.fields["x"]])) as loader:
            lent.append([b for b in loader])
    assert lent[0] == lent[1]


def test_a_damaged_frame_is_named_and_verify_catches_it(pair, tmp_path):
    d = tmp_path / "z.fb"
    shutil.copytree(pair[1], d)
    z = forebay.open_dataset(d)
    i, lay = 40, z.layout
    row = z.index[i]
    at = int(row[lay.REC_OFF] + row[lay.off["img"]] + 4)      # inside the frame's header
    shard = d / z.manifest.shards[int(z.shard_of[i])].data
    data = bytearray(shard.read_bytes())
    data[at] ^= 0xFF
    shard.write_bytes(bytes(data))
    z = forebay.open_dataset(d)
    with pytest.raises(CorruptDatasetError, match="field 'img'"):
        z[i]
    with pytest.raises(CorruptDatasetError, match=f"sample {i}, field 'img'"):
        z.get_many([3, i, 5])
    with pytest.raises(ChecksumError, match=f"sample {i}"):
        forebay.open_dataset(d, verify_on_read=True).get_many([i])
    with pytest.raises(ChecksumError, match=rf"damaged samples: \[{i}\]"):
        z.verify()


def _reseal(path, edit):
    m = path / "manifest.json"
    doc = json.loads(m.read_text())
    edit(doc)
    m.write_text(seal_manifest(doc))


def test_crafted_manifests_with_codecs_are_refused(pair, tmp_path):
    d = tmp_path / "z.fb"
    shutil.copytree(pair[1], d)
    _reseal(d, lambda doc: doc.update(version=1))        # an old reader's version, codecs in
    with pytest.raises(ManifestError, match="version 1 with compressed fields"):
        forebay.open_dataset(d)
    _reseal(d, lambda doc: [doc.update(version=2)]
            + [f.update(codec="lz4") for f in doc["schema"]["fields"] if "codec" in f])
    with pytest.raises(ManifestError, match="codec 'lz4'"):
        forebay.open_dataset(d)


def test_a_crafted_shape_beyond_what_a_frame_can_hold_is_refused_at_open(pair, tmp_path):
    import io

    from forebay.dataset import checksum

    d = tmp_path / "z.fb"
    shutil.copytree(pair[1], d)
    z = forebay.open_dataset(d)
    col = z.layout.shape["img"].start
    m = d / "manifest.json"
    doc = json.loads(m.read_text())
    ipath = d / doc["shards"][0]["index"]
    rows = np.load(ipath)
    rows[0, col] = 1 << 40                                 # 4 TiB from a few bytes
    buf = io.BytesIO()
    np.save(buf, rows, allow_pickle=False)
    ipath.write_bytes(buf.getvalue())
    doc["shards"][0].update(index_nbytes=len(buf.getvalue()),
                            index_checksum=checksum(buf.getvalue()))
    m.write_text(seal_manifest(doc))
    with pytest.raises(CorruptDatasetError, match="field 'img'"):
        forebay.open_dataset(d)


def test_append_and_mixtures_keep_the_codecs(pair, tmp_path):
    d = tmp_path / "z.fb"
    shutil.copytree(pair[1], d)
    forebay.append(d, samples())
    z = forebay.open_dataset(d)
    assert len(z) == 2 * N and [f.codec for f in z.schema.fields] == ["zstd", "zstd", "",
                                                                        "zstd"]
    assert_same(z[N + 5], forebay.open_dataset(pair[0])[5])
    mix = forebay.Mixture({str(d): 0.5, str(pair[1]): 0.5})
    from forebay.torch import DataLoader
    with DataLoader(mix, 8, store="preload") as loader:
        assert sum(len(b["label"]) for b in loader) == len(loader) * 8


@pytest.mark.parametrize("spec, match", [("zstd:0", "level must be 1 to 22"),
                                         ("lz4", "give 'zstd' or 'zstd:LEVEL'"),
                                         ({"nope": "zstd"}, "'nope', not a field")])
def test_bad_compress_settings_are_named(tmp_path, spec, match):
    with pytest.raises(InvalidArgumentError, match=match):
        forebay.write_dataset(tmp_path / "x.fb", samples(), compress=spec)
    assert not (tmp_path / "x.fb").exists()


def test_ingest_compress_option(tmp_path, cli):
    src = tmp_path / "src"
    src.mkdir()
    np.savez(src / "a.npz", x=np.zeros((50, 64), np.float32), y=np.arange(50))
    code, _, err = cli("ingest", src, tmp_path / "a.fb", "--from", "npz", "--compress",
                       "x=zstd:5")
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "a.fb")
    assert [f.codec for f in ds.schema.fields] == ["zstd", ""]
    assert ds.nbytes < 50 * 64 * 4 and np.array_equal(ds[7]["x"], np.zeros(64, np.float32))
    code, out, _ = cli("info", tmp_path / "a.fb")
    assert "zstd-compressed per sample" in out
    # forebay decompress: the node's copy (a job's prolog step), its path on stdout
    code, out, err = cli("decompress", tmp_path / "a.fb", "--into", tmp_path / "local")
    assert code == 0 and "50 samples, 12.9 KiB decompressed" in err, err
    copy = forebay.open_dataset(out.strip())
    assert not copy.layout.coded and np.array_equal(copy[7]["x"], ds[7]["x"])
    code, again, _ = cli("decompress", tmp_path / "a.fb", "--into", tmp_path / "local")
    assert again == out
    code, out, err = cli("decompress", copy.path, "--into", tmp_path / "local")
    assert code == 0 and out.strip() == str(copy.path) and "no compressed fields" in err


def test_a_decompressed_copy_is_made_once_and_read_bit_exact(pair, tmp_path):
    """The tiers hold the form they are given: a store over the node's decompressed
    copy holds the values' bytes, over the source the frames (issue S, item 2)."""
    from forebay.dataset import value_nbytes
    from forebay.store import DistributedStore

    plain, z = (forebay.open_dataset(p) for p in pair)
    copy = forebay.decompressed(pair[1], tmp_path / "local")
    assert copy.path == tmp_path / "local" / f"decompressed-{z.fingerprint}"
    assert [(f.name, f.kind, f.codec) for f in copy.schema.fields] == \
        [(f.name, f.kind, "") for f in z.schema.fields]
    assert copy.metadata["decompressed_from"] == {"path": str(z.path),
                                                  "fingerprint": z.fingerprint}
    ids = np.random.default_rng(4).permutation(N)
    got, want = copy.get_many(ids), plain.get_many(ids)
    for name in plain.schema.names:
        assert got.field(name).equals(want.field(name)), name
    assert copy.verify().ok
    assert np.array_equal(copy.sample_nbytes, value_nbytes(z))
    # what a store holds: the frames over the source, the values over the copy
    forebay.write_dataset(tmp_path / "big.fb", ({"x": np.full(1024, i, np.float32)}
                                                for i in range(64)), compress="zstd")
    big = forebay.open_dataset(tmp_path / "big.fb")
    held = [DistributedStore(ds, None, progress=False)
            for ds in (big, forebay.decompressed(big, tmp_path / "local"))]
    assert held[0].nbytes < 64 * 4096 <= held[1].nbytes
    assert held[1].get_many(ids % 64).equals(held[0].get_many(ids % 64))
    for s in held:
        s.close()
    # a second call (another rank, a later job) opens the same copy, not a new one
    made = (copy.path / "manifest.json").stat().st_mtime_ns
    again = forebay.decompressed(z, tmp_path / "local")
    assert again.path == copy.path and again.fingerprint == copy.fingerprint
    assert (copy.path / "manifest.json").stat().st_mtime_ns == made
    # a plain dataset is returned as is; a mixture is refused with the way to do it
    assert forebay.decompressed(plain, tmp_path / "local") is plain
    from forebay.dataset import ConcatDataset
    with pytest.raises(forebay.errors.UsageError, match="one by one"):
        forebay.decompressed(ConcatDataset([pair[1], pair[1]]), tmp_path / "local")


def test_a_changed_source_gets_a_new_copy_and_a_damaged_one_none(pair, tmp_path):
    d = tmp_path / "z.fb"
    shutil.copytree(pair[1], d)
    first = forebay.decompressed(d, tmp_path / "local")
    forebay.append(d, samples())                      # another version: another copy
    second = forebay.decompressed(d, tmp_path / "local")
    assert second.path != first.path and len(second) == 2 * N and len(first) == N
    assert_same(second[N + 7], forebay.open_dataset(pair[0])[7])
    # a record that fails its checksum stops the copy: nothing left to be reused
    z = forebay.open_dataset(d)
    i, lay = 9, z.layout
    at = int(z.index[i][lay.REC_OFF] + z.index[i][lay.off["label"]])
    shard = d / z.manifest.shards[int(z.shard_of[i])].data
    data = bytearray(shard.read_bytes())
    data[at] ^= 0x01
    shard.write_bytes(bytes(data))
    forebay.append(d, samples())              # a new version, its shards now damaged
    with pytest.raises(ChecksumError, match=f"sample {i} fails its checksum"):
        forebay.decompressed(d, tmp_path / "local")
    fp = forebay.open_dataset(d).fingerprint
    assert not (tmp_path / "local" / f"decompressed-{fp}").exists()
    # something else at the copy's place is named, not read as the copy
    shutil.copytree(pair[0], tmp_path / "local" / f"decompressed-{fp}")
    with pytest.raises(CorruptDatasetError, match="not a decompressed copy"):
        forebay.decompressed(d, tmp_path / "local")

"""Round trips of the packed format: bit-exact, aligned, read-only, batched, shareable."""

from __future__ import annotations

import json
import os
import pickle
import threading
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import forebay
from forebay.dataset import ALIGNMENT, FieldBatch
from forebay.errors import (ArgumentTypeError, InvalidArgumentError, SampleIndexError,
                            SchemaError, TruncatedShardError)
from conftest import assert_sample_equal, as_array

DTYPES = ["?", "i1", "u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8",
          "<c8", "<c16", ">f4", ">i8"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_numeric_dtype_round_trips_bit_exact(tmp_path, dtype):
    rng = np.random.default_rng(1)
    dt = np.dtype(dtype)
    samples = []
    for i in range(20):
        raw = rng.integers(0, 256, size=(i % 4 + 1) * 3 * dt.itemsize, dtype=np.uint8)
        arr = raw.view(dt).reshape(-1, 3) if dt.kind != "b" else \
            (raw % 2).astype(bool).reshape(-1, 3)
        samples.append({"a": arr,
                        "s": np.array(i, dtype=dt) if dt.kind != "b" else np.bool_(i % 2)})
    forebay.write_dataset(tmp_path / "d", samples)
    ds = forebay.open_dataset(tmp_path / "d")
    assert ds.schema["a"].dtype == dt
    for i, s in enumerate(samples):
        assert_sample_equal(ds[i], s)  # NaN payloads included: compared as bytes
    batch = ds.get_many(range(20))
    for i, s in enumerate(samples):
        assert_sample_equal(batch.sample(i), s)


def test_ragged_zero_d_bytes_and_empty_arrays(packed):
    path, samples = packed
    ds = forebay.open_dataset(path)
    assert len(ds) == len(samples)
    assert len(ds.manifest.shards) > 1
    assert ds.schema.names == ("x", "label", "blob", "mask", "z")
    assert ds.schema["blob"].kind == "bytes"
    assert ds.schema["label"].ndim == 0
    for i in (0, 1, 17, len(samples) - 1, -1, -len(samples)):
        assert_sample_equal(ds[i], samples[i])
    assert any(s["x"].shape[0] == 0 for s in samples)  # empty arrays are exercised
    assert any(len(s["blob"]) == 0 for s in samples)


def test_views_are_read_only_aligned_and_zero_copy(packed):
    path, samples = packed
    ds = forebay.open_dataset(path)
    checked = 0
    for i in range(len(ds)):
        for name, a in ds[i].items():
            assert not a.flags.writeable
            if a.nbytes:
                assert a.ctypes.data % ALIGNMENT == 0, (i, name)
                assert a.base is not None  # a view into the shard map, not a copy
                checked += 1
    assert checked > 0
    with pytest.raises(ValueError):
        ds[0]["mask"][0] = True


def test_a_sample_copied_or_read_from_another_buffer(packed):
    """ds.sample(i, copy=True): one writable copy of the record; sample_from: a sample
    out of a buffer that holds its record (a store's memory); a record that does not
    fit in the buffer is named, never read past."""
    path, samples = packed
    ds = forebay.open_dataset(path)
    rows = ds.rows(np.arange(len(ds)))
    for i in (0, 1, 17, len(samples) - 1, -1, -len(samples)):
        got = ds.sample(i, copy=True)
        assert_sample_equal(got, samples[i])
        assert all(a.flags.writeable for a in got.values())
        j = i % len(ds)
        start, n = int(rows[j, 0]), int(rows[j, 1])
        record = ds.shard_buffer(int(ds.shard_of[j]))[start:start + n]
        held = np.zeros(n + 24, dtype=np.uint8)
        held[8:8 + n] = record
        assert_sample_equal(ds.sample_from(i, held, 8), samples[i])
        lent = ds.sample_from(i, held, 8, copy=False)
        assert_sample_equal(lent, samples[i])
        if lent["x"].size:                     # a view of the buffer given, not a copy
            assert np.shares_memory(lent["x"], held)
        with pytest.raises(InvalidArgumentError, match="not inside the buffer"):
            ds.sample_from(i, held[:8 + n - 1], 8)
        with pytest.raises(InvalidArgumentError, match="not inside the buffer"):
            ds.sample_from(i, held, -1)
    got = ds.sample(3, copy=True)
    got["x"][...] = 7
    assert_sample_equal(ds[3], samples[3])
    with pytest.raises(ArgumentTypeError, match="uint8"):
        ds.sample_from(0, np.zeros(4096, dtype=np.int64))
    for start in (1.5, True, "8"):
        with pytest.raises(ArgumentTypeError, match="start must be an integer"):
            ds.sample_from(0, np.zeros(1 << 16, dtype=np.uint8), start)
    assert_sample_equal(ds.sample_from(0, ds.shard_buffer(int(ds.shard_of[0])),
                                       np.int64(ds.rows(np.array([0]))[0, 0])), samples[0])
    with pytest.raises(SampleIndexError):
        ds.sample(len(ds), copy=True)


def test_get_many_matches_single_reads_in_any_order(packed):
    path, samples = packed
    ds = forebay.open_dataset(path)
    ids = np.array([299, 0, 5, 5, 150, -1, 42])
    batch = ds.get_many(ids)
    assert len(batch) == len(ids)
    assert list(batch.keys()) == list(ds.schema.names)
    for k, i in enumerate(ids):
        assert_sample_equal(batch.sample(k), samples[i])
    # uniform fields stack into (n, *shape) without copying
    assert batch["label"].tolist() == [299, 0, 5, 5, 150, 299, 42]
    assert batch["mask"].shape == (len(ids), 4)
    # ragged fields come as values + offsets + shapes
    fb = batch.field("x")
    assert isinstance(fb, FieldBatch)
    assert fb.offsets[-1] == len(fb.values)
    assert [tuple(s) for s in fb.shapes] == [samples[i]["x"].shape for i in ids]
    if not fb.uniform:
        with pytest.raises(SchemaError):
            batch["x"]
    # writable, owned memory
    assert batch.field("z").values.flags.writeable


def test_get_many_large_records_use_the_copy_path(tmp_path):
    rng = np.random.default_rng(3)
    samples = [{"v": rng.normal(size=(rng.integers(100, 3000),))} for _ in range(40)]
    forebay.write_dataset(tmp_path / "d", samples, shard_bytes=64 << 10)
    ds = forebay.open_dataset(tmp_path / "d")
    ids = rng.permutation(40)
    batch = ds.get_many(ids)
    for k, i in enumerate(ids):
        np.testing.assert_array_equal(batch.sample(k)["v"], samples[i]["v"])


def test_get_many_empty_and_other_batch_equality(packed):
    path, _ = packed
    ds = forebay.open_dataset(path)
    empty = ds.get_many([])
    assert len(empty) == 0 and empty["label"].shape == (0,)
    a, b = ds.get_many([3, 4]), ds.get_many(np.array([3, 4], dtype=np.int32))
    assert a.equals(b)
    assert not a.equals(ds.get_many([4, 3]))


def test_sizes_schema_and_metadata(tmp_path, ragged):
    forebay.write_dataset(tmp_path / "d", ragged, metadata={"origin": "test", "n": 3})
    ds = forebay.open_dataset(tmp_path / "d")
    want = np.array([sum(as_array(v).nbytes for v in s.values()) for s in ragged])
    np.testing.assert_array_equal(ds.sample_nbytes, want)
    assert ds.nbytes == want.sum()
    assert ds.metadata == {"origin": "test", "n": 3}
    doc = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert doc["version"] == 1 and doc["num_samples"] == len(ragged)
    assert isinstance(ds._index, np.ndarray) and ds._index.dtype == np.int64


def test_shard_size_bounds_shards(tmp_path):
    samples = [{"a": np.full(1000, i, dtype=np.float64)} for i in range(100)]  # 8 KB each
    forebay.write_dataset(tmp_path / "d", samples, shard_bytes=100_000)
    ds = forebay.open_dataset(tmp_path / "d")
    sizes = [s.data_nbytes for s in ds.manifest.shards]
    assert len(sizes) == 9 and max(sizes) <= 100_000
    assert sum(s.num_samples for s in ds.manifest.shards) == 100
    np.testing.assert_array_equal(ds.get_many(range(100))["a"][:, 0], np.arange(100))


def test_torch_tensors_and_python_scalars_are_accepted(tmp_path):
    torch = pytest.importorskip("torch")
    samples = [{"t": torch.arange(4, dtype=torch.float32) * i, "k": i, "f": 0.5 * i}
               for i in range(5)]
    forebay.write_dataset(tmp_path / "d", samples)
    ds = forebay.open_dataset(tmp_path / "d")
    assert ds[3]["t"].tolist() == [0.0, 3.0, 6.0, 9.0]
    assert ds[3]["k"].dtype == np.int64 and ds[3]["k"] == 3
    assert ds[3]["f"].dtype == np.float64 and ds[3]["f"] == 1.5


def test_pickled_dataset_reopens_its_maps(packed):
    path, samples = packed
    ds = forebay.open_dataset(path)
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert_sample_equal(clone[7], samples[7])


def test_thread_safe_concurrent_reads(packed):
    path, samples = packed
    ds = forebay.open_dataset(path)  # maps opened lazily, concurrently

    def read(i):
        b = ds.get_many([i, (i * 7) % len(samples)])
        return b.sample(0)["x"].tobytes(), ds[i]["blob"].tobytes()

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(read, range(len(samples))))
    for i, (x, blob) in enumerate(results):
        assert x == samples[i]["x"].tobytes() and blob == samples[i]["blob"]


def test_fork_safe_reads_in_child(packed):
    path, samples = packed
    ds = forebay.open_dataset(path)
    ds[0]  # some maps open before the fork, others not
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            ok = all(ds[i]["x"].tobytes() == samples[i]["x"].tobytes() for i in range(len(ds)))
            ok = ok and ds.get_many([5, 250])["label"].tolist() == [5, 250]
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    assert got == b"1"


def test_overwrite_replaces_atomically(tmp_path, ragged):
    forebay.write_dataset(tmp_path / "d", ragged[:10])
    forebay.write_dataset(tmp_path / "d", ragged[:20], overwrite=True)
    assert len(forebay.open_dataset(tmp_path / "d")) == 20
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_writer_context_manager(tmp_path, ragged):
    with forebay.DatasetWriter(tmp_path / "d", shard_bytes=4096) as w:
        for s in ragged[:50]:
            w.add(s)
        assert not (tmp_path / "d").exists()  # appears only when closed
    ds = forebay.open_dataset(tmp_path / "d")
    assert len(ds) == 50 and ds.verify().ok


def test_gather_kernel_and_numpy_fallback_agree():
    from forebay.dataset._batch import _native, gather_ranges, gather_ranges_numpy

    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 100_000, dtype=np.uint8)
    for mean in (8, 3000):  # both numpy strategies
        lens = rng.integers(0, 2 * mean, 200)
        starts = rng.integers(0, len(src) - lens.max(), 200)
        dst = np.cumsum(lens) - lens
        a = np.zeros(int(lens.sum()), np.uint8)
        b = np.zeros_like(a)
        gather_ranges(src, starts, lens, a, dst)
        gather_ranges_numpy(src, starts, lens, b, dst)
        want = b"".join(src[s:s + n].tobytes() for s, n in zip(starts, lens))
        assert a.tobytes() == b.tobytes() == want
    for impl in (gather_ranges, gather_ranges_numpy):
        with pytest.raises(ValueError, match="out of bounds"):
            impl(src, np.array([len(src) - 5]), np.array([10]), np.zeros(10, np.uint8),
                 np.array([0]))
        with pytest.raises(ValueError, match="out of bounds"):
            impl(src, np.array([0]), np.array([10]), np.zeros(5, np.uint8), np.array([0]))
    if _native is not None:
        with pytest.raises(ValueError, match="differ in length"):
            _native.gather(src, np.array([0, 1]), np.array([1]), np.zeros(4, np.uint8),
                           np.array([0]))
        with pytest.raises(TypeError):
            _native.gather(src, np.array([0]), np.array([1]), src.copy().tobytes(), np.array([0]))


def test_batch_kernels_match_numpy_and_refuse_ranges_outside_buffers(tmp_path, monkeypatch):
    """assemble_batch's C path (batch_layout + gather_fields) gives the numpy path's
    batches, masks and all; crafted offsets raise ValueError, never read outside."""
    import forebay.dataset._batch as B

    if not B._FAST:
        pytest.skip("the C kernel is not built")
    rng = np.random.default_rng(1)
    forebay.write_dataset(tmp_path / "d", ({"x": rng.normal(size=(int(rng.integers(0, 5)), 2)),
                                             "s": rng.bytes(int(rng.integers(0, 40))),
                                             "k": np.int32(i)} for i in range(60)),
                          shard_bytes=1 << 10)
    ds = forebay.open_dataset(tmp_path / "d")
    batches = [rng.integers(0, len(ds), size=n) for n in (0, 1, 7, 60)]
    fast = [ds.get_many(ids) for ids in batches]              # several shards: masks
    monkeypatch.setattr(B, "_FAST", False)
    slow = [ds.get_many(ids) for ids in batches]
    assert all(a.equals(b) for a, b in zip(fast, slow))
    assert all(len(b.fields) == 3 for b in fast)
    rows = np.ascontiguousarray(ds.rows(np.array([0, 1])))
    lay = ds.layout
    nf, ncols = len(ds.schema.fields), rows.shape[1]
    meta = np.empty(nf + 2 * nf + 3 * nf, np.int64)
    size = B._native.batch_layout(rows, ncols, lay.nbytes_cols, lay.itemsizes, 64, meta)
    src = ds.shard_buffer(0)
    out = np.zeros(size, np.uint8)
    dst = meta[nf:3 * nf]
    with pytest.raises(ValueError, match="out of bounds"):     # a record past the shard
        B._native.gather_fields(src, rows, ncols, lay.off_cols, lay.nbytes_cols,
                                np.array([len(src) - 1, 0]), None, dst, out)
    with pytest.raises(ValueError, match="out of bounds"):     # output too small
        B._native.gather_fields(src, rows, ncols, lay.off_cols, lay.nbytes_cols,
                                rows[:, 0].copy(), None, dst, np.zeros(1, np.uint8))
    with pytest.raises(ValueError, match="record starts"):     # mask and starts disagree
        B._native.gather_fields(src, rows, ncols, lay.off_cols, lay.nbytes_cols,
                                rows[:, 0].copy(), np.array([True, False]), dst, out)
    bad = rows.copy()
    bad[0, lay.nbytes_cols[0]] = -8
    with pytest.raises(ValueError, match="bytes"):
        B._native.batch_layout(bad, ncols, lay.nbytes_cols, lay.itemsizes, 64, meta)
    with pytest.raises(ValueError, match="wrong length"):
        B._native.batch_layout(rows, ncols, lay.nbytes_cols, lay.itemsizes, 64, meta[:3])


def test_one_call_assemble_takes_only_what_it_can_read_safely(tmp_path):
    """The one-call kernel (layout, allocation and every part's copy) gives
    assemble_batch's batches; a part it does not take (an index-array selector, int32
    or reversed starts, int32 rows) is NotImplemented with nothing allocated, and the
    batch then comes from the other paths, bit-exact; crafted ranges and a short
    allocation raise ValueError before any byte moves."""
    import forebay.dataset._batch as B

    if not B._FAST:
        pytest.skip("the C kernel is not built")
    rng = np.random.default_rng(2)
    forebay.write_dataset(tmp_path / "d", ({"x": rng.normal(size=(int(rng.integers(0, 5)), 3)),
                                             "k": np.int16(i)} for i in range(40)),
                          shard_bytes=1 << 30)
    ds = forebay.open_dataset(tmp_path / "d")
    assert len(ds.manifest.shards) == 1
    ids = np.array([5, 0, 39, 5, 17])
    want = ds.get_many(ids)
    rows = ds.rows(ids)
    src = ds.shard_buffer(0)
    starts = rows[:, 0].copy()
    lay = ds.layout
    nf, ncols = len(lay.fields), rows.shape[1]
    asked = []

    def alloc(n):
        asked.append(n)
        return np.empty(n, np.uint8)

    def call(parts, rws=rows, allocate=alloc):
        meta = np.empty(nf + len(ids) * nf + (len(ids) + 1) * nf, np.int64)
        return B._native.assemble(rws, ncols, lay.off_cols, lay.nbytes_cols, lay.itemsizes,
                                  64, meta, parts, allocate)

    half = np.array([True, False, True, False, True])
    for parts in ([(src, starts, slice(None))],
                  [(src, rows[:, 0], slice(None))],              # a column: strided starts
                  [(src, starts[half], half), (src, starts[~half], ~half)]):
        got = B.assemble_batch(ids, rows, ds.schema, lay, parts)
        assert got.equals(want)
        out, bounds = call(parts)
        assert len(bounds) == 2 * nf and out.nbytes == asked[-1]
    asked.clear()
    for parts, rws in (([(src, starts, np.arange(5))], rows),
                       ([(src, starts[:1], slice(0, 1)), (src, starts[1:], slice(1, None))],
                        rows),
                       ([(src, starts.astype(np.int32), slice(None))], rows),
                       ([(src, np.ascontiguousarray(starts[::-1])[::-1], slice(None))], rows),
                       ([(src, starts, slice(None))], rows.astype(np.int32))):
        assert call(parts, rws) is NotImplemented
        assert B.assemble_batch(ids, rows, ds.schema, lay, parts).equals(want)
    assert asked == []
    with pytest.raises(ValueError, match="out of bounds"):      # a record past the shard
        call([(src, starts + len(src), slice(None))])
    with pytest.raises(ValueError, match="gave"):                # allocation too small
        call([(src, starts, slice(None))], allocate=lambda n: np.empty(n - 1, np.uint8))
    with pytest.raises(ValueError, match="record starts"):       # starts and mask disagree
        call([(src, starts[half][:2], half), (src, starts[~half], ~half)])


def test_native_extension_is_built_in_dev():
    """make builds the C kernel; if this fails, forebay silently runs the slower fallback."""
    from forebay.dataset._batch import _native

    assert _native is not None


def _mapped_rss(path) -> int:
    """Bytes of ``path``'s pages mapped in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_release_unmaps_copied_records_and_a_reread_is_unchanged(tmp_path):
    """A clairvoyant tier copies records out of the map; ``release`` then drops the
    map's pages from the process (the node held each sample twice: 2.03x its bytes in
    Pss, 1.03x after, benchmarks/store/node_memory.py), and reading them again faults
    the same bytes back in."""
    rng = np.random.default_rng(0)
    samples = [{"b": rng.integers(0, 256, 64 << 10, dtype=np.uint8).tobytes()}
               for _ in range(64)]
    forebay.write_dataset(tmp_path / "d", samples)
    ds = forebay.open_dataset(tmp_path / "d")
    ids = np.arange(len(ds))
    assert all(bytes(ds[i]["b"]) == samples[i]["b"] for i in ids)     # every page touched
    shard = ds.shard_path(0)
    assert _mapped_rss(shard) >= 60 * (64 << 10)
    ds.release(ids, ds.rows(ids))
    assert _mapped_rss(shard) < 64 << 10
    assert all(bytes(ds[i]["b"]) == samples[i]["b"] for i in ids)


def test_read_records_copies_records_with_pread_and_names_a_shard_cut_short(tmp_path,
                                                                            monkeypatch):
    """``read_records`` gives the records' bytes (as the maps hold them) across shards,
    with the C kernel and with its pure-Python fallback; a copied dataset has no open
    files; a shard cut short after it was opened raises TruncatedShardError naming the
    file and the sample, never a short copy."""
    import forebay.dataset._files as R
    from forebay.dataset import IndexLayout

    rng = np.random.default_rng(3)
    forebay.write_dataset(tmp_path / "d", ({"b": rng.bytes(int(rng.integers(1, 5000))),
                                             "k": np.int64(i)} for i in range(300)),
                          shard_bytes=64 << 10)
    ds = forebay.open_dataset(tmp_path / "d")
    assert len(ds.manifest.shards) > 3
    ids = rng.permutation(len(ds))[:200]
    rows = ds.rows(ids)
    ln = rows[:, IndexLayout.REC_LEN]
    dst = np.cumsum(ln) - ln

    def want() -> bytes:
        return b"".join(bytes(ds.shard_buffer(int(ds.shard_of[i]))[o:o + n])
                        for i, o, n in zip(ids, rows[:, IndexLayout.REC_OFF], ln))

    for native in (R._native, None):
        monkeypatch.setattr(R, "_native", native)
        out = np.zeros(int(ln.sum()), np.uint8)
        ds.read_records(ids, rows, out, dst)
        assert out.tobytes() == want()
        with pytest.raises((ValueError, InvalidArgumentError), match="out of bounds"):
            ds.read_records(ids, rows, out[:-1], dst)
    assert pickle.loads(pickle.dumps(ds))._files == {}
    last = int(ds.shard_of[-1])
    victim = np.flatnonzero(ds.shard_of == last)[-1]
    with open(ds.shard_path(last), "r+b") as f:               # cut short after opening
        f.truncate(int(ds.rows(np.array([victim]))[0, IndexLayout.REC_OFF]) + 1)
    one = np.array([victim])
    with pytest.raises(TruncatedShardError, match=f"sample {victim}'s record .* past the end"):
        ds.read_records(one, ds.rows(one), np.zeros(1 << 16, np.uint8), np.zeros(1, np.int64))


def test_running_out_of_file_descriptors_is_named(tmp_path):
    """Each shard a dataset reads stays open; a process at its RLIMIT_NOFILE gets an
    error naming the limit and what to change, not a bare EMFILE."""
    import resource

    from forebay.errors import UsageError

    forebay.write_dataset(tmp_path / "d", ({"b": bytes(3000)} for _ in range(40)),
                          shard_bytes=16 << 10)
    ds = forebay.open_dataset(tmp_path / "d")
    assert len(ds.manifest.shards) >= 4
    import numpy.ma  # noqa: F401  (imported lazily on the way; nothing left to open it)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
    taken = []
    try:
        while True:                  # every descriptor below the limit in use
            try:
                taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        with pytest.raises(UsageError, match=r"RLIMIT_NOFILE .*ulimit -n"):
            ds.get_many(np.arange(len(ds)))
        os.close(taken.pop())        # one left: the shard opens, its map cannot
        with pytest.raises(UsageError, match=r"RLIMIT_NOFILE .*ulimit -n"):
            ds.get_many(np.arange(len(ds)))
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert ds.get_many(np.arange(len(ds))).num_samples == len(ds)


def test_a_copying_tier_fills_without_mapping_the_files(tmp_path):
    """The clairvoyant copying tier reads the files with pread: after a whole fill the
    process maps none of the shard's pages (the node holds each sample once, in the
    tier), and the tier's batches are the dataset's."""
    from forebay.plan import AccessPlan
    from forebay.store import ClairvoyantStore
    from forebay.world import LOCAL

    rng = np.random.default_rng(4)
    forebay.write_dataset(tmp_path / "d", ({"b": rng.bytes(64 << 10)} for _ in range(64)))
    ds = forebay.open_dataset(tmp_path / "d")
    st = ClairvoyantStore(ds, AccessPlan(len(ds), 1, 8, 1, 0), LOCAL, ram_bytes=8 << 20,
                          ram_tier="copy", fill=False, warm_files=False)
    assert st.fill_now() == len(ds)
    assert _mapped_rss(ds.shard_path(0)) == 0
    ids = np.arange(len(ds))
    assert st.get_many(ids).equals(ds.get_many(ids))
    assert st.stats()["fetches_by_source"] == {"local": len(ds), "peer": 0, "pfs": 0}
    st.close()


def _evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.sync()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_warm_reads_the_extents_samples_fill_once_in_parts(tmp_path):
    """``warm`` reads whole extents sequentially into the page cache (ranks split
    them), skips what is cached, and the samples read afterwards are unchanged."""
    rng = np.random.default_rng(1)
    samples = [{"b": rng.integers(0, 256, 3000, dtype=np.uint8).tobytes()}
               for _ in range(2000)]
    forebay.write_dataset(tmp_path / "d", samples, shard_bytes=2 << 20)
    ds = forebay.open_dataset(tmp_path / "d")
    assert ds.small_records
    extent = 256 << 10
    every = ds.warm_extents(extent=extent)
    # every extent of every shard, in file order, each at most `extent` bytes
    sizes = [s.data_nbytes for s in ds.manifest.shards]
    assert sum(n for _, _, n in every) == sum(sizes)
    assert all(n <= extent and at % extent == 0 for _, at, n in every)
    # a sample set that fills no extent to 90% (every other sample) warms nothing
    assert ds.warm_extents(np.arange(0, len(ds), 2), extent=extent) == []
    for k in range(len(sizes)):
        _evict(ds.shard_path(k))
    parts = [ds.warm(part=p, parts=3, extent=extent) for p in range(3)]
    assert sum(r["extents"] + r["cached"] for r in parts) == len(every)
    read, cached = sum(r["bytes"] for r in parts), sum(r["cached"] for r in parts)
    assert read <= sum(sizes) and (cached > 0 or read == sum(sizes))   # tmpfs: all cached
    again = ds.warm(extent=extent)          # all in the page cache now
    assert again["bytes"] == 0 and again["cached"] == len(every)
    assert all(ds.cached(k, 0, n) and ds.cached(k, n // 3, n) for k, n in enumerate(sizes))
    stop = threading.Event()
    stop.set()
    assert ds.warm(stop=stop, extent=extent)["extents"] == 0
    ids = rng.permutation(len(ds))[:500]
    batch = ds.get_many(ids)
    assert all(bytes(batch.sample(j)["b"]) == samples[i]["b"] for j, i in enumerate(ids))


def test_warm_names_a_shard_truncated_after_opening(tmp_path):
    samples = [{"b": np.full(1000, i % 251, dtype=np.uint8)} for i in range(1000)]
    forebay.write_dataset(tmp_path / "d", samples)
    ds = forebay.open_dataset(tmp_path / "d")
    path = ds.shard_path(0)
    _evict(path)
    os.truncate(path, 100_000)
    with pytest.raises(TruncatedShardError, match="shard-00000"):
        ds.warm(extent=64 << 10)


def test_a_failed_warm_up_fails_the_next_batch_with_its_cause(tmp_path):
    from forebay.store import DirectStore, StoreError
    samples = [{"b": np.full(1000, i % 251, dtype=np.uint8)} for i in range(1000)]
    forebay.write_dataset(tmp_path / "d", samples)
    ds = forebay.open_dataset(tmp_path / "d")
    os.truncate(ds.shard_path(0), 100_000)       # after opening: the index still agrees
    store = DirectStore(ds, warm=(0, 1))
    store._warm.join()
    with pytest.raises(StoreError, match=r"files ahead \(warm_files\) failed: "
                                         "TruncatedShardError: .*shard-00000"):
        store.get_many([1, 2])
    store.close()


@pytest.mark.parametrize("n", [1, 40])          # the few-samples path and the numpy one
def test_views_never_reach_outside_their_source(tmp_path, n):
    """assemble_views checks every range against its source and takes read-only
    sources only: a short or writable source raises instead of lending less."""
    from forebay.dataset import IndexLayout, ReadOnly, assemble_views
    from forebay.errors import InvalidArgumentError

    forebay.write_dataset(tmp_path / "ds", ({"b": bytes([i]) * 300, "y": np.int64(i)}
                                            for i in range(n)))
    ds = forebay.open_dataset(tmp_path / "ds")
    ids = np.arange(n)
    rows = ds.rows(ids)
    starts = rows[:, IndexLayout.REC_OFF] - rows[0, IndexLayout.REC_OFF]
    need = int((starts + rows[:, IndexLayout.REC_LEN]).max())
    src = ReadOnly(np.zeros(need, dtype=np.uint8)).array()
    views = assemble_views(ids, rows, ds.schema, ds.layout, [(src, starts, slice(None))])
    assert [v.tobytes() for v in views["b"]] == [bytes(300)] * n
    short = ReadOnly(np.zeros(need - 1, dtype=np.uint8)).array()
    with pytest.raises(InvalidArgumentError, match="outside its source"):
        assemble_views(ids, rows, ds.schema, ds.layout, [(short, starts, slice(None))])
    with pytest.raises(InvalidArgumentError, match="writable"):
        assemble_views(ids, rows, ds.schema, ds.layout,
                       [(np.zeros(need, dtype=np.uint8), starts, slice(None))])


def test_buffer_pool_reuses_a_buffer_only_once_nothing_reaches_its_memory():
    """A BufferPool buffer comes back only when the last array or tensor over any part
    of it is gone; until then a new batch gets other memory (a held batch is never
    overwritten)."""
    import torch
    from forebay.dataset import BufferPool
    from forebay.errors import InvalidArgumentError

    pool = BufferPool(keep=2, granule=1000)
    a = pool(1000)
    first = a.ctypes.data
    a[:] = 7
    part = a[10:20].view(np.uint8)       # a view of a view: the lease still reaches it
    del a
    b = pool(1000)
    assert b.ctypes.data != first and (part == 7).all()
    b[:] = 9
    del part
    c = pool(1000)
    assert c.ctypes.data == first                 # nothing reached it: reused
    t = torch.from_numpy(c[64:128].view(np.int64))[2:4]     # a tensor over a slice
    del c
    d = pool(1000)
    assert d.ctypes.data != first
    del t
    assert pool(1000).ctypes.data == first
    assert pool.stats()["reused"] == 2
    pool.granule = 1 << 20      # (below the granule: a plain allocation, not pooled)
    assert pool(1000).base is None and pool.stats()["allocated"] == 3
    # a buffer much larger than asked is not lent for a small batch, nor one too small
    # for a large batch; at most ``keep`` free buffers are kept
    big = pool(8 << 20)
    big_at = big.ctypes.data
    del big
    assert pool(1 << 20).ctypes.data != big_at
    assert len(pool(16 << 20)) == 16 << 20
    held = [pool(1 << 20) for _ in range(4)]
    del held
    assert pool.stats()["free"] == 2
    # a lease can die anywhere: inside the garbage collector (a batch in a reference
    # cycle), and while this thread holds the pool's lock (a collection run inside
    # the pool's own code): the buffer still comes back, and nothing deadlocks
    import gc
    pool = BufferPool(keep=1)
    x = pool(1 << 20)
    at = x.ctypes.data
    cycle: list = [x]
    cycle.append(cycle)
    del x, cycle
    gc.collect()
    y = pool(1 << 20)
    assert y.ctypes.data == at
    with pool._lock:
        del y
    assert pool(1 << 20).ctypes.data == at
    with pytest.raises(InvalidArgumentError, match="BufferPool"):
        BufferPool(keep=-1)

"""Every kind of bad input gets a clear error naming what is wrong, and no partial output."""

from __future__ import annotations

import json
import os
import pickle
import re

import numpy as np
import pytest

import forebay
from forebay import errors
from forebay.dataset import can_lock, checksum, seal_manifest
from forebay.dataset.sources import NpzSource, PickleSource, get_source, ingest
from conftest import leftovers


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _record_of(ds, i):
    row = ds._index[i]
    return ds.path / ds.manifest.shards[ds._shard_of[i]].data, int(row[0]), int(row[1])


# -- damaged datasets -------------------------------------------------------------
def test_truncated_shard_is_named_at_open(packed):
    path, _ = packed
    shard = path / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(errors.TruncatedShardError, match="shard-00001.bin") as e:
        forebay.open_dataset(path)
    assert isinstance(e.value, ValueError)


def test_a_shard_truncated_while_mapped_ends_the_reader_with_sigbus(packed):
    """The documented behaviour (docs/format.md): a shard cut short under a process that
    has it mapped kills that process with SIGBUS on access; it never returns bytes from
    past the new end (zeros, or another file's) as a sample.  A reopen names the
    truncation.  (A forked child reopens its maps, so the child here opens its own.)"""
    import faulthandler
    import os
    import signal

    path, ragged = packed
    pid = os.fork()
    if pid == 0:
        code = 3
        faulthandler.disable()            # the child's SIGBUS is the expected end
        try:
            ds = forebay.open_dataset(path)
            last = len(ds) - 1
            code = 4 if bytes(ds[last]["blob"]) != ragged[-1]["blob"] else 5   # mapped
            sample = ds[last]             # views of the map
            os.truncate(_record_of(ds, last)[0], 0)
            code = 6 if bytes(sample["blob"]) else 7     # SIGBUS here: the process ends
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGBUS, status
    with pytest.raises(errors.TruncatedShardError):
        forebay.open_dataset(path)


def test_views_of_a_shard_truncated_while_mapped_raise_instead(packed, tmp_path):
    """get_views maps a batch's pages in before it lends them (the first time this
    process lends each sample): a shard cut short after it was mapped raises
    TruncatedShardError naming it, where a read of the views would end the process
    with SIGBUS (the test above)."""
    import os
    import shutil

    path = tmp_path / "copy"
    shutil.copytree(packed[0], path)
    ds = forebay.open_dataset(path)
    last = len(ds) - 1
    assert ds.get_views([0]).equals(ds.get_many([0]))     # the first shard mapped
    shard = _record_of(ds, last)[0]
    ds.get_many([last])                                   # and the last
    os.truncate(shard, 0)
    with pytest.raises(errors.TruncatedShardError, match=shard.name):
        ds.get_views([last])


@pytest.mark.skipif(not can_lock(64 << 20), reason="this process may "
                    "not lock memory (RLIMIT_MEMLOCK)")
def test_a_shard_truncated_under_the_page_cache_tier_is_named_by_its_fill(packed, tmp_path):
    """The clairvoyant RAM tier held in the page cache (ram_tier="pages") maps the
    samples in as it fills: a shard cut short after the dataset was opened, before or
    after the tier mapped it, raises TruncatedShardError naming it from the fill (here
    run in the caller's thread; the fill threads' error is raised by the next
    get_many), never SIGBUS."""
    import os
    import shutil

    from forebay.store import ClairvoyantStore
    from forebay.world import LOCAL

    path = tmp_path / "copy"
    shutil.copytree(packed[0], path)
    ds = forebay.open_dataset(path)
    plan = forebay.AccessPlan(len(ds), 1, 4, 1)
    with ClairvoyantStore(ds, plan, LOCAL, ram_bytes=1 << 20,
                          ram_tier="pages", fill=False) as st:
        for shard in sorted({_record_of(ds, i)[0] for i in range(len(ds))}):
            os.truncate(shard, 0)
        with pytest.raises(errors.TruncatedShardError, match=r"shard-\d+\.bin"):
            st.fill_now()
    # one shard, already mapped (and partly locked) when it is cut short
    one = tmp_path / "one"
    forebay.write_dataset(one, ({"x": np.full(3000, i, dtype=np.int64)} for i in range(40)))
    ds = forebay.open_dataset(one)
    with ClairvoyantStore(ds, forebay.AccessPlan(len(ds), 1, 4, 1), LOCAL, ram_bytes=1 << 20,
                          ram_tier="pages", fill=False) as st:
        assert st.fill_now(limit=4) == 4
        shard = _record_of(ds, 0)[0]
        os.truncate(shard, 4096)
        with pytest.raises(errors.TruncatedShardError, match=shard.name):
            st.fill_now()


def test_missing_shard_file(packed):
    path, _ = packed
    (path / "shard-00000.bin").unlink()
    with pytest.raises(FileNotFoundError, match="shard-00000.bin"):
        forebay.open_dataset(path)


def test_flipped_byte_caught_by_verify_and_verified_reads(packed, cli):
    path, samples = packed
    ds = forebay.open_dataset(path)
    victim = 123
    shard, off, _ = _record_of(ds, victim)
    nbytes_x = samples[victim]["x"].nbytes
    assert nbytes_x > 0 or True
    _flip(shard, off + 1)  # inside the record's first field (or its padding)
    ds = forebay.open_dataset(path)  # open checks sizes and index only: still opens
    with pytest.raises(errors.ChecksumError, match=rf"{shard.name}.*damaged samples: \[{victim}\]"):
        ds.verify()
    report = ds.verify(raise_on_error=False)
    assert not report.ok and report.bad_samples == [victim]
    strict = forebay.open_dataset(path, verify_on_read=True)
    with pytest.raises(errors.ChecksumError, match=f"sample {victim}"):
        strict[victim]
    with pytest.raises(errors.ChecksumError, match=f"sample {victim}"):
        strict.get_many([0, victim])
    strict[victim + 1]  # undamaged neighbours still read
    code, out, err = cli("verify", path)
    assert code == 1 and "CORRUPT" in err and str(victim) in err


def test_flipped_padding_byte_still_fails_verify(tmp_path):
    # 3-byte records leave 61 bytes of padding between samples
    forebay.write_dataset(tmp_path / "d", [{"a": np.arange(3, dtype=np.uint8)}] * 4)
    _flip(tmp_path / "d" / "shard-00000.bin", 10)
    report = forebay.open_dataset(tmp_path / "d").verify(raise_on_error=False)
    assert not report.ok and report.bad_samples == []
    assert "padding" in report.problems[0]


def test_corrupted_index_file(packed):
    path, _ = packed
    _flip(path / "shard-00000.idx.npy", 200)
    with pytest.raises(errors.ChecksumError, match="shard-00000.idx.npy"):
        forebay.open_dataset(path)


@pytest.mark.parametrize("damage, error, words", [
    (lambda m: m.unlink(), errors.ManifestError, "manifest.json is missing"),
    (lambda m: m.write_text('{"format": "forebay.packed", "vers'), errors.ManifestError,
     "not valid JSON"),
    (lambda m: m.write_bytes(b"\xff\xfe\x00garbage"), errors.ManifestError, "not valid JSON"),
    (lambda m: m.write_text(json.dumps({**json.loads(m.read_text()), "version": 99})),
     errors.FormatVersionError, "format version 99"),
    # edited with the checksum recomputed (crafted): the content checks still apply
    (lambda m: m.write_text(seal_manifest({k: v for k, v in json.loads(m.read_text()).items()
                                           if k != "schema"})), errors.ManifestError, "'schema'"),
    (lambda m: m.write_text(seal_manifest({**json.loads(m.read_text()), "num_samples": 7})),
     errors.ManifestError, "num_samples"),
    # edited without: the checksum catches it
    (lambda m: m.write_text(m.read_text().replace('"num_samples": 300', '"num_samples": 301')),
     errors.ChecksumError, "manifest checksum mismatch"),
    (lambda m: m.write_text(json.dumps(json.loads(m.read_text()))), errors.ManifestError,
     "no checksum"),
    (lambda m: m.write_text("[1, 2]"), errors.ManifestError, "not a forebay manifest"),
])
def test_bad_manifests(packed, damage, error, words):
    path, _ = packed
    damage(path / "manifest.json")
    with pytest.raises(error, match=words) as e:
        forebay.open_dataset(path)
    assert isinstance(e.value, ValueError) and str(path) in str(e.value)


def test_missing_dataset_is_file_not_found(tmp_path, cli):
    with pytest.raises(FileNotFoundError, match="no dataset"):
        forebay.open_dataset(tmp_path / "nope")
    code, _, err = cli("info", tmp_path / "nope")
    assert code == 2 and "no dataset" in err


def test_index_out_of_range(packed):
    path, samples = packed
    ds = forebay.open_dataset(path)
    n = len(samples)
    for bad in (n, -n - 1, 10**9):
        with pytest.raises(errors.SampleIndexError, match=f"{bad} out of range for {n}"):
            ds[bad]
    with pytest.raises(IndexError, match=f"{n} out of range"):
        ds.get_many([0, n, 1])
    with pytest.raises(TypeError):
        ds["x"]
    with pytest.raises(TypeError):
        ds.get_many([0.5])


# -- bad samples for the writer ------------------------------------------------------
@pytest.mark.parametrize("bad, words", [
    ({"a": np.zeros(3, np.float32)}, "missing \\['b'\\]"),
    ({"a": np.zeros(3, np.float32), "b": np.int64(1), "c": 1}, "unexpected \\['c'\\]"),
    ({"a": np.zeros(3, np.float64), "b": np.int64(1)}, "field 'a': dtype <f8 differs"),
    ({"a": np.zeros((3, 1), np.float32), "b": np.int64(1)}, "field 'a': 2-d array"),
    ({"a": np.array(["x"]), "b": np.int64(1)}, "field 'a': dtype <U1 is not supported"),
    ({"a": np.array([object()]), "b": np.int64(1)}, "field 'a': dtype object"),
    ({"a": "text", "b": np.int64(1)}, "str values"),
    ([1, 2], "must be a mapping"),
])
def test_inconsistent_samples_name_index_and_field(tmp_path, bad, words):
    good = {"a": np.zeros(2, np.float32), "b": np.int64(0)}
    with pytest.raises(errors.SchemaError, match=f"sample 2.*{words}|{words}") as e:
        forebay.write_dataset(tmp_path / "d", [good, good, bad, good])
    assert "sample 2" in str(e.value)
    assert not (tmp_path / "d").exists() and leftovers(tmp_path) == []


def test_object_array_in_first_sample(tmp_path):
    with pytest.raises(errors.UnsupportedDtypeError, match="sample 0, field 'o'"):
        forebay.write_dataset(tmp_path / "d", [{"o": np.array([{}, None])}])
    assert not (tmp_path / "d").exists()


def test_existing_output_refused_and_kept(packed, ragged):
    path, samples = packed
    with pytest.raises(errors.DatasetExistsError, match="overwrite") as e:
        forebay.write_dataset(path, ragged[:3])
    assert isinstance(e.value, FileExistsError)
    assert len(forebay.open_dataset(path)) == len(samples)


def _precious(root):
    """A user's directory that no forebay command wrote."""
    (root / "sub").mkdir(parents=True)
    (root / "thesis.tex").write_text("years of work")
    (root / "sub" / "data.csv").write_text("1,2,3")
    return root


def _still_there(root):
    return ((root / "thesis.tex").read_text() == "years of work"
            and (root / "sub" / "data.csv").read_text() == "1,2,3")


def test_overwrite_refuses_a_users_directory(tmp_path, cli):
    """--overwrite replaces a forebay dataset, never a directory forebay did not write
    (it used to rename it aside and delete it whole)."""
    precious = _precious(tmp_path / "precious")
    with pytest.raises(errors.DatasetExistsError, match="refusing to overwrite"):
        forebay.write_dataset(precious, [{"x": np.arange(3)}], overwrite=True)
    assert _still_there(precious)
    forebay.synth.synthesize("mummi", tmp_path / "src", 8, per_file=4)
    code, out, err = cli("ingest", tmp_path / "src", precious, "--from", "npz", "--overwrite")
    assert code == 2 and "refusing to overwrite" in err and "Traceback" not in err
    assert _still_there(precious) and leftovers(tmp_path) == []
    code, out, err = cli("synth", "ising", precious, "--samples", "3", "--overwrite")
    assert code == 2 and "forebay synth did not write it" in err
    assert _still_there(precious) and leftovers(tmp_path) == []
    # a file or a link is refused too; a link's target is never touched
    (tmp_path / "file").write_text("mine")
    (tmp_path / "link").symlink_to(precious)
    for p in (tmp_path / "file", tmp_path / "link"):
        with pytest.raises(errors.DatasetExistsError, match="refusing"):
            forebay.write_dataset(p, [{"x": np.arange(3)}], overwrite=True)
    assert (tmp_path / "file").read_text() == "mine" and _still_there(precious)


def test_overwrite_replaces_datasets_and_empty_directories(packed, tmp_path):
    path, samples = packed
    forebay.write_dataset(path, samples[:3], overwrite=True)
    assert len(forebay.open_dataset(path)) == 3
    (tmp_path / "empty").mkdir()
    forebay.write_dataset(tmp_path / "empty", samples[:2], overwrite=True)
    assert len(forebay.open_dataset(tmp_path / "empty")) == 2
    # a dataset holding something its manifest does not list is refused, then kept
    (path / "notes.txt").write_text("mine")
    with pytest.raises(errors.DatasetExistsError, match="notes.txt"):
        forebay.write_dataset(path, samples[:5], overwrite=True)
    assert (path / "notes.txt").read_text() == "mine" and len(forebay.open_dataset(path)) == 3


def test_synth_overwrite_replaces_only_its_own_output(tmp_path):
    from forebay.synth import synthesize

    out = synthesize("ising", tmp_path / "s", 4)
    synthesize("ising", out, 6, overwrite=True)
    assert len(list(out.glob("*.pkl"))) == 6
    (out / "extra.txt").write_text("mine")
    with pytest.raises(errors.DatasetExistsError, match="holds 7 files"):
        synthesize("ising", out, 2, overwrite=True)
    assert (out / "extra.txt").read_text() == "mine"


def test_failed_overwrite_keeps_the_old_dataset(packed):
    path, samples = packed

    def broken():
        yield samples[0]
        raise RuntimeError("source died")

    with pytest.raises(RuntimeError, match="source died"):
        forebay.write_dataset(path, broken(), overwrite=True)
    ds = forebay.open_dataset(path)
    assert len(ds) == len(samples) and ds.verify().ok
    assert leftovers(path.parent) == []


def test_empty_source(tmp_path):
    with pytest.raises(errors.EmptySourceError, match="no samples"):
        forebay.write_dataset(tmp_path / "d", [])
    assert not (tmp_path / "d").exists() and leftovers(tmp_path) == []


# -- bad sources ------------------------------------------------------------------
def test_pickle_source_needs_trust(tmp_path, cli):
    (tmp_path / "src").mkdir()
    with open(tmp_path / "src" / "a.pkl", "wb") as f:
        pickle.dump({"a": np.zeros(2)}, f)
    with pytest.raises(errors.UntrustedPickleError, match="--trust-pickle"):
        PickleSource(tmp_path / "src")
    code, _, err = cli("ingest", tmp_path / "src", tmp_path / "out", "--from", "pickle")
    assert code == 2 and "--trust-pickle" in err and not (tmp_path / "out").exists()
    code, _, _ = cli("ingest", tmp_path / "src", tmp_path / "out", "--from", "pickle",
                     "--trust-pickle")
    assert code == 0


def test_empty_source_directory(tmp_path, cli):
    (tmp_path / "src").mkdir()
    with pytest.raises(errors.EmptySourceError, match="no npz files"):
        NpzSource(tmp_path / "src")
    code, _, err = cli("ingest", tmp_path / "src", tmp_path / "out", "--from", "npz")
    assert code == 2 and "no npz files" in err
    with pytest.raises(FileNotFoundError, match="does not exist"):
        NpzSource(tmp_path / "missing")


def test_npz_missing_key_and_ragged_stack(tmp_path):
    (tmp_path / "src").mkdir()
    np.savez(tmp_path / "src" / "f0.npz", a=np.zeros((4, 2)), b=np.zeros(4))
    np.savez(tmp_path / "src" / "f1.npz", a=np.zeros((4, 2)), b=np.zeros(3))
    with pytest.raises(errors.SourceError, match=r"f0.npz: no 'c' \(has 'a', 'b'\)"):
        ingest(get_source("npz", tmp_path / "src", keys=["c"]), tmp_path / "out")
    with pytest.raises(errors.SourceError, match="f1.npz: arrays differ in length"):
        ingest(get_source("npz", tmp_path / "src"), tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_npz_object_array_and_garbled_file(tmp_path):
    (tmp_path / "src").mkdir()
    np.savez(tmp_path / "src" / "obj.npz", a=np.array([{"k": 1}, None], dtype=object))
    with pytest.raises(errors.UnsupportedDtypeError, match="obj.npz"):
        ingest(get_source("npz", tmp_path / "src"), tmp_path / "out")
    (tmp_path / "src" / "obj.npz").write_bytes(b"PK\x03\x04 this is not a zip")
    with pytest.raises(errors.SourceError, match="obj.npz: cannot read"):
        ingest(get_source("npz", tmp_path / "src"), tmp_path / "out")
    # not a zip at all: np.load took it for a pickle ("holds an object array")
    (tmp_path / "src" / "obj.npz").write_bytes(b"garbage, not an archive")
    with pytest.raises(errors.SourceError, match=r"obj.npz: not an npz archive \(not a zip"):
        ingest(get_source("npz", tmp_path / "src"), tmp_path / "out")
    (tmp_path / "npy").mkdir()
    (tmp_path / "npy" / "a.npy").write_bytes(b"garbage, not an array")
    with pytest.raises(errors.SourceError, match=r"a.npy: not an .npy array \(no NumPy header"):
        ingest(get_source("npy", tmp_path / "npy"), tmp_path / "out")


def _npy_declaring(shape, body: int = 1024) -> bytes:
    """An .npy whose header declares ``shape`` of float64, followed by ``body`` bytes."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "<f8", "fortran_order": False, "shape": shape})
    return buf.getvalue() + bytes(body)


@pytest.mark.parametrize("kind", ["npz", "npy", "dlio npz", "dlio npy"])
def test_a_declared_shape_beyond_the_stored_bytes_is_refused_before_allocating(
        tmp_path, cli, kind):
    """An 8 MB file declaring shape (1, 8e9) made ingest allocate 59.6 GiB (then an
    ArrayMemoryError traceback): the header is read first, nothing allocated."""
    import zipfile

    (tmp_path / "src").mkdir()
    data = _npy_declaring((1, 8_000_000_000), body=8 << 20)
    if kind.endswith("npz"):
        with zipfile.ZipFile(tmp_path / "src" / "a.npz", "w") as z:
            z.writestr("x.npy", data)
    else:
        (tmp_path / "src" / "a.npy").write_bytes(data)
    code, out, err = cli("ingest", tmp_path / "src", tmp_path / "out", "--from",
                         kind.split()[0])
    assert code == 2 and not out
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "declares shape (1, 8000000000) of float64 (59.6 GiB) but holds 8.0 MiB" in err, err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_a_declared_shape_beyond_memory_is_refused(tmp_path, monkeypatch):
    """Stored in full (a real 64 MiB array) but more than the node has: named, not
    allocated (FOREBAY_MEMORY_LIMIT stands in for a small node)."""
    (tmp_path / "src").mkdir()
    np.save(tmp_path / "src" / "a.npy", np.zeros((8, 1 << 20)))
    monkeypatch.setenv("FOREBAY_MEMORY_LIMIT", str(32 << 20))
    with pytest.raises(errors.SourceError, match=r"a.npy declares shape \(8, 1048576\) of "
                       r"float64 \(64.0 MiB\): more than the 32.0 MiB of memory available"):
        ingest(get_source("npy", tmp_path / "src"), tmp_path / "out")
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "big.h5", "w") as f:     # chunked, nothing written: ~KB
        f.create_dataset("x", shape=(1 << 40,), dtype="f8", chunks=(1 << 16,))
    assert (tmp_path / "big.h5").stat().st_size < 1 << 20
    with pytest.raises(errors.SourceError, match=r"dataset 'x' declares shape \(1099511627776,\)"
                       r" of float64 \(8.0 TiB\): more than"):
        ingest(get_source("hdf5", tmp_path / "big.h5", layout="per-file"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_many_tiny_stacked_samples_are_made_one_at_a_time(tmp_path):
    """A stacked source's unit is a lazy sequence: 2 M one-byte samples are not 2 M
    dicts held at once (900 MB before)."""
    from forebay.dataset.sources import Stacked

    (tmp_path / "src").mkdir()
    x = (np.arange(100_000) % 251).astype(np.uint8).reshape(-1, 1)
    np.savez(tmp_path / "src" / "a.npz", x=x)
    unit = get_source("npz", tmp_path / "src").read_unit(tmp_path / "src" / "a.npz")
    assert isinstance(unit, Stacked) and len(unit) == 100_000
    assert int(unit[-1]["x"][0]) == x[-1, 0] and len(unit[5:8]) == 3
    with pytest.raises(IndexError):
        unit[100_000]
    ingest(get_source("npz", tmp_path / "src"), tmp_path / "out")
    ds = forebay.open_dataset(tmp_path / "out")
    assert len(ds) == 100_000 and int(ds[99_999]["x"][0]) == x[-1, 0]


def test_hdf5_bad_layouts(tmp_path):
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["x"] = np.zeros((5, 2))
        f["y"] = np.zeros(4)
    with pytest.raises(errors.SourceError, match="different sample counts"):
        get_source("hdf5", tmp_path / "a.h5")
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["v"] = np.zeros(10)
        f["v_offsets"] = np.array([0, 4, 12])
    with pytest.raises(errors.SourceError, match="offsets 'v_offsets' run from 0 to 12"):
        get_source("hdf5", tmp_path / "b.h5")
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f["v"] = np.zeros(10)
        f["v_offsets"] = np.array([0, 6, 4, 10])
    with pytest.raises(errors.SourceError, match="decrease at sample 1"):
        ingest(get_source("hdf5", tmp_path / "c.h5"), tmp_path / "out")
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["s"] = np.array([b"ab", b"cd"])
    with pytest.raises(errors.UnsupportedDtypeError, match="dataset 's'"):
        get_source("hdf5", tmp_path / "d.h5")
    (tmp_path / "e.h5").write_bytes(b"not hdf5 at all")
    with pytest.raises(errors.SourceError, match="e.h5: cannot open as HDF5"):
        get_source("hdf5", tmp_path / "e.h5")
    assert not (tmp_path / "out").exists()


# -- crafted datasets (issue M.3-5): someone else's dataset is untrusted input ----------------
def _craft(path, edit_rows=None, edit_doc=None):
    """Rewrite shard 0's index rows and/or the manifest, with every checksum recomputed
    (so only forebay's own checks stand between the file and a read)."""
    import io

    m = path / "manifest.json"
    doc = json.loads(m.read_text())
    if edit_rows is not None:
        ipath = path / doc["shards"][0]["index"]
        rows = np.load(ipath)
        edit_rows(rows)
        buf = io.BytesIO()
        np.save(buf, rows, allow_pickle=False)
        ipath.write_bytes(buf.getvalue())
        doc["shards"][0]["index_nbytes"] = len(buf.getvalue())
        doc["shards"][0]["index_checksum"] = checksum(buf.getvalue())
    if edit_doc is not None:
        edit_doc(doc)
    m.write_text(seal_manifest(doc))


def _craft_index_bytes(path, raw: bytes) -> None:
    """Replace shard 0's index file with ``raw``, its size and checksum recorded."""
    def edit(doc):
        ipath = path / doc["shards"][0]["index"]
        ipath.write_bytes(raw)
        doc["shards"][0]["index_nbytes"] = len(raw)
        doc["shards"][0]["index_checksum"] = checksum(raw)
    _craft(path, edit_doc=edit)


def _npy_bytes(header: dict, body: bytes = b"") -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + body


def _pickled_index() -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    return buf.getvalue()


@pytest.mark.parametrize("raw, words", [
    (lambda: _npy_bytes({"descr": "<i8", "fortran_order": False, "shape": (10**10, 7)}),
     "index has shape (10000000000, 7)"),
    (lambda: _pickled_index(), "index has shape (2,) object"),
    (lambda: b"\x93NUMPY\x01\x00" + (40).to_bytes(2, "little") + b"{'descr': '<i8', "
     b"'shape': (1,2" + b" " * 13 + b"\n", "index header unreadable"),
], ids=["10^10 rows", "pickled", "unparsable header"])
def test_a_crafted_index_header_is_named_not_loaded(packed, cli, raw, words):
    """Issue X item 11: with the checksums recomputed, a header declaring 10^10 rows, a
    pickled object array and a header that is no Python literal reached np.load
    (TokenError, ValueError tracebacks)."""
    path, _ = packed
    _craft_index_bytes(path, raw())
    with pytest.raises(errors.CorruptDatasetError, match=re.escape(words)):
        forebay.open_dataset(path)
    code, out, err = cli("verify", path)
    assert code == 1 and words in err and "Traceback" not in err, err


def test_a_deeply_nested_manifest_is_named_not_a_recursion_error(packed, cli):
    path, _ = packed
    m = path / "manifest.json"
    m.write_text(m.read_text()[:-2] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(errors.ManifestError, match="nested too deeply"):
        forebay.open_dataset(path)
    code, out, err = cli("verify", path)
    assert code == 1 and "nested too deeply" in err and "Traceback" not in err, err


@pytest.mark.parametrize("column, value", [(0, -4096), (0, 2**63 - 8), (1, 2**63 - 1),
                                           (3, -64), (3, 2**62), (4, 10**6), (5, 7)])
def test_crafted_index_rows_are_refused_at_open(packed, cli, column, value):
    """Offsets before the map or past the shard, sizes past the record, a shape that does
    not match the byte count: each used to return bytes from outside the record (or
    SIGSEGV) through ds[i], past verify(); now open names the sample."""
    path, _ = packed
    _craft(path, edit_rows=lambda rows: rows.__setitem__((5, column), value))
    with pytest.raises(errors.CorruptDatasetError, match="sample 5"):
        forebay.open_dataset(path)
    code, out, err = cli("verify", path)
    assert code == 1 and "CORRUPT" in err and "sample 5" in err and "Traceback" not in err


def test_a_huge_dimension_of_an_empty_field_is_refused_at_open(packed):
    """A zero-size field (shape (0, 3)) whose other dimension is set to 2**62: the byte
    count still matches (0), but numpy cannot make the array; open names the sample (the
    attack rerun found ds[i] raising numpy's ValueError instead)."""
    path, ragged = packed
    ds = forebay.open_dataset(path)
    i = next(k for k, smp in enumerate(ragged) if smp["x"].shape[0] == 0 and
             ds._shard_of[k] == 0)
    row = i - int(ds._shard_start[0])
    col = ds._layout.shape["x"].start + 1
    _craft(path, edit_rows=lambda rows: rows.__setitem__((row, col), 2**62))
    with pytest.raises(errors.CorruptDatasetError, match=f"sample {i}"):
        forebay.open_dataset(path)


@pytest.mark.parametrize("name", ["../other.fb/shard-00000.bin", "/etc/passwd",
                                  "sub/shard.bin", ".."])
def test_shard_paths_cannot_leave_the_dataset(packed, name):
    path, _ = packed
    _craft(path, edit_doc=lambda d: d["shards"][0].__setitem__("data", name))
    with pytest.raises(errors.ManifestError, match="plain file name"):
        forebay.open_dataset(path)


@pytest.mark.parametrize("dtype", [">f3", "<m8", "|O", "<U4", "f4", "[('a', '<f4')]"])
def test_manifest_dtypes_come_from_a_whitelist(packed, dtype):
    path, _ = packed
    _craft(path, edit_doc=lambda d: d["schema"]["fields"][0].__setitem__("dtype", dtype))
    with pytest.raises(errors.ManifestError):
        forebay.open_dataset(path)


def test_every_single_byte_flip_of_the_manifest_is_caught(packed, cli):
    """Flip each byte of the manifest in turn: open either fails with a forebay error or
    (never, here) opens the same dataset; verify exits 1 or 2, never with a traceback.
    Before, 16 of 23,121 flips changed a dtype and passed verify and verify_on_read."""
    path, _ = packed
    m = path / "manifest.json"
    raw = m.read_bytes()
    want = forebay.open_dataset(path).fingerprint
    for k in range(len(raw)):
        bad = bytearray(raw)
        bad[k] ^= 0x01 if k % 2 else 0x20
        m.write_bytes(bytes(bad))
        try:
            ds = forebay.open_dataset(path)
        except errors.ForebayError:
            pass
        else:
            pytest.fail(f"a flip of manifest byte {k} opened (fingerprint {ds.fingerprint}, "
                        f"intact {want})")
        if k % 97 == 0:
            code, _, err = cli("verify", path)
            assert code in (1, 2) and "Traceback" not in err, (k, err)
    m.write_bytes(raw)
    assert forebay.open_dataset(path).verify().ok


def test_private_files_are_created_0600_whatever_the_umask(tmp_path):
    """Model stores, clairvoyant SSD tier files and traces hold what other users of a
    shared node must not read (they were created 0644)."""
    import os
    import stat

    import forebay.models as fm
    import forebay.trace as trace
    from forebay.store import ClairvoyantStore
    from forebay.world import LOCAL

    old = os.umask(0o022)
    try:
        with fm.open_repository(str(tmp_path / "repo")) as r:
            r.save("m", {"w": __import__("torch").zeros(3)})
        forebay.write_dataset(tmp_path / "ds", [{"x": np.arange(9)}] * 20)
        ds = forebay.open_dataset(tmp_path / "ds")
        (tmp_path / "ssd").mkdir()
        st = ClairvoyantStore(ds, forebay.AccessPlan(20, 1, 4, 1), LOCAL, ram_bytes=0,
                              ssd_dir=tmp_path / "ssd", ssd_bytes=1 << 20, fill=False)
        tier_files = list((tmp_path / "ssd").iterdir())
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tier_files}
        st.close()
        trace.enable(tmp_path / "trace")
        with trace.region("x"):
            pass
        written = trace.disable()
    finally:
        os.umask(old)
    for p in (tmp_path / "repo" / "data.mdb", tmp_path / "repo" / "lock.mdb", written):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE((tmp_path / "repo").stat().st_mode) == 0o700
    assert tier_files and set(modes.values()) == {0o600}, modes


# -- leftovers after crashes (issue M.10) ------------------------------------------------------
def _start_and_kill(func, *args) -> None:
    """Run ``func(*args)`` (a function of this module) in a new Python, wait until it
    prints 'ready', kill -9 it."""
    import signal
    import subprocess
    import sys

    from conftest import rank_command

    cmd, env = rank_command(func, [str(a) for a in args])
    p = subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "ready"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        p.stdout.close()


def rank_hold_a_writer(path: str) -> None:
    """A writer with one sample added, then waiting to be killed."""
    import time

    w = forebay.DatasetWriter(path)
    w.add({"x": np.arange(3)})
    print("ready", flush=True)
    time.sleep(600)


def test_a_killed_writers_temporaries_are_removed_by_the_next_write(tmp_path):
    out = tmp_path / "ds"
    _start_and_kill(rank_hold_a_writer, out)
    first = leftovers(tmp_path)
    assert len(first) == 1                        # what a kill -9 leaves
    _start_and_kill(rank_hold_a_writer, out)      # its start removed the first one
    second = leftovers(tmp_path)
    assert len(second) == 1 and second != first
    forebay.write_dataset(out, [{"x": np.arange(3)}])
    assert leftovers(tmp_path) == [] and len(forebay.open_dataset(out)) == 1


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    out = tmp_path / "ds"
    live = forebay.DatasetWriter(out)             # holds its lock
    forebay.write_dataset(tmp_path / "other", [{"x": np.arange(3)}])
    w2 = forebay.DatasetWriter(out, overwrite=True)
    assert len(leftovers(tmp_path)) == 2          # both temporaries exist
    w2.abort()
    live.add({"x": np.arange(4)})
    live.close()
    assert forebay.open_dataset(out)[0]["x"].tolist() == [0, 1, 2, 3]


def rank_hold_an_ssd_tier(path: str, ssd: str) -> None:
    """A clairvoyant store with an SSD tier file, then waiting to be killed."""
    import time

    from forebay.store import ClairvoyantStore
    from forebay.world import LOCAL

    ds = forebay.open_dataset(path)
    ClairvoyantStore(ds, forebay.AccessPlan(len(ds), 1, 4, 1), LOCAL, ram_bytes=0,
                     ssd_dir=ssd, ssd_bytes=1 << 20, fill=False)
    print("ready", flush=True)
    time.sleep(600)


def test_a_killed_ranks_ssd_tier_file_is_removed_at_the_next_start(tmp_path):
    from forebay.store import ClairvoyantStore
    from forebay.world import LOCAL

    forebay.write_dataset(tmp_path / "ds", [{"x": np.arange(9)}] * 20)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    _start_and_kill(rank_hold_an_ssd_tier, tmp_path / "ds", ssd)
    assert len(list(ssd.glob("*.tier"))) == 1
    ds = forebay.open_dataset(tmp_path / "ds")
    st = ClairvoyantStore(ds, forebay.AccessPlan(20, 1, 4, 1), LOCAL, ram_bytes=0,
                          ssd_dir=ssd, ssd_bytes=1 << 20, fill=False)
    assert [p.name for p in ssd.glob("*.tier")] == [st._ssd_file.name]   # only its own
    other = ClairvoyantStore(ds, forebay.AccessPlan(20, 1, 4, 1), LOCAL, ram_bytes=0,
                             ssd_dir=ssd, ssd_bytes=1 << 20, fill=False)
    assert len(list(ssd.glob("*.tier"))) == 2     # a live store's file is kept
    other.close()
    st.close()
    assert list(ssd.glob("*.tier")) == []


def rank_pool_then_wait() -> None:
    """A pool of two spawned workers that die with this process; prints their pids."""
    import multiprocessing
    import os
    import time
    from concurrent.futures import ProcessPoolExecutor

    from forebay.dataset.sources._base import _die_with_parent

    ex = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_die_with_parent, initargs=(os.getpid(),))
    pids = {ex.submit(os.getpid).result() for _ in range(8)}
    print(" ".join(map(str, pids)), flush=True)
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_ingest_workers_die_with_their_parent(tmp_path):
    """kill -9 of an ingest with --workers used to leave its readers running."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import rank_command

    cmd, env = rank_command(rank_pool_then_wait, [])
    p = subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE, text=True, env=env)
    pids = [int(x) for x in p.stdout.readline().split()]
    assert pids and all(_alive(q) for q in pids)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    p.stdout.close()
    deadline = time.monotonic() + 60              # a hang guard, not a measured time
    while any(_alive(q) for q in pids):
        assert time.monotonic() < deadline, f"workers {pids} outlived their parent"
        time.sleep(0.05)


def test_a_write_that_fills_the_disk_leaves_no_temporary_directory(small_fs):
    """X item 6: on ENOSPC the writer's abort flushed into the same error and never
    removed its temporary directory, keeping the disk full."""
    with pytest.raises(OSError) as err:
        forebay.write_dataset(small_fs / "ds", ({"x": np.full(100_000, i, np.uint8)}
                                                for i in range(40)))
    assert "No space left" in str(err.value) or getattr(err.value, "errno", 0) == 28
    assert leftovers(small_fs) == [] and not (small_fs / "ds").exists()
    assert os.statvfs(small_fs).f_bfree == os.statvfs(small_fs).f_blocks   # all freed

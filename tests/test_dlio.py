"""forebay.dlio: DLIO's generated layouts packed in DLIO's order, the plug-in's settings,
repacking only when the files change, and (where the DLIO benchmark can run) a real DLIO
workload through the plug-in under mpiexec -n 2.

The real-DLIO test runs with ``FOREBAY_TEST_DLIO_PYTHON`` naming a Python that has
``dlio_benchmark`` (or when this one has it).  It is not in CI's environment because
dlio-benchmark 2.0.0 from PyPI imports tensorflow at start-up (its profiler factory)
and requires nvidia-dali-cuda110, torchvision and torchaudio, which pull another torch:
gigabytes, against the pinned CPU torch.  benchmarks/dlio/ builds such an environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import forebay
from forebay.dataset.sources import DlioSource, dlio_files
from forebay.dlio import prepare_dataset, settings
from forebay.errors import InvalidArgumentError, SourceError


def _dlio_npz(folder: Path, files: int, per_file: int, side: int = 6) -> list[np.ndarray]:
    """Files as DLIO's npz generator writes them (x: samples on the last axis); the
    samples in DLIO's order."""
    folder.mkdir(parents=True)
    out = []
    rng = np.random.default_rng(0)
    for i in range(files):
        x = rng.integers(0, 255, size=(side, side + 1, per_file), dtype=np.uint8)
        np.savez(folder / f"img_{i:02d}_of_{files}.npz", x=x, y=[i] * per_file)
        out += [x[..., j] for j in range(per_file)]
    return out


def test_npz_samples_come_off_the_last_axis_in_dlios_order(tmp_path, cli):
    want = _dlio_npz(tmp_path / "train", files=3, per_file=4)
    code, _, err = cli("ingest", tmp_path / "train", tmp_path / "ds", "--from", "dlio")
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "ds")
    assert len(ds) == 12 and ds.manifest.metadata["dlio_format"] == "npz"
    for i in range(12):
        got = ds[i]
        assert np.array_equal(got["x"], want[i]) and int(got["y"]) == i // 4


def test_hdf5_npy_and_jpeg_layouts(tmp_path):
    import h5py

    (tmp_path / "h").mkdir()
    rec = np.arange(5 * 4 * 3, dtype=np.uint8).reshape(5, 4, 3)
    with h5py.File(tmp_path / "h" / "img_0_of_1.hdf5", "w") as f:
        f["records"] = rec
        f["labels"] = [7] * 5
    got = DlioSource(tmp_path / "h").read_unit(dlio_files(tmp_path / "h")[0])
    assert [int(s["y"]) for s in got] == [7] * 5
    assert all(np.array_equal(s["x"], rec[k]) for k, s in enumerate(got))
    (tmp_path / "n").mkdir()
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    np.save(tmp_path / "n" / "img_0_of_1.npy", arr)
    got = DlioSource(tmp_path / "n").read_unit(tmp_path / "n" / "img_0_of_1.npy")
    assert len(got) == 4 and np.array_equal(got[2]["x"], arr[..., 2])
    (tmp_path / "j" / "0").mkdir(parents=True)            # sub-folders: sorted by name
    (tmp_path / "j" / "1").mkdir()
    (tmp_path / "j" / "1" / "img_0_of_2.jpeg").write_bytes(b"first")
    (tmp_path / "j" / "0" / "img_1_of_2.jpeg").write_bytes(b"second")
    files = dlio_files(tmp_path / "j")
    assert [f.name for f in files] == ["img_0_of_2.jpeg", "img_1_of_2.jpeg"]
    assert DlioSource(tmp_path / "j").read_unit(files[0])[0]["x"].tobytes() == b"first"


def test_a_file_that_is_not_dlios_layout_is_named(tmp_path):
    (tmp_path / "t").mkdir()
    np.savez(tmp_path / "t" / "a.npz", records=np.zeros(3))
    with pytest.raises(SourceError, match="a.npz: no array 'x'"):
        DlioSource(tmp_path / "t").read_unit(tmp_path / "t" / "a.npz")
    np.savez(tmp_path / "t" / "a.npz", x=np.zeros((2, 3)), y=[0])
    with pytest.raises(SourceError, match="3 records but 1 labels"):
        DlioSource(tmp_path / "t").read_unit(tmp_path / "t" / "a.npz")


def test_float_labels_are_kept_and_labels_that_are_not_numbers_are_refused(tmp_path, cli):
    (tmp_path / "f").mkdir()
    x = np.arange(2 * 2 * 3, dtype=np.uint8).reshape(2, 2, 3)
    np.savez(tmp_path / "f" / "img_0_of_1.npz", x=x, y=np.array([0.2, 1.7, 2.9]))
    code, _, err = cli("ingest", tmp_path / "f", tmp_path / "ds", "--from", "dlio")
    assert code == 0, err
    ds = forebay.open_dataset(tmp_path / "ds")
    assert [ds[i]["y"].item() for i in range(3)] == [0.2, 1.7, 2.9]
    assert ds[0]["y"].dtype == np.float64
    big = np.array([np.iinfo(np.uint64).max] * 3, dtype=np.uint64)   # beyond int64
    np.savez(tmp_path / "f" / "img_0_of_1.npz", x=x, y=big)
    got = DlioSource(tmp_path / "f").read_unit(tmp_path / "f" / "img_0_of_1.npz")
    assert [int(s["y"]) for s in got] == [int(v) for v in big]
    np.savez(tmp_path / "f" / "img_0_of_1.npz", x=x, y=np.array(["a", "b", "c"]))
    with pytest.raises(SourceError, match="img_0_of_1.npz: labels of dtype <U1 are not"):
        DlioSource(tmp_path / "f").read_unit(tmp_path / "f" / "img_0_of_1.npz")


def test_hdf5_records_that_are_not_an_array_of_samples_are_named(tmp_path):
    import h5py

    (tmp_path / "h").mkdir()
    f0 = tmp_path / "h" / "img_0_of_1.hdf5"
    with h5py.File(f0, "w") as f:
        f["records"] = 3
    with pytest.raises(SourceError, match="'records' is 0-d"):
        DlioSource(tmp_path / "h").read_unit(f0)
    with h5py.File(f0, "w") as f:
        f.create_group("records")
    with pytest.raises(SourceError, match="'records' is a group"):
        DlioSource(tmp_path / "h").read_unit(f0)


def test_the_fingerprint_is_the_files_not_how_their_path_is_spelled(tmp_path, monkeypatch,
                                                                    cli):
    from forebay.dataset.sources import source_fingerprint

    _dlio_npz(tmp_path / "data" / "train", files=2, per_file=3)
    monkeypatch.chdir(tmp_path)
    rel = dlio_files(Path("data/train"))
    absolute = dlio_files(tmp_path / "data" / "train")
    (tmp_path / "link").symlink_to(tmp_path / "data")
    linked = dlio_files(tmp_path / "link" / "train")
    assert source_fingerprint(rel) == source_fingerprint(absolute) == \
        source_fingerprint(linked)
    assert source_fingerprint(rel, content=True) == source_fingerprint(absolute, content=True)
    # packed once from the absolute spelling, not again from the relative one
    out = prepare_dataset(absolute, tmp_path / "train.forebay", None)
    first = (out / "manifest.json").stat().st_mtime_ns
    prepare_dataset(rel, Path("train.forebay"), None)
    assert (out / "manifest.json").stat().st_mtime_ns == first
    # a dataset packed by hand with `forebay ingest --from dlio` is the plug-in's too
    assert cli("ingest", "data/train", "hand.forebay", "--from", "dlio")[0] == 0
    hand = (tmp_path / "hand.forebay" / "manifest.json").stat().st_mtime_ns
    prepare_dataset(absolute, tmp_path / "hand.forebay", None)
    assert (tmp_path / "hand.forebay" / "manifest.json").stat().st_mtime_ns == hand


def test_an_edit_that_keeps_size_and_time_is_caught_by_the_content_check(tmp_path):
    _dlio_npz(tmp_path / "train", files=2, per_file=3)
    files = dlio_files(tmp_path / "train")
    out = prepare_dataset(files, tmp_path / "train.forebay", None, check_content=True)
    assert forebay.open_dataset(out)[0]["x"][0, 0] != 77
    st = files[0].stat()
    with np.load(files[0]) as z:
        x, y = z["x"].copy(), z["y"]
    x[0, 0, 0] = 77 if x[0, 0, 0] != 77 else 78
    np.savez(files[0], x=x, y=y)                          # same size, time put back
    os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert files[0].stat().st_size == st.st_size
    prepare_dataset(files, out, None)                     # names, sizes, times: stale
    assert forebay.open_dataset(out)[0]["x"][0, 0] != x[0, 0, 0]
    prepare_dataset(files, out, None, check_content=True)
    assert forebay.open_dataset(out)[0]["x"][0, 0] == x[0, 0, 0]
    assert settings({"FOREBAY_DLIO_CHECK_CONTENT": "1"}) == {"check_content": True}


def test_a_dataset_not_packed_from_dlio_files_is_never_overwritten(tmp_path, cli):
    _dlio_npz(tmp_path / "train", files=1, per_file=3)
    np.save(tmp_path / "mine.npy", np.zeros((4, 2), np.float32))
    assert cli("ingest", tmp_path / "mine.npy", tmp_path / "train.forebay",
               "--from", "npy")[0] == 0
    with pytest.raises(SourceError, match="not packed from DLIO files .source npy.*"
                       "FOREBAY_DLIO_DATASET"):
        prepare_dataset(dlio_files(tmp_path / "train"), tmp_path / "train.forebay", None)
    kept = forebay.open_dataset(tmp_path / "train.forebay")
    assert len(kept) == 1 and kept[0]["data"].shape == (4, 2)


def test_the_last_step_of_an_epoch_left_early_is_recorded(tmp_path):
    """DLIO breaks out of its loop after an epoch's last step: that step's compute span
    is recorded all the same, so AU is not under-reported."""
    from forebay import trace
    from forebay.dlio import steps
    from forebay.trace._read import read_traces

    trace.enable(tmp_path / "t", rank=0)
    try:
        for _epoch in range(2):
            for i, batch in enumerate(steps(iter(range(4)))):
                assert batch == i
                if i == 3:          # DLIO: the epoch's last step done, leave the loop
                    break
        for _ in steps(range(3)):     # and a loop that runs to the end
            pass
    finally:
        trace.disable()
    ev = read_traces(tmp_path / "t")
    assert int(((ev.cat == "compute") & (ev.name == "dlio.step")).sum()) == 2 * 4 + 3


def test_prepare_dataset_packs_once_and_again_only_when_the_files_change(tmp_path):
    _dlio_npz(tmp_path / "train", files=2, per_file=3)
    files = dlio_files(tmp_path / "train")
    out = prepare_dataset(files, tmp_path / "train.forebay", None)
    first = (out / "manifest.json").stat().st_mtime_ns
    assert len(forebay.open_dataset(out)) == 6
    prepare_dataset(files, out, None)                        # unchanged: not rewritten
    assert (out / "manifest.json").stat().st_mtime_ns == first
    np.savez(files[1], x=np.zeros((6, 7, 5), np.uint8), y=[0] * 5)   # DLIO regenerated
    prepare_dataset(files, out, None)
    assert len(forebay.open_dataset(out)) == 8
    (tmp_path / "mine").mkdir()                              # never replaces user data
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(SourceError, match="could not pack"):
        prepare_dataset(files, tmp_path / "mine", None)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_settings_from_a_toml_file_and_the_environment(tmp_path):
    toml = tmp_path / "f.toml"
    toml.write_text('[dlio]\nmode = "clairvoyant"\nram_bytes = "2GiB"\nprefetch = 3\n')
    got = settings({"FOREBAY_DLIO_CONFIG": str(toml), "FOREBAY_DLIO_PREFETCH": "5",
                    "FOREBAY_DLIO_VERIFY_ON_READ": "yes",
                    "FOREBAY_DLIO_OVERLAP_PRELOAD": "on"})
    assert got == {"mode": "clairvoyant", "ram_bytes": 2 << 30, "prefetch": 5,
                   "verify_on_read": True, "overlap_preload": True}
    with pytest.raises(InvalidArgumentError, match="FOREBAY_DLIO_RAM_BYTE"):
        settings({"FOREBAY_DLIO_RAM_BYTE": "1"})
    with pytest.raises(InvalidArgumentError, match="prefetch='many'"):
        settings({"FOREBAY_DLIO_PREFETCH": "many"})
    assert settings({"FOREBAY_DLIO_OVERLAP_PRELOAD": "Auto"}) == {"overlap_preload": "auto"}
    with pytest.raises(InvalidArgumentError, match="overlap_preload='maybe'"):
        settings({"FOREBAY_DLIO_OVERLAP_PRELOAD": "maybe"})
    with pytest.raises(InvalidArgumentError, match="verify_on_read='auto'"):
        settings({"FOREBAY_DLIO_VERIFY_ON_READ": "auto"})


def _dlio_python() -> str | None:
    py = os.environ.get("FOREBAY_TEST_DLIO_PYTHON")
    if py:
        return py
    try:
        import dlio_benchmark  # noqa: F401
    except Exception:          # noqa: BLE001 - any failure means DLIO cannot run here
        return None
    return sys.executable


TINY = """model: tiny
framework: pytorch
workflow: {generate_data: False, train: True, evaluation: False}
dataset: {data_folder: DATA, format: npz, num_files_train: 16, num_samples_per_file: 8,
          record_length: 4096}
reader: {data_loader: pytorch, data_loader_classname: forebay.dlio.CLASS,
         data_loader_sampler: index, batch_size: 4, read_threads: 1, sample_shuffle: seed}
train: {epochs: 2, computation_time: 0.001}
"""


@pytest.mark.mpi
@pytest.mark.parametrize("cls", ["ForebayPreload", "ForebayClairvoyant"])
def test_a_real_dlio_workload_reads_every_sample_through_the_plugin(tmp_path, cls):
    py = _dlio_python()
    if py is None:
        pytest.skip("the DLIO benchmark is not importable (set FOREBAY_TEST_DLIO_PYTHON); see "
                    "this module's docstring")
    from forebay.trace._read import read_traces

    bindir = Path(py).parent
    (tmp_path / "cfg" / "workload").mkdir(parents=True)
    (tmp_path / "cfg" / "workload" / "tiny.yaml").write_text(
        TINY.replace("DATA", str(tmp_path / "data")).replace("CLASS", cls))
    src = Path(forebay.__file__).parents[1]
    env = dict(os.environ, PYTHONPATH=str(src), FOREBAY_TRACE=str(tmp_path / "trace"),
               PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    mpiexec = shutil.which("mpiexec", path=env["PATH"])
    run = [mpiexec, "-n", "2", str(bindir / "dlio_benchmark"),
           f"--config-dir={tmp_path / 'cfg'}", "workload=tiny"]
    gen = subprocess.run(run + ["++workload.workflow.generate_data=True",
                                "++workload.workflow.train=False"], cwd=tmp_path, env=dict(
                                    env, FOREBAY_TRACE=""), capture_output=True, text=True,
                         timeout=300)
    assert gen.returncode == 0, gen.stderr[-3000:]
    p = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "Training Accelerator Utilization" in out and "Traceback" not in out
    for rank in (0, 1):       # 128 samples / (4 x 2 ranks) = 16 steps, both epochs
        assert out.count(f"Rank {rank} step 16 processed 4 samples") == 2, out[-3000:]
    ev = read_traces(tmp_path / "trace")
    items = (ev.cat == "data") & (ev.name == "item")
    assert int(items.sum()) == 2 * 128               # every sample, each epoch
    assert ((ev.cat == "compute") & (ev.name == "dlio.step")).sum() >= 2 * 2 * 15
    from forebay.trace import analyze
    assert 0 < analyze(tmp_path / "trace")["accelerator_utilization"] <= 1
    assert json.loads((tmp_path / "data" / "train.forebay" / "manifest.json").read_text())

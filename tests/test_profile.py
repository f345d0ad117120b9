"""forebay calibrate and machine profiles: measured, written as TOML, validated on load."""

from __future__ import annotations

import re

import pytest

from forebay.progress import Progress
from forebay.store import ProfileError, calibrate, dump_profile, load_profile


def test_calibrate_round_trips(tmp_path, packed):
    prof = calibrate(ssd_dir=tmp_path, dataset=packed[0], threads=[1, 2], ram_bytes=8 << 20,
                     ssd_bytes=16 << 20, samples=50)
    assert set(prof) == {"machine", "ram", "ssd", "pfs"}
    assert set(prof["ram"]["copy_MBps"]) == {1, 2}
    assert all(v > 0 for v in prof["pfs"]["read_MBps"].values())
    assert set(prof["pfs"]["stream_MBps"]) == {1, 2}
    assert all(v > 0 for v in prof["pfs"]["stream_MBps"].values())
    assert [p.name for p in tmp_path.iterdir() if "calibrate" in p.name] == []  # cleaned up
    path = tmp_path / "p.toml"
    path.write_text(dump_profile(prof))
    back = load_profile(path)
    assert back["ram"]["copy_MBps"].keys() == {1, 2}
    assert back["pfs"]["record_bytes"] == prof["pfs"]["record_bytes"]
    assert back["pfs"]["stream_MBps"].keys() == {1, 2}
    # the subset was every record of this small dataset: the dense case already
    assert back["pfs"]["read_fraction"] == 1.0 and "dense_MBps" not in back["pfs"]


def test_calibrate_reads_a_random_subset_and_a_dense_range(tmp_path, packed):
    """A record's request brings in parts of its neighbours: calibrate times random
    records (``read_fraction`` of them) and every record of a range of as many
    (``dense_MBps``), for the simulator to interpolate between by a node's share."""
    prof = calibrate(dataset=packed[0], threads=[1, 2], ram_bytes=8 << 20, samples=50,
                     pfs_bytes=1)
    assert prof["pfs"]["read_fraction"] == pytest.approx(50 / 300, abs=1e-4)
    assert set(prof["pfs"]["dense_MBps"]) == set(prof["pfs"]["read_MBps"]) == {1, 2}
    assert all(v > 0 for v in prof["pfs"]["dense_MBps"].values())
    path = tmp_path / "p.toml"
    path.write_text(dump_profile(prof))
    back = load_profile(path)
    assert back["pfs"]["dense_MBps"].keys() == {1, 2}
    assert back["pfs"]["read_fraction"] == prof["pfs"]["read_fraction"]


class Recording(Progress):
    def __init__(self) -> None:
        self.total, self.done, self.closed = None, 0.0, False

    def start(self, total, desc="", unit="it") -> None:
        self.total = total

    def update(self, n=1) -> None:
        self.done += n

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("pfs_bytes", [1, None])
def test_calibrate_tells_a_progress_hook_each_measurement(tmp_path, packed, pfs_bytes):
    """A slow file system makes calibrate long (each dataset read at least 256 MB, three
    kinds per reader count): a ``progress=`` hook is told every measurement, whether the
    random reads were a subset (a dense range read too) or the whole dataset."""
    bar = Recording()
    calibrate(ssd_dir=tmp_path, dataset=packed[0], threads=[1, 2], ram_bytes=8 << 20,
              ssd_bytes=16 << 20, samples=50, progress=bar,
              **({"pfs_bytes": pfs_bytes} if pfs_bytes else {}))
    assert bar.total == 1 + 1 + 3 * 2 and bar.done == bar.total and bar.closed


@pytest.mark.parametrize("text, words", [
    ("[gpu]\nx = 1\n", "unknown section \\[gpu\\]"),
    ("[ram]\ncopy_GBps = 3\n", "unknown key 'copy_GBps'"),
    ("[ram]\ncopy_MBps = -5\n", "must be a number of MB/s"),
    ("[pfs]\nread_MBps = { \"1\" = \"fast\" }\n", "must be a number of MB/s"),
    ("[pfs]\nread_MBps = { \"one\" = 3 }\n", "thread or reader count"),
    ("[rma]\nranks = 0\n", "positive number"),
    ("[pfs]\nread_fraction = 0\n", "fraction in \\(0, 1\\]"),
    ("[pfs]\nread_fraction = 1.5\n", "fraction in \\(0, 1\\]"),
    ("[tiers]\nram_bytes = \"lots\"\n", "not a size"),
    ("[tiers]\nssd_bytes = -1\n", "non-negative integer of bytes"),
    ("[tiers]\nprefetch = 1.5\n", "non-negative integer"),
    ("[tiers]\nnvme_bytes = 1\n", "unknown key 'nvme_bytes'"),
    ("[ram\ncopy_MBps = 1\n", "not valid TOML"),
])
def test_bad_profiles_are_named(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=words) as e:
        load_profile(path)
    assert isinstance(e.value, ValueError) and "bad.toml" in str(e.value)


def test_cli_calibrate(tmp_path, cli):
    code, out, err = cli("calibrate", "--out", tmp_path / "m.toml")
    assert code == 0, err
    assert "[ram]" in out and load_profile(tmp_path / "m.toml")["ram"]["copy_MBps"]


def test_loader_takes_its_tiers_from_a_system_file(tmp_path, packed):
    pytest.importorskip("torch")
    from forebay.torch import Clairvoyant, DataLoader, Pipeline

    ssd = tmp_path / "ssd"
    ssd.mkdir()
    sysf = tmp_path / "system.toml"
    sysf.write_text(f'''[machine]
description = "test node"

[tiers]
ram_bytes = "16KiB"
ssd_dir = "{ssd}"
ssd_bytes = 65536
staging_bytes = "1MiB"
prefetch = 2
''')
    assert load_profile(sysf)["tiers"]["ram_bytes"] == 16 << 10
    with DataLoader(packed[0], 8, system=sysf, progress=False, store="clairvoyant") as dl:
        st = dl.store.stats()
        assert st["ssd_bytes"] > 0 and 0 < st["tier_bytes"] <= 16 << 10
        assert dl.staging_bytes == 1 << 20 and dl.prefetch == 2
        n = sum(1 for _ in dl)
        assert n == len(dl)
    # explicit arguments win over the file
    with DataLoader(packed[0], 8, system=sysf, progress=False,
                    store=Clairvoyant(ram_bytes=8 << 10),
                    pipeline=Pipeline(prefetch=0, staging_bytes=4096)) as dl:
        assert dl.prefetch == 0 and dl.staging_bytes == 4096
        assert dl.store.stats()["tier_bytes"] <= 8 << 10


def test_fetch_model_interpolates_clamps_and_compares():
    from forebay.store._model import FetchModel, interpolate
    from forebay.store._profile import ProfileError

    t = {1: 330.0, 2: 730.0, 4: 1540.0, 8: 2870.0}       # NoPFS §6.1, Lassen's PFS
    assert interpolate(t, 2) == 730.0
    assert interpolate(t, 3) == pytest.approx(1135.0)     # halfway between 2 and 4
    assert interpolate(t, 64) == 2870.0 and interpolate(t, 0.5) == 330.0   # clamped
    with pytest.raises(ProfileError):
        interpolate({}, 3)
    m = FetchModel(pfs_MBps=t, rma_MBps={2: 10_000.0}, ram_MBps={1: 8000.0})
    # 8 readers share 2,870 MB/s: 1 MB takes 8 / 2870 s
    assert m.pfs_s(1e6, readers=8) == pytest.approx(8 / 2870)
    assert m.peer_s(1e6) == pytest.approx(1 / 10_000)
    assert m.local_s(8e6, "ram") == pytest.approx(1 / 1000)
    assert not m.prefer_pfs(1e6, readers=8, ranks=2)
    assert FetchModel(pfs_MBps={1: 1e6}, rma_MBps={2: 1.0}).prefer_pfs(1e6, 1, 2)
    assert FetchModel(pfs_MBps={1: 1e6}).peer_s(1e6) == 0.0  # unmeasured: peers first
    assert FetchModel.from_profile({"ram": {"copy_MBps": {1: 1.0}}}) is None


def rank_calibrate(out: str) -> None:
    """One rank of `forebay calibrate` under mpiexec."""
    from forebay.cli import main

    assert main(["calibrate", "--out", out]) == 0


def rank_calibrate_pfs(out: str, dataset: str, real: int) -> None:
    """`forebay calibrate --dataset` under mpiexec; only rank ``real`` is given a real
    path: the others' calibrate fails where it reads theirs."""
    from mpi4py import MPI

    from forebay.cli import main

    rank = MPI.COMM_WORLD.Get_rank()
    path = dataset if rank == int(real) else dataset + ".missing"
    code = main(["calibrate", "--dataset", path, "--out", out])
    print(f"rank {rank} exit {code}", flush=True)


@pytest.mark.mpi
def test_calibrate_under_mpiexec_reads_the_shared_file_system_from_one_rank(tmp_path,
                                                                             packed):
    """Every rank measured the shared file system at once, so t(k) came out as one
    rank's share (193 MB/s for 2 readers of a 300 MB/s disk where 1 reader got 325)."""
    pytest.importorskip("mpi4py")
    from conftest import run_ranks
    from forebay.store import load_profile

    out = tmp_path / "p.toml"
    p = run_ranks(2, rank_calibrate_pfs, out, str(packed[0]), 0, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "rank 1 exit 0" in p.stdout
    prof = load_profile(out)
    assert prof["pfs"]["path"] == str(packed[0]) and prof["pfs"]["read_MBps"][1] > 0
    # rank 0's read fails: every rank ends with an error, none waits for it
    p = run_ranks(2, rank_calibrate_pfs, tmp_path / "q.toml", str(packed[0]), 1, timeout=180)
    # (the ranks' lines may share one line of mpiexec's output: found, not split)
    codes = sorted(re.findall(r"rank (\d+) exit (\d+)", p.stdout))
    assert [r for r, _ in codes] == ["0", "1"] and all(c != "0" for _, c in codes), \
        p.stdout + p.stderr
    assert "no dataset at" in p.stderr and "rank 0 could not measure" in p.stderr, p.stderr


@pytest.mark.mpi
def test_calibrate_under_mpiexec_measures_gets_from_a_peer(tmp_path):
    pytest.importorskip("mpi4py")
    from conftest import run_ranks
    from forebay.store import load_profile

    out = tmp_path / "p.toml"
    p = run_ranks(2, rank_calibrate, out, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    prof = load_profile(out)
    assert prof["rma"]["ranks"] == 2 and prof["rma"]["get_MBps"][2] > 0
    assert p.stdout.count("[rma]") == 1          # only rank 0 prints and writes


def test_ssd_tier_on_a_shared_file_system_is_used_with_a_warning(tmp_path, packed,
                                                                  monkeypatch):
    """An SSD tier directory on Lustre (by /proc/mounts) is not node-local: the store
    says so, naming the file system, and still uses it (a burst buffer may be fast)."""
    from forebay import AccessPlan, _fs
    from forebay.store import ClairvoyantStore

    ssd = tmp_path / "lus" / "ssd"
    ssd.mkdir(parents=True)
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\nmds@tcp:/fs {tmp_path / 'lus'} lustre rw 0 0\n")
    monkeypatch.setattr(_fs, "_MOUNTS", str(mounts))
    path = packed[0]
    from forebay.dataset import open_dataset

    n = len(open_dataset(path))
    plan = AccessPlan(n, 1, 8, epochs=2, seed=0)
    with pytest.warns(RuntimeWarning, match=r"SSD tier .* is on lustre, a file system shared"):
        st = ClairvoyantStore(path, plan, None, ram_bytes=0, ssd_dir=ssd, ssd_bytes=1 << 20)
    try:
        assert st.stats()["ssd_bytes"] > 0
    finally:
        st.close()

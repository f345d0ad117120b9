"""forebay calibrate and machine profiles: measured, written as TOML, validated on load."""

from __future__ import annotations

import pytest

from forebay.store import ProfileError, calibrate, dump_profile, load_profile


def test_calibrate_round_trips(tmp_path, packed):
    prof = calibrate(ssd_dir=tmp_path, dataset=packed[0], threads=[1, 2], ram_bytes=8 << 20,
                     ssd_bytes=16 << 20, samples=50)
    assert set(prof) == {"machine", "ram", "ssd", "pfs"}
    assert set(prof["ram"]["copy_MBps"]) == {1, 2}
    assert all(v > 0 for v in prof["pfs"]["read_MBps"].values())
    assert [p.name for p in tmp_path.iterdir() if "calibrate" in p.name] == []  # cleaned up
    path = tmp_path / "p.toml"
    path.write_text(dump_profile(prof))
    back = load_profile(path)
    assert back["ram"]["copy_MBps"].keys() == {1, 2}
    assert back["pfs"]["record_bytes"] == prof["pfs"]["record_bytes"]


@pytest.mark.parametrize("text, words", [
    ("[gpu]\nx = 1\n", "unknown section \\[gpu\\]"),
    ("[ram]\ncopy_GBps = 3\n", "unknown key 'copy_GBps'"),
    ("[ram]\ncopy_MBps = -5\n", "must be a number of MB/s"),
    ("[pfs]\nread_MBps = { \"1\" = \"fast\" }\n", "must be a number of MB/s"),
    ("[pfs]\nread_MBps = { \"one\" = 3 }\n", "thread or reader count"),
    ("[rma]\nranks = 0\n", "positive number"),
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

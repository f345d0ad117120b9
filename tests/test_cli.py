"""The installed ``forebay`` command, end to end, as a user runs it."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import BIN


def run(*args, ok=True):
    p = subprocess.run([str(BIN / "forebay"), *map(str, args)], capture_output=True, text=True,
                       timeout=120)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def test_synth_ingest_info_verify(tmp_path):
    run("synth", "ising", tmp_path / "src", "--samples", "40", "--format", "cff")
    p = run("ingest", tmp_path / "src", tmp_path / "ds", "--from", "hdf5", "--shard-size", "64KiB")
    assert "ingested 40 samples" in p.stdout
    p = run("info", tmp_path / "ds")
    assert "samples      40" in p.stdout and "edge_index" in p.stdout
    info = json.loads(run("info", tmp_path / "ds", "--json").stdout)
    assert info["samples"] == 40 and info["shards"] > 1
    assert {f["name"] for f in info["fields"]} == {"x", "pos", "edge_index", "edge_attr", "y"}
    assert "ok: 40 samples" in run("verify", tmp_path / "ds").stdout
    shard = tmp_path / "ds" / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    p = run("verify", tmp_path / "ds", ok=False)
    assert p.returncode == 1 and "shard-00000.bin" in p.stderr


def test_existing_output_and_bad_arguments(tmp_path):
    run("synth", "mummi", tmp_path / "src", "-n", "3")
    p = run("synth", "mummi", tmp_path / "src", "-n", "3", ok=False)
    assert p.returncode == 2 and "exists" in p.stderr and "Traceback" not in p.stderr
    p = run("ingest", tmp_path / "src", tmp_path / "ds", "--from", "npz", "--shard-size", "lots",
            ok=False)
    assert p.returncode == 2 and "not a size" in p.stderr
    p = run("ingest", tmp_path / "src", tmp_path / "ds", "--from", "npz", "--keys", "nope",
            ok=False)
    assert p.returncode == 2 and "no 'nope'" in p.stderr and not (tmp_path / "ds").exists()


@pytest.mark.parametrize("text, value", [("256MiB", 256 << 20), ("1g", 1 << 30), ("4096", 4096),
                                         ("1.5KiB", 1536), ("2MB", 2_000_000)])
def test_parse_size(text, value):
    from forebay.cli import parse_size

    assert parse_size(text) == value


def test_synth_refuses_at_once_what_cannot_fit(cli, tmp_path):
    """Issue X item 10: `synth --samples 99999999999999999999` ran on (until the disk was
    full); it is refused before anything is written, saying what it needs and has."""
    import shutil

    free = shutil.disk_usage(tmp_path).free
    samples = free // (8_691 * 8) + 1                   # mummi: 69,528 bytes at least each
    code, out, err = cli("synth", "mummi", tmp_path / "m", "--samples", samples)
    assert code == 2 and f"{samples:,} mummi samples need at least" in err, err
    assert f"free in {tmp_path}" in err, err
    code, out, err = cli("synth", "ising", tmp_path / "i", "--samples", "99999999999999999999")
    assert code == 2 and "ising samples need at least" in err, err
    assert list(tmp_path.iterdir()) == []                # nothing written, nothing left


def test_synths_ingest_hint_can_be_pasted_for_a_path_with_spaces(cli, tmp_path):
    """Issue X item 12: the hint printed the path unquoted."""
    import shlex

    out_dir = tmp_path / "my data" / "ising src"
    code, out, err = cli("synth", "ising", out_dir, "--samples", "3")
    assert code == 0, err
    hint = out.split("(ingest with: ")[1].rstrip(")\n")
    argv = shlex.split(hint)
    assert argv[:3] == ["forebay", "ingest", str(out_dir)], argv
    code, out, err = cli(*argv[1:3], tmp_path / "ds", *argv[4:])
    assert code == 0, err

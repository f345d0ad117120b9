from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import forebay
from forebay.cli import main as cli_main

BIN = Path(sys.executable).parent


def ragged_samples(n: int, seed: int = 0) -> list[dict]:
    """Samples exercising every storable kind: ragged 2-d, 0-d, bytes, bool, complex."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(0, 6))
        out.append({
            "x": rng.normal(size=(k, 3)).astype(np.float32),
            "label": np.int64(i),
            "blob": rng.integers(0, 256, size=0 if i % 50 == 7 else int(rng.integers(1, 300)),
                                dtype=np.uint8).tobytes(),
            "mask": rng.random(4) > 0.5,
            "z": (rng.normal(size=2) + 1j * rng.normal(size=2)).astype(np.complex64),
        })
    return out


def as_array(v):
    return np.frombuffer(v, dtype=np.uint8) if isinstance(v, bytes) else np.asarray(v)


def assert_sample_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want) or set(got) == set(want)
    for k, v in want.items():
        w = as_array(v)
        g = got[k]
        assert g.dtype == w.dtype, k
        assert g.shape == w.shape, k
        assert g.tobytes() == w.tobytes(), k


@pytest.fixture
def ragged():
    return ragged_samples(300)


@pytest.fixture
def packed(tmp_path, ragged):
    """A small multi-shard dataset and its source samples."""
    path = tmp_path / "ds"
    forebay.write_dataset(path, ragged, shard_bytes=8 << 10)
    return path, ragged


@pytest.fixture
def cli(capsys):
    """Run the forebay CLI in-process: returns (exit code, stdout, stderr)."""
    def run(*args: str):
        code = cli_main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err
    return run


def leftovers(parent: Path) -> list[str]:
    """Hidden temporary directories a write may have left behind."""
    return [p.name for p in parent.iterdir() if ".forebay-" in p.name]


def rank_command(func, args, env: dict | None = None) -> tuple[list[str], dict]:
    """rank_main.py's arguments for ``func(*args)``, and an environment whose
    PYTHONPATH finds tests/ and ``func``'s module."""
    mod = sys.modules[func.__module__]
    here = Path(__file__).parent
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join([str(here), str(Path(mod.__file__).parent),
                                              full_env.get("PYTHONPATH", "")])
    return ([str(here / "rank_main.py"), func.__module__, func.__name__, *map(str, args)],
            full_env)


def run_ranks(ranks: int, func, *args, timeout: int = 120, env: dict | None = None):
    """Run ``func(*args)``, a function of a test module (named ``rank_*`` so pytest does
    not collect it), on every rank of real ``mpiexec -n ranks``; a hang fails at
    ``timeout``.  Returns the CompletedProcess; each rank whose call returned printed
    ``rank-main: rank R ok`` (see :func:`assert_ranks_ok`)."""
    import subprocess

    cmd, full_env = rank_command(func, args, env)
    return subprocess.run([str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, *cmd],
                          capture_output=True, text=True, timeout=timeout, env=full_env)


def run_torchrun(ranks: int, func, *args, timeout: int = 120, env: dict | None = None):
    """As :func:`run_ranks`, under real ``torchrun --standalone --nproc-per-node ranks``."""
    import subprocess

    cmd, full_env = rank_command(func, args, env)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node",
                           str(ranks), *cmd], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


#: the step :func:`rank_steps` is running in this process ("" outside such a job), for
#: rank functions that tag what they report with it
STEP = [""]


def rank_steps(steps: str) -> None:
    """Several rank functions in turn, in one process per rank: ``steps`` is JSON
    ``[[name, module, function, [args...]], ...]``; after each, the rank says
    ``step NAME done`` (see :func:`run_steps`)."""
    import importlib
    import json

    for name, module, func, args in json.loads(steps):
        STEP[0] = name
        getattr(importlib.import_module(module), func)(*args)
        say(f"step {name} done")


def run_steps(ranks: int, steps: dict, launcher: str = "torchrun", timeout: int = 300):
    """Run each of ``steps`` (name -> ``(rank function, *args)``) in turn in ONE job of
    ``ranks`` ranks under ``launcher`` (a torchrun launch costs seconds of imports on
    every rank); each test then checks its own step with :func:`assert_step_ok`.  A step
    that fails ends the job: the steps after it are reported as not run."""
    import json

    spec = [[name, f.__module__, f.__name__, [str(a) for a in args]]
            for name, (f, *args) in steps.items()]
    dirs = sorted({str(Path(sys.modules[f.__module__].__file__).parent)
                   for f, *_ in steps.values()})
    run = run_torchrun if launcher == "torchrun" else run_ranks
    return run(ranks, rank_steps, json.dumps(spec), timeout=timeout,
               env={"PYTHONPATH": os.pathsep.join(dirs + [os.environ.get("PYTHONPATH", "")])})


def assert_step_ok(p, name: str, ranks: int) -> None:
    """Every rank of a :func:`run_steps` job finished step ``name``."""
    assert p.stdout.count(f"step {name} done\n") == ranks, \
        f"step {name!r} not done on every rank: exit {p.returncode}\n{p.stdout[-2000:]}\n" \
        f"{p.stderr[-4000:]}"


def assert_ranks_ok(p, ranks: int) -> None:
    """Every rank of a :func:`run_ranks` run returned from its function."""
    ok = sorted(line for line in p.stdout.splitlines() if line.startswith("rank-main: "))
    assert p.returncode == 0 and ok == sorted(f"rank-main: rank {r} ok"
                                              for r in range(ranks)), \
        f"exit {p.returncode}, {ok}\n{p.stderr[-4000:]}"


def say_global_batches(every: list, state=None, tag: str = "") -> None:
    """On the rank that gathered ``every`` rank's ``[epoch, *labels]`` rows: print the
    global batch of each step ("GLOBAL" + tag + JSON) and a saved loader state
    ("STATE" + tag)."""
    import json

    out = every[0]
    steps = [sum((r[i][1:] for r in every), []) for i in range(len(out))]
    say(f"GLOBAL{tag} " + json.dumps([[out[i][0]] + s for i, s in enumerate(steps)]))
    if state is not None:
        say(f"STATE{tag} " + json.dumps(state))


def copy_tree(src: Path, dst: Path) -> Path:
    """A copy of a test data directory (to damage or edit)."""
    import shutil

    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, edit) -> None:
    """``edit(doc)`` applied to the JSON file at ``path``, in place."""
    import json

    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


class SeenBatches:
    """A collate_fn (or batch_transform) that notes each batch's ids as the loader's
    prefetch thread makes it, and returns them; :meth:`wait_for` waits for a batch to
    be made (an event, not a time)."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._seen: list[tuple] = []

    def __call__(self, batch):
        with self._lock:
            self._seen.append(tuple(batch.ids.tolist()))
        return batch.ids.copy()

    @property
    def seen(self) -> list[tuple]:
        with self._lock:
            return list(self._seen)

    def wait_for(self, ids: tuple, timeout: float = 60) -> bool:
        """Whether the batch of ``ids`` was made within ``timeout`` seconds."""
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if ids in self.seen:
                return True
            time.sleep(0.01)
        return False


def skip_without(module: str) -> None:
    """Skip the calling test module when ``module`` is not installed, without importing
    it: every rank of a multi-rank test imports its test module, and torch's import
    costs about 2 seconds a process (``pytest.importorskip`` imports it)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed", allow_module_level=True)


def say(line: str) -> None:
    """One atomic write per line, so lines of concurrent ranks never interleave."""
    os.write(1, (line + "\n").encode())


def corrupt_stored_tensor(store: Path, tensor_hash: str, at: int = 10, mask: int = 0xFF) -> None:
    """Flip bits of one byte of a tensor stored in an LMDB model repository, in place
    (a bit rot the repository must detect; the store must not be open in this process)."""
    import lmdb

    env = lmdb.open(str(store), max_dbs=4)
    db = env.open_db(b"tensors")
    h = tensor_hash.encode()
    with env.begin(write=True) as txn:
        bad = bytearray(txn.get(h, db=db))
        bad[at] ^= mask
        txn.put(h, bytes(bad), db=db)
    env.close()


def damaged_copy(src: Path, dst: Path, sample: int, field: str = "x") -> Path:
    """A copy of dataset ``src`` at ``dst`` with one bit of sample ``sample``'s ``field``
    flipped in its shard (checked: exactly that sample fails verification)."""
    import shutil

    shutil.copytree(src, dst)
    ds = forebay.open_dataset(dst)
    want = ds[sample][field].tobytes()
    for shard in ds.manifest.shards:
        raw = bytearray((dst / shard.data).read_bytes())
        at = raw.find(want)
        if at >= 0:
            raw[at] ^= 1
            (dst / shard.data).write_bytes(bytes(raw))
            break
    assert forebay.open_dataset(dst).verify(raise_on_error=False).bad_samples == [sample]
    return dst


def pytest_terminal_summary(terminalreporter) -> None:
    """One line saying how many tests ran across the emulated nodes (tests/cluster.py)
    and, where they were skipped, why."""
    counts: dict[str, int] = {}
    why = set()
    for outcome in ("passed", "failed", "skipped", "error"):
        for rep in terminalreporter.stats.get(outcome, []):
            if "cluster" in getattr(rep, "keywords", {}) and getattr(rep, "when", "call") in (
                    "call", "setup") and not (outcome == "passed" and rep.when == "setup"):
                counts[outcome] = counts.get(outcome, 0) + 1
                if outcome == "skipped" and isinstance(rep.longrepr, tuple):
                    why.add(str(rep.longrepr[2]).removeprefix("Skipped: "))
    if counts:
        text = ", ".join(f"{n} {k}" for k, n in counts.items())
        terminalreporter.write_line(f"cluster tests (emulated nodes): {text}"
                                    + (f" ({'; '.join(sorted(why))})" if why else ""))


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs of its own (root only): a disk that fills up."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a small file system of its own needs root (mount -t tmpfs)")
    d = tmp_path / "small"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def pytest_configure(config) -> None:
    """A run started as a shell's background job (``make test &`` in a script) inherits
    SIGINT ignored, and so would every command a test starts: a test that stops one as
    Ctrl-C does would find it writing on (``forebay synth`` wrote all its 22 GB).  The
    run takes SIGINT back, so its commands start with it as a terminal gives it."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

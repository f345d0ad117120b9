"""The model repository in the ecosystem: torch.distributed.checkpoint (forebay.models.dcp)
with dedup across checkpoints, verified loads, versions that are whole or absent and
resharding with real DCP on gloo process groups under torchrun; saves that do not block
training; safetensors in and out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from forebay.errors import CorruptModelError, ModelRepositoryError  # noqa: E402
from forebay.models import open_repository  # noqa: E402
from forebay.models.dcp import Reader, Writer  # noqa: E402
from conftest import assert_ranks_ok, corrupt_stored_tensor, run_torchrun  # noqa: E402

# DCP warns on every single-process save or load, even when asked for one
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"layer{i}.weight": torch.randn(64, 32, generator=g) for i in range(6)}
            | {"emb": torch.randn(10, 8, generator=g).to(torch.bfloat16),
               "mask": torch.rand(7, generator=g) > 0.5,
               "steps": torch.arange(5)},
            "epoch": 3, "names": ["a", "b"]}


def _zeros_like(sd: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
            "epoch": 0, "names": []}


def _equal(a: dict, b: dict) -> bool:
    return a["epoch"] == b["epoch"] and a["names"] == b["names"] and all(
        torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_round_trip_in_one_process(tmp_path):
    url = f"file://{tmp_path / 'repo'}"
    sd = _state()
    w = Writer(url, "run", metadata={"note": "first"})
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.version == 1
    back = _zeros_like(sd)
    dcp.load(back, storage_reader=Reader(url, "run"), no_dist=True)
    assert _equal(back, sd)
    m = open_repository(url).manifest("run")
    assert m["metadata"]["note"] == "first" and "dcp" in m["metadata"]
    json.dumps(m)                                    # all JSON: nothing pickled


def test_ten_checkpoints_changing_one_layer_each_store_the_base_once(tmp_path):
    url = f"file://{tmp_path / 'repo'}"
    sd = _state()
    dcp.save(sd, storage_writer=Writer(url, "run"), no_dist=True)
    repo = open_repository(url)
    base = repo.manifest("run", 1)["new_bytes"]
    layer = sd["model"]["layer0.weight"].nbytes
    for k in range(10):
        sd["model"][f"layer{k % 6}.weight"] += 1.0
        dcp.save(sd, storage_writer=Writer(url, "run"), no_dist=True)
        assert repo.manifest("run")["new_bytes"] == layer
    assert repo.versions("run") == list(range(1, 12))
    stored = sum(repo.manifest("run", v)["new_bytes"] for v in repo.versions("run"))
    assert stored <= 1.1 * (base + 10 * layer)
    back = _zeros_like(sd)
    dcp.load(back, storage_reader=Reader(url, "run", version=11), no_dist=True)
    assert _equal(back, sd)
    old = _zeros_like(sd)
    dcp.load(old, storage_reader=Reader(url, "run", version=1), no_dist=True)
    assert torch.equal(old["model"]["layer1.weight"], _state()["model"]["layer1.weight"])


def test_a_corrupt_item_fails_the_load_naming_it(tmp_path):
    url = f"file://{tmp_path / 'repo'}"
    sd = _state()
    dcp.save(sd, storage_writer=Writer(url, "run"), no_dist=True)
    repo = open_repository(url)
    m = repo.manifest("run")
    # a small item (stored inline: the helper's rewrite lands where the load reads)
    key = next(k for k in m["tensors"] if k.startswith("model.steps"))
    h = m["tensors"][key]["hash"]
    repo.close()
    corrupt_stored_tensor(tmp_path / "repo", h)
    # DCP wraps a rank's error in its CheckpointException, traceback included
    with pytest.raises(CheckpointException, match=f"{CorruptModelError.__name__}: .*model.steps"):
        dcp.load(_zeros_like(sd), storage_reader=Reader(url, "run"), no_dist=True)


def test_a_failed_save_publishes_nothing_and_leaves_the_last_version(tmp_path):
    url = f"file://{tmp_path / 'repo'}"
    sd = _state()
    dcp.save(sd, storage_writer=Writer(url, "run"), no_dist=True)

    class Dies(Writer):
        def finish(self, metadata, results):
            raise OSError("the job was killed before the version was published")

    sd["model"]["layer0.weight"] += 5
    with pytest.raises(CheckpointException, match="killed"):
        dcp.save(sd, storage_writer=Dies(url, "run"), no_dist=True)
    repo = open_repository(url)
    assert repo.versions("run") == [1]
    back = _zeros_like(sd)
    dcp.load(back, storage_reader=Reader(url, "run"), no_dist=True)
    assert torch.equal(back["model"]["layer0.weight"], _state()["model"]["layer0.weight"])
    repo.save("plain", {"w": torch.ones(2)})
    with pytest.raises(CheckpointException, match="'plain' version 1 was not saved with DCP"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=Reader(url, "plain"), no_dist=True)


# -- several ranks: DTensor shards saved at one world size, loaded at another ---------------

FULL = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)
# torch's DCP/gloo threads abort a rank at interpreter exit now and then, after its
# work succeeded (about 1 run in 30 here): the ranks leave at once once done
DCP_ENV = {"FOREBAY_ABORT_ON_ERROR": "0", "RANK_MAIN_EXIT_AT_ONCE": "1"}


def rank_save_sharded(url: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {"w": distribute_tensor(FULL.clone(), mesh, [Shard(0)]),
          "b": torch.full((3,), 7.0), "step": 11}
    w = Writer(url, "sharded")
    dcp.save(sd, storage_writer=w)
    if dist.get_rank() == 0:
        assert w.version == 1
    dist.barrier()
    dist.destroy_process_group()


def rank_load_resharded(url: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {"w": distribute_tensor(torch.zeros_like(FULL), mesh, [Shard(0)]),
          "b": torch.zeros(3), "step": 0}
    dcp.load(sd, storage_reader=Reader(url, "sharded"))
    assert torch.equal(sd["w"].full_tensor(), FULL) and torch.equal(sd["b"], torch.full((3,), 7.0))
    assert sd["step"] == 11
    dist.destroy_process_group()


@pytest.mark.mpi
def test_sharded_save_on_two_ranks_loads_on_three_and_in_one_process(tmp_path):
    url = f"file://{tmp_path / 'repo'}"
    assert_ranks_ok(run_torchrun(2, rank_save_sharded, url, env=DCP_ENV), 2)
    repo = open_repository(url)
    m = repo.manifest("sharded")
    assert sorted(k.split("|")[0] for k in m["tensors"]) == ["b", "step", "w", "w"]
    repo.close()
    assert_ranks_ok(run_torchrun(3, rank_load_resharded, url, env=DCP_ENV), 3)
    one = {"w": torch.zeros_like(FULL), "b": torch.zeros(3), "step": 0}
    dcp.load(one, storage_reader=Reader(url, "sharded"), no_dist=True)   # whole, one process
    assert torch.equal(one["w"], FULL) and one["step"] == 11


def rank_dies_while_saving(url: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    sd = {"w": torch.full((4, 4), float(dist.get_rank() + 100))}

    class Slow(Writer):
        def write_data(self, plan, planner):
            if dist.get_rank() == 1:
                os._exit(9)                    # killed in the middle of the save
            return super().write_data(plan, planner)

    dcp.save({"r0": sd["w"]} if dist.get_rank() == 0 else {"r1": sd["w"]},
             storage_writer=Slow(url, "crash"))


@pytest.mark.mpi
def test_a_rank_killed_during_a_save_leaves_the_previous_version(tmp_path):
    url = f"file://{tmp_path / 'repo'}"
    dcp.save({"r0": torch.ones(4, 4), "r1": torch.ones(4, 4)}, storage_writer=Writer(url, "crash"),
             no_dist=True)
    p = run_torchrun(2, rank_dies_while_saving, url, timeout=120,
                     env=DCP_ENV)
    assert p.returncode != 0
    repo = open_repository(url)
    assert repo.versions("crash") == [1]
    back = {"r0": torch.zeros(4, 4), "r1": torch.zeros(4, 4)}
    dcp.load(back, storage_reader=Reader(url, "crash"), no_dist=True)
    assert torch.equal(back["r0"], torch.ones(4, 4))
    assert Path(url[len("file://"):]).is_dir()


# -- safetensors ----------------------------------------------------------------------------

def test_safetensors_import_export_round_trip_with_metadata(tmp_path, cli):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    sd = {"a.weight": torch.randn(8, 4), "a.bias": torch.zeros(4, dtype=torch.bfloat16),
          "emb": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    save_file(sd, tmp_path / "in.safetensors", metadata={"format": "pt", "author": "x"})
    repo_dir = tmp_path / "repo"
    code, out, err = cli("models", "import", repo_dir, tmp_path / "in.safetensors", "net")
    assert code == 0, err
    assert "net version 1: 3 tensors" in out
    save_file(sd | {"a.weight": sd["a.weight"] + 1}, tmp_path / "v2.safetensors")
    code, out, _ = cli("models", "import", repo_dir, tmp_path / "v2.safetensors", "net")
    assert code == 0 and f"({8 * 4 * 4} B new)" in out.replace(",", "")
    code, out, err = cli("models", "export", repo_dir, "net", tmp_path / "out.safetensors",
                         "--version", "1")
    assert code == 0, err
    back = load_file(tmp_path / "out.safetensors")
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    with safe_open(str(tmp_path / "out.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta["author"] == "x" and meta["forebay_model"] == "net"
    assert meta["forebay_version"] == "1"
    code, _, _ = cli("models", "export", repo_dir, "net", tmp_path / "part.safetensors",
                     "--include", "a.*")
    assert code == 0 and set(load_file(tmp_path / "part.safetensors")) == {"a.weight", "a.bias"}


def test_a_crafted_safetensors_file_is_refused_and_nothing_is_stored(tmp_path, cli):
    bad = tmp_path / "bad.safetensors"
    # a header claiming a tensor far beyond the file's end
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 20],
                               "data_offsets": [0, 4 << 20]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    code, _, err = cli("models", "import", tmp_path / "repo", bad, "net")
    assert code != 0 and "bad.safetensors: not a valid safetensors file" in err
    assert open_repository(str(tmp_path / "repo")).list() == {}


# -- saves that do not block training --------------------------------------------------------

class _Held:
    """A repository whose tensor writes wait for a gate: the test decides when the
    background save may finish (no timing)."""

    def __init__(self, url):
        import threading

        from forebay.models import Repository

        self.gate = threading.Event()
        self.entered = threading.Event()
        gate, entered = self.gate, self.entered
        base = open_repository(url)

        class Held(Repository):
            def _store_tensors(self, *a, **k):
                entered.set()
                assert gate.wait(60)
                return super()._store_tensors(*a, **k)
        base.close()
        self.repo = Held(base.backend.__class__(url[len("file://"):]))


def test_an_async_save_returns_at_once_and_stores_the_snapshot(tmp_path):
    url = f"file://{tmp_path / 'repo'}"
    held = _Held(url)
    model = torch.nn.Linear(16, 8)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fut = held.repo.save("net", model, blocking=False)
    assert held.entered.wait(60)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):                         # training steps while the save runs
        opt.zero_grad()
        model(torch.ones(4, 16)).sum().backward()
        opt.step()
    assert not fut.done()
    held.gate.set()
    assert fut.result(timeout=60) == 1
    got = held.repo.load("net")
    assert all(torch.equal(got[k], want[k]) for k in want)          # the snapshot
    assert not torch.equal(model.weight.detach(), want["weight"])  # training went on
    fut2 = held.repo.save("net", model, blocking=False)             # staging reused
    held.repo.close()                                               # waits for it
    assert fut2.done() and fut2.result() == 2
    back = open_repository(url).load("net", 2)
    assert torch.equal(back["weight"], model.weight.detach())


def test_a_failed_async_save_raises_from_its_future_and_publishes_nothing(tmp_path):
    from forebay.models import Repository

    url = f"file://{tmp_path / 'repo'}"
    repo = open_repository(url)
    repo.save("net", {"w": torch.ones(3)})
    backend = repo.backend

    class Full(Repository):
        def _store_tensors(self, *a, **k):
            raise OSError(28, "No space left on device")

    full = Full(backend)
    fut = full.save("net", {"w": torch.full((3,), 2.0)}, blocking=False)
    with pytest.raises(OSError, match="No space left"):
        fut.result(timeout=60)
    assert full.versions("net") == [1]
    with pytest.raises(ModelRepositoryError, match="not a tensor"):   # refused at once
        full.save("net", {"w": 3}, blocking=False)
    with pytest.raises(OSError, match="No space left"):   # close never hides a failed save
        full.close()


def test_dcp_async_save_through_forebay(tmp_path):
    url = f"file://{tmp_path / 'repo'}"
    sd = _state()
    fut = dcp.async_save(sd, storage_writer=Writer(url, "run"), no_dist=True)
    fut.result(timeout=120)
    back = _zeros_like(sd)
    dcp.load(back, storage_reader=Reader(url, "run"), no_dist=True)
    assert _equal(back, sd)


def rank_load_once_per_node(url: str, out: str) -> None:
    """Every rank loads the same replicated model; with share=True the node reads each
    item once between its ranks."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    got = {}
    for share in (False, True):
        sd = {"model": {k: torch.zeros_like(v) for k, v in _state()["model"].items()}}
        r = Reader(url, "replicated", share=share)
        dcp.load(sd, storage_reader=r)
        assert all(torch.equal(sd["model"][k], v) for k, v in _state()["model"].items())
        got[str(share)] = r.bytes_read
    Path(out, f"rank-{rank}.json").write_text(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.mpi
def test_a_node_reads_each_item_once_when_its_ranks_share_the_load(tmp_path):
    from forebay.comm import SHM_DIR

    url = f"file://{tmp_path / 'repo'}"
    dcp.save({"model": _state()["model"]}, storage_writer=Writer(url, "replicated"),
             no_dist=True)
    logical = open_repository(url).manifest("replicated")["logical_bytes"]
    before = set(SHM_DIR.glob(".forebay-seg-*"))
    assert_ranks_ok(run_torchrun(3, rank_load_once_per_node, url, tmp_path,
                                 env=DCP_ENV), 3)
    per = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    assert sum(p["False"] for p in per) == 3 * logical       # every rank read it all
    assert sum(p["True"] for p in per) == logical            # once for the node
    assert max(p["True"] for p in per) < logical              # striped over the ranks
    assert set(SHM_DIR.glob(".forebay-seg-*")) <= before

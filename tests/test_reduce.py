"""forebay.reduce: bitvector and master-worker coordination, grouping, response cache.

Multi-rank tests are ``rank_*`` functions run on every rank of a real gloo process group
on 127.0.0.1 under ``mpiexec`` (the port is agreed through mpi4py by
``init_process_group``), or as plain processes with torchrun's variables where a rank
must die; each with a timeout.  The two-rank cases run one after the other in one
``mpiexec`` job (the ``two_ranks`` fixture, conftest's ``run_steps``), whose output each
of their tests reads."""
from __future__ import annotations

import json
import os
import random
import sys
import time

import numpy as np
import pytest

from conftest import STEP, assert_step_ok, rank_command, run_ranks, run_steps, say

torch = pytest.importorskip("torch")

from forebay.errors import ReduceError  # noqa: E402
from forebay.reduce._cache import (INVALID, SHUTDOWN, UNCACHED, Params,  # noqa: E402
                                   ResponseCache, bits_of, invert_request_bits, new_vector,
                                   set_bits, status_of)
from forebay.reduce._requests import MasterTable  # noqa: E402

P = Params((3,), "float32", "average", -1)


def results(proc) -> list[dict]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return results_of(proc)


def results_of(proc) -> list[dict]:
    return [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("RES ")]


# ----------------------------------------------------------------------------- one process

def test_cache_positions_lru_eviction_and_erase():
    c = ResponseCache(capacity=3)
    assert [c.put(n, P) for n in "abc"] == [0, 1, 2]
    assert c.lookup("b", P) == ("hit", 1)
    assert c.lookup("b", P._replace(shape=(4,))) == ("stale", 1)
    assert c.lookup("z", P) == ("miss", -1)
    c.touch("a")                                   # LRU order now b, c, a
    assert c.put("d", P) == 1 and c.evictions == 1  # b evicted, its position reused
    assert c.lookup("b", P)[0] == "miss"
    assert c.names_in_lru_order() == ["c", "a", "d"]
    c.erase([2, 0])                                # c and a
    assert len(c) == 1 and c.invalidations == 2
    assert c.put("e", P) == 0                      # lowest free position first
    with pytest.raises(ValueError):
        ResponseCache(0)


def test_bitvector_and_means_all_ranks_for_requests_any_rank_for_status():
    words = ResponseCache(200).words
    assert words == 1 + 4
    a = new_vector(words, SHUTDOWN)
    b = new_vector(words, UNCACHED)
    set_bits(a, [0, 5, 64, 199])
    set_bits(b, [5, 63, 199])
    both = a & b                                   # what a BAND all-reduce computes
    assert bits_of(both).tolist() == [5, 199]
    assert status_of(both) == SHUTDOWN | UNCACHED
    assert status_of(new_vector(words) & new_vector(words)) == 0
    # OR of request bits through the same BAND (how invalid entries are agreed on)
    inv_a, inv_b = new_vector(words, INVALID), new_vector(words)
    set_bits(inv_a, [7])
    set_bits(inv_b, [130])
    anyone = invert_request_bits(invert_request_bits(inv_a) & invert_request_bits(inv_b))
    assert bits_of(anyone).tolist() == [7, 130]
    assert status_of(anyone) == INVALID


def test_master_table_waits_for_every_rank_and_reports_mismatches():
    t = MasterTable(world=3)
    req = lambda name, shape: [name, shape, "float32", "average", -1]  # noqa: E731
    out = t.process([{"requests": [req("a", [2]), req("b", [2])]},
                     {"requests": [req("b", [2])]}, {"requests": [req("b", [2])]}])
    assert out == {"ready": ["b"], "errors": [], "shutdown": False, "busy": True}
    assert t.missing("a") == [1, 2]
    out = t.process([{"requests": []}, {"requests": [req("a", [3])]},
                     {"requests": [req("a", [2])], "shutdown": True}])
    assert out["ready"] == [] and out["shutdown"]
    [[name, message]] = out["errors"]
    assert name == "a" and "rank 0 sent shape [2]" in message and "rank 1 sent shape [3]" in message
    with pytest.raises(ReduceError, match="malformed coordination message from rank 1"):
        t.process([{"requests": []}, {"requests": [["x", "notashape"]]}, {"requests": []}])


# ----------------------------------------------------------------------------- multi-rank
# Each rank_* function runs on every rank (see conftest.run_ranks) and prints one
# "RES {json}" line per result, which the test collects with results().

def _init() -> tuple[int, int]:
    import forebay.reduce as fr
    return fr.init_process_group("gloo")


def _out(rank: int, **kw) -> None:
    """One result, tagged with the step of a shared job it belongs to."""
    say("RES " + json.dumps(dict(rank=rank, case=STEP[0], **kw)))


@pytest.fixture(scope="module")
def two_ranks():
    """The two-rank cases in turn in one mpiexec job (each launch costs seconds of
    imports on every rank); each case makes and closes its own coordinators (each with
    its own process groups), and those that use the default one shut it down."""
    steps = {"adhoc-bitvector": (rank_adhoc, "bitvector", 0, 1024),
             "adhoc-small-cache": (rank_adhoc, "bitvector", 0, 5)}
    for mode, groups in TRAIN_CASES:
        steps[f"train-{mode}-{groups}"] = (rank_train, mode, groups)
    for mode in ("bitvector", "master"):
        steps[f"ddp-{mode}"] = (rank_ddp, mode)
    steps.update({"params": (rank_params,), "misuse": (rank_misuse,),
                  "mismatch": (rank_mismatch,), "reshape": (rank_reshape,)})
    return run_steps(2, steps, launcher="mpiexec")


def case_results(p, case: str) -> list[dict]:
    """The results of ``case``, which both ranks finished."""
    assert_step_ok(p, case, 2)
    return [r for r in results_of(p) if r["case"] == case]


TRAIN_CASES = [("bitvector", "null"), ("bitvector", "2"), ("bitvector", '"lists"'),
               ("master", '"lists"')]


def rank_adhoc(mode: str, grouped: str, capacity: str) -> None:
    """Every rank submits the same named tensors in its own random order with random
    delays; results must equal a reference all-reduce on the default group. Tensor i has
    2**i elements, so a fused size tells exactly which tensors went into one collective."""
    import torch.distributed as dist

    import forebay.reduce as fr
    rank, world = _init()
    coord = fr.Coordinator(coordination=mode, cache_capacity=int(capacity),
                           fusion_threshold_bytes=1 << 16)
    names = [f"t{i}" for i in range(12)]
    if grouped == "1":
        coord.register_group(0, names[:5])
        coord.register_group(1, names[5:9])
    group = {n: (0 if i < 5 else 1 if i < 9 else -1) if grouped == "1" else -1
             for i, n in enumerate(names)}
    rng = random.Random(rank)
    ok = True
    for step in range(4):
        g = torch.Generator().manual_seed(1000 * step + rank)
        data = {n: torch.randn(2 ** i, generator=g) for i, n in enumerate(names)}
        orig = {n: t.clone() for n, t in data.items()}
        order = names[:]
        rng.shuffle(order)
        handles = {}
        for n in order:
            handles[n] = coord.submit(n, data[n], "average", group=group[n])
            time.sleep(rng.random() * 0.003)
        for n in names:
            got = handles[n].wait(60)
            ref = orig[n].clone()
            dist.all_reduce(ref)
            ref /= world
            ok &= torch.allclose(got, ref, atol=1e-6) and torch.equal(data[n], orig[n])
    coord.close()
    c = coord.counters
    _out(rank, ok=bool(ok), evictions=coord.cache.evictions, cached=c["cached"],
         negotiated=c["negotiated"], sizes=coord.fused_sizes)


@pytest.mark.mpi
@pytest.mark.parametrize("mode,grouped,ranks", [("bitvector", 0, 2), ("bitvector", 1, 4),
                                                 ("master", 1, 3)])
def test_random_readiness_order_gives_reference_average(mode, grouped, ranks, two_ranks):
    res = case_results(two_ranks, "adhoc-bitvector") if ranks == 2 else \
        results(run_ranks(ranks, rank_adhoc, mode, grouped, 1024, timeout=180))
    assert len(res) == ranks and all(r["ok"] for r in res)
    if mode == "bitvector":            # step 1 negotiates, the later steps hit the cache
        assert all(r["negotiated"] == 12 and r["cached"] == 36 for r in res)
    else:
        assert all(r["cached"] == 0 and r["negotiated"] == 48 for r in res)
    assert len({tuple(r["sizes"]) for r in res}) == 1   # same collectives on every rank
    members = [s // 4 for s in res[0]["sizes"]]          # bit i set: tensor t{i} was in it
    assert sum(members) == 4 * (2 ** 12 - 1)            # each tensor once per step
    if grouped:                                          # groups are never split
        assert all(m & 0x1F in (0, 0x1F) and m & 0x1E0 in (0, 0x1E0) for m in members)


@pytest.mark.mpi
def test_cache_smaller_than_the_tensor_count_evicts_consistently(two_ranks):
    res = case_results(two_ranks, "adhoc-small-cache")
    assert all(r["ok"] for r in res)
    assert all(r["evictions"] > 0 for r in res)
    assert res[0]["evictions"] == res[1]["evictions"]


def _two_branch_net(rank: int):
    """Two branches whose order in forward (and so in backward) differs per rank, and a
    branch used only on some ranks and steps."""
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.rare = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(6, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, x, use_rare):
            first, second = (self.a, self.b) if rank % 2 == 0 else (self.b, self.a)
            h = torch.relu(first(x)) + torch.relu(second(x))
            if use_rare:
                h = h + self.rare(x)
            return self.head(h)
    return Net()


def rank_train(mode: str, groups_json: str) -> None:
    import torch.distributed as dist

    import forebay.reduce as fr
    rank, world = _init()
    groups = json.loads(groups_json)
    torch.manual_seed(0)
    ours, ref = _two_branch_net(rank), _two_branch_net(rank)
    ref.load_state_dict(ours.state_dict())
    if groups == "lists":
        groups = [[ours.a.weight, ours.a.bias, ours.b.weight],
                  [ours.head.weight, ours.head.bias]]
    opt = fr.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1),
                                  ours.named_parameters(), coordination=mode, groups=groups,
                                  fusion_threshold_bytes=256)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ok = True
    for step in range(5):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(16, 6, generator=g)
        use_rare = (step + rank) % 2 == 0
        for model, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            model(x, use_rare).pow(2).mean().backward()
        # reference: every parameter's gradient (zeros where unused) averaged with all_reduce
        for p in ref.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        ropt.step()
        for (_, p), q in zip(ours.named_parameters(), ref.parameters()):
            ok &= torch.allclose(p, q, atol=1e-6)
    s = opt.stats()
    opt.close()
    _out(rank, ok=bool(ok), last=s["last_step"], steps=s["steps"], cache=s["cache"])


@pytest.mark.mpi
@pytest.mark.parametrize("mode,groups", TRAIN_CASES)
def test_optimizer_matches_reference_with_reordered_and_unused_gradients(mode, groups,
                                                                         two_ranks):
    res = case_results(two_ranks, f"train-{mode}-{groups}")
    assert len(res) == 2 and all(r["ok"] for r in res), res
    assert all(r["steps"] == 5 for r in res)
    assert res[0]["last"]["fused_sizes"] == res[1]["last"]["fused_sizes"]
    if mode == "bitvector":
        assert res[0]["last"]["negotiated"] == 0 and res[0]["last"]["cached"] == 8


def rank_ddp(mode: str) -> None:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import forebay.reduce as fr
    rank, _ = _init()

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(),
                             nn.Linear(4 * 6 * 6, 10))
    ours, theirs = make(), DDP(make())
    opt = fr.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9),
                                  ours.named_parameters(), coordination=mode)
    fr.broadcast_parameters(ours.state_dict(), root_rank=0)
    dopt = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    dsched = torch.optim.lr_scheduler.StepLR(dopt, step_size=2, gamma=0.5)
    losses: list[float] = []
    dlosses: list[float] = []
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
    for _ in range(6):
        for model, o, s, acc in ((ours, opt, sched, losses), (theirs, dopt, dsched, dlosses)):
            o.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            o.step()
            s.step()
            acc.append(loss.item())
    opt.close()
    _out(rank, losses=losses, ddp=dlosses, sgd=isinstance(opt, torch.optim.SGD))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["bitvector", "master"])
def test_training_curve_equals_ddp(mode, two_ranks):
    res = case_results(two_ranks, f"ddp-{mode}")
    assert len(res) == 2
    for r in res:
        assert r["sgd"]
        np.testing.assert_allclose(r["losses"], r["ddp"], rtol=1e-5, atol=1e-6)
        assert r["losses"][-1] < r["losses"][0]


def _outcome(rank: int, key: str, call) -> None:
    """Report ``call()``'s exception (type and message) under ``key``, or None."""
    try:
        call()
        _out(rank, **{key: None})
    except Exception as e:
        _out(rank, **{key: type(e).__name__, "msg": str(e)[:300]})


def rank_reshape() -> None:
    import forebay.reduce as fr
    rank, _ = _init()
    first = fr.allreduce_async(torch.full((3,), float(rank)), "t").wait(60).tolist()
    second = fr.allreduce(torch.full((5,), float(rank + 1)), "t", op="sum").tolist()
    third = fr.allreduce(torch.full((5,), 2.0), "t", op="sum").tolist()
    c = fr._optimizer._default
    _out(rank, first=first, second=second, third=third, inv=c.cache.invalidations,
         cycles=c.counters["invalid_cycles"])
    fr.shutdown()


@pytest.mark.mpi
def test_tensor_reregistered_with_a_new_shape_invalidates_the_entry(two_ranks):
    res = case_results(two_ranks, "reshape")
    assert len(res) == 2
    for r in res:
        assert r["first"] == [0.5] * 3
        assert r["second"] == [3.0] * 5 and r["third"] == [4.0] * 5
        assert r["inv"] == 1 and r["cycles"] == 1


def rank_mismatch() -> None:
    import forebay.reduce as fr
    rank, _ = _init()
    _outcome(rank, "err", lambda: fr.allreduce(torch.zeros(3 + rank), "bad"))
    _out(rank, after=fr.allreduce(torch.ones(2), "good").tolist())  # the coordinator still works
    fr.shutdown()


@pytest.mark.mpi
def test_ranks_disagreeing_on_a_shape_get_a_clear_error_and_go_on(two_ranks):
    res = case_results(two_ranks, "mismatch")
    errs = [r for r in res if "err" in r]
    assert len(errs) == 2
    for r in errs:
        assert r["err"] == "ReduceMismatchError"
        assert "'bad'" in r["msg"] and "shape [3]" in r["msg"] and "shape [4]" in r["msg"]
    assert [r["after"] for r in res if "after" in r] == [[1.0, 1.0]] * 2


def rank_shutdown() -> None:
    import forebay.reduce as fr
    rank, _ = _init()
    coord = fr.Coordinator()
    if rank == 0:
        coord.close()
        _out(rank, closed=True)
    else:
        _outcome(rank, "err", lambda: coord.submit("never", torch.ones(1)).wait(60))
        _outcome(rank, "err2", lambda: coord.submit("later", torch.ones(1)))


@pytest.mark.mpi
def test_one_rank_closing_stops_every_rank_without_a_hang():
    res = results(run_ranks(2, rank_shutdown, timeout=120))
    r1 = next(r for r in res if r["rank"] == 1 and "err" in r)
    assert r1["err"] == "ReduceError" and "shut down" in r1["msg"]
    assert any(r.get("err2") == "ReduceError" for r in res)


def rank_peer_lost(case: str) -> None:
    """Rank 1 dies (``dies``) or stops, alive with its sockets open (``stuck``), after one
    reduction; rank 0 reports how its next reduction ended."""
    import signal

    import forebay.reduce as fr
    rank, _ = _init()
    coord = fr.Coordinator(timeout_s=5)
    coord.submit("x", torch.ones(1)).wait(60)
    if rank == 1:
        if case == "dies":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGSTOP)
    t = time.monotonic()
    try:
        coord.submit("y", torch.ones(1)).wait(60)
        _out(rank, err=None)
    except Exception as e:
        _out(rank, err=type(e).__name__, msg=str(e)[:300], took=time.monotonic() - t)
    os._exit(0)     # the peer is gone: do not wait for it in interpreter teardown


def run_torchrun_style(ranks: int, func, *args, timeout: int = 120):
    """``func(*args)`` in plain processes with torchrun's RANK/WORLD_SIZE/MASTER_*
    variables (no launcher, which would tear the whole job down when one rank dies)."""
    import socket
    import subprocess
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd, env = rank_command(func, args)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ranks))
    procs = [subprocess.Popen([sys.executable, *cmd], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(ranks)]
    try:
        first = procs[0].communicate(timeout=timeout)
    finally:
        for q in procs[1:]:
            if q.poll() is None:        # a stopped or hung peer
                q.kill()
    return procs, [first] + [q.communicate() for q in procs[1:]]


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["dies", "stuck"])
def test_a_dead_or_stuck_rank_fails_the_survivors_instead_of_hanging(case):
    procs, outs = run_torchrun_style(2, rank_peer_lost, case)
    assert procs[1].returncode == (3 if case == "dies" else -9)
    res = [json.loads(line[4:]) for line in outs[0][0].splitlines() if line.startswith("RES ")]
    assert len(res) == 1, outs[0]
    r = res[0]
    assert r["rank"] == 0 and r["err"] == "ReduceError" and r["took"] < 30, r
    assert "failed on rank 0" in r["msg"] and "a peer rank" in r["msg"]


def rank_params() -> None:
    import forebay.reduce as fr
    rank, _ = _init()
    model = torch.nn.Linear(4, 2 + rank)
    _outcome(rank, "err", lambda: fr.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1), model.named_parameters()))


@pytest.mark.mpi
def test_different_parameter_lists_are_refused_at_construction(two_ranks):
    res = case_results(two_ranks, "params")
    assert len(res) == 2
    for r in res:
        assert r["err"] == "ReduceError" and "different parameter lists" in r["msg"]


def rank_subgroups() -> None:
    """Two independent data-parallel groups of 2 ranks each (two ensemble members, say)."""
    import torch.distributed as dist

    import forebay.reduce as fr
    rank, _ = _init()
    g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = fr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                  model.named_parameters(),
                                  process_group=g01 if rank < 2 else g23)
    opt.zero_grad()
    model(torch.full((1, 4), float(rank))).sum().backward()
    opt.step()
    _out(rank, w=model.weight.grad[0].tolist(), b=model.bias.grad.tolist())
    opt.close()


@pytest.mark.mpi
def test_process_group_limits_the_average_to_its_ranks():
    res = {r["rank"]: r for r in results(run_ranks(4, rank_subgroups, timeout=120))}
    assert res[0]["w"] == res[1]["w"] == [0.5] * 4          # mean of ranks 0 and 1
    assert res[2]["w"] == res[3]["w"] == [2.5] * 4          # mean of ranks 2 and 3
    assert all(r["b"] == [1.0, 1.0] for r in res.values())


def rank_misuse() -> None:
    import forebay.reduce as fr
    rank, _ = _init()
    model = torch.nn.Linear(4, 2)
    opt = fr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1),
                                  model.named_parameters())
    errs = []
    model(torch.ones(1, 4)).sum().backward()
    for misuse in (opt.zero_grad, lambda: model(torch.ones(1, 4)).sum().backward()):
        try:
            misuse()
        except Exception as e:
            errs.append(str(e))
    opt.step()
    opt.close()
    _out(rank, errs=errs)


@pytest.mark.mpi
def test_zero_grad_or_a_second_backward_before_step_are_refused(two_ranks):
    res = case_results(two_ranks, "misuse")
    assert len(res) == 2
    for r in res:
        assert len(r["errs"]) == 2
        assert "zero_grad() was called after loss.backward()" in r["errs"][0]
        assert "more than backward_passes_per_step=1" in r["errs"][1]


def rank_stats(n: str, trace_dir: str) -> None:
    """Both coordinations in turn in one job (each launch costs seconds of imports)."""
    import forebay.reduce as fr
    import forebay.trace
    rank, _ = _init()
    for mode in ("bitvector", "master"):
        forebay.trace.enable(f"{trace_dir}/{mode}")
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(int(n) // 2)])
        opt = fr.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      model.named_parameters(), coordination=mode,
                                      cycle_time_ms=2)
        for _ in range(4):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        s = opt.stats()
        opt.close()
        forebay.trace.disable()
        _out(rank, mode=mode, last=s["last_step"], words=opt._fb_coord.cache.words)


@pytest.mark.mpi
def test_stats_bitvector_control_bytes_are_one_vector_per_cycle(tmp_path):
    from forebay.trace._read import read_traces
    both = results(run_ranks(3, rank_stats, 40, tmp_path, timeout=120))
    res = [r for r in both if r["mode"] == "bitvector"]
    assert len(res) == 3
    for r in res:
        last = r["last"]
        assert last["control_bytes_sent"] == 8 * r["words"] * last["cycles"]
        assert last["control_collectives"] == last["cycles"] and last["control_messages"] == 0
        assert last["data_collectives"] == len(last["fused_sizes"]) >= 1
        assert sum(last["fused_sizes"]) == 20 * (16 + 4) * 4
    ev = read_traces(tmp_path / "bitvector")     # reductions show up in the trace
    names = set(zip(ev.cat.tolist(), ev.name.tolist()))
    assert ("comm", "allreduce") in names and ("comm", "synchronize") in names
    root = next(r for r in both if r["rank"] == 0 and r["mode"] == "master")["last"]
    assert root["control_messages"] == 2 * root["cycles"]          # one from each worker
    assert root["control_bytes_received"] > 40 * 2 * 10            # every request, by name


def _listening() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on, from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:      # 0A: LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                if width == 8:
                    addr = ".".join(str(b) for b in bytes.fromhex(hexaddr)[::-1])
                else:
                    addr = "::" if int(hexaddr, 16) == 0 else hexaddr
                out.append((addr, int(hexport, 16)))
    return out


def rank_rendezvous_binds() -> None:
    from mpi4py import MPI  # noqa: F401 - MPI's own sockets (the launcher's) come first
    before = set(_listening())
    rank, world = _init()
    _out(rank, listening=sorted(set(_listening()) - before), world=world)


def test_rendezvous_store_listens_only_on_the_jobs_address():
    """The store rank 0 serves for the rendezvous is bound to 127.0.0.1 on one host
    (torch's own TCPStore listens on every interface: any user of the node, or of the
    network, could reach it)."""
    out = results(run_ranks(2, rank_rendezvous_binds, timeout=120))
    assert len(out) == 2 and all(o["world"] == 2 for o in out)
    r0 = next(o for o in out if o["rank"] == 0)
    assert r0["listening"], "rank 0 serves the rendezvous store"
    assert ["127.0.0.1", int(r0["listening"][0][1])] in r0["listening"]
    wild = [a for o in out for a in o["listening"] if a[0] in ("0.0.0.0", "::")]
    assert not wild, f"sockets listening on every interface: {wild}"

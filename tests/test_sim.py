"""forebay.sim: NoPFS's performance model and the I/O policy simulator."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from forebay.plan import AccessPlan
from forebay.sim import (POLICIES, System, Workload, hdmlp_thesis, lassen, simulate,
                         simulate_policy, timeline)
from forebay.sim._engine import _release_steps
from forebay.store import ProfileError

CONTRACT = ["perfect", "naive", "staging", "deepio", "deepio-opportunistic",
            "parallel-staging", "lbann", "lbann-preload", "locality-aware", "nopfs",
            "forebay-preload", "forebay-clairvoyant"]


def toy(**kw) -> System:
    """1 MB/s compute, PFS 1 MB/s for one reader (2 for two), preprocessing 2 MB/s,
    memory too fast to matter: every time below is a sum of whole seconds."""
    base = dict(compute_MBps=1.0, preprocess_MBps=2.0, network_MBps=1e6,
                pfs_MBps={1: 1.0, 2: 2.0}, mem_MBps={1: 1e7}, staging_bytes=10**9,
                ram_bytes=0, ssd_bytes=0, staging_threads=1, ram_threads=1, ssd_threads=1)
    base.update(kw)
    return System(**base)


def one_worker(system: System, samples: int = 8, batch: int = 2) -> Workload:
    plan = AccessPlan(num_samples=samples, world_size=1, batch_size=batch, epochs=1)
    return Workload(np.full(samples, 10**6), plan, system)


def test_contract_policy_names():
    assert list(POLICIES) == CONTRACT


def test_hand_computed_one_worker_one_tier():
    # 4 batches of 2 x 1 MB.  A sample: fetch 1 s + write 0.5 s; a batch: 3 s to
    # deliver, 2 s to compute.
    w = one_worker(toy())
    assert simulate_policy("perfect", w)["total_s"] == pytest.approx(8.0)
    naive = simulate_policy("naive", w)          # no overlap: 4 x (3 + 2)
    assert naive["total_s"] == pytest.approx(20.0)
    assert naive["stall_s"] == pytest.approx(12.0)
    assert naive["accelerator_utilization"] == pytest.approx(8.0 / 20.0)   # DLIO's AU
    assert simulate_policy("perfect", w)["accelerator_utilization"] == pytest.approx(1.0)
    assert naive["by_source"]["pfs"] == pytest.approx(8.0)
    staging = simulate_policy("staging", w)      # delivery-bound: 4 x 3 + the last 2
    assert staging["total_s"] == pytest.approx(14.0)
    assert staging["stall_s"] == pytest.approx(6.0)
    # two threads: two readers get t(2) = 2 MB/s between them, 1 MB/s each; a batch
    # takes 3 / 2 = 1.5 s, so compute-bound after the first batch: 1.5 + 4 x 2
    two = simulate_policy("staging", one_worker(toy(staging_threads=2)))
    assert two["total_s"] == pytest.approx(9.5)
    # a staging buffer that holds one batch cannot prefetch: the naive timeline again
    tight = simulate_policy("staging", one_worker(toy(staging_bytes=2 * 10**6)))
    assert tight["total_s"] == pytest.approx(20.0)
    # ... and one that holds two batches overlaps the next fetch with compute
    two_b = simulate_policy("staging", one_worker(toy(staging_bytes=4 * 10**6)))
    assert two_b["total_s"] == pytest.approx(14.0)


def test_cached_policies_hand_computed():
    # RAM holds everything; 2 epochs of 2 batches.  Epoch 0 from the PFS (3 s per
    # batch), epoch 1 from RAM (write only: 1 s per batch); compute 2 s per batch.
    sysm = toy(ram_bytes=10**9, staging_threads=1)
    plan = AccessPlan(num_samples=4, world_size=1, batch_size=2, epochs=2)
    w = Workload(np.full(4, 10**6), plan, sysm)
    for name in ("nopfs", "forebay-clairvoyant", "lbann"):
        r = simulate_policy(name, w)
        # P = 3, 6, 7, 8; steps start 3, 6, 8, 10 -> end 12
        assert r["total_s"] == pytest.approx(12.0), name
        assert r["fetches"] == {"pfs": 4, "ram": 4, "ssd": 0, "peer_ram": 0, "peer_ssd": 0}
    # the set-up policies load the 4 samples first (fetch + write: 6 s), then read
    # every epoch from RAM (1 s per batch): 7 s to the first batch, then compute-bound
    for name in ("deepio", "lbann-preload", "locality-aware"):
        r = simulate_policy(name, w)
        assert r["setup_s"] == pytest.approx(6.0), name
        assert r["first_batch_s"] == pytest.approx(7.0), name
        assert r["total_s"] == pytest.approx(6.0 + 1 + 4 * 2), name
        assert r["fetches"] == {"pfs": 0, "ram": 8, "ssd": 0, "peer_ram": 0, "peer_ssd": 0}
    # preload: 4 MB from the PFS into RAM first (4 s; preprocessing comes at delivery),
    # then 1 s per batch to deliver: the first batch after 5 s, then compute-bound
    pre = simulate_policy("forebay-preload", w)
    assert pre["setup_s"] == pytest.approx(4.0)
    assert pre["total_s"] == pytest.approx(4.0 + 1 + 4 * 2)
    # a file system whose large sequential requests stream at 4 MB/s (one request per
    # record: 1 MB/s) loads a packed chunk at the stream's rate, 1 s for 4 MB, where the
    # reads of one record each still go at the record table's; a file per sample
    # is one request per record either way
    streamed = replace(w.system, pfs_stream_MBps={1: 4.0, 2: 8.0})
    fast = simulate_policy("forebay-preload", Workload(w.sizes, w.plan, streamed))
    assert fast["setup_s"] == pytest.approx(1.0)
    assert fast["total_s"] == pytest.approx(1.0 + 1 + 4 * 2)
    assert simulate_policy("staging", Workload(w.sizes, w.plan, streamed))["total_s"] == \
        pytest.approx(simulate_policy("staging", w)["total_s"])
    files = simulate_policy("forebay-preload", Workload(w.sizes, w.plan, streamed,
                                                          per_file=True))
    assert files["setup_s"] == pytest.approx(4.0)


@pytest.mark.parametrize("whole", [True, False])
def test_release_steps_are_the_definitions(whole):
    """The buffer's release step, solved for every worker at once, is the smallest g
    with bytes(g+1 .. h) <= capacity (at most h-1), for whole and fractional sizes and
    capacities from none to more than every batch together."""
    rng = np.random.default_rng(7)
    for n, s in [(1, 1), (3, 7), (64, 5), (2, 40)]:
        nbytes = rng.integers(0, 50, (n, s)).astype(float)
        if not whole:
            nbytes += rng.random((n, s))
        for cap in (0, 1, 37, 120, 1 << 62):
            want = np.empty((n, s), dtype=np.int64)
            for i in range(n):
                for h in range(s):
                    g = next((g for g in range(-1, h) if nbytes[i, g + 1:h + 1].sum() <= cap),
                             h - 1)
                    want[i, h] = min(g, h - 1)
            assert (_release_steps(nbytes, cap) == want).all(), (n, s, cap)


def _reference(read, comp, nbytes, cap, setup):
    """Step by step, as the model is written (NoPFS §4 with a bounded buffer)."""
    n, s = read.shape
    g = _release_steps(nbytes, cap)
    cmax = comp.max(axis=0)
    end = np.zeros(s)
    p = np.full(n, float(setup))
    prev_end = float(setup)
    for h in range(s):
        rel = np.array([end[g[i, h]] if g[i, h] >= 0 else 0.0 for i in range(n)])
        p = np.maximum(p, rel) + read[:, h]
        start = max(p.max(), prev_end)
        end[h] = start + cmax[h]
        prev_end = end[h]
    return end


@pytest.mark.parametrize("seed", range(6))
def test_timeline_scan_matches_step_by_step(seed):
    rng = np.random.default_rng(seed)
    n, s = int(rng.integers(1, 5)), int(rng.integers(1, 300))
    read = rng.exponential(1.0, (n, s))
    comp = rng.exponential(1.0, (n, s))
    nbytes = rng.integers(1, 100, (n, s)).astype(float)
    cap = int(rng.choice([0, 50, 200, 1000, 10**9]))
    setup = float(rng.choice([0.0, 3.0]))
    tl = timeline(read, comp, nbytes, cap, setup)
    np.testing.assert_allclose(tl.end, _reference(read, comp, nbytes, cap, setup), rtol=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_perfect_bounds_every_policy(seed):
    rng = np.random.default_rng(100 + seed)
    f = int(rng.integers(40, 400))
    n = int(rng.choice([1, 2, 3, 4]))
    b = int(rng.integers(1, max(2, f // (2 * n))))
    sizes = rng.integers(10_000, 2_000_000, f)
    total = int(sizes.sum())
    sysm = replace(lassen(), compute_MBps=float(rng.choice([64, 1000, 5000])),
                   staging_bytes=int(rng.choice([0, 4_000_000, 10**9])),
                   ram_bytes=int(total * rng.uniform(0, 0.6)),
                   ssd_bytes=int(total * rng.uniform(0, 0.6)))
    w = Workload(sizes, AccessPlan(f, n, b, int(rng.integers(1, 4)), seed=seed), sysm)
    lower = simulate_policy("perfect", w)["total_s"]
    for name in CONTRACT:
        r = simulate_policy(name, w)
        if r["failed"]:
            continue
        assert r["total_s"] >= lower * (1 - 1e-12), name
        assert r["stall_s"] >= 0


def test_lbann_and_preload_fail_beyond_aggregate_ram():
    sizes = np.full(100, 10**6)
    plan = AccessPlan(100, 4, 5, 2)
    small = Workload(sizes, plan, replace(lassen(), ram_bytes=20 * 10**6))  # 80 MB < 100 MB
    for name in ("lbann", "forebay-preload"):
        r = simulate_policy(name, small)
        assert r["failed"] and "exceeds the workers' aggregate RAM" in r["failed"]
        assert r["total_s"] is None
    enough = Workload(sizes, plan, replace(lassen(), ram_bytes=30 * 10**6))
    assert simulate_policy("lbann", enough)["failed"] is None
    pre = simulate_policy("forebay-preload", enough)
    assert pre["failed"] is None and pre["width"] == 4   # one replica striped over 4


def test_clairvoyant_reads_each_sample_from_the_pfs_once():
    # aggregate capacity covers the dataset, no single worker's does
    sizes = np.random.default_rng(1).integers(50_000, 150_000, 2_000)
    plan = AccessPlan(2_000, 4, 16, 4, seed=3)
    sysm = replace(lassen(), ram_bytes=int(sizes.sum() * 0.2), ssd_bytes=int(sizes.sum() * 0.1))
    w = Workload(sizes, plan, sysm)
    fb = simulate_policy("forebay-clairvoyant", w)
    assert fb["covered"] == 1.0
    assert fb["pfs_reads"] == plan.num_samples          # each exactly once
    nopfs = simulate_policy("nopfs", w)                  # frequency-only placement
    assert nopfs["pfs_reads"] > fb["pfs_reads"]
    assert simulate_policy("staging", w)["pfs_reads"] == plan.epochs * plan.steps_per_epoch \
        * plan.global_batch


def test_parallel_staging_trains_on_what_it_staged():
    # each worker's storage holds 30 of the 100 samples (less than its 50-sample
    # shard): it stages them in set-up and then reads nothing from the PFS
    sizes = np.full(100, 10**6)
    plan = AccessPlan(100, 2, 5, 3, seed=1)
    sysm = replace(lassen(), ram_bytes=0, ssd_bytes=30 * 10**6)
    r = simulate_policy("parallel-staging", Workload(sizes, plan, sysm))
    assert r["setup_s"] > 0 and r["fetches"]["pfs"] == 0
    assert r["fetches"]["ssd"] == plan.epochs * plan.steps_per_epoch * plan.global_batch


def test_lassen_mnist_naive_is_slowest():
    # every worker counted as a PFS reader all the time: the closed form below
    rep = simulate(replace(lassen(), pfs_readers="all"), "mnist", workers=4, epochs=3,
                   scale=0.2)
    pol = rep["policies"]
    totals = {k: v["total_s"] for k, v in pol.items() if k != "perfect" and not v["failed"]}
    assert max(totals, key=totals.get) == "naive"
    best = min(totals.values())
    # the model's closed form: naive pays 1/(t(4)/4) + 1/beta per MB on top of 1/c
    sysm = lassen()
    closed = 1 + sysm.compute_MBps * (4 / 1540 + 1 / sysm.preprocess_MBps)
    assert totals["naive"] / pol["perfect"]["total_s"] == pytest.approx(closed, rel=0.01)
    assert totals["naive"] / best > 1.4


def test_lassen_imagenet_nopfs_and_forebay_near_the_bound():
    rep = simulate("lassen", "imagenet-1k", workers=4, epochs=3, scale=0.005,
                   policies=["perfect", "nopfs", "forebay-clairvoyant", "naive"])
    pol = rep["policies"]
    for name in ("nopfs", "forebay-clairvoyant"):
        assert pol[name]["total_s"] <= 1.02 * pol["perfect"]["total_s"], name
    assert pol["naive"]["total_s"] > 1.3 * pol["perfect"]["total_s"]


def test_system_files(tmp_path):
    prof = tmp_path / "sys.toml"
    prof.write_text('[pfs]\nread_MBps = { "1" = 100.0, "4" = 300.0 }\n'
                    '[ram]\ncopy_MBps = { "1" = 5000.0 }\n[rma]\nget_MBps = { "2" = 900.0 }\n'
                    '[tiers]\nram_bytes = "1GiB"\nstaging_threads = 2\n')
    with pytest.raises(ProfileError, match="no compute throughput"):
        simulate(str(prof), "mnist", workers=2, epochs=1, scale=0.01)
    from forebay.sim import load_system

    s = load_system(prof, compute_MBps=500)
    assert (s.compute_MBps, s.network_MBps, s.ram_bytes, s.staging_threads) == \
        (500, 900.0, 1 << 30, 2)
    prof.write_text(prof.read_text() + '[compute]\nMBps = 250.0\npreprocess_MBps = 800.0\n')
    rep = simulate(str(prof), "mnist", workers=2, epochs=1, scale=0.01, policies=["staging"])
    assert rep["system"]["compute_MBps"] == 250.0 and rep["system"]["pfs_open_ms"] == 0.0
    prof.write_text(prof.read_text().replace("[pfs]\n", "[pfs]\nopen_ms = 1.5\n"))
    assert load_system(prof).pfs_open_ms == 1.5
    assert load_system(prof, pfs_open_ms=0.2).pfs_open_ms == 0.2
    dense = prof.read_text().replace("[pfs]\n", '[pfs]\ndense_MBps = { "1" = 125.0 }\n'
                                     'read_fraction = 0.2\n')
    prof.write_text(dense)
    s = load_system(prof)
    assert (dict(s.pfs_dense_MBps), s.pfs_read_fraction) == ({1: 125.0}, 0.2)
    assert s.pfs_record_cost(1.0) == pytest.approx(0.8)
    prof.write_text(dense.replace("read_fraction = 0.2\n", ""))
    with pytest.raises(ProfileError, match="dense_MBps needs read_fraction"):
        load_system(prof)
    prof.write_text("[compute]\nMBps = -3\n")
    with pytest.raises(ProfileError, match="positive number"):
        load_system(prof)


def test_simulate_cli_json_and_errors(cli, tmp_path, capsys):
    out = tmp_path / "r.json"
    code, text, err = cli("simulate", "--dataset", "mnist", "--workers", "2", "--epochs", "2",
                          "--scale", "0.05", "--json", out, "--plot", tmp_path / "r.png")
    assert code == 0, err
    assert "naive" in text and "forebay-clairvoyant" in text
    res = json.loads(out.read_text())
    assert list(res["policies"]) == CONTRACT
    for v in res["policies"].values():
        assert {"total_s", "stall_s", "by_source"} <= set(v)
        if not v["failed"]:
            assert v["total_s"] > 0 and set(v["by_source"]) >= {"pfs", "ram"}
    assert (tmp_path / "r.png").stat().st_size > 0
    code, _, err = cli("simulate", "--dataset", "mnist", "--workers", "2", "--epochs", "1",
                       "--policies", "magic")
    assert code == 2 and "unknown policy 'magic'" in err
    code, _, err = cli("simulate", "--dataset", "nowhere", "--workers", "2", "--epochs", "1")
    assert code == 2 and "neither a scenario" in err
    for bad in (["--batch", "0"], ["--workers", "0"]):   # refused by the argument parser
        args = ["--dataset", "mnist", "--workers", "2", "--epochs", "1"] + bad
        with pytest.raises(SystemExit) as e:
            cli("simulate", *args)
        assert e.value.code == 2
        assert f"argument {bad[0]}: must be a positive integer" in capsys.readouterr().err


def test_simulate_real_dataset_and_sweep(cli, packed, tmp_path):
    code, text, err = cli("simulate", "--dataset", packed[0], "--workers", "2", "--epochs", "2",
                          "--batch", "4", "--policies", "staging,forebay-clairvoyant")
    assert code == 0, err
    assert f"{len(packed[1]):,} samples" in text
    out = tmp_path / "s.json"
    code, text, err = cli("simulate", "sweep", "--dataset", "imagenet-1k", "--workers", "2",
                          "--epochs", "2", "--scale", "0.001", "--ram", "0,60GB",
                          "--ssd", "0,450GB,900GB", "--compute-MBps", "2000", "--json", out)
    assert code == 0, err
    res = json.loads(out.read_text())
    grid = np.array(res["total_s"])
    assert grid.shape == (2, 3)
    # caching helps: with no RAM and no SSD every epoch streams from the PFS
    assert grid[0, 0] > grid[1, 2]


def test_open_latency_is_paid_per_file_read_from_the_pfs():
    """A file per sample: every PFS read pays pfs_open_ms on top of its bytes; a packed
    dataset is opened once.  Naive on the toy system: 8 reads x 0.5 s more on the
    critical path; staging spreads the same 4 s over the prefetch overlap."""
    plan = AccessPlan(num_samples=8, world_size=1, batch_size=2, epochs=1)
    sizes = np.full(8, 10**6)
    sysm = toy(pfs_open_ms=500.0)
    files = simulate_policy("naive", Workload(sizes, plan, sysm, per_file=True))
    packed = simulate_policy("naive", Workload(sizes, plan, sysm, per_file=False))
    assert packed["total_s"] == pytest.approx(20.0)              # as without latency
    assert files["total_s"] == pytest.approx(24.0)               # 4 x (3 + 1 + 2)
    assert files["by_source"]["pfs"] == pytest.approx(12.0)
    st = simulate_policy("staging", Workload(sizes, plan, sysm, per_file=True))
    assert st["total_s"] == pytest.approx(4 * 4.0 + 2.0)         # delivery-bound: 4 s/batch
    # cached policies pay it only for what they still read from the PFS
    cached = toy(pfs_open_ms=500.0, ram_bytes=10**9)
    plan3 = AccessPlan(num_samples=8, world_size=1, batch_size=2, epochs=3)
    for name in ("nopfs", "forebay-clairvoyant"):
        a = simulate_policy(name, Workload(sizes, plan3, cached, per_file=True))
        b = simulate_policy(name, Workload(sizes, plan3, cached, per_file=False))
        assert a["fetches"]["pfs"] == 8 and b["fetches"]["pfs"] == 8
        assert a["by_source"]["pfs"] - b["by_source"]["pfs"] == pytest.approx(8 * 0.5)
    with pytest.raises(ProfileError, match="pfs_open_ms"):
        toy(pfs_open_ms=-1.0)


def test_simulate_layout_option(cli, tmp_path):
    code, out, _ = cli("simulate", "--dataset", "mnist", "--workers", "2", "--epochs", "1",
                       "--policies", "naive", "--scale", "0.01", "--pfs-open-ms", "2",
                       "--json", str(tmp_path / "f.json"))
    assert code == 0 and "a file per sample, 2 ms per open" in out
    code, _, _ = cli("simulate", "--dataset", "mnist", "--workers", "2", "--epochs", "1",
                     "--policies", "naive", "--scale", "0.01", "--pfs-open-ms", "2",
                     "--layout", "packed", "--json", str(tmp_path / "p.json"))
    f = json.loads((tmp_path / "f.json").read_text())
    p = json.loads((tmp_path / "p.json").read_text())
    assert f["workload"]["layout"] == "files" and p["workload"]["layout"] == "packed"
    extra = f["policies"]["naive"]["total_s"] - p["policies"]["naive"]["total_s"]
    reads = f["policies"]["naive"]["fetches"]["pfs"] / 2          # per worker, serial
    # (gamma shifts a little: an open keeps a worker's read in flight longer)
    assert extra == pytest.approx(reads * 0.002, rel=1e-3)


# -- fidelity: the HDMLP thesis' tables (Boehringer 2020, §5.2) ----------------------

THESIS_5_1 = {"perfect": 7.30, "naive": 27.78, "nopfs": 7.78, "staging": 10.24,
              "deepio": 8.41, "deepio-opportunistic": 8.40, "parallel-staging": 10.11,
              "lbann": 7.71, "lbann-preload": 8.41, "locality-aware": 8.41}


def thesis_run(mean: float, sd: float, count: int, epochs: int, scale: float = 1.0):
    """A scenario of the thesis: its system, 4 nodes, global batch 100; RAM and SSD
    scaled with the sample count (the same case, fewer samples)."""
    return simulate("hdmlp-thesis", f"normal:{mean},{sd},{count}", workers=4, epochs=epochs,
                    batch=25, scale=scale, seed=42)["policies"]


def test_thesis_table_5_1_every_row_within_5_percent():
    pol = thesis_run(0.027, 0.01, 10_000, 10)
    for name, published in THESIS_5_1.items():
        assert pol[name]["total_s"] == pytest.approx(published, rel=0.05), name


def test_thesis_tables_5_2_and_5_3_rankings():
    # Table 5.2 (150 GB, fits one node's storage): HDMLP first, LBANN dynamic next,
    # then DeepIO, LBANN preloading and locality-aware tied (their set-up is the same
    # bucket load), then parallel staging, staging and naive
    p = thesis_run(1.0, 0.1, 150_000, 10, scale=0.01)
    t = {k: v["total_s"] for k, v in p.items()}
    assert t["perfect"] <= t["nopfs"] < t["lbann"] < t["deepio"]
    assert t["deepio"] == pytest.approx(t["lbann-preload"], rel=1e-3)
    assert t["deepio"] == pytest.approx(t["locality-aware"], rel=1e-3)
    assert t["deepio"] < t["parallel-staging"] < t["staging"] < t["naive"]
    assert t["nopfs"] == pytest.approx(t["perfect"], rel=0.02)     # thesis: 0.3% above
    # Table 5.3 (600 GB, fits only the aggregate): LBANN cannot run; DeepIO ordered reads
    # most samples from the PFS synchronously, far behind; opportunistic ordering helps
    p = thesis_run(2.0, 0.2, 300_000, 5, scale=0.01)
    t = {k: v["total_s"] for k, v in p.items() if not v["failed"]}
    assert p["lbann"]["failed"] and p["lbann-preload"]["failed"]
    assert t["nopfs"] < t["deepio-opportunistic"] < t["parallel-staging"] < t["staging"] \
        < t["deepio"] < t["naive"]
    assert t["nopfs"] == pytest.approx(t["perfect"], rel=0.02)     # thesis: 0.1% above
    assert t["deepio"] / t["perfect"] == pytest.approx(23_948.24 / 7_655.25, rel=0.05)


def test_thesis_table_5_4_ranking():
    # Table 5.4 (1.2 TB, twice the aggregate storage): as published, except NoPFS and
    # DeepIO opportunistic (1.105x and 1.055x the bound there), which forebay's model
    # puts within 1% of each other in the other order (docs/sim.md)
    p = thesis_run(3.0, 0.2, 400_000, 5, scale=0.01)
    t = {k: v["total_s"] for k, v in p.items() if not v["failed"]}
    assert p["lbann"]["failed"] and p["lbann-preload"]["failed"]
    assert max(t["nopfs"], t["deepio-opportunistic"]) < t["parallel-staging"] \
        < t["locality-aware"] < t["staging"] < t["deepio"] < t["naive"]
    # parallel staging trains on what it staged: set-up, then no PFS read
    assert t["parallel-staging"] / t["perfect"] == pytest.approx(16_861.82 / 15_204.78,
                                                                 rel=0.05)


def test_active_readers_against_every_worker_reading():
    # one worker: gamma is 1 either way
    w1 = one_worker(toy())
    assert simulate_policy("naive", w1)["total_s"] == pytest.approx(
        simulate_policy("naive", one_worker(toy(pfs_readers="all")))["total_s"])
    # four workers alternating reads with compute share the PFS with fewer than 4
    # readers on average: faster than the worst case, slower than a lone reader
    sysm = toy(pfs_MBps={1: 1.0, 4: 2.0})
    plan = AccessPlan(num_samples=64, world_size=4, batch_size=2, epochs=1)
    act = simulate_policy("naive", Workload(np.full(64, 10**6), plan, sysm))
    worst = simulate_policy("naive", Workload(np.full(64, 10**6), plan,
                                              replace(sysm, pfs_readers="all")))
    assert act["total_s"] < worst["total_s"]
    assert 1.0 < act["mean_pfs_readers"] < 4.0 and worst["mean_pfs_readers"] == 4.0
    # the worst case is the closed form: 8 steps x (2 x (2 s fetch + 0.5 s write) + 2 s)
    assert worst["total_s"] == pytest.approx(8 * (2 * 2.5 + 2))


@pytest.mark.parametrize("model", ["conserving", "thesis"])
def test_a_worker_filling_its_tiers_counts_as_a_pfs_reader(model):
    """NoPFS's fill threads read the PFS from time 0; the thesis' simulator counts a
    node whose fill is reading among the PFS clients of the others' demand reads."""
    from forebay.sim._engine import F_PFS, F_RAM
    from forebay.sim._run import prefetching as _prefetching

    plan = AccessPlan(num_samples=16, world_size=2, batch_size=2, epochs=1)
    w = Workload(np.full(16, 10**6), plan, toy(pfs_MBps={1: 1.0, 2: 1.0}, model=model))
    runs = []
    for fill_until in (0.0, 1e6):
        run = _prefetching(w)
        for i in range(2):     # worker 0 reads the PFS, worker 1 only its own RAM
            ids = w.batches(i, 0)
            run.add(i, 0, ids, np.full(ids.shape, F_PFS if i == 0 else F_RAM))
        run.fill_until = np.array([0.0, fill_until])          # the thesis' rule
        # conserving: a fill of worker 1, one thread, reading more than the run lasts
        run.fills = [(1, 1e6, 1e6, 1, 0.0, 1e6)] if fill_until else []
        runs.append(run.finish())
    alone, shared = runs
    assert alone["mean_pfs_readers"] == pytest.approx(1.0, abs=1e-3)   # a fixed point
    if model == "thesis":            # whole workers
        assert shared["mean_pfs_readers"] == pytest.approx(2.0, abs=1e-3)
    else:                            # threads on the PFS: worker 0's spends 1/3 writing
        assert 1.5 < shared["mean_pfs_readers"] < 2.0
    assert shared["total_s"] > alone["total_s"]


def test_nopfs_builds_each_workers_placement_once(monkeypatch):
    """Issue N item 5: the placement (a walk of the worker's whole stream) was built
    once for the copy counts and again in every fixed-point iteration."""
    calls = []
    real = AccessPlan.frequencies

    def counted(self, rank):
        calls.append(rank)
        return real(self, rank)

    monkeypatch.setattr(AccessPlan, "frequencies", counted)
    sizes = np.random.default_rng(2).integers(50_000, 150_000, 3_000)
    plan = AccessPlan(3_000, 4, 16, 3, seed=1)
    sysm = replace(lassen(), compute_MBps=2_000.0, ram_bytes=int(sizes.sum() * 0.1),
                   ssd_bytes=int(sizes.sum() * 0.1))
    r = simulate_policy("nopfs", Workload(sizes, plan, sysm))
    assert r["failed"] is None
    assert sorted(calls) == [0, 1, 2, 3]


def test_b_fs_caps_one_client():
    # t(1) = 1 MB/s but the client's link carries 0.5 MB/s: a fetch takes 2 s
    capped = simulate_policy("naive", one_worker(toy(pfs_client_MBps=0.5)))
    assert capped["total_s"] == pytest.approx(4 * (2 * 2.5 + 2))


def test_deepio_uncached_samples_are_read_when_needed():
    # no RAM: DeepIO caches nothing, and reads every sample synchronously, so its
    # prefetching buys nothing: the naive timeline (staging would overlap reads)
    w = one_worker(toy(staging_threads=2))
    assert simulate_policy("deepio", w)["total_s"] == pytest.approx(
        simulate_policy("naive", one_worker(toy()))["total_s"])
    assert simulate_policy("deepio", w)["total_s"] > simulate_policy("staging", w)["total_s"]
    # opportunistic ordering replaces them with cached samples: with RAM for half the
    # dataset it never touches the PFS
    half = one_worker(toy(ram_bytes=4 * 10**6))
    opp = simulate_policy("deepio-opportunistic", half)
    assert opp["fetches"]["pfs"] == 0 and opp["setup_s"] == pytest.approx(4 * 1.5)


def test_normal_datasets():
    from forebay.sim import dataset_sizes
    from forebay.errors import ForebayError

    sizes, spec = dataset_sizes("normal:1,0.2,2000", seed=1)
    assert spec is None and len(sizes) == 2000 and sizes.min() > 0
    assert abs(sizes.mean() / 1e6 - 1) < 0.02
    assert dataset_sizes("normal:0.5,0.4,2000")[0].min() > 0    # truncated at 0
    again, _ = dataset_sizes("normal:1,0.2,2000", seed=1)
    assert np.array_equal(sizes, again)
    assert len(dataset_sizes("normal:1,0,1000", scale=0.1)[0]) == 100
    for bad in ("normal:1,2", "normal:x,1,10", "normal:-1,1,10", "normal:1,1,0"):
        with pytest.raises(ForebayError, match="normal:"):
            dataset_sizes(bad)


def test_docs_system_file_example_loads(tmp_path):
    import re
    from pathlib import Path

    from forebay.sim import load_system

    doc = (Path(__file__).parent.parent / "docs" / "sim.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", doc, re.S)
    assert blocks
    for k, block in enumerate(blocks):
        (tmp_path / f"s{k}.toml").write_text(block)
        sysm = load_system(tmp_path / f"s{k}.toml")
        assert sysm.pfs_open_ms >= 0


def test_model_choices_in_system_files(tmp_path):
    from forebay.sim import load_system

    base = ('[compute]\nMBps = 100.0\n[pfs]\nread_MBps = { "1" = 100.0 }\nclient_MBps = 50.0\n'
            '[ram]\ncopy_MBps = { "1" = 5000.0 }\n')
    f = tmp_path / "m.toml"
    f.write_text(base + '[model]\nmodel = "thesis"\npfs_readers = "all"\n'
                 'tier_reads = "per-read"\n')
    sysm = load_system(f)
    assert (sysm.model, sysm.pfs_readers, sysm.tier_reads, sysm.pfs_client_MBps) == \
        ("thesis", "all", "per-read", 50)
    assert not sysm.conserving
    f.write_text(base)
    assert load_system(f).model == "conserving"                 # the default
    # a tier read that gets the whole table is the thesis' rule only
    f.write_text(base + '[model]\ntier_reads = "per-read"\n')
    with pytest.raises(ProfileError, match="tier_reads.*thesis"):
        load_system(f)
    f.write_text(base + '[model]\npfs_readers = "threads"\n')
    with pytest.raises(ProfileError, match="pfs_readers"):
        load_system(f)
    f.write_text(base + '[model]\nmodel = "fast"\n')
    with pytest.raises(ProfileError, match="model must be one of conserving, thesis"):
        load_system(f)


def test_plots_keep_failed_policies_and_say_scale_compute_and_unit(tmp_path):
    """simulate.png's title names the scale and the compute rate; a failed policy keeps
    its row and a failed sweep cell its place; the axis and colour bar use the unit the
    table prints (fig8 drew 50,000 s where the table said hours)."""
    pytest.importorskip("matplotlib")
    from forebay.sim._report import _title, _unit, plot_policies, plot_sweep

    res = simulate("lassen", "mnist", workers=2, epochs=1, scale=0.05,
                   policies=["naive", "staging", "nopfs"])
    res["policies"]["staging"]["failed"] = "does not fit"
    t = _title(res)
    assert "scale 0.05" in t and "compute" in t and "MB/s" in t, t
    plot_policies(res, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
    assert _unit(50_000) == ("h", 3600.0) and _unit(90) == ("min", 60.0)
    plot_sweep({"policy": "nopfs", "ram_bytes": [0, 1 << 30], "ssd_bytes": [0, 1 << 33],
                "total_s": [[50_000, None], [9_000, 3_900]]}, str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").stat().st_size > 0


def test_a_profile_without_tiers_is_said_and_ram_ssd_override_it(tmp_path, cli):
    """A `forebay calibrate` profile has no [tiers]: simulate says the caching policies
    get nothing to cache in (it used to cache nothing silently), and --ram/--ssd give
    them capacity."""
    prof = tmp_path / "sys.toml"
    prof.write_text('[pfs]\nread_MBps = { "1" = 100.0, "4" = 300.0 }\n'
                    '[ram]\ncopy_MBps = { "1" = 5000.0 }\n[compute]\nMBps = 500.0\n')
    args = ("simulate", "--system", prof, "--dataset", "mnist", "--workers", "2",
            "--epochs", "2", "--scale", "0.05", "--policies", "naive,nopfs")
    code, out0, err = cli(*args, "--json", tmp_path / "a.json")
    assert code == 0 and "has no [tiers]" in err and "--ram" in err, err
    code, out1, err = cli(*args, "--ram", "1GB", "--json", tmp_path / "b.json")
    assert code == 0 and "[tiers]" not in err, err
    a, b = (json.loads((tmp_path / f).read_text())["policies"]["nopfs"]
            for f in ("a.json", "b.json"))
    assert b["by_source"]["ram"] > 0 == a["by_source"]["ram"]
    code, _, err = cli(*args, "--ram", "1GB,2GB")
    assert code == 2 and "one size" in err


def test_plan_finds_the_smallest_capacity_reaching_a_target_au(cli):
    """`simulate plan --target-au`: the capacity it names reaches the target in the
    simulator and 2% of the dataset less does not; a target the workload reaches with
    nothing cached answers 0; one that no capacity reaches says so with the best AU."""
    from dataclasses import replace

    from forebay.sim import lassen, plan_capacity

    kw = dict(workers=4, epochs=5, scale=0.01)
    sysm = replace(lassen(), compute_MBps=1000.0)
    res = plan_capacity(sysm, "imagenet-1k", target_au=0.9, **kw)
    full = res["dataset_bytes"]
    for o in res["options"]:
        assert o["reached"] and 0 < o["bytes"] < full and o["accelerator_utilization"] >= 0.9
        less = {"ram_bytes": 0, "ssd_bytes": 0, f"{o['tier']}_bytes": o["bytes"] - full // 50}
        r = simulate(replace(sysm, **less), "imagenet-1k", policies=["forebay-clairvoyant"],
                     **kw)["policies"]["forebay-clairvoyant"]
        assert r["accelerator_utilization"] < 0.9, (o, r["accelerator_utilization"])
    easy = plan_capacity(replace(sysm, compute_MBps=500.0), "imagenet-1k", target_au=0.9,
                         tiers=["ram"], **kw)
    assert easy["options"][0]["bytes"] == 0 and easy["options"][0]["reached"]
    hard = plan_capacity(replace(sysm, compute_MBps=10_000.0), "imagenet-1k",
                         target_au=0.9, tiers=["ram"], **kw)
    assert not hard["options"][0]["reached"] and hard["options"][0]["bytes"] == full
    code, out, err = cli("simulate", "plan", "--target-au", "0.9", "--dataset", "imagenet-1k",
                         "--workers", "4", "--epochs", "5", "--scale", "0.01",
                         "--compute-MBps", "1000")
    assert code == 0 and "RAM" in out and "SSD" in out and "AU 9" in out, (out, err)
    code, _, err = cli("simulate", "plan", "--dataset", "mnist", "--workers", "2",
                       "--epochs", "1")
    assert code == 2 and "--target-au" in err


def test_plan_never_reaches_what_the_file_system_cannot_feed(cli):
    """Issue R: ImageNet-1k on 4 Lassen workers at 1,000 MB/s of compute each needs
    4 GB/s; the profile's file system gives at most 2.87 GB/s.  Nothing cached cannot
    reach AU 0.9 (it was answered 0 B at 99.8%), and 99% is out of reach at any
    capacity: the answer names the PFS's bandwidth and the best AU."""
    from dataclasses import replace

    from forebay.sim import lassen, plan_capacity

    kw = dict(workers=4, epochs=3, scale=0.005)
    sysm = replace(lassen(), compute_MBps=1000.0)
    none = simulate(replace(sysm, ram_bytes=0, ssd_bytes=0), "imagenet-1k",
                    policies=["forebay-clairvoyant"], **kw)["policies"]["forebay-clairvoyant"]
    assert none["binding"] == "PFS bandwidth"      # 4 GB/s wanted, 2.87 GB/s at most
    assert none["accelerator_utilization"] <= none["au_bound"] * 1.001 < 0.9
    assert none["pfs_MBps_mean"] <= 2870 * 1.001
    res = plan_capacity(sysm, "imagenet-1k", target_au=0.99, tiers=["ram"], **kw)
    o = res["options"][0]
    assert not o["reached"] and o["binding"] == "PFS bandwidth"
    assert o["accelerator_utilization"] <= o["au_bound"] * 1.001
    code, out, err = cli("simulate", "plan", "--target-au", "0.99", "--dataset", "imagenet-1k",
                         "--workers", "4", "--epochs", "3", "--scale", "0.005",
                         "--compute-MBps", "1000")
    assert code == 0 and "not reachable" in out and "bound by PFS bandwidth" in out, out
    assert "2,870 MB/s" in out, out


@pytest.mark.parametrize("workers", [4, 1024])
def test_no_policy_draws_more_from_the_file_system_than_it_has(workers):
    """Issue R: with 8 prefetch threads per worker, the thesis' rule let Staging pull
    23.5 GB/s at 1,024 Lassen workers from a file system whose table tops at 2.87 GB/s.
    The conserving model: every policy's PFS bytes over its run time, and the least
    time those bytes need, stay within the table's largest rate."""
    # 1,024 workers: batches of 8 keep a step's 8,192 samples within the 0.7% scale's
    # 8,968
    kw = dict(scale=0.002) if workers == 4 else dict(scale=0.007, batch=8)
    rep = simulate("lassen", "imagenet-1k", workers=workers, epochs=1, progress=False, **kw)
    top = max(lassen().pfs_MBps.values())
    for name, r in rep["policies"].items():
        if r["failed"] or name == "perfect":
            continue
        assert r["pfs_MB"] / r["total_s"] <= top * 1.001, (name, r["pfs_MB"] / r["total_s"])
        assert r["total_s"] >= r["need_s"]["PFS bandwidth"] * 0.999, name
        # the least time is a lower bound of the run it describes
        assert r["total_s"] >= r["compute_s"] / r["au_bound"] * 0.999, name
    if workers == 4:
        return
    # the thesis' rule, on the same run, does draw more (what the issue found)
    thesis = simulate(replace(lassen(), model="thesis"), "imagenet-1k", workers=workers,
                      epochs=1, policies=["staging"], progress=False,
                      **kw)["policies"]["staging"]
    assert thesis["pfs_MB"] / thesis["total_s"] > top * 1.5


def test_the_least_time_never_exceeds_the_run_with_background_fills():
    """NoPFS's fills read the PFS while the epochs run: counted in epoch 0's need, the
    least time came out above the run itself (5.5 s for a 3.9 s run)."""
    sysm = replace(hdmlp_thesis(), compute_MBps=400.0, model="conserving",
                   tier_reads="shared")
    r = simulate(sysm, "normal:0.027,0.01,2000", workers=4, epochs=10, batch=25,
                 seed=42, policies=["nopfs"], progress=False)["policies"]["nopfs"]
    assert r["pfs_MB"] > r["need_s"]["compute"]               # it does read the PFS
    least = r["compute_s"] / r["au_bound"]
    assert least <= r["total_s"] * 1.001, (least, r["total_s"])
    assert least >= r["pfs_MB"] / max(sysm.pfs_MBps.values()) * 0.999


def test_simulate_cli_refuses_what_it_would_drop_or_misread(cli):
    """Issue R item 5: --policies with several names in sweep/plan used the first and
    dropped the rest; --target-au outside plan was ignored; an unknown --system
    answered "No such file" instead of naming the presets."""
    base = ["--dataset", "mnist", "--workers", "2", "--epochs", "1", "--scale", "0.01"]
    code, out, err = cli("simulate", "plan", "--target-au", "0.9", *base,
                         "--policies", "nopfs,staging")
    assert code == 2 and "takes one policy, got 2" in err, err
    code, out, err = cli("simulate", "sweep", *base, "--ram", "0,1GB", "--ssd", "0",
                         "--policies", "nopfs,staging")
    assert code == 2 and "takes one policy" in err, err
    code, out, err = cli("simulate", "--target-au", "0.9", *base)
    assert code == 2 and "--target-au is for 'simulate plan'" in err, err
    code, out, err = cli("simulate", "--system", "summit", *base)
    assert code == 2 and "lassen, hdmlp-thesis" in err and "summit" in err, err


def test_simulate_refuses_a_dataset_it_cannot_hold(cli, monkeypatch):
    """Issue X item 10: 10^10 samples went on to an ArrayMemoryError traceback."""
    monkeypatch.setenv("FOREBAY_MEMORY_LIMIT", str(1 << 30))
    code, out, err = cli("simulate", "--dataset", "normal:1,0.1,10000000000", "--workers",
                         "100000000", "--epochs", "2")
    assert code == 2 and not out and "Traceback" not in err, err
    assert "10,000,000,000 samples need about 596.0 GiB" in err and "--scale" in err, err


def test_simulate_cli_capacities_threads_and_plot_names(cli, tmp_path):
    """Issue R item 5: "--ram 60" ran as 60 bytes; "--ram 60GB" read back as 55.9 GiB;
    a profile's staging_threads = 0 became 1; "--plot out.jpgx" failed after the whole
    run; "--plot DIR/" wrote a hidden .png."""
    base = ["--dataset", "mnist", "--workers", "2", "--epochs", "1", "--scale", "0.01"]
    code, out, err = cli("simulate", *base, "--ram", "60", "--policies", "staging")
    assert code == 2 and "--ram 60: give a unit" in err, err
    code, out, err = cli("simulate", "sweep", *base, "--ram", "0,60GB", "--ssd", "0,2",
                         "--policies", "nopfs")
    assert code == 2 and "--ssd 2: give a unit" in err, err
    code, out, err = cli("simulate", "sweep", *base, "--ram", "0,60GB", "--ssd", "0",
                         "--policies", "nopfs")
    assert code == 0 and "60.0 GB" in out and "GiB" not in out, out
    for bad, why in (("out.jpgx", "must end in one of"), (f"{tmp_path}/", "is a folder")):
        code, out, err = cli("simulate", *base, "--policies", "staging", "--plot", bad)
        assert code == 2 and why in err and out == "", (out, err)   # nothing simulated
    assert list(tmp_path.iterdir()) == []
    f = tmp_path / "p.toml"
    f.write_text('[compute]\nMBps = 100.0\n[pfs]\nread_MBps = { "1" = 100.0 }\n'
                 '[ram]\ncopy_MBps = { "1" = 5000.0 }\n[tiers]\nstaging_threads = 0\n')
    code, out, err = cli("simulate", "--system", str(f), *base, "--policies", "staging")
    assert code == 2 and "staging_threads must be >= 1" in err, err
    # more workers than samples per step: said at once, not a padded run of hours
    code, out, err = cli("simulate", "--dataset", "mnist", "--workers", "100000000",
                         "--epochs", "1", "--scale", "0.01")
    assert code == 2 and "need 3,200,000,000 samples per step" in err, err
    assert "Warning" not in err


def test_threads_share_the_nodes_cores():
    """A node's cores (``cpus``) are shared by its prefetch threads, which queue for
    them, and a thread alone gets at most the node.  4 batches of 2 x 1 MB,
    preprocessing 0.5 MB/s: a batch is 2 s of reads and 4 s of CPU."""
    def run(**kw):
        return simulate_policy("staging", one_worker(toy(staging_threads=2,
                                                         preprocess_MBps=0.5, **kw)))

    # a core per thread: (2 + 4) / 2 = 3 s a delivery, 4 x 3 + the last step's 2
    assert run()["total_s"] == pytest.approx(14.0)
    # one core: the two threads' mean value analysis.  One thread: 1 / (2 + 4) a
    # second, 4/6 of it at the core; two: the core's residence 4 (1 + 4/6) = 20/3 s,
    # so 2 / (2 + 20/3) = 3/13 a second, 13/3 s a delivery (not the core's 4 s: the
    # threads' reads do not always overlap the other's CPU)
    one = run(cpus=1.0)
    assert one["total_s"] == pytest.approx(4 * 13 / 3 + 2)
    assert one["binding"] == "node CPU" and one["need_s"]["node CPU"] == pytest.approx(16.0)
    # half a core: 8 s of the node a batch; 1 / (2 + 8), 0.8 at the core; 8 (1 + 0.8)
    # = 14.4 s, 2 / 16.4 a second: 8.2 s a delivery
    assert run(cpus=0.5)["total_s"] == pytest.approx(4 * 8.2 + 2)
    # cores to spare change nothing
    assert run(cpus=8.0)["total_s"] == pytest.approx(14.0)


def _shared_cores_batches_per_s(z: float, d: float, threads: int, cpus: float,
                                draw, batches: int = 20_000) -> float:
    """A discrete-event run of ``threads`` threads, each batch ``draw(z)`` seconds of its
    own then ``draw(d)`` CPU-seconds on ``cpus`` cores shared equally by the threads
    at them (at most one core each): batches a second."""
    own = [draw(z) for _ in range(threads)]          # time left of each thread's span
    cpu = [0.0] * threads                            # CPU left (at the cores when > 0)
    t, done = 0.0, 0
    while done < batches:
        at = [k for k in range(threads) if own[k] <= 0.0]
        rate = min(1.0, cpus / len(at)) if at else 0.0
        dt = min([own[k] for k in range(threads) if own[k] > 0.0]
                 + [cpu[k] / rate for k in at])
        t += dt
        for k in range(threads):
            if own[k] > 0.0:
                own[k] -= dt
                if own[k] <= 1e-12:
                    own[k], cpu[k] = 0.0, draw(d)
            else:
                cpu[k] -= dt * rate
                if cpu[k] <= 1e-12:
                    own[k], done = draw(z), done + 1
    return done / t


@pytest.mark.parametrize("cpus", [0.4, 1.0, 1.5])
def test_threads_queue_for_the_cores_as_a_simulation_of_them_does(cpus):
    """The model's deliveries on a node of ``cpus`` cores against a discrete-event run of
    the same two threads (reads of 2 s, 4 CPU-seconds a batch): equal for spans of
    random length, exponential or uniform (a processor-shared station does not depend
    on the spread of its spans), within the event run's sampling error."""
    sysm = toy(staging_threads=2, preprocess_MBps=0.5, compute_MBps=1e6, cpus=cpus)
    r = simulate_policy("staging", one_worker(sysm, samples=800))
    model = 400 / r["total_s"]                       # batches a second
    rng = np.random.default_rng(0)
    for draw in (rng.exponential, lambda m: rng.uniform(0.0, 2 * m)):
        measured = _shared_cores_batches_per_s(2.0, 4.0, 2, cpus, draw)
        assert model == pytest.approx(measured, rel=0.03), (cpus, model, measured)
    # faster than both bounds, the threads' cycle and the cores, allow (the old rule)
    assert model < 0.99 * min(2 / (2 + 4 / min(1.0, cpus)), cpus / 4)


def test_the_hand_back_is_in_series_with_the_step():
    """``handback_MBps``: the training process takes each batch back from worker
    processes after its delivery and after the step before, on one core (or the
    node's share of one).  One thread: a delivery 3 s, a step 2 s."""
    w = one_worker(toy(handback_MBps=1.0))          # 2 s a batch
    r = simulate_policy("staging", w)
    assert r["total_s"] == pytest.approx(3 + 4 * (2 + 2))
    assert r["compute_s"] == pytest.approx(8.0)                 # not accelerator time
    assert r["binding"] == "hand-back" and r["need_s"]["hand-back"] == pytest.approx(16.0)
    half = simulate_policy("staging", one_worker(toy(handback_MBps=1.0, cpus=0.5,
                                                     preprocess_MBps=1e6)))
    # half a core: 4 s a hand-back, and a delivery (2 s of reads) lasts at least its
    # batch's CPU on the node, the hand-back's included (a mean rate): 4 s (the
    # thread's 2 us of CPU a batch, sharing the core with the hand-back, add 0.1%)
    assert half["total_s"] == pytest.approx(4 + 4 * (4 + 2), rel=2e-3)
    # the hand-back's CPU counts on the node's cores too
    assert half["need_s"]["node CPU"] == pytest.approx(4 * 2 / 0.5, rel=1e-3)


def test_the_hand_back_shares_the_cores_with_the_threads_there():
    """On a node of half a core whose one prefetch thread is always preprocessing
    (reads take no time; 0.5 CPU-s a batch), the training process's hand-back (2
    CPU-s a batch) gets half of that half core: 8 s in series with each 2 s step, and
    the thread's deliveries (at most every 5 s: the node's 2.5 CPU-s a batch) wait
    for it.  Its least need stays 4 s a step (the core alone)."""
    r = simulate_policy("staging", one_worker(toy(handback_MBps=1.0, cpus=0.5,
                                                  preprocess_MBps=4.0,
                                                  pfs_MBps={1: 1e9, 2: 2e9})))
    assert r["total_s"] == pytest.approx(5 + 4 * (8 + 2))
    assert r["need_s"]["hand-back"] == pytest.approx(4 * 2 + 4 * 4)
    assert r["binding"] == "hand-back"


@pytest.mark.parametrize("model", ["conserving", "thesis"])
def test_no_policy_uses_more_cores_than_the_node_has(model):
    """Every policy's preprocessing on nodes of 2 cores with 8 prefetch threads: the
    run lasts at least its CPU seconds over the cores."""
    sysm = replace(lassen(), cpus=2.0, preprocess_MBps=20.0, model=model,
                   tier_reads="shared")
    rep = simulate(sysm, "imagenet-1k", workers=4, epochs=2, scale=0.002, progress=False)
    for name, r in rep["policies"].items():
        if r["failed"] or name == "perfect":
            continue
        assert r["need_s"]["node CPU"] > 0, name
        assert r["total_s"] >= r["need_s"]["node CPU"] * 0.999, name
        # and the least time it reports is no more than the run: each epoch's largest
        # worker, summed, came out above it (a different worker the largest each epoch)
        assert r["compute_s"] / r["au_bound"] <= r["total_s"] * 1.001, name


def test_cores_and_hand_back_in_system_files(tmp_path):
    from forebay.sim import load_system

    base = ('[pfs]\nread_MBps = { "1" = 100.0 }\n[ram]\ncopy_MBps = { "1" = 5000.0 }\n'
            '[compute]\nMBps = 100.0\n')
    f = tmp_path / "c.toml"
    f.write_text(base + 'cpus = 1.5\nhandback_MBps = 240\n')
    sysm = load_system(f)
    assert (sysm.cpus, sysm.handback_MBps) == (1.5, 240.0)
    assert sysm.describe()["cpus"] == 1.5
    f.write_text(base)
    assert (load_system(f).cpus, load_system(f).handback_MBps) == (None, None)
    for bad, says in (("cpus = 0", r"cpus = 0: must be a positive number"),
                      ('cpus = "two"', r"cpus = 'two': must be a positive number"),
                      ("handback_MBps = -1", r"handback_MBps = -1: must be a positive")):
        f.write_text(base + bad + "\n")
        with pytest.raises(ProfileError, match=says):
            load_system(f)
    with pytest.raises(ProfileError, match="cpus must be positive"):
        toy(cpus=0.0)


def test_simulate_cli_cpus_names_the_node_cpu_as_the_bound(cli, tmp_path):
    """``--cpus``: Lassen's 8 prefetch threads on nodes of one core, preprocessing at
    20 MB/s a core: the node's CPU, not the file system, bounds staging."""
    args = ["simulate", "--dataset", "imagenet-1k", "--workers", "4", "--epochs", "1",
            "--scale", "0.002", "--policies", "staging", "--preprocess-MBps", "20"]
    code, _, err = cli(*args, "--json", tmp_path / "free.json")
    assert code == 0, err
    code, text, err = cli(*args, "--cpus", "1", "--json", tmp_path / "one.json")
    assert code == 0, err
    free, one = (json.loads((tmp_path / f"{k}.json").read_text())["policies"]["staging"]
                 for k in ("free", "one"))
    assert free["binding"] != "node CPU" and one["binding"] == "node CPU"
    assert one["total_s"] >= one["need_s"]["node CPU"] > free["total_s"]
    assert "node CPU" in text
    # plan says why a target is out of reach on such nodes, and with what
    code, text, err = cli("simulate", "plan", "--target-au", "0.9", "--dataset", "imagenet-1k",
                          "--workers", "4", "--epochs", "2", "--scale", "0.002",
                          "--policies", "staging", "--preprocess-MBps", "20", "--cpus", "2")
    assert code == 0, err
    assert "not reachable" in text and "bound by node CPU (" in text, text
    assert "CPU-seconds of preprocessing a node, on 2 cores" in text, text


def test_a_node_reading_every_record_reads_at_the_dense_rate():
    """A record's request brings in parts of its neighbours (issue R): with calibrate's
    two tables, a worker that reads every record each epoch reads at the dense rate,
    one that reads the calibration's share at the random-read table's, fewer still
    slower; samples stored as files of their own, or a system without the dense
    table, read at the table's rate whatever their share."""
    sysm = toy(pfs_MBps={1: 40.0}, pfs_dense_MBps={1: 50.0}, pfs_read_fraction=0.5,
               compute_MBps=1e7, preprocess_MBps=1e7)
    assert sysm.pfs_record_cost(0.5) == pytest.approx(1.0)
    assert sysm.pfs_record_cost(1.0) == pytest.approx(0.8)
    assert sysm.pfs_record_cost(0.0) == pytest.approx(1.2)
    assert sysm.pfs_top_MBps == 50.0
    plain = replace(sysm, pfs_dense_MBps={}, pfs_read_fraction=0.0)
    assert plain.pfs_record_cost(0.1) == pytest.approx(1.0)
    with pytest.raises(ProfileError, match="dense_MBps needs read_fraction"):
        replace(sysm, pfs_read_fraction=1.0)
    sizes = np.full(400, 10**6)

    def run(system: System, world: int, per_file: bool = False) -> float:
        plan = AccessPlan(num_samples=400, world_size=world, batch_size=4, epochs=2)
        res = simulate_policy("naive", Workload(sizes, plan, system, per_file=per_file))
        return res["total_s"]
    # one worker reads every record: 800 MB at 50 MB/s; at 40 without the dense table
    assert run(sysm, 1) == pytest.approx(800 / 50, rel=0.01)
    assert run(plain, 1) == pytest.approx(800 / 40, rel=0.01)
    assert run(sysm, 1, per_file=True) == pytest.approx(800 / 40, rel=0.01)
    # four workers read a quarter each: above the calibration's share, 1.1 x the table
    assert run(sysm, 4) == pytest.approx(1.1 * run(plain, 4), rel=0.01)

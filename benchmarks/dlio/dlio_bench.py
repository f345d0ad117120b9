"""DLIO's own metrics for forebay's shipped DLIO workloads (issue K), side by side in one
run: DLIO's stock pytorch loader, forebay preload and clairvoyant through the
``forebay.dlio`` plug-in, and a no-I/O loader (the same batch every step) as the
ceiling.  Page cache evicted before every run (the generated files and the packed
dataset); contenders interleaved in rotating order, repeated.

DLIO needs its own environment (PyPI's dlio-benchmark 2.0.0 imports tensorflow at
start-up and pins CUDA packages), built outside this repository, e.g.::

    python -m venv /tmp/dliovenv
    /tmp/dliovenv/bin/pip install torch==2.13.0 tensorflow-cpu pydftracer==1.0.2 \\
        hydra-core omegaconf pandas psutil pyyaml h5py mpi4py mpich Pillow xxhash tqdm
    /tmp/dliovenv/bin/pip install --no-deps dlio-benchmark==2.0.0
    python benchmarks/dlio/dlio_bench.py --python /tmp/dliovenv/bin/python --reps 3

forebay is imported from this checkout (PYTHONPATH).  The packed dataset is made once,
before the timed runs (as DLIO's data generation is); the table gives each run's wall
time too, which includes forebay's preload or DLIO's worker start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _common
from _common import evict, files_under, machine  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
CONTENDERS = {
    "DLIO pytorch loader": ["~workload.reader.data_loader_classname",
                            "~workload.reader.data_loader_sampler"],
    "forebay preload": ["++workload.reader.data_loader_classname=forebay.dlio.ForebayPreload"],
    "forebay clairvoyant": ["++workload.reader.data_loader_classname="
                            "forebay.dlio.ForebayClairvoyant"],
    "no-I/O ceiling": ["++workload.reader.data_loader_classname=noio_loader.NoIOLoader"],
}
AU = re.compile(r"Epoch (\d+) - Block \d+ \[Training\] Accelerator Utilization \[AU\] \(%\): "
                r"([\d.]+)")
TOTAL = re.compile(r"\[METRIC\] Training Throughput \(samples/second\): ([\d.]+)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", required=True, help="a Python with dlio_benchmark")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/forebay-dlio"))
    p.add_argument("--workloads", default="forebay_mummi,forebay_unet3d,forebay_resnet50,"
                                          "forebay_cosmoflow")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    bindir = Path(a.python).parent
    cfg = HERE.parents[1] / "src" / "forebay" / "dlio_workloads"
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{HERE}", OMP_NUM_THREADS="1",
               PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    env.pop("FOREBAY_TRACE", None)
    a.workdir.mkdir(parents=True, exist_ok=True)
    base = [str(bindir / "mpiexec"), "-n", str(a.ranks), str(bindir / "dlio_benchmark"),
            f"--config-dir={cfg}"]
    runs: dict[tuple[str, str], list[dict]] = {}
    for wl in a.workloads.split(","):
        data = a.workdir / "data" / wl
        if not (data / "train").exists():
            subprocess.run(base + [f"workload={wl}", "++workload.workflow.generate_data=True",
                                   "++workload.workflow.train=False"], cwd=a.workdir, env=env,
                           check=True, capture_output=True)
        # pack once, untimed (as DLIO's generation): one forebay run of one step
        subprocess.run(base + [f"workload={wl}", "++workload.train.epochs=1",
                               "++workload.train.total_training_steps=1"]
                       + CONTENDERS["forebay preload"], cwd=a.workdir, env=env, check=True,
                       capture_output=True)
        names = list(CONTENDERS)
        for rep in range(a.reps):
            for c in names[rep % len(names):] + names[:rep % len(names)]:
                evict(files_under(data))
                t0 = time.perf_counter()
                proc = subprocess.run(base + [f"workload={wl}"] + CONTENDERS[c], cwd=a.workdir,
                                      env=env, capture_output=True, text=True, timeout=3600)
                wall = time.perf_counter() - t0
                out = proc.stdout + proc.stderr
                if proc.returncode != 0:
                    sys.exit(f"{wl} {c} failed:\n{out[-3000:]}")
                au = {}
                for e, v in AU.findall(out):
                    au.setdefault(int(e), []).append(float(v))
                per_epoch = [statistics.mean(au[e]) for e in sorted(au)]
                thr = [float(x) for x in TOTAL.findall(out)]
                r = {"au_epoch": per_epoch, "throughput": thr[0] if thr else None,
                     "wall_s": wall}
                runs.setdefault((wl, c), []).append(r)
                print(f"{wl:<18} rep {rep} {c:<22} AU by epoch "
                      f"{' '.join(f'{x:5.1f}' for x in per_epoch)}  "
                      f"{r['throughput']:.0f} samples/s  wall {wall:.1f} s", flush=True)
    print(f"\nmachine: {machine()}; {a.ranks} ranks; {a.reps} interleaved repetitions; page "
          f"cache evicted before each run; medians over repetitions (min in brackets)")
    print("\n| workload | loader | AU epoch 1 % | AU later epochs % | samples/s | wall s |"
          "\n|---|---|---:|---:|---:|---:|")
    for wl in a.workloads.split(","):
        for c in CONTENDERS:
            rs = runs[(wl, c)]
            e1 = [r["au_epoch"][0] for r in rs]
            later = [statistics.mean(r["au_epoch"][1:]) for r in rs if len(r["au_epoch"]) > 1]
            thr = [r["throughput"] for r in rs]
            wall = [r["wall_s"] for r in rs]
            print(f"| {wl} | {c} | {statistics.median(e1):.1f} ({min(e1):.1f}) | "
                  f"{statistics.median(later):.1f} ({min(later):.1f}) | "
                  f"{statistics.median(thr):,.0f} | {statistics.median(wall):.1f} |")
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(), "runs": {
            f"{k[0]} | {k[1]}": v for k, v in runs.items()}}, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The forebay demo on built-in synthetic data (run through `make demo`).
set -euo pipefail
OUT=${1:-.demo}
mkdir -p "$OUT"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "1. synthesize DDStore's Ising set as per-sample pickles (PFF): 2,000 graphs"
forebay synth ising "$OUT/ising-pff" --samples 2000 --seed 0 --overwrite

step "2. ingest it into a packed, checksummed forebay dataset"
forebay ingest "$OUT/ising-pff" "$OUT/ising.fb" --from pickle --trust-pickle --overwrite

step "3. what is in it"
forebay info "$OUT/ising.fb"

step "4. verify every checksum"
forebay verify "$OUT/ising.fb"

step "5. random-access read benchmark: PFF pickles vs HDF5 vs MuMMI NPZ vs packed"
python benchmarks/format/format_bench.py --out "$OUT/bench" --samples 5000 --reads 1000 \
    --mummi-samples 1024 --mummi-reads 100

step "6. the access-frequency analysis NoPFS builds on (ImageNet-1k, 16 workers, 90 epochs)"
forebay plan --samples 1281167 --world 16 --epochs 90 --delta 0.8

step "7. train a small graph network for 2 epochs on 2 MPI ranks: forebay's clairvoyant loader and gradient coordination vs torch DataLoader over PFF"
rm -rf "$OUT/trace"
mpiexec -n 2 python benchmarks/loader/train_gnn.py --packed "$OUT/ising.fb" --pff "$OUT/ising-pff" --epochs 2 \
    --mode clairvoyant --ram-share 0.6 --reduce bitvector --trace "$OUT/trace" \
    --repo "file://$(cd "$OUT" && pwd)/models" --json "$OUT/train.json"

step "7b. the same on a slow shared file system (emulated: 2 ms a request, 100 MB/s), 3 epochs: the regime forebay is for"
mpiexec -n 2 python benchmarks/loader/train_gnn.py --packed "$OUT/ising.fb" --pff "$OUT/ising-pff" --epochs 3 \
    --mode clairvoyant --ram-share 0.6 --reduce bitvector --slow-fs 100,2

step "8. what the trace of that forebay run says (DFTracer-format files, one per rank)"
forebay analyze "$OUT/trace" --json "$OUT/trace-analysis.json" --plots "$OUT/trace-plots"

step "9. the trained model in the embedded model repository (a new version each demo run)"
forebay models ls "$OUT/models"
forebay models show "$OUT/models" graphnet

step "10. the simulator for that run, next to what was measured (NoPFS's model, this machine)"
python benchmarks/sim/sim_validate.py --train-json "$OUT/train.json" --json "$OUT/sim-validate.json"

step "11. the simulator on paper: ImageNet-1k on 4 Lassen-like nodes with a faster accelerator (c = 1 GB/s), 1% of the samples"
forebay simulate --system lassen --dataset imagenet-1k --workers 4 --epochs 3 --scale 0.01 \
    --compute-MBps 1000 --json "$OUT/simulate.json" --plot "$OUT/simulate.png"

#!/bin/bash
# forebay's GPU checks, in one command, on a machine with a CUDA device and a Python
# that has torch and torchvision (CI has no GPU and skips them):
#   tests/test_gpu.py (nvjpeg decode, pinned batches on a busy device, NCCL gradients,
#   model loads into GPU tensors), then the GPU decode benchmark.
# Run from the repository root:  bash scripts/gpu_check.sh [OUTDIR]
# The model-repository tests need lmdb and msgpack (skipped without them). Set
# PYTHON (default python3), SAMPLES (4096), WORKERS (8), BENCH=0 to skip the benchmark.
set -u
out=${1:-/tmp/forebay-gpu-check}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
$py setup.py build_ext --inplace > "$out/build.txt" 2>&1 || echo "C extension not built: numpy paths"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
$py -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
$py -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/tests.txt" | tail -20
status=${PIPESTATUS[0]}
if [ "${BENCH:-1}" != 0 ]; then
    $py benchmarks/loader/decode_bench.py --out "$out/decode" --samples "${SAMPLES:-4096}" \
        --workers "${WORKERS:-8}" --reps 3 --epochs 3 --device cuda 2>&1 | tee "$out/decode.txt" | tail -14
fi
exit "$status"

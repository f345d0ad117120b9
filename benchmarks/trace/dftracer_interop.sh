#!/usr/bin/env bash
# forebay's traces against the real DFTracer tools (benchmark-side: dftracer-analyzer pulls
# dask, pandas and pyarrow, too heavy for CI).  Needs the project's .venv (make venv) and
# the package registry.  Pinned: dftracer 2.2.0 / pydftracer 2.0.6 write traces;
# dftracer-analyzer 0.0.9 needs dftracer-utils 0.0.12.
#
#   bash benchmarks/trace/dftracer_interop.sh [WORKDIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W=${1:-/tmp/forebay-dftracer}
PY=$ROOT/.venv/bin/python
export PATH=$ROOT/.venv/bin:$PATH
export USER=${USER:-$(id -un)}  # dfanalyzer's config interpolates it
mkdir -p "$W" && rm -rf "$W"/trace-* "$W/app" "$W/dfa-in"
step() { printf '\n== %s\n' "$*"; }

step "1. tools: dftracer (tracer) beside forebay; dftracer-analyzer in its own venv"
[ -d "$W/dft/dftracer" ] || \
  $PY -m pip install -q --no-deps --target "$W/dft" dftracer==2.2.0 pydftracer==2.0.6
if [ ! -x "$W/dfa/bin/dfanalyzer" ]; then
  python3 -m venv "$W/dfa"
  "$W/dfa/bin/pip" install -q dftracer-analyzer==0.0.9 dftracer-utils==0.0.12
fi

step "2. a 2-rank forebay run traced by forebay AND DFTracer (POSIX) into one directory"
$PY - "$W/data.fb" <<'EOF'
import sys, numpy as np, forebay
forebay.write_dataset(sys.argv[1], ({"x": np.full((i % 50 + 1, 8), i, np.float32),
                                     "y": np.int64(i)} for i in range(4000)), overwrite=True)
EOF
cat > "$W/train.py" <<'EOF'
import sys, time
from mpi4py import MPI
from dftracer.python import dftracer
log = dftracer.initialize_log(logfile=None, data_dir=None, process_id=-1)
import forebay.trace as trace
from forebay.torch import DataLoader
dl = DataLoader(sys.argv[1], 32, epochs=2, mode=sys.argv[2], ram_bytes=1 << 20,
                progress=False)
for e in range(2):
    dl.set_epoch(e)
    for b in dl:
        with trace.region("compute"):
            time.sleep(0.001)
dl.close()
trace.disable()
log.finalize()
EOF
for mode in preload clairvoyant; do
  T=$W/trace-$mode
  mkdir -p "$T"  # DFTracer opens its file at start-up, before forebay creates the dir
  PYTHONPATH=$W/dft FOREBAY_TRACE=$T DFTRACER_ENABLE=1 DFTRACER_INC_METADATA=1 \
  DFTRACER_TRACE_COMPRESSION=1 DFTRACER_LOG_FILE=$T/dft DFTRACER_DATA_DIR=$W/data.fb \
    mpiexec -n 2 $PY "$W/train.py" "$W/data.fb" $mode
  ls "$T"
  step "   forebay analyze $T ($mode)"
  forebay analyze "$T" --json "$T.json"
done

step "3. a plain DFTracer trace of a program that reads files, summarized by forebay"
mkdir -p "$W/app/data"
(cd "$W/app" && PYTHONPATH=$W/dft DFTRACER_ENABLE=1 DFTRACER_INC_METADATA=1 \
  DFTRACER_TRACE_COMPRESSION=1 DFTRACER_LOG_FILE=$W/app/trace DFTRACER_DATA_DIR=$W/app/data \
  $PY "$ROOT/tests/data/dftracer/posix_app.py")
forebay analyze "$W/app"

step "4. dftracer-utils 0.0.12 TraceReader on forebay's files"
"$W/dfa/bin/python" - "$W"/trace-clairvoyant/forebay-*.pfw.gz <<'EOF'
import collections, json, sys
from dftracer.utils.trace_reader import TraceReader
for path in sys.argv[1:]:
    r = TraceReader(path, index_dir=path + ".idx", auto_build_index=True)
    ev = r.read_json(1, r.num_lines)
    raw = sum(1 for _ in __import__("gzip").open(path, "rt"))
    c = collections.Counter((dict(e)["cat"], dict(e)["name"]) for e in ev)
    print(f"{path}: {r.num_lines} lines indexed, {len(ev)} parsed of {raw}; top: "
          f"{c.most_common(4)}")
    assert len(ev) == raw
EOF

step "5. dftracer-analyzer 0.0.9, dlio preset, on forebay's trace (forebay files only)"
mkdir -p "$W/dfa-in" && cp "$W"/trace-clairvoyant/forebay-*.pfw.gz "$W/dfa-in/"
(cd "$W" && timeout 900 "$W/dfa/bin/dfanalyzer" analyzer=dftracer analyzer/preset=dlio \
  trace_path="$W/dfa-in" analyzer.checkpoint=false 2>&1 | grep -v "INFO\|WARNING" | tail -40)
step "   forebay analyze on the same files, for comparison"
forebay analyze "$W/dfa-in" | head -9

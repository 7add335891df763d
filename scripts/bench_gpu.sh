#!/usr/bin/env bash
# bench_gpu.sh — `duelq bench` on a GPU machine, one command, unattended (about 3–4 minutes).
#
#   scripts/bench_gpu.sh [duelq bench flags…]       (--backend cuda is set; flags add to it)
#
# For the device machine, where nothing can be fetched: carry `.whl` (wheels of what its
# image lacks); scripts/device_env.sh installs them and, if duelq is not installed, puts a
# folder of links on PYTHONPATH.  Writes bench.json, bench.png and bench.log to
# $OUT/bench (./duelq-bench without OUT).  Exit status: the bench's (0 all measured).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
DEST=${OUT:+$OUT/bench}
DEST=${DEST:-$ROOT/duelq-bench}
export PYTHONUNBUFFERED=1

. "$ROOT/scripts/device_env.sh"
"$PY" -c 'import duelq.server.bench' || { echo "bench_gpu.sh: cannot import duelq.server.bench" \
    "(the error above names what is missing; carry its wheel in .whl)"; exit 1; }
"$PY" -c 'import grpc, google.protobuf as p, numpy, cupy; print("grpcio", grpc.__version__,
"| protobuf", p.__version__, "| numpy", numpy.__version__, "| cupy", cupy.__version__)'
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'

mkdir -p "$DEST"
cd "$ROOT"
timeout "${BENCH_TIMEOUT:-560}" "$PY" -m duelq.server.cli bench --backend cuda --out "$DEST" "$@" \
    2>&1 | tee "$DEST/bench.log"
exit "${PIPESTATUS[0]}"

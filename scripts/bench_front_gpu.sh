#!/usr/bin/env bash
# bench_front_gpu.sh — the server with `--front-process` against the single-process one, each
# through `duelq bench --target`, on a GPU machine (about 1–2 minutes).
#
#   scripts/bench_front_gpu.sh [duelq bench flags…]   (flags apply to the front-process bench)
#
# Starts `duelq serve --backend cuda --front-process` and a plain `duelq serve --backend cuda`
# on local ports; benches the first at B = 1024, 4096 (all wires unless the flags say
# otherwise) and the second at B = 1024 float32, the reference figure; stops both with
# SIGTERM.  Each bench measures its own byte-stream ceiling in the same run.  Writes
# $OUT/{front,plain}/bench.{json,png} and both servers' logs (./duelq-bench-front without
# OUT).  Exit status: 1 if a server did not come up or a bench failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
DEST=${OUT:-$ROOT/duelq-bench-front}
export PYTHONUNBUFFERED=1
. "$ROOT/scripts/device_env.sh"
cd "$ROOT"
mkdir -p "$DEST"
duelq() { "$PY" -m duelq.server.cli "$@"; }
duelq --log-level WARNING serve --backend cuda --front-process --port 50061 >"$DEST/front.log" 2>&1 &
FRONT=$!
duelq --log-level WARNING serve --backend cuda --port 50062 >"$DEST/plain.log" 2>&1 &
PLAIN=$!
trap 'kill -TERM $FRONT $PLAIN 2>/dev/null; wait' EXIT
for port in 50061 50062; do
    for _ in $(seq 120); do duelq health --target 127.0.0.1:$port >/dev/null && break; sleep 1; done
    duelq health --target 127.0.0.1:$port || { tail -20 "$DEST"/*.log; exit 1; }
done
status=0
duelq bench --target 127.0.0.1:50061 --batch-sizes 1024,4096 --scaling-actors "" \
    --no-experiments --no-device-step --out "$DEST/front" "$@" || status=1
duelq bench --target 127.0.0.1:50062 --batch-sizes 1024 --wire-dtypes float32 \
    --scaling-actors "" --no-experiments --no-device-step --out "$DEST/plain" || status=1
exit $status

#!/usr/bin/env bash
# profile_relay.sh — where the learner process's relay thread spends a request: py-spy
# samples the learner process (wall clock, idle included) during the float16 TrainStream
# cell of `duelq bench` against `duelq serve --front-processes $FRONTS`, and the table gives
# each function's share of the thread's samples and its µs per request (share ÷ the
# cell's steps/s).  Needs py-spy (scripts/device_wheels.sh carries it to a GPU image).
#
#   [FRONTS=8] [ACTORS=8] [BATCH=1024] [PROFILE_S=5] [BACKEND=cuda] scripts/profile_relay.sh
#
# The raw samples, the bench's JSON and the logs go to $OUT (a temporary folder without it).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
LOGS=${OUT:-$(mktemp -d)}
. "$ROOT/scripts/device_env.sh"
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
PORT=50094
"$PY" -m duelq.apps.cli --log-level WARNING serve --backend "${BACKEND:-cuda}" \
    --front-processes "${FRONTS:-8}" --port $PORT >"$LOGS/serve.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 120); do
    "$PY" -m duelq.apps.cli health --target 127.0.0.1:$PORT >/dev/null 2>&1 && break
    sleep 0.5
done
# The learner process: the first process the server spawned (its fronts follow).
learner=$(pgrep -P $server -f spawn_main | sort -n | head -1)
"$PY" -m duelq.apps.cli bench --target 127.0.0.1:$PORT --batch-sizes "${BATCH:-1024}" \
    --wire-dtypes float32,float16 --actors "${ACTORS:-8}" --scaling-actors "" \
    --echo-processes "${FRONTS:-8}" --no-experiments --no-device-step --no-replay-cells \
    --duration $(( ${PROFILE_S:-5} + 3 )) --out "$LOGS/bench" >"$LOGS/bench.log" 2>&1 &
bench=$!
# bench.json is rewritten after each cell: the float16 stream cell follows the float32 one.
until grep -q '"stream"' "$LOGS/bench/bench.json" 2>/dev/null; do
    kill -0 $bench 2>/dev/null || { echo "the bench ended early: $LOGS/bench.log"; exit 1; }
    sleep 0.1
done
sleep 1.5   # the cell's start and warm-up
"$SPY" record --pid "$learner" --threads --idle --nonblocking --rate 1000 \
    --duration "${PROFILE_S:-5}" --format raw --output "$LOGS/relay.txt" >"$LOGS/py-spy.log" 2>&1
wait $bench
"$PY" - "$LOGS/relay.txt" "$LOGS/bench/bench.json" <<'TABLE'
import collections, json, sys
rows = json.load(open(sys.argv[2]))["rows"]
rate = next(r["steps_per_s"] for r in rows if r["kind"] == "stream" and r["wire"] == "float16")
inclusive, total = collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, count = line.rsplit(" ", 1)
    frames = stack.split(";")
    if not frames[0].endswith(": duelq-relay"):   # the relay thread's samples only
        continue
    total += int(count)
    for name in {f.split(" (")[0] for f in frames[1:]} - {"Thread.run", "Thread._bootstrap",
                                                          "Thread._bootstrap_inner"}:
        inclusive[name] += int(count)
print(f"relay thread, float16 TrainStream: {rate:.0f} steps/s, {1e6 / rate:.0f} µs a request; "
      f"{total} samples")
print("| function | share | µs a request |\n|---|---|---|")
for name, count in inclusive.most_common(24):
    print(f"| {name} | {count / total:.0%} | {count / total * 1e6 / rate:.1f} |")
TABLE

#!/usr/bin/env bash
# profile_relay.sh — where the learner process's relay thread spends a learner step: py-spy
# samples the learner process (wall clock, idle included) during one cell of `duelq bench`
# against `duelq serve --front-processes $FRONTS` (CELL=stream: the float16 TrainStream
# cell; CELL=replay: the float32 replay cell, the server training from a buffer of 10⁶ rows
# at ratio 8 while the actors insert), and the table gives each function's share of the
# thread's samples and its µs per learner step (share ÷ the cell's steps/s).  The busiest
# threads' CPU and run-queue times come from /proc.  Needs py-spy
# (scripts/device_wheels.sh carries it to a GPU image).
#
#   [CELL=stream|replay] [FRONTS=8] [ACTORS=8] [BATCH=1024] [PROFILE_S=5] [BACKEND=cuda] \
#       [NATIVE=1: C frames too, sampled less often] scripts/profile_relay.sh
#
# The raw samples, the bench's JSON and the logs go to $OUT (a temporary folder without it).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
LOGS=${OUT:-$(mktemp -d)}
CELL=${CELL:-stream}
case $CELL in stream|replay) ;; *) echo "CELL must be stream or replay, not $CELL" >&2; exit 2;; esac
. "$ROOT/scripts/device_env.sh"
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
PORT=50094
if [ "$CELL" = replay ]; then   # the cell profiled, and the one before it (bench.json's rows)
    WIRE=float32 BEFORE=stream/float16
    SERVE=(--replay-capacity 1000000 --replay-batch-size "${BATCH:-1024}" --replay-ratio 8)
    BENCH=()
else
    WIRE=float16 BEFORE=stream/float32 SERVE=() BENCH=(--no-replay-cells)
fi
"$PY" -m duelq.apps.cli --log-level WARNING serve --backend "${BACKEND:-cuda}" \
    --front-processes "${FRONTS:-8}" --port $PORT "${SERVE[@]}" >"$LOGS/serve.log" 2>&1 &
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
    --echo-processes "${FRONTS:-8}" --no-experiments --no-device-step "${BENCH[@]}" \
    --duration $(( ${PROFILE_S:-5} + 3 )) --out "$LOGS/bench" >"$LOGS/bench.log" 2>&1 &
bench=$!
# bench.json is rewritten after each cell: the profiled cell starts once the one before it
# is written.
written() {
    "$PY" - "$LOGS/bench/bench.json" "$BEFORE" <<'ROWS' 2>/dev/null
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
sys.exit(0 if any(f"{r['kind']}/{r['wire']}" == sys.argv[2] for r in rows) else 1)
ROWS
}
until written; do
    kill -0 $bench 2>/dev/null || { echo "the bench ended early: $LOGS/bench.log"; exit 1; }
    sleep 0.1
done
sleep 1.5   # the cell's start and warm-up
schedstat() {   # each thread of the learner process: "tid cpu-ns runqueue-wait-ns"
    for t in /proc/"$learner"/task/*; do   # a thread gone meanwhile is left out
        s=$(cut -d' ' -f1,2 "$t/schedstat" 2>/dev/null) && echo "${t##*/} $s"
    done
}
schedstat >"$LOGS/sched-before.txt"
# py-spy reads C frames only by pausing the process at each sample: fewer samples then.
if [ -n "${NATIVE:-}" ]; then HOW=(--native --rate 200); else HOW=(--nonblocking --rate 1000); fi
"$SPY" record --pid "$learner" --threads --idle "${HOW[@]}" --duration "${PROFILE_S:-5}" \
    --format raw --output "$LOGS/relay.txt" >"$LOGS/py-spy.log" 2>&1
schedstat >"$LOGS/sched-after.txt"
wait $bench
"$PY" - "$LOGS/relay.txt" "$LOGS/bench/bench.json" "$LOGS"/sched-{before,after}.txt \
    "$CELL" "$WIRE" <<'TABLE'
import collections, json, sys
before, after = ({t: (int(c), int(w)) for t, c, w in (line.split() for line in open(f))}
                 for f in sys.argv[3:5])
busy = sorted(((after[t][0] - before[t][0], after[t][1] - before[t][1], t)
               for t in after if t in before), reverse=True)[:3]
print("learner process's busiest threads over the profile (from /proc/*/schedstat): "
      + "; ".join(f"{tid}: {cpu / 1e6:.0f} ms on a CPU, {wait / 1e6:.0f} ms waiting for one"
                  for cpu, wait, tid in busy))
rows = json.load(open(sys.argv[2]))["rows"]
rate = next(r["steps_per_s"] for r in rows if r["kind"] == sys.argv[5] and r["wire"] == sys.argv[6])
inclusive, innermost, total = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, count = line.rsplit(" ", 1)
    frames = stack.split(";")
    if not frames[0].endswith(": duelq-relay"):   # the relay thread's samples only
        continue
    total += int(count)
    innermost[frames[-1].strip()] += int(count)
    for name in {f.split(" (")[0] for f in frames[1:]} - {"Thread.run", "Thread._bootstrap",
                                                          "Thread._bootstrap_inner"}:
        inclusive[name] += int(count)
print(f"relay thread, {sys.argv[5]} {sys.argv[6]}: {rate:.0f} learner steps/s, {1e6 / rate:.0f} "
      f"µs a step; {total} samples")
print("| function | share | µs a step |\n|---|---|---|")
for name, count in inclusive.most_common(24):
    print(f"| {name} | {count / total:.0%} | {count / total * 1e6 / rate:.1f} |")
print("\n| innermost frame (its own time) | share | µs a step |\n|---|---|---|")
for name, count in innermost.most_common(16):
    print(f"| {name} | {count / total:.0%} | {count / total * 1e6 / rate:.1f} |")
TABLE

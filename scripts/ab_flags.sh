#!/usr/bin/env bash
# ab_flags.sh — server settings against each other, alternated on one host: for each of
# ROUNDS rounds, every configuration in turn (every other round in reverse order) is
# started, benched with `duelq bench --target` (B = $BATCH, $ACTORS actors, TrainStream
# float32 and float16 plus unary, the byte-stream echo served by $FRONTS processes as the
# ceiling) and stopped.
#
#   [ROUNDS=3] [FRONTS=8] [ACTORS=8] [DURATION=3] [BATCH=1024] scripts/ab_flags.sh NAME="FLAGS" …
#
# FLAGS may start with "tree:DIR " to serve another checkout (DIR's packages, linked as
# scripts/device_env.sh links this tree's; its own `duelq` command: apps/cli.py, or
# server/cli.py in an older tree), benched by that checkout's own bench (its client speaks its proto),
# e.g. base="tree:/tmp/base --front-process".  FLAGS may start with "env:VAR=VALUE,… " (then
# tree:, if any): the server's environment gains those variables (its fronts inherit
# them), e.g. malloc="env:MALLOC_MMAP_THRESHOLD_=33554432,MALLOC_TRIM_THRESHOLD_=268435456".
#
# Prints a table of steps/s per configuration and round, and the medians; bench JSON goes
# to $OUT/ab (./duelq-ab/ab without OUT).  Exit status 1 if a server did not come up.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
DEST=${OUT:-$ROOT/duelq-ab}/ab
export PYTHONUNBUFFERED=1
. "$ROOT/scripts/device_env.sh"
mkdir -p "$DEST"
CLI=${CLI:-duelq.apps.cli}
PORT=50093
status=0
for round in $(seq "${ROUNDS:-3}"); do
    order=("$@")   # every other round in reverse (A B, B A, …): neither runs always first
    if (( round % 2 == 0 )); then
        order=() && for (( i = $#; i > 0; i-- )); do order+=("${!i}"); done
    fi
    for spec in "${order[@]}"; do
        name=${spec%%=*} flags=${spec#*=} serve_path=${PYTHONPATH:-} serve_cli=$CLI
        serve_env=()
        if [[ $flags == env:* ]]; then
            vars=${flags%% *} flags=${flags#"$vars"} flags=${flags# } vars=${vars#env:}
            IFS=, read -r -a serve_env <<<"$vars"
        fi
        if [[ $flags == tree:* ]]; then
            tree=${flags%% *} tree=${tree#tree:} flags=${flags#tree:"$tree"}
            shim=$(mktemp -d) && mkdir -p "$shim/duelq"
            for pkg in wire server client apps kernels; do
                [ -d "$tree/$pkg" ] && ln -s "$tree/$pkg" "$shim/duelq/$pkg"
            done
            ln -s "$tree/protos/duelq/v1" "$shim/duelq/v1"
            rest=${PYTHONPATH:-} && rest=${rest#"${SHIM:-}"} && rest=${rest#:}   # less this tree
            serve_path=$shim${rest:+:$rest} serve_cli=duelq.server.cli
            [ -f "$tree/apps/cli.py" ] && serve_cli=duelq.apps.cli
        fi
        # shellcheck disable=SC2086
        env "${serve_env[@]}" PYTHONPATH="$serve_path" "$PY" -m $serve_cli --log-level WARNING serve --backend "${BACKEND:-cuda}" \
            --front-processes "${FRONTS:-8}" --port $PORT $flags >"$DEST/$name-$round.log" 2>&1 &
        pid=$!
        up=0
        for _ in $(seq 120); do
            "$PY" -m $CLI health --target "127.0.0.1:$PORT" >/dev/null 2>&1 && { up=1; break; }
            sleep 0.5
        done
        if [ $up = 1 ]; then
            PYTHONPATH=$serve_path "$PY" -m $serve_cli bench --target "127.0.0.1:$PORT" --batch-sizes "${BATCH:-1024}" \
                --wire-dtypes float32,float16 --actors "${ACTORS:-8}" --scaling-actors "" \
                --echo-processes "$(( ${FRONTS:-8} > 0 ? ${FRONTS:-8} : 1 ))" --no-experiments --no-device-step \
                --duration "${DURATION:-3}" --out "$DEST/bench-$name-$round" >/dev/null 2>&1 \
                || status=1
        else
            echo "$name did not come up"; tail -5 "$DEST/$name-$round.log"; status=1
        fi
        kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null
        "$PY" - "$DEST/bench-$name-$round/bench.json" "$name" "$round" <<'ROW'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, ValueError, KeyError):
    rows = []
cells = {f"{r['kind']}/{r['wire']}": r.get("steps_per_s") for r in rows if "error" not in r}
print(sys.argv[2], sys.argv[3], " ".join(f"{k}={v:.0f}" for k, v in sorted(cells.items()) if v))
ROW
    done
done | tee "$DEST/rows.txt"
"$PY" - "$DEST/rows.txt" <<'SUMMARY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) < 3 or "=" not in parts[2]:
        continue
    for cell in parts[2:]:
        k, v = cell.split("=")
        runs.setdefault(parts[0], {}).setdefault(k, []).append(float(v))
keys = sorted({k for r in runs.values() for k in r})
print("\n| config | " + " | ".join(f"{k} median [runs]" for k in keys) + " |")
print("|---" * (len(keys) + 1) + "|")
for name, r in runs.items():
    print(f"| {name} | " + " | ".join(
        f"{statistics.median(r[k]):.0f} [{', '.join(f'{v:.0f}' for v in r[k])}]"
        if k in r else "—" for k in keys) + " |")
SUMMARY
exit $status

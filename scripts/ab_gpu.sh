#!/usr/bin/env bash
# ab_gpu.sh — this build against another one, side by side on one GPU host.  Hosts of one
# kind differ by up to 2× (docs/benchmarks.md, round 8), so a comparison holds only within
# one host.  Each of ROUNDS rounds (default 2) runs, for each build in turn:
#   * benchmarks/learner_path.py (this tree's harness, that build's server code), and
#   * `duelq bench --target` (this tree's client; B = 1024 float32, $ACTORS actors, the
#     byte-stream echo, TrainStream and unary cells) against a `--front-process
#     --front-processes $FRONTS` server of that build, both servers up all along.
#
#   git worktree add /tmp/base <commit>
#   [FRONTS=4] [ACTORS=8] [BACKEND=cuda] [DURATION=6] [REQUESTS=1000] \
#       scripts/ab_gpu.sh /tmp/base [ROUNDS]
#
# Each build runs from a folder of links to its packages; duelq must not be installed (as
# on the GPU image: scripts/device_env.sh carries the wheels it lacks).  Prints each figure
# as it comes and a summary table at the end; bench JSON goes to $OUT/ab (./duelq-ab
# without OUT).  Exit status: 2 for bad arguments, 1 if a server did not come up, a build
# imported from elsewhere or a bench failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] && [ -d "$1/server" ] || { echo "usage: ab_gpu.sh OTHER_TREE [ROUNDS]" >&2; exit 2; }
OTHER=$(cd "$1" && pwd)
ROUNDS=${2:-2}
PY=${PYTHON:-python3}
BACKEND=${BACKEND:-cuda}
DEST=${OUT:-$ROOT/duelq-ab}/ab
export PYTHONUNBUFFERED=1
. "$ROOT/scripts/device_env.sh"   # the carried wheels (and this tree) on PYTHONPATH
BASEPATH=$PYTHONPATH
mkdir -p "$DEST"

links() {   # a folder whose duelq/ links to tree $1's packages
    local dir
    dir=$(mktemp -d)
    mkdir -p "$dir/duelq"
    for pkg in server client kernels; do ln -s "$1/$pkg" "$dir/duelq/$pkg"; done
    ln -s "$1/protos/duelq/v1" "$dir/duelq/v1"
    echo "$dir"
}
declare -A PATHS=([this]="$(links "$ROOT"):$BASEPATH" [other]="$(links "$OTHER"):$BASEPATH")
declare -A TREES=([this]=$ROOT [other]=$OTHER) PORTS=([this]=50091 [other]=50092) PIDS=()
as() {   # as BUILD command…: run with BUILD's packages importable
    local build=$1
    shift
    PYTHONPATH=${PATHS[$build]} "$@"
}
status=0
for build in this other; do
    where=$(as $build "$PY" -c 'import duelq.server, os; print(os.path.realpath(duelq.server.__path__[0]))')
    if [ "$where" != "$(realpath "${TREES[$build]}/server")" ]; then
        echo "build $build imports duelq.server from $where, not ${TREES[$build]}: is duelq installed?"
        exit 1
    fi
    as $build "$PY" -m duelq.server.cli --log-level WARNING serve --backend "$BACKEND" \
        --front-process --front-processes "${FRONTS:-4}" --port "${PORTS[$build]}" \
        >"$DEST/$build.log" 2>&1 &
    PIDS[$build]=$!
done
trap 'kill -TERM "${PIDS[@]}" 2>/dev/null; wait' EXIT
for build in this other; do
    for _ in $(seq 120); do
        as this "$PY" -m duelq.server.cli health --target "127.0.0.1:${PORTS[$build]}" \
            >/dev/null 2>&1 && break
        sleep 1
    done
    as this "$PY" -m duelq.server.cli health --target "127.0.0.1:${PORTS[$build]}" \
        || { tail -20 "$DEST/$build.log"; exit 1; }
done
for round in $(seq "$ROUNDS"); do
    for build in this other; do
        echo "== round $round, $build (${TREES[$build]})"
        as $build "$PY" "$ROOT/benchmarks/learner_path.py" --backend "$BACKEND" \
            --requests "${REQUESTS:-1000}" --repeats 3 | tee "$DEST/path-$round-$build.txt" \
            | grep -E "learner's (share|host work)" || status=1
        as this "$PY" -m duelq.server.cli bench --target "127.0.0.1:${PORTS[$build]}" \
            --batch-sizes 1024 --wire-dtypes float32 --actors "${ACTORS:-8}" \
            --scaling-actors "" --no-experiments --no-device-step \
            --duration "${DURATION:-6}" --out "$DEST/bench-$round-$build" >/dev/null || status=1
    done
done
"$PY" - "$DEST" "$ROUNDS" <<'SUMMARY'
import json, re, sys
from pathlib import Path
dest, rounds = Path(sys.argv[1]), int(sys.argv[2])
print("\n| round | build | learner's host work, µs (median [range]) | echo msgs/s | "
      "TrainStream steps/s (÷ echo) | unary steps/s (÷ echo) |")
print("|---|---|---|---|---|---|")
for r in range(1, rounds + 1):
    for build in ("this", "other"):
        text = (dest / f"path-{r}-{build}.txt").read_text() if (
            dest / f"path-{r}-{build}.txt").exists() else ""
        work = re.search(r"\| the learner's (?:host work|share)[^|]*\| ([^|]+) \|", text)
        try:
            rows = {row["kind"]: row for row in json.loads(
                (dest / f"bench-{r}-{build}" / "bench.json").read_text())["rows"]}
        except (OSError, ValueError, KeyError):
            rows = {}
        cell = lambda kind: (f"{rows[kind]['steps_per_s']:.0f} ({rows[kind]['vs_echo']:.2f})"
                             if kind in rows else "—")
        echo = f"{rows['echo']['steps_per_s']:.0f}" if "echo" in rows else "—"
        print(f"| {r} | {build} | {work.group(1).strip() if work else '—'} | {echo} | "
              f"{cell('stream')} | {cell('unary')} |")
SUMMARY
exit $status

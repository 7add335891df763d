#!/usr/bin/env bash
# ab_gpu.sh — this build against another one, side by side on one GPU host.  Hosts of one
# kind differ by up to 2× (docs/benchmarks.md, rounds 7 and 8), so a comparison holds only
# within one host.  Each of ROUNDS rounds (default 2) runs, for each build in turn:
#   * benchmarks/learner_path.py (this tree's harness, that build's server code; requests
#     packed as the fronts pack them since round 13: LEARNER_FLAGS=--unpacked for a build
#     from before, or for figures comparable with earlier rounds' A/B runs), and
#   * `duelq bench --target` (this tree's client; B = 1024 float32, $ACTORS actors, the
#     byte-stream echo, TrainStream and unary cells) against a `--front-process
#     --front-processes $FRONTS` server of that build, both servers up all along.
#
#   git worktree add /tmp/base <commit>
#   [FRONTS=4] [ACTORS=8] [BACKEND=cuda] [DURATION=6] [REQUESTS=1000] [LEARNER_FLAGS=…] \
#       scripts/ab_gpu.sh /tmp/base [ROUNDS]
#
# Each build runs from a folder of links to its packages; duelq must not be installed (as
# on the GPU image: scripts/device_env.sh carries the wheels it lacks).  Prints each figure
# as it comes and a summary table at the end; bench JSON goes to $OUT/ab (./duelq-ab/ab
# without OUT).  Exit status: 2 for bad arguments, 1 if a server did not come up, a build
# imported from elsewhere or a bench failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
usage() { echo "usage: ab_gpu.sh OTHER_TREE [ROUNDS ≥ 1]" >&2; exit 2; }
[ $# -ge 1 ] && [ -d "$1/server" ] || usage
OTHER=$(cd "$1" && pwd)
ROUNDS=${2:-2}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || usage
PY=${PYTHON:-python3}
BACKEND=${BACKEND:-cuda}
DEST=${OUT:-$ROOT/duelq-ab}/ab
export PYTHONUNBUFFERED=1
. "$ROOT/scripts/device_env.sh"   # the carried wheels (and this tree) on PYTHONPATH
BASEPATH=${PYTHONPATH:-}
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
trap 'kill -TERM "${PIDS[@]}" 2>/dev/null; wait; rm -rf "${PATHS[this]%%:*}" "${PATHS[other]%%:*}"' EXIT
as() {   # as BUILD command…: run with BUILD's packages importable
    local build=$1
    shift
    PYTHONPATH=${PATHS[$build]} "$@"
}
status=0
for build in this other; do
    where=$(as $build "$PY" -c 'import os, duelq.server, duelq.client, duelq.kernels, duelq.v1
print(*sorted({os.path.realpath(m.__path__[0]) for m in (duelq.server, duelq.client, duelq.kernels, duelq.v1)}))')
    tree=${TREES[$build]}
    want=$(realpath "$tree/client" "$tree/kernels" "$tree/protos/duelq/v1" "$tree/server" | sort | xargs)
    if [ "$where" != "$want" ]; then
        echo "build $build imports duelq from $where, not $tree: is duelq installed?"
        exit 1
    fi
    if as this "$PY" -m duelq.server.cli health --target "127.0.0.1:${PORTS[$build]}" \
            >/dev/null 2>&1; then
        echo "port ${PORTS[$build]} already serves duelq (a server left running?)"
        exit 1
    fi
    (PYTHONPATH=${PATHS[$build]} exec "$PY" -m duelq.server.cli --log-level WARNING serve \
        --backend "$BACKEND" --front-process --front-processes "${FRONTS:-4}" \
        --port "${PORTS[$build]}" >"$DEST/$build.log" 2>&1) &
    PIDS[$build]=$!   # the server itself (exec): SIGTERM stops it and its processes
done
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
            --requests "${REQUESTS:-1000}" --repeats 3 ${LEARNER_FLAGS:-} \
            | tee "$DEST/path-$round-$build.txt" \
            | grep -E "learner's (share|host work)" || status=1
        as this "$PY" -m duelq.server.cli bench --target "127.0.0.1:${PORTS[$build]}" \
            --batch-sizes 1024 --wire-dtypes float32 --actors "${ACTORS:-8}" \
            --scaling-actors "" --no-experiments --no-device-step \
            --duration "${DURATION:-6}" --out "$DEST/bench-$round-$build" >/dev/null || status=1
    done
done
"$PY" - "$DEST" "$ROUNDS" <<'SUMMARY' || status=1
import json, re, sys
from pathlib import Path
dest, rounds = Path(sys.argv[1]), int(sys.argv[2])


def learner(text: str) -> str:
    """learner_path's host work (cuda), else the learner's share, as "median [range]"
    (its first column: the fronts' copies made ahead)."""
    for part in ("host work", "share"):
        found = re.search(rf"\| the learner's {part}[^|]*\| ([^|]+) \|", text)
        if found:
            return f"{found.group(1).strip()} ({part})"
    return "—"


def cell(rows: dict, kind: str) -> str:
    row = rows.get(kind)
    if row is None or "error" in row:
        return "—"
    ratio = row.get("vs_echo")
    return f"{row['steps_per_s']:.0f}" + (f" ({ratio:.2f})" if ratio is not None else "")


print("\n| round | build | learner µs/request, median [range] | echo msgs/s | "
      "TrainStream steps/s (÷ echo) | unary steps/s (÷ echo) |")
print("|---|---|---|---|---|---|")
for r in range(1, rounds + 1):
    for build in ("this", "other"):
        path = dest / f"path-{r}-{build}.txt"
        try:
            rows = {row["kind"]: row for row in json.loads(
                (dest / f"bench-{r}-{build}" / "bench.json").read_text())["rows"]}
        except (OSError, ValueError, KeyError, TypeError):
            rows = {}
        print(f"| {r} | {build} | {learner(path.read_text() if path.exists() else '')} | "
              f"{cell(rows, 'echo')} | {cell(rows, 'stream')} | {cell(rows, 'unary')} |")
SUMMARY
exit $status

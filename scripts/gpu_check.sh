#!/usr/bin/env bash
# gpu_check.sh — the one command for a GPU machine: the `gpu` tests, the device
# benchmarks (the step, the replay step, launch costs), then the Docker image's server
# model end to end (`duelq bench --front-processes $FRONTS`, B = 1024, 8 actors:
# TrainStream, TrainStep, and 8 actors inserting into the server-side replay at ratio 8;
# the byte-stream echo served by as many processes as fronts, the ceiling), then a summary.
#
#   [FRONTS=8] [BACKEND=cuda] [E2E=0: skip the end-to-end part] \
#       scripts/gpu_check.sh [pytest…]
#
# Default: `pytest -m gpu` over the test modules that mark gpu tests (other modules may
# not even import on a bare GPU image).
# duelq need not be installed (scripts/device_env.sh: carried wheels, a folder of links on
# PYTHONPATH). Logs and the benchmark JSON go to $OUT when set.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
LOGS=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1

. "$ROOT/scripts/device_env.sh"
cd "$ROOT"

# The gpu tests need no conftest fixtures; skip tests/conftest.py where the service's
# packages (grpc health, metrics) are not installed, as on a bare GPU image.
NOCONFTEST=()
if ! "$PY" -c 'import runpy; runpy.run_path("tests/conftest.py")' >/dev/null 2>&1; then
    echo "note: tests/conftest.py does not import here; running with --noconftest"
    NOCONFTEST=(--noconftest)
fi
if [ $# -eq 0 ]; then
    set -- $(grep -l 'mark\.gpu' tests/test_*.py)
fi
"$PY" -m pytest -m gpu -rs -p no:cacheprovider "${NOCONFTEST[@]}" "$@" 2>&1 | tee "$LOGS/gpu_tests.log"
TESTS_RC=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT:-900}" "$PY" benchmarks/device_step.py 2>&1 | tee "$LOGS/device_step.log"
BENCH_RC=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT:-900}" "$PY" benchmarks/replay_step.py 2>&1 | tee "$LOGS/replay_step.log"
BENCH_RC=$(( BENCH_RC || PIPESTATUS[0] ))
timeout "${BENCH_TIMEOUT:-900}" "$PY" benchmarks/launch_costs.py 2>&1 | tee "$LOGS/launch_costs.log"
BENCH_RC=$(( BENCH_RC || PIPESTATUS[0] ))
E2E_RC=0 FRONTS=${FRONTS:-8}
if [ "${E2E:-1}" != 0 ]; then
    timeout 300 "$PY" -m duelq.apps.cli bench --backend "${BACKEND:-cuda}" \
        --front-processes "$FRONTS" --echo-processes "$FRONTS" --batch-sizes 1024 \
        --actors 8 --scaling-actors "" \
        --no-experiments --no-device-step --duration 3 --out "$LOGS/bench-fronts" \
        2>&1 | tee "$LOGS/bench-fronts.log"
    E2E_RC=${PIPESTATUS[0]}
fi

echo
echo "=============================== gpu-check summary ==============================="
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
echo "gpu tests (exit $TESTS_RC): $(tail -n 1 "$LOGS/gpu_tests.log")"
sed -n '/^## duelq device benchmark/,$p' "$LOGS/device_step.log"
sed -n '/^## replay step/,$p' "$LOGS/replay_step.log"
sed -n '/^## kernel boundaries/,$p' "$LOGS/launch_costs.log"
echo "benchmark exit $BENCH_RC"
if [ "${E2E:-1}" != 0 ]; then
    echo "end to end, $FRONTS fronts, B = 1024, 8 actors (bench exit $E2E_RC):"
    "$PY" - "$LOGS/bench-fronts/bench.json" <<'ROWS'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, ValueError, KeyError):
    sys.exit("- no bench.json")
for r in rows:
    if r.get("batch") == 1024 and r.get("section") == "main" and "error" not in r:
        if r["kind"] == "replay":
            print(f"- replay {r['wire']} (ratio {r['ratio_measured'] or 0:.1f}): "
                  f"{r['steps_per_s']:.0f} learner steps/s, {r['vs_stream_steps'] or 0:.2f}× "
                  f"TrainStream's; wire bytes per step {r['vs_stream_bytes_per_step'] or 0:.2f}× "
                  "TrainStream's")
            continue
        ratio = f" ({r['vs_echo']:.2f} of the echo)" if r.get("vs_echo") else ""
        print(f"- {r['kind']} {r['wire']}: {r['steps_per_s']:.0f} steps/s{ratio}")
ROWS
fi
exit $(( TESTS_RC != 0 || BENCH_RC != 0 || E2E_RC != 0 ))

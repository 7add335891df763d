#!/usr/bin/env bash
# gpu_check.sh — the one command for a GPU machine: the `gpu` tests, the device
# benchmark, then issue 5's goals for the Docker image's server model (`duelq bench
# --front-process --front-processes $FRONTS`, B = 1024, 8 actors, and the learner's host
# work per request from benchmarks/relay_path.py, RELAY_RUNS times), then a short summary.
#
#   [FRONTS=8] [BACKEND=cuda] [RELAY_RUNS=5] [E2E=0: skip the end-to-end part] \
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
[[ ${RELAY_RUNS:-5} =~ ^[1-9][0-9]*$ ]] || { echo "RELAY_RUNS must be a count ≥ 1" >&2; exit 2; }

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
E2E_RC=0 RELAY_RC=0 FRONTS=${FRONTS:-8}
if [ "${E2E:-1}" != 0 ]; then
    timeout 300 "$PY" -m duelq.server.cli bench --backend "${BACKEND:-cuda}" --front-process \
        --front-processes "$FRONTS" --batch-sizes 1024 --actors 8 --scaling-actors "" \
        --no-experiments --no-device-step --duration 3 --out "$LOGS/bench-fronts" \
        2>&1 | tee "$LOGS/bench-fronts.log"
    E2E_RC=${PIPESTATUS[0]}
    # One host's figure moves by tens of per cent from run to run: RELAY_RUNS of them.
    : > "$LOGS/relay_path.log"
    for _ in $(seq "${RELAY_RUNS:-5}"); do
        timeout 120 "$PY" benchmarks/relay_path.py --backend "${BACKEND:-cuda}" \
            --fronts "$FRONTS" --duration 3 2>&1 | tee -a "$LOGS/relay_path.log"
        RC=${PIPESTATUS[0]}
        [ "$RC" = 0 ] || RELAY_RC=$RC
    done
fi

echo
echo "=============================== gpu-check summary ==============================="
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
echo "gpu tests (exit $TESTS_RC): $(tail -n 1 "$LOGS/gpu_tests.log")"
sed -n '/^## duelq device benchmark/,$p' "$LOGS/device_step.log"
echo "benchmark exit $BENCH_RC"
if [ "${E2E:-1}" != 0 ]; then
    echo "end to end, $FRONTS fronts (bench exit $E2E_RC, relay_path exit $RELAY_RC):"
    sed -n '/^### Issue 5 goals, as measured here/,$p' "$LOGS/bench-fronts.log" | grep '^- '
    HOST_US=$(grep -E '^\| [0-9]' "$LOGS/relay_path.log" | awk -F'|' '{print $6 + 0}' | sort -n \
        | awk '{v[NR] = $1} END {if (NR) printf "median %g µs (%d run(s): %g–%g)", \
              (v[int((NR + 1) / 2)] + v[int(NR / 2) + 1]) / 2, NR, v[1], v[NR]}')
    echo "- the learner's host work per request (relay_path.py, $FRONTS fronts; goal ≤ 100 µs):" \
        "${HOST_US:-not measured}"
fi
exit $(( TESTS_RC != 0 || BENCH_RC != 0 || E2E_RC != 0 || RELAY_RC != 0 ))

#!/usr/bin/env bash
# gpu_check.sh — the one command for a GPU machine: the `gpu` tests, then the device
# benchmark, then a short summary table.
#
#   scripts/gpu_check.sh [pytest paths/args…]
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

echo
echo "=============================== gpu-check summary ==============================="
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
echo "gpu tests (exit $TESTS_RC): $(tail -n 1 "$LOGS/gpu_tests.log")"
sed -n '/^## duelq device benchmark/,$p' "$LOGS/device_step.log"
echo "benchmark exit $BENCH_RC"
exit $(( TESTS_RC != 0 || BENCH_RC != 0 ))

#!/usr/bin/env bash
# profile_front.sh — where the `--front-process` server's GIL time goes under a TrainStream
# load: py-spy samples the threads that hold the GIL in the front and learner processes
# while `duelq bench --target` drives them (B = 1024 float32, $ACTORS actors (default 2),
# about a minute), with $FRONTS front processes (default 1).
#
#   scripts/profile_front.sh [cuda|reference]
#
# Needs py-spy: on PATH, or its wheel in .prof/ (carried to the GPU machine).  Writes
# $OUT/gil.txt (py-spy's collapsed stacks, by process and thread) and prints the functions
# that hold the GIL most in each process (./duelq-profile without OUT).  SPY_FLAGS=--idle
# samples every thread, waiting or not, instead of the GIL's holders.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
DEST=${OUT:-$ROOT/duelq-profile}
BACKEND=${1:-cuda}
export PYTHONUNBUFFERED=1
. "$ROOT/scripts/device_env.sh"
cd "$ROOT"
mkdir -p "$DEST"
SPY=$(command -v py-spy)
if [ -z "$SPY" ] && compgen -G "$ROOT/.prof/py_spy-*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/pyspy "$ROOT"/.prof/py_spy-*.whl
    SPY=/tmp/pyspy/bin/py-spy
fi
[ -x "$SPY" ] || { echo "py-spy not found (PATH or .prof/py_spy-*.whl)"; exit 1; }
"$SPY" record --subprocesses ${SPY_FLAGS:---gil} --threads --rate 250 --format raw -o "$DEST/gil.txt" -- \
    "$PY" -m duelq.server.cli --log-level WARNING serve --backend "$BACKEND" --front-process \
    --front-processes "${FRONTS:-1}" --port 50071 >"$DEST/serve.log" 2>&1 &
SPIED=$!
for _ in $(seq 90); do
    "$PY" -m duelq.server.cli health --target 127.0.0.1:50071 >/dev/null 2>&1 && break; sleep 1
done
"$PY" -m duelq.server.cli bench --target 127.0.0.1:50071 --batch-sizes 1024 --actors "${ACTORS:-2}" \
    --wire-dtypes float32 --scaling-actors "" --no-experiments --no-device-step --duration 8 \
    --out "$DEST/bench" | grep -E "^\| stream"
# The learner process: the one listening on learner.sock (the fronts only connect to it).
LEARNER=$("$PY" - <<'FIND'
import os
sockets = {f"socket:[{line.split()[6]}]" for line in open("/proc/net/unix")
           if line.rstrip().endswith("learner.sock")}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if any(os.readlink(f"/proc/{pid}/fd/{fd}") in sockets
               for fd in os.listdir(f"/proc/{pid}/fd")):
            print(pid)
            break
    except OSError:
        pass
FIND
)
for pid in $(pgrep -f "front-process --front-processes .* --port 50071"); do   # not py-spy
    grep -q py-spy "/proc/$pid/cmdline" 2>/dev/null || kill -TERM "$pid"
done
wait $SPIED
"$PY" - "$DEST/gil.txt" "$LEARNER" <<'TOP'
import collections, re, sys
learner = f"process {sys.argv[2]}:"   # every other process is a front
# A line: "process 123:\"cmd\";thread (0x7f..);frame (file:line);... count"
own, incl = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
total = collections.Counter()
threads = collections.Counter()
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    if "importlib" in stack or "<module>" in stack:
        continue                              # start-up: imports, compiles
    frames = stack.split(";")
    proc = "learner" if stack.startswith(learner) else "fronts"
    total[proc] += int(n)
    thread = next((f for f in frames if f.startswith("thread (")), "thread ?")
    threads[proc, re.sub(r"\(\d+\)|_\d+$", "", thread)] += int(n)
    names = [re.sub(r" \(.*?([^/]+\.py):\d+\)$", r" (\1)", f) for f in frames[2:]]
    if names:
        own[proc][names[-1]] += int(n)
    for name in set(names):
        incl[proc][name] += int(n)
for proc in total:
    print(f"\n== {proc}: {total[proc]} samples (250 a second) after start-up ==")
    print("  ".join(f"{t.split(': ')[-1]} {n}" for (p, t), n in threads.most_common() if p == proc))
    print("-- own (top 25) --")
    for name, n in own[proc].most_common(25):
        print(f"{100 * n / total[proc]:5.1f}%  {name}")
    print("-- inclusive (top 40) --")
    for name, n in incl[proc].most_common(40):
        print(f"{100 * n / total[proc]:5.1f}%  {name}")
TOP

#!/usr/bin/env bash
# bench_front_gpu.sh — the server with `--front-process` against the single-process one, each
# through `duelq bench --target`, on a GPU machine (about 1–2 minutes).
#
#   [FRONTS=K] scripts/bench_front_gpu.sh [duelq bench flags…]   (flags: the front-process bench)
#
# Starts `duelq serve --backend cuda --front-process` and a plain `duelq serve --backend cuda`
# (with --front-processes K, default 1) on local ports; benches the first at B = 1024, 4096 (all wires unless the flags say
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
# Started without the function, so that $! is the server itself and the trap's SIGTERM
# stops it (a function in the background runs in a subshell, which the signal would stop).
"$PY" -m duelq.server.cli --log-level WARNING serve --backend cuda --front-process \
    --front-processes "${FRONTS:-1}" --port 50061 >"$DEST/front.log" 2>&1 &
FRONT=$!
"$PY" -m duelq.server.cli --log-level WARNING serve --backend cuda --port 50062 \
    >"$DEST/plain.log" 2>&1 &
PLAIN=$!
trap 'kill -TERM $FRONT $PLAIN 2>/dev/null; wait' EXIT
for port in 50061 50062; do
    for _ in $(seq 120); do duelq health --target 127.0.0.1:$port >/dev/null && break; sleep 1; done
    duelq health --target 127.0.0.1:$port || { tail -20 "$DEST"/*.log; exit 1; }
done
# CPU seconds of the front processes (all K) and of the learner process, and the learner's
# step count, as JSON.  The learner process is the child listening on learner.sock.
probe() {
    "$PY" - "$FRONT" <<'PROBE'
import json, os, sys
from duelq.client import LearnerClient
front = int(sys.argv[1])   # the first front process
tick = os.sysconf("SC_CLK_TCK")
def cpu(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick      # utime + stime
children = [p for p in open(f"/proc/{front}/task/{front}/children").read().split()
            if b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()]
sockets = {f"socket:[{line.split()[6]}]" for line in open("/proc/net/unix")
           if line.rstrip().endswith("learner.sock")}
def listens(pid):
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in sockets:
                return True
        except OSError:   # closed meanwhile
            pass
    return False
learner = next(p for p in children if listens(p))
fronts = [front] + [p for p in children if p != learner]
with LearnerClient("127.0.0.1:50061") as client:
    step = client.info().step
print(json.dumps({"front_cpu_s": sum(map(cpu, fronts)), "learner_cpu_s": cpu(learner),
                  "step": step}))
PROBE
}
status=0
before=$(probe)
duelq bench --target 127.0.0.1:50061 --batch-sizes 1024 --wire-dtypes float32 --scaling-actors "" \
    --no-experiments --no-device-step --duration 3 --out "$DEST/front-cpu" || status=1
after=$(probe)
"$PY" - "$before" "$after" <<'REPORT' | tee "$DEST/front-cpu.txt"
import json, sys
a, b = (json.loads(x) for x in sys.argv[1:3])
steps = b["step"] - a["step"]
for name in ("front", "learner"):
    used = b[f"{name}_cpu_s"] - a[f"{name}_cpu_s"]
    print(f"{name} process(es): {1e6 * used / max(steps, 1):.0f} µs of CPU per step "
          f"({used:.2f} s over {steps} steps: B = 1024 float32, stream and unary cells)")
REPORT
duelq bench --target 127.0.0.1:50061 --batch-sizes 1024,4096 --scaling-actors "" \
    --no-experiments --no-device-step --out "$DEST/front" "$@" || status=1
duelq bench --target 127.0.0.1:50062 --batch-sizes 1024 --wire-dtypes float32 \
    --scaling-actors "" --no-experiments --no-device-step --out "$DEST/plain" || status=1
exit $status

# device_env.sh — sourced by gpu_check.sh and ab_flags.sh (expects ROOT and PY): makes
# duelq importable on a bare GPU image. Wheels the image lacks, carried in .whl (see
# scripts/device_wheels.sh), go to /tmp/site; without an installed duelq, a folder of links
# (duelq/server, client, kernels, v1) goes on PYTHONPATH.
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$ROOT"/.whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c 'import duelq.server, duelq.apps, duelq.wire, duelq.kernels, duelq.v1' 2>/dev/null; then
    SHIM=$(mktemp -d)
    mkdir -p "$SHIM/duelq"
    for pkg in wire server client apps kernels; do ln -s "$ROOT/$pkg" "$SHIM/duelq/$pkg"; done
    ln -s "$ROOT/protos/duelq/v1" "$SHIM/duelq/v1"
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi

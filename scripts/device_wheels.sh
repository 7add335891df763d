#!/usr/bin/env bash
# device_wheels.sh — download into .whl/ the wheels (pure Python; ml_dtypes for cp312; py-spy) that
# the GPU machine's image lacks (it has grpcio 1.84.0, protobuf, numpy, cupy, torch, matplotlib, tqdm, safetensors,
# prometheus-client, but nothing can be installed from the network there).  Carry `.whl`
# with the device call; scripts/device_env.sh installs it (gpu_check.sh and ab_flags.sh
# source it; elsewhere: `ROOT=$PWD PY=python3 . scripts/device_env.sh`).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qsx '/.whl/' .git/info/exclude || { mkdir -p .git/info; echo /.whl/ >> .git/info/exclude; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 python-json-logger==4.2.0 \
    gymnasium==1.4.0 farama-notifications==0.0.6 ml_dtypes==0.6.0 py-spy==0.4.3
ls .whl

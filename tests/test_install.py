"""What an installation holds: a lean client (no server, demo or CUDA packages), the extras
named by one line when a command needs them, and a wheel built from the repository as
`pip install git+URL` builds it."""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from duelq.apps import cli

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

#: What a remote actor host installs, and what it must not need.
CLIENT = {"numpy", "grpcio", "protobuf", "grpcio-health-checking", "ml_dtypes"}
NOT_ON_THE_CLIENT = ("matplotlib", "safetensors", "prometheus_client", "tqdm", "gymnasium",
                     "cupy", "grpc_reflection", "pythonjsonlogger")


def names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in requirements}


def test_the_client_install_is_grpc_protobuf_and_numpy():
    assert names(PROJECT["dependencies"]) == CLIENT
    extras = PROJECT["optional-dependencies"]
    assert {"server", "cuda", "demo", "test"} <= extras.keys()
    # the modules the command line looks for come with the extras it names
    package = {"grpc_reflection": "grpcio-reflection", "safetensors": "safetensors",
               "prometheus_client": "prometheus-client", "pythonjsonlogger": "python-json-logger",
               "tqdm": "tqdm", "matplotlib": "matplotlib", "gymnasium": "gymnasium"}
    for extra, modules in cli.EXTRA_MODULES.items():
        assert {package[m] for m in modules} <= names(extras[extra]), extra
    assert names(extras["cuda"]) == {"cupy-cuda12x"}


CLIENT_ONLY = f"""
import sys
sys.modules.update(dict.fromkeys({NOT_ON_THE_CLIENT!r}))   # as if not installed
import numpy as np
from duelq.client import Batch, LearnerClient
from duelq.apps.cli import main

rng = np.random.default_rng(0)
B, H, N = 4, int(sys.argv[2]), int(sys.argv[3])
batch = Batch(h_t=rng.standard_normal((B, H), dtype=np.float32),
              h_tp1=rng.standard_normal((B, H), dtype=np.float32),
              actions=np.arange(B, dtype=np.int32) % N, rewards=np.ones(B, np.float32),
              dones=np.zeros(B, np.float32), discounts=np.full(B, 0.9, np.float32))
with LearnerClient(sys.argv[1]) as client, \\
        LearnerClient(sys.argv[1], feature_dtype="bfloat16") as narrow:
    print("step", client.train_step(batch).step, narrow.train_step(batch).step)
print("health", main(["health", "--target", sys.argv[1], "--timeout", "60"]))
print("serve", main(["serve"]))
print("demo", main(["demo", "--target", sys.argv[1]]))
print("loaded", sorted(m for m in {NOT_ON_THE_CLIENT!r} if sys.modules.get(m) is not None))
"""


def test_the_client_and_health_run_without_any_extra(server):
    """With every package of the extras hidden: a train step and `duelq health` work, and
    `duelq serve` or `duelq demo` say in one line which extras to install and how."""
    done = subprocess.run([sys.executable, "-c", CLIENT_ONLY, server.target,
                           str(server.learner.config.hidden_dim),
                           str(server.learner.config.n_actions)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines()
               if not line.startswith(server.target))
    assert out == {"step": "1 2", "health": "0", "serve": "1", "demo": "1", "loaded": "[]"}
    assert server.learner.step_count == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, done.stderr   # one line for serve, one for demo
    assert lines[0].startswith("duelq: duelq serve needs the server extra: ")
    assert lines[1].startswith("duelq: duelq demo needs the server and demo extras: ")
    assert all(re.search(r"-m pip install .*\[server(,demo)?\]", line) for line in lines)


def test_the_demo_on_a_gymnasium_task_without_gymnasium_says_so_in_one_line(monkeypatch,
                                                                             capsys):
    monkeypatch.setitem(sys.modules, "gymnasium", None)   # as if not installed
    assert cli.main(["demo", "--env", "FrozenLake-v1"]) == cli.EXIT_FAILURE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("duelq: duelq demo needs the demo extra: ")
    assert "[server,demo]" in err


@pytest.mark.slow
def test_a_wheel_built_from_the_repository_holds_every_part(tmp_path):
    """What `pip install git+URL` builds: the committed and new files of the checkout (not
    the ignored ones), built in isolation into a wheel with the code, the kernels, the
    native source and the proto, the `duelq` command, and the extras declared."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    src = tmp_path / "src"
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr
    assert "Deprecat" not in built.stderr
    wheel = next((tmp_path / "dist").glob("duelq-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        files = set(z.namelist())
        meta = email.message_from_string(z.read(next(f for f in files
                                                     if f.endswith("METADATA"))).decode())
        entry = z.read(next(f for f in files if f.endswith("entry_points.txt"))).decode()
    for part in ("duelq/client/client.py", "duelq/wire/tensors.py", "duelq/server/service.py",
                 "duelq/server/core/native.c", "duelq/server/fronts/relay.py",
                 "duelq/kernels/learner_step.cu", "duelq/kernels/dueling_common.cuh",
                 "duelq/v1/learner.proto", "duelq/v1/learner_pb2.py", "duelq/apps/cli.py",
                 "duelq/apps/bench/run.py"):
        assert part in files, part
    assert not any(f.startswith(("tests/", "docs/")) or "__pycache__" in f for f in files)
    assert "duelq = duelq.apps.cli:main" in entry
    requires = meta.get_all("Requires-Dist")
    assert names([r for r in requires if "extra ==" not in r]) == CLIENT
    assert set(meta.get_all("Provides-Extra")) >= {"server", "cuda", "demo", "test"}
    assert meta["License-Expression"] == "Apache-2.0"

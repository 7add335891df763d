"""A client in another language, from the proto as it is: clients/node (Node.js,
@grpc/grpc-js, stubs by @grpc/proto-loader) against a real server with a token: GetInfo,
TrainSteps, a TrainStream and ComputeEntropy, with the same losses, TD errors and state as
the Python client's for the same batches."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np

from duelq.client import LearnerClient
from duelq.wire.types import Batch

from conftest import SMALL
from helpers import missing, tool

NODE_CLIENT = Path(__file__).resolve().parent.parent / "clients" / "node"
TOKEN = "n0de-t0ken"
ROWS, STEPS, STREAMED = 16, 3, 4


def node_batch(i: int, B: int, H: int, N: int) -> Batch:
    """example.js's batch(i, B, H, N), in NumPy."""
    b = np.arange(i * 17, i * 17 + B)[:, None]   # [B, 1]
    c = np.arange(H)[None, :]                    # [1, H]
    b1 = b[:, 0]
    return Batch(h_t=(((b * 7 + c * 3) % 11) / 8 - 0.625).astype(np.float32),
                 h_tp1=(((b * 5 + c * 2) % 13) / 16 - 0.375).astype(np.float32),
                 actions=((b1 * 3) % N).astype(np.int32),
                 rewards=(((b1 % 5) - 2) / 4).astype(np.float32),
                 dones=(b1 % 7 == 0).astype(np.float32),
                 discounts=np.full(B, 0.96875, np.float32))


def test_the_node_client_trains_as_the_python_client_does(make_server):
    node = tool("node", "apt-get install nodejs")
    if not (NODE_CLIENT / "node_modules" / "@grpc" / "grpc-js").is_dir():
        missing("clients/node's packages", "npm ci --prefix clients/node")
    server = make_server(token=TOKEN)
    done = subprocess.run([node, "example.js", "--target", server.target, "--token", TOKEN,
                           "--steps", str(STEPS), "--stream", str(STREAMED), "--rows", str(ROWS)],
                          cwd=NODE_CLIENT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    H, N = SMALL.hidden_dim, SMALL.n_actions
    assert out["info"] == {"backend": "reference", "hidden_dim": H, "n_actions": N, "step": 0}
    node_steps = out["steps"] + out["stream"]
    assert [s["step"] for s in node_steps] == [s["seq"] for s in node_steps] == list(
        range(1, STEPS + STREAMED + 1))

    twin = make_server(token=TOKEN)   # the same batches from Python, on a fresh server
    with LearnerClient(twin.target, token=TOKEN) as client:
        python = [client.train_step(node_batch(i, ROWS, H, N)) for i in range(STEPS)]
        python += list(client.train_stream(node_batch(STEPS + k, ROWS, H, N)
                                           for k in range(STREAMED)))
        entropy = client.compute_entropy(np.arange(40, dtype=np.int32) ** 2 % N,
                                         "action_entropy_ema", 0.5)
    assert [s["loss"] for s in node_steps] == [r.loss for r in python]
    assert [s["grad_norm"] for s in node_steps] == [r.grad_norm for r in python]
    for got, want in zip(node_steps, python):
        assert np.array(got["td_errors"], np.float32).tobytes() == want.td_errors.tobytes()
    assert out["entropy"] == {"entropy": entropy.entropy, "ema": entropy.ema,
                              "slot": entropy.slot}
    assert server.learner.snapshot().checksum() == twin.learner.snapshot().checksum()

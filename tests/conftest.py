"""Fixtures: a real in-process duelq server on a free port (reference backend)."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from duelq.server.core.batch import Batch
from duelq.server.core.config import LearnerConfig
from duelq.server.fronts import start_server
from duelq.server.server import LearnerServer, ServerOptions

#: Small sizes keep the suite fast; H and N still differ from every batch size used.
SMALL = LearnerConfig(hidden_dim=16, n_actions=5, lr=1e-3, step_entropy_slot="action_entropy_ema")


def random_batch(rng: np.random.Generator, rows: int, config: LearnerConfig = SMALL,
                 *, weights: bool = True) -> Batch:
    """A valid batch of ``rows`` transitions."""
    H, N = config.hidden_dim, config.n_actions
    return Batch(
        h_t=rng.standard_normal((rows, H), dtype=np.float32),
        h_tp1=rng.standard_normal((rows, H), dtype=np.float32),
        actions=rng.integers(0, N, rows, dtype=np.int32),
        rewards=rng.standard_normal(rows, dtype=np.float32),
        dones=(rng.random(rows) < 0.2).astype(np.float32),
        discounts=np.full(rows, 0.99 ** 3, np.float32),
        weights=rng.uniform(0.5, 1.5, rows).astype(np.float32) if weights else None)


@pytest.fixture
def make_server():
    """Start servers (``start_server`` arguments); all are stopped after the test."""
    servers: list[LearnerServer] = []

    def make(config: LearnerConfig = SMALL, *, interceptors=(), **options) -> LearnerServer:
        options.setdefault("port", 0)
        server = start_server(config, ServerOptions(**options), backend="reference",
                              interceptors=interceptors)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop(0)


@pytest.fixture
def server(make_server) -> LearnerServer:
    """A fresh server with the SMALL config."""
    return make_server()


@pytest.fixture
def dead_target() -> str:
    """host:port where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"

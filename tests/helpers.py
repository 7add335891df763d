"""Shared test helpers: random batches and configs, tools the tests run, and waiting for an
event."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable
import grpc

import numpy as np
import pytest

from duelq.server.core import Batch, LearnerConfig


def random_batch(rng: np.random.Generator, B: int, H: int, N: int, *,
                 weights: bool = True, done_rate: float = 0.2) -> Batch:
    """A valid batch of fresh random inputs (never zeros)."""
    return Batch(
        h_t=rng.normal(size=(B, H)).astype(np.float32),
        h_tp1=rng.normal(size=(B, H)).astype(np.float32),
        actions=rng.integers(0, N, size=B).astype(np.int32),
        rewards=rng.normal(size=B).astype(np.float32),
        dones=(rng.random(B) < done_rate).astype(np.float32),
        discounts=rng.uniform(0.5, 1.0, size=B).astype(np.float32),
        weights=rng.uniform(0.1, 1.5, size=B).astype(np.float32) if weights else None,
    )


def small_config(**overrides) -> LearnerConfig:
    values = dict(hidden_dim=8, n_actions=3, isv_size=16,
                  isv_slots={"action_entropy_ema": 5, "policy_entropy_ema": 2})
    values.update(overrides)
    return LearnerConfig(**values)


def missing(what: str, install: str) -> None:
    """Skip a test for lack of ``what`` here; fail it in CI, whose .ci/run installs it
    (``install`` says how)."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing; .ci/run should have installed it ({install})")
    pytest.skip(f"{what} is not installed ({install})")


def tool(name: str, install: str) -> str:
    """The path of command ``name``, on PATH or beside this Python (see :func:`missing`)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        missing(name, install)
    return found


def wait_for(predicate: Callable[[], object], timeout: float = 30, what: str = "") -> None:
    """Poll ``predicate`` until it holds; fail only if it never does within ``timeout``
    seconds (generous: a busy machine is slow, never wrong)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what or "the awaited event never came"
        time.sleep(0.005)


class RelayWork:
    """A relay.RelayService whose work is the functions given: ``prepare(data, method)``,
    ``apply(job, call)``, ``refuse(exc, method)`` (default: INTERNAL, the exception's
    words), ``prepare_packed(packed, key, method)`` and ``call(method, request, call)`` (default:
    refused); it counts what the metrics would."""

    def __init__(self, prepare, apply, refuse=None, *, prepare_packed=None, call=None):
        self._prepare, self._apply = prepare, apply
        self._refuse = refuse or (lambda exc, method: (grpc.StatusCode.INTERNAL, str(exc)))
        self._prepare_packed, self._call = prepare_packed, call
        self.depth = self.opened = self.closed = 0   # requests not answered; streams

    def prepare(self, request, method):
        return self._prepare(request, method)

    def prepare_packed(self, packed, key, method):
        if self._prepare_packed is None:
            raise RuntimeError("a packed request reached a relay that takes none")
        return self._prepare_packed(packed, key, method)

    def apply(self, job, call):
        return self._apply(job, call)

    def refusal(self, exc, method):
        return self._refuse(exc, method)

    def call(self, method, request, call):
        if self._call is None:
            return grpc.StatusCode.UNIMPLEMENTED, b"this relay takes no small rpcs"
        return self._call(method, request, call)

    def received(self, front):
        self.depth += 1

    def answered(self):
        self.depth -= 1

    def stream_opened(self):
        self.opened += 1

    def stream_closed(self):
        self.closed += 1

    def front_refused(self, method, code, count=1):
        pass


def replies(stream, n: int) -> list:
    """The next ``n`` replies (code, payload) in a FrontStream's inbox, 10 s at most each."""
    from duelq.server.fronts.relay import REPLY
    got = []
    while len(got) < n:
        kind, item = stream.inbox.get(timeout=10)
        if kind == REPLY:
            got.append(item)
    return got

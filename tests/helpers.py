"""Shared test helpers: random batches and configs, the relay's work in its own tests."""

from __future__ import annotations

import grpc
import numpy as np

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


class RelayWork:
    """A relay.RelayService whose work is the functions given: ``prepare(data, unary)``,
    ``apply(job, call)``, ``refuse(exc, unary)`` (default: INTERNAL, the exception's
    words), ``prepare_packed(packed, key)`` and ``call(method, request, call)`` (default:
    refused); it counts what the metrics would."""

    def __init__(self, prepare, apply, refuse=None, *, prepare_packed=None, call=None):
        self._prepare, self._apply = prepare, apply
        self._refuse = refuse or (lambda exc, unary: (grpc.StatusCode.INTERNAL, str(exc)))
        self._prepare_packed, self._call = prepare_packed, call
        self.depth = self.opened = self.closed = 0   # requests not answered; streams

    def prepare(self, request, unary):
        return self._prepare(request, unary)

    def prepare_packed(self, packed, key):
        if self._prepare_packed is None:
            raise RuntimeError("a packed request reached a relay that takes none")
        return self._prepare_packed(packed, key)

    def apply(self, job, call):
        return self._apply(job, call)

    def refusal(self, exc, unary):
        return self._refuse(exc, unary)

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

    def front_refused(self, method, code):
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

"""Request plans: how every train request of one wire layout becomes a checked Batch.

Actors send one shape of batch after another, so most requests share their framing with
the one before (a remembered layout, :func:`duelq.server.wire.known_layout`): the same
fields with the same dtypes and shapes at the same offsets.  Decoding such a request and
checking its dtypes and shapes gives the same answer every time; only the values differ.
A :class:`RequestPlan`, learned from the first request of a layout that decoded to views
of its bytes and passed the learner's checks unchanged, makes the arrays of the next ones
directly (one ``numpy.frombuffer`` each) and lets the learner skip those checks.  The
values are still checked: on the device by a backend that checks them as it reads them,
else on the host (``Learner.prepare(shapes_checked=True)``).
"""

from __future__ import annotations

import threading

import numpy as np

from .batch import Batch, HostSpan

MAX_PLANS = 64   # as many as wire.py remembers layouts


class RequestPlan:
    """The arrays of one layout's requests: (dtype, element count, shape, byte offset) each,
    in :meth:`Batch.arrays` order."""

    __slots__ = ("fields", "has_weights", "offsets", "sizes", "nbytes")

    def __init__(self, batch: Batch, offsets: tuple[int, ...]):
        arrays = batch.arrays()
        self.fields = tuple((a.dtype, a.size, a.shape if a.ndim != 1 else None, offset)
                            for a, offset in zip(arrays, offsets))
        self.has_weights = batch.weights is not None
        self.offsets = offsets
        self.sizes = tuple(a.nbytes for a in arrays)
        self.nbytes = max(o + n for o, n in zip(offsets, self.sizes))

    def batch(self, data, address: int | None = None) -> Batch:
        """The Batch of a request of this plan's layout (``data``: its bytes, lying at host
        ``address`` when known; the batch's arrays view them)."""
        arrays = [np.frombuffer(data, dtype, count, offset) if shape is None else
                  np.frombuffer(data, dtype, count, offset).reshape(shape)
                  for dtype, count, shape, offset in self.fields]
        if not self.has_weights:
            arrays.append(None)
        span = (None if address is None else
                HostSpan(address, self.nbytes, self.offsets, self.sizes))
        return Batch(*arrays, span=span)


class Plans:
    """A bounded map from remembered layouts to plans, for one ``learner`` (thread-safe): a
    new learner gets a new map, read together with it, so no plan outlives its learner."""

    def __init__(self, learner=None):
        self.learner = learner
        self._plans: dict[object, RequestPlan] = {}
        self._lock = threading.Lock()

    def get(self, layout) -> RequestPlan | None:
        return self._plans.get(layout) if layout is not None else None

    def learn(self, layout, decoded: Batch, checked: Batch,
              offsets: tuple[int, ...] | None) -> None:
        """Remember ``layout``'s plan when its request decoded to views of its payloads
        (``offsets`` given: see ``service.decode_batch``) and the learner's checks gave
        every array back unchanged (``checked``)."""
        if layout is None or offsets is None or layout in self._plans:
            return
        if not all(a is b for a, b in zip(decoded.arrays(), checked.arrays())) \
                or (decoded.weights is None) != (checked.weights is None):
            return
        plan = RequestPlan(decoded, offsets)
        with self._lock:
            if len(self._plans) >= MAX_PLANS:
                del self._plans[next(iter(self._plans))]   # the oldest
            self._plans[layout] = plan

"""Train and insert requests packed by the front process, for the learner process to copy
as they are.

With ``--front-processes`` the learner process's one relay thread is the server's serial
path (server/fronts/relay.py).  A request's bytes pass through a front anyway, so the front
writes the request's arrays into its relay buffer already in the step kernel's packed input
layout (:func:`duelq.server.core.batch.packed_layout`) and sends a descriptor: the learner
parses nothing and copies the buffer's words to the device in one call
(:class:`duelq.server.core.batch.PackedBatch`).

A request packs when its framing is canonical (server/framing.py) and its fields have dtypes
and shapes every learner takes as they are: h_t and h_tp1 [B, H] of one feature dtype,
actions int32 [B], rewards, dones, discounts and (optional) weights float32 [B], and a key
that parses.  An InsertStream request has TrainRequest's framing with field 7 named
priorities, so it packs the same way, its priorities in the weights' place, and the
learner copies its words to the device as they lie.  Anything else goes as it came, to the
learner's own checks and refusals (the learner packs it on the host: the device sees one
input form; relay.py says why that path stays).  The learner checks what a front cannot
know (H, the batch size limit) and words a refusal as for the unpacked bytes.
The front learns once per wire layout whether and where its requests pack.

The descriptor (a PACKED frame's payload): B, H, the features' dtype (an index into
``FEATURE_DTYPES``) and whether weights follow, then the key's bytes (a RequestKey).
"""

from __future__ import annotations

import functools
import struct
import threading
from typing import Callable

import numpy as np

from duelq.wire.tensors import decode
from duelq.wire.types import FEATURE_DTYPES
from duelq.v1 import learner_pb2 as pb

from duelq.server.core.batch import PackedBatch, packed_layout
from duelq.server.framing import MAX_LAYOUTS, TENSOR_FIELDS, known_layout, parse_train_request

DESCRIPTOR = struct.Struct("<IIBB")   # B, H, features' dtype (FEATURE_DTYPES index), weights
STREAM_MIN_BYTES = 1 << 16            # arrays the Packer's stream copy writes (B·H features)
_VECTOR = np.dtype(np.float32)
_ACTIONS = np.dtype(np.int32)


def read_packed(payload: bytes, data: memoryview, address: int
                ) -> tuple[PackedBatch, bytes]:
    """(the packed batch in ``data``, lying at host ``address``; its key's bytes) of a
    PACKED frame's ``payload``.  ValueError when the descriptor is not one a front writes,
    or ``data`` is shorter than its layout."""
    if len(payload) < DESCRIPTOR.size:
        raise ValueError(f"a packed request's descriptor has {len(payload)} bytes, "
                         f"not {DESCRIPTOR.size}")
    rows, hidden, dtype, weights, words = _described(payload[:DESCRIPTOR.size])
    if 4 * words > len(data):
        raise ValueError(f"a packed request of {4 * words} bytes in {len(data)}")
    return (PackedBatch(rows, hidden, dtype, weights, words, data, address),
            payload[DESCRIPTOR.size:])


@functools.lru_cache(maxsize=MAX_LAYOUTS)
def _described(descriptor: bytes) -> tuple[int, int, np.dtype, bool, int]:
    """(B, H, the features' dtype, weights, words) of a descriptor; worked out once for
    each of the few that an actor's requests repeat."""
    rows, hidden, kind, weights = DESCRIPTOR.unpack(descriptor)
    if kind >= len(FEATURE_DTYPES) or weights > 1 or rows < 1 or hidden < 1:
        raise ValueError(f"a packed request's descriptor is malformed: B = {rows}, H = "
                         f"{hidden}, dtype {kind}, weights {weights}")
    dtype = FEATURE_DTYPES[kind]
    _, words = packed_layout(rows, hidden, dtype.itemsize, bool(weights))
    return rows, hidden, dtype, bool(weights), words


class _Plan:
    """How the requests of one layout pack: their arrays' copies and descriptor."""

    __slots__ = ("copies", "nbytes", "descriptor")

    def __init__(self, copies: tuple, nbytes: int, descriptor: bytes):
        self.copies = copies            # ((request offset, packed offset, bytes), …)
        self.nbytes = nbytes            # bytes of the packed layout
        self.descriptor = descriptor    # DESCRIPTOR's bytes


def _plan(data: bytes) -> tuple[object, _Plan | None]:
    """(the layout of request ``data``, how its requests pack or None when they do not);
    the layout is None when framing.py keeps none for it."""
    request = parse_train_request(data)
    if request is None or request.layout is None:
        return None, None
    layout = request.layout
    present = [name for name in TENSOR_FIELDS if request.HasField(name)]
    if present not in (list(TENSOR_FIELDS[:6]), list(TENSOR_FIELDS)):
        return layout, None
    tensors = [getattr(request, name) for name in present]
    try:
        arrays = [decode(t, name, widen=False) for t, name in zip(tensors, present)]
    except Exception:  # noqa: BLE001 — the learner refuses it, in its words
        return layout, None
    h_t, h_tp1, actions = arrays[:3]
    rows = actions.shape[0] if actions.ndim == 1 else 0
    if not (h_t.dtype == h_tp1.dtype and h_t.dtype in FEATURE_DTYPES and h_t.ndim == 2
            and h_t.shape == h_tp1.shape and h_t.shape[0] == rows >= 1 and h_t.shape[1] >= 1
            and actions.dtype == _ACTIONS
            and all(a.dtype == _VECTOR and a.shape == (rows,) for a in arrays[3:])):
        return layout, None
    has_weights = len(arrays) == 7
    offsets, words = packed_layout(rows, h_t.shape[1], h_t.dtype.itemsize, has_weights)
    copies = tuple((t.offset, at, a.nbytes) for t, at, a in zip(tensors, offsets, arrays))
    descriptor = DESCRIPTOR.pack(rows, h_t.shape[1], FEATURE_DTYPES.index(h_t.dtype),
                                 has_weights)
    return layout, _Plan(copies, 4 * words, descriptor)


class Packer:
    """A front process's packing of train and insert requests into relay buffers
    (thread-safe).

    ``stream_copy`` (server/core/native.py's): where :meth:`pack` is given the buffer's address and
    the request as ``bytes``, arrays of :data:`STREAM_MIN_BYTES` or more are written with
    non-temporal stores, which leave the caches shared with the learner process's thread
    alone (only the device's copy engine reads a buffer)."""

    def __init__(self, stream_copy: Callable[[int, bytes, int, int], None] | None = None):
        self._plans: dict[object, _Plan | None] = {}   # by wire layout
        self._lock = threading.Lock()
        self._stream_copy = stream_copy

    def pack(self, data: bytes, buffer: np.ndarray, address: int | None = None) -> bytes | None:
        """Write request ``data``'s arrays into ``buffer`` (uint8; ``address``, when given,
        must be where ``buffer`` starts: the large arrays then go through the stream copy) in
        the packed layout and return the descriptor to send, with the key's canonical bytes;
        None (``buffer`` left as it was) when the request does not pack, or does not fit."""
        layout = known_layout(data)
        plan = self._plans.get(layout, False) if layout is not None else False
        if plan is False:   # a layout not seen here
            layout, plan = _plan(data)
            if layout is not None:
                with self._lock:
                    if len(self._plans) >= MAX_LAYOUTS:
                        del self._plans[next(iter(self._plans))]   # the oldest
                    self._plans[layout] = plan
        if plan is None or plan.nbytes > buffer.size:
            return None
        key = b""
        if layout.key is not None:   # (start, stop) of the key's bytes
            try:   # canonical, as the learner echoes them in its answer
                key = pb.RequestKey.FromString(data[layout.key[0]:layout.key[1]]
                                               ).SerializeToString()
            except Exception:  # noqa: BLE001 — upb's DecodeError: the learner words it
                return None
        # Copied holding the GIL: a copy that lets it go (NumPy's, past 500 elements) must
        # then wait for the front's busy gRPC threads to give it back, up to the switch
        # interval (5 ms) each time.
        source, target = memoryview(data), buffer.data
        stream = (self._stream_copy if address is not None and type(data) is bytes
                  else None)
        for start, at, n in plan.copies:   # in bounds: the layout is one of len(data)
            if stream is not None and n >= STREAM_MIN_BYTES:
                stream(address + at, data, start, n)
            else:
                target[at:at + n] = source[start:start + n]
        return plan.descriptor + key

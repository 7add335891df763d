"""A zero-copy parser for the canonical protobuf encoding of ``TrainRequest`` and
``InsertStreamRequest`` (the same framing: seven tensors, then the key; field 7 is a
train request's ``weights`` and an insert's ``priorities``).

gRPC hands the server each request as one ``bytes`` object.  protobuf (upb)
copies every tensor's data into its arena and again on each read of
``Tensor.data``: two fresh megabyte copies per step at B = 1024, each
page-faulting.  :func:`parse_train_request` instead reads the framing itself
and views each tensor's data as a ``memoryview`` slice of gRPC's bytes, so
``numpy.frombuffer`` in :func:`duelq.wire.tensors.decode` copies nothing.

It accepts only the canonical form that :func:`duelq.wire.tensors.tensor_wire`
(and protobuf itself) writes: top-level fields 1–8 as length-delimited fields,
each at most once, in increasing order; inside a Tensor ``dtype`` (one-byte
varint), packed ``shape`` (each dimension < 2**63) and ``data``, each at most
once, in that order.  The key is parsed by upb from its (small) slice.  For
anything else (unknown fields, repeated or out-of-order fields, unpacked shapes,
malformed bytes) it returns None and the deserializers fall back to protobuf's
``FromString``, so the result (or the parse error, which the server answers
INVALID_ARGUMENT) is exactly upb's.
"""

from __future__ import annotations

import threading

from duelq.v1 import learner_pb2 as pb
from duelq.wire.tensors import INSERT_FIELDS, TRAIN_FIELDS

TENSOR_FIELDS = tuple(TRAIN_FIELDS)
INSERT_TENSOR_FIELDS = tuple(INSERT_FIELDS)
_EMPTY = memoryview(b"")


class _Fallback(Exception):
    """Not the canonical form: let upb parse it."""


class WireTensor:
    """A Tensor read from the wire: ``data`` is a memoryview of the request's bytes, from
    byte ``offset`` of the request on."""

    __slots__ = ("dtype", "shape", "data", "offset")

    def __init__(self, dtype: int = 0, shape: tuple[int, ...] = (), data=_EMPTY,
                 offset: int = 0):
        self.dtype, self.shape, self.data, self.offset = dtype, shape, data, offset

    def __repr__(self) -> str:
        return f"WireTensor(dtype={self.dtype}, shape={self.shape}, {len(self.data)} bytes)"


class _WireRequest:
    """What the service reads of a request: the tensors (``FIELDS``, by field number),
    ``key`` and ``HasField``; ``layout``: the remembered layout it was read with
    (:func:`known_layout`), or None, and ``view``: the request's bytes."""

    __slots__ = ("key", "layout", "view", "_present")
    FIELDS: tuple[str, ...] = ()   # the tensor fields' names, by field number
    PROTO: type = pb.TrainRequest   # the protobuf message it stands for

    def __init__(self, present: dict, layout: "_Layout | None" = None,
                 view: memoryview = _EMPTY):
        self._present, self.layout, self.view = present, layout, view
        for name in self.FIELDS:
            setattr(self, name, present.get(name) or WireTensor())
        key = present.get("key")
        self.key = key if key is not None else pb.RequestKey()

    def HasField(self, name: str) -> bool:  # noqa: N802 — protobuf's spelling
        if name != "key" and name not in self.FIELDS:
            raise ValueError(f'Protocol message {self.PROTO.DESCRIPTOR.name} has no singular '
                             f'"{name}" field.')
        return name in self._present


class WireTrainRequest(_WireRequest):
    """A ``TrainRequest`` read from the wire."""

    __slots__ = TENSOR_FIELDS
    FIELDS, PROTO = TENSOR_FIELDS, pb.TrainRequest


class WireInsertRequest(_WireRequest):
    """An ``InsertStreamRequest`` read from the wire."""

    __slots__ = INSERT_TENSOR_FIELDS
    FIELDS, PROTO = INSERT_TENSOR_FIELDS, pb.InsertStreamRequest


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, next position) of a varint of at most 9 bytes (value < 2**63) in [pos, end)."""
    result = shift = 0
    while pos < end and shift <= 56:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
    raise _Fallback


def _packed(buf: bytes) -> tuple[int, ...]:
    """Packed varints of at most 9 bytes each (each < 2**63), as a tuple."""
    dims = []
    value = shift = 0
    for b in buf:
        value |= (b & 0x7F) << shift
        if b < 0x80:
            dims.append(value)
            value = shift = 0
        else:
            shift += 7
            if shift > 56:
                raise _Fallback
    if shift:                                     # the last varint is unterminated
        raise _Fallback
    return tuple(dims)


def _tensor(data: bytes, pos: int, end: int) -> tuple[int, tuple[int, ...], int, int]:
    """The Tensor in [pos, end): (dtype, shape, data start, data stop)."""
    dtype, shape, start, stop = 0, (), end, end
    if pos < end and data[pos] == 0x08:           # dtype = 1, varint (one byte)
        if pos + 1 >= end or data[pos + 1] >= 0x80:
            raise _Fallback
        dtype = data[pos + 1]
        pos += 2
    if pos < end and data[pos] == 0x12:           # shape = 2, packed varints
        length, pos = _varint(data, pos + 1, end)
        packed_end = pos + length
        if packed_end > end:
            raise _Fallback
        shape = _packed(data[pos:packed_end])
        pos = packed_end
    if pos < end and data[pos] == 0x1A:           # data = 3, bytes
        length, pos = _varint(data, pos + 1, end)
        start, stop = pos, pos + length
        if stop > end:
            raise _Fallback
        pos = stop
    if pos != end:
        raise _Fallback
    return dtype, shape, start, stop


class _Layout:
    """Where the fields of one canonical request lie, and the bytes that say so.

    The parse reads only framing: each field's tag and length and, inside a Tensor, its
    dtype, shape and data length, which sit in one run of bytes before the data (``heads``:
    (offset, bytes) per field).  A request of the same length with the same bytes in those
    runs therefore parses to the same fields at the same offsets: only the data and the
    key's contents differ.  Actors send one shape of batch after another, so the parse of
    their requests is mostly these few comparisons.
    """

    __slots__ = ("heads", "tensors", "key")

    def __init__(self, heads: tuple, tensors: tuple, key: tuple[int, int] | None):
        self.heads = heads        # ((offset, bytes), …), one per field
        self.tensors = tensors    # ((field number, dtype, shape, data start, data stop), …)
        self.key = key            # (start, stop) of the key's contents, or None

    def matches(self, data) -> bool:
        return all(data[at:at + len(head)] == head for at, head in self.heads)

    def read(self, data, view: memoryview, kept: bool, kind: type[_WireRequest]
             ) -> _WireRequest | None:
        names = kind.FIELDS
        present: dict = {names[number - 1]: WireTensor(dtype, shape, view[start:stop]
                                                       if stop > start else _EMPTY, start)
                         for number, dtype, shape, start, stop in self.tensors}
        if self.key is not None:
            key = _key(data, *self.key)
            if key is None:
                return None
            present["key"] = key
        return kind(present, self if kept else None, view)


_LAYOUTS: dict[int, _Layout] = {}   # by request length: the last layout seen
MAX_LAYOUTS = 64   # request lengths remembered (the fronts keep as many packing plans)
_HEADS_MAX = 1024   # framing bytes of a layout worth keeping (a batch's: ≈ 60 + the key's)
_layouts_lock = threading.Lock()


def _remember(n: int, layout: _Layout) -> None:
    with _layouts_lock:
        _LAYOUTS.pop(n, None)
        if len(_LAYOUTS) >= MAX_LAYOUTS:
            del _LAYOUTS[next(iter(_LAYOUTS))]   # the oldest
        _LAYOUTS[n] = layout


def _key(data, start: int, stop: int) -> pb.RequestKey | None:
    try:
        return pb.RequestKey.FromString(bytes(data[start:stop]))
    except Exception:  # noqa: BLE001 — upb's DecodeError: let the full parse say it
        return None


def _bytes_view(data) -> memoryview | None:
    """A flat byte view of ``data`` (bytes, or a memoryview such as a shared-memory slot)."""
    if type(data) is memoryview:
        return data.cast("B") if data.ndim == 1 and data.itemsize == 1 else None
    return memoryview(data) if type(data) is bytes else None


def known_layout(data) -> _Layout | None:
    """The remembered layout whose framing ``data`` has, if any: ``data`` then parses to that
    layout's fields at its offsets (only the tensors' bytes and the key's may differ)."""
    layout = _LAYOUTS.get(len(data))
    if layout is None:
        return None
    if type(data) is not bytes:
        data = _bytes_view(data)
        if data is None:
            return None
    return layout if layout.matches(data) else None


def parse_train_request(data) -> WireTrainRequest | None:
    """``data`` (bytes, or a flat byte memoryview such as a shared-memory slot) in the
    canonical encoding as a :class:`WireTrainRequest`; None otherwise."""
    return _parse(data, WireTrainRequest)


def parse_insert_request(data) -> WireInsertRequest | None:
    """:func:`parse_train_request` for an ``InsertStreamRequest``."""
    return _parse(data, WireInsertRequest)


def _parse(data, kind: type[_WireRequest]) -> _WireRequest | None:
    view = _bytes_view(data)
    if view is None:
        return None
    if type(data) is memoryview:
        data = view
    n = len(data)
    layout = _LAYOUTS.get(n)
    if layout is not None and layout.matches(data):
        return layout.read(data, view, True, kind)
    heads, tensors, key = [], [], None
    pos, last = 0, 0
    try:
        while pos < n:
            tag = data[pos]
            field = tag >> 3
            if tag & 7 != 2 or not last < field <= 8:   # also rejects multi-byte tags
                return None
            last, begin = field, pos
            length, pos = _varint(data, pos + 1, n)
            end = pos + length
            if end > n:
                return None
            if field == 8:
                key = (pos, end)
                heads.append((begin, bytes(data[begin:pos])))
            else:
                tensor = _tensor(data, pos, end)              # (dtype, shape, start, stop)
                tensors.append((field, *tensor))
                heads.append((begin, bytes(data[begin:tensor[2]])))
            pos = end
    except _Fallback:
        return None
    layout = _Layout(tuple(heads), tuple(tensors), key)
    kept = sum(len(head) for _, head in heads) <= _HEADS_MAX
    request = layout.read(data, view, kept, kind)
    if request is not None and kept:
        _remember(n, layout)
    return request


def _deserialize(data: bytes | memoryview, kind: type[_WireRequest]):
    """The zero-copy parse of the canonical form, else protobuf's (whose errors the server
    answers INVALID_ARGUMENT)."""
    parsed = _parse(data, kind)
    return parsed if parsed is not None else kind.PROTO.FromString(bytes(data))


def train_request_deserializer(data: bytes | memoryview):
    """gRPC's request deserializer for TrainStep and TrainStream (:func:`_deserialize`)."""
    return _deserialize(data, WireTrainRequest)


def insert_request_deserializer(data: bytes | memoryview):
    """gRPC's request deserializer for InsertStream (:func:`_deserialize`)."""
    return _deserialize(data, WireInsertRequest)


def undecodable(method: str, exc: Exception) -> str:
    """What the server says of request bytes that do not parse as ``method``'s message."""
    return f"cannot parse as the {method} request message ({type(exc).__name__}: {exc})"

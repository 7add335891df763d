"""The Tensor codec: numpy arrays ↔ ``duelq.v1.Tensor`` (raw little-endian row-major bytes).

Decoding checks the byte length against shape × itemsize before touching the
data, then views the bytes with ``numpy.frombuffer`` (no per-element work; the
one copy is protobuf's, which hands out a field's bytes as a new object on
each read; bfloat16 is then widened to float32).  Encoding copies once
(``tobytes``) plus protobuf's copy into the message; build messages from
:func:`tensor_fields` dicts, not from ready Tensors, to avoid a third.  bfloat16 is the
upper 16 bits of a float32; it is produced by round-to-nearest-even and NaN
stays NaN.  Used by both the client (encode requests, decode responses) and
the server (decode requests, encode responses).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from duelq.v1 import learner_pb2 as pb
from duelq.wire.types import BFLOAT16, wrong_dtype

#: Wire dtype name → (enum value, little-endian numpy dtype of the raw bytes).
WIRE_DTYPES: dict[str, tuple[int, np.dtype]] = {
    "float32": (pb.DTYPE_FLOAT32, np.dtype("<f4")),
    "float16": (pb.DTYPE_FLOAT16, np.dtype("<f2")),
    "bfloat16": (pb.DTYPE_BFLOAT16, np.dtype("<u2")),
    "int32": (pb.DTYPE_INT32, np.dtype("<i4")),
    "uint8": (pb.DTYPE_UINT8, np.dtype("u1")),
    "bool": (pb.DTYPE_BOOL, np.dtype("?")),
}
_BY_ENUM = {enum: (name, raw) for name, (enum, raw) in WIRE_DTYPES.items()}
MAX_NDIM = 8
#: TrainRequest's and InsertStreamRequest's tensor fields in field order, by name: their
#: field numbers (read from learner.proto's descriptor); the key follows them in both.
TRAIN_FIELDS, INSERT_FIELDS = ({f.name: f.number for f in message.DESCRIPTOR.fields
                                 if f.name != "key"}
                                for message in (pb.TrainRequest, pb.InsertStreamRequest))
KEY_FIELD = pb.TrainRequest.DESCRIPTOR.fields_by_name["key"].number
#: Raw dtype → enum of the wire dtypes an array may already be in (not bfloat16: uint16).
_ENUM_BY_RAW = {raw: enum for name, (enum, raw) in WIRE_DTYPES.items() if name != "bfloat16"}


def dtype_name(enum: int) -> str:
    """A Dtype value as messages spell it: "float32" for DTYPE_FLOAT32, "unspecified" for 0,
    "17 (not a Dtype)" for a number the enum lacks."""
    entry = _BY_ENUM.get(enum)
    if entry is not None:
        return entry[0]
    return "unspecified" if enum == pb.DTYPE_UNSPECIFIED else f"{enum} (not a Dtype)"


def floating(dtype: np.dtype) -> bool:
    """Whether ``dtype`` holds floating-point values: numpy's kinds and ml_dtypes' bfloat16."""
    return dtype.kind == "f" or dtype == BFLOAT16


class TensorError(ValueError):
    """A tensor that cannot be encoded or decoded; ``field`` names it.  Its text is the
    server's "field: problem" form."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


_bad = TensorError


def encode(array: np.ndarray, field: str, *, wire: str | None = None) -> pb.Tensor:
    """A numpy array as a Tensor; ``wire`` picks the wire dtype (default: the array's).

    ``wire="bfloat16"`` sends ``ml_dtypes.bfloat16`` data as it is and converts
    float32/float16 data; otherwise the array's dtype must be one of
    :data:`WIRE_DTYPES` (or be losslessly the same kind).
    """
    return pb.Tensor(**tensor_fields(array, field, wire=wire))


def tensor_fields(array: np.ndarray, field: str, *, wire: str | None = None) -> dict:
    """The fields of :func:`encode`'s Tensor as a dict, to build a message in place.

    ``pb.TrainRequest(h_t=tensor_fields(...))`` copies the data once; passing a
    ready Tensor instead copies it a second time (protobuf merges it in).
    """
    enum, shape, data = wire_array(array, field, wire=wire)
    return {"dtype": enum, "shape": shape, "data": data.tobytes()}


def wire_array(array: np.ndarray, field: str, *,
               wire: str | None = None) -> tuple[int, tuple[int, ...], np.ndarray]:
    """:func:`encode`'s checks and conversion: (dtype enum, shape, the raw data as a
    C-contiguous little-endian array), without copying data that is already so."""
    if type(array) is np.ndarray and 1 <= array.ndim <= MAX_NDIM and array.flags.c_contiguous:
        enum = _ENUM_BY_RAW.get(array.dtype)  # the common case, without the checks' cost
        if enum is not None and (wire is None or wire == _BY_ENUM[enum][0]):
            return enum, array.shape, array
    a = np.asarray(array)
    name = wire or a.dtype.name
    if name not in WIRE_DTYPES:
        raise _bad(field, wrong_dtype(WIRE_DTYPES, a.dtype.name))
    if a.ndim > MAX_NDIM:
        raise _bad(field, f"has {a.ndim} dimensions, at most {MAX_NDIM}")
    enum, raw = WIRE_DTYPES[name]
    if name == "bfloat16":   # bfloat16 data (a model's output, say) goes as its bits
        if a.dtype != BFLOAT16 and a.dtype.kind != "f":
            raise _bad(field, f"bfloat16 needs floating-point data, got {a.dtype}")
        if a.dtype != BFLOAT16:   # through float32, rounded to nearest even (ml_dtypes)
            with np.errstate(invalid="ignore"):   # a signalling NaN stays a NaN, silently
                a = np.asarray(a, np.float32).astype(BFLOAT16)
        data = np.ascontiguousarray(a).view(np.uint16).astype(raw, copy=False)
    else:
        if a.dtype.name != name:
            raise _bad(field, f"dtype {a.dtype} does not match wire dtype {name}")
        data = np.ascontiguousarray(a, dtype=raw)
    return enum, a.shape, data


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of an unsigned integer."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def tensor_wire(number: int, array: np.ndarray, field: str, *,
                wire: str | None = None) -> list:
    """A Tensor as field ``number`` of its parent message, in protobuf wire format.

    Pieces to join (``b"".join``): header bytes, then the array's own buffer, so
    the data is copied once, into the joined message.  Parses to the same Tensor
    as :func:`encode` (shape packed, as proto3 writes it).
    """
    enum, shape, data = wire_array(array, field, wire=wire)
    head = tensor_head(number, enum, shape, data.nbytes)
    return [head, memoryview(data).cast("B")] if data.nbytes else [head]


@functools.lru_cache(maxsize=256)
def tensor_head(number: int, enum: int, shape: tuple[int, ...], nbytes: int) -> bytes:
    """Field ``number``'s tag and length, then the Tensor's dtype, shape and data's length:
    the same for every batch of one shape, so built once."""
    dims = b"".join(varint(d) for d in shape)
    head = b"\x08" + varint(enum) + (b"\x12" + varint(len(dims)) + dims if dims else b"")
    if not nbytes:
        return varint(number << 3 | 2) + varint(len(head)) + head
    head += b"\x1a" + varint(nbytes)
    return varint(number << 3 | 2) + varint(len(head) + nbytes) + head


def decode(tensor: pb.Tensor, field: str, *, widen: bool = True,
           dtypes: tuple[str, ...] | None = None) -> np.ndarray:
    """A Tensor as a (read-only) numpy array; bfloat16 comes back as float32, or with
    ``widen=False`` as the ``ml_dtypes.bfloat16`` view of its bytes.

    Raises :class:`TensorError` naming ``field`` when the dtype is not one of ``dtypes``
    (default: any of :data:`WIRE_DTYPES`), the shape is malformed or the byte length is
    not prod(shape) × itemsize.
    """
    entry = _BY_ENUM.get(tensor.dtype)
    wanted = WIRE_DTYPES if dtypes is None else dtypes
    if entry is None or entry[0] not in wanted:
        raise _bad(field, wrong_dtype(wanted, dtype_name(tensor.dtype)))
    name, raw = entry
    shape = tuple(tensor.shape)
    if len(shape) > MAX_NDIM:
        raise _bad(field, f"has {len(shape)} dimensions, at most {MAX_NDIM}")
    if min(shape, default=0) < 0:
        raise _bad(field, f"shape {list(shape)} has a negative dimension")
    expected = math.prod(shape) * raw.itemsize
    data = tensor.data  # a copy out of the message each time it is read: read it once
    if len(data) != expected:
        raise _bad(field, f"has {len(data)} bytes, but shape {list(shape)} of {name} "
                          f"needs {expected}")
    if name == "bool":
        flags = np.frombuffer(data, np.uint8)
        if flags.size and flags.max() > 1:
            raise _bad(field, "bool bytes must be 0 or 1")
    a = np.frombuffer(data, raw)
    if len(shape) != 1:  # 1-D: frombuffer's own shape (one call less on the hot path)
        try:
            a = a.reshape(shape)
        except ValueError as exc:  # e.g. [2**62, 2**62, 0]: zero bytes, unrepresentable dims
            raise _bad(field, f"shape {list(shape)} is not a valid array shape ({exc})") \
                from None
    if name != "bfloat16":
        return a
    return a.view(BFLOAT16).astype(np.float32) if widen else a.view(BFLOAT16)

"""The Tensor codec: byte layout, bfloat16 rounding, and size checks before decoding."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest


from duelq.wire.tensors import TensorError, decode, encode
from duelq.v1 import learner_pb2 as pb


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.uint8, np.bool_])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 0, 4)])
def test_round_trip_is_exact(dtype, shape):
    a = (np.random.default_rng(0).standard_normal(shape) * 50).astype(dtype)
    tensor = encode(a, "x")
    assert list(tensor.shape) == list(shape) and len(tensor.data) == a.nbytes
    b = decode(tensor, "x")
    assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)


def test_bytes_are_little_endian_row_major_whatever_the_input_layout():
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    expected = a.astype("<i4").tobytes(order="C")
    assert encode(np.asfortranarray(a), "x").data == expected
    assert encode(a.astype(">i4"), "x").data == expected
    assert encode(a.T.copy().T, "x").data == expected


def test_decode_is_a_read_only_view_of_the_message_bytes():
    b = decode(encode(np.ones((4, 4), np.float32), "x"), "x")
    assert not b.flags.writeable


@pytest.mark.parametrize("value, bits", [
    (1.0, 0x3F80),
    (1 + 1 / 256, 0x3F80),     # halfway between 0x3F80 and 0x3F81: to even
    (1 + 3 / 256, 0x3F82),     # halfway between 0x3F81 and 0x3F82: to even
    (1 + 1.01 / 256, 0x3F81),  # just past halfway: up
    (-2.0, 0xC000),
    (-0.0, 0x8000),
    (np.inf, 0x7F80),
    (-np.inf, 0xFF80),
])
def test_bfloat16_rounds_to_nearest_even(value, bits):
    tensor = encode(np.array([value], np.float32), "h", wire="bfloat16")
    assert np.frombuffer(tensor.data, "<u2")[0] == bits


def test_bfloat16_keeps_nan_and_decodes_to_float32():
    a = np.array([np.nan, 0.1, 3.0, -1e-3], np.float32)
    tensor = encode(a, "h", wire="bfloat16")
    assert tensor.dtype == pb.DTYPE_BFLOAT16 and len(tensor.data) == 2 * a.size
    b = decode(tensor, "h")
    assert b.dtype == np.float32 and np.isnan(b[0])
    assert np.allclose(b[1:], a[1:], rtol=2 ** -8, atol=0)
    assert np.array_equal(b[1:], a[1:].astype(ml_dtypes.bfloat16).astype(np.float32))


def test_bfloat16_can_stay_16_bit():
    a = np.array([np.nan, 0.1, 3.0, -np.inf], np.float32)
    tensor = encode(a, "h", wire="bfloat16")
    b = decode(tensor, "h", widen=False)
    assert b.dtype == ml_dtypes.bfloat16
    assert b.view(np.uint16).tobytes() == tensor.data  # a view of the bytes as they came
    assert np.array_equal(b.astype(np.float32), decode(tensor, "h"), equal_nan=True)


def test_bfloat16_data_goes_on_the_wire_as_it_is():
    """An ml_dtypes.bfloat16 array (a model's bf16 output) is sent as its own bits, with no
    round trip through float32: the same bytes as converting its float32 values, for a
    C-contiguous array and a transposed one, with the wire named or taken from the dtype."""
    a = np.random.default_rng(3).standard_normal((5, 6)).astype(np.float32)
    a[0, :2] = -0.0, np.inf
    b = a.astype(ml_dtypes.bfloat16)
    for array in (b, b.T):
        for wire in ("bfloat16", None):
            tensor = encode(array, "h", wire=wire)
            assert tensor.dtype == pb.DTYPE_BFLOAT16 and list(tensor.shape) == list(array.shape)
            assert tensor.data == np.ascontiguousarray(array).view(np.uint16).tobytes()
            assert tensor.data == encode(array.astype(np.float32), "h", wire="bfloat16").data
    quiet = np.array([0x7F81, 0xFFC1], np.uint16).view(ml_dtypes.bfloat16)   # NaN payloads
    assert encode(quiet, "h").data == quiet.view(np.uint16).tobytes()   # not 0x7FC0


def _tensor(dtype=pb.DTYPE_FLOAT32, shape=(2, 2), data=bytes(16)):
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


@pytest.mark.parametrize("tensor, problem", [
    (_tensor(data=bytes(15)), "has 15 bytes, but shape [2, 2] of float32 needs 16"),
    (_tensor(data=bytes(20)), "has 20 bytes"),
    (_tensor(shape=(2, -2)), "negative dimension"),
    (_tensor(shape=(1,) * 9, data=bytes(4)), "at most 8"),
    (_tensor(dtype=pb.DTYPE_UNSPECIFIED), "got unspecified"),
    (_tensor(dtype=99), "got 99 (not a Dtype)"),
    (_tensor(dtype=pb.DTYPE_BOOL, shape=(2,), data=b"\x00\x02"), "0 or 1"),
    (_tensor(dtype=pb.DTYPE_INT32, shape=(1 << 40,), data=bytes(8)), "needs 4398046511104"),
])
def test_decode_checks_size_and_dtype_before_the_data(tensor, problem):
    with pytest.raises(TensorError) as info:
        decode(tensor, "h_t")
    assert info.value.field == "h_t" and problem in str(info.value)
    assert str(info.value).startswith("h_t: ")


@pytest.mark.parametrize("array, wire", [
    (np.zeros(3, np.float64), None),
    (np.zeros(3, np.int64), None),
    (np.zeros(3, np.int32), "bfloat16"),
    (np.zeros(3, np.float32), "int32"),
    (np.zeros(3, np.float32), "complex64"),
])
def test_encode_refuses_what_the_wire_cannot_carry(array, wire):
    with pytest.raises(TensorError) as info:
        encode(array, "rewards", wire=wire)
    assert info.value.field == "rewards"


def test_a_shape_numpy_cannot_build_is_invalid_not_internal():
    absurd = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2 ** 62, 2 ** 62, 0], data=b"")
    with pytest.raises(TensorError, match="h: shape .* is not a valid array shape"):
        decode(absurd, "h")

"""The fast transport paths are the same bytes and values as the plain ones."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from duelq.client.client import encode_batch, encode_batch_wire
from duelq.client.errors import InvalidArgument
from duelq.wire.tensors import (INSERT_FIELDS, KEY_FIELD, TRAIN_FIELDS, decode, encode,
                                tensor_wire, varint)
from duelq.server.service import decode_batch
from duelq.v1 import learner_pb2 as pb

from conftest import random_batch


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rows, weights", [(1, True), (37, False), (1024, True)])
def test_wire_request_parses_to_the_protobuf_built_one(wire, rows, weights):
    batch = random_batch(np.random.default_rng(rows), rows, weights=weights)
    message = encode_batch(batch, feature_dtype=wire)
    assert pb.TrainRequest.FromString(encode_batch_wire(batch, feature_dtype=wire)) == message
    message.key.actor_id, message.key.seq = "actor-é", 2 ** 40 + 3
    data = encode_batch_wire(batch, feature_dtype=wire, actor_id="actor-é", seq=2 ** 40 + 3)
    assert pb.TrainRequest.FromString(data) == message


@pytest.mark.parametrize("wire", ["float32", "float16"])
def test_foreign_dtypes_encode_as_their_native_equivalents(wire):
    """Big-endian, wider and narrower dtypes take the converting path, not the fast one;
    one header built for a shape serves every batch of that shape, and only it."""
    batch = random_batch(np.random.default_rng(5), 9)
    native = encode_batch_wire(batch, feature_dtype=wire, actor_id="a", seq=1)
    foreign = replace(batch, h_t=batch.h_t.astype(">f4"), h_tp1=batch.h_tp1.astype(np.float64),
                      actions=batch.actions.astype(np.uint16),
                      rewards=batch.rewards.astype(">f4"), weights=batch.weights.astype(">f8"))
    assert encode_batch_wire(foreign, feature_dtype=wire, actor_id="a", seq=1) == native
    other = random_batch(np.random.default_rng(6), 10)
    assert pb.TrainRequest.FromString(encode_batch_wire(other, feature_dtype=wire)) == \
        encode_batch(other, feature_dtype=wire)


@pytest.mark.parametrize("wire", ["int32", "float64", None, np.dtype("float64"), object(),
                                  [("a", "<f4"), ("a", "<f4")], np.zeros(2)])
def test_an_unknown_feature_dtype_is_refused_by_name(wire):
    batch = random_batch(np.random.default_rng(2), 4)
    for encoder in (encode_batch, encode_batch_wire):
        with pytest.raises(InvalidArgument, match="feature_dtype"):
            encoder(batch, feature_dtype=wire)


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
def test_a_numpy_dtype_names_a_feature_dtype(wire):
    import ml_dtypes
    batch = random_batch(np.random.default_rng(3), 4)
    dtype = np.dtype(ml_dtypes.bfloat16 if wire == "bfloat16" else wire)
    assert encode_batch_wire(batch, feature_dtype=dtype) == \
        encode_batch_wire(batch, feature_dtype=wire)


@pytest.mark.parametrize("array, wire", [
    (np.arange(12, dtype=np.float32).reshape(3, 4), None),
    (np.zeros((0, 5), np.float32), None),          # no data bytes
    (np.array(2.5, np.float32), None),             # a scalar: no shape
    (np.arange(300, dtype=np.int32)[::2], None),   # not contiguous
    (np.array([True, False, True]), None),
    (np.linspace(-3, 3, 200, dtype=np.float32), "bfloat16"),
    (np.linspace(-3, 3, 200, dtype=np.float32).reshape(20, 10).astype("bfloat16").T,
     "bfloat16"),                                  # bfloat16 already, not contiguous
])
def test_tensor_wire_parses_to_encode(array, wire):
    parsed = pb.TrainRequest.FromString(b"".join(tensor_wire(2, array, "h_tp1", wire=wire)))
    assert parsed.h_tp1 == encode(array, "h_tp1", wire=wire)


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 2 ** 32, 2 ** 64 - 1])
def test_varint_matches_protobuf(n):
    assert varint(n) == pb.RequestKey(seq=n).SerializeToString()[1:] or n == 0
    assert pb.RequestKey.FromString(b"\x10" + varint(n)).seq == n


def test_float16_features_are_widened_on_decode_with_checks_unchanged():
    batch = random_batch(np.random.default_rng(3), 16)
    decoded = decode_batch(encode_batch(batch, feature_dtype="float16"))
    assert decoded.h_t.dtype == np.float32
    assert np.array_equal(decoded.h_t, batch.h_t.astype(np.float16).astype(np.float32))


def test_bfloat16_encode_rounds_like_the_reference_formula():
    bits = np.random.default_rng(0).integers(0, 2 ** 32, 200_000, dtype=np.uint64)
    a = bits.astype(np.uint32).view(np.float32)
    u = a.view(np.uint32)
    want = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    tensor = encode(a, "h", wire="bfloat16")
    nan = np.isnan(a)
    assert np.array_equal(np.frombuffer(tensor.data, "<u2")[~nan], want[~nan])
    wide = decode(tensor, "h")   # widened exactly: the bits back in float32's top half
    assert np.array_equal(wide[~nan].view(np.uint32) >> 16, want[~nan])
    assert np.isnan(wide[nan]).all()


def test_train_and_insert_fields_follow_the_proto():
    """The tensor fields both ends write by number, in field order (the framing and the
    packing rely on it), and the key after them."""
    assert list(TRAIN_FIELDS.items()) == [("h_t", 1), ("h_tp1", 2), ("actions", 3),
                                          ("rewards", 4), ("dones", 5), ("discounts", 6),
                                          ("weights", 7)]
    assert list(INSERT_FIELDS.items()) == list(TRAIN_FIELDS.items())[:6] + [("priorities", 7)]
    assert KEY_FIELD == 8 == pb.InsertStreamRequest.DESCRIPTOR.fields_by_name["key"].number

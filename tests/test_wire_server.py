"""The server's zero-copy parser of TrainRequest and InsertStreamRequest
(server/framing.py) against protobuf's (upb).

Whatever bytes arrive, ``train_request_deserializer`` must give what
``TrainRequest.FromString`` gives: the same fields (presence, dtype, shape, data,
key) or the same refusal, and ``decode_batch`` must give the same arrays or the
same error; ``insert_request_deserializer`` likewise against
``InsertStreamRequest.FromString`` and ``decode_transitions``.  The canonical form
(as the client and protobuf write it) must take the zero-copy path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duelq.client.client import encode_batch_wire
from duelq.wire.tensors import tensor_wire
from duelq.server.core.errors import InvalidArgument
from duelq.wire.tensors import TensorError
from duelq.server.service import decode_batch, decode_transitions
from duelq.server import framing as wire
from duelq.server.framing import (INSERT_TENSOR_FIELDS, TENSOR_FIELDS, WireInsertRequest,
                                  WireTrainRequest, insert_request_deserializer,
                                  parse_insert_request, parse_train_request,
                                  train_request_deserializer)
from duelq.v1 import learner_pb2 as pb

from conftest import random_batch

SETTINGS = settings(max_examples=400, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def same_request(fast, slow: pb.TrainRequest, fields=TENSOR_FIELDS) -> None:
    """``fast`` (either parser's result) reads exactly like upb's ``slow``."""
    for name in fields + ("key",):
        assert fast.HasField(name) == slow.HasField(name), name
    for name in fields:
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype, name
        assert tuple(a.shape) == tuple(b.shape), name
        assert bytes(a.data) == b.data, name
    assert fast.key == slow.key


def outcome(fn):
    try:
        return "ok", fn()
    except (InvalidArgument, TensorError) as exc:
        return "invalid", str(exc)


def same_arrays(fast, slow, decoder) -> None:
    """``decoder`` (decode_batch, decode_transitions) gives the same arrays, or the same
    error, from either parser's result."""
    got, want = outcome(lambda: decoder(fast)), outcome(lambda: decoder(slow))
    assert got[0] == want[0], (got, want)
    if got[0] == "invalid":
        assert got[1] == want[1]
        return
    for a, b in zip(dataclasses.astuple(got[1]), dataclasses.astuple(want[1])):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


#: (upb's message, the deserializer, the zero-copy parse, its tensor fields, the decoder)
TRAIN = (pb.TrainRequest, train_request_deserializer, parse_train_request, TENSOR_FIELDS,
         decode_batch)
INSERT = (pb.InsertStreamRequest, insert_request_deserializer, parse_insert_request,
          INSERT_TENSOR_FIELDS, decode_transitions)


def check_bytes(data: bytes, kind: tuple = TRAIN) -> None:
    """The deserializer agrees with upb on ``data``: same message or both refuse; and the
    decoder on what they give."""
    message, deserializer, parse, fields, decoder = kind
    try:
        slow = message.FromString(data)
    except Exception as exc:  # noqa: BLE001
        with pytest.raises(type(exc)):
            deserializer(data)
        assert parse(data) is None
        return
    fast = deserializer(data)
    same_request(fast, slow, fields)
    same_arrays(fast, slow, decoder)


dims = st.one_of(st.integers(0, 6), st.integers(0, 2**63 - 1), st.integers(-2**63, -1))
tensors = st.fixed_dictionaries({}, optional={
    "dtype": st.one_of(st.integers(0, 7), st.integers(-2**31, 2**31 - 1)),
    "shape": st.lists(dims, max_size=4),
    "data": st.binary(max_size=64)})
keys = st.fixed_dictionaries({}, optional={
    "actor_id": st.text(max_size=20), "seq": st.integers(0, 2**64 - 1)})


@st.composite
def messages(draw) -> pb.TrainRequest:
    fields = {name: draw(tensors) for name in draw(st.sets(st.sampled_from(TENSOR_FIELDS)))}
    if draw(st.booleans()):
        fields["key"] = draw(keys)
    return pb.TrainRequest(**fields)


@SETTINGS
@given(messages())
def test_random_messages_parse_as_upb_does(message):
    data = message.SerializeToString()
    check_bytes(data)
    small = all(0 <= getattr(message, n).dtype < 128 and min(getattr(message, n).shape,
                                                             default=0) >= 0
                for n in TENSOR_FIELDS)
    if small:   # the canonical form: the zero-copy path takes it
        assert isinstance(parse_train_request(data), WireTrainRequest)


@SETTINGS
@given(messages(), st.data())
def test_mutated_bytes_parse_as_upb_does(message, data):
    raw = bytearray(message.SerializeToString())
    for _ in range(data.draw(st.integers(1, 3))):
        how = data.draw(st.sampled_from(["cut", "flip", "splice", "append", "dup", "swap"]))
        if how == "cut" and raw:
            del raw[data.draw(st.integers(0, len(raw) - 1)):]
        elif how == "flip" and raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        elif how == "splice":
            at = data.draw(st.integers(0, len(raw)))
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif how == "append":   # another whole message: repeats or merges fields
            raw += data.draw(messages()).SerializeToString()
        elif how == "dup" and raw:  # the same bytes twice: every field repeated
            raw += bytes(raw)
        else:                   # a field put in front of the others (non-canonical order)
            raw[:0] = data.draw(messages()).SerializeToString()
    check_bytes(bytes(raw))


@SETTINGS
@given(messages(), st.data())
def test_a_remembered_layout_serves_only_requests_it_fits(message, data):
    """After one request, a second of the same length (its data bytes rewritten, or any
    byte at all) parses as upb parses it: the remembered layout applies only when every
    framing byte is the same."""
    raw = message.SerializeToString()
    parse_train_request(raw)
    other = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        if other:
            other[data.draw(st.integers(0, len(other) - 1))] = data.draw(st.integers(0, 255))
    check_bytes(bytes(other))


def test_a_remembered_layout_is_used_and_keyed_by_every_framing_byte():
    rng = np.random.default_rng(8)
    first, second = random_batch(rng, 12), random_batch(rng, 12)
    a = encode_batch_wire(first, actor_id="a", seq=5)
    b = encode_batch_wire(second, actor_id="b", seq=6)
    assert len(a) == len(b)
    parse_train_request(a)
    layout = wire._LAYOUTS[len(a)]
    fast = parse_train_request(b)
    assert wire._LAYOUTS[len(b)] is layout            # served from it, not re-parsed
    same_request(fast, pb.TrainRequest.FromString(b))
    # The same length, float32 actions instead of int32: one dtype byte differs.
    floats = replace(second, actions=second.actions.astype(np.float32))
    parts: list = []
    for number, name in enumerate(TENSOR_FIELDS, 1):
        parts += tensor_wire(number, getattr(floats, name), name)
    c = b"".join(parts) + a[len(b"".join(parts)):]
    assert len(c) == len(a) and c != a
    got = parse_train_request(c)
    assert got.actions.dtype == pb.DTYPE_FLOAT32
    same_request(got, pb.TrainRequest.FromString(c))


def test_a_layout_with_long_framing_is_not_remembered():
    """A shape of many dimensions parses (upb would too) but is not kept: the cache holds
    a few hundred bytes per entry, whatever requests arrive (before any check or token)."""
    data = pb.TrainRequest(h_t=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[0] * 2000),
                           key=pb.RequestKey(actor_id="a", seq=1)).SerializeToString()
    assert isinstance(parse_train_request(data), WireTrainRequest)
    assert len(data) not in wire._LAYOUTS


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("weights", [True, False])
def test_client_wire_bytes_take_the_zero_copy_path(wire, weights):
    batch = random_batch(np.random.default_rng(7), 33, weights=weights)
    data = encode_batch_wire(batch, feature_dtype=wire, actor_id="actor-é", seq=2**64 - 1)
    fast = parse_train_request(data)
    assert isinstance(fast, WireTrainRequest)
    slow = pb.TrainRequest.FromString(data)
    same_request(fast, slow)
    same_arrays(fast, slow, decode_batch)
    assert fast.key.actor_id == "actor-é" and fast.key.seq == 2**64 - 1
    h = decode_batch(fast).h_t
    if wire == "float32":   # a view of the request's bytes, not a copy
        assert not h.flags.owndata and not h.flags.writeable


def test_unknown_fields_and_bad_utf8_fall_back_to_upb():
    good = encode_batch_wire(random_batch(np.random.default_rng(1), 4), actor_id="a", seq=1)
    unknown = good + b"\x48\x01"                       # field 9, varint: unknown to us
    assert parse_train_request(unknown) is None
    same_request(train_request_deserializer(unknown), pb.TrainRequest.FromString(unknown))
    bad_key = good + b"\x42\x03\x0a\x01\xff"             # key.actor_id = b"\xff": not UTF-8
    assert parse_train_request(bad_key) is None
    with pytest.raises(Exception):
        pb.TrainRequest.FromString(bad_key)
    with pytest.raises(Exception):
        train_request_deserializer(bad_key)
    assert not WireTrainRequest({}).HasField("h_t")
    with pytest.raises(ValueError):
        WireTrainRequest({}).HasField("nope")
    with pytest.raises(ValueError, match="TrainRequest has no .*priorities"):
        WireTrainRequest({}).HasField("priorities")   # as upb: each message its own names


@st.composite
def insert_messages(draw) -> pb.InsertStreamRequest:
    fields = {name: draw(tensors)
              for name in draw(st.sets(st.sampled_from(INSERT_TENSOR_FIELDS)))}
    if draw(st.booleans()):
        fields["key"] = draw(keys)
    return pb.InsertStreamRequest(**fields)


@SETTINGS
@given(insert_messages(), st.data())
def test_insert_requests_parse_as_upb_does(message, data):
    raw = bytearray(message.SerializeToString())
    check_bytes(bytes(raw), INSERT)
    if all(0 <= getattr(message, n).dtype < 128
           and min(getattr(message, n).shape, default=0) >= 0 for n in INSERT_TENSOR_FIELDS):
        assert isinstance(parse_insert_request(bytes(raw)), WireInsertRequest)
    if raw and data.draw(st.booleans()):   # and a mutation of it
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        check_bytes(bytes(raw), INSERT)


def test_a_layout_remembered_from_a_train_request_reads_an_insert_by_its_own_names():
    """Train and insert requests of one shape share their framing, so one remembered
    layout serves both; field 7 reads as ``weights`` in one and ``priorities`` in the
    other."""
    rng = np.random.default_rng(9)
    batch = random_batch(rng, 12)
    train = encode_batch_wire(batch, actor_id="a", seq=5)
    insert = pb.InsertStreamRequest.FromString(train)   # the same fields, 7 = priorities
    assert insert.HasField("priorities")
    data = insert.SerializeToString()
    assert len(data) == len(train)
    parse_train_request(train)
    layout = wire._LAYOUTS[len(train)]
    got = parse_insert_request(data)
    assert got.layout is layout and got.HasField("priorities")
    same_request(got, insert, INSERT_TENSOR_FIELDS)
    with pytest.raises(ValueError, match="InsertStreamRequest has no .*weights"):
        got.HasField("weights")


def test_server_accepts_canonical_and_other_encodings(server):
    channel = grpc.insecure_channel(server.target)
    batch = random_batch(np.random.default_rng(3), 6)
    canonical = encode_batch_wire(batch, actor_id="", seq=0)
    message = pb.TrainRequest.FromString(canonical)
    # Fields in reverse order: valid protobuf, not canonical, so upb parses it.
    reordered = b"".join(
        pb.TrainRequest(**{name: getattr(message, name)}).SerializeToString()
        for name in reversed(TENSOR_FIELDS) if message.HasField(name))
    step = channel.unary_unary("/duelq.v1.Learner/TrainStep", request_serializer=bytes,
                               response_deserializer=pb.TrainResponse.FromString)
    first = step(canonical, timeout=10)
    second = step(reordered, timeout=10)
    assert second.step == first.step + 1
    with pytest.raises(grpc.RpcError) as err:
        step(canonical[:-3] + b"\x0a", timeout=10)     # truncated
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        step(canonical[:-4], timeout=10)               # the last field cut short
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stream = channel.stream_stream("/duelq.v1.Learner/TrainStream", request_serializer=bytes,
                                   response_deserializer=pb.TrainResponse.FromString)
    answers = list(stream(iter([canonical, reordered]), timeout=10))
    assert [a.step for a in answers] == [second.step + 1, second.step + 2]

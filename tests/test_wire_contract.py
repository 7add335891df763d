"""What a client nobody here wrote meets: reflection v1 and v1alpha with the proto's comments,
the bearer scheme in any case, the typed configuration in GetInfo, messages that say what
happened, and the same bits for a batch wherever it lies in the request's bytes."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb

from duelq.client import LearnerClient
from duelq.client.client import encode_batch_wire
from duelq.server.core.learner import Learner
from duelq.server.framing import parse_train_request
from duelq.server.reflection import v1_file
from duelq.v1 import learner_pb2 as pb
from duelq.v1 import learner_pb2_grpc as pb_grpc
from duelq.wire.tensors import decode, varint

from conftest import SMALL, random_batch

TOKEN = "s3cret"


def reflect(channel: grpc.Channel, version: str, *requests: rpb.ServerReflectionRequest,
            metadata=()) -> list[rpb.ServerReflectionResponse]:
    """Ask reflection ``version`` ("v1" or "v1alpha"); the two share their messages' bytes."""
    call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/"
                                 "ServerReflectionInfo",
                                 request_serializer=rpb.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=rpb.ServerReflectionResponse.FromString)
    return list(call(iter(requests), metadata=metadata, timeout=30))


def files(response: rpb.ServerReflectionResponse) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    protos = (descriptor_pb2.FileDescriptorProto.FromString(f)
              for f in response.file_descriptor_response.file_descriptor_proto)
    return {p.name: p for p in protos}


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_serves_both_versions_and_the_protos_comments(make_server, version):
    server = make_server(token=TOKEN)
    channel = grpc.insecure_channel(server.target)
    with pytest.raises(grpc.RpcError) as info:   # reflection needs the token too
        reflect(channel, version, rpb.ServerReflectionRequest(list_services=""))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    auth = (("authorization", f"bearer {TOKEN}"),)   # the scheme in lower case
    listed, tensor, v1 = reflect(
        channel, version, rpb.ServerReflectionRequest(list_services=""),
        rpb.ServerReflectionRequest(file_containing_symbol="duelq.v1.Tensor"),
        rpb.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
        metadata=auth)
    assert {s.name for s in listed.list_services_response.service} == {
        "duelq.v1.Learner", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection"}
    learner = files(tensor)["duelq/v1/learner.proto"]
    comments = {tuple(loc.path): loc.leading_comments
                for loc in learner.source_code_info.location}
    tensor_doc = comments[(4, [m.name for m in learner.message_type].index("Tensor"))]
    assert "little-endian" in tensor_doc and "row-major" in tensor_doc
    assert "Dtype float32, float16 or bfloat16." in " ".join(comments.values())
    served = descriptor_pb2.FileDescriptorProto()
    served.CopyFrom(learner)
    served.ClearField("source_code_info")
    assert _without_json_names(served) == _without_json_names(_proto(pb.DESCRIPTOR))
    reflection_v1 = files(v1)["grpc/reflection/v1/reflection.proto"]
    assert reflection_v1.package == "grpc.reflection.v1" and reflection_v1 == v1_file()


def _proto(descriptor) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    descriptor.CopyToProto(proto)
    return proto


def _without_json_names(proto: descriptor_pb2.FileDescriptorProto) -> bytes:
    for message in proto.message_type:
        for m in (message, *message.nested_type):
            for field in m.field:
                field.ClearField("json_name")
    return proto.SerializeToString(deterministic=True)


def test_the_v1_reflection_file_is_v1alphas_messages_under_v1s_names():
    v1, alpha = v1_file(), _proto(rpb.DESCRIPTOR)
    assert [(m.name, [(f.name, f.number, f.type, f.label, f.type_name.split(".")[-1],
                       f.oneof_index if f.HasField("oneof_index") else None) for f in m.field])
            for m in v1.message_type] == [
        (m.name, [(f.name, f.number, f.type, f.label, f.type_name.split(".")[-1],
                   f.oneof_index if f.HasField("oneof_index") else None) for f in m.field])
        for m in alpha.message_type]
    assert v1.service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert v1.options.go_package == "google.golang.org/grpc/reflection/grpc_reflection_v1"


@pytest.mark.parametrize("header, admitted", [
    (f"Bearer {TOKEN}", True), (f"bearer {TOKEN}", True), (f"BEARER {TOKEN}", True),
    (f"Bearer  {TOKEN}", True), (f"Bearer {TOKEN}x", False), (f"Basic {TOKEN}", False),
    (f"Bearer{TOKEN}", False), (TOKEN, False)])
def test_the_bearer_scheme_is_matched_in_any_case(make_server, header, admitted):
    server = make_server(token=TOKEN)
    stub = pb_grpc.LearnerStub(grpc.insecure_channel(server.target))
    try:
        stub.GetInfo(pb.GetInfoRequest(), metadata=(("authorization", header),), timeout=30)
    except grpc.RpcError as error:
        assert not admitted and error.code() == grpc.StatusCode.UNAUTHENTICATED
    else:
        assert admitted


def test_get_info_carries_the_configuration_typed_and_as_json(server):
    info = pb_grpc.LearnerStub(grpc.insecure_channel(server.target)).GetInfo(
        pb.GetInfoRequest(), timeout=30)
    assert info.config == pb.LearnerConfig(**SMALL.to_dict())
    assert (info.config.hidden_dim, info.config.n_actions) == (SMALL.hidden_dim, SMALL.n_actions)
    assert info.config.isv_slots["action_entropy_ema"] == 583
    assert json.loads(info.config_json) == SMALL.to_dict()
    with LearnerClient(server.target) as client:
        got = client.info()
    assert (got.hidden_dim, got.n_actions, got.config) == (SMALL.hidden_dim, SMALL.n_actions,
                                                           SMALL.to_dict())


def test_a_drain_refusal_advises_the_key_only_to_keyed_requests(server, rng):
    stub = pb_grpc.LearnerStub(grpc.insecure_channel(server.target))
    server.service.drain()
    for key, advice in ((pb.RequestKey(), "the request was not applied: retry it"),
                        (pb.RequestKey(actor_id="a", seq=1),
                         "the request was not applied: retry it with the same key")):
        request = pb.TrainRequest.FromString(encode_batch_wire(random_batch(rng, 4)))
        request.key.CopyFrom(key)
        with pytest.raises(grpc.RpcError) as info:
            stub.TrainStep(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == f"the server is shutting down; {advice}"


def shifted(request: bytes, extra: int) -> bytes:
    """``request`` with its first field's length written ``extra`` bytes longer (a varint
    padded with zero groups, which protobuf reads as the same number): every byte after it,
    h_t's data included, lies ``extra`` bytes further on."""
    assert request[0] == 0x0A                       # h_t, field 1, length-delimited
    length = varint(len(pb.TrainRequest.FromString(request).h_t.SerializeToString()))
    assert request[1:1 + len(length)] == length
    padded = bytearray(length)
    if extra:
        padded[-1] |= 0x80
        padded += b"\x80" * (extra - 1) + b"\x00"
    return request[:1] + bytes(padded) + request[1 + len(length):]


@pytest.fixture
def rng():
    return np.random.default_rng(5)


def test_a_batch_gives_the_same_bits_wherever_it_lies_in_the_request(server, rng):
    """The reference backend steps one batch sent with h_t's data at four offsets (three of
    them not 4-byte aligned, so NumPy's matmul would leave BLAS) exactly as in process."""
    batch = random_batch(rng, 200)   # h_t is 12800 bytes: a length of two varint bytes
    local = Learner(SMALL, backend="reference")
    want = local.step(batch)
    request = encode_batch_wire(batch)
    variants = [shifted(request, extra) for extra in range(4)]
    assert all(pb.TrainRequest.FromString(v) == pb.TrainRequest.FromString(request)
               for v in variants)
    aligned = [decode(parse_train_request(v).h_t, "h_t").flags.aligned for v in variants]
    assert aligned.count(False) == 3, aligned       # the zero-copy views, at each offset
    raw = grpc.insecure_channel(server.target).unary_unary(
        "/duelq.v1.Learner/TrainStep", request_serializer=None,
        response_deserializer=pb.TrainResponse.FromString)
    start = server.learner.snapshot()
    for extra, variant in enumerate(variants):
        server.learner.load(start)
        got = raw(variant, timeout=30)
        assert (got.loss, got.grad_norm, got.q_taken_mean) == (
            want.loss, want.grad_norm, want.q_taken_mean), extra
        assert decode(got.td_errors, "td_errors").tobytes() == want.td_errors.tobytes(), extra
        assert server.learner.snapshot().checksum() == local.snapshot().checksum(), extra

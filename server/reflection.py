"""Server reflection, grpc.reflection.v1 and v1alpha, serving learner.proto with its comments.

grpcio-reflection implements v1alpha only.  v1 is the same messages under another package,
so one servicer answers both: v1's requests are parsed, and its answers written, with
v1alpha's classes (the same bytes).  The gencode's descriptors carry no comments (protoc's
Python output and upb drop source info), so the learner's file is served as
``learner.binpb`` holds it, the FileDescriptorSet that scripts/gen_protos.py writes with
them: ``grpcurl describe duelq.v1.Tensor`` then shows the byte order and the dtypes.
"""

from __future__ import annotations

import functools
from importlib import resources

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from duelq.v1 import learner_pb2 as pb

V1ALPHA = reflection.SERVICE_NAME                 # "grpc.reflection.v1alpha.ServerReflection"
V1 = "grpc.reflection.v1.ServerReflection"
_V1_OPTIONS = {"java_package": "io.grpc.reflection.v1", "java_outer_classname":
               "ServerReflectionProto", "java_multiple_files": True,
               "go_package": "google.golang.org/grpc/reflection/grpc_reflection_v1"}


@functools.cache
def learner_file() -> bytes:
    """learner.proto's FileDescriptorProto with its comments (source info), serialised."""
    files = descriptor_pb2.FileDescriptorSet.FromString(
        (resources.files("duelq.v1") / "learner.binpb").read_bytes())
    file, = (f for f in files.file if f.name == pb.DESCRIPTOR.name)
    return file.SerializeToString()


def _file(descriptor) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    descriptor.CopyToProto(proto)
    return proto


def v1_file() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto: v1alpha's file under v1's name, package and
    options (the messages and fields are the same)."""
    proto = _file(reflection_pb2.DESCRIPTOR)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = field.type_name.replace(old, new)
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(old, new)
        method.output_type = method.output_type.replace(old, new)
    proto.options.Clear()
    for name, value in _V1_OPTIONS.items():
        setattr(proto.options, name, value)
    return proto


def _pool() -> descriptor_pool.DescriptorPool:
    """The files reflection answers from: the learner's, health's and both reflections'."""
    pool = descriptor_pool.DescriptorPool()
    for proto in (descriptor_pb2.FileDescriptorProto.FromString(learner_file()),
                  _file(health_pb2.DESCRIPTOR), _file(reflection_pb2.DESCRIPTOR), v1_file()):
        pool.Add(proto)
    return pool


class Reflection(reflection.ReflectionServicer):
    """grpcio-reflection's servicer over :func:`_pool`, answering learner.proto with its
    comments."""

    def __init__(self, service_names):
        super().__init__(service_names, pool=_pool())

    def ServerReflectionInfo(self, request_iterator, context):  # noqa: N802 — gRPC's name
        for response in super().ServerReflectionInfo(request_iterator, context):
            if response.HasField("file_descriptor_response"):
                files = response.file_descriptor_response.file_descriptor_proto
                files[:] = [learner_file() if _name(f) == pb.DESCRIPTOR.name else f
                            for f in files]
            yield response


def _name(file: bytes) -> str:
    return descriptor_pb2.FileDescriptorProto.FromString(file).name


def enable_reflection(service_names, server: grpc.Server) -> None:
    """Serve reflection of ``service_names`` (and of itself) on ``server``, v1 and v1alpha."""
    servicer = Reflection((*service_names, V1ALPHA, V1))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}),))

"""The committed gencode is what the pinned generator makes, and the proto is documented."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos" / "duelq" / "v1"
GENERATED = ("learner_pb2.py", "learner_pb2.pyi", "learner_pb2_grpc.py")


def gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


needs_generator = pytest.mark.skipif(
    gen_protos().generator_version() != gen_protos().GENERATOR_VERSION,
    reason=f"needs grpcio-tools=={gen_protos().GENERATOR_VERSION} (the test extra)")


@needs_generator
def test_regenerating_changes_nothing(tmp_path):
    gen_protos().generate(tmp_path)
    for name in GENERATED:
        fresh = (tmp_path / "duelq" / "v1" / name).read_text()
        assert fresh == (PROTO_DIR / name).read_text(), \
            f"{name} is stale: run python scripts/gen_protos.py"


@needs_generator
def test_every_message_field_enum_value_and_rpc_has_a_comment(tmp_path):
    from grpc_tools import protoc

    out = tmp_path / "learner.desc"
    assert protoc.main(["protoc", f"-I{ROOT / 'protos'}", "--include_source_info",
                        f"--descriptor_set_out={out}", str(PROTO_DIR / "learner.proto")]) == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    proto = files.file[0]
    comments = {tuple(loc.path): loc.leading_comments.strip()
                for loc in proto.source_code_info.location}

    # Descriptor paths: 4 = message_type, 2 = field, 8 = oneof_decl, 5 = enum_type,
    # 2 = enum value, 6 = service, 2 = method.
    missing = []
    for m, message in enumerate(proto.message_type):
        if not comments.get((4, m)):
            missing.append(message.name)
        missing += [f"{message.name}.{f.name}" for i, f in enumerate(message.field)
                    if not comments.get((4, m, 2, i))]
        missing += [f"{message.name}.{o.name}" for i, o in enumerate(message.oneof_decl)
                    if not o.name.startswith("_") and not comments.get((4, m, 8, i))]
    for e, enum in enumerate(proto.enum_type):
        missing += [f"{enum.name}.{v.name}" for i, v in enumerate(enum.value)
                    if not comments.get((5, e, 2, i))]
    for s, service in enumerate(proto.service):
        missing += [f"{service.name}.{r.name}" for i, r in enumerate(service.method)
                    if not comments.get((6, s, 2, i))]
    assert not missing, f"undocumented in learner.proto: {missing}"


def test_dependency_floors_match_what_the_gencode_needs():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floors = dict(re.match(r"([\w-]+)>=([\d.]+)", d).groups()
                  for d in pyproject["project"]["dependencies"] if ">=" in d)
    grpc_gen = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'",
                         (PROTO_DIR / "learner_pb2_grpc.py").read_text()).group(1)
    pb_gen = re.search(r"Protobuf Python Version: ([\d.]+)",
                       (PROTO_DIR / "learner_pb2.py").read_text()).group(1)
    assert floors["grpcio"] == grpc_gen
    assert floors["protobuf"] == pb_gen
    assert f"grpcio-tools=={gen_protos().GENERATOR_VERSION}" in pyproject["project"][
        "optional-dependencies"]["test"]


def test_generated_package_imports_as_duelq_v1():
    from duelq.v1 import learner_pb2, learner_pb2_grpc

    assert learner_pb2.DESCRIPTOR.package == "duelq.v1"
    assert learner_pb2_grpc.duelq_dot_v1_dot_learner__pb2 is learner_pb2

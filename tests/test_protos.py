"""The committed gencode is what the pinned generator makes; the proto is documented, lint
clean, and says what the code does (dtypes, configuration)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from duelq.server.core.config import LearnerConfig
from duelq.v1 import learner_pb2 as pb
from duelq.wire.types import FIELD_DTYPES

from helpers import tool

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos" / "duelq" / "v1"
GENERATED = ("learner_pb2.py", "learner_pb2.pyi", "learner_pb2_grpc.py", "learner.binpb")


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
        fresh = (tmp_path / "duelq" / "v1" / name).read_bytes()
        assert fresh == (PROTO_DIR / name).read_bytes(), \
            f"{name} is stale: run python scripts/gen_protos.py"


def documented() -> tuple[descriptor_pb2.FileDescriptorProto, dict]:
    """learner.proto's committed descriptor with comments, and its leading comments by path."""
    proto = descriptor_pb2.FileDescriptorSet.FromString(
        (PROTO_DIR / "learner.binpb").read_bytes()).file[0]
    return proto, {tuple(loc.path): loc.leading_comments.strip()
                   for loc in proto.source_code_info.location}


def test_every_message_field_enum_value_and_rpc_has_a_comment():
    proto, comments = documented()

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


def test_each_request_tensor_comment_names_exactly_the_dtypes_the_code_takes():
    """The line "Dtype a, b or c." of each request tensor field's comment is the contract
    (FIELD_DTYPES), in its order."""
    proto, comments = documented()
    found = {}
    for m, message in enumerate(proto.message_type):
        for i, field in enumerate(message.field):
            if message.name.endswith("Request") and field.type_name == ".duelq.v1.Tensor":
                line = re.search(r"Dtype ([\w ,]+)\.", " ".join(comments[(4, m, 2, i)].split()))
                assert line, f"{message.name}.{field.name} names no dtypes"
                found[field.name] = tuple(re.split(r", | or ", line.group(1)))
    assert found == FIELD_DTYPES


def test_the_typed_configuration_has_every_config_field_with_its_type():
    fields = pb.LearnerConfig.DESCRIPTOR.fields_by_name
    assert list(fields) == [f.name for f in dataclasses.fields(LearnerConfig)]
    config = LearnerConfig(isv_slots={"a": 3}, step_entropy_slot="a", seed=2**40)
    assert pb.LearnerConfig(**config.to_dict()) == pb.LearnerConfig(
        hidden_dim=128, n_actions=11, optimizer="adam", lr=1e-4, beta1=0.9, beta2=0.999,
        adam_eps=1e-8, huber_kappa=1.0, double_dqn=False, max_grad_norm=0.0, tau=0.005,
        target_update_period=1, priority_eps=1e-6, isv_size=1024, isv_slots={"a": 3},
        step_entropy_slot="a", step_entropy_alpha=0.05, seed=2**40, replay_dtype="float32",
        replay_alpha=0.6, replay_beta=0.4, replay_batch_size=256, replay_min_size=256)


def test_every_common_generator_has_what_it_needs():
    options = pb.DESCRIPTOR.GetOptions()
    assert options.go_package.endswith(";duelqv1") and "/" in options.go_package
    assert options.java_multiple_files


def test_buf_lint_is_clean(tmp_path):
    """buf's STANDARD rules (buf-bin, the test extra), the exceptions commented in place."""
    buf = tool("buf", "pip install buf-bin (the test extra)")
    done = subprocess.run([buf, "lint"], cwd=ROOT / "protos", capture_output=True, text=True,
                          timeout=120, env={"BUF_CACHE_DIR": str(tmp_path), "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr

"""The dtype contract, cell by cell: every request tensor field × every wire dtype through a
real server (one process, and two front processes that pack requests themselves; on the
reference backend and, marked gpu, on cuda).

A cell's values are 0s and 1s, valid in every dtype, so a cell is refused for its dtype
alone.  A dtype the field takes (learner.proto, FIELD_DTYPES) is applied exactly as the
in-process learner applies the same arrays; any other is INVALID_ARGUMENT naming the field
and the dtype, in one spelling, with the server's whole state bit-identical (read back
through SaveCheckpoint).  The Python client gives the same verdict locally, in the same
words.
"""

from __future__ import annotations

import dataclasses

import grpc
import ml_dtypes
import numpy as np
import pytest

from duelq.client import LearnerClient, errors
from duelq.server.core import InvalidArgument, Learner
from duelq.server.core.checkpoint import read_checkpoint
from duelq.server.core.learner import cuda_usable
from duelq.server.fronts import start_server
from duelq.server.server import ServerOptions
from duelq.v1 import learner_pb2 as pb
from duelq.v1 import learner_pb2_grpc as pb_grpc
from duelq.wire.tensors import WIRE_DTYPES
from duelq.wire.types import FIELD_DTYPES, Batch

from conftest import SMALL

B, H, N = 6, SMALL.hidden_dim, SMALL.n_actions
TRAIN_FIELDS = ("h_t", "h_tp1", "actions", "rewards", "dones", "discounts", "weights")
NUMPY = {name: ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)
         for name in WIRE_DTYPES}
#: (field, dtype name) of every cell: the wire dtypes, "unspecified" and a number no Dtype has.
CELLS = [(field, dtype) for field in (*TRAIN_FIELDS, "h", "entropy actions")
         for dtype in (*WIRE_DTYPES, "unspecified", "99")]


def zeros_and_ones(rng: np.random.Generator) -> Batch:
    """A valid batch of 0s and 1s (actions too), in float32 and int32."""
    def bits(*shape):
        return rng.integers(0, 2, shape).astype(np.float32)
    return Batch(h_t=bits(B, H), h_tp1=bits(B, H), actions=bits(B).astype(np.int32),
                 rewards=bits(B), dones=bits(B), discounts=bits(B), weights=bits(B))


def tensor(values: np.ndarray, dtype: str) -> pb.Tensor:
    """``values`` on the wire as ``dtype`` (a name of WIRE_DTYPES, "unspecified", or an enum
    number), the bytes those of the nearest wire dtype's size."""
    if dtype in WIRE_DTYPES:
        data = values.astype(NUMPY[dtype]).tobytes()
        return pb.Tensor(dtype=WIRE_DTYPES[dtype][0], shape=values.shape, data=data)
    enum = pb.DTYPE_UNSPECIFIED if dtype == "unspecified" else int(dtype)
    return pb.Tensor(dtype=enum, shape=values.shape, data=values.astype(np.float32).tobytes())


def refusal(field: str, dtype: str) -> str:
    wanted = FIELD_DTYPES[field]
    got = {"99": "99 (not a Dtype)"}.get(dtype, dtype)
    listed = wanted[0] if len(wanted) == 1 else f"{', '.join(wanted[:-1])} or {wanted[-1]}"
    return f"{field}: dtype must be {listed}, got {got}"


class Cells:
    """A server and a local learner kept in step: each applied cell is applied to both."""

    def __init__(self, server, backend: str, rng):
        self.server, self.rng = server, rng
        self.channel = grpc.insecure_channel(server.target)
        self.stub = pb_grpc.LearnerStub(self.channel)
        self.local = Learner(SMALL, backend=backend)

    def state_checksum(self) -> str:
        path = self.stub.SaveCheckpoint(pb.SaveCheckpointRequest(), timeout=30).path
        return read_checkpoint(path, SMALL).state.checksum()

    def check(self, field: str, dtype: str) -> None:
        """Send cell (field, dtype); assert the verdict, the answer and the state after."""
        batch = zeros_and_ones(self.rng)
        accepted = dtype in FIELD_DTYPES["actions" if field == "entropy actions" else field]
        if field in TRAIN_FIELDS:
            request = pb.TrainRequest(**{f: tensor(getattr(batch, f), dtype if f == field
                                                   else WIRE_DTYPES_OF[f])
                                         for f in TRAIN_FIELDS})
            call, local = self.stub.TrainStep, lambda: self.local.step(
                _as(batch, field, dtype)).loss
            answer = lambda response: response.loss  # noqa: E731
        elif field == "h":
            request = pb.ActRequest(h=tensor(batch.h_t, dtype))
            call, local = self.stub.Act, lambda: self.local.q_values(
                batch.h_t.astype(NUMPY[dtype])).tobytes()
            answer = lambda response: np.frombuffer(response.q_values.data,  # noqa: E731
                                                    np.float32).tobytes()
        else:
            field = "actions"
            request = pb.ComputeEntropyRequest(actions=tensor(batch.actions, dtype),
                                               slot=pb.SlotRef(name="action_entropy_ema"),
                                               alpha=0.5)
            call, local = self.stub.ComputeEntropy, lambda: self.local.compute_entropy(
                batch.actions.astype(NUMPY[dtype]), "action_entropy_ema", 0.5).ema
            answer = lambda response: response.ema  # noqa: E731
        if accepted:
            assert answer(call(request, timeout=30)) == local(), (field, dtype)
        else:
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == refusal(field, dtype)
            if dtype in WIRE_DTYPES:   # in process, the same refusal
                with pytest.raises(InvalidArgument) as local_info:
                    local()
                assert str(local_info.value) == refusal(field, dtype)
        assert self.state_checksum() == self.local.snapshot().checksum(), (field, dtype)


#: Each train field's dtype in a cell about another field.
WIRE_DTYPES_OF = {"h_t": "float32", "h_tp1": "float32", "actions": "int32", "rewards": "float32",
                  "dones": "float32", "discounts": "float32", "weights": "float32"}


def _as(batch: Batch, field: str, dtype: str) -> Batch:
    return dataclasses.replace(batch, **{field: getattr(batch, field).astype(NUMPY[dtype])})


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not cuda_usable()[0], reason=f"no usable GPU: {cuda_usable()[1]}")])


@pytest.mark.parametrize("backend", ["reference", CUDA])
@pytest.mark.parametrize("fronts", [0, 2], ids=["one process", "two front processes"])
def test_every_field_takes_exactly_its_dtypes_through_the_wire(tmp_path, fronts, backend):
    server = start_server(SMALL, ServerOptions(port=0, front_processes=fronts,
                                               checkpoint_dir=str(tmp_path),
                                               checkpoint_every_seconds=0),
                          backend=backend)
    try:
        cells = Cells(server, backend, np.random.default_rng(fronts))
        for field, dtype in CELLS:
            cells.check(field, dtype)
        cells.channel.close()
    finally:
        server.stop(0)


def test_the_contract_covers_every_request_tensor_field():
    fields = {f.name for message in pb.DESCRIPTOR.message_types_by_name.values()
              if message.name.endswith("Request") for f in message.fields
              if f.message_type is not None and f.message_type.full_name == "duelq.v1.Tensor"}
    assert fields == set(FIELD_DTYPES)
    assert set(WIRE_DTYPES_OF) | {"h", "priorities"} == set(FIELD_DTYPES)  # priorities: insert only


@pytest.mark.parametrize("field", TRAIN_FIELDS)
def test_the_client_gives_the_servers_verdict_in_its_words(server, field):
    """Each wire dtype of each train field, through LearnerClient: what the server takes sent
    raw the client sends too, with the same step as the outcome; the rest the client refuses
    before sending, with the server's message."""
    rng = np.random.default_rng(7)
    stub = pb_grpc.LearnerStub(grpc.insecure_channel(server.target))
    with LearnerClient(server.target) as client:
        for dtype in WIRE_DTYPES:
            batch = zeros_and_ones(rng)
            request = pb.TrainRequest(**{f: tensor(getattr(batch, f), dtype if f == field
                                                   else WIRE_DTYPES_OF[f])
                                         for f in TRAIN_FIELDS})
            before = server.learner.snapshot()
            try:
                raw = stub.TrainStep(request, timeout=30)
            except grpc.RpcError as error:
                with pytest.raises(errors.InvalidArgument) as info:
                    client.train_step(_as(batch, field, dtype))
                assert info.value.details == error.details() == refusal(field, dtype)
                assert server.learner.snapshot().checksum() == before.checksum()
                continue
            after = server.learner.snapshot().checksum()
            server.learner.load(before)
            assert client.train_step(_as(batch, field, dtype)).loss == raw.loss, dtype
            assert server.learner.snapshot().checksum() == after, dtype

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT32: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RequestKey(_message.Message):
    __slots__ = ("actor_id", "seq")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    seq: int
    def __init__(self, actor_id: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("h_t", "h_tp1", "actions", "rewards", "dones", "discounts", "weights", "key")
    H_T_FIELD_NUMBER: _ClassVar[int]
    H_TP1_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    DONES_FIELD_NUMBER: _ClassVar[int]
    DISCOUNTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    h_t: Tensor
    h_tp1: Tensor
    actions: Tensor
    rewards: Tensor
    dones: Tensor
    discounts: Tensor
    weights: Tensor
    key: RequestKey
    def __init__(self, h_t: _Optional[_Union[Tensor, _Mapping]] = ..., h_tp1: _Optional[_Union[Tensor, _Mapping]] = ..., actions: _Optional[_Union[Tensor, _Mapping]] = ..., rewards: _Optional[_Union[Tensor, _Mapping]] = ..., dones: _Optional[_Union[Tensor, _Mapping]] = ..., discounts: _Optional[_Union[Tensor, _Mapping]] = ..., weights: _Optional[_Union[Tensor, _Mapping]] = ..., key: _Optional[_Union[RequestKey, _Mapping]] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("loss", "td_errors", "priorities", "q_taken_mean", "grad_norm", "step", "version", "entropy", "key", "replayed")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TD_ERRORS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    Q_TAKEN_MEAN_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    loss: float
    td_errors: Tensor
    priorities: Tensor
    q_taken_mean: float
    grad_norm: float
    step: int
    version: int
    entropy: float
    key: RequestKey
    replayed: bool
    def __init__(self, loss: _Optional[float] = ..., td_errors: _Optional[_Union[Tensor, _Mapping]] = ..., priorities: _Optional[_Union[Tensor, _Mapping]] = ..., q_taken_mean: _Optional[float] = ..., grad_norm: _Optional[float] = ..., step: _Optional[int] = ..., version: _Optional[int] = ..., entropy: _Optional[float] = ..., key: _Optional[_Union[RequestKey, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class EntropyRequest(_message.Message):
    __slots__ = ("actions", "slot", "alpha", "key")
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    actions: Tensor
    slot: SlotRef
    alpha: float
    key: RequestKey
    def __init__(self, actions: _Optional[_Union[Tensor, _Mapping]] = ..., slot: _Optional[_Union[SlotRef, _Mapping]] = ..., alpha: _Optional[float] = ..., key: _Optional[_Union[RequestKey, _Mapping]] = ...) -> None: ...

class EntropyResponse(_message.Message):
    __slots__ = ("entropy", "ema", "slot", "key", "replayed")
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    EMA_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    entropy: float
    ema: float
    slot: int
    key: RequestKey
    replayed: bool
    def __init__(self, entropy: _Optional[float] = ..., ema: _Optional[float] = ..., slot: _Optional[int] = ..., key: _Optional[_Union[RequestKey, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class SlotRef(_message.Message):
    __slots__ = ("name", "index")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    name: str
    index: int
    def __init__(self, name: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class ActRequest(_message.Message):
    __slots__ = ("h", "target")
    H_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    h: Tensor
    target: bool
    def __init__(self, h: _Optional[_Union[Tensor, _Mapping]] = ..., target: _Optional[bool] = ...) -> None: ...

class ActResponse(_message.Message):
    __slots__ = ("q_values", "actions", "version")
    Q_VALUES_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    q_values: Tensor
    actions: Tensor
    version: int
    def __init__(self, q_values: _Optional[_Union[Tensor, _Mapping]] = ..., actions: _Optional[_Union[Tensor, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class GetWeightsRequest(_message.Message):
    __slots__ = ("target",)
    TARGET_FIELD_NUMBER: _ClassVar[int]
    target: bool
    def __init__(self, target: _Optional[bool] = ...) -> None: ...

class Weights(_message.Message):
    __slots__ = ("w_v", "b_v", "W_a", "b_a", "version", "step", "target")
    W_V_FIELD_NUMBER: _ClassVar[int]
    B_V_FIELD_NUMBER: _ClassVar[int]
    W_A_FIELD_NUMBER: _ClassVar[int]
    B_A_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    w_v: Tensor
    b_v: Tensor
    W_a: Tensor
    b_a: Tensor
    version: int
    step: int
    target: bool
    def __init__(self, w_v: _Optional[_Union[Tensor, _Mapping]] = ..., b_v: _Optional[_Union[Tensor, _Mapping]] = ..., W_a: _Optional[_Union[Tensor, _Mapping]] = ..., b_a: _Optional[_Union[Tensor, _Mapping]] = ..., version: _Optional[int] = ..., step: _Optional[int] = ..., target: _Optional[bool] = ...) -> None: ...

class ReadISVRequest(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[SlotRef]
    def __init__(self, slots: _Optional[_Iterable[_Union[SlotRef, _Mapping]]] = ...) -> None: ...

class ISVValue(_message.Message):
    __slots__ = ("slot", "name", "value", "observed")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    slot: int
    name: str
    value: float
    observed: bool
    def __init__(self, slot: _Optional[int] = ..., name: _Optional[str] = ..., value: _Optional[float] = ..., observed: _Optional[bool] = ...) -> None: ...

class ISVValues(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[ISVValue]
    def __init__(self, values: _Optional[_Iterable[_Union[ISVValue, _Mapping]]] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Info(_message.Message):
    __slots__ = ("backend", "device", "config_json", "step", "version", "max_message_bytes", "max_batch_size", "max_streams", "server_version", "max_queue")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    backend: str
    device: str
    config_json: str
    step: int
    version: int
    max_message_bytes: int
    max_batch_size: int
    max_streams: int
    server_version: str
    max_queue: int
    def __init__(self, backend: _Optional[str] = ..., device: _Optional[str] = ..., config_json: _Optional[str] = ..., step: _Optional[int] = ..., version: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_streams: _Optional[int] = ..., server_version: _Optional[str] = ..., max_queue: _Optional[int] = ...) -> None: ...

class InsertRequest(_message.Message):
    __slots__ = ("h_t", "h_tp1", "actions", "rewards", "dones", "discounts", "priorities", "key")
    H_T_FIELD_NUMBER: _ClassVar[int]
    H_TP1_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    DONES_FIELD_NUMBER: _ClassVar[int]
    DISCOUNTS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    h_t: Tensor
    h_tp1: Tensor
    actions: Tensor
    rewards: Tensor
    dones: Tensor
    discounts: Tensor
    priorities: Tensor
    key: RequestKey
    def __init__(self, h_t: _Optional[_Union[Tensor, _Mapping]] = ..., h_tp1: _Optional[_Union[Tensor, _Mapping]] = ..., actions: _Optional[_Union[Tensor, _Mapping]] = ..., rewards: _Optional[_Union[Tensor, _Mapping]] = ..., dones: _Optional[_Union[Tensor, _Mapping]] = ..., discounts: _Optional[_Union[Tensor, _Mapping]] = ..., priorities: _Optional[_Union[Tensor, _Mapping]] = ..., key: _Optional[_Union[RequestKey, _Mapping]] = ...) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("rows", "size", "inserted", "version", "step", "key", "replayed")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    INSERTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    rows: int
    size: int
    inserted: int
    version: int
    step: int
    key: RequestKey
    replayed: bool
    def __init__(self, rows: _Optional[int] = ..., size: _Optional[int] = ..., inserted: _Optional[int] = ..., version: _Optional[int] = ..., step: _Optional[int] = ..., key: _Optional[_Union[RequestKey, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class TrainReplayRequest(_message.Message):
    __slots__ = ("steps", "key")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    steps: int
    key: RequestKey
    def __init__(self, steps: _Optional[int] = ..., key: _Optional[_Union[RequestKey, _Mapping]] = ...) -> None: ...

class TrainReplayResponse(_message.Message):
    __slots__ = ("steps", "refused", "loss", "q_taken_mean", "grad_norm", "step", "version", "key", "replayed")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    Q_TAKEN_MEAN_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    steps: int
    refused: bool
    loss: float
    q_taken_mean: float
    grad_norm: float
    step: int
    version: int
    key: RequestKey
    replayed: bool
    def __init__(self, steps: _Optional[int] = ..., refused: _Optional[bool] = ..., loss: _Optional[float] = ..., q_taken_mean: _Optional[float] = ..., grad_norm: _Optional[float] = ..., step: _Optional[int] = ..., version: _Optional[int] = ..., key: _Optional[_Union[RequestKey, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class GetReplayInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplayInfo(_message.Message):
    __slots__ = ("capacity", "size", "inserted", "sampled", "ratio", "target_ratio", "draws", "beta", "batch_size", "min_size", "dtype", "cursor")
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    INSERTED_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    TARGET_RATIO_FIELD_NUMBER: _ClassVar[int]
    DRAWS_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    capacity: int
    size: int
    inserted: int
    sampled: int
    ratio: float
    target_ratio: float
    draws: int
    beta: float
    batch_size: int
    min_size: int
    dtype: str
    cursor: int
    def __init__(self, capacity: _Optional[int] = ..., size: _Optional[int] = ..., inserted: _Optional[int] = ..., sampled: _Optional[int] = ..., ratio: _Optional[float] = ..., target_ratio: _Optional[float] = ..., draws: _Optional[int] = ..., beta: _Optional[float] = ..., batch_size: _Optional[int] = ..., min_size: _Optional[int] = ..., dtype: _Optional[str] = ..., cursor: _Optional[int] = ...) -> None: ...

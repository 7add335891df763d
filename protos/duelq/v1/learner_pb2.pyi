from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]
    DTYPE_INT32: _ClassVar[Dtype]
    DTYPE_UINT8: _ClassVar[Dtype]
    DTYPE_BOOL: _ClassVar[Dtype]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
DTYPE_INT32: Dtype
DTYPE_UINT8: Dtype
DTYPE_BOOL: Dtype

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

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

class ComputeEntropyRequest(_message.Message):
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

class ComputeEntropyResponse(_message.Message):
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

class GetWeightsResponse(_message.Message):
    __slots__ = ("w_v", "b_v", "w_a", "b_a", "version", "step", "target")
    W_V_FIELD_NUMBER: _ClassVar[int]
    B_V_FIELD_NUMBER: _ClassVar[int]
    W_A_FIELD_NUMBER: _ClassVar[int]
    B_A_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    w_v: Tensor
    b_v: Tensor
    w_a: Tensor
    b_a: Tensor
    version: int
    step: int
    target: bool
    def __init__(self, w_v: _Optional[_Union[Tensor, _Mapping]] = ..., b_v: _Optional[_Union[Tensor, _Mapping]] = ..., w_a: _Optional[_Union[Tensor, _Mapping]] = ..., b_a: _Optional[_Union[Tensor, _Mapping]] = ..., version: _Optional[int] = ..., step: _Optional[int] = ..., target: _Optional[bool] = ...) -> None: ...

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

class ReadISVResponse(_message.Message):
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

class LearnerConfig(_message.Message):
    __slots__ = ("hidden_dim", "n_actions", "optimizer", "lr", "beta1", "beta2", "adam_eps", "huber_kappa", "double_dqn", "max_grad_norm", "tau", "target_update_period", "priority_eps", "isv_size", "isv_slots", "step_entropy_slot", "step_entropy_alpha", "seed", "replay_capacity", "replay_dtype", "replay_alpha", "replay_beta", "replay_beta_steps", "replay_batch_size", "replay_min_size", "replay_ratio", "replay_seed")
    class IsvSlotsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    HIDDEN_DIM_FIELD_NUMBER: _ClassVar[int]
    N_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    ADAM_EPS_FIELD_NUMBER: _ClassVar[int]
    HUBER_KAPPA_FIELD_NUMBER: _ClassVar[int]
    DOUBLE_DQN_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    TARGET_UPDATE_PERIOD_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_EPS_FIELD_NUMBER: _ClassVar[int]
    ISV_SIZE_FIELD_NUMBER: _ClassVar[int]
    ISV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STEP_ENTROPY_SLOT_FIELD_NUMBER: _ClassVar[int]
    STEP_ENTROPY_ALPHA_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPLAY_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    REPLAY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ALPHA_FIELD_NUMBER: _ClassVar[int]
    REPLAY_BETA_FIELD_NUMBER: _ClassVar[int]
    REPLAY_BETA_STEPS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLAY_MIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLAY_RATIO_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SEED_FIELD_NUMBER: _ClassVar[int]
    hidden_dim: int
    n_actions: int
    optimizer: str
    lr: float
    beta1: float
    beta2: float
    adam_eps: float
    huber_kappa: float
    double_dqn: bool
    max_grad_norm: float
    tau: float
    target_update_period: int
    priority_eps: float
    isv_size: int
    isv_slots: _containers.ScalarMap[str, int]
    step_entropy_slot: str
    step_entropy_alpha: float
    seed: int
    replay_capacity: int
    replay_dtype: str
    replay_alpha: float
    replay_beta: float
    replay_beta_steps: int
    replay_batch_size: int
    replay_min_size: int
    replay_ratio: float
    replay_seed: int
    def __init__(self, hidden_dim: _Optional[int] = ..., n_actions: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., adam_eps: _Optional[float] = ..., huber_kappa: _Optional[float] = ..., double_dqn: _Optional[bool] = ..., max_grad_norm: _Optional[float] = ..., tau: _Optional[float] = ..., target_update_period: _Optional[int] = ..., priority_eps: _Optional[float] = ..., isv_size: _Optional[int] = ..., isv_slots: _Optional[_Mapping[str, int]] = ..., step_entropy_slot: _Optional[str] = ..., step_entropy_alpha: _Optional[float] = ..., seed: _Optional[int] = ..., replay_capacity: _Optional[int] = ..., replay_dtype: _Optional[str] = ..., replay_alpha: _Optional[float] = ..., replay_beta: _Optional[float] = ..., replay_beta_steps: _Optional[int] = ..., replay_batch_size: _Optional[int] = ..., replay_min_size: _Optional[int] = ..., replay_ratio: _Optional[float] = ..., replay_seed: _Optional[int] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("backend", "device", "config_json", "step", "version", "max_message_bytes", "max_batch_size", "max_streams", "server_version", "max_queue", "config")
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
    CONFIG_FIELD_NUMBER: _ClassVar[int]
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
    config: LearnerConfig
    def __init__(self, backend: _Optional[str] = ..., device: _Optional[str] = ..., config_json: _Optional[str] = ..., step: _Optional[int] = ..., version: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_streams: _Optional[int] = ..., server_version: _Optional[str] = ..., max_queue: _Optional[int] = ..., config: _Optional[_Union[LearnerConfig, _Mapping]] = ...) -> None: ...

class InsertStreamRequest(_message.Message):
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

class InsertStreamResponse(_message.Message):
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

class GetReplayInfoResponse(_message.Message):
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

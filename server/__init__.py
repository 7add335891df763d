"""duelq.server: the learner core, its backends and the gRPC service."""

from .batch import Batch
from .config import LearnerConfig
from .errors import InvalidArgument, LearnerError, NonFiniteStep, ResourceExhausted
from .learner import Learner, StepResult
from .state import LearnerState, Params

__all__ = [
    "Batch", "InvalidArgument", "Learner", "LearnerConfig", "LearnerError", "LearnerState",
    "NonFiniteStep", "Params", "ResourceExhausted", "StepResult",
]

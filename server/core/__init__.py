"""duelq.server.core: the learner core: configuration, state, batch checks, the NumPy
reference, the backend interface, the learner, the CUDA backend and checkpoints.  It knows
nothing of gRPC or of how requests reach it."""

from duelq.server.core.batch import Batch
from duelq.server.core.config import LearnerConfig
from duelq.server.core.errors import InvalidArgument, LearnerError, NonFiniteStep, ResourceExhausted
from duelq.server.core.learner import Learner, StepResult
from duelq.server.core.state import LearnerState, Params

__all__ = [
    "Batch", "InvalidArgument", "Learner", "LearnerConfig", "LearnerError", "LearnerState",
    "NonFiniteStep", "Params", "ResourceExhausted", "StepResult",
]

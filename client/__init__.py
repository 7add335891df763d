"""duelq.client: the library remote actors use to talk to a duelq learner.

``Batch`` is the server's own dataclass (duelq.server.batch), re-exported so
that actors and the learner share one definition of a batch and its fields.
"""

from duelq.server.batch import Batch

from . import errors
from .client import (ActResult, EntropyResult, ISVValue, LearnerClient, ServerInfo,
                     TrainResult, Weights, encode_batch)

__all__ = ["ActResult", "Batch", "EntropyResult", "ISVValue", "LearnerClient", "ServerInfo",
           "TrainResult", "Weights", "encode_batch", "errors"]

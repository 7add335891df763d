"""duelq.client: the library remote actors use to talk to a duelq learner.

``Batch`` is the one definition of a batch that actors and the learner share
(``duelq.wire.types``).
"""

from duelq.wire.types import Batch, Transitions

from duelq.client import errors
from duelq.client.client import (ActResult, EntropyResult, InsertResult, ISVValue, LearnerClient,
                     ReplayInfo, ReplayTrainResult, ServerInfo, TrainResult, Weights,
                     encode_batch, tls_credentials)

__all__ = ["ActResult", "Batch", "EntropyResult", "ISVValue", "InsertResult", "LearnerClient",
           "ReplayInfo", "ReplayTrainResult", "ServerInfo", "TrainResult", "Transitions",
           "Weights", "encode_batch", "errors", "tls_credentials"]

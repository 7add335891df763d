"""duelq.client: the library remote actors use to talk to a duelq learner.

``Batch`` is the one definition of a batch that actors and the learner share
(``duelq.wire.types``).
"""

from duelq.wire.types import Batch

from duelq.client import errors
from duelq.client.client import (ActResult, EntropyResult, ISVValue, LearnerClient, ServerInfo,
                     TrainResult, Weights, encode_batch, tls_credentials)

__all__ = ["ActResult", "Batch", "EntropyResult", "ISVValue", "LearnerClient", "ServerInfo",
           "TrainResult", "Weights", "encode_batch", "errors", "tls_credentials"]

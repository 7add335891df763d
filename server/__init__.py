"""duelq.server: the gRPC service and server around the learner core (``duelq.server.core``);
the multi-process front machinery lives in ``duelq.server.fronts``."""

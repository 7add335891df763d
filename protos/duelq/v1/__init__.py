"""duelq.v1: the wire contract (learner.proto) and its generated, committed code."""

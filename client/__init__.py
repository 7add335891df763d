"""duelq.client: the library remote actors use to talk to a duelq learner."""

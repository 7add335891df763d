"""duelq.wire: what the client and the server share: the tensor codec and the batch and
parameter types.  Neither end imports the other."""

"""duelq.server.fronts: gRPC served by several front processes, the learner in one more.

The fronts decode, check and pack train requests into shared memory; the learner process
steps them.  :func:`make_server` picks this model or the one-process server."""

from duelq.server.fronts.front import FrontServer, make_server, start_server

__all__ = ["FrontServer", "make_server", "start_server"]

"""duelq.apps: the ``duelq`` command (serve, health, demo, bench) built from the server and
the client."""

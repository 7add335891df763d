"""What every part of ``duelq bench`` shares: exit codes, errors, wire dtypes, CPU time."""

from __future__ import annotations

import resource


EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
WIRES = ("float32", "float16", "bfloat16")
TRANSPORTS = ("tcp", "uds")
ACTOR_TIMEOUT_S = 120.0              # setup or drain longer than this: the bench stops


class BenchError(Exception):
    """A cell could not be measured."""


class UsageError(ValueError):
    """A bench flag has a value that cannot be used."""


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

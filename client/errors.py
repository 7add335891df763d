"""One exception hierarchy for the client; every grpc.RpcError is translated into it.

Each error keeps the gRPC status ``code`` (for a check made locally before
sending, the code the server would have answered) and the message
``details``.  Where a builtin fits, the class also derives from it
(ValueError, ConnectionError, TimeoutError), so generic handlers keep working.
"""

from __future__ import annotations

import grpc


class DuelqError(Exception):
    """Base of every error the duelq client raises."""

    code: grpc.StatusCode | None = None
    seq: int | None = None
    """Set by ``train_step``: the request's key sequence number, to resend it with."""

    def __init__(self, details: str, *, code: grpc.StatusCode | None = None):
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}" if self.code is not None else self.details


class InvalidArgument(DuelqError, ValueError):
    """An input failed a check, locally or on the server; nothing was applied.

    ``field`` names the offending field ("h_t", "actions", "slot", …).
    """

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, details: str, *, code: grpc.StatusCode | None = None,
                 field: str | None = None):
        super().__init__(details, code=code)
        # The server's messages read "field: problem".
        self.field = field if field is not None else details.split(":", 1)[0].strip()

    @classmethod
    def of(cls, field: str, problem: str) -> "InvalidArgument":
        """A local refusal in the server's "field: problem" form."""
        return cls(f"{field}: {problem}", field=field)


class ResourceExhausted(DuelqError):
    """A server limit was exceeded (batch size, message size, streams, rpcs)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(DuelqError):
    """The step would have made the weights non-finite (refused), checkpoints are off, or
    the server-side replay is off or not yet ready to train."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyApplied(DuelqError):
    """The request's key was applied before and its result is no longer kept."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Unavailable(DuelqError, ConnectionError):
    """The server cannot be reached, is starting, or is shutting down (after retries)."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(DuelqError, TimeoutError):
    """The call did not finish within its timeout."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(DuelqError):
    """The server wants a bearer token and the client's is missing or wrong."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Unimplemented(DuelqError):
    """The server does not offer this rpc (an older server)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Cancelled(DuelqError):
    """The call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class ServerError(DuelqError):
    """INTERNAL, UNKNOWN or DATA_LOSS: a server-side bug; its log has the details."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[DuelqError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyApplied,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: ServerError,
    grpc.StatusCode.UNKNOWN: ServerError,
    grpc.StatusCode.DATA_LOSS: ServerError,
}


def from_rpc_error(error: grpc.RpcError) -> DuelqError:
    """The DuelqError for a failed call, keeping its status code and message."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    return _BY_CODE.get(code, DuelqError)(details, code=code)

"""The learner's errors; the service maps each to one gRPC status code."""

from __future__ import annotations


class LearnerError(Exception):
    """Base of every error the learner raises on purpose."""


class InvalidArgument(LearnerError, ValueError):
    """An input or a setting failed its check; nothing was applied.

    ``field`` names the offending field, ``problem`` says what is wrong with it.
    """

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def check_setting(owner: object, ok: bool, name: str, problem: str) -> None:
    """Refuse ``owner``'s setting ``name`` unless ``ok``: InvalidArgument naming it, its
    value and ``problem`` (a configuration dataclass's check of one field)."""
    if not ok:
        raise InvalidArgument(name, f"{problem} (got {getattr(owner, name)!r})")


class NonFiniteStep(LearnerError, ArithmeticError):
    """A step overflowed (non-finite TD errors, loss, gradient or updated state); it was
    refused, and its message says what overflowed."""


class ResourceExhausted(LearnerError):
    """A limit (batch size, queue depth, concurrent streams…) was exceeded."""


class ReplayNotReady(LearnerError):
    """The replay buffer cannot serve the request now: it is off, or holds too few rows."""


class ReplayTooLarge(LearnerError):
    """The configured replay buffer does not fit the memory it would live in."""

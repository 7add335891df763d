"""Idempotency keys: which (actor_id, seq) were applied, and their responses.

Memory is bounded three ways:

* per actor, the highest seq applied and a bitmap of the ``window`` sequence
  numbers below it (an anti-replay window, as in IPsec); a seq older than the
  window cannot be told apart from an applied one and is refused;
* responses sit in an LRU cache of ``capacity`` entries; each actor's latest
  response is kept outside it, so a client resending its last request after a
  dropped connection always gets its result back;
* at most ``max_actors`` actors are tracked; the least recently seen one is
  forgotten first (a retry from a forgotten actor would be applied again).

Not thread-safe: the service calls it under the lock that applies steps.

:meth:`ReplayGuard.to_bytes` / :meth:`ReplayGuard.from_bytes` carry the records
into a checkpoint and back, so a key applied before a checkpoint stays applied
after a restart from it.  Format 2: ``DQR2``, the length of a JSON index (8 bytes,
little-endian), the index (actors, keys, and each response's message type and
length), then the responses' protobuf bytes back to back; no base64, so at B = 1024
the 1024 cached TrainResponses take 8 MiB instead of 11.  Format 1 (all JSON,
base64 responses; written before) is still read.
"""

from __future__ import annotations

import base64
import json
import struct
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from google.protobuf.message import DecodeError

from duelq.server.core.errors import InvalidArgument, LearnerError

MAX_ACTOR_ID_BYTES = 128
_MAGIC = b"DQR2"
_LENGTH = struct.Struct("<Q")


class AlreadyApplied(LearnerError):
    """The key was applied before and its response is no longer kept."""


@dataclass
class _Actor:
    high: int = 0        # highest seq applied
    seen: int = 0        # bit i set ⇔ seq high − i applied, i < window
    latest: Any = None   # response of seq ``high``


def _of_kind(response: Any, kind: type) -> bool:
    """Whether a recorded response is a ``kind``: an instance, or another object that says
    it encodes that message (its ``DESCRIPTOR``, as service.EncodedTrainResponse)."""
    return isinstance(response, kind) or (
        getattr(response, "DESCRIPTOR", None) is getattr(kind, "DESCRIPTOR", False))


def _name(response: Any) -> str:
    """The name of a recorded response's message."""
    descriptor = getattr(response, "DESCRIPTOR", None)
    return descriptor.name if descriptor is not None else type(response).__name__


class ReplayGuard:
    """Applied keys and recorded responses, in bounded memory."""

    def __init__(self, *, capacity: int = 1024, window: int = 1024, max_actors: int = 4096):
        if capacity < 0 or window < 1 or max_actors < 1:
            raise InvalidArgument("replay_cache", "capacity must be ≥ 0, window and "
                                  "max_actors ≥ 1")
        self.capacity, self.window, self.max_actors = capacity, window, max_actors
        self._actors: OrderedDict[str, _Actor] = OrderedDict()
        self._responses: OrderedDict[tuple[str, int], Any] = OrderedDict()

    @staticmethod
    def check_key(actor_id: str, seq: int) -> None:
        """Refuse malformed keys (an empty actor_id means no key)."""
        if len(actor_id.encode()) > MAX_ACTOR_ID_BYTES:
            raise InvalidArgument("key.actor_id", f"is longer than {MAX_ACTOR_ID_BYTES} bytes")
        if actor_id and seq < 1:
            raise InvalidArgument("key.seq", "must be ≥ 1 when key.actor_id is set")

    def high(self, actor_id: str) -> int:
        """The highest seq applied for ``actor_id`` (0: none known): a higher one is new."""
        actor = self._actors.get(actor_id)
        return 0 if actor is None else actor.high

    def lookup(self, actor_id: str, seq: int, kind: type) -> Any | None:
        """The recorded response of an applied key, or None when the key is new.

        Raises AlreadyApplied when the key was applied (or is too old to tell)
        but its response is gone, InvalidArgument when the key was used by a
        request of another kind.
        """
        actor = self._actors.get(actor_id)
        if actor is None or seq > actor.high:
            return None
        self._actors.move_to_end(actor_id)
        age = actor.high - seq
        if age >= self.window:
            raise AlreadyApplied(f"key {actor_id}/{seq} is older than the last {self.window} "
                                 f"sequence numbers of its actor (highest {actor.high}); "
                                 f"refusing to risk applying it twice")
        if not actor.seen >> age & 1:
            return None
        response = actor.latest if age == 0 else self._responses.get((actor_id, seq))
        if response is None:
            raise AlreadyApplied(f"key {actor_id}/{seq} was applied, but its recorded "
                                 f"response is no longer kept")
        if not _of_kind(response, kind):
            raise InvalidArgument("key.seq", f"{seq} of actor {actor_id!r} was already used "
                                  f"by a {_name(response)}")
        if age != 0:
            self._responses.move_to_end((actor_id, seq))
        return response

    def record(self, actor_id: str, seq: int, response: Any) -> None:
        """Mark a key applied and keep its response."""
        actor = self._actors.get(actor_id)
        if actor is None:
            actor = self._actors[actor_id] = _Actor()
            if len(self._actors) > self.max_actors:
                self._forget(next(iter(self._actors)))
        self._actors.move_to_end(actor_id)
        if seq > actor.high:
            if actor.latest is not None:
                self._keep((actor_id, actor.high), actor.latest)
            shift = seq - actor.high
            actor.seen = (actor.seen << shift | 1) & ((1 << self.window) - 1) \
                if shift < self.window else 1
            actor.high, actor.latest = seq, response
        else:
            actor.seen |= 1 << (actor.high - seq)
            self._keep((actor_id, seq), response)

    def copy(self) -> "ReplayGuard":
        """A copy that shares the recorded responses (never mutated once recorded)."""
        other = ReplayGuard(capacity=self.capacity, window=self.window,
                            max_actors=self.max_actors)
        other._actors = OrderedDict((a, replace(rec)) for a, rec in self._actors.items())
        other._responses = OrderedDict(self._responses)
        return other

    def to_bytes(self) -> bytes:
        """Every record, LRU order kept (format 2); responses must be protobuf messages
        (or encoded ones: SerializeToString and DESCRIPTOR)."""
        blobs: list[bytes] = []
        kinds: list[list] = []

        def ref(response: Any) -> int | None:  # the response's blob number
            if response is None:
                return None
            blobs.append(response.SerializeToString())
            kinds.append([_name(response), len(blobs[-1])])
            return len(blobs) - 1

        index = json.dumps({
            "format": 2, "window": self.window,
            "actors": [[a, rec.high, format(rec.seen, "x"), ref(rec.latest)]
                       for a, rec in self._actors.items()],
            "responses": [[a, seq, ref(r)] for (a, seq), r in self._responses.items()],
            "blobs": kinds,
        }, separators=(",", ":")).encode()
        return b"".join([_MAGIC, _LENGTH.pack(len(index)), index, *blobs])

    @classmethod
    def from_bytes(cls, data: bytes, kinds: Mapping[str, type], *, capacity: int = 1024,
                   max_actors: int = 4096) -> "ReplayGuard":
        """Records written by :meth:`to_bytes` (format 2, or format 1 from earlier
        versions); ``kinds`` maps message names to classes.

        The stored window is kept (a wider one would forget applied keys); the
        response cache is trimmed to ``capacity``.  Raises ValueError when
        ``data`` is malformed.
        """
        try:
            doc, message = cls._parse(bytes(data), kinds)
            guard = cls(capacity=capacity, window=int(doc["window"]), max_actors=max_actors)
            for actor_id, high, seen, latest in doc["actors"]:
                if not isinstance(actor_id, str) or not isinstance(high, int) or high < 0:
                    raise ValueError(f"bad actor record {actor_id!r}/{high!r}")
                guard._actors[actor_id] = _Actor(high, int(seen, 16) & ((1 << guard.window) - 1),
                                                 message(latest))
            for actor_id, seq, response in doc["responses"]:
                guard._keep((str(actor_id), int(seq)), message(response))
        except (KeyError, IndexError, TypeError, ValueError, DecodeError, struct.error) as exc:
            raise ValueError(f"malformed idempotency records: {exc!r}") from exc
        while len(guard._actors) > guard.max_actors:
            guard._forget(next(iter(guard._actors)))
        return guard

    @staticmethod
    def _parse(data: bytes, kinds: Mapping[str, type]) -> tuple[dict, Callable[[Any], Any]]:
        """(the record index, a function from a response reference to the message)."""
        if not data.startswith(_MAGIC):  # format 1: one JSON document, base64 responses
            doc = json.loads(data)
            if doc["format"] != 1:
                raise ValueError(f"format {doc['format']!r}, expected 1 or 2")

            def inline(item: Any) -> Any:
                if item is None:
                    return None
                name, text = item
                return kinds[name].FromString(base64.b64decode(text, validate=True))
            return doc, inline
        start = len(_MAGIC) + _LENGTH.size
        (length,) = _LENGTH.unpack_from(data, len(_MAGIC))
        doc = json.loads(data[start:start + length])
        if doc["format"] != 2:
            raise ValueError(f"format {doc['format']!r} after the format-2 magic")
        offsets, at = [], start + length
        for name, size in doc["blobs"]:
            if not isinstance(size, int) or size < 0:
                raise ValueError(f"bad blob length {size!r}")
            offsets.append((kinds[name], at, at + size))
            at += size
        if at != len(data):
            raise ValueError(f"{len(data) - at} bytes after the last response")

        def stored(item: Any) -> Any:
            if item is None:
                return None
            kind, begin, end = offsets[item]
            return kind.FromString(data[begin:end])
        return doc, stored

    def _keep(self, key: tuple[str, int], response: Any) -> None:
        if self.capacity == 0:
            return
        self._responses[key] = response
        self._responses.move_to_end(key)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def _forget(self, actor_id: str) -> None:
        del self._actors[actor_id]
        for key in [k for k in self._responses if k[0] == actor_id]:
            del self._responses[key]
